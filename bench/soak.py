"""Soak: two servers under a steady mixed load for minutes, their memory sampled every second.

An encoder server answers KServe V1 predict, Open Inference V2 REST and gRPC, and OpenAI
embeddings; a generative server (the transformers backend) answers OpenAI completions and
streamed chats. :data:`WORKERS` closed-loop workers per kind of request send one request after
the other until the time is up; every answer is checked (status, shape, and for the encoder the
same vector as the warm-up's V1 answer for that text). Meanwhile each server's process family
(the server and every process under it) has its VmRSS summed every :data:`SAMPLE_EVERY_S`.

A server that runs for weeks must not grow: over the second half of the run (the first half
lets allocator arenas, thread pools and caches reach their working size) the RSS of each family
is fitted with a least-squares line, whose slope must be near zero.

``python -m bench --only soak``: 10 minutes; ``--quick``: 1 minute. ``tests/test_soak.py`` runs
the same driver for 90 s on the tests' tiny models.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp

from huggingfaceserver.units import MiB

from . import server
from .report import table
from .soak_requests import (
    ENCODER_KINDS,
    ENCODER_NAME,
    GENERATION_NAME,
    MAX_TOKENS,
    REQUEST_TIMEOUT_S,
    Call,
    EncoderCalls,
    GenerationCalls,
    GrpcClient,
    Servers,
)
from .targets import Target
from .workloads import Settings

if TYPE_CHECKING:  # imports torch
    from .models import BenchModels

logger = logging.getLogger(__name__)

KEY = "soak"
WORKERS = 2
"""Closed-loop workers per kind of request."""
SAMPLE_EVERY_S = 1.0
EDGE_SAMPLES = 5
"""Second-half growth: the median of this many samples at each end, not one noisy sample."""
NOISE_STEP_MIB = 8.0
"""Allocator noise: steps of a few MiB that come and go (arenas grown, then trimmed), no steady
climb. In the tests' 90 s runs (2 noisy cores) the encoder stayed within 0.2 MiB/min over the
second half and the generative server within -10..0 MiB/min, its steps up to 6-8 MiB."""
LEAK_MB = 1.0
"""The leak to catch: this many MB per 100 requests."""
GROWTH_LIMIT_MIB = 2 * NOISE_STEP_MIB
"""Second-half growth allowed per server family (16 MiB): two noise steps."""
FAMILY_COLUMNS = ("server", "RSS MiB start / middle / end", "second half MiB/min (limit)",
                  "second half growth MiB (limit)", "1 MB/100 requests leak MiB/min")  # fmt: skip
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
"""Two servers and the load share the cores: one torch thread per server, as an operator
packing servers onto a node sets it."""


# --- memory -------------------------------------------------------------------------------


@dataclass(frozen=True)
class RssSample:
    at_s: float
    """Seconds since the load started."""
    mib: float


def slope_limit(window_s: float) -> float:
    """The second-half slope allowed (MiB/min) for a window of ``window_s``: what one noise step
    in its middle fits to. A step of h MiB in the middle of T minutes fits a slope of 1.5 h / T:
    16 MiB/min for the tests' 45 s, 2.4 MiB/min for the bench's 5 minutes.

    A leak of 1 MB per 100 requests (:meth:`SoakResult.leak_slope`) is well past it where
    requests are many: 290 MiB/min at the tiny encoder's 500 requests/s and 30 MiB/min (22 MiB
    of growth) at the tiny llama's 50/s in the tests; 20 MiB/min at the bench MiniLM's 35/s.
    The bench Llama's 6/s make 3.4 MiB/min, 17 MiB over the 10-minute run's second half: a leak
    that slow is at the limits, caught by its growth as much as by its slope.
    """
    return 1.5 * NOISE_STEP_MIB / (window_s / 60) if window_s > 0 else math.inf


@dataclass(frozen=True)
class Trend:
    """The RSS over the second half of a run."""

    slope_mib_per_min: float
    """Of the least-squares line through the samples."""
    growth_mib: float
    """From its start to its end (medians of :data:`EDGE_SAMPLES` samples at each end)."""
    samples: int
    window_s: float = 0.0
    """From the first to the last sample of the second half."""

    @property
    def slope_limit(self) -> float:
        return slope_limit(self.window_s)

    def flat(self) -> bool:
        """Near zero: slope and growth within :func:`slope_limit` and :data:`GROWTH_LIMIT_MIB`."""
        return (
            self.samples >= 2
            and self.slope_mib_per_min <= self.slope_limit
            and self.growth_mib <= GROWTH_LIMIT_MIB
        )


def second_half_trend(samples: Sequence[RssSample]) -> Trend:
    """The slope (MiB/min) and growth of the samples taken in the second half of the run."""
    if not samples:
        return Trend(math.nan, math.nan, 0)
    middle = (samples[0].at_s + samples[-1].at_s) / 2
    half = [s for s in samples if s.at_s >= middle]
    if len(half) < 2:
        return Trend(math.nan, math.nan, len(half))
    mean_t = statistics.fmean(s.at_s for s in half)
    mean_m = statistics.fmean(s.mib for s in half)
    covariance = sum((s.at_s - mean_t) * (s.mib - mean_m) for s in half)
    variance = sum((s.at_s - mean_t) ** 2 for s in half)
    edge = min(EDGE_SAMPLES, len(half) // 2)
    growth = statistics.median(s.mib for s in half[-edge:]) - statistics.median(
        s.mib for s in half[:edge]
    )
    window = half[-1].at_s - half[0].at_s
    return Trend(60 * covariance / variance, growth, len(half), window)


# --- the result ---------------------------------------------------------------------------


@dataclass
class Tally:
    """One kind of request: how many were answered, how many were wrong, the first problems."""

    server: str
    requests: int = 0
    errors: int = 0
    problems: list[str] = field(default_factory=list)

    def record(self, problem: str | None) -> None:
        self.requests += 1
        if problem is not None:
            self.errors += 1
            if len(self.problems) < 5:
                self.problems.append(problem[:300])


@dataclass
class SoakResult:
    """Per-kind request counts and errors, and each server family's RSS samples."""

    duration_s: float
    tallies: dict[str, Tally]
    rss: dict[str, list[RssSample]]
    """Server family label -> samples."""

    @property
    def errors(self) -> int:
        return sum(tally.errors for tally in self.tallies.values())

    def problems(self) -> list[str]:
        return [f"{k}: {p}" for k, tally in self.tallies.items() for p in tally.problems]

    def trend(self, family: str) -> Trend:
        return second_half_trend(self.rss[family])

    def rate(self, kind: str) -> float:
        return self.tallies[kind].requests / self.duration_s

    def leak_slope(self, family: str) -> float:
        """The second-half slope (MiB/min) a leak of 1 MB per 100 requests of ``family``'s
        server would have at this run's request rate."""
        requests = sum(t.requests for t in self.tallies.values() if t.server == family)
        return requests / self.duration_s * 60 / 100 * LEAK_MB * 1e6 / MiB

    def landmarks(self, family: str) -> tuple[float, float, float]:
        """RSS MiB at the start, the middle and the end of the run."""
        samples = self.rss[family]
        if not samples:
            return (math.nan, math.nan, math.nan)
        middle = min(samples, key=lambda s: abs(s.at_s - samples[-1].at_s / 2))
        return (samples[0].mib, middle.mib, samples[-1].mib)

    def summary(self) -> str:
        """One line per kind and per family, for a test's output."""
        lines = [
            f"{kind}: {t.requests} requests ({self.rate(kind):.1f}/s), {t.errors} errors"
            for kind, t in self.tallies.items()
        ]
        for family in self.rss:
            trend, (start, middle, end) = self.trend(family), self.landmarks(family)
            lines.append(
                f"{family} RSS MiB {start:.0f} / {middle:.0f} / {end:.0f}; second half: "
                f"{trend.slope_mib_per_min:+.2f} MiB/min (limit {trend.slope_limit:.1f}), "
                f"{trend.growth_mib:+.1f} MiB ({trend.samples} samples; a leak of 1 MB per 100 "
                f"requests: {self.leak_slope(family):.1f} MiB/min)"
            )
        return "\n".join(lines)

    # The bench Outcome.

    def targets(self) -> list[Target]:
        total = sum(t.requests for t in self.tallies.values())
        flat = {family: self.trend(family) for family in self.rss}
        return [
            Target(
                f"{KEY}: every request of the mixed load answered right",
                self.errors == 0 and all(t.requests > 0 for t in self.tallies.values()),
                f"{self.errors} errors in {total} requests over {self.duration_s / 60:.0f} min",
            ),
            Target(
                f"{KEY}: each server's RSS flat over the second half (its slope within what one "
                f"{NOISE_STEP_MIB:g} MiB noise step fits to, growth <= {GROWTH_LIMIT_MIB:g} MiB)",
                all(trend.flat() for trend in flat.values()),
                "; ".join(
                    f"{family} {t.slope_mib_per_min:+.2f} MiB/min (limit {t.slope_limit:.1f}), "
                    f"{t.growth_mib:+.1f} MiB"
                    for family, t in flat.items()
                ),
            ),
        ]

    def section(self) -> list[str]:
        kinds = [
            [kind, t.server, str(t.requests), f"{self.rate(kind):.1f}", str(t.errors)]
            for kind, t in self.tallies.items()
        ]
        families = []
        for family in self.rss:
            trend = self.trend(family)
            families.append(
                [family, " / ".join(f"{mib:.0f}" for mib in self.landmarks(family))]
                + [f"{trend.slope_mib_per_min:+.2f} (≤ {trend.slope_limit:.1f})"]
                + [f"{trend.growth_mib:+.1f} (≤ {GROWTH_LIMIT_MIB:g})"]
                + [f"{self.leak_slope(family):.1f}"]
            )
        return [
            "## Soak: memory under a steady mixed load",
            "",
            f"Method. Two servers side by side, each with `OMP_NUM_THREADS=1`: all-MiniLM-L6-v2 "
            f"(`--task text_embedding`) and the benchmark Llama (`--backend huggingface`). "
            f"For {self.duration_s / 60:.0f} min, {WORKERS} closed-loop workers per kind of "
            f"request (aiohttp; gRPC through tritonclient in a subprocess), one or two texts "
            f"per encoder request, greedy generations of {MAX_TOKENS} tokens; every answer "
            "checked (status, shape, the encoder's vectors against the warm-up's). RSS: VmRSS "
            f"summed over the server and its descendants, every {SAMPLE_EVERY_S:g} s; the slope "
            "is a least-squares line through the second half's samples, the growth the "
            f"difference of the medians of {EDGE_SAMPLES} samples at its two ends. The slope limit "
            f"is what one allocator step of {NOISE_STEP_MIB:g} MiB in the middle of the second "
            "half fits to (1.5 × step / its minutes); the last column is the slope a leak of "
            f"{LEAK_MB:g} MB per 100 requests would have at the server's rate in this run.",
            "",
            *table(("request", "server", "requests", "req/s", "errors"), kinds),
            "",
            *table(FAMILY_COLUMNS, families),
            "",
        ]


