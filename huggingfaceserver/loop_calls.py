"""Calls onto an event loop from other threads, many per wake-up.

``loop.call_soon_threadsafe`` writes to the loop's self-pipe on every call; a batch that
settles sixteen requests would wake the loop sixteen times. :class:`LoopCalls` queues the calls
and wakes the loop once for all those queued before it runs them.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable
from contextlib import suppress
from typing import Any

_per_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopCalls] = (
    weakref.WeakKeyDictionary()
)
_per_loop_lock = threading.Lock()


class LoopCalls:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.lock = threading.Lock()
        self.calls: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        self.scheduled = False

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> LoopCalls:
        """The one instance for ``loop``."""
        with _per_loop_lock:
            calls = _per_loop.get(loop)
            if calls is None:
                calls = _per_loop[loop] = cls(loop)
            return calls

    def call(self, function: Callable[..., Any], *args: Any) -> None:
        """Run ``function(*args)`` on the loop soon (from any thread)."""
        with self.lock:
            self.calls.append((function, args))
            if self.scheduled:
                return
            self.scheduled = True
        with suppress(RuntimeError):  # the loop is closed: nobody waits any more
            self.loop.call_soon_threadsafe(self._run)

    def _run(self) -> None:
        with self.lock:
            calls, self.calls = self.calls, []
            self.scheduled = False
        for function, args in calls:
            function(*args)
