"""torch's intra-op threads on CPU, kept only where they make the model's forward faster:
timed at load on the thread that runs every forward (OpenMP keeps a team per calling thread),
and for a generation model's decode steps and prefills timed again while it serves
(:class:`TunedLoopThreads`): whether a second thread pays depends on the forward's size and on
what else the machine's cores are doing, neither of which a load-time timing sees."""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from ...pod import threads_within

logger = logging.getLogger(__name__)

T = TypeVar("T")

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

    @property
    def pays(self) -> bool:
        """Whether all threads are worth their spinning: :data:`MIN_THREAD_SPEEDUP` or more."""
        return self.speedup >= MIN_THREAD_SPEEDUP

    def describe(self, threads: int) -> str:
        return f"{self.one * 1000:.1f} ms on 1 thread, {self.many * 1000:.1f} ms on {threads}"

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


@dataclass(frozen=True)
class ThreadDecision:
    """What the calibration kept: ``threads`` of the ``most`` torch would use; ``tuned`` when
    it chose (not fixed by ``OMP_NUM_THREADS`` or one core)."""

    threads: int
    most: int
    tuned: bool
    reason: str

    def __str__(self) -> str:
        return f"{self.threads} ({self.reason})"


def calibrate_cpu_threads(forward: Callable[[], object]) -> ThreadDecision:
    """Keep torch's intra-op threads only where they pay: for a small model they barely speed a
    forward up while their OpenMP workers spin between operations, a core busy for nothing
    that the HTTP side needs. Never more than the pod's CPU quota runs
    (:func:`~huggingfaceserver.pod.threads_within`). Leaves the setting alone when
    ``OMP_NUM_THREADS`` is set or there is one core."""
    threads = threads_within(torch.get_num_threads())
    if threads != torch.get_num_threads():  # the pod's CPU quota: no more threads than it runs
        torch.set_num_threads(threads)
    if "OMP_NUM_THREADS" in os.environ or threads < 2:
        return ThreadDecision(threads, threads, False, "OMP_NUM_THREADS or one core")
    timings = time_thread_counts(forward, threads)
    timing = timings.describe(threads)
    if timings.pays:
        torch.set_num_threads(threads)
        return ThreadDecision(threads, threads, True, timing)
    return ThreadDecision(1, threads, True, f"{timing}: more threads would spin for little")


TIMED_PAIRS = 6
"""Forwards of a bucket timed on each thread count, alternately, before its choice is made."""
RETIME_AFTER_S = 20.0
"""How long a bucket's choice stands before its forwards are timed on both counts again."""


@dataclass(frozen=True)
class Bucket:
    """Forwards of one kind whose size (rows, tokens) has the same power of two share a choice:
    1, 2-3, 4-7, 8-15, ..."""

    kind: str
    unit: str
    scale: int

    def __str__(self) -> str:
        low = 1 << (self.scale - 1)
        return f"{self.kind} of {low}-{2 * low - 1} {self.unit}"


def decode_bucket(rows: int) -> Bucket:
    return Bucket("decode steps", "rows", rows.bit_length())


def prefill_bucket(tokens: int) -> Bucket:
    return Bucket("prefills", "prompt tokens", tokens.bit_length())


class LoopThreads:
    """The decode loop's thread count as the calibration left it, for every forward (on a GPU,
    or where ``OMP_NUM_THREADS`` fixes it)."""

    def run(self, bucket: Bucket, forward: Callable[[], T]) -> T:
        return forward()


@dataclass
class BucketTimes:
    """A bucket's choice, when it is next timed, and the timings of the round under way."""

    threads: int
    retime_at: float
    one: list[float] = field(default_factory=list)
    many: list[float] = field(default_factory=list)


class TunedLoopThreads(LoopThreads):
    """torch's intra-op threads for each forward of the decode loop, chosen by bucket (decode
    steps by rows, prefills by prompt tokens) while the loop serves, on the decode thread,
    which runs every forward: every :data:`RETIME_AFTER_S` a bucket's next
    :data:`TIMED_PAIRS` pairs of forwards run alternately on one thread and on all, and it
    keeps all only where their median forward is :data:`MIN_THREAD_SPEEDUP` times faster.
    A second thread pays while another core is free and the forward is large, and costs a
    spinning core otherwise; on shared cores that changes from one minute to the next
    (BENCHMARKS.md), which the load-time calibration, made once, cannot follow. Forwards of a
    bucket back to back have nearly the same shape, and alternating them cancels the drift of
    the machine's load, as the calibration does."""

    def __init__(
        self,
        decision: ThreadDecision,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        clock: Callable[[], float] = time.perf_counter,
        retime_after_s: float = RETIME_AFTER_S,
        pairs: int = TIMED_PAIRS,
    ) -> None:
        self.most = decision.most
        self.initial = decision.threads
        self.current = decision.threads
        self.set_threads = set_threads
        self.clock = clock
        self.retime_after_s = retime_after_s
        self.pairs = pairs
        self.buckets: dict[Bucket, BucketTimes] = {}

    def run(self, bucket: Bucket, forward: Callable[[], T]) -> T:
        start = self.clock()
        times = self.buckets.get(bucket)
        if times is None:
            times = self.buckets[bucket] = BucketTimes(self.initial, start)
        timing = start >= times.retime_at
        if timing:  # alternately: one thread, then all
            threads = 1 if len(times.one) <= len(times.many) else self.most
        else:
            threads = times.threads
        if threads != self.current:
            self.set_threads(threads)
            self.current = threads
            start = self.clock()
        result = forward()
        if timing:
            (times.one if threads == 1 else times.many).append(self.clock() - start)
            if len(times.many) >= self.pairs:
                self.decide(bucket, times)
        return result

    def decide(self, bucket: Bucket, times: BucketTimes) -> None:
        medians = ThreadTimings(
            many=statistics.median(times.many), one=statistics.median(times.one)
        )
        chosen = self.most if medians.pays else 1
        log = logger.info if chosen != times.threads else logger.debug
        log("intra-op threads for %s: %d (%s)", bucket, chosen, medians.describe(self.most))
        times.threads = chosen
        times.one.clear()
        times.many.clear()
        times.retime_at = self.clock() + self.retime_after_s