# --- the run ------------------------------------------------------------------------------


async def checked(call: Call, index: int) -> str | None:
    try:
        return await call(index)
    except Exception as exc:  # a request that failed is a finding, not a crash of the soak
        return repr(exc)


async def worker(call: Call, tally: Tally, numbers: Iterator[int], deadline: float) -> None:
    while time.monotonic() < deadline:
        tally.record(await checked(call, next(numbers)))


async def sample_rss(
    families: dict[str, int], started: float, stop: asyncio.Event
) -> dict[str, list[RssSample]]:
    """Every family's RSS every :data:`SAMPLE_EVERY_S` until ``stop`` is set."""
    rss: dict[str, list[RssSample]] = {label: [] for label in families}
    while True:
        at = time.monotonic() - started
        for label, pid in families.items():
            rss[label].append(RssSample(at, server.family_rss_mb(pid)))
        try:
            await asyncio.wait_for(stop.wait(), SAMPLE_EVERY_S)
            return rss
        except TimeoutError:
            continue


async def warm_up(calls: dict[str, Call]) -> None:
    """Each kind of request a few times, one after the other; any problem stops the soak."""
    for kind, call in calls.items():
        for index in range(3):
            if (problem := await checked(call, index)) is not None:
                raise RuntimeError(f"warm-up {kind}: {problem}")


