"""Decode batches: rows of requests that started at different times, merged into one padded
batch, produce the logits each would produce alone; padding no row needs is dropped."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from huggingfaceserver.backends.pytorch.decode_batch import (
    CausalLMBatch,
    DecodeBatch,
    takes_ready_masks,
)
from huggingfaceserver.observability.syncs import SyncCounter

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


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_prompts_prefilled_together_give_what_each_gives_alone(backends, name: str) -> None:
    backend = backends(name)
    prompts = [prompt(backend, text) for text in PROMPTS]
    assert len({len(ids) for ids in prompts}) > 1  # left padding is exercised
    rows = [1, 2, 1]
    tokens = torch.randint(
        0, backend.vocab_size, (sum(rows), STEPS), generator=torch.Generator().manual_seed(1)
    ).tolist()
    with torch.inference_mode():
        expected_first, expected_steps = [], []
        used = 0
        for ids, count in zip(prompts, rows, strict=True):
            alone = backend.new_batch()
            expected_first.append(alone.prefill(ids, count)[0])
            expected_steps.append(steps(alone, tokens[used : used + count]))
            used += count
        together = backend.new_batch()
        assert together.prefills_together
        first = together.prefill_together(prompts, rows)
        got = steps(together, tokens)
    # float32 sums over a padded batch in another order: 1e-4, the tolerance the decode loop's
    # tests give logprobs
    torch.testing.assert_close(first, torch.cat(expected_first), atol=1e-4, rtol=1e-4)
    for step, logits in enumerate(got):
        want = torch.cat([alone_steps[step] for alone_steps in expected_steps])
        torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_prompts_scored_together_give_what_each_gives_alone(backends, name: str) -> None:
    """Each prompt's logits at every position of a left-padded batch are those of the prompt
    scored alone: the padding is cut from the front of each."""
    backend = backends(name)
    prompts = [prompt(backend, text) for text in PROMPTS]
    assert len({len(ids) for ids in prompts}) > 1  # left padding is exercised
    rows = [1, 2, 1]
    with torch.inference_mode():
        expected = [
            backend.new_batch().prefill(ids, count, score_prompt=True)
            for ids, count in zip(prompts, rows, strict=True)
        ]
        together = backend.new_batch()
        first, scored = together.prefill_scoring_together(prompts, rows)
        plain = backend.new_batch().prefill_together(prompts, rows)
    torch.testing.assert_close(first, torch.cat([e[0] for e in expected]), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(first, plain, atol=1e-5, rtol=1e-5)
    assert [tuple(s.shape) for s in scored] == [(len(p) - 1, backend.vocab_size) for p in prompts]
    for got, (_, want) in zip(scored, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_rows_repeated_for_several_choices_wait_for_nothing(backends, name: str) -> None:
    """Prompts prefilled for several rows each (``n`` choices), together or alone: outside
    the model's forward nothing reads the device's values (the repeated rows' order is built
    on the host), so that on a GPU admitting them does not wait for the steps queued."""
    backend = backends(name)
    prompts = [prompt(backend, text) for text in PROMPTS]
    with torch.inference_mode():
        together, alone = backend.new_batch(), backend.new_batch()
        with SyncCounter() as counter, counter.separating(backend.model):
            together.prefill_together(prompts, [2, 1, 3])
            alone.prefill(prompts[0], 3)
    assert counter.outside_module == 0, counter.counts
    assert together.mask.shape[0] == 6 and alone.mask.shape[0] == 3


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
        assert not batch.prefills_together


@pytest.mark.parametrize("reserved", [True, False])
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_prompt_fed_in_parts_gives_what_it_gives_whole(backends, name, reserved) -> None:
    """Parts of 3 tokens, then two rows stepped: the logits of the whole prompt's forward,
    on the reserved cache and on transformers' own."""
    backend = backends(name)
    ids = prompt(backend, PROMPTS[2])
    tokens = torch.randint(
        0, backend.vocab_size, (2, STEPS), generator=torch.Generator().manual_seed(2)
    ).tolist()

    def batch() -> DecodeBatch:
        return backend.new_batch() if reserved else CausalLMBatch(backend.model)

    with torch.inference_mode():
        whole = batch()
        first, _ = whole.prefill(ids, 2)
        expected = steps(whole, tokens)
        parted = batch()
        assert parted.prefills_in_parts
        for start in range(0, len(ids), 3):
            last = parted.prefill_part(ids[start : start + 3], start)
        parted.finish_prefill(len(ids), 2)
        got = steps(parted, tokens)
    torch.testing.assert_close(last, first[0], atol=1e-5, rtol=1e-5)
    for logits, want in zip(got, expected, strict=True):
        torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("reserved", [True, False])
def test_a_prompt_scored_in_parts_gives_the_logits_of_the_whole(backends, reserved) -> None:
    backend = backends("llama")
    ids = prompt(backend, PROMPTS[2])
    assert len(ids) > 6  # three parts at least

    def batch() -> DecodeBatch:
        return backend.new_batch() if reserved else CausalLMBatch(backend.model)

    with torch.inference_mode():
        first, expected = batch().prefill(ids, 1, score_prompt=True)
        parted = batch()
        parts = [
            parted.score_part(ids[start : start + 3], start) for start in range(0, len(ids), 3)
        ]
    every = torch.cat(parts)
    assert [len(part) for part in parts] == [len(ids[s : s + 3]) for s in range(0, len(ids), 3)]
    assert expected is not None
    # float32 products of other shapes: 1e-4, the tolerance the decode loop's tests give
    torch.testing.assert_close(every[:-1], expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(every[-1], first[0], atol=1e-4, rtol=1e-4)


def test_a_sequence_to_sequence_prompt_runs_whole(backends) -> None:
    batch = backends("t5").new_batch()
    assert not batch.prefills_in_parts
    with pytest.raises(NotImplementedError):
        batch.prefill_part([1, 2], 0)
    with pytest.raises(NotImplementedError):
        batch.score_part([1, 2], 0)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_transformers_models_take_a_ready_step_mask(backends, name: str) -> None:
    backend = backends(name)
    assert takes_ready_masks(backend.model, backend.cache_layers)
    assert backend.ready_masks


class ExpandsItsOwnMask(LlamaForCausalLM):
    """Model code (as ``trust_remote_code`` brings) that reads any mask as the 2-D one."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, **kw):
        if attention_mask is not None:
            attention_mask = attention_mask.reshape(attention_mask.shape[0], -1)
        return super().forward(input_ids, attention_mask, position_ids, cache, **kw)


def test_a_model_that_misreads_a_ready_mask_keeps_the_2d_one(backends) -> None:
    backend = backends("llama")
    model = ExpandsItsOwnMask(backend.model.config).eval()
    model.load_state_dict(backend.model.state_dict())
    assert not takes_ready_masks(model, backend.cache_layers)
