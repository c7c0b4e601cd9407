"""GPU mode (``python -m bench --device cuda``): real-sized models on one GPU, short runs.

- ``encoder``: a classifier with bert-base's dimensions. Plain torch (tokenize + forward +
  argmax) in fp32 and fp16 at batch sizes up to 256, against the server in each dtype
  (:data:`SERVER_ARGS`, :data:`ENCODER_DTYPES`) under single-text V1 requests at concurrency 1,
  64 and 256, and 16 texts per request at concurrency 64, from :data:`CLIENT_PROCESSES` lean
  client processes (:mod:`bench.fastload`).
- ``generation``: a Llama with TinyLlama-1.1B's dimensions. Plain ``generate`` at batch 1 and
  32 (eager, transformers' dynamic cache) and at batch 32 with transformers' static cache, which
  ``generate`` compiles on a GPU (``torch.compile``), against streamed completions at
  concurrency 1 and 32, :data:`MAX_TOKENS` tokens each.
- ``lora``: :mod:`bench.lora`'s workload (base-model and adapter requests in one batch against
  the base model alone) on that Llama, where the decode steps of adapter rows replay CUDA
  graphs.

The targets are issue 32's. Each workload fits well inside one 10-minute command on the device
(see ``bench/gpu_run.sh``). ``--rehearse`` runs both on this machine's CPU with models of the same
architectures a few thousandths the size (:data:`bench.gpu_models.REHEARSAL`): every step of the
GPU run, its figures meaningless, so that a GPU session's minutes are not spent finding a bug.
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import plans, routes, server, texts
from .fastload import FastResult, LoadClients
from .gpu_models import GpuModels
from .load import Budget, LoadResult, run_load
from .raw import EncoderCeiling, GenerationCeiling, encoder_ceiling, generation_ceiling
from .summary import summarize
from .targets import Target
from .workloads import Settings

logger = logging.getLogger(__name__)

GENERATION_MODEL = "A Llama with TinyLlama-1.1B's dimensions (random weights, bf16)"
"""The generation model as the LoRA workload's report names it."""
SERVER_ARGS = {
    "encoder": (),
    "generation": ("--backend", "huggingface"),
}
"""The server's flags on the GPU, beyond the model: default flags (on a GPU 256 encoder rows a
batch, as plain torch's best batch; the decode rows sized to the memory; the Llama in its
checkpoint's bf16), the Llama on the transformers backend (the GPU machine has no vLLM; a
rehearsal's CPU may)."""
ENCODER_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
"""Plain torch and the server (``--dtype``) in each, by label."""
ENCODER_NAME, GENERATION_NAME = "bert", "llama"
ENCODER_BATCH_SIZES = (1, 8, 32, 64, 128, 256)
RAW_BATCHES = 8
"""Plain torch: texts per batch size = this many batches (at least :data:`RAW_MIN_TEXTS`)."""
RAW_MIN_TEXTS = 64
SINGLE_CONCURRENCY = (1, 64, 256)
MULTI_TEXTS, MULTI_CONCURRENCY = 16, 64
CLIENT_PROCESSES = 8
"""Lean client processes sharing the connections: one saturates a core at thousands of
requests/s."""
GENERATION_BATCHES = (1, 32)
STATIC_BATCH = 32
"""Plain ``generate`` with the static cache (compiled on a GPU): at this batch size only."""
MAX_TOKENS = 128
GENERATION_DTYPE = torch.bfloat16
"""The checkpoint's dtype, which the server's ``--dtype auto`` keeps on a GPU and plain
``generate`` uses too."""
SINGLE_SHARE = {"fp32": 1.0, "fp16": 0.8}
"""Single-text requests at the highest concurrency: at least this share of plain torch's best
batched rate in the same dtype."""
MULTI_SHARE = 0.8
"""16 texts per request at c=64 (sequences/s): at least this share of it."""
EAGER_SHARE = {32: 1.0, 1: 0.9}
"""Streamed completions at each concurrency: at least this share of eager ``generate`` at the
same batch size."""
STATIC_SHARE = 0.4
"""At concurrency :data:`STATIC_BATCH`: at least this share of static-cache ``generate``."""
TTFT_P50_MS = 500.0
"""At concurrency 32: time to first token, median, at most this."""

