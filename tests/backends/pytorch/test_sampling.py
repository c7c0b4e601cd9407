"""A decode step's token choice for a whole batch (:class:`SamplingBatch`) against the per-row
computation it replaced, row by row (every sampling parameter, greedy and seeded), across steps
in which rows take their tokens, leave and join; the one copy to the host per step; and a row
that fails, failing alone."""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from huggingfaceserver.backends.pytorch.logits import filter_for_sampling
from huggingfaceserver.backends.pytorch.sampling import SamplingBatch, sampling_generator
from huggingfaceserver.errors import BadRequest, ServerError
from huggingfaceserver.generation.params import SamplingParams, TokenLogprob
from huggingfaceserver.observability.syncs import SyncCounter

NEG_INF = float("-inf")
VOCAB = 100


@dataclass(eq=False)
class Row:
    params: SamplingParams
    prompt_ids: Sequence[int] = ()
    output_ids: list[int] = field(default_factory=list)
    stop_ids: Collection[int] = ()
    generator: torch.Generator | None = None
    matcher: Any = None


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_logits(rows: int = 3, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=seeded(seed)) * 3


def per_row(logits: torch.Tensor, row: Row) -> tuple[int, TokenLogprob | None]:
    """The token and logprobs of one row alone, computed from scratch as every step did before
    the batch kept its settings and counts on the device: bias, min_tokens, the penalties
    recounted from the row's tokens (transformers' repetition penalty), the filters, then the
    argmax or a draw (the inverse of its cumulative distribution) from the row's own
    generator."""
    p = row.params
    x = logits.float().clone()
    for token, bias in p.logit_bias.items():
        x[token] += bias
    if len(row.output_ids) < p.min_tokens:
        for token in row.stop_ids:
            x[token] = NEG_INF
    if p.repetition_penalty != 1.0:
        seen = torch.tensor([[*row.prompt_ids, *row.output_ids]], dtype=torch.long)
        x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(seen, x[None])[0]
    for token in set(row.output_ids):
        count = row.output_ids.count(token)
        x[token] -= p.presence_penalty + p.frequency_penalty * count
    if p.greedy:
        token = int(x.argmax())
    else:
        enabled = 0 < p.top_k < x.shape[0]
        filtered = filter_for_sampling(
            x[None],
            torch.tensor([[p.temperature]]),
            torch.tensor([p.top_k if enabled else 0]),
            torch.tensor([[p.top_p]]) if p.top_p < 1 else None,
            torch.tensor([[p.min_p]]) if p.min_p > 0 else None,
            p.top_k if enabled else 0,
        )[0]
        uniform = torch.empty(1).uniform_(generator=row.generator).clamp(min=2.0**-40)
        cumulative = filtered.softmax(-1).cumsum(-1)
        token = int(torch.searchsorted(cumulative, uniform * cumulative[-1]))
    if p.logprobs is None:
        return token, None
    logprobs = logits.float().log_softmax(-1)
    top = logprobs.topk(min(p.logprobs, logprobs.shape[0]))
    pairs = tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True))
    return token, TokenLogprob(token, float(logprobs[token]), pairs)


PARAMS = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.0, 0.6, 1.0, 1.4]),
    top_k=st.sampled_from([0, 0, 1, 5, 200]),
    top_p=st.sampled_from([1.0, 1.0, 0.8]),
    min_p=st.sampled_from([0.0, 0.0, 0.1]),
    repetition_penalty=st.sampled_from([1.0, 1.0, 0.6, 1.3]),
    presence_penalty=st.sampled_from([0.0, 0.0, 0.5, -0.7]),
    frequency_penalty=st.sampled_from([0.0, 0.0, 0.25, 1.5]),
    logit_bias=st.sampled_from([{}, {}, {0: 1.5, 3: -2.0}]),
    min_tokens=st.sampled_from([0, 0, 2]),
    logprobs=st.sampled_from([None, None, 0, 3]),
)


