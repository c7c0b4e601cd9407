"""The closed-loop load generator: C workers, each sending its next request when the last one
answered, for a fixed time or a fixed number of requests, with the health prober running."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

import aiohttp

from .health import HealthProber, Probes
from .routes import Call, Sample
from .server import Server, cpu_seconds

REQUEST_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Budget:
    """When the workers stop: after ``duration_s`` seconds, or after ``requests`` each."""

    duration_s: float | None = None
    requests: int | None = None

    def __post_init__(self) -> None:
        if (self.duration_s is None) == (self.requests is None):
            raise ValueError("give exactly one of duration_s and requests")


@dataclass
class LoadResult:
    """One loaded run: the samples, its wall time and the health probes during it."""

    concurrency: int
    elapsed_s: float
    samples: list[Sample]
    probes: Probes = field(default_factory=Probes)
    peak_rss_mb: float = float("nan")
    server_cpu_s: float = float("nan")
    """CPU seconds the server used during the run."""
    client_cpu_s: float = float("nan")
    """CPU seconds this process (the load generator) used during the run."""
    other_server_cpu_s: float = float("nan")
    """CPU seconds of another server that was up but not loaded (should be about 0)."""

    @property
    def ok(self) -> list[Sample]:
        return [s for s in self.samples if s.error is None]

    @property
    def errors(self) -> list[str]:
        return [s.error for s in self.samples if s.error is not None]

    @property
    def requests_per_s(self) -> float:
        return len(self.ok) / self.elapsed_s

    @property
    def tokens_per_s(self) -> float:
        return sum(s.tokens for s in self.ok) / self.elapsed_s


async def _worker(
    call: Call,
    session: aiohttp.ClientSession,
    indices: itertools.count,
    budget: Budget,
    deadline: float,
) -> list[Sample]:
    """Requests one after the other until the budget is spent."""
    samples: list[Sample] = []
    while True:
        if budget.requests is not None and len(samples) >= budget.requests:
            return samples
        if budget.duration_s is not None and time.perf_counter() >= deadline:
            return samples
        try:
            samples.append(await call(session, next(indices)))
        except (TimeoutError, aiohttp.ClientError) as exc:
            samples.append(Sample(float("nan"), error=f"{type(exc).__name__}: {exc}"))


async def closed_loop(call: Call, concurrency: int, budget: Budget) -> tuple[float, list[Sample]]:
    """Run ``concurrency`` workers until ``budget`` is spent: (wall seconds, samples)."""
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    indices = itertools.count()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        deadline = start + (budget.duration_s or 0.0)
        workers = [_worker(call, session, indices, budget, deadline) for _ in range(concurrency)]
        per_worker = await asyncio.gather(*workers)
        elapsed = time.perf_counter() - start
    return elapsed, [sample for samples in per_worker for sample in samples]


def run_load(
    call: Call, concurrency: int, budget: Budget, prober: HealthProber | None, port: int
) -> LoadResult:
    """One loaded run, with the health prober polling ``127.0.0.1:port`` during it."""
    if prober is not None:
        prober.begin("127.0.0.1", port)
    client_cpu = time.process_time()
    try:
        elapsed, samples = asyncio.run(closed_loop(call, concurrency, budget))
    finally:
        probes = prober.end() if prober is not None else Probes()
    result = LoadResult(concurrency, elapsed, samples, probes)
    result.client_cpu_s = time.process_time() - client_cpu
    return result


def run_streamed(call: Call, concurrency: int, budget: Budget, running: Server) -> LoadResult:
    """:func:`run_load` on a running server, no prober, with the server's CPU seconds over the
    run (:attr:`LoadResult.server_cpu_s`)."""
    cpu = cpu_seconds(running.process.pid)
    result = run_load(call, concurrency, budget, None, running.http_port)
    result.server_cpu_s = cpu_seconds(running.process.pid) - cpu
    return result
