"""How many rows torch runs together without ``--max_batch_size``, by device.

On a CPU, :data:`~huggingfaceserver.cli.DEFAULT_MAX_BATCH_SIZE` (16): larger batches gain no
throughput there (BENCHMARKS.md). On a GPU a forward of many rows costs hardly more than one of
a few, and 16 would cap the device at a fraction of its rate (on an H200, BENCHMARKS-gpu.md:
plain bert-base in fp16 ran 2,973 sequences/s at batch 32 and 14,999 at 256; eager `generate`
of a 1.1B Llama made 69 tokens/s at batch 1 and 2,023 at 32). There:

- an encoder batch takes up to :data:`GPU_ROWS`, its padded tokens bounded by
  ``--max_batch_tokens`` as on a CPU (what bounds its memory);
- the decode loop takes as many rows as a KV cache at the model's full context fits in
  :data:`KV_MEMORY_SHARE` of the device memory free once the weights are loaded, between the
  CPU's 16 and :data:`GPU_ROWS`. The reserved cache (:mod:`.kv_cache`) holds ``rows x
  columns`` and grows its columns by half again when full, the old buffers and the new side by
  side while it moves: sized at a share well under half, the rows' full context still fits
  with its growth, the activations and the recorded steps' memory.
"""

from __future__ import annotations

from ...cli import DEFAULT_MAX_BATCH_SIZE

GPU_ROWS = 256
"""Rows at most on a GPU without ``--max_batch_size`` (vLLM's ``--max-num-seqs`` default)."""
KV_MEMORY_SHARE = 0.4
"""Of the device memory free after the weights: the KV cache of every row at full context."""


def encoder_rows(device_type: str) -> int:
    """Rows per encoder forward without ``--max_batch_size`` on a device of this type."""
    return GPU_ROWS if device_type == "cuda" else DEFAULT_MAX_BATCH_SIZE


def decode_rows(device_type: str, free_bytes: int, kv_bytes_per_row: int | None) -> int:
    """Rows decoded together without ``--max_batch_size``: on a GPU, those whose KV cache at
    full context (``kv_bytes_per_row``; None where the model's config does not say its
    attention) fits in :data:`KV_MEMORY_SHARE` of ``free_bytes``, within 16 and
    :data:`GPU_ROWS`; elsewhere 16."""
    if device_type != "cuda" or not kv_bytes_per_row:
        return DEFAULT_MAX_BATCH_SIZE
    fits = int(free_bytes * KV_MEMORY_SHARE) // kv_bytes_per_row
    return max(DEFAULT_MAX_BATCH_SIZE, min(GPU_ROWS, fits))
