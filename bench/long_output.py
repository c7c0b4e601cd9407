"""Long outputs: streamed generation at 256 tokens against thousands, on the transformers
backend, under both process layouts.

The model is :func:`bench.models.build_long_llama` (hidden 64, 2 layers, 16,384 positions), so
a decode step costs little and what grows with the answer shows: the server's work per token
(detokenizing, framing, the hops between processes) and the model's cache. Streamed OpenAI
completions (``/openai/v1/completions``), greedy, ``ignore_eos``, exactly ``max_tokens`` tokens
each (checked against the usage chunk), in a closed loop from the benchmark process:

- one stream: 256 tokens (:data:`SHORT_REPEATS` requests one after the other, so that the
  server's CPU time is read over seconds, not a few clock ticks), and one of 12,000 tokens;
- 8 streams together: 256 tokens each (:data:`SHORT_REPEATS_TOGETHER` requests per stream),
  and 4,000 tokens each.

Both layouts' servers (``--api_workers 1``, ``--api_workers 2``) are up together; each round
runs every run on one then the other (the order flips every round), so that a noisy minute
spreads over both. Per run: tokens/s (per stream alone, aggregate for 8), time to first token,
inter-token latency from chunk arrival times, and the server's CPU seconds (utime + stime of
the server and all its descendants, from ``/proc``) per 1,000 tokens.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from . import long_output_alone, routes, server, texts
from .load import REQUEST_TIMEOUT_S
from .long_output_alone import Alone
from .routes import StreamTrace, TokenCountMismatch
from .stats import median, percentile
from .targets import Target
from .workloads import Settings

logger = logging.getLogger(__name__)

KEY = "long_output"
MODEL_NAME = "llm"
SHORT_TOKENS = 256
STREAMS = 8
SHORT_REPEATS = 8
"""Requests of the one-stream 256-token run, one after the other."""
SHORT_REPEATS_TOGETHER = 4
"""Requests per stream of the 8-stream 256-token run."""
LAYOUTS = {
    "--api_workers 1": ("--api_workers", "1"),
    "--api_workers 2": ("--api_workers", "2"),
}
ALONE_RATE_SHARE = 0.7
"""One stream: tokens/s at the long length, at least this share of tokens/s at 256."""
ALONE_CPU_FACTOR = 1.5
"""One stream: CPU per 1,000 tokens at the long length, at most this many times at 256."""
TOGETHER_RATE_SHARE = 0.8
"""8 streams: aggregate tokens/s at the long length, at least this share of that at 256."""
EDGE_TOKENS = 1000
"""The long stream's rate is also given over its first and its last this many tokens."""


@dataclass(frozen=True)
class Run:
    """One kind of run: ``streams`` at once, each sending ``requests`` requests of ``tokens``
    tokens one after the other."""

    streams: int
    tokens: int
    requests: int = 1

    @property
    def label(self) -> str:
        count = "1 stream" if self.streams == 1 else f"{self.streams} streams"
        return f"{count} x {self.tokens:,} tokens"


def runs_of(settings: Settings) -> tuple[Run, Run, Run, Run]:
    """Short and long alone, short and long together."""
    alone, together = settings.long_output_tokens
    return (
        Run(1, SHORT_TOKENS, SHORT_REPEATS),
        Run(1, alone),
        Run(STREAMS, SHORT_TOKENS, SHORT_REPEATS_TOGETHER),
        Run(STREAMS, together),
    )


@dataclass
class Measured:
    """One run, once: its streams, its wall time, the server's CPU over it, and the idle
    server's (the other layout's, which should be about nil)."""

    run: Run
    traces: list[StreamTrace]
    elapsed_s: float
    server_cpu_s: float = float("nan")
    idle_cpu_s: float = float("nan")

    @property
    def errors(self) -> list[str]:
        return [t.error for t in self.traces if t.error is not None]

    @property
    def tokens(self) -> int:
        return sum(t.usage_tokens or 0 for t in self.traces if t.error is None)

    @property
    def tokens_per_s(self) -> float:
        """Per stream for one stream, aggregate for several; NaN when a stream failed."""
        return float("nan") if self.errors else self.tokens / self.elapsed_s

    @property
    def cpu_per_1k(self) -> float:
        """Server CPU seconds per 1,000 generated tokens."""
        return float("nan") if self.errors else 1000 * self.server_cpu_s / self.tokens

    @property
    def ttft_ms(self) -> float:
        return median([1000 * t.ttft_s for t in self.traces if t.error is None])

    def itl_ms(self, q: float) -> float:
        """The ``q``-th percentile of the gaps between chunks, all streams together."""
        return percentile([1000 * g for t in self.traces for g in t.gaps_s], q)

    @property
    def one_token_chunks(self) -> bool:
        """Whether every stream had one chunk per generated token."""
        return all(len(t.chunk_s) == t.usage_tokens for t in self.traces if t.error is None)

    def edge_rates(self) -> tuple[float, float]:
        """Tokens/s over the first and the last :data:`EDGE_TOKENS` chunks of the first
        stream (NaN when it is not longer than twice that)."""
        chunks = self.traces[0].chunk_s
        if len(chunks) <= 2 * EDGE_TOKENS:
            return float("nan"), float("nan")
        first = EDGE_TOKENS / (chunks[EDGE_TOKENS] - chunks[0])
        last = EDGE_TOKENS / (chunks[-1] - chunks[-1 - EDGE_TOKENS])
        return first, last


