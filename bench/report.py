"""``BENCHMARKS.md``: the header (date, machine, versions, method), the targets, one section
per workload (raw ceiling, then the server per mode and concurrency)."""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from . import texts
from .environment import Environment
from .load import LoadResult
from .raw import EncoderCeiling, GenerationCeiling
from .runner import WorkloadResult
from .stats import Spread, percentile
from .summary import RunSummary, summarize
from .targets import Target
from .workloads import Settings

logger = logging.getLogger(__name__)

ENCODER_COLUMNS = (
    "configuration",
    "route",
    "C",
    "req/s (median [min–max])",
    "of ceiling",
    "p50 ms",
    "p95 ms",
    "p99 ms",
    "errors",
    "CPU server / client",
    "peak RSS MiB",
    "health p50 / p99 / max ms",
)
GENERATION_COLUMNS = (
    "configuration",
    "C",
    "tokens/s (median [min–max])",
    "of raw",
    "p50 ms",
    "p95 ms",
    "p99 ms",
    "TTFT p50 / p95 / p99 ms",
    "errors",
    "CPU server / client",
    "peak RSS MiB",
    "health p50 / p99 / max ms",
)


def num(value: float, digits: int = 1) -> str:
    """A number for a table cell; a dash when it was not measured."""
    return "–" if math.isnan(value) else f"{value:.{digits}f}"


def spread(value: Spread, digits: int = 1) -> str:
    if value.low == value.high:
        return num(value.median, digits)
    return f"{num(value.median, digits)} [{num(value.low, digits)}–{num(value.high, digits)}]"


def triple(values: Sequence[float]) -> str:
    return " / ".join(num(v) for v in values)


def table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


@dataclass
class StreamedModes:
    """Rounds of streamed completions by (mode, concurrency), the first mode each
    concurrency's yardstick (the structured-output and ``--torch_compile`` workloads)."""

    settings: Settings
    runs: dict[tuple[str, int], list[LoadResult]] = field(default_factory=dict)

    def add(self, key: str, mode: str, concurrency: int, round_: int, run: LoadResult) -> None:
        """Keep round ``round_``'s run (from 0), and log it under the workload's ``key``."""
        self.runs.setdefault((mode, concurrency), []).append(run)
        logger.info(
            "  %s, %s, c=%d, round %d: %.0f tokens/s, %d errors",
            key, mode, concurrency, round_ + 1, run.tokens_per_s, len(run.errors),
        )  # fmt: skip

    def rate(self, mode: str, concurrency: int) -> float:
        return statistics.median(run.tokens_per_s for run in self.runs[(mode, concurrency)])

    def rows(self, modes: Sequence[str], concurrencies: Sequence[int]) -> list[list[str]]:
        """:func:`streamed_row` of each mode at each concurrency, against the first mode."""
        return [
            streamed_row(mode, c, self.runs[(mode, c)], self.rate(modes[0], c))
            for c in concurrencies
            for mode in modes
        ]


def streamed_row(label: str, concurrency: int, runs: list[LoadResult], base: float) -> list[str]:
    """A row of streamed-completion rounds: label, C, tokens/s, share of ``base`` tokens/s,
    p50 latency, TTFT, errors, CPU (the columns of the structured-output and LoRA tables)."""
    summary = summarize(runs, tokens=True)
    return (
        [label, str(concurrency), spread(summary.rate, 0)]
        + [f"{summary.rate.median / base:.0%}", num(summary.latency_ms[0])]
        + [triple(summary.ttft_ms), f"{len(summary.errors)}/{summary.requests}"]
        + [" / ".join(num(cores, 2) for cores in summary.cpu_cores)]
    )


def _machine(env: Environment, settings: Settings) -> str:
    machine = f"{env.cpu}, {env.cores} cores, {env.memory_gib:.1f} GiB RAM"
    if env.gpu:
        return f"{machine}, {env.gpu}; each figure is the median of {settings.repeats} repeat(s)"
    return (
        f"{machine}, no GPU; shared with other work, so figures are noisy: each is the median "
        f"of {settings.repeats} repeat(s), with [min–max] for the rates"
    )


