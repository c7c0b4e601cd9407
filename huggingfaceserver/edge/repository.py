"""KServe's model repository extension (``/v2/repository/...`` and its gRPC methods) for a
server that serves the one model it loaded at start.

The routes are off unless ``--enable_model_repository``: one unauthenticated ``unload`` would
otherwise take the model down for good. When on (and behind the API key, like every model
route), ``unload`` stops the model and frees its backend, and ``load`` builds and loads it again
(a no-op when it is loaded), answering once it is ready.

An unload returns the model's memory: the backend's threads end (requests they had not run
get a 503), nothing keeps the model any more, and :func:`return_freed_memory` collects it and
hands the freed heap back to the OS.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Awaitable, Callable

from kserve.errors import ModelNotFound
from kserve.model_repository import ModelRepository
from kserve.protocol.model_repository_extension import ModelRepositoryExtension

from ..errors import NotReady
from ..heap import trim_heap
from ..protocols.kserve_model import BackendModel

logger = logging.getLogger(__name__)

REPOSITORY_PATH = "/v2/repository/"
REPOSITORY_GRPC_METHODS = frozenset({"RepositoryModelLoad", "RepositoryModelUnload"})
DISABLED = "the model repository routes are off: start the server with --enable_model_repository"


class SingleModelRepository(ModelRepositoryExtension):
    """Load and unload for the served model (and the names it is registered under)."""

    def __init__(
        self,
        registry: ModelRepository,
        name: str,
        build: Callable[[], BackendModel],
        start: Callable[[BackendModel], Awaitable[None]],
        forget: Callable[[BackendModel], None],
    ):
        super().__init__(model_registry=registry)
        self.registry = registry
        self.name = name
        self.build = build
        self.start = start
        self.lock = asyncio.Lock()
        self.forget = forget
        """Told of a model unloaded on request (its backend's end is then no failure)."""

    def check_name(self, name: str) -> None:
        if name != self.name:
            raise ModelNotFound(name)

    async def load(self, model_name: str) -> None:
        self.check_name(model_name)
        async with self.lock:
            if self.registry.get_model(model_name) is not None:
                return
            model = self.build()
            self.registry.update(model)
            logger.info("model %s: loading again (repository load)", model_name)
            await self.start(model)
            if not model.ready:
                self.registry.get_models().pop(model_name, None)
                raise NotReady(f"model {model_name} failed to load")

    async def unload(self, model_name: str) -> None:
        self.check_name(model_name)
        async with self.lock:
            model = self.registry.get_model(model_name)
            if model is None:
                raise ModelNotFound(model_name)
            logger.info("model %s: unloading (repository unload)", model_name)
            models = self.registry.get_models()
            for name in [n for n, m in models.items() if m is model]:  # adapters' names too
                del models[name]
            self.forget(model)
            await asyncio.to_thread(model.stop)
            del model  # the last reference but those of requests still answering their 503
            await asyncio.to_thread(return_freed_memory)


def return_freed_memory() -> None:
    """Collect what an unloaded model leaves, and return it to the OS. The server freezes its
    heap once the model is loaded (:func:`~.loading.freeze_loaded_heap`), and a frozen object
    is never collected: the model's reference cycles would stay. Thaw, collect, freeze what
    lives on again, then trim the C heap (:func:`malloc_trim`)."""
    frozen = gc.get_freeze_count() > 0
    gc.unfreeze()
    gc.collect()
    if frozen:
        gc.freeze()
    trim_heap()
