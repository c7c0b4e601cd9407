"""How many rows torch runs together without ``--max_batch_size``, by device.

On a CPU, :data:`~huggingfaceserver.cli.DEFAULT_MAX_BATCH_SIZE` (16): larger batches gain no
throughput there (BENCHMARKS.md). On a GPU a forward of many rows costs hardly more than one of
a few, and 16 would cap the device at a fraction of its rate (on an H200, BENCHMARKS-gpu.md:
plain bert-base in fp16 ran 2,973 sequences/s at batch 32 and 14,999 at 256; eager `generate`
of a 1.1B Llama made 69 tokens/s at batch 1 and 2,023 at 32). There:

- an encoder batch takes up to :data:`GPU_ROWS`, its padded tokens bounded by
  ``--max_batch_tokens`` as on a CPU (what bounds its memory);
- the decode loop takes as many rows as its KV cache budget (:mod:`.kv_budget`: a share of
  the device memory free once the weights are loaded) holds at the model's full context,
  between the CPU's 16 and :data:`GPU_ROWS`. Where fewer rows than that fit at full context,
  the budget still admits them by their own lengths (a prompt and its ``max_tokens``).
"""

from __future__ import annotations

from ...cli import DEFAULT_MAX_BATCH_SIZE

GPU_ROWS = 256
"""Rows at most on a GPU without ``--max_batch_size`` (vLLM's ``--max-num-seqs`` default)."""


def encoder_rows(device_type: str) -> int:
    """Rows per encoder forward without ``--max_batch_size`` on a device of this type."""
    return GPU_ROWS if device_type == "cuda" else DEFAULT_MAX_BATCH_SIZE


def decode_rows(device_type: str, budget_tokens: int | None, context: int) -> int:
    """Rows decoded together without ``--max_batch_size``: on a GPU, as many sequences of
    ``context`` tokens as the KV cache budget holds (``budget_tokens``; None where the model's
    config does not say its attention), within 16 and :data:`GPU_ROWS`; elsewhere 16."""
    if device_type != "cuda" or budget_tokens is None:
        return DEFAULT_MAX_BATCH_SIZE
    return max(DEFAULT_MAX_BATCH_SIZE, min(GPU_ROWS, budget_tokens // max(context, 1)))
