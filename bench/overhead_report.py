"""The host overhead section of ``BENCHMARKS.md``."""

from __future__ import annotations

from .fastload import FastResult
from .overhead import (
    CONCURRENCY,
    DEFAULT,
    REFERENCE_CPU_MS,
    TWO_WORKERS,
    OverheadResult,
    VariantRuns,
    cpu_per_request,
    rate,
)
from .report import num, spread, table
from .stats import Spread, median

COLUMNS = (
    "configuration",
    "processes",
    "req/s (median [min–max])",
    "server CPU ms/req",
    "client CPU ms/req",
    "p50 / p99 ms",
    "errors",
    "health route req/s",
    "health route server CPU ms/req",
    "idle servers' CPU ms/s",
    "peak RSS MiB",
    "start s",
)


def _label(runs: VariantRuns, result: OverheadResult) -> str:
    if runs.variant.baseline:
        return f"baseline {result.baseline_ref} (default flags)"
    if runs.layout:
        return f"{runs.variant.label}: {runs.layout}"
    return runs.variant.label


def _row(runs: VariantRuns, result: OverheadResult) -> list[str]:
    predict, health = runs.predict, runs.health
    errors = sum(r.error_count for r in predict)
    answered = sum(r.answered for r in predict)
    idle = median([1000 * r.other_servers_cpu_s / r.elapsed_s for r in [*predict, *health]])
    return [
        _label(runs, result),
        str(runs.processes),
        spread(rate(runs), 0),
        spread(cpu_per_request(runs), 2),
        num(median([r.client_cpu_ms_per_request for r in predict]), 3),
        f"{_median_of(predict, 50)} / {_median_of(predict, 99)}",
        f"{errors}/{answered + errors}",
        spread(Spread.of([r.requests_per_s for r in health]), 0),
        num(median([r.server_cpu_ms_per_request for r in health]), 2),
        num(idle, 0),
        num(max(r.peak_rss_mb for r in predict), 0),
        num(runs.startup_s, 1),
    ]


def _median_of(runs: list[FastResult], q: float) -> str:
    return num(median([r.latency_ms(q) for r in runs]), 1)


def _ratios(result: OverheadResult) -> list[str]:
    lines = []
    default, base = result.runs(DEFAULT), result.baseline()
    if default is not None and base is not None:
        share = cpu_per_request(default).median / cpu_per_request(base).median
        lines.append(
            f"Server CPU per request, default flags against the baseline: {share:.2f}x "
            f"({rate(default).median / rate(base).median:.2f}x the requests/s)."
        )
    one, two = result.one_worker(), result.runs(TWO_WORKERS)
    if one is not None and two is not None:
        lines.append(
            f"`--api_workers 2` against one process: {rate(two).median / rate(one).median:.2f}x "
            f"the requests/s, {cpu_per_request(two).median / cpu_per_request(one).median:.2f}x "
            "the server CPU per request."
        )
    lines.append(
        f"For reference, the issue quotes {REFERENCE_CPU_MS} ms of server CPU per request, "
        "measured earlier on 2026-11-23 by another method; the target is against the baseline "
        "measured in this run."
    )
    return [" ".join(lines)]


def _method(result: OverheadResult) -> str:
    settings = result.settings
    flags = " ".join(settings.server_args)
    served = f"default flags plus `{flags}`" if flags else "default flags, request log on"
    return (
        "Method. The model is a `BertForSequenceClassification` with 2 layers, hidden size 32, "
        "2 heads and intermediate size 37 on all-MiniLM-L6-v2's tokenizer and vocabulary "
        "(random weights): its forward pass costs next to nothing, so the server's CPU time is "
        "its host overhead (HTTP, JSON, validation, tokenization, batching, request log, hops "
        "between threads and processes). Each request is one sentence on V1 `:predict` "
        f"({served}). "
        f"Closed loop at c={CONCURRENCY}: keep-alive connections, each sending its next "
        "prebuilt request when the last one answered (asyncio protocols on uvloop, in "
        f"{result.client_processes} client process(es) of their own; no health prober). "
        f"{settings.duration_s:.0f} s per run after {settings.warmup_s:.0f} s of warm-up, "
        f"{settings.repeats} repeat(s), the servers in turn within each repeat (all of them up "
        "the whole time; the idle ones' CPU is in the table). Server CPU per request = user + "
        "system CPU seconds of the server process and all its descendants over the run / "
        "answered requests; client CPU likewise for the client processes. The health route "
        f"is `GET /v2/health/live` at the same concurrency for {settings.duration_s / 2:g} s "
        "per repeat, on the same servers. The baseline is the server's code at "
        f"`{result.baseline_ref}` (from `git archive`), run with the same interpreter and "
        "packages."
    )


def section(result: OverheadResult) -> list[str]:
    """Title, method, the table, the ratios and what did not run."""
    lines = [
        f"## Host overhead: single-text V1 :predict on a 2-layer, hidden-32 BERT, c={CONCURRENCY}",
        "",
        _method(result),
        "",
    ]
    measured = [runs for runs in result.variants if runs.predict]
    lines += table(COLUMNS, [_row(runs, result) for runs in measured])
    lines += ["", *_ratios(result), ""]
    notes = [f"{runs.variant.label} {runs.failure}" for runs in result.variants if runs.failure]
    if result.baseline_note:
        notes.append(result.baseline_note)
    errors = [e for runs in measured for r in runs.predict for e in r.errors]
    if errors:
        notes.append("first errors: " + "; ".join(errors[:3]))
    if notes:
        lines += ["Not measured or failed: " + " ".join(f"{n}." for n in notes), ""]
    return lines
