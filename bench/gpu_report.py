"""The GPU mode's sections of the report."""

from __future__ import annotations

import statistics

from .fastload import FastResult
from .gpu import (
    CLIENT_PROCESSES,
    ENCODER_BATCH_SIZES,
    GENERATION_DTYPE,
    MAX_TOKENS,
    RAW_BATCHES,
    SERVER_ARGS,
    STATIC_BATCH,
    GpuEncoderResult,
    GpuGenerationResult,
)
from .gpu_models import REHEARSAL, Dims
from .raw import EncoderCeiling
from .report import num, spread, table, triple
from .stats import Spread, median, percentile
from .summary import summarize

ENCODER_COLUMNS = (
    "configuration",
    "C",
    "sequences/s (median [min–max])",
    "of plain best, same dtype",
    "p50 ms",
    "p99 ms",
    "errors",
    "CPU server / client (cores)",
    "peak RSS MiB",
)
GENERATION_COLUMNS = (
    "configuration",
    "C",
    "tokens/s (median [min–max])",
    "of plain generate",
    "TTFT p50 / p95 / p99 ms",
    "p50 ms",
    "errors",
    "CPU server / client (cores)",
    "peak RSS MiB",
)


def _flags(name: str) -> str:
    flags = " ".join(SERVER_ARGS[name])
    return f"default flags plus `{flags}`" if flags else "default flags"


def _plain_rows(label: str, ceiling: EncoderCeiling, best: float) -> list[list[str]]:
    alone = Spread.of(ceiling.rates[1])
    top = Spread.of(ceiling.rates[ceiling.best_batch])
    single = [percentile(ceiling.single_ms, q) for q in (50, 99)]
    rest = ["–"] * 3
    rows = [
        [f"plain torch {label}, batch 1", "–", spread(alone, 0), f"{alone.median / best:.0%}"]
        + [*map(num, single), *rest]
    ]
    if ceiling.best_batch != 1:
        rows.append(
            [f"plain torch {label}, batch {ceiling.best_batch}", "–", spread(top, 0)]
            + [f"{top.median / best:.0%}", "–", "–", *rest]
        )
    return rows


def _server_row(label: str, per_request: int, runs: list[FastResult], best: float) -> list[str]:
    rate = Spread.of([r.requests_per_s * per_request for r in runs])
    errors = sum(r.error_count for r in runs)
    answered = sum(r.answered for r in runs)
    server_cores = median([r.server_cpu_s / r.elapsed_s for r in runs])
    client_cores = median([r.client_cpu_s / r.elapsed_s for r in runs])
    texts = "1 text" if per_request == 1 else f"{per_request} texts"
    return [
        f"server {label}, {texts} per request (V1)",
        str(runs[0].concurrency),
        spread(rate, 0),
        f"{rate.median / best:.0%}",
        num(median([r.latency_ms(50) for r in runs])),
        num(median([r.latency_ms(99) for r in runs])),
        f"{errors}/{answered + errors}",
        f"{num(server_cores, 2)} / {num(client_cores, 2)}",
        num(max(r.peak_rss_mb for r in runs), 0),
    ]


def _by_batch(label: str, ceiling: EncoderCeiling) -> str:
    rates = ", ".join(f"{size}: {statistics.median(r):.0f}" for size, r in ceiling.rates.items())
    return f"{label}: {rates}"


def encoder_section(result: GpuEncoderResult) -> list[str]:
    """Plain torch by dtype, then the server per request size and concurrency."""
    rows = []
    for label, ceiling in result.plain.items():
        rows += _plain_rows(label, ceiling, result.best(label))
    for (label, per_request, _), runs in result.runs.items():
        rows.append(_server_row(label, per_request, runs, result.best(label)))
    settings = result.settings
    started = ", ".join(f"{label} {s:.0f} s" for label, s in result.startup_s.items())
    return [
        "## GPU encoder: BERT with bert-base's dimensions (hidden 768, 12 layers), random weights"
        + rehearsal_note(result.device, REHEARSAL.bert),
        "",
        "Method. Plain torch: tokenizer + forward + argmax under `torch.inference_mode` on the "
        f"{_where(result.device)}, results copied back to the CPU, padded per batch, fp32 (what "
        "the server's `--dtype auto` gives an encoder) and fp16; batch sizes "
        f"{', '.join(map(str, ENCODER_BATCH_SIZES))}, {RAW_BATCHES} batches each. The server: "
        f"{_flags('encoder')}, with `--dtype float32`, then with `--dtype float16`; "
        "single-sentence and 16-sentence V1 `:predict` requests from "
        f"{CLIENT_PROCESSES} lean client processes sharing the connections (keep-alive, "
        f"prebuilt requests), {settings.duration_s:.0f} s per run after "
        f"{settings.warmup_s:g} s of warm-up, {settings.repeats} repeat(s). Rates are "
        "sequences/s (requests/s times texts per request).",
        "",
        *table(ENCODER_COLUMNS, rows),
        "",
        "Plain torch sequences/s by batch size (median): "
        + "; ".join(_by_batch(label, ceiling) for label, ceiling in result.plain.items())
        + ".",
        "",
        f"Server start to ready: {started}. Its log on how it runs the model:",
        "",
        *(f"- {label}: `{line}`" for label, lines in result.server_said.items() for line in lines),
        "",
    ]