GPU_SETTINGS = Settings(
    repeats=2,
    duration_s=5.0,
    warmup_s=2.0,
    generation_rounds=1,
    generation_min_requests=4,
)
GPU_QUICK = Settings(
    repeats=1,
    duration_s=2.0,
    warmup_s=1.0,
    generation_rounds=1,
    generation_min_requests=2,
)
REHEARSAL_SETTINGS = Settings(
    repeats=1,
    duration_s=1.0,
    warmup_s=0.5,
    generation_rounds=1,
    generation_min_requests=2,
)
"""``--rehearse``: every run once, as short as still exercises it."""


@dataclass
class GpuEncoderResult:
    """Plain torch by dtype, and the server's runs by (dtype, texts per request,
    concurrency)."""

    plain: dict[str, EncoderCeiling]
    """By dtype label (:data:`ENCODER_DTYPES`)."""
    runs: dict[tuple[str, int, int], list[FastResult]] = field(default_factory=dict)
    startup_s: dict[str, float] = field(default_factory=dict)
    """The server's start to ready, by dtype label."""
    server_said: dict[str, list[str]] = field(default_factory=dict)
    """How the server said it runs the model (:func:`said`), by dtype label."""
    settings: Settings = GPU_SETTINGS
    device: str = "cuda"

    def best(self, label: str) -> float:
        """Plain torch's best rate in dtype ``label`` (sequences/s)."""
        return self.plain[label].best_rate

    def sequences_per_s(self, label: str, texts_per_request: int, concurrency: int) -> float:
        runs = self.runs[(label, texts_per_request, concurrency)]
        return statistics.median(r.requests_per_s * texts_per_request for r in runs)

    def _share(self, label: str, texts: int, concurrency: int, share: float) -> Target:
        rate, best = self.sequences_per_s(label, texts, concurrency), self.best(label)
        what = "single-text V1" if texts == 1 else f"{texts} texts per request"
        return Target(
            f"gpu encoder {label}: {what} c={concurrency} >= {share:.1f}x plain torch {label} "
            "at its best batch",
            rate >= share * best,
            f"{rate:.0f} seq/s = {rate / best:.2f}x plain torch {label}, batch "
            f"{self.plain[label].best_batch}: {best:.0f} seq/s",
        )

    def targets(self) -> list[Target]:
        top = max(SINGLE_CONCURRENCY)
        checked = [self._share(label, 1, top, SINGLE_SHARE[label]) for label in self.plain]
        checked += [
            self._share(label, MULTI_TEXTS, MULTI_CONCURRENCY, MULTI_SHARE) for label in self.plain
        ]
        pairs = [
            (c, self.sequences_per_s("fp16", 1, c), self.sequences_per_s("fp32", 1, c))
            for c in SINGLE_CONCURRENCY
        ]
        checked.append(
            Target(
                "gpu encoder: fp16 at least as fast as fp32, single-text V1, at every concurrency",
                all(fp16 >= fp32 for _, fp16, fp32 in pairs),
                "; ".join(f"c={c}: {fp16:.0f} against {fp32:.0f} seq/s" for c, fp16, fp32 in pairs),
            )
        )
        return checked


