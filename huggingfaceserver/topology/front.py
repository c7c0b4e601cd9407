"""A front process's work: HTTP and gRPC on the shared ports, the model in the engine process.

Its imports (kserve, FastAPI, grpc, tokenizers, the edge and the protocols: about 1.5 s of a
core) are what a front costs to start. The supervisor starts fronts from multiprocessing's fork
server with this module preloaded (:data:`~.supervisor.FRONT_PRELOAD`): the fork server imports
it once, beside the engine's own imports, and each front is a fork of it, up in a fraction of a
second and sharing the imported modules' pages with its siblings. Nothing here imports torch.
"""

from __future__ import annotations

from ..assembly import model_around
from ..cli import ServerConfig
from ..edge.admission import FileSlots
from ..edge.gateway import ReadyFronts
from ..edge.serving import serve_model
from ..loading import load_source
from .engine.backend import engine_backend
from .engine.client import EngineClient


def serve_front(
    config: ServerConfig, address: str, index: int, fronts: int, slots: str, ready: str
) -> None:
    """Front ``index`` of ``fronts``: connect to the engine at ``address``, serve until
    SIGTERM. ``slots`` and ``ready`` name the admission slots and the count of ready fronts
    that every front shares."""
    client = EngineClient(address, index, fronts)
    source = load_source(config, read_config=False)  # the engine reads transformers' config
    model = model_around(config, source, engine_backend(source, config, client))
    serve_model(
        model,
        config,
        shared_port=True,
        admission_slots=FileSlots(slots, config.max_concurrent_requests),
        ready_fronts=ReadyFronts(ready, fronts),
    )
