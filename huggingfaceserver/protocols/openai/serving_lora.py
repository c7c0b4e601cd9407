"""LoRA adapters loaded and unloaded at run time: vLLM's ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``, their request shapes and answers. Off unless
``--enable_runtime_lora`` (then a 404, as vLLM without ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``);
behind the API key like every route; paths only inside ``--lora_adapter_dir``. A loaded adapter
is a model name of its own, as one named by ``--lora-modules``."""

from __future__ import annotations

import logging

from fastapi import Response
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from ...backends.base import GenerationBackend
from ...errors import NotFound
from ..kserve_model import BackendModel
from .models import ServedModels

logger = logging.getLogger(__name__)


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's body: the adapter's name (its model name from then on) and its folder."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str
    load_inplace: bool = False
    """vLLM's: replace an adapter already loaded under this name (unloaded first: a 409 while
    requests use it)."""


class UnloadLoraAdapterRequest(BaseModel):
    """vLLM's body: the adapter's name (``lora_int_id``, vLLM's own number, is not needed)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None


def served(models: ServedModels, route: str) -> tuple[BackendModel, GenerationBackend]:
    """The one model served (its adapters are more names of it), and its backend, which must
    generate."""
    registered = models.registry.get_models().values()
    distinct = list({id(m): m for m in registered if isinstance(m, BackendModel)}.values())
    if len(distinct) != 1:
        raise NotFound(f"{route} needs one model served; {len(distinct)} are")
    model = models.get(distinct[0].name)
    return model, models.backend(model.name, GenerationBackend, route)  # type: ignore[type-abstract]


async def load_lora_adapter(models: ServedModels, body: LoadLoraAdapterRequest) -> Response:
    model, backend = served(models, "/v1/load_lora_adapter")
    if body.load_inplace and body.lora_name in backend.adapters:
        await backend.unload_adapter(body.lora_name)
        models.registry.get_models().pop(body.lora_name, None)
    await backend.load_adapter(body.lora_name, body.lora_path)
    models.registry.update(model, body.lora_name)
    logger.info("LoRA adapter %s loaded at run time: a model of its own", body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(models: ServedModels, body: UnloadLoraAdapterRequest) -> Response:
    _, backend = served(models, "/v1/unload_lora_adapter")
    await backend.unload_adapter(body.lora_name)
    models.registry.get_models().pop(body.lora_name, None)
    logger.info("LoRA adapter %s unloaded", body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
