"""Which served model an OpenAI request names, and the model list / card routes."""

from __future__ import annotations

import time
from typing import Any, TypeVar

from kserve.model_repository import ModelRepository

from ...backends.base import EncoderBackend, GenerationBackend
from ...errors import BadRequest, NotFound, NotReady
from ..kserve_model import BackendModel, GenerationModel

B = TypeVar("B", EncoderBackend, GenerationBackend)

KIND_NAMES = {EncoderBackend: "an encoder", GenerationBackend: "a text generation"}


class ServedModels:
    """The models registered with KServe, seen from the OpenAI routes."""

    def __init__(self, registry: ModelRepository):
        self.registry = registry
        self.created = int(time.time())

    def get(self, name: str | None) -> BackendModel:
        """The ready model called ``name``: 404 if there is none, 503 while it loads."""
        models = self.registry.get_models()
        if name is None and len(models) == 1:
            name = next(iter(models))
        model = models.get(name) if name is not None else None
        if not isinstance(model, BackendModel):
            raise NotFound(f"The model `{name}` does not exist.")
        if not model.ready:
            raise NotReady(f"The model `{name}` is still loading.")
        return model

    def backend(self, name: str | None, kind: type[B], route: str) -> B:
        """The model's backend, which must be of ``kind`` for ``route`` (else a 400)."""
        model = self.get(name)
        if not isinstance(model.backend, kind):
            raise BadRequest(
                f"{route} needs {KIND_NAMES[kind]} model; `{model.name}` is a "
                f"{model.task.value} model"
            )
        return model.backend

    def card(self, name: str) -> dict[str, Any]:
        """An OpenAI model object."""
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "huggingfaceserver",
        }

    def listing(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.card(n) for n in self.registry.get_models()]}


def resolve_generation(
    models: ServedModels, name: str | None, route: str
) -> tuple[GenerationModel, GenerationBackend, str | None]:
    """The model, its backend, and the LoRA adapter when ``name`` is an adapter's name."""
    model = models.get(name)
    backend = models.backend(model.name, GenerationBackend, route)  # type: ignore[type-abstract]
    assert isinstance(model, GenerationModel)
    adapter = name if name is not None and name != model.name else None
    return model, backend, adapter
