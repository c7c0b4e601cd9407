"""Logits processing and token choice on small hand-made logits; transformers' own logits
processors are the oracle where they define the same thing, and the straightforward
recount-every-step penalties (kept here) the oracle of the kept counts."""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from huggingfaceserver.errors import BadRequest, ServerError
from huggingfaceserver.generation.logits import (
    apply_logit_bias,
    choose_next_tokens,
    filter_for_sampling,
    process_logits,
    sample,
    suppress_tokens,
    token_logprobs,
)
from huggingfaceserver.generation.params import SamplingParams
from huggingfaceserver.generation.penalties import (
    apply_presence_frequency_penalties,
    apply_repetition_penalty,
)

NEG_INF = float("-inf")


@dataclass
class Row:
    params: SamplingParams
    prompt_ids: Sequence[int] = ()
    output_ids: list[int] = field(default_factory=list)
    stop_ids: Collection[int] = ()
    generator: torch.Generator | None = None
    matcher: Any = None
    penalties: Any = None


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
    processed = logits.clone()
    assert process_logits(processed, rows) == {}
    assert processed[0, 1] == NEG_INF
    assert processed[1].tolist() == logits[1].tolist()


def occurrences(logits: torch.Tensor, token_ids: Sequence[Sequence[int]]) -> torch.Tensor:
    """How often each vocabulary token occurs in each row's ``token_ids``: ``[rows, vocab]``
    (counted from scratch, as every step did before the counts were kept)."""
    counts = torch.zeros_like(logits)
    for row, ids in enumerate(token_ids):
        if ids:
            index = torch.tensor(ids, device=logits.device)
            counts[row].index_add_(0, index, torch.ones_like(index, dtype=logits.dtype))
    return counts


def reference_process_logits(logits: torch.Tensor, rows: Sequence[Row]) -> None:
    """The straightforward processing (unconstrained rows): every row's prompt and output
    recounted, every row penalized (a neutral penalty changes nothing)."""
    apply_logit_bias(logits, [row.params.logit_bias for row in rows])
    suppress_tokens(
        logits,
        [row.stop_ids if len(row.output_ids) < row.params.min_tokens else () for row in rows],
    )
    seen = occurrences(logits, [[*row.prompt_ids, *row.output_ids] for row in rows]) > 0
    penalty = torch.tensor([row.params.repetition_penalty for row in rows]).unsqueeze(1)
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits.copy_(torch.where(seen, penalized, logits))
    counts = occurrences(logits, [row.output_ids for row in rows])
    presence = torch.tensor([row.params.presence_penalty for row in rows]).unsqueeze(1)
    frequency = torch.tensor([row.params.frequency_penalty for row in rows]).unsqueeze(1)
    logits -= presence * (counts > 0) + frequency * counts


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
    apply_repetition_penalty(logits, occurrences(logits, seen) > 0, [1.3, 0.7])
    torch.testing.assert_close(logits, expected)


def test_presence_and_frequency_penalties_count_the_output() -> None:
    logits = torch.zeros(2, 4)
    counts = occurrences(logits, [[1, 1, 2], []])
    apply_presence_frequency_penalties(logits, counts, [0.5, 0.5], [0.25, 0.25])
    assert logits.tolist() == [[0, -1.0, -0.75, 0], [0] * 4]


PENALTIES = st.builds(
    SamplingParams,
    repetition_penalty=st.sampled_from([1.0, 1.0, 0.6, 1.3, 2.0]),
    presence_penalty=st.sampled_from([0.0, 0.0, 0.5, -0.7]),
    frequency_penalty=st.sampled_from([0.0, 0.0, 0.25, 1.5]),
    logit_bias=st.sampled_from([{}, {0: 1.5}]),
)


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_kept_penalty_counts_equal_recounting_every_step(data: st.DataObject) -> None:
    vocab = data.draw(st.integers(2, 40), label="vocab")
    token = st.integers(0, vocab - 1)
    rows = [
        Row(params, prompt_ids=data.draw(st.lists(token, max_size=8), label="prompt"))
        for params in data.draw(st.lists(PENALTIES, min_size=1, max_size=5), label="params")
    ]
    seed = data.draw(st.integers(0, 2**16), label="seed")
    for step in range(data.draw(st.integers(1, 6), label="steps")):
        logits = random_logits(len(rows), vocab, seed + step)
        expected = logits.clone()
        reference_process_logits(expected, rows)
        assert process_logits(logits, rows) == {}
        assert torch.equal(logits, expected)
        for row in rows:  # usually one token a step; some steps none or several
            row.output_ids += data.draw(st.lists(token, max_size=2), label="new tokens")
    for row in rows:
        p = row.params
        asks = p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty
        assert (row.penalties is not None) == bool(asks), "counts only for penalized rows"


