"""Calls run on a worker thread for other threads, each waited for by its caller.

torch's CPU threads must be set on the thread that runs the forward passes (OpenMP keeps a team
of threads per calling thread, and a second team makes libgomp cut its workers' spin-waits
short, which slowed every small forward pass down by half): the encoder batcher's worker and
the decode loop both take such calls between batches, through this queue.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class WorkerCalls:
    """A queue of calls for one worker thread. Callers add under the worker's lock (and wake
    it); the worker runs them between batches; when it stops, the calls left fail."""

    def __init__(self) -> None:
        self.queue: deque[tuple[Callable[[], Any], Future[Any]]] = deque()

    def __bool__(self) -> bool:
        return bool(self.queue)

    def add(self, function: Callable[[], T]) -> Future[T]:
        """Queue ``function``; its result (or exception) arrives in the future returned."""
        done: Future[T] = Future()
        self.queue.append((function, done))
        return done

    def run(self) -> None:
        """On the worker: run every queued call, each result handed to its caller."""
        while self.queue:
            function, done = self.queue.popleft()
            try:
                done.set_result(function())
            except BaseException as exc:  # handed to the caller
                done.set_exception(exc)

    def fail(self, error: BaseException) -> None:
        """On the worker as it stops: every call not run fails with ``error``."""
        while self.queue:
            _, done = self.queue.popleft()
            done.set_exception(error)
