"""Rows of a decode batch stepped with :func:`advance`: a row that fails (its model logits, its
settings, its grammar, its text) fails alone, and every other row, greedy or seeded, constrained
or not, produces exactly what it produces in a batch without the failed row."""

from __future__ import annotations

import zlib
from collections.abc import Callable

import pytest
import torch

from huggingfaceserver.backends.pytorch.sampling import SamplingBatch
from huggingfaceserver.backends.pytorch.sequence import SequenceState, advance
from huggingfaceserver.errors import BadRequest, ServerError
from huggingfaceserver.generation.constraints import Grammars
from huggingfaceserver.generation.params import (
    ChoiceDelta,
    Constraint,
    FinishReason,
    SamplingParams,
)
from huggingfaceserver.generation.text import ChoiceText

STEPS = 6
Outcomes = dict[str, list[ChoiceDelta | Exception]]


class BrokenText(ChoiceText):
    """Text making that breaks on the row's first token."""

    def take(self, token_id: int, ended: FinishReason | None) -> tuple[str, FinishReason | None]:
        raise RuntimeError("the detokenizer broke")


def row(
    tokenizer,
    params: SamplingParams,
    seed: int | None = None,
    grammars: Grammars | None = None,
    text: type[ChoiceText] = ChoiceText,
) -> SequenceState:
    constraint = params.constraint
    return SequenceState(
        index=0,
        params=params,
        prompt_ids=tokenizer("Hello world").input_ids,
        stop_ids=frozenset({tokenizer.eos_token_id}),
        budget=STEPS,
        generator=None if seed is None else torch.Generator().manual_seed(seed),
        text=text.for_params(tokenizer, params),
        matcher=grammars.matcher(constraint) if grammars and constraint else None,
    )


def good_rows(tokenizer, grammars: Grammars) -> dict[str, SequenceState]:
    """Rows of every kind, made afresh (fresh generators and matchers)."""
    letters = SamplingParams(temperature=0.0, constraint=Constraint("regex", "[a-z ]{3,}"))
    choice = SamplingParams(temperature=1.0, constraint=Constraint("choice", '["red", "blue"]'))
    return {
        "greedy": row(tokenizer, SamplingParams(temperature=0.0, logprobs=2)),
        "seeded": row(tokenizer, SamplingParams(temperature=1.0, top_p=0.9), seed=1),
        "penalized": row(
            tokenizer,
            SamplingParams(temperature=0.8, repetition_penalty=1.3, presence_penalty=0.5),
            seed=2,
        ),
        "letters": row(tokenizer, letters, grammars=grammars),
        "choice": row(tokenizer, choice, seed=3, grammars=grammars),
    }