def _where(device: str) -> str:
    return "GPU" if device == "cuda" else "CPU"


def rehearsal_note(device: str, dims: Dims) -> str:
    """What a section's title adds when its figures are a rehearsal's (nothing on a GPU)."""
    if device == "cuda":
        return ""
    return (
        f" – REHEARSAL on the CPU with the same architecture at hidden {dims.hidden} and "
        f"{dims.layers} layers (`--rehearse`): the figures say nothing of a GPU"
    )


def generation_section(result: GpuGenerationResult) -> list[str]:
    """Plain ``generate`` by batch, then streamed completions by concurrency."""
    plain = result.plain
    rows = [
        [f"plain generate, batch {size}", "–", spread(Spread.of(rates), 0), "100%"] + ["–"] * 5
        for size, rates in plain.rates.items()
    ]
    static = Spread.of(result.static.rates[STATIC_BATCH])
    compiled = " + torch.compile" if result.device == "cuda" else ""
    eager_share = static.median / statistics.median(plain.rates[STATIC_BATCH])
    rows.append(
        [f"plain generate, static cache{compiled}, batch {STATIC_BATCH}", "–", spread(static, 0)]
        + [f"{eager_share:.0%}"]
        + ["–"] * 5
    )
    for concurrency, runs in result.runs.items():
        summary = summarize(runs, tokens=True)
        reference = plain.rates.get(concurrency)
        share = f"{summary.rate.median / statistics.median(reference):.0%}" if reference else "–"
        rows.append(
            ["server, streamed completions", str(concurrency), spread(summary.rate, 0), share]
            + [triple(summary.ttft_ms), num(summary.latency_ms[0])]
            + [f"{len(summary.errors)}/{summary.requests}"]
            + [" / ".join(num(cores, 2) for cores in summary.cpu_cores)]
            + [num(summary.peak_rss_mb, 0)]
        )
    low, high = plain.prompt_tokens
    settings = result.settings
    dtype = str(GENERATION_DTYPE).removeprefix("torch.")
    return [
        "## GPU generation: Llama with TinyLlama-1.1B's dimensions, random weights, EOS "
        f"unreachable, max_tokens={MAX_TOKENS}" + rehearsal_note(result.device, REHEARSAL.llama),
        "",
        f"Method. Plain `model.generate` on the {_where(result.device)}, in {dtype} (the "
        "checkpoint's dtype), with transformers' dynamic cache (eager), and at batch "
        f'{STATIC_BATCH} with its static cache (`cache_implementation="static"`, which '
        "`generate` compiles on a GPU: `torch.compile`, CUDA graphs), greedy, left-padded, "
        f"{settings.repeats} repeat(s) after two warm-ups. The share column is against eager "
        "`generate` at the same batch size. The server: "
        f"{_flags('generation')}; streamed `/openai/v1/completions`, greedy, exactly "
        f"{MAX_TOKENS} new tokens each (checked from the usage chunk), closed loop (aiohttp, "
        f"in the benchmark process), {settings.generation_rounds} request(s) per worker and at "
        f"least {settings.generation_min_requests} per run, {settings.repeats} repeat(s). "
        f"Prompts of {low}–{high} tokens. TTFT is the first token's chunk.",
        "",
        *table(GENERATION_COLUMNS, rows),
        "",
        f"Server start to ready: {result.startup_s:.0f} s. Its log on how it runs the model:",
        "",
        *(f"- `{line}`" for line in result.server_said),
        "",
    ]
