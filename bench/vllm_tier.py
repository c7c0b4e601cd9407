"""vLLM's own OpenAI server against this server on vLLM, on the same model and engine flags.

``vllm serve MODEL`` (started as ``python -m vllm.entrypoints.cli.main serve``, with this
interpreter) and ``python -m huggingfaceserver --backend vllm`` serve the benchmark Llama
(:func:`bench.models.build_llama`: EOS unreachable, so every request generates exactly
``max_tokens``) with :data:`ENGINE_FLAGS`. Both are started once and kept up; streamed
completions at each concurrency alternate between them (ours, vLLM's, ours, vLLM's, ...) for
:func:`rounds` rounds. A single run's rate moves by 10-15% on this shared machine, more than the
5% the target allows, so the target is the median over rounds of each round's ratio (ours over
vLLM's, measured a few seconds apart): drift that slows both cancels out of it.
Our route is ``/openai/v1/completions``, vLLM's ``/v1/completions``.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import statistics
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from . import routes, server, texts
from .environment import package_version
from .load import Budget, LoadResult, run_load
from .report import num, spread, table, triple
from .summary import summarize
from .targets import Target
from .workloads import MAX_TOKENS, Settings

logger = logging.getLogger(__name__)

KEY = "vllm"
MODEL_NAME = "llm"
CONCURRENCY = (1, 16)
SHARE = 0.95
"""Our tokens/s at each concurrency: at least this share of ``vllm serve``'s."""
PAIRED_ROUNDS = 7
"""Rounds in a full run (one in a ``--repeats 1`` smoke run)."""
ENGINE_FLAGS = ("--enforce-eager", "--max-model-len", "256", "--dtype", "float32")
"""Given to both servers (``--dtype`` is ours too: float32 is what ``auto`` gives on a CPU)."""
KV_CACHE_GIB = "1"
COLUMNS = (
    "server",
    "C",
    "tokens/s (median [min–max])",
    "of vLLM's",
    "p50 ms",
    "TTFT p50 / p95 / p99 ms",
    "errors",
    "CPU server / client",
    "other server's CPU",
    "peak RSS MiB",
    "start s",
)


def unavailable() -> str | None:
    """Why this workload cannot run here, None when it can."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (make install-vllm)"
    return None


def vllm_env(root: Path) -> dict[str, str]:
    """vLLM's CPU settings: a small KV cache; its caches and IPC sockets under ``root``."""
    rpc = root / "rpc"
    rpc.mkdir(parents=True, exist_ok=True)
    return {
        "VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB,
        "VLLM_CACHE_ROOT": str(root / "vllm-cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor-cache"),
        "VLLM_RPC_BASE_PATH": str(rpc),
    }


@dataclass
class ServerRuns:
    """One of the two servers: its runs by concurrency (one per round)."""

    label: str
    path: str
    command: str
    """How it was started, for the report (the model folder as MODEL)."""
    runs: dict[int, list[LoadResult]] = field(default_factory=dict)
    startup_s: float = math.nan

    def rate(self, concurrency: int) -> float:
        return statistics.median(run.tokens_per_s for run in self.runs[concurrency])


def rounds(settings: Settings) -> int:
    """How many alternated rounds: :data:`PAIRED_ROUNDS`, or one for a smoke run."""
    return 1 if settings.repeats == 1 else PAIRED_ROUNDS


@dataclass
class VllmTierResult:
    """Both servers' runs."""

    ours: ServerRuns
    theirs: ServerRuns
    settings: Settings
    prompt_count: int

    def targets(self) -> list[Target]:
        return [self._target(c) for c in CONCURRENCY]

    def paired_ratio(self, concurrency: int) -> float:
        """The median over rounds of ours / vLLM's in that round."""
        pairs = zip(self.ours.runs[concurrency], self.theirs.runs[concurrency], strict=True)
        return statistics.median(mine.tokens_per_s / theirs.tokens_per_s for mine, theirs in pairs)

    def _target(self, concurrency: int) -> Target:
        ours, theirs = self.ours.rate(concurrency), self.theirs.rate(concurrency)
        ratio = self.paired_ratio(concurrency)
        return Target(
            f"{KEY}: this server on vLLM, streamed completions c={concurrency} >= {SHARE:.0%} of "
            "`vllm serve`",
            ratio >= SHARE,
            f"median of the {len(self.ours.runs[concurrency])} alternated rounds' ratios "
            f"{ratio:.0%}; medians of the rates {ours:.0f} tokens/s against {theirs:.0f} "
            f"tokens/s ({ours / theirs:.0%})",
        )

    def section(self) -> list[str]:
        return _section(self)


def vllm_serve_command(model_dir: Path, port: int) -> list[str]:
    """``vllm serve MODEL ...`` with this interpreter. The CLI reads the version of the
    ``vllm`` distribution, which vLLM's CPU build (``vllm-cpu``) lacks: there, the module that
    ``vllm serve`` runs (``vllm.entrypoints.openai.api_server``, same server, same flags with
    ``--model``) is started directly."""
    try:
        version("vllm")
        entry = ["-m", "vllm.entrypoints.cli.main", "serve", str(model_dir)]
    except PackageNotFoundError:
        entry = ["-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    return [
        sys.executable, *entry,
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL_NAME,
        *ENGINE_FLAGS,
    ]  # fmt: skip


