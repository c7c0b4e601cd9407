"""The figures of repeated runs: medians over the repeats of each run's rate and percentiles."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .load import LoadResult
from .stats import Spread, median, percentile


@dataclass(frozen=True)
class RunSummary:
    """One row of a table: medians over repeats (latencies in ms); RSS and errors over all."""

    rate: Spread
    """Requests/s (encoders) or tokens/s (generation)."""
    latency_ms: tuple[float, float, float]
    """p50, p95, p99."""
    ttft_ms: tuple[float, float, float]
    health_ms: tuple[float, float, float]
    """p50, p99 (medians over repeats) and the worst probe of all repeats."""
    health_failures: int
    cpu_cores: tuple[float, float]
    """Server and load generator CPU time over wall time (cores busy), medians."""
    peak_rss_mb: float
    requests: int
    errors: list[str]


def _median_percentiles(
    runs: Sequence[LoadResult], values: Callable[[LoadResult], list[float]], qs: Sequence[float]
) -> tuple[float, ...]:
    return tuple(median([percentile(values(run), q) for run in runs]) for q in qs)


def _latencies(run: LoadResult) -> list[float]:
    return [s.latency_s * 1000 for s in run.ok]


def _ttfts(run: LoadResult) -> list[float]:
    return [s.ttft_s * 1000 for s in run.ok if s.ttft_s is not None]


def _health(run: LoadResult) -> list[float]:
    return run.probes.latencies_ms


def summarize(runs: Sequence[LoadResult], tokens: bool) -> RunSummary:
    """The medians of ``runs`` (repeats of one configuration); ``tokens``: rate in tokens/s."""
    rates = [run.tokens_per_s if tokens else run.requests_per_s for run in runs]
    p50, p95, p99 = _median_percentiles(runs, _latencies, (50, 95, 99))
    t50, t95, t99 = _median_percentiles(runs, _ttfts, (50, 95, 99))
    h50, h99 = _median_percentiles(runs, _health, (50, 99))
    worst = max((ms for run in runs for ms in _health(run)), default=float("nan"))
    return RunSummary(
        rate=Spread.of(rates),
        latency_ms=(p50, p95, p99),
        ttft_ms=(t50, t95, t99),
        health_ms=(h50, h99, worst),
        health_failures=sum(run.probes.failures for run in runs),
        cpu_cores=(
            median([run.server_cpu_s / run.elapsed_s for run in runs]),
            median([run.client_cpu_s / run.elapsed_s for run in runs]),
        ),
        peak_rss_mb=max(run.peak_rss_mb for run in runs),
        requests=sum(len(run.samples) for run in runs),
        errors=[error for run in runs for error in run.errors],
    )
