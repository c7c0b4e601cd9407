"""LoRA adapters on the transformers backend: a mixed batch of base-model and adapter requests
against the base model served alone, at C=16 (issue 33's target: at least 0.6x).

Two servers of the benchmark Llama: one plain, one with two random rank-16 LoRA adapters (on
the attention projections, built here with PEFT) whose requests share the continuous batch
with the base model's. The mixed load sends the base model's name and each adapter's in turn;
the plain server gets the same requests, all for the base model. Every request generates
exactly ``MAX_TOKENS`` tokens (``ignore_eos``: the adapters' random weights may reach EOS).
"""

from __future__ import annotations

import logging
import statistics
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import aiohttp

from . import routes, server, texts
from .load import Budget, LoadResult, run_load, run_streamed
from .report import streamed_row, table
from .routes import Call
from .targets import Target
from .workloads import MAX_TOKENS, Settings

logger = logging.getLogger(__name__)

KEY = "lora"
MODEL_NAME = "llm"
ADAPTERS = ("sql", "chat")
CONCURRENCY = 16
TARGET_SHARE = 0.6
"""The mixed load's tokens/s as a share of the base model's alone, at least."""
EXTRA = {"ignore_eos": True}
MODES = ("base model alone", "base + 2 adapters, mixed")
COLUMNS = ("load", "C", "tokens/s (median [min–max])", "of the base alone", "p50 ms",
           "TTFT p50 / p95 / p99 ms", "errors", "CPU server / client")  # fmt: skip


CPU_MODEL = "The benchmark Llama (hidden 512, 4 layers, random weights)"
"""What :func:`measure` serves, as the report's method names it (the GPU mode gives its own)."""


@dataclass
class LoraResult:
    settings: Settings
    runs: dict[str, list[LoadResult]] = field(default_factory=dict)
    model: str = CPU_MODEL

    def rate(self, mode: str) -> float:
        return statistics.median(run.tokens_per_s for run in self.runs[mode])

    def share(self) -> float:
        return self.rate(MODES[1]) / self.rate(MODES[0])

    def targets(self) -> list[Target]:
        share = self.share()
        detail = (
            f"{self.rate(MODES[1]):.0f} tokens/s mixed vs {self.rate(MODES[0]):.0f} base alone "
            f"at C={CONCURRENCY}: {share:.2f}x (target {TARGET_SHARE}x)"
        )
        return [Target("LoRA mixed batch vs the base model alone", share >= TARGET_SHARE, detail)]

    def section(self) -> list[str]:
        base = self.rate(MODES[0])
        rows = [streamed_row(mode, CONCURRENCY, self.runs[mode], base) for mode in MODES]
        return [
            "## LoRA adapters: base-model and adapter requests in one batch",
            "",
            f"Method. {self.model} on the "
            "transformers backend; two random rank-16 LoRA adapters (q/k/v/o projections) "
            "loaded with PEFT (`--enable-lora --lora-modules`). Streamed completions, greedy, "
            f"exactly {MAX_TOKENS} new tokens each (`ignore_eos`), {CONCURRENCY} at a time: on "
            "the plain server all for the base model, on the adapter server the base model "
            f"and each adapter in turn. {self.settings.repeats} round(s); figures are medians "
            "over the rounds.",
            "",
            *table(COLUMNS, rows),
            "",
        ]


def save_adapter(model_dir: Path, seed: int, out_dir: Path) -> Path:
    """A random rank-16 LoRA adapter for the model (PEFT), its B matrices random too: PEFT's
    zeros would leave the output as the base model's."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    config = LoraConfig(
        r=16,
        lora_alpha=32,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        init_lora_weights=False,
        task_type="CAUSAL_LM",
    )
    get_peft_model(model, config).save_pretrained(str(out_dir))
    return out_dir


def build_adapters(model_dir: Path, cache: Path) -> dict[str, Path]:
    """The two adapters, built once per cache."""
    from .models import built_once

    return {
        name: built_once(cache / f"lora-{name}-r16-v1", partial(save_adapter, model_dir, seed))
        for seed, name in enumerate(ADAPTERS, start=1)
    }


def in_turn(calls: list[Call]) -> Call:
    """Request ``i`` made by ``calls[i % len(calls)]``."""

    async def call(session: aiohttp.ClientSession, index: int) -> routes.Sample:
        return await calls[index % len(calls)](session, index)

    return call


def measure(
    model_dir: Path,
    settings: Settings,
    cache: Path,
    log_dir: Path,
    model: str = CPU_MODEL,
) -> LoraResult:
    """Both servers of ``model_dir`` (``model``: how the report names it), one after the
    other."""
    adapters = build_adapters(model_dir, cache)
    args = ["--model_dir", str(model_dir), "--model_name", MODEL_NAME, "--backend", "huggingface"]
    modules = [f"{name}={path}" for name, path in adapters.items()]
    launches = {
        MODES[0]: args,
        MODES[1]: [*args, "--enable-lora", "--lora-modules", *modules],
    }
    result = LoraResult(settings, model=model)
    for number, (mode, mode_args) in enumerate(launches.items()):
        with ExitStack() as stack:
            log_path = log_dir / f"{KEY}-{number}.log"
            launched = server.start([*mode_args, *settings.server_args], log_path)
            running = stack.enter_context(server.ready(launched))
            names = [MODEL_NAME] if mode == MODES[0] else [MODEL_NAME, *ADAPTERS]
            calls = [
                routes.openai_completion_stream(
                    running.url, name, texts.prompts(), MAX_TOKENS, extra=EXTRA
                )
                for name in names
            ]
            call = in_turn(calls)
            run_load(call, 1, Budget(requests=len(calls)), None, running.http_port)  # warm-up
            for round_ in range(settings.repeats):
                budget = Budget(requests=settings.generation_requests(CONCURRENCY))
                run = run_streamed(call, CONCURRENCY, budget, running)
                result.runs.setdefault(mode, []).append(run)
                logger.info(
                    "  %s, %s, c=%d, round %d: %.0f tokens/s, %d errors",
                    KEY, mode, CONCURRENCY, round_ + 1, run.tokens_per_s, len(run.errors),
                )  # fmt: skip
    return result
