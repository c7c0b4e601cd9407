"""Admission control: how many requests the server holds at once, in flight plus queued.

Beyond the limit a request is refused at the door (429) before it is parsed, so memory stays
bounded whatever the offered load. With front processes before an engine the count is kept
once for the whole server: the fronts share one counter in a file the supervisor creates
(:class:`FileSlots`, on a :class:`~huggingfaceserver.edge.shared_count.SharedCount`).
"""

from __future__ import annotations

from typing import Protocol

from .shared_count import SharedCount


class SharedSlots(Protocol):
    """What a ``multiprocessing`` semaphore offers (shared by the front processes)."""

    def acquire(self, block: bool = True, timeout: float | None = None) -> bool: ...

    def release(self) -> None: ...


class Admission:
    """``limit`` slots; :meth:`try_enter` takes one or says no at once, :meth:`leave` gives it
    back. ``shared``: slots counted across processes (then ``limit`` is the semaphore's)."""

    def __init__(self, limit: int, shared: SharedSlots | None = None):
        self.limit = limit
        self.shared = shared
        self.held = 0
        """Slots this process holds now."""

    def try_enter(self) -> bool:
        if self.shared is not None:
            if not self.shared.acquire(block=False):
                return False
        elif self.held >= self.limit:
            return False
        self.held += 1
        return True

    def refusal(self) -> str:
        """What a request refused for want of a slot is told (HTTP 429, gRPC
        ``RESOURCE_EXHAUSTED``)."""
        return (
            f"the server is at its limit of {self.limit} concurrent requests "
            "(--max_concurrent_requests); retry later"
        )

    def leave(self) -> None:
        self.held -= 1
        if self.shared is not None:
            self.shared.release()


class FileSlots:
    """Slots counted once for the whole server, in a :class:`SharedCount` the fronts share."""

    def __init__(self, path: str, limit: int):
        self.limit = limit
        self.count = SharedCount(path)

    @staticmethod
    def create(path: str) -> str:
        return SharedCount.create(path)

    def acquire(self, block: bool = True, timeout: float | None = None) -> bool:
        assert not block, "admission never waits"
        return self.count.add(1, self.limit)

    def release(self) -> None:
        self.count.add(-1)

    def taken(self) -> int:
        return self.count.value()
