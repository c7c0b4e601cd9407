"""The lifecycle every vLLM backend shares: start the engine, watch it, shut it down."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
from typing import Any

from vllm import AsyncEngineArgs

from ...errors import EngineDied, StartupError
from . import compat

logger = logging.getLogger(__name__)

ENGINE_DIED = (
    "the vLLM engine died (its own log, above, says why); where vLLM cannot run this model on "
    "this machine, --backend huggingface runs it on transformers"
)
"""What a request waiting on a dead engine fails with (a 503), and the server's last line when
that request was the warm-up inference."""
HEALTH_INTERVAL_S = 5.0
RPC_ENV = "VLLM_RPC_BASE_PATH"
MAX_IPC_DIR_LEN = 107 - 1 - 36


def make_ipc_dir(base: str | None) -> str:
    """A fresh folder for vLLM's IPC sockets, in ``base`` when the socket paths (a folder, "/",
    and a 36-character id) stay within the 107 characters a Unix socket path may have."""
    path = tempfile.mkdtemp(prefix="hf-", dir=base)
    if len(path) <= MAX_IPC_DIR_LEN:
        return path
    os.rmdir(path)
    logger.warning("%s=%s is too long for socket paths; using the temp folder", RPC_ENV, base)
    return tempfile.mkdtemp(prefix="hf-")


class EngineHolder:
    """Owns one vLLM async engine (its core runs in child processes)."""

    engine_args: AsyncEngineArgs
    engine: Any = None
    ipc_dir: str | None = None

    def start_engine(self) -> None:
        """Blocking, and meant for a worker thread: the engine then starts its output handler
        lazily on the serving event loop, at the first request.

        vLLM leaves its IPC sockets behind when it shuts down, so they go in a folder of our
        own (inside ``VLLM_RPC_BASE_PATH`` when set), removed at shutdown.
        """
        logger.info("starting the vLLM %s engine", compat.VERSION)
        self.ipc_dir = make_ipc_dir(os.environ.get(RPC_ENV))
        os.environ[RPC_ENV] = self.ipc_dir
        try:
            self.engine = compat.AsyncEngine.from_engine_args(self.engine_args)
        except Exception as exc:  # vLLM fails to start in many ways: all are startup errors
            self.remove_ipc_dir()
            first_line = (str(exc) or type(exc).__name__).splitlines()[0]
            raise StartupError(f"the vLLM engine did not start: {first_line}") from None

    def remove_ipc_dir(self) -> None:
        if self.ipc_dir is not None:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
            self.ipc_dir = None

    def shutdown(self) -> None:
        if self.engine is not None:
            engine, self.engine = self.engine, None
            engine.shutdown()
        self.remove_ipc_dir()

    async def watch(self) -> None:
        """Return only when the engine has died, so that the server exits and is restarted."""
        while True:
            await asyncio.sleep(HEALTH_INTERVAL_S)
            if self.engine is None:  # shut down on purpose
                return
            try:
                await self.engine.check_health()
            except Exception as exc:  # whatever the health check raises, the engine is gone
                raise EngineDied(f"the vLLM engine died: {exc}") from None