@dataclass
class LayoutRuns:
    """One layout's server and its measured runs (one per round)."""

    label: str
    flags: tuple[str, ...]
    runs: dict[Run, list[Measured]] = field(default_factory=dict)
    startup_s: float = float("nan")
    processes: int = 0
    failure: str | None = None
    """Why the server did not start (then there are no runs)."""

    def rates(self, run: Run) -> list[float]:
        return [m.tokens_per_s for m in self.runs.get(run, [])]

    def cpu_per_1k(self, run: Run) -> list[float]:
        return [m.cpu_per_1k for m in self.runs.get(run, [])]


@dataclass
class LongOutputResult:
    """Every layout's runs."""

    settings: Settings
    layouts: list[LayoutRuns]
    alone: list[Alone] = field(default_factory=list)
    """The model alone, no server (:mod:`.long_output_alone`): the 8-stream target's yardstick."""

    @property
    def runs(self) -> tuple[Run, Run, Run, Run]:
        return runs_of(self.settings)

    def targets(self) -> list[Target]:
        return [t for layout in self.layouts if layout.runs for t in layout_targets(self, layout)]


def _ratio(above: list[float], below: list[float]) -> float:
    """The median of the rounds' ratios (the two runs of a round ran minutes apart at most)."""
    return median([a / b for a, b in zip(above, below, strict=True)])


def layout_targets(result: LongOutputResult, layout: LayoutRuns) -> Iterator[Target]:
    short, alone, short_together, together = result.runs
    name = f"{KEY}, {layout.label}"
    share = _ratio(layout.rates(alone), layout.rates(short))
    yield Target(
        f"{name}: 1 stream, tokens/s at {alone.tokens:,} >= {ALONE_RATE_SHARE}x at {short.tokens}",
        share >= ALONE_RATE_SHARE,
        f"{share:.2f}x (median of the rounds' ratios): {median(layout.rates(alone)):.0f} "
        f"against {median(layout.rates(short)):.0f} tokens/s",
    )
    factor = _ratio(layout.cpu_per_1k(alone), layout.cpu_per_1k(short))
    yield Target(
        f"{name}: 1 stream, server CPU per 1,000 tokens at {alone.tokens:,} <= "
        f"{ALONE_CPU_FACTOR}x at {short.tokens}",
        factor <= ALONE_CPU_FACTOR,
        f"{factor:.2f}x (median of the rounds' ratios): {median(layout.cpu_per_1k(alone)):.2f} "
        f"against {median(layout.cpu_per_1k(short)):.2f} CPU s",
    )
    share = _ratio(layout.rates(together), layout.rates(short_together))
    yield Target(
        f"{name}: {together.streams} streams, aggregate tokens/s at {together.tokens:,} >= "
        f"{TOGETHER_RATE_SHARE}x at {short_together.tokens}",
        share >= TOGETHER_RATE_SHARE,
        f"{share:.2f}x (median of the rounds' ratios): {median(layout.rates(together)):.0f} "
        f"against {median(layout.rates(short_together)):.0f} tokens/s",
    )


async def _stream_loop(
    session: aiohttp.ClientSession, url: str, run: Run, indices: Iterator[int]
) -> list[StreamTrace]:
    """One stream: its requests one after the other; a request that did not generate exactly
    ``run.tokens`` tokens stops the benchmark (it would measure something else)."""
    prompts = texts.prompts()
    traces = []
    for _ in range(run.requests):
        prompt = prompts[next(indices) % len(prompts)]
        body = routes.completion_body(MODEL_NAME, prompt, run.tokens, {"ignore_eos": True})
        try:
            trace = await routes.traced_completion_stream(session, url, body)
        except (TimeoutError, aiohttp.ClientError) as exc:
            trace = StreamTrace(float("nan"), error=f"{type(exc).__name__}: {exc}")
        if trace.error is None and trace.usage_tokens != run.tokens:
            raise TokenCountMismatch(
                f"asked for {run.tokens} tokens with ignore_eos, the server generated "
                f"{trace.usage_tokens}"
            )
        traces.append(trace)
    return traces


