"""torch's intra-op threads on CPU, kept only where they make the model's forward faster:
timed at load on the thread that runs every forward (OpenMP keeps a team per calling thread)."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

CALIBRATION_SHAPE = (8, 32)
"""Rows and tokens of the batch that times the forward pass at load."""
MIN_THREAD_SPEEDUP = 1.3
"""On CPU, torch's intra-op threads are kept only if they make that forward this much faster."""
CALIBRATION_ROUNDS = 3
"""At most this many timings of the forward pass on each thread count (the fastest counts)."""
MIN_CALIBRATION_ROUNDS = 2
"""At least this many: one timing disturbed by other work on the machine (seen: 103 ms on 2
threads for a forward that takes 50-65 ms) must not decide alone."""
CLEAR_MARGIN = 1.15
"""Calibration stops after :data:`MIN_CALIBRATION_ROUNDS` once the speedup is this factor or
more away from :data:`MIN_THREAD_SPEEDUP`, either way: more rounds would not change it."""


@dataclass
class ThreadTimings:
    """The fastest forward seen on all of torch's threads and on one."""

    many: float = math.inf
    one: float = math.inf

    @property
    def speedup(self) -> float:
        return self.one / self.many

    def clear(self) -> bool:
        """Whether the decision can no longer change with more rounds."""
        margin = self.speedup / MIN_THREAD_SPEEDUP
        return margin >= CLEAR_MARGIN or margin <= 1 / CLEAR_MARGIN


def time_thread_counts(
    forward: Callable[[], object],
    threads: int,
    set_threads: Callable[[int], None] = torch.set_num_threads,
    clock: Callable[[], float] = time.perf_counter,
) -> ThreadTimings:
    """Time ``forward`` on ``threads`` and on one, alternately (drift on a shared machine
    slows both alike), after one warm-up (first calls allocate and pick kernels). Stops once
    the decision is clear (for MiniLM after two rounds: 5 forwards, where timing each count
    three times after its own warm-up took 8). Leaves one thread set."""
    timings = ThreadTimings()

    def timed() -> float:
        start = clock()
        forward()
        return clock() - start

    set_threads(threads)
    timed()
    for done in range(1, CALIBRATION_ROUNDS + 1):
        set_threads(threads)
        timings.many = min(timings.many, timed())
        set_threads(1)
        timings.one = min(timings.one, timed())
        if done >= MIN_CALIBRATION_ROUNDS and timings.clear():
            break
    return timings


def most_calibration_forwards() -> int:
    """The forward passes :func:`time_thread_counts` makes at most (a warm-up, then a timing on
    each thread count per round)."""
    return 1 + 2 * CALIBRATION_ROUNDS


def calibrate_cpu_threads(forward: Callable[[], object]) -> str:
    """Keep torch's intra-op threads only where they pay: for a small model they barely speed a
    forward up while their OpenMP workers spin between operations, a core busy for nothing
    that the HTTP side needs. Leaves the setting alone when ``OMP_NUM_THREADS`` is set or there
    is one core. Returns what was decided, for the log."""
    threads = torch.get_num_threads()
    if "OMP_NUM_THREADS" in os.environ or threads < 2:
        return f"{threads} (OMP_NUM_THREADS or one core)"
    timings = time_thread_counts(forward, threads)
    timing = f"{timings.one * 1000:.1f} ms on 1 thread, {timings.many * 1000:.1f} ms on {threads}"
    if timings.speedup >= MIN_THREAD_SPEEDUP:
        torch.set_num_threads(threads)
        return f"{threads} ({timing})"
    return f"1 ({timing}: more threads would spin for little)"
