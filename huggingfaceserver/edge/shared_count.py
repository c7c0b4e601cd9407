"""A counter shared by the server's processes: 8 bytes of a file in the server's private folder,
mapped into each of them, changed under an exclusive ``flock`` (two system calls, some
microseconds). Unlike a ``multiprocessing`` semaphore or value it needs no resource tracker,
which reports and unlinks named semaphores when a process dies, and it is passed to a spawned
child as a plain path.

The fronts count with it what must be counted once for the whole server: the requests admitted
(:class:`~huggingfaceserver.edge.admission.FileSlots`) and the fronts whose model is ready
(:class:`~huggingfaceserver.edge.gateway.ReadyFronts`).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct


class SharedCount:
    COUNT = struct.Struct("q")

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_RDWR)
        self.map = mmap.mmap(self.fd, self.COUNT.size)

    @classmethod
    def create(cls, path: str) -> str:
        """The counter's file, at zero; give its path to the processes that share it."""
        with open(path, "wb") as file:
            file.write(bytes(cls.COUNT.size))
        return path

    def add(self, delta: int, limit: int | None = None) -> bool:
        """Add ``delta``, unless it is positive and the count is at ``limit`` already."""
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            (count,) = self.COUNT.unpack_from(self.map)
            if delta > 0 and limit is not None and count >= limit:
                return False
            self.COUNT.pack_into(self.map, 0, count + delta)
            return True
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def value(self) -> int:
        (count,) = self.COUNT.unpack_from(self.map)
        return int(count)