def assert_same(got: TokenLogprob | None, want: TokenLogprob | None) -> None:
    assert (got is None) == (want is None)
    if got is not None and want is not None:
        assert got.token_id == want.token_id
        assert got.logprob == pytest.approx(want.logprob, abs=1e-5)
        assert [t for t, _ in got.top] == [t for t, _ in want.top]
        assert [v for _, v in got.top] == pytest.approx([v for _, v in want.top], abs=1e-5)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_every_setting_as_the_per_row_computation(data: st.DataObject) -> None:
    """Rows of every kind, stepped together as the decode loop steps them (each takes its
    token; now and then one leaves and a new one joins): each step's tokens and logprobs are
    those of each row computed alone, and the counts kept on the device equal recounting."""
    vocab = data.draw(st.integers(8, 60), label="vocab")
    token = st.integers(0, vocab - 1)
    made = 0

    def new_row() -> tuple[Row, Row]:
        """The same row twice (one for the batch, one for the oracle): same seed."""
        nonlocal made
        made += 1
        params = data.draw(PARAMS, label="params")
        prompt = data.draw(st.lists(token, max_size=6), label="prompt")
        stops = data.draw(st.sets(token, max_size=2), label="stops")
        pair = tuple(
            Row(params, prompt, stop_ids=stops, generator=None if params.greedy else seeded(made))
            for _ in range(2)
        )
        return pair  # type: ignore[return-value]

    pairs = [new_row() for _ in range(data.draw(st.integers(1, 5), label="rows"))]
    sampler = None
    for step in range(data.draw(st.integers(1, 6), label="steps")):
        logits = random_logits(len(pairs), vocab, seed=step)
        rows = [mine for mine, _ in pairs]
        sampler = SamplingBatch.for_rows(rows, logits, sampler)
        tokens, logprobs, failures = sampler.choose(logits)
        assert failures == {}
        for i, (mine, oracle) in enumerate(pairs):
            want_token, want_logprob = per_row(logits[i], oracle)
            assert tokens[i] == want_token, (step, i, mine.params)
            assert_same(logprobs[i], want_logprob)
            mine.output_ids.append(want_token)
            oracle.output_ids.append(want_token)
        if data.draw(st.booleans(), label="a row leaves") and len(pairs) > 1:
            del pairs[data.draw(st.integers(0, len(pairs) - 1), label="which")]
        if data.draw(st.booleans(), label="a row joins"):
            pairs.append(new_row())


def test_a_seeded_row_draws_the_same_alone_and_in_any_batch() -> None:
    params = SamplingParams(temperature=1.0, top_p=0.95)
    alone = Row(params, generator=seeded(42))
    together = Row(params, generator=seeded(42))
    others = [
        Row(SamplingParams(temperature=t), generator=seeded(i)) for i, t in enumerate([0.5, 2.0])
    ]
    sampler_alone = sampler_together = None
    for step in range(10):
        logits = random_logits(3, VOCAB, seed=step)
        sampler_alone = SamplingBatch.for_rows([alone], logits[1:2], sampler_alone)
        batch = [others[0], together, others[1], Row(SamplingParams(temperature=1.0))]
        mixed = torch.cat([logits, random_logits(1, VOCAB, seed=100 + step)])
        sampler_together = SamplingBatch(batch, VOCAB, mixed.device)
        (mine,), _, _ = sampler_alone.choose(logits[1:2])
        theirs = sampler_together.choose(mixed).tokens[1]
        assert mine == theirs
        alone.output_ids.append(mine)
        together.output_ids.append(mine)


def test_draws_follow_the_distribution() -> None:
    """4,000 seeded rows of one distribution: each token's share within 3 standard errors."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, NEG_INF]]).expand(4000, -1)
    rows = [Row(SamplingParams(temperature=1.0), generator=seeded(i)) for i in range(4000)]
    tokens = SamplingBatch(rows, 5, logits.device).choose(logits).tokens
    probs = logits[0].softmax(-1)
    for token in range(5):
        share = tokens.count(token) / len(tokens)
        error = (float(probs[token]) * (1 - float(probs[token])) / len(tokens)) ** 0.5
        assert abs(share - float(probs[token])) <= 3 * error + 1e-9, token


def test_unseeded_rows_leave_the_global_rng_alone_and_differ() -> None:
    before = torch.get_rng_state()
    logits = random_logits(2, 1000)
    rows = [Row(SamplingParams(temperature=1.0)) for _ in range(2)]
    draws = [SamplingBatch(rows, 1000, logits.device).choose(logits).tokens for _ in range(20)]
    assert len({tuple(d) for d in draws}) > 1
    assert torch.equal(torch.get_rng_state(), before)
    assert sampling_generator(torch.device("cpu")).initial_seed() != torch.initial_seed()


@pytest.mark.parametrize("count", [1, 8, 32])
def test_one_copy_to_the_host_per_step(count: int) -> None:
    """Whatever the rows and their settings: one read of the device's values per step."""
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=5, seed=1),
        SamplingParams(temperature=1.0, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=0.0, repetition_penalty=1.2, logprobs=2),
        SamplingParams(temperature=0.7, frequency_penalty=0.5, logit_bias={1: 2.0}, min_tokens=3),
    ]
    rows = [
        Row(kinds[i % len(kinds)], prompt_ids=[1, 2], stop_ids={0}, generator=seeded(i))
        for i in range(count)
    ]
    sampler = None
    counter = SyncCounter()
    for step in range(4):
        logits = random_logits(count, VOCAB, seed=step)
        sampler = SamplingBatch.for_rows(rows, logits, sampler)
        with counter:
            tokens, _, failures = sampler.choose(logits)
        assert failures == {}
        assert counter.total == step + 1, counter.counts
        for row, token in zip(rows, tokens, strict=True):
            row.output_ids.append(token)  # type: ignore[arg-type]


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
    """``steps`` steps of the good rows alone, and with ``bad`` at row ``at`` in the first step
    (its logits ``bad_logits``, else random ones), after which it leaves as a failed row
    leaves the decode loop: the bad row's failure, and the good rows' tokens and logprobs in
    each run."""
    runs: dict[str, list[Any]] = {"alone": [], "together": []}
    failure = None
    for run in runs:
        rows = good_rows()
        sampler = None
        for step in range(steps):
            logits = random_logits(len(rows), VOCAB, seed=step)
            batch = rows
            if run == "together" and step == 0:
                row_logits = (
                    random_logits(1, VOCAB, seed=99)[0] if bad_logits is None else bad_logits
                )
                logits = torch.cat([logits[:at], row_logits.unsqueeze(0), logits[at:]])
                batch = [*rows[:at], bad, *rows[at:]]
            sampler = SamplingBatch.for_rows(batch, logits, sampler)
            tokens, logprobs, failed = sampler.choose(logits)
            if batch is not rows:
                assert set(failed) == {at}
                assert tokens[at] is None
                failure = failed[at]
                del tokens[at], logprobs[at]
            else:
                assert failed == {}
            runs[run].append((tokens, logprobs))
            for row, token in zip(rows, tokens, strict=True):
                row.output_ids.append(token)
    return failure, runs["alone"], runs["together"]


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
    failure, alone, together = with_bad_row(bad, UNUSABLE_LOGITS[kind])
    assert together == alone
    assert type(failure) is ServerError
    assert "the model's logits" in str(failure)


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
    failure, alone, together = with_bad_row(bad, at=0)
    assert together == alone
    assert isinstance(failure, BadRequest)
    assert re.search(message, str(failure)), failure


