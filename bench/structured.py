"""The cost of structured output: streamed completions under a JSON schema beside the same
completions unconstrained, on one server (the transformers backend), alternated.

The schema holds the output inside one long JSON string (``minLength`` well past what
``MAX_TOKENS`` tokens can write), so a constrained request generates exactly ``MAX_TOKENS``
tokens too, each after its grammar mask is computed and applied: the figure is what masking
costs a decode step, not a shorter answer.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

from . import routes, server, texts
from .load import Budget, run_load, run_streamed
from .report import StreamedModes, table
from .targets import Target
from .workloads import MAX_TOKENS, Settings

KEY = "structured"
MODEL_NAME = "llm"
CONCURRENCY = (1, 8)
SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 2000}},
    "required": ["text"],
}
MODES = {"unconstrained": None, "JSON schema": {"guided_json": SCHEMA}}
COLUMNS = ("request", "C", "tokens/s (median [min–max])", "of unconstrained", "p50 ms",
           "TTFT p50 / p95 / p99 ms", "errors", "CPU server / client")  # fmt: skip


class StructuredResult(StreamedModes):
    def targets(self) -> list[Target]:
        return []  # a measured cost, reported; no target set for it

    def section(self) -> list[str]:
        rows = self.rows(list(MODES), CONCURRENCY)
        return [
            "## Structured output: a JSON-schema request beside an unconstrained one",
            "",
            "Method. The benchmark Llama (hidden 512, 4 layers, random weights, EOS "
            "unreachable) on the transformers backend. Streamed completions, greedy, exactly "
            f"{MAX_TOKENS} new tokens each; the constrained ones with `guided_json` "
            f"`{SCHEMA}`, which keeps the output in one JSON string, so every step is masked "
            f"by llguidance. {self.settings.repeats} round(s), each running both kinds at "
            "each concurrency; figures are medians over the rounds.",
            "",
            *table(COLUMNS, rows),
            "",
        ]


def measure(model_dir: Path, settings: Settings, log_dir: Path) -> StructuredResult:
    args = ["--model_dir", str(model_dir), "--model_name", MODEL_NAME, "--backend", "huggingface"]
    result = StructuredResult(settings)
    with ExitStack() as stack:
        launched = server.start([*args, *settings.server_args], log_dir / f"{KEY}.log")
        running = stack.enter_context(server.ready(launched))
        for extra in MODES.values():  # a warm-up each: the grammar is compiled once
            call = routes.openai_completion_stream(
                running.url, MODEL_NAME, texts.prompts(), MAX_TOKENS, extra=extra
            )
            run_load(call, 1, Budget(requests=1), None, running.http_port)
        for round_ in range(settings.repeats):
            for concurrency in CONCURRENCY:
                for mode, extra in MODES.items():
                    call = routes.openai_completion_stream(
                        running.url, MODEL_NAME, texts.prompts(), MAX_TOKENS, extra=extra
                    )
                    budget = Budget(requests=settings.generation_requests(concurrency))
                    run = run_streamed(call, concurrency, budget, running)
                    result.add(KEY, mode, concurrency, round_, run)
    return result