def random_logits(name: str, step: int, vocab: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(zlib.crc32(f"{name}/{step}".encode()))
    return torch.randn(vocab, generator=generator) * 3


def decode(
    rows: dict[str, SequenceState], logits_of: Callable[[str, int], torch.Tensor]
) -> Outcomes:
    """Step the rows as the decode loop does (a row leaves when it finishes or fails): each
    row's outcome at each of its steps."""
    outcomes: Outcomes = {name: [] for name in rows}
    live = dict(rows)
    sampler = None
    for step in range(STEPS):
        names = list(live)
        if not names:
            break
        logits = torch.stack([logits_of(name, step) for name in names])
        batch = [live[n] for n in names]
        sampler = SamplingBatch.for_rows(batch, logits, sampler)
        for name, outcome in zip(names, advance(batch, logits, sampler), strict=True):
            outcomes[name].append(outcome)
            if isinstance(outcome, Exception) or live[name].finish_reason is not None:
                del live[name]
    return outcomes


def with_and_without(
    tokenizer, grammars: Grammars, bad: SequenceState, bad_logits: torch.Tensor | None = None
) -> tuple[Outcomes, Outcomes, list[ChoiceDelta | Exception]]:
    """The good rows' outcomes without and with ``bad`` in the middle of the batch, and the
    bad row's own."""
    vocab = len(tokenizer)

    def logits_of(name: str, step: int) -> torch.Tensor:
        if name == "bad" and bad_logits is not None:
            return bad_logits
        return random_logits(name, step, vocab)

    alone = decode(good_rows(tokenizer, grammars), logits_of)
    rows = good_rows(tokenizer, grammars)
    names = list(rows)
    mixed = {name: rows[name] for name in names[:2]} | {"bad": bad}
    mixed |= {name: rows[name] for name in names[2:]}
    together = decode(mixed, logits_of)
    return alone, {name: together[name] for name in names}, together["bad"]


def test_the_good_rows_decode(tokenizer, grammars):
    """The baseline is not empty: every good row gets tokens, the constrained ones keep to
    their grammar."""
    outcomes = decode(good_rows(tokenizer, grammars), lambda n, s: random_logits(n, s, 400))
    for name, deltas in outcomes.items():
        assert deltas and all(isinstance(d, ChoiceDelta) for d in deltas), name
    choice = "".join(d.text for d in outcomes["choice"] if isinstance(d, ChoiceDelta))
    assert choice in ("red", "blue")


@pytest.mark.parametrize("kind", ["NaN", "all -inf"])
def test_a_row_with_unusable_model_logits_fails_alone(tokenizer, grammars, kind):
    vocab = len(tokenizer)
    logits = torch.full((vocab,), float("nan") if kind == "NaN" else float("-inf"))
    bad = row(tokenizer, SamplingParams(temperature=1.0), seed=9)
    alone, together, [failure] = with_and_without(tokenizer, grammars, bad, logits)
    assert together == alone
    assert type(failure) is ServerError
    assert "the model's logits" in str(failure)


def test_a_matcher_in_error_fails_its_row_alone(tokenizer, grammars):
    bad = row(tokenizer, SamplingParams(constraint=Constraint("regex", "[0-9]+")), 4, grammars)
    assert bad.matcher is not None
    bad.matcher.matcher.consume_token(tokenizer.convert_tokens_to_ids("a"))  # not a digit
    alone, together, [failure] = with_and_without(tokenizer, grammars, bad)
    assert together == alone
    assert isinstance(failure, BadRequest)
    assert str(failure).startswith("structured output failed:")


def test_a_row_whose_text_breaks_fails_alone(tokenizer, grammars):
    bad = row(tokenizer, SamplingParams(temperature=1.0), seed=5, text=BrokenText)
    alone, together, [failure] = with_and_without(tokenizer, grammars, bad)
    assert together == alone
    assert isinstance(failure, RuntimeError)
    assert str(failure) == "the detokenizer broke"


def test_a_complete_grammar_under_min_tokens_is_a_400_that_says_so(tokenizer, grammars):
    """The grammar allows only the end, min_tokens forbids it: nothing is left, and the row
    fails rather than go on unconstrained."""
    params = SamplingParams(
        temperature=0.0, min_tokens=20, constraint=Constraint("choice", '["1"]')
    )
    bad = row(tokenizer, params, grammars=grammars)
    alone, together, outcomes = with_and_without(tokenizer, grammars, bad)
    assert together == alone
    *deltas, failure = outcomes
    assert "".join(d.text for d in deltas if isinstance(d, ChoiceDelta)) == "1"
    assert isinstance(failure, BadRequest)
    assert str(failure) == (
        "no token is allowed: the grammar is complete but min_tokens=20 forbids ending"
    )


def test_a_token_the_grammar_refuses_fails_the_append(tokenizer, grammars):
    state = row(tokenizer, SamplingParams(constraint=Constraint("regex", "[0-9]+")), 1, grammars)
    with pytest.raises(BadRequest, match="structured output failed"):
        state.append(tokenizer.convert_tokens_to_ids("a"), None)


def test_a_grammar_ends_its_row_with_the_end_of_sequence(tokenizer, grammars):
    params = SamplingParams(temperature=0.0, constraint=Constraint("choice", '["1"]'))
    state = row(tokenizer, params, grammars=grammars)
    outcomes = decode({"one": state}, lambda n, s: random_logits(n, s, len(tokenizer)))
    deltas = outcomes["one"]
    assert all(isinstance(d, ChoiceDelta) for d in deltas)
    assert state.finish_reason == "stop"
    assert state.output_ids[-1] == tokenizer.eos_token_id
    assert "".join(d.text for d in deltas if isinstance(d, ChoiceDelta)) == "1"