def test_a_temperature_too_small_to_sample_fails_its_row_alone():
    bad = Row(SamplingParams(temperature=1e-45), generator=seeded(5))
    failure, alone, together = with_bad_row(bad, at=1)
    assert together == alone
    assert isinstance(failure, BadRequest)
    assert "temperature=1e-45" in str(failure)


def test_processing_that_raises_is_redone_row_by_row():
    """A token id outside the logits (the backend's check would refuse it) breaks the batch's
    processing: the rows are processed one by one and only that row fails."""
    bad = Row(SamplingParams(temperature=0.0, logit_bias={VOCAB + 5: 1.0}))
    failure, alone, together = with_bad_row(bad, at=3)
    assert together == alone
    assert isinstance(failure, (IndexError, RuntimeError))


def test_rows_without_penalties_keep_no_counts():
    rows = [
        Row(SamplingParams(temperature=0.0, presence_penalty=1.0), output_ids=[1]),
        Row(SamplingParams(temperature=0.0)),
    ]
    logits = torch.zeros(2, 4)
    logits[:, 1] = 0.5
    sampler = SamplingBatch(rows, 4, logits.device)
    tokens, _, failures = sampler.choose(logits)
    assert tokens == [0, 1] and failures == {}
    assert sampler.count_rows == [0] and sampler.seen is None
    assert sampler.counts is not None and sampler.counts.tolist() == [[1.0, 1.0, 0, 0]]


def test_counts_carry_over_when_rows_change():
    """A row's counts move with it into the next batch (not recounted), and a joining row's
    are counted from its tokens."""
    first = Row(SamplingParams(temperature=0.0, frequency_penalty=1.0), output_ids=[2])
    sampler = SamplingBatch([first], 6, torch.device("cpu"))
    logits = torch.zeros(1, 6)
    logits[0, 4] = 1.0
    assert sampler.choose(logits).tokens == [4]
    first.output_ids.append(4)
    joining = Row(SamplingParams(temperature=0.0, frequency_penalty=1.0), output_ids=[5, 5])
    first.output_ids.clear()  # the carried counts, not the row's tokens, hold its history
    after = SamplingBatch.for_rows([joining, first], torch.zeros(2, 6), sampler)
    assert after is not sampler
    assert after.counts is not None
    assert after.counts.tolist() == [[0, 0, 0, 0, 0, 2.0], [0, 0, 1.0, 0, 1.0, 0]]


def test_a_step_begun_then_read_later_gives_what_choose_gives() -> None:
    """:meth:`SamplingBatch.begin` chooses on the device and :meth:`Chosen.result` reads the
    outcome later, after the next step was queued: the tokens and logprobs of ``choose``. With
    ``volatile`` (the logits are a recorded step's output, which the next step overwrites in
    between) a failed row is still told from its own logits: NaN, not a 400 about the
    request's settings."""
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(seed=5, logprobs=1)]

    def rows() -> list[Row]:
        return [Row(params[0]), Row(params[1], generator=seeded(1))]

    logits = random_logits(rows=2, vocab=VOCAB)
    reference = SamplingBatch.for_rows(rows(), logits, None).choose(logits)
    batch = SamplingBatch.for_rows(rows(), logits, None)
    chosen = batch.begin(logits, volatile=True)
    assert batch.tokens is not None and batch.tokens.tolist() == reference.tokens
    assert chosen.result() == reference

    broken = logits.clone().index_fill_(1, torch.tensor([7]), float("nan"))
    chosen = SamplingBatch.for_rows(rows(), broken, None).begin(broken, volatile=True)
    broken.copy_(logits)  # the next step's logits, in the same tensor
    failures = chosen.result().failures
    assert set(failures) == {0, 1}
    assert {str(failure) for failure in failures.values()} == {"the model's logits are NaN"}