def test_counts_are_kept_not_recounted() -> None:
    """The counts take in each new token once; rebuilding the tensors every step is gone."""
    row = Row(SamplingParams(frequency_penalty=1.0, repetition_penalty=2.0), prompt_ids=[3])
    process_logits(torch.zeros(1, 6), [row])
    counts = row.penalties
    row.output_ids += [1, 1]
    process_logits(torch.zeros(1, 6), [row])
    row.output_ids += [4]
    logits = torch.ones(1, 6)
    process_logits(logits, [row])
    assert row.penalties is counts and counts.counted == 3
    assert counts.counts.tolist() == [0, 2, 0, 0, 1, 0]
    assert counts.seen.tolist() == [False, True, False, True, True, False]
    assert logits.tolist() == [[1.0, 0.5 - 2.0, 1.0, 0.5, 0.5 - 1.0, 1.0]]


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
    tokens, logprobs, failures = choose_next_tokens(logits, [row])
    assert tokens == [2]
    assert logprobs == [None]
    assert failures == {}


def test_seeded_sampling_is_reproducible_and_leaves_the_global_rng_alone() -> None:
    logits = random_logits(rows=1, vocab=1000)
    params = SamplingParams(temperature=1.0)
    before = torch.get_rng_state()

    def draws(seed: int) -> list[int]:
        generator = seeded(seed)
        row = Row(params, generator=generator)
        return [int(sample(logits, [row])[0][0]) for _ in range(20)]

    assert draws(1) == draws(1)
    assert draws(1) != draws(2)
    assert torch.equal(torch.get_rng_state(), before)


def test_samples_stay_within_top_k() -> None:
    logits = random_logits(rows=1, vocab=100)
    allowed = set(logits[0].topk(3).indices.tolist())
    generator = seeded(0)
    row = Row(SamplingParams(temperature=5.0, top_k=3), generator=generator)
    drawn = {int(sample(logits, [row])[0][0]) for _ in range(200)}
    assert drawn == allowed


def test_greedy_and_sampled_rows_in_one_batch() -> None:
    logits = random_logits(rows=2, vocab=100)
    rows = [
        Row(SamplingParams(temperature=0.0)),
        Row(SamplingParams(temperature=1.0, top_k=1), generator=seeded(0)),
    ]
    tokens, failures = sample(logits, rows)
    assert tokens.tolist() == logits.argmax(dim=-1).tolist()
    assert failures == {}


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
    tokens, logprobs, _ = choose_next_tokens(logits, [Row(params, generator=seeded(0))])
    assert tokens == [3]
    reported = logprobs[0]
    assert reported is not None
    assert reported.logprob == pytest.approx(float(logits.log_softmax(dim=-1)[0, 3]), abs=1e-6)
    assert reported.top[0][0] == int(logits[0].argmax())


def test_more_alternatives_than_the_vocabulary() -> None:
    logits = random_logits(rows=1, vocab=4)
    (result,) = token_logprobs(logits, torch.tensor([0]), [10])
    assert result is not None and len(result.top) == 4


def good_rows() -> list[Row]:
    """Greedy, seeded and penalized rows with logprobs, made afresh (fresh generators)."""
    return [
        Row(SamplingParams(temperature=0.0, logprobs=2)),
        Row(SamplingParams(temperature=0.9, top_p=0.9), generator=seeded(1)),
        Row(SamplingParams(temperature=1.2, top_k=20, logprobs=1), generator=seeded(2)),
        Row(
            SamplingParams(temperature=1.0, repetition_penalty=1.5, frequency_penalty=0.5),
            prompt_ids=[1, 2, 3],
            output_ids=[4, 4],
            generator=seeded(3),
        ),
    ]


