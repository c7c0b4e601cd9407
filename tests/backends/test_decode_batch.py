"""Decode batches: rows of requests that started at different times, merged into one padded
batch, produce the logits each would produce alone; padding no row needs is dropped."""

from __future__ import annotations

import pytest
import torch

from huggingfaceserver.backends.decode_batch import CausalLMBatch, DecodeBatch

from .generation_helpers import PROMPTS, prompt

STEPS = 4


def steps(batch: DecodeBatch, tokens: list[list[int]]) -> list[torch.Tensor]:
    """Feed the batch one column of ``tokens`` (one token per row) a step; the logits."""
    return [batch.step(column) for column in zip(*tokens, strict=True)]


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_absorbed_rows_step_as_they_would_alone(backends, name: str) -> None:
    backend = backends(name)
    long_ids, short_ids = prompt(backend, PROMPTS[2]), prompt(backend, PROMPTS[0])
    assert len(long_ids) > len(short_ids)
    tokens = torch.randint(
        0, backend.vocab_size, (3, 2 * STEPS), generator=torch.Generator().manual_seed(0)
    ).tolist()
    with torch.inference_mode():
        alone_long, alone_short = backend.new_batch(), backend.new_batch()
        alone_long.prefill(long_ids, 1)
        steps(alone_long, [tokens[0][:STEPS]])  # the long request ran a while alone
        expected_long = steps(alone_long, [tokens[0][STEPS:]])
        alone_short.prefill(short_ids, 2)
        expected_short = steps(alone_short, tokens[1:3])[:STEPS]

        merged, joining = backend.new_batch(), backend.new_batch()
        merged.prefill(long_ids, 1)
        steps(merged, [tokens[0][:STEPS]])
        joining.prefill(short_ids, 2)
        assert merged.absorb(joining)
        got = steps(merged, [tokens[0][STEPS:], *(row[:STEPS] for row in tokens[1:3])])
    for step, logits in enumerate(got):
        assert logits.shape[0] == 3
        torch.testing.assert_close(logits[0], expected_long[step][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits[1:], expected_short[step], atol=1e-5, rtol=1e-5)


def test_keep_drops_the_padding_no_row_needs(backends) -> None:
    backend = backends("llama")
    long_ids, short_ids = prompt(backend, PROMPTS[2]), prompt(backend, PROMPTS[0])
    with torch.inference_mode():
        batch, joining = backend.new_batch(), backend.new_batch()
        batch.prefill(long_ids, 1)
        joining.prefill(short_ids, 1)
        assert batch.absorb(joining)
        assert isinstance(batch, CausalLMBatch)
        assert batch.mask.shape == (2, len(long_ids))
        assert batch.mask[1].sum() == len(short_ids)
        batch.step([1, 1])
        batch.keep([1])  # the long request finished
        assert batch.mask.shape == (1, len(short_ids) + 1)
        assert bool(batch.mask.all())
        assert batch.cache.get_seq_length() == len(short_ids) + 1
        assert batch.positions.tolist() == [len(short_ids) + 1]
        logits = batch.step([2])
        alone = backend.new_batch()
        alone.prefill(short_ids, 1)
        alone.step([1])
        torch.testing.assert_close(logits, alone.step([2]), atol=1e-5, rtol=1e-5)


def test_sequence_to_sequence_batches_stay_apart(backends) -> None:
    backend = backends("t5")
    with torch.inference_mode():
        batch, other = backend.new_batch(), backend.new_batch()
        batch.prefill(prompt(backend), 1)
        other.prefill(prompt(backend), 1)
        assert not batch.absorb(other)