async def _streams(base_url: str, run: Run) -> tuple[float, list[StreamTrace]]:
    """``run.streams`` streams at once: (wall seconds, every request's trace)."""
    connector = aiohttp.TCPConnector(limit=run.streams)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    url = f"{base_url}/openai/v1/completions"
    indices = itertools.count()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        streams = [_stream_loop(session, url, run, indices) for _ in range(run.streams)]
        per_stream = await asyncio.gather(*streams)
        elapsed = time.perf_counter() - start
    return elapsed, [trace for traces in per_stream for trace in traces]


def measure_run(run: Run, running: server.Server, idle: list[server.Server]) -> Measured:
    """``run`` against ``running``, with its CPU (and the idle servers') over the run."""

    def idle_cpu() -> float:
        return sum(server.cpu_seconds(s.process.pid) for s in idle)

    pid = running.process.pid
    cpu, idle_before = server.cpu_seconds(pid), idle_cpu()
    elapsed, traces = asyncio.run(_streams(running.url, run))
    measured = Measured(run, traces, elapsed)
    measured.server_cpu_s = server.cpu_seconds(pid) - cpu
    measured.idle_cpu_s = idle_cpu() - idle_before
    return measured


def _bring_up(
    stack: ExitStack, label: str, flags: tuple[str, ...], model_dir: Path, settings: Settings,
    log_dir: Path,
) -> tuple[server.Server | None, LayoutRuns]:  # fmt: skip
    """The layout's ready server (None, and the reason in its runs, if it did not start)."""
    args = ["--model_dir", str(model_dir), "--model_name", MODEL_NAME, "--backend", "huggingface"]
    args += [*flags, *settings.server_args]
    layout = LayoutRuns(label, flags)
    log_path = log_dir / f"{KEY}-{'-'.join(flags).strip('-')}.log"
    logger.info("%s, %s: python -m huggingfaceserver %s", KEY, label, " ".join(args))
    started = server.start(args, log_path)
    try:
        running = stack.enter_context(server.ready(started))
    except (RuntimeError, TimeoutError) as exc:
        lines = str(exc).strip().splitlines()
        layout.failure = f"did not start: {lines[0]}; last log line: {lines[-1][:300]}"
        logger.warning("  %s: %s (log: %s)", label, layout.failure, log_path)
        return None, layout
    layout.startup_s = running.ready_s
    layout.processes = server.family_size(running.process.pid)
    logger.info("  ready in %.1f s, %d process(es)", running.ready_s, layout.processes)
    return running, layout


def measure(model_dir: Path, settings: Settings, log_dir: Path) -> LongOutputResult:
    """Both layouts up, each warmed up, then ``settings.long_output_rounds`` rounds of every
    run on each."""
    runs = runs_of(settings)
    _, _, short_together, together = runs
    alone = long_output_alone.measure(
        model_dir, together.streams, short_together.tokens, together.tokens
    )
    for way in alone:
        logger.info(
            "  %s, %s: %.0f tokens/s at %d, %.0f at %d: %.2fx",
            KEY, way.engine, way.short_rate, short_together.tokens, way.long_rate,
            together.tokens, way.share,
        )  # fmt: skip
    with ExitStack() as stack:
        tried = [
            _bring_up(stack, label, flags, model_dir, settings, log_dir)
            for label, flags in LAYOUTS.items()
        ]
        up = [(running, layout) for running, layout in tried if running is not None]
        for running, _ in up:  # first calls allocate; a few batched steps each
            measure_run(Run(STREAMS, SHORT_TOKENS), running, [])
        for round_ in range(settings.long_output_rounds):
            for running, layout in up if round_ % 2 == 0 else up[::-1]:
                idle = [other for other, _ in up if other is not running]
                for run in runs:
                    measured = measure_run(run, running, idle)
                    layout.runs.setdefault(run, []).append(measured)
                    _log(layout, measured, round_)
    return LongOutputResult(settings, [layout for _, layout in tried], alone)


def _log(layout: LayoutRuns, measured: Measured, round_: int) -> None:
    logger.info(
        "  %s, %s, %s, round %d: %.0f tokens/s, TTFT %.1f ms, ITL p99 %.2f ms, "
        "%.2f CPU s/1k tokens, %d errors",
        KEY,
        layout.label,
        measured.run.label,
        round_ + 1,
        measured.tokens_per_s,
        measured.ttft_ms,
        measured.itl_ms(99),
        measured.cpu_per_1k,
        len(measured.errors),
    )
