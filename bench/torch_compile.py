"""``--torch_compile`` on the transformers backend: where compiling the decode step pays.

Two servers of the benchmark Llama (hidden 512, 4 layers) side by side, one with default flags
and one with ``--torch_compile`` (each bucket's decode step compiled by inductor; on a CPU it
runs over the whole KV cache buffers, where on a GPU the compiled step is what the CUDA graph
replays). Streamed completions, greedy, exactly ``MAX_TOKENS`` tokens each (``ignore_eos``), at
C=1 and C=16, the two servers in turn in every round, so that both see the same minutes of a
shared machine. Reported: tokens/s, TTFT, the server's CPU, and each server's start-up (to
ready: the compiles are made before it). No target: the flag is off by default, and this is
the figure that says whether it should be on (on a GPU: ``bench/gpu_run.sh --only generation
--server-arg=--torch_compile`` against the same without it).
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from . import routes, server, texts
from .load import Budget, run_load, run_streamed
from .report import StreamedModes, table
from .targets import Target
from .workloads import MAX_TOKENS, Settings

KEY = "torch_compile"
MODEL_NAME = "llm"
CONCURRENCY = (1, 16)
EXTRA = {"ignore_eos": True}
MODES = {"default flags": (), "--torch_compile": ("--torch_compile",)}
COLUMNS = ("server", "C", "tokens/s (median [min–max])", "of default flags", "p50 ms",
           "TTFT p50 / p95 / p99 ms", "errors", "CPU server / client")  # fmt: skip


@dataclass
class CompileResult(StreamedModes):
    ready_s: dict[str, float] = field(default_factory=dict)

    def targets(self) -> list[Target]:
        return []  # a measurement: whether the flag pays here

    def section(self) -> list[str]:
        rows = self.rows(list(MODES), CONCURRENCY)
        ready = ", ".join(f"{mode} {seconds:.1f} s" for mode, seconds in self.ready_s.items())
        return [
            "## `--torch_compile`: the decode step compiled, against eager",
            "",
            "Method. The benchmark Llama (hidden 512, 4 layers, random weights) on the "
            "transformers backend, two servers side by side: default flags, and "
            "`--torch_compile` (inductor; on a CPU the compiled step runs over the whole KV "
            "cache buffers, on a GPU it is what the CUDA graphs replay). Streamed completions, "
            f"greedy, exactly {MAX_TOKENS} new tokens each (`ignore_eos`); the two servers in "
            f"turn in each of {self.settings.repeats} round(s); medians over the rounds.",
            "",
            *table(COLUMNS, rows),
            "",
            f"Start-up to ready: {ready} (the compiles are made before the server is ready).",
            "",
        ]


def measure(model_dir: Path, settings: Settings, log_dir: Path) -> CompileResult:
    args = ["--model_dir", str(model_dir), "--model_name", MODEL_NAME, "--backend", "huggingface"]
    result = CompileResult(settings)
    with ExitStack() as stack:
        calls = {}
        for number, (mode, flags) in enumerate(MODES.items()):
            log_path = log_dir / f"{KEY}-{number}.log"
            launched = server.start([*args, *flags, *settings.server_args], log_path)
            running = stack.enter_context(server.ready(launched))
            result.ready_s[mode] = running.ready_s
            call = routes.openai_completion_stream(
                running.url, MODEL_NAME, texts.prompts(), MAX_TOKENS, extra=EXTRA
            )
            run_load(call, 1, Budget(requests=2), None, running.http_port)  # warm-up
            calls[mode] = (call, running)
        for round_ in range(settings.repeats):
            for concurrency in CONCURRENCY:
                for mode, (call, running) in calls.items():
                    budget = Budget(requests=settings.generation_requests(concurrency))
                    run = run_streamed(call, concurrency, budget, running)
                    result.add(KEY, mode, concurrency, round_, run)
    return result