async def drive(servers: Servers, duration_s: float) -> SoakResult:
    """The mixed load for ``duration_s`` seconds after a warm-up, RSS sampled meanwhile."""
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        GrpcClient.running(servers.encoder_grpc, servers.encoder_model) as grpc,
    ):
        encoder = EncoderCalls(session, servers, grpc)
        await encoder.learn()
        calls = {**encoder.calls(), **GenerationCalls(session, servers).calls()}
        await warm_up(calls)
        tallies = {
            kind: Tally("encoder" if kind in ENCODER_KINDS else "generation") for kind in calls
        }
        stop, numbers = asyncio.Event(), itertools.count()
        started = time.monotonic()
        sampler = asyncio.create_task(sample_rss(servers.families, started, stop))
        deadline = started + duration_s
        await asyncio.gather(
            *(
                worker(call, tallies[kind], numbers, deadline)
                for kind, call in calls.items()
                for _ in range(WORKERS)
            )
        )
        elapsed = time.monotonic() - started
        stop.set()
        rss = await sampler
    return SoakResult(elapsed, tallies, rss)


def run(servers: Servers, duration_s: float) -> SoakResult:
    """:func:`drive` on a fresh event loop."""
    return asyncio.run(drive(servers, duration_s))


# --- the bench suite ----------------------------------------------------------------------


