"""Logits processing and token choice on small hand-made logits; transformers' own logits
processors are the oracle where they define the same thing."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from huggingfaceserver.generation.logits import (
    apply_logit_bias,
    apply_presence_frequency_penalties,
    apply_repetition_penalty,
    choose_next_tokens,
    filter_for_sampling,
    process_logits,
    sample,
    suppress_tokens,
    token_logprobs,
)
from huggingfaceserver.generation.params import SamplingParams

NEG_INF = float("-inf")


@dataclass
class Row:
    params: SamplingParams
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()
    stop_ids: Collection[int] = ()
    generator: torch.Generator | None = None
    matcher: Any = None


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_logits(rows: int = 3, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=seeded(seed)) * 3


def test_logit_bias_is_added_per_row() -> None:
    logits = torch.zeros(2, 5)
    apply_logit_bias(logits, [{1: 2.5, 3: -1.0}, {}])
    assert logits.tolist() == [[0, 2.5, 0, -1.0, 0], [0] * 5]


def test_suppressed_tokens_become_impossible() -> None:
    logits = torch.zeros(2, 4)
    suppress_tokens(logits, [{0, 2}, ()])
    assert logits.tolist() == [[NEG_INF, 0, NEG_INF, 0], [0] * 4]


def test_min_tokens_suppresses_the_stop_ids_until_reached() -> None:
    logits = torch.tensor([[0.0, 9.0, 1.0]] * 2)
    rows = [
        Row(SamplingParams(min_tokens=2), output_ids=[2], stop_ids={1}),
        Row(SamplingParams(min_tokens=2), output_ids=[2, 2], stop_ids={1}),
    ]
    processed = process_logits(logits.clone(), rows)
    assert processed[0, 1] == NEG_INF
    assert processed[1].tolist() == logits[1].tolist()


def test_repetition_penalty_matches_transformers() -> None:
    logits = random_logits(rows=2)
    seen = [[1, 4, 4, 7], [2, 3]]
    expected = torch.cat(
        [
            RepetitionPenaltyLogitsProcessor(penalty)(
                torch.tensor([ids]), logits[i : i + 1].clone()
            )
            for i, (ids, penalty) in enumerate(zip(seen, [1.3, 0.7], strict=True))
        ]
    )
    apply_repetition_penalty(logits, seen, [1.3, 0.7])
    torch.testing.assert_close(logits, expected)


def test_presence_and_frequency_penalties_count_the_output() -> None:
    logits = torch.zeros(2, 4)
    apply_presence_frequency_penalties(logits, [[1, 1, 2], []], [0.5, 0.5], [0.25, 0.25])
    assert logits.tolist() == [[0, -1.0, -0.75, 0], [0] * 4]


def test_penalties_use_prompt_for_repetition_only() -> None:
    logits = torch.ones(1, 4)
    row = Row(
        SamplingParams(repetition_penalty=2.0, presence_penalty=1.0),
        prompt_ids=[0],
        output_ids=[3],
    )
    process_logits(logits, [row])
    assert logits.tolist() == [[0.5, 1.0, 1.0, -0.5]]


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [(0.7, 0, 1.0, 0.0), (1.0, 5, 1.0, 0.0), (1.0, 0, 0.8, 0.0), (1.3, 10, 0.9, 0.05)],
)
def test_sampling_filters_match_transformers(
    temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    logits = random_logits(rows=1)
    expected = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1.0:
        expected = TopPLogitsWarper(top_p)(None, expected)
    if min_p:
        expected = MinPLogitsWarper(min_p)(None, expected)
    actual = filter_for_sampling(logits, [temperature], [top_k], [top_p], [min_p])
    torch.testing.assert_close(actual, expected)


def test_sampling_filters_apply_per_row() -> None:
    logits = random_logits(rows=3)
    actual = filter_for_sampling(logits, [1.0, 1.0, 1.0], [3, 0, -1], [1.0, 0.5, 1.0], [0.0] * 3)
    assert (actual[0] > NEG_INF).sum() == 3
    assert 1 <= (actual[1] > NEG_INF).sum() < logits.shape[1]
    assert torch.equal(actual[2], logits[2])


def test_greedy_takes_the_argmax_of_the_processed_logits() -> None:
    logits = torch.tensor([[1.0, 5.0, 2.0]])
    row = Row(SamplingParams(temperature=0.0, logit_bias={2: 10.0}))
    tokens, logprobs = choose_next_tokens(logits, [row])
    assert tokens == [2]
    assert logprobs == [None]


def test_seeded_sampling_is_reproducible_and_leaves_the_global_rng_alone() -> None:
    logits = random_logits(rows=1, vocab=1000)
    params = SamplingParams(temperature=1.0)
    before = torch.get_rng_state()

    def draws(seed: int) -> list[int]:
        generator = seeded(seed)
        return [int(sample(logits, [Row(params, generator=generator)])[0]) for _ in range(20)]

    assert draws(1) == draws(1)
    assert draws(1) != draws(2)
    assert torch.equal(torch.get_rng_state(), before)


def test_samples_stay_within_top_k() -> None:
    logits = random_logits(rows=1, vocab=100)
    allowed = set(logits[0].topk(3).indices.tolist())
    generator = seeded(0)
    row = Row(SamplingParams(temperature=5.0, top_k=3), generator=generator)
    drawn = {int(sample(logits, [row])[0]) for _ in range(200)}
    assert drawn == allowed


def test_greedy_and_sampled_rows_in_one_batch() -> None:
    logits = random_logits(rows=2, vocab=100)
    rows = [
        Row(SamplingParams(temperature=0.0)),
        Row(SamplingParams(temperature=1.0, top_k=1), generator=seeded(0)),
    ]
    assert sample(logits, rows).tolist() == logits.argmax(dim=-1).tolist()


def test_logprobs_are_the_raw_log_softmax() -> None:
    logits = random_logits(rows=3)
    tokens = torch.tensor([4, 7, 9])
    result = token_logprobs(logits, tokens, [2, None, 0])
    expected = logits.log_softmax(dim=-1)
    first, second, third = result
    assert first is not None and second is None and third is not None
    assert first.token_id == 4
    assert first.logprob == pytest.approx(float(expected[0, 4]), abs=1e-6)
    top_ids = expected[0].topk(2).indices.tolist()
    assert [token for token, _ in first.top] == top_ids
    assert [lp for _, lp in first.top] == pytest.approx(expected[0, top_ids].tolist(), abs=1e-6)
    assert third.top == ()
    assert third.logprob == pytest.approx(float(expected[2, 9]), abs=1e-6)


def test_reported_logprobs_ignore_bias_and_temperature() -> None:
    logits = random_logits(rows=1)
    params = SamplingParams(temperature=0.5, logit_bias={3: 100.0}, logprobs=1)
    tokens, logprobs = choose_next_tokens(logits, [Row(params, generator=seeded(0))])
    assert tokens == [3]
    reported = logprobs[0]
    assert reported is not None
    assert reported.logprob == pytest.approx(float(logits.log_softmax(dim=-1)[0, 3]), abs=1e-6)
    assert reported.top[0][0] == int(logits[0].argmax())


def test_more_alternatives_than_the_vocabulary() -> None:
    logits = random_logits(rows=1, vocab=4)
    (result,) = token_logprobs(logits, torch.tensor([0]), [10])
    assert result is not None and len(result.top) == 4
