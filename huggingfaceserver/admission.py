"""Admission control: how many requests the server holds at once, in flight plus queued.

Beyond the limit a request is refused at the door (429) before it is parsed, so memory stays
bounded whatever the offered load. With front processes before an engine the count is kept
once for the whole server: the fronts share one counter in a file the supervisor creates
(:class:`FileSlots`).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
from typing import Protocol


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
    """A counter of taken slots shared by processes: 8 bytes of a file in the server's private
    folder, mapped into each of them, changed under an exclusive ``flock`` (two system calls,
    some microseconds). Unlike a ``multiprocessing`` semaphore it needs no resource tracker,
    which reports and unlinks named semaphores when a process dies."""

    COUNT = struct.Struct("q")

    def __init__(self, path: str, limit: int):
        self.limit = limit
        self.fd = os.open(path, os.O_RDWR)
        self.map = mmap.mmap(self.fd, self.COUNT.size)

    @classmethod
    def create(cls, path: str) -> str:
        """The counter's file, at zero; give its path to the processes that share it."""
        with open(path, "wb") as file:
            file.write(bytes(cls.COUNT.size))
        return path

    def _add(self, delta: int) -> bool:
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            (taken,) = self.COUNT.unpack_from(self.map)
            if delta > 0 and taken >= self.limit:
                return False
            self.COUNT.pack_into(self.map, 0, taken + delta)
            return True
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def acquire(self, block: bool = True, timeout: float | None = None) -> bool:
        assert not block, "admission never waits"
        return self._add(1)

    def release(self) -> None:
        self._add(-1)

    def taken(self) -> int:
        (taken,) = self.COUNT.unpack_from(self.map)
        return int(taken)
