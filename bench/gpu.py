"""GPU mode (``python -m bench --device cuda``): real-sized models on one GPU, short runs.

- ``encoder``: a classifier with bert-base's dimensions. Plain torch (tokenize + forward +
  argmax, fp32 as the server's ``--dtype auto`` gives for encoders, and fp16) at batch sizes
  up to 256, against the server (:data:`SERVER_ARGS`) under single-text V1 requests at
  concurrency 1, 64 and 256, and 16 texts per request at concurrency 64, from
  :data:`CLIENT_PROCESSES` lean client processes (:mod:`bench.fastload`).
- ``generation``: a Llama with TinyLlama-1.1B's dimensions. Plain ``generate`` at batch 1 and
  32 against streamed completions at concurrency 1 and 32, :data:`MAX_TOKENS` tokens each.

Each workload fits well inside one 10-minute command on the device (see ``bench/gpu_run.sh``).
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
from .targets import Target
from .workloads import Settings

logger = logging.getLogger(__name__)

SERVER_ARGS = {
    "encoder": ("--max_batch_size", "256"),
    "generation": ("--dtype", "bfloat16"),
}
"""The server's flags on the GPU, beyond the model: default flags, plus a batch size for the
encoder that matches the plain torch best batch, and the Llama in bf16 as GPU.md measured it."""
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
MAX_TOKENS = 128
GENERATION_DTYPE = torch.bfloat16
"""The checkpoint's dtype, which the server is given (``--dtype bfloat16``; ``auto`` would be
fp16) and plain ``generate`` uses too."""
SINGLE_SHARE = 0.6
"""Single-text requests at c=256: at least this share of plain torch's best batched rate."""
MULTI_SHARE = 0.8
"""16 texts per request at c=64 (sequences/s): at least this share of it."""

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


@dataclass
class GpuEncoderResult:
    """Plain torch by dtype, and the server's runs by (texts per request, concurrency)."""

    plain: dict[str, EncoderCeiling]
    """By dtype label (``fp32``, ``fp16``)."""
    runs: dict[tuple[int, int], list[FastResult]] = field(default_factory=dict)
    startup_s: float = math.nan
    settings: Settings = GPU_SETTINGS

    @property
    def best(self) -> float:
        """Plain torch fp32's best rate (sequences/s): the reference of the targets."""
        return self.plain["fp32"].best_rate

    def sequences_per_s(self, texts_per_request: int, concurrency: int) -> float:
        runs = self.runs[(texts_per_request, concurrency)]
        return statistics.median(r.requests_per_s * texts_per_request for r in runs)

    def targets(self) -> list[Target]:
        single = self.sequences_per_s(1, max(SINGLE_CONCURRENCY))
        multi = self.sequences_per_s(MULTI_TEXTS, MULTI_CONCURRENCY)
        reference = f"plain torch fp32, batch {self.plain['fp32'].best_batch}: {self.best:.0f}"
        return [
            Target(
                f"gpu encoder: single-text V1 c={max(SINGLE_CONCURRENCY)} >= {SINGLE_SHARE:.0%} "
                "of plain torch's best batched rate",
                single >= SINGLE_SHARE * self.best,
                f"{single:.0f} seq/s = {single / self.best:.0%} of {reference} seq/s",
            ),
            Target(
                f"gpu encoder: {MULTI_TEXTS} texts per request c={MULTI_CONCURRENCY} >= "
                f"{MULTI_SHARE:.0%} of plain torch's best batched rate",
                multi >= MULTI_SHARE * self.best,
                f"{multi:.0f} seq/s = {multi / self.best:.0%} of {reference} seq/s",
            ),
        ]


@dataclass
class GpuGenerationResult:
    """Plain ``generate`` and the server's streamed runs by concurrency."""

    plain: GenerationCeiling
    runs: dict[int, list[LoadResult]] = field(default_factory=dict)
    startup_s: float = math.nan
    settings: Settings = GPU_SETTINGS

    def targets(self) -> list[Target]:
        return []  # reported as ratios only


def _raw_texts(batch_size: int) -> list[str]:
    return texts.cycle(texts.SENTENCES, max(RAW_MIN_TEXTS, RAW_BATCHES * batch_size))


def _free_gpu() -> None:
    torch.cuda.empty_cache()


def measure_encoder(models: GpuModels, settings: Settings, log_dir: Path) -> GpuEncoderResult:
    """Plain torch (fp32, fp16), then the server at every concurrency, repeated."""
    path = models.bert_base
    ceilings = {}
    for label, dtype in (("fp32", torch.float32), ("fp16", torch.float16)):
        logger.info("gpu encoder: plain torch %s", label)
        ceilings[label] = encoder_ceiling(
            path,
            "sequence_classification",
            _raw_texts,
            ENCODER_BATCH_SIZES,
            settings.repeats,
            device="cuda",
            dtype=dtype,
        )
        _free_gpu()
    result = GpuEncoderResult(ceilings, settings=settings)
    args = ["--model_dir", str(path.resolve()), "--model_name", ENCODER_NAME]
    args += [*SERVER_ARGS["encoder"], *settings.server_args]
    logger.info("gpu encoder: python -m huggingfaceserver %s", " ".join(args))
    loads = [(1, c) for c in SINGLE_CONCURRENCY] + [(MULTI_TEXTS, MULTI_CONCURRENCY)]
    with (
        server.serving(args, log_dir / "gpu-encoder.log") as running,
        LoadClients(CLIENT_PROCESSES) as clients,
    ):
        result.startup_s = running.ready_s
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
                result.runs.setdefault((per_request, concurrency), []).append(run)
                logger.info(
                    "  gpu encoder, %d text(s)/request, c=%d, repeat %d: %.0f seq/s, %d errors",
                    per_request,
                    concurrency,
                    repeat + 1,
                    run.requests_per_s * per_request,
                    run.error_count,
                )
    return result


def measure_generation(models: GpuModels, settings: Settings, log_dir: Path) -> GpuGenerationResult:
    """Plain ``generate`` at batch 1 and 32, then streamed completions at c=1 and 32."""
    path = models.tinyllama
    prompts = texts.prompts()
    logger.info("gpu generation: plain generate")
    ceiling = generation_ceiling(
        path,
        prompts,
        GENERATION_BATCHES,
        MAX_TOKENS,
        settings.repeats,
        device="cuda",
        dtype=GENERATION_DTYPE,
    )
    _free_gpu()
    result = GpuGenerationResult(ceiling, settings=settings)
    args = ["--model_dir", str(path.resolve()), "--model_name", GENERATION_NAME]
    args += [*SERVER_ARGS["generation"], *settings.server_args]
    logger.info("gpu generation: python -m huggingfaceserver %s", " ".join(args))
    with server.serving(args, log_dir / "gpu-generation.log") as running:
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
    return result
