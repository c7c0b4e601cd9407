"""Rows per batch without ``--max_batch_size``, by device (:mod:`.batch_rows`): the CPU's 16
everywhere on a CPU; on a GPU 256 for encoders, and for decoding what the free memory holds at
full context in its KV cache budget, within 16 and 256."""

from __future__ import annotations

import logging

import pytest
import torch

from huggingfaceserver.backends.pytorch.batch_rows import GPU_ROWS, decode_rows, encoder_rows
from huggingfaceserver.backends.pytorch.kv_budget import KV_MEMORY_SHARE, plan_kv_budget
from huggingfaceserver.cli import DEFAULT_MAX_BATCH_SIZE
from huggingfaceserver.pod import Memory
from huggingfaceserver.units import GiB
from tests.harness import load_model

from .generation_helpers import load

TINYLLAMA = 22_528
"""TinyLlama-1.1B's KV cache per token in bf16 (22 KiB; 46 MiB at its full 2,048 tokens)."""
LLAMA2_7B = 524_288
"""Llama-2-7B's in fp16 (512 KiB; 2 GiB at 4,096 tokens)."""
LLAMA3_8B = 131_072
"""Llama-3-8B's in bf16 (128 KiB; 1 GiB at 8,192 tokens)."""


def budget(free: int, per_token: int | None) -> int | None:
    """The GPU's default KV cache budget in tokens, ``free`` bytes after the weights."""
    return plan_kv_budget(per_token, None, Memory(free, "cuda:0")).tokens


def test_a_cpu_keeps_its_16_rows():
    assert encoder_rows("cpu") == DEFAULT_MAX_BATCH_SIZE == 16
    assert decode_rows("cpu", budget(100 * GiB, TINYLLAMA), 2048) == DEFAULT_MAX_BATCH_SIZE


def test_a_gpu_batches_256_encoder_rows():
    assert encoder_rows("cuda") == GPU_ROWS == 256


@pytest.mark.parametrize(
    ("free", "per_token", "context", "rows"),
    [
        (135 * GiB, TINYLLAMA, 2048, GPU_ROWS),  # an H200: far more than 256 would fit
        (64 * GiB, LLAMA3_8B, 8192, int(64 * KV_MEMORY_SHARE)),  # 25
        (66 * GiB, LLAMA2_7B, 4096, DEFAULT_MAX_BATCH_SIZE),  # 13 fit: 16, the budget admits
        (135 * GiB, None, 2048, DEFAULT_MAX_BATCH_SIZE),  # the attention's shape unknown
    ],
)
def test_a_gpu_decodes_what_its_kv_budget_holds_at_full_context(free, per_token, context, rows):
    assert decode_rows("cuda", budget(free, per_token), context) == rows


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_generator_on_a_gpu_sizes_its_rows_and_says_so(tiny_models, caplog):
    with caplog.at_level(logging.INFO):
        backend = load(tiny_models["llama"])
    try:
        assert backend.max_rows == GPU_ROWS  # a tiny model's cache: 256 rows fit anywhere
        assert any("decoding up to 256 rows" in r.getMessage() for r in caplog.records)
    finally:
        backend.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_an_encoder_on_a_gpu_batches_256_rows(tiny_models):
    path = tiny_models["bert_sequence_classification"]
    model = load_model(["--model_dir", str(path), "--backend", "huggingface"])
    try:
        assert model.backend.batcher.limits.max_batch_size == GPU_ROWS
    finally:
        model.backend.shutdown()
