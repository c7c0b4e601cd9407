"""Serves the model a :class:`ServerConfig` names: in this process, or as one engine process
behind front processes (:mod:`.topology`), as the layout chosen for the pod says."""

from __future__ import annotations

import logging

from .assembly import build_model, check_choice, locate
from .cli import REPOSITORY_NEEDS_ONE_PROCESS, ServerConfig
from .edge.open_files import raise_open_files_limit
from .edge.serving import serve_model
from .errors import StartupError
from .pod import read_pod_limits
from .topology.cuda_probe import cuda_available
from .topology.layout import choose_layout, engine_bytes
from .topology.supervisor import run_processes

logger = logging.getLogger(__name__)


def serve(config: ServerConfig) -> None:
    """Serve until stopped, in one process or as an engine behind front processes.
    Startup problems raise :class:`StartupError`."""
    raise_open_files_limit()  # before any child process: they inherit it
    source, choice = locate(config, read_config=False)
    check_choice(config, choice)
    layout = choose_layout(
        config.api_workers,
        choice.name,
        remote=bool(config.server.predictor_host) and not source.task.is_generative,
        # only auto asks (torch tells, in a child process: the supervisor never imports it)
        cuda=config.api_workers is None and cuda_available(),
        pod=read_pod_limits(),
        engine=engine_bytes(source.path),
    )
    if not layout.fits_memory:
        logger.warning("the layout may not fit in the pod's memory: %s", layout.reason)
    if layout.split and config.enable_model_repository:
        # the fronts --api_workers auto starts on a CUDA device (an explicit count: parsing)
        raise StartupError(REPOSITORY_NEEDS_ONE_PROCESS)
    if layout.split:
        logger.info(
            "%d front processes before one engine process (%s)", layout.api_workers, layout.reason
        )
        run_processes(config, layout.api_workers)
        return
    logger.info("one process (%s)", layout.reason)
    source.read_config()
    serve_model(build_model(config, (source, choice)), config, rebuild=lambda: build_model(config))