CLASSIC_METHOD = (
    "Method (the classic workloads). The raw rows are plain runtimes in the benchmark process "
    "with no server running: for encoders, tokenizer + forward (+ pooling or argmax) on ONNX "
    "Runtime, with the export and session options the server uses (the runtime it serves them "
    "on by default; plain torch's figures are in the Runtimes section), padded per batch; for "
    "generation, transformers' `model.generate` (greedy, left-padded). The "
    "server is started as a user starts it (`python -m huggingfaceserver --model_dir DIR "
    "--model_name NAME ...`, default flags, request logging on) and loaded in a closed loop: C "
    "workers, each sending its next request when the last one answered (aiohttp, in the "
    "benchmark process, on the same cores as the server), one text per request, "
    "{duration:.0f} s per encoder run after {warmup:.0f} s of warm-up, {rounds} request(s) per "
    "worker (at least {minimum} per run) for generation. Meanwhile a separate process probes "
    "`GET /v2/health/live` every 100 ms on a new connection (as a kubelet does). Peak RSS is "
    "VmHWM of the server process (and children) since its start. Batching off is "
    "`--max_batch_size 1`."
)


def header(
    env: Environment, command: str, settings: Settings, runtime_s: float, classic: bool = True
) -> list[str]:
    """Date, machine, software, command; the classic workloads' method when they ran."""
    versions = ", ".join(f"{name} {v}" for name, v in env.packages.items())
    lines = [
        "# Benchmarks",
        "",
        f"- Date: {env.date}; whole run {runtime_s / 60:.1f} min.",
        f"- Machine: {_machine(env, settings)}.",
        f"- Software: Python {env.python}, {versions}; torch threads {env.torch_threads} "
        f"(defaults, raw and server alike); git {env.git}.",
        f"- Command: `{command}`.",
        "",
    ]
    if classic:
        method = CLASSIC_METHOD.format(
            duration=settings.duration_s,
            warmup=settings.warmup_s,
            rounds=settings.generation_rounds,
            minimum=settings.generation_min_requests,
        )
        lines += [method, ""]
    return lines


def targets_section(targets: Sequence[Target]) -> list[str]:
    lines = ["## Targets", ""]
    if not targets:
        lines.append("None for these workloads: their figures are reported as ratios.")
    for target in targets:
        lines.append(f"- **{'PASS' if target.passed else 'FAIL'}** {target.name}: {target.detail}")
    return lines + [""]


def _server_cells(summary: RunSummary) -> list[str]:
    """errors, RSS and health cells shared by both kinds of table."""
    health = f"{triple(summary.health_ms)}"
    if summary.health_failures:
        health += f" ({summary.health_failures} failed)"
    cpu = " / ".join(num(cores, 2) for cores in summary.cpu_cores)
    return [f"{len(summary.errors)}/{summary.requests}", cpu, num(summary.peak_rss_mb, 0), health]


def encoder_rows(result: WorkloadResult, ceiling: EncoderCeiling) -> list[list[str]]:
    single = [percentile(ceiling.single_ms, q) for q in (50, 95, 99)]
    best = ceiling.best_batch
    dash = ["–"] * 4
    alone = Spread.of(ceiling.rates[1])
    rows = [
        ["raw, batch 1", "–", "–", spread(alone), f"{alone.median / ceiling.best_rate:.0%}"]
        + [*map(num, single), *dash],
        ["raw, best batch", f"batch {best}", "–", spread(Spread.of(ceiling.rates[best])), "100%"]
        + ["–"] * 3
        + dash,
    ]
    for mode in result.modes:
        for (route, concurrency), runs in mode.runs.items():
            summary = summarize(runs, tokens=False)
            share = summary.rate.median / ceiling.best_rate
            rows.append(
                [f"server, {mode.mode.label}", route, str(concurrency), spread(summary.rate)]
                + [f"{share:.0%}", *map(num, summary.latency_ms), *_server_cells(summary)]
            )
    return rows