@dataclass
class GpuGenerationResult:
    """Plain ``generate`` (eager by batch size, static cache at :data:`STATIC_BATCH`) and the
    server's streamed runs by concurrency."""

    plain: GenerationCeiling
    static: GenerationCeiling
    runs: dict[int, list[LoadResult]] = field(default_factory=dict)
    startup_s: float = math.nan
    settings: Settings = GPU_SETTINGS
    device: str = "cuda"
    server_said: list[str] = field(default_factory=list)
    """How the server said it runs the model (:func:`said`)."""

    def tokens_per_s(self, concurrency: int) -> float:
        return statistics.median(run.tokens_per_s for run in self.runs[concurrency])

    def targets(self) -> list[Target]:
        checked = []
        for concurrency, share in EAGER_SHARE.items():
            rate = self.tokens_per_s(concurrency)
            eager = statistics.median(self.plain.rates[concurrency])
            checked.append(
                Target(
                    f"gpu generation: streamed completions c={concurrency} >= {share:.1f}x eager "
                    f"generate at batch {concurrency}",
                    rate >= share * eager,
                    f"{rate:.0f} tokens/s = {rate / eager:.2f}x {eager:.0f}",
                )
            )
        rate = self.tokens_per_s(STATIC_BATCH)
        static = statistics.median(self.static.rates[STATIC_BATCH])
        checked.append(
            Target(
                f"gpu generation: streamed completions c={STATIC_BATCH} >= {STATIC_SHARE:.1f}x "
                f"static-cache compiled generate at batch {STATIC_BATCH}",
                rate >= STATIC_SHARE * static,
                f"{rate:.0f} tokens/s = {rate / static:.2f}x {static:.0f}"
                + ("" if self.device == "cuda" else " (not compiled: no GPU)"),
            )
        )
        ttft = summarize(self.runs[STATIC_BATCH], tokens=True).ttft_ms[0]
        checked.append(
            Target(
                f"gpu generation: TTFT p50 at c={STATIC_BATCH} <= {TTFT_P50_MS:.0f} ms",
                ttft <= TTFT_P50_MS,
                f"{ttft:.0f} ms",
            )
        )
        return checked


def _raw_texts(batch_size: int) -> list[str]:
    return texts.cycle(texts.SENTENCES, max(RAW_MIN_TEXTS, RAW_BATCHES * batch_size))


def _free_gpu() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _encoder_server(
    models: GpuModels,
    settings: Settings,
    log_dir: Path,
    label: str,
    result: GpuEncoderResult,
) -> None:
    """The server in dtype ``label``: every load once to warm up, then ``repeats`` times."""
    args = ["--model_dir", str(models.bert_base.resolve()), "--model_name", ENCODER_NAME]
    dtype = str(ENCODER_DTYPES[label]).removeprefix("torch.")
    args += [*SERVER_ARGS["encoder"], "--dtype", dtype, *settings.server_args]
    logger.info("gpu encoder: python -m huggingfaceserver %s", " ".join(args))
    loads = [(1, c) for c in SINGLE_CONCURRENCY] + [(MULTI_TEXTS, MULTI_CONCURRENCY)]
    log = log_dir / f"gpu-encoder-{label}.log"
    with (
        server.serving(args, log) as running,
        LoadClients(CLIENT_PROCESSES) as clients,
    ):
        result.startup_s[label] = running.ready_s
        pid, port = running.process.pid, running.http_port

        def cpu() -> float:
            return server.cpu_seconds(pid)

        for per_request, concurrency in loads:
            warm = plans.v1_predict(ENCODER_NAME, settings.warmup_s, per_request, port)
            clients.run(warm, concurrency)
        for repeat in range(settings.repeats):
            for per_request, concurrency in loads:
                plan = plans.v1_predict(ENCODER_NAME, settings.duration_s, per_request, port)
                run = clients.run(plan, concurrency, around=cpu)
                run.peak_rss_mb = server.peak_rss_mb(pid)
                result.runs.setdefault((label, per_request, concurrency), []).append(run)
                logger.info(
                    "  gpu encoder %s, %d text(s)/request, c=%d, repeat %d: %.0f seq/s, %d errors",
                    label,
                    per_request,
                    concurrency,
                    repeat + 1,
                    run.requests_per_s * per_request,
                    run.error_count,
                )
    result.server_said[label] = said(log.read_text(errors="replace"))


