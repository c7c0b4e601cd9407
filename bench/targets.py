"""The targets the server must meet, checked against the measured figures."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator
from dataclasses import dataclass

from .raw import EncoderCeiling, GenerationCeiling
from .runner import ModeRuns, WorkloadResult
from .summary import RunSummary, summarize
from .workloads import BATCHING, BATCHING_TWO_FRONTS

ENCODER_SHARE = 0.85
"""Encoder at the loaded concurrency: at least this share of the best raw batched rate."""
GENERATION_SHARE = 0.70
"""Generation at the loaded concurrency: at least this share of raw ``generate`` at that batch."""
LATENCY_FACTOR, LATENCY_SLACK_MS = 1.2, 5.0
"""Concurrency 1 p50 at most factor x the raw single forward + slack."""
HEALTH_P99_MS = 50.0
"""Health probe p99 under load, below this."""


@dataclass(frozen=True)
class Target:
    """One checked target: what, pass or fail, and the figures behind it."""

    name: str
    passed: bool
    detail: str


def _batching(result: WorkloadResult) -> ModeRuns | None:
    return next((runs for runs in result.modes if runs.mode == BATCHING), None)


def _encoder_targets(result: WorkloadResult, ceiling: EncoderCeiling) -> Iterator[Target]:
    batching = _batching(result)
    if batching is None:
        return
    key, loaded = result.workload.key, result.workload.loaded
    single_ms = statistics.median(ceiling.single_ms)
    for route in result.workload.routes:
        busy = summarize(batching.runs[(route.label, loaded)], tokens=False)
        share = busy.rate.median / ceiling.best_rate
        yield Target(
            f"{key}, {route.label}: c={loaded} >= {ENCODER_SHARE:.0%} of the raw ceiling",
            share >= ENCODER_SHARE,
            f"{busy.rate.median:.1f} req/s = {share:.0%} of {ceiling.best_rate:.1f} req/s "
            f"(raw, batch {ceiling.best_batch})",
        )
        alone = summarize(batching.runs[(route.label, 1)], tokens=False)
        limit = LATENCY_FACTOR * single_ms + LATENCY_SLACK_MS
        yield Target(
            f"{key}, {route.label}: c=1 p50 <= {LATENCY_FACTOR}x raw single forward "
            f"+ {LATENCY_SLACK_MS:.0f} ms",
            alone.latency_ms[0] <= limit,
            f"p50 {alone.latency_ms[0]:.1f} ms vs limit {limit:.1f} ms "
            f"(raw single forward p50 {single_ms:.1f} ms; ratio "
            f"{alone.latency_ms[0] / single_ms:.2f}x)",
        )
        yield _health_target(f"{key}, {route.label}: c={loaded}", busy)


def _health_target(name: str, busy: RunSummary) -> Target:
    p99 = busy.health_ms[1]
    failed = busy.health_failures
    return Target(
        f"{name} health probe p99 < {HEALTH_P99_MS:.0f} ms",
        not math.isnan(p99) and p99 < HEALTH_P99_MS and failed == 0,
        f"p99 {p99:.1f} ms, max {busy.health_ms[2]:.1f} ms, {failed} failed probes",
    )


def _generation_targets(result: WorkloadResult, ceiling: GenerationCeiling) -> Iterator[Target]:
    """The share of raw batched generate, in each process layout measured."""
    loaded = result.workload.loaded
    raw_rate = statistics.median(ceiling.rates[loaded])
    for runs in result.modes:
        if runs.mode not in (BATCHING, BATCHING_TWO_FRONTS):
            continue
        layout = "" if runs.mode == BATCHING else f" ({runs.mode.args[-2]} {runs.mode.args[-1]})"
        for route in (r for r in result.workload.routes if r.judged):
            busy = summarize(runs.runs[(route.label, loaded)], tokens=True)
            share = busy.rate.median / raw_rate
            yield Target(
                f"{result.workload.key}{layout}, {route.label}: c={loaded} >= "
                f"{GENERATION_SHARE:.0%} of raw generate at batch {loaded}",
                share >= GENERATION_SHARE,
                f"{busy.rate.median:.0f} tokens/s = {share:.0%} of {raw_rate:.0f} tokens/s",
            )


def evaluate(results: list[WorkloadResult]) -> list[Target]:
    """Every target that the measured workloads allow to check."""
    targets: list[Target] = []
    for result in results:
        if isinstance(result.raw, EncoderCeiling):
            targets += _encoder_targets(result, result.raw)
        else:
            targets += _generation_targets(result, result.raw)
    return targets
