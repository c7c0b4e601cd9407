"""The long-output Llama alone, no server up: how much of its own speed its decode steps keep
at the long length, the yardstick of the 8-stream target.

The server cannot keep more of its short-answer speed than the model's own decode steps keep,
unless its own cost per step is large enough to hide them. So, in the benchmark process, before
the servers start, 8 rows (the 8 streams' prompts, greedy) are decoded to 256 tokens and to the
long length:

- through the server's own decode batch (:class:`~huggingfaceserver.backends.decode_batch.
  ReservedCausalLMBatch` on its reserved KV cache), with nothing else around it: argmax, no
  sampling, no text; on one intra-op thread (what the server's calibration keeps for this
  model) and on all of torch's;
- through transformers' ``generate`` (greedy, left-padded, its own ``DynamicCache``), on all.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from huggingfaceserver.backends.pytorch.decode_batch import ReservedCausalLMBatch
from huggingfaceserver.backends.pytorch.kv_cache import ReservedCache

from . import texts
from .raw import generate_new_tokens


@dataclass(frozen=True)
class Alone:
    """One way of running the model alone: 8 rows' aggregate tokens/s at both lengths."""

    engine: str
    short_rate: float
    long_rate: float

    @property
    def share(self) -> float:
        """Tokens/s at the long length, as a share of tokens/s at the short one."""
        return self.long_rate / self.short_rate


def decode_loop_rate(model: Any, prompt_ids: list[list[int]], tokens: int) -> float:
    """Aggregate tokens/s of ``tokens`` greedy tokens per prompt, the prompts' rows decoded
    together on the server's reserved cache (the prefill included, as in the server's runs)."""
    rows = len(prompt_ids)
    layers = ReservedCausalLMBatch.cache_layers(model)
    batch = ReservedCausalLMBatch(model, ReservedCache(layers, rows, model.device))
    start = time.perf_counter()
    next_ids = batch.prefill_together(prompt_ids, [1] * rows).argmax(-1).tolist()
    for _ in range(tokens - 1):
        next_ids = batch.step(next_ids).argmax(-1).tolist()
    return rows * tokens / (time.perf_counter() - start)


def _rates(model: Any, prompt_ids: list[list[int]], short: int, long: int) -> tuple[float, float]:
    decode_loop_rate(model, prompt_ids, short)  # warm-up: first calls allocate
    return decode_loop_rate(model, prompt_ids, short), decode_loop_rate(model, prompt_ids, long)


def _measure(model_dir: Path, rows: int, short: int, long: int) -> Iterator[Alone]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    tokenizer.pad_token = tokenizer.eos_token
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompts = texts.prompts()[:rows]
    prompt_ids = [tokenizer(prompt)["input_ids"] for prompt in prompts]
    threads = torch.get_num_threads()
    with torch.inference_mode():
        for count in dict.fromkeys((1, threads)):
            torch.set_num_threads(count)
            label = "1 thread" if count == 1 else f"{count} threads"
            yield Alone(
                f"the server's decode batch alone, {label}", *_rates(model, prompt_ids, short, long)
            )
        torch.set_num_threads(threads)
        generate_new_tokens(model, tokenizer, prompts, short)  # warm-up
        seconds = [generate_new_tokens(model, tokenizer, prompts, n) for n in (short, long)]
        yield Alone(
            f"transformers' `generate`, {threads} thread(s)",
            rows * short / seconds[0],
            rows * long / seconds[1],
        )


def measure(model_dir: Path, rows: int, short: int, long: int) -> list[Alone]:
    """Every way of running the model alone, in turn (torch's threads as they were after)."""
    threads = torch.get_num_threads()
    try:
        return list(_measure(model_dir, rows, short, long))
    finally:
        torch.set_num_threads(threads)