def generation_rows(result: WorkloadResult, ceiling: GenerationCeiling) -> list[list[str]]:
    rows = [
        [f"raw generate, batch {size}", "–", spread(Spread.of(rates), 0), "–"] + ["–"] * 8
        for size, rates in ceiling.rates.items()
    ]
    several = len(result.workload.routes) > 1
    for mode in result.modes:
        for (route, concurrency), runs in mode.runs.items():
            summary = summarize(runs, tokens=True)
            raw = ceiling.rates.get(concurrency)
            share = f"{summary.rate.median / statistics.median(raw):.0%}" if raw else ""
            label = f"server, {mode.mode.label}" + (f"; {route}" if several else "")
            rows.append(
                [label, str(concurrency), spread(summary.rate, 0), share]
                + [*map(num, summary.latency_ms), triple(summary.ttft_ms)]
                + _server_cells(summary)
            )
    return rows


def _words() -> str:
    counts = [len(sentence.split()) for sentence in texts.SENTENCES]
    return f"{len(counts)} sentences of {min(counts)}–{max(counts)} words, in turn"


def _raw_detail(ceiling: EncoderCeiling) -> str:
    rates = ", ".join(
        f"batch {size}: {statistics.median(r):.1f}" for size, r in ceiling.rates.items()
    )
    return f"Raw requests/s by batch size (median): {rates}."


def workload_section(result: WorkloadResult) -> list[str]:
    workload = result.workload
    lines = [f"## {workload.title}", ""]
    if isinstance(result.raw, EncoderCeiling):
        lines += table(ENCODER_COLUMNS, encoder_rows(result, result.raw))
        lines += ["", _raw_detail(result.raw) + f" Requests: one sentence each ({_words()})."]
    elif isinstance(result.raw, GenerationCeiling):
        lines += table(GENERATION_COLUMNS, generation_rows(result, result.raw))
        low, high = result.raw.prompt_tokens
        lines += [
            "",
            f"Prompts of {low}–{high} tokens, greedy, exactly {result.raw.new_tokens} new tokens "
            "per request (checked: the model cannot generate EOS, BOS or lone bytes), or on a "
            "route whose label gives a range, that range's lengths in steps of 16, request by "
            "request in turn (streams end at different steps, new ones arrive while others "
            "decode; no target: a run's last, longest streams decode with few rows beside them). "
            "Latency is the whole stream; TTFT is the first token's chunk.",
        ]
    startups = ", ".join(f"{m.mode.label} {m.startup_s:.0f} s" for m in result.modes)
    lines += ["", f"Server start to ready: {startups}.", ""]
    errors = [
        error
        for mode in result.modes
        for runs in mode.runs.values()
        for r in runs
        for error in r.errors
    ]
    if errors:
        lines += [f"First errors ({len(errors)} in all): " + "; ".join(errors[:3]), ""]
    return lines


def render(
    sections: Sequence[Sequence[str]],
    targets: Sequence[Target],
    env: Environment,
    command: str,
    settings: Settings,
    runtime_s: float,
    classic: bool = True,
    skipped: Sequence[str] = (),
) -> str:
    """The whole markdown document: header, targets, one section per workload, what was
    skipped."""
    lines = header(env, command, settings, runtime_s, classic) + targets_section(targets)
    for section in sections:
        lines += section
    if skipped:
        lines += ["## Skipped", "", *(f"- {note}" for note in skipped), ""]
    return "\n".join(lines).rstrip() + "\n"


def gpu_appendix(path: Path) -> str:
    """The GPU report (made on a GPU machine, see bench/gpu_run.sh) as the last section of the
    CPU one, so that BENCHMARKS.md holds every figure; nothing when there is none."""
    if not path.is_file():
        return ""
    body = path.read_text().split("\n", 1)[1].strip()
    body = "\n".join(f"#{line}" if line.startswith("#") else line for line in body.splitlines())
    return f"\n# GPU figures (from {path.name}, taken on the GPU machine)\n\n{body}\n"
