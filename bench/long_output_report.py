"""The long-output section of ``BENCHMARKS.md``."""

from __future__ import annotations

import math

from .long_output import (
    EDGE_TOKENS,
    TOGETHER_RATE_SHARE,
    LongOutputResult,
    Measured,
    Run,
    layout_targets,
)
from .report import num, spread, table
from .stats import Spread, median

COLUMNS = (
    "layout",
    "run",
    "tokens/s (median [min–max])",
    "TTFT ms",
    "ITL p50 / p99 ms",
    "server CPU s / 1k tokens",
    "errors",
)


def _row(label: str, run: Run, measured: list[Measured]) -> list[str]:
    errors = sum(len(m.errors) for m in measured)
    requests = sum(len(m.traces) for m in measured)
    itl = f"{num(median([m.itl_ms(50) for m in measured]), 2)} / "
    itl += num(median([m.itl_ms(99) for m in measured]), 2)
    return [
        label,
        run.label if run.requests == 1 else f"{run.label} ({run.requests} in turn)",
        spread(Spread.of([m.tokens_per_s for m in measured]), 0),
        num(median([m.ttft_ms for m in measured])),
        itl,
        spread(Spread.of([m.cpu_per_1k for m in measured]), 2),
        f"{errors}/{requests}",
    ]


def _chunk_note(result: LongOutputResult) -> str:
    every = [m for layout in result.layouts for runs in layout.runs.values() for m in runs]
    split = [m for m in every if not m.one_token_chunks]
    if not split:
        return (
            "Every stream had one chunk per token (chunks = the usage chunk's "
            "`completion_tokens` = `max_tokens`): the ITL figures are per token."
        )
    return (
        f"{len(split)} of {len(every)} runs had streams with fewer chunks than tokens (several "
        "tokens in a chunk): their ITL figures are gaps between chunks, not tokens."
    )


def _edge_note(result: LongOutputResult) -> list[str]:
    alone = result.runs[1]
    notes = []
    for layout in result.layouts:
        edges = [m.edge_rates() for m in layout.runs.get(alone, [])]
        first, last = median([e[0] for e in edges]), median([e[1] for e in edges])
        if not math.isnan(first):
            notes.append(
                f"- {layout.label}: the {alone.tokens:,}-token stream ran at {num(first, 0)} "
                f"tokens/s over its first {EDGE_TOKENS:,} tokens, {num(last, 0)} over its last "
                f"{EDGE_TOKENS:,}."
            )
    return notes


def _alone_section(result: LongOutputResult) -> list[str]:
    """The model alone against the 8-stream target: what its own decode steps keep."""
    if not result.alone:
        return []
    _, _, short, long = result.runs
    rows = [
        [way.engine, num(way.short_rate, 0), num(way.long_rate, 0), f"{way.share:.2f}x"]
        for way in result.alone
    ]
    columns = (
        f"the model alone, {long.streams} rows",
        f"tokens/s at {short.tokens}",
        f"tokens/s at {long.tokens:,}",
        f"{long.tokens:,} against {short.tokens}",
    )
    one_thread = result.alone[0]
    beyond = [
        f"- {layout.label}: "
        + ", ".join(
            f"{num(1000 * run.streams * (1 / median(layout.rates(run)) - 1 / rate), 2)} ms "
            f"at {run.tokens:,} tokens"
            for run, rate in ((short, one_thread.short_rate), (long, one_thread.long_rate))
        )
        for layout in result.layouts
        if layout.runs
    ]
    return [
        f"The model alone, in the benchmark process before the servers start "
        f"(`bench/long_output_alone.py`): {long.streams} rows, the {long.streams} streams' "
        "prompts, greedy, to each length. The server keeps at most about what the model's own "
        "decode steps keep, more only where its own cost per step hides them; the "
        f"{long.streams}-stream target ({TOGETHER_RATE_SHARE}x) is measured against this.",
        "",
        *table(columns, rows),
        "",
        f"Each server's wall time per step of {long.streams} rows beyond the model alone's on "
        f"one thread (what the server adds: sampling, text, streaming, the hops between "
        f"processes), at both lengths; a figure that stays put means that what grows with the "
        f"answer is the model's own step:",
        "",
        *beyond,
        "",
    ]


def _layout_notes(result: LongOutputResult) -> list[str]:
    notes = []
    for layout in result.layouts:
        if layout.failure is not None:
            notes.append(f"- {layout.label}: {layout.failure}")
            continue
        idle = median(
            [1000 * m.idle_cpu_s / m.elapsed_s for ms in layout.runs.values() for m in ms]
        )
        notes.append(
            f"- {layout.label}: {layout.processes} process(es), ready in "
            f"{num(layout.startup_s)} s; the other layout's idle server meanwhile: "
            f"{num(idle, 0)} CPU ms/s."
        )
    return notes


def section(result: LongOutputResult) -> list[str]:
    """Method, the table (layout x run), each layout's target verdicts, notes."""
    rows = [
        _row(layout.label, run, layout.runs[run])
        for layout in result.layouts
        for run in result.runs
        if run in layout.runs
    ]
    verdicts = [
        f"- **{'PASS' if t.passed else 'FAIL'}** {t.name}: {t.detail}"
        for layout in result.layouts
        if layout.runs
        for t in layout_targets(result, layout)
    ]
    short, alone, short_together, together = result.runs
    return [
        f"## Long outputs: streamed generation to {alone.tokens:,} tokens, transformers backend",
        "",
        "Method. A random Llama (hidden 64, 2 layers, 16,384 positions, the tests' byte-level "
        "BPE tokenizer, EOS and lone bytes unreachable) served with `--backend huggingface` "
        "under `--api_workers 1` and `--api_workers 2`, both servers up, each round running "
        "every run on one then the other (the order flips each round), "
        f"{result.settings.long_output_rounds} round(s). Streamed OpenAI completions "
        "(`/openai/v1/completions`, `stream: true`), greedy, `ignore_eos: true`, exactly "
        "`max_tokens` tokens each (checked), closed loop from the benchmark process: one "
        f"stream of {short.tokens} tokens ({short.requests} requests in turn) and one of "
        f"{alone.tokens:,}; {together.streams} streams of {short_together.tokens} tokens "
        f"({short_together.requests} requests each in turn) and of {together.tokens:,}. "
        "Tokens/s is per stream for one stream, aggregate for several (tokens over the run's "
        "wall time); TTFT is the first token's chunk (median over the run's streams); ITL "
        "is the gap between consecutive chunks, client-side, all of the run's "
        "streams pooled; server CPU is utime + stime of the server and all its descendant "
        "processes (fronts, engine) from `/proc`, before and after the run, per 1,000 "
        "generated tokens. Figures are medians over rounds; targets use the median of the "
        "rounds' ratios.",
        "",
        *table(COLUMNS, rows),
        "",
        *verdicts,
        "",
        *_alone_section(result),
        _chunk_note(result),
        "",
        *_edge_note(result),
        *_layout_notes(result),
        "",
    ]
