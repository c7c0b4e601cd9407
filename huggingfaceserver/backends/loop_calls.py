"""Calls onto an event loop from other threads, many per wake-up.

``loop.call_soon_threadsafe`` writes to the loop's self-pipe on every call: a batch that
settles sixteen requests would wake the loop sixteen times, each wake a system call that
hands the GIL over. :class:`LoopCalls` queues the calls and wakes the loop once for all those
queued before it runs them; inside :func:`deferred` (a batch settling its requests, a decode
step emitting its deltas) the wake waits until the block ends.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

_per_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopCalls] = (
    weakref.WeakKeyDictionary()
)
_per_loop_lock = threading.Lock()
_deferring = threading.local()


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
        waiting: set[LoopCalls] | None = getattr(_deferring, "loops", None)
        if waiting is not None:
            waiting.add(self)
        else:
            self._wake()

    def _wake(self) -> None:
        with suppress(RuntimeError):  # the loop is closed: nobody waits any more
            self.loop.call_soon_threadsafe(self._run)

    def _run(self) -> None:
        with self.lock:
            calls, self.calls = self.calls, []
            self.scheduled = False
        for function, args in calls:
            function(*args)


@contextmanager
def deferred() -> Iterator[None]:
    """Calls made in this thread inside the block wake their loops once, at its end."""
    if getattr(_deferring, "loops", None) is not None:  # nested: the outer block wakes
        yield
        return
    _deferring.loops = set()
    try:
        yield
    finally:
        loops, _deferring.loops = _deferring.loops, None
        for calls in loops:
            calls._wake()