def soak_duration_s(settings: Settings) -> float:
    """Ten minutes (``Settings.soak_s``); one for ``--quick``."""
    return settings.soak_s


def launch(args: list[str], log_path: Path) -> tuple[server.Server, int]:
    """``python -m huggingfaceserver ARGS`` on free ports, one torch thread; it and its gRPC
    port."""
    http_port, grpc_port = server.free_port(), server.free_port()
    command = [sys.executable, "-m", "huggingfaceserver", *args]
    command += ["--http_port", str(http_port), "--grpc_port", str(grpc_port)]
    return server.launch(command, http_port, log_path, ONE_THREAD), grpc_port


def measure(
    models: BenchModels, settings: Settings, log_dir: Path, duration_s: float | None = None
) -> SoakResult:
    """The soak on all-MiniLM-L6-v2 and the benchmark Llama, for ``duration_s`` (default
    :func:`soak_duration_s`)."""
    encoder_args = ["--model_dir", str(models.minilm), "--model_name", ENCODER_NAME]
    encoder_args += ["--task", "text_embedding", *settings.server_args]
    generation_args = ["--model_dir", str(models.llama), "--model_name", GENERATION_NAME]
    generation_args += ["--backend", "huggingface", *settings.server_args]
    with ExitStack() as stack:
        encoder, grpc_port = launch(encoder_args, log_dir / f"{KEY}-encoder.log")
        stack.callback(server.stop, encoder)
        generation, _ = launch(generation_args, log_dir / f"{KEY}-generation.log")
        stack.callback(server.stop, generation)
        for running in (encoder, generation):
            server.wait_ready(running)
        servers = Servers(
            encoder.url,
            f"127.0.0.1:{grpc_port}",
            generation.url,
            {"encoder": encoder.process.pid, "generation": generation.process.pid},
        )
        result = run(servers, duration_s or soak_duration_s(settings))
    logger.info("  %s: %d errors\n%s", KEY, result.errors, result.summary())
    return result