def measure_encoder(
    models: GpuModels, settings: Settings, log_dir: Path, device: str = "cuda"
) -> GpuEncoderResult:
    """Plain torch in each dtype, then the server in each at every concurrency, repeated."""
    if any(arg.split("=")[0] == "--dtype" for arg in settings.server_args):
        raise SystemExit(
            "gpu encoder: the server runs in fp32, then in fp16, by itself; drop --dtype from "
            "--server-arg"
        )
    ceilings = {}
    for label, dtype in ENCODER_DTYPES.items():
        logger.info("gpu encoder: plain torch %s", label)
        ceilings[label] = encoder_ceiling(
            models.bert_base,
            "sequence_classification",
            _raw_texts,
            ENCODER_BATCH_SIZES,
            settings.repeats,
            device=device,
            dtype=dtype,
        )
        _free_gpu()
    result = GpuEncoderResult(ceilings, settings=settings, device=device)
    for label in ENCODER_DTYPES:
        _encoder_server(models, settings, log_dir, label, result)
    return result


def measure_generation(
    models: GpuModels, settings: Settings, log_dir: Path, device: str = "cuda"
) -> GpuGenerationResult:
    """Plain ``generate`` (eager at batch 1 and 32, static cache at 32), then streamed
    completions at c=1 and 32."""
    path = models.tinyllama
    prompts = texts.prompts()
    plain = {}
    for label, batches, cache in (
        ("eager", GENERATION_BATCHES, None),
        ("static cache", (STATIC_BATCH,), "static"),
    ):
        logger.info("gpu generation: plain generate, %s", label)
        plain[label] = generation_ceiling(
            path,
            prompts,
            batches,
            MAX_TOKENS,
            settings.repeats,
            device=device,
            dtype=GENERATION_DTYPE,
            cache_implementation=cache,
        )
        torch.compiler.reset()  # the compiled forward and its graphs' memory go with the model
        _free_gpu()
    result = GpuGenerationResult(
        plain["eager"], plain["static cache"], settings=settings, device=device
    )
    args = ["--model_dir", str(path.resolve()), "--model_name", GENERATION_NAME]
    args += [*SERVER_ARGS["generation"], *settings.server_args]
    logger.info("gpu generation: python -m huggingfaceserver %s", " ".join(args))
    log = log_dir / "gpu-generation.log"
    with server.serving(args, log) as running:
        result.startup_s = running.ready_s
        call = routes.openai_completion_stream(running.url, GENERATION_NAME, prompts, MAX_TOKENS)
        pid = running.process.pid
        run_load(call, max(GENERATION_BATCHES), Budget(requests=1), None, running.http_port)
        for repeat in range(settings.repeats):
            for concurrency in GENERATION_BATCHES:
                budget = Budget(requests=settings.generation_requests(concurrency))
                cpu = server.cpu_seconds(pid)
                run = run_load(call, concurrency, budget, None, running.http_port)
                run.server_cpu_s = server.cpu_seconds(pid) - cpu
                run.peak_rss_mb = server.peak_rss_mb(pid)
                result.runs.setdefault(concurrency, []).append(run)
                logger.info(
                    "  gpu generation, c=%d, repeat %d: %.0f tokens/s, %d errors",
                    concurrency,
                    repeat + 1,
                    run.tokens_per_s,
                    len(run.errors),
                )
    result.server_said = said(log.read_text(errors="replace"))
    return result


SAID = (
    "backend ",
    "loaded ",
    "batches of up to ",
    "KV cache up to ",
    "decoding up to ",
    "decode steps compiled",
    "intra-op threads",
)
"""The server's log lines that say how it runs the model (the report quotes them)."""
WARNINGS_QUOTED = 5


def said(log: str) -> list[str]:
    """The first of each of :data:`SAID`'s lines in a server's log, then its first
    :data:`WARNINGS_QUOTED` warnings (a step that could not be recorded, say), without their
    prefixes."""
    lines = log.splitlines()
    quoted = []
    for start in SAID:
        found = next((line for line in lines if f" INFO {start}" in line), None)
        if found is not None:
            quoted.append(found.split(" INFO ", 1)[1])
    warnings = [line.split(" WARNING ", 1)[1] for line in lines if " WARNING " in line]
    return quoted + [f"warning: {line}" for line in warnings[:WARNINGS_QUOTED]]
