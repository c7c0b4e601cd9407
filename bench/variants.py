"""The server on MiniLM under the runtime flags a user may pick: default (ONNX Runtime),
``--max_batch_size`` 8 and 4 on it, ``--backend openvino`` in float32 and in bfloat16, and
``--backend huggingface`` (torch). OpenAI embeddings, one sentence per request, closed loop at
concurrency 1 and 32; the variants alternate within each of ``settings.repeats`` rounds, one
server up at a time. No targets: this shows what each flag buys on this machine.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from . import routes, server, texts
from .load import Budget, run_load
from .report import table
from .targets import Target
from .workloads import Settings

logger = logging.getLogger(__name__)

KEY = "variants"
VARIANTS: dict[str, tuple[str, ...]] = {
    "default flags (ONNX Runtime, --max_batch_size 16)": (),
    "--max_batch_size 8": ("--max_batch_size", "8"),
    "--max_batch_size 4": ("--max_batch_size", "4"),
    "--backend openvino": ("--backend", "openvino"),
    "--backend openvino --dtype bfloat16": ("--backend", "openvino", "--dtype", "bfloat16"),
    "--backend huggingface (torch)": ("--backend", "huggingface"),
}
CONCURRENCY = (1, 32)


@dataclass
class VariantsOutcome:
    rates: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def targets(self) -> list[Target]:
        return []

    def section(self) -> list[str]:
        default = next(iter(VARIANTS))
        rows = []
        for name in VARIANTS:
            row = [name]
            for concurrency in CONCURRENCY:
                rates = self.rates.get((name, concurrency), [])
                if not rates:
                    row += ["–", "–"]
                    continue
                base = statistics.median(self.rates[(default, concurrency)])
                median = statistics.median(rates)
                row += [
                    f"{median:.0f} [{min(rates):.0f}–{max(rates):.0f}]",
                    f"{median / base:.2f}x",
                ]
            rows.append(row)
        columns = ["server flags", "C=1 req/s", "÷ default", "C=32 req/s", "÷ default"]
        return [
            "## Server runtime flags on MiniLM",
            "",
            "Method. `python -m huggingfaceserver --model_dir MINILM --model_name minilm` plus the "
            "flags of the row; OpenAI embeddings, one sentence per request, closed loop at C=1 and "
            "C=32 (aiohttp in the benchmark process), the variants alternated within each round, "
            "one server up at a time; medians over rounds [min–max]. No targets: what each flag "
            "buys on this machine (bfloat16 on OpenVINO is not equal to torch: see Runtimes).",
            "",
            *table(columns, rows),
            "",
            *(f"- {note}" for note in self.notes),
        ]


def measure(model_dir: Path, settings: Settings, log_dir: Path) -> VariantsOutcome:
    outcome = VariantsOutcome()
    budget = Budget(duration_s=settings.duration_s)
    for round_ in range(1, settings.repeats + 1):
        for name, flags in VARIANTS.items():
            args = ["--model_dir", str(model_dir), "--model_name", "minilm", *flags]
            args += list(settings.server_args)
            log = log_dir / f"{KEY}-{round_}-{len(outcome.rates)}.log"
            try:
                with server.serving(args, log) as running:
                    call = routes.openai_embeddings(running.url, "minilm", texts.SENTENCES)
                    run_load(
                        call, 32, Budget(duration_s=settings.warmup_s), None, running.http_port
                    )
                    for concurrency in CONCURRENCY:
                        result = run_load(call, concurrency, budget, None, running.http_port)
                        outcome.rates.setdefault((name, concurrency), []).append(
                            result.requests_per_s
                        )
                        logger.info(
                            "%s, round %d: %s, C=%d: %.1f req/s, %d errors",
                            KEY,
                            round_,
                            name,
                            concurrency,
                            result.requests_per_s,
                            len(result.errors),
                        )
            except (RuntimeError, TimeoutError) as exc:  # a variant that does not start here
                note = f"{name}: did not start ({str(exc).splitlines()[-1]})"
                if note not in outcome.notes:
                    outcome.notes.append(note)
    return outcome
