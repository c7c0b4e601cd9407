"""The lifecycle every vLLM backend shares: start the engine, watch it, shut it down."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from vllm import AsyncEngineArgs

from ...errors import StartupError
from . import compat

logger = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 5.0


class EngineHolder:
    """Owns one vLLM async engine (its core runs in child processes)."""

    engine_args: AsyncEngineArgs
    engine: Any = None

    def start_engine(self) -> None:
        """Blocking, and meant for a worker thread: the engine then starts its output handler
        lazily on the serving event loop, at the first request."""
        logger.info("starting the vLLM %s engine", compat.VERSION)
        try:
            self.engine = compat.AsyncEngine.from_engine_args(self.engine_args)
        except (RuntimeError, ValueError, OSError) as exc:
            raise StartupError(f"the vLLM engine did not start: {exc}") from None

    def shutdown(self) -> None:
        if self.engine is not None:
            engine, self.engine = self.engine, None
            engine.shutdown()

    async def watch(self) -> None:
        """Return only when the engine has died, so that the server exits and is restarted."""
        while True:
            await asyncio.sleep(HEALTH_INTERVAL_S)
            if self.engine is None:  # shut down on purpose
                return
            try:
                await self.engine.check_health()
            except Exception as exc:  # whatever the health check raises, the engine is gone
                raise StartupError(f"the vLLM engine died: {exc}") from None