def _servers(
    stack: ExitStack, model_dir: Path, cache: Path, log_dir: Path, server_args: tuple[str, ...]
) -> Iterator[tuple[server.Server, ServerRuns]]:
    """This server on vLLM, then vLLM's own, each ready (started one after the other)."""
    args = ["--model_dir", str(model_dir), "--model_name", MODEL_NAME, "--backend", "vllm"]
    args += [*ENGINE_FLAGS, *server_args]
    logger.info("%s: python -m huggingfaceserver %s", KEY, " ".join(args))
    ours = server.start(args, log_dir / f"{KEY}-ours.log", env=vllm_env(cache / "vllm-ours"))
    running = stack.enter_context(server.ready(ours))
    shown = " ".join(["python -m huggingfaceserver", *args]).replace(str(model_dir), "MODEL")
    yield running, ServerRuns("this server, --backend vllm", "/openai/v1/completions", shown)
    port = server.free_port()
    command = vllm_serve_command(model_dir, port)
    logger.info("%s: %s", KEY, " ".join(command[1:]))
    theirs = server.launch(
        command,
        port,
        log_dir / f"{KEY}-vllm-serve.log",
        env=vllm_env(cache / "vllm-serve"),
        ready_path="/health",
    )
    running = stack.enter_context(server.ready(theirs))
    shown = " ".join(["python", *command[1:]]).replace(str(model_dir), "MODEL")
    shown = shown.replace(f"--port {port}", "--port PORT")
    yield running, ServerRuns("vllm serve", "/v1/completions", shown)


def _run(
    running: server.Server,
    runs: ServerRuns,
    other: server.Server,
    concurrency: int,
    settings: Settings,
) -> LoadResult:
    prompts = texts.prompts()
    call = routes.openai_completion_stream(
        running.url, MODEL_NAME, prompts, MAX_TOKENS, path=runs.path
    )
    budget = Budget(requests=settings.generation_requests(concurrency))
    cpu, idle = server.cpu_seconds(running.process.pid), server.cpu_seconds(other.process.pid)
    result = run_load(call, concurrency, budget, None, running.http_port)
    result.server_cpu_s = server.cpu_seconds(running.process.pid) - cpu
    result.other_server_cpu_s = server.cpu_seconds(other.process.pid) - idle
    result.peak_rss_mb = server.peak_rss_mb(running.process.pid)
    return result


def measure(model_dir: Path, settings: Settings, cache: Path, log_dir: Path) -> VllmTierResult:
    """Both servers up, a warm-up each, then :func:`rounds` rounds of: at each concurrency,
    ours then vLLM's."""
    with ExitStack() as stack:
        (ours, our_runs), (theirs, their_runs) = _servers(
            stack, model_dir, cache, log_dir, settings.server_args
        )
        our_runs.startup_s, their_runs.startup_s = ours.ready_s, theirs.ready_s
        pairs = ((ours, our_runs, theirs), (theirs, their_runs, ours))
        for running, runs, _ in pairs:
            call = routes.openai_completion_stream(
                running.url, MODEL_NAME, texts.prompts(), MAX_TOKENS, path=runs.path
            )
            run_load(call, max(CONCURRENCY), Budget(requests=1), None, running.http_port)
        for round_ in range(rounds(settings)):
            for concurrency in CONCURRENCY:
                for running, runs, other in pairs:
                    run = _run(running, runs, other, concurrency, settings)
                    runs.runs.setdefault(concurrency, []).append(run)
                    logger.info(
                        "  %s, %s, c=%d, round %d: %.0f tokens/s, %d errors",
                        KEY,
                        runs.label,
                        concurrency,
                        round_ + 1,
                        run.tokens_per_s,
                        len(run.errors),
                    )
    return VllmTierResult(our_runs, their_runs, settings, len(texts.prompts()))


def _rows(result: VllmTierResult) -> list[list[str]]:
    rows = []
    for concurrency in CONCURRENCY:
        for runs in (result.ours, result.theirs):
            summary = summarize(runs.runs[concurrency], tokens=True)
            share = result.paired_ratio(concurrency) if runs is result.ours else 1.0
            other = statistics.median(
                run.other_server_cpu_s / run.elapsed_s for run in runs.runs[concurrency]
            )
            rows.append(
                [runs.label, str(concurrency), spread(summary.rate, 0), f"{share:.0%}"]
                + [num(summary.latency_ms[0]), triple(summary.ttft_ms)]
                + [f"{len(summary.errors)}/{summary.requests}"]
                + [" / ".join(num(cores, 2) for cores in summary.cpu_cores), num(other, 2)]
                + [num(summary.peak_rss_mb, 0), num(runs.startup_s, 0)]
            )
    return rows


def _section(result: VllmTierResult) -> list[str]:
    settings = result.settings
    return [
        f"## vLLM tier: this server on vLLM against `vllm serve` (vLLM {package_version('vllm')})",
        "",
        "Method. The benchmark Llama (hidden 512, 4 layers, random weights, EOS "
        f"unreachable), served by vLLM's own OpenAI server (`{result.theirs.command}`) and by "
        f"this server (`{result.ours.command}`), both with "
        f"`VLLM_CPU_KVCACHE_SPACE={KV_CACHE_GIB}`. Streamed completions (`/v1/completions` "
        f"and `/openai/v1/completions`), greedy, exactly {MAX_TOKENS} new tokens each (checked "
        "from the usage chunk), closed loop (aiohttp, in the benchmark process); "
        f"{settings.generation_rounds} request(s) per worker and at least "
        f"{settings.generation_min_requests} per run. Both servers are up the whole time; "
        f"{rounds(settings)} round(s), each running every concurrency on ours then on vLLM's; "
        "figures are medians over the rounds, and 'of vLLM's' for this server is the median "
        "of each round's ratio (a run's rate moves by 10-15% on this shared machine; drift "
        "that slows both servers cancels out of the ratio). 'Other server's CPU' is the idle "
        "server's CPU (cores) during the run: it should be about 0.",
        "",
        *table(COLUMNS, _rows(result)),
        "",
    ]
