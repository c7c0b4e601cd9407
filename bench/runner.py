"""Running a workload: the raw ceiling first (no server up), then the server in each mode."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

from . import raw, server, texts
from .health import HealthProber
from .load import Budget, LoadResult, run_load
from .models import BenchModels
from .routes import Call
from .workloads import MAX_TOKENS, Kind, Mode, Settings, Workload

logger = logging.getLogger(__name__)
WARMUP_GENERATION_CONCURRENCY = 4


@dataclass
class ModeRuns:
    """The loaded runs of one server mode: ``(route label, concurrency)`` -> one per repeat."""

    mode: Mode
    runs: dict[tuple[str, int], list[LoadResult]] = field(default_factory=dict)
    startup_s: float = math.nan


@dataclass
class WorkloadResult:
    """Everything measured for one workload."""

    workload: Workload
    raw: raw.EncoderCeiling | raw.GenerationCeiling
    modes: list[ModeRuns]


def measure_raw(
    workload: Workload, model_dir: Path, settings: Settings
) -> raw.EncoderCeiling | raw.GenerationCeiling:
    """The plain ceiling for ``workload``'s model: encoders on the runtime the server runs
    them on with default flags (ONNX Runtime, the server's export), generation on transformers."""
    if workload.kind is Kind.ENCODER:
        sentences = texts.cycle(texts.SENTENCES, settings.raw_texts)
        return raw.encoder_ceiling(
            model_dir,
            workload.task,
            sentences,
            settings.raw_batch_sizes,
            settings.repeats,
            runtime="onnx",
        )
    return raw.generation_ceiling(
        model_dir,
        texts.prompts(),
        workload.concurrency,
        MAX_TOKENS,
        settings.repeats,
    )


def budget(workload: Workload, settings: Settings, concurrency: int) -> Budget:
    """A fixed time for encoder runs, a fixed number of requests per worker for generation."""
    if workload.kind is Kind.ENCODER:
        return Budget(duration_s=settings.duration_s)
    return Budget(requests=settings.generation_requests(concurrency))


def warm_up(workload: Workload, settings: Settings, url: str, port: int) -> None:
    """A little load on every route before measuring: first calls allocate and compile."""
    for route in workload.routes:
        call = route.make_call(url, workload.model_name)
        if workload.kind is Kind.ENCODER:
            run_load(call, workload.loaded, Budget(duration_s=settings.warmup_s), None, port)
        else:
            run_load(call, WARMUP_GENERATION_CONCURRENCY, Budget(requests=1), None, port)


def measure_once(
    workload: Workload,
    call: Call,
    concurrency: int,
    settings: Settings,
    prober: HealthProber,
    running: server.Server,
) -> LoadResult:
    """One loaded run, with the server's CPU time and peak memory."""
    pid = running.process.pid
    server_cpu = server.cpu_seconds(pid)
    run = run_load(
        call, concurrency, budget(workload, settings, concurrency), prober, running.http_port
    )
    run.server_cpu_s = server.cpu_seconds(pid) - server_cpu
    run.peak_rss_mb = server.peak_rss_mb(pid)
    return run


def measure_mode(
    workload: Workload,
    mode: Mode,
    model_dir: Path,
    settings: Settings,
    prober: HealthProber,
    log_dir: Path,
) -> ModeRuns:
    """Start the server in ``mode``, warm it up, then every route and concurrency, repeated
    (repeats outermost, so that a noisy minute spreads over all of them)."""
    args = ["--model_dir", str(model_dir), "--model_name", workload.model_name]
    args += [*workload.server_args, *mode.args, *settings.server_args]
    result = ModeRuns(mode)
    log_path = log_dir / f"{workload.key}-{mode.label.replace(' ', '-')}.log"
    logger.info("%s, %s: python -m huggingfaceserver %s", workload.key, mode.label, " ".join(args))
    with server.serving(args, log_path) as running:
        result.startup_s = running.ready_s
        warm_up(workload, settings, running.url, running.http_port)
        for repeat in range(settings.repeats):
            for route in workload.routes:
                call = route.make_call(running.url, workload.model_name)
                for concurrency in workload.concurrency:
                    run = measure_once(workload, call, concurrency, settings, prober, running)
                    result.runs.setdefault((route.label, concurrency), []).append(run)
                    _log_run(workload, mode, route.label, repeat, run)
    return result


def _log_run(workload: Workload, mode: Mode, route: str, repeat: int, run: LoadResult) -> None:
    rate = (
        f"{run.tokens_per_s:.0f} tokens/s"
        if workload.kind is Kind.GENERATION
        else f"{run.requests_per_s:.1f} req/s"
    )
    logger.info(
        "  %s, %s, %s, c=%d, repeat %d: %s, %d errors",
        workload.key,
        mode.label,
        route,
        run.concurrency,
        repeat + 1,
        rate,
        len(run.errors),
    )


def measure_workload(
    workload: Workload,
    models: BenchModels,
    settings: Settings,
    prober: HealthProber,
    log_dir: Path,
) -> WorkloadResult:
    """Raw ceiling, then the server in each of the workload's modes."""
    model_dir = workload.model_dir(models)
    logger.info("%s: raw ceiling", workload.key)
    ceiling = measure_raw(workload, model_dir, settings)
    modes = [
        measure_mode(workload, mode, model_dir, settings, prober, log_dir)
        for mode in workload.modes
    ]
    return WorkloadResult(workload, ceiling, modes)