def with_bad_row(bad: Row, bad_logits: torch.Tensor | None = None, at: int = 2, steps: int = 4):
    """``steps`` steps of the good rows alone, and with ``bad`` at row ``at`` (its logits
    ``bad_logits``, else random ones): the bad row's failure at each step, and the good rows'
    tokens and logprobs in each run."""
    alone, together = good_rows(), good_rows()
    failures: list[Exception | None] = []
    runs: dict[str, list[Any]] = {"alone": [], "together": []}
    for step in range(steps):
        logits = random_logits(len(alone), VOCAB, seed=step)
        row_logits = random_logits(1, VOCAB, seed=99)[0] if bad_logits is None else bad_logits
        mixed = torch.cat([logits[:at], row_logits.unsqueeze(0), logits[at:]])
        tokens, logprobs, failed = choose_next_tokens(logits, alone)
        assert failed == {}
        runs["alone"].append((tokens, logprobs))
        bad.output_ids.clear()  # the bad row stays at its first step
        tokens, logprobs, failed = choose_next_tokens(mixed, [*together[:at], bad, *together[at:]])
        assert set(failed) <= {at}
        assert [i for i, token in enumerate(tokens) if token is None] == list(failed)
        failures.append(failed.get(at))
        del tokens[at], logprobs[at]
        runs["together"].append((tokens, logprobs))
        for rows, run in ((alone, runs["alone"]), (together, runs["together"])):
            for row, token in zip(rows, run[-1][0], strict=True):
                row.output_ids.append(token)
    return failures, runs["alone"], runs["together"]


VOCAB = 100
UNUSABLE_LOGITS = {
    "NaN": torch.full((VOCAB,), 1.0).index_fill(0, torch.tensor([7]), float("nan")),
    "+inf": torch.zeros(VOCAB).index_fill(0, torch.tensor([3]), float("inf")),
    "all -inf": torch.full((VOCAB,), NEG_INF),
}


@pytest.mark.parametrize("kind", UNUSABLE_LOGITS)
@pytest.mark.parametrize("greedy", [True, False])
def test_a_row_with_unusable_model_logits_fails_alone(kind, greedy):
    params = SamplingParams(temperature=0.0 if greedy else 1.0, logprobs=1)
    bad = Row(params, generator=None if greedy else seeded(7))
    failures, alone, together = with_bad_row(bad, UNUSABLE_LOGITS[kind])
    assert together == alone
    assert all(type(failure) is ServerError for failure in failures)
    assert "the model's logits" in str(failures[0])


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (SamplingParams(logit_bias=dict.fromkeys(range(VOCAB), NEG_INF)), "logit_bias"),
        (SamplingParams(logit_bias={5: float("inf")}), "NaN or \\+inf"),
        (
            SamplingParams(min_tokens=3, logit_bias=dict.fromkeys(range(1, VOCAB), NEG_INF)),
            "min_tokens=3",
        ),
    ],
)
def test_settings_that_exclude_every_token_are_a_400_of_their_row(params, message):
    bad = Row(params, stop_ids={0})
    failures, alone, together = with_bad_row(bad, at=0)
    assert together == alone
    assert all(isinstance(failure, BadRequest) for failure in failures)
    assert re.search(message, str(failures[0])), failures[0]


def test_a_temperature_too_small_to_sample_fails_before_any_draw():
    generator = seeded(5)
    before = generator.get_state()
    bad = Row(SamplingParams(temperature=1e-45), generator=generator)
    failures, alone, together = with_bad_row(bad, at=1)
    assert together == alone
    assert all(isinstance(failure, BadRequest) for failure in failures)
    assert "temperature=1e-45" in str(failures[0])
    assert torch.equal(generator.get_state(), before), "the failed row drew nothing"


def test_processing_that_raises_is_redone_row_by_row():
    """A token id outside the logits (the backend's check would refuse it) breaks the batch's
    processing: the rows are processed one by one and only that row fails."""
    bad = Row(SamplingParams(temperature=0.0, logit_bias={VOCAB + 5: 1.0}))
    failures, alone, together = with_bad_row(bad, at=3)
    assert together == alone
    assert all(isinstance(failure, (IndexError, RuntimeError)) for failure in failures)


def test_rows_without_penalties_keep_no_counts():
    """Only a row whose params ask for a penalty gets counts; the other is not touched."""
    rows = [
        Row(SamplingParams(temperature=0.0, presence_penalty=1.0), output_ids=[1]),
        Row(SamplingParams(temperature=0.0)),
    ]
    logits = torch.zeros(2, 4)
    logits[:, 1] = 0.5
    tokens, _, failures = choose_next_tokens(logits, rows)
    assert tokens == [0, 1] and failures == {}
    assert rows[1].penalties is None
