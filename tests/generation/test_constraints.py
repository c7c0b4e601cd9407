"""Grammar-constrained decoding with llguidance: a greedy walk through the masks of a row
spells what its grammar allows, the masks of a batch (one llguidance call) are each row's own
(``compute_bitmask`` one row at a time is the oracle), a matcher in error fails its row,
invalid grammars are 400s, and grammars are cached."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from huggingfaceserver.backends.pytorch.masks import mask_disallowed, unpack_bitmask
from huggingfaceserver.errors import BadRequest
from huggingfaceserver.generation.constraints import GrammarMatcher, Grammars
from huggingfaceserver.generation.params import Constraint
from tiny_models import train_llama_tokenizer

NEG_INF = float("-inf")
CONSTRAINTS = [
    Constraint("regex", "[0-9]{2}-[ab]+"),
    Constraint("choice", '["red", "green"]'),
    Constraint("grammar", 'root ::= "<" ("x" | "y") ">"'),
    Constraint("json", '{"type": "object", "properties": {"a": {"type": "integer"}}}'),
]


def walk(grammars: Grammars, tokenizer, constraint: Constraint, logits_seed: int) -> str:
    """Decode under the constraint, choosing the most likely allowed token of random logits,
    until the end of sequence: the text the grammar let through."""
    return walk_from(grammars.matcher(constraint), tokenizer, logits_seed)


def walk_from(matcher: GrammarMatcher, tokenizer, logits_seed: int) -> str:
    """:func:`walk` from where ``matcher`` is."""
    generator = torch.Generator().manual_seed(logits_seed)
    tokens: list[int] = []
    for _ in range(200):
        logits = torch.randn(1, len(tokenizer), generator=generator)
        assert mask_disallowed(logits, [(0, matcher)]) == {}
        token = int(logits.argmax())
        if token == tokenizer.eos_token_id:
            return tokenizer.decode(tokens)
        matcher.consume(token)
        tokens.append(token)
    raise AssertionError("the grammar never allowed the end of sequence")


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    ("constraint", "check"),
    [
        (Constraint("regex", "[0-9]{2}-[ab]+"), lambda t: re.fullmatch("[0-9]{2}-[ab]+", t)),
        (Constraint("choice", '["red", "green"]'), lambda t: t in ("red", "green")),
        (Constraint("grammar", 'root ::= "<" ("x" | "y") ">"'), lambda t: t in ("<x>", "<y>")),
        (
            Constraint(
                "json",
                json.dumps(
                    {
                        "type": "object",
                        "properties": {"a": {"type": "boolean"}},
                        "required": ["a"],
                        "additionalProperties": False,
                    }
                ),
            ),
            lambda t: json.loads(t) in ({"a": True}, {"a": False}) and " " not in t,
        ),
    ],
)
def test_a_walk_through_the_masks_spells_what_the_grammar_allows(
    grammars, tokenizer, constraint, check, seed
):
    text = walk(grammars, tokenizer, constraint, seed)
    assert check(text), text


@pytest.mark.parametrize(
    ("constraint", "in_message"),
    [
        (Constraint("regex", "(unclosed"), "invalid regex"),
        (Constraint("json", '{"type": "nonsense"}'), "invalid JSON schema"),
        (Constraint("grammar", "root ::= ("), "invalid grammar"),
    ],
)
def test_invalid_grammars_are_400s(grammars, constraint, in_message):
    with pytest.raises(BadRequest, match=in_message):
        grammars.grammar(constraint)


def test_grammars_are_cached(grammars):
    constraint = Constraint("regex", "[a-z]{4}")
    assert grammars.grammar(constraint) is grammars.grammar(constraint)


def reference_allowed(matcher: GrammarMatcher, vocab: int) -> torch.Tensor:
    """Which tokens the matcher allows next, one row on its own: a bool mask ``[vocab]``."""
    words = torch.frombuffer(bytearray(matcher.matcher.compute_bitmask()), dtype=torch.int32)
    bits = ((words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten().bool()
    allowed = torch.zeros(vocab, dtype=torch.bool)
    width = min(vocab, len(bits))
    allowed[:width] = bits[:width]
    return allowed


def advanced(grammars: Grammars, tokenizer, constraint: Constraint, steps: int, seed: int):
    """A matcher moved ``steps`` tokens into its grammar (greedy on random logits)."""
    matcher = grammars.matcher(constraint)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        logits = torch.randn(1, len(tokenizer), generator=generator)
        mask_disallowed(logits, [(0, matcher)])
        token = int(logits.argmax())
        if token == tokenizer.eos_token_id:
            break
        matcher.consume(token)
    return matcher


def test_a_mask_allows_only_the_grammars_next_tokens(grammars, tokenizer):
    matcher = grammars.matcher(Constraint("choice", '["zebra"]'))
    logits = torch.zeros(1, len(tokenizer))
    mask_disallowed(logits, [(0, matcher)])
    allowed = (logits[0] > NEG_INF).nonzero().flatten().tolist()
    assert 0 < len(allowed) < len(tokenizer)
    for token in allowed:
        assert "zebra".startswith(tokenizer.decode([token]))


@pytest.mark.parametrize("seed", range(3))
def test_the_masks_of_a_batch_are_each_rows_own(grammars, tokenizer, seed):
    """Constrained rows in any positions, at different places in different grammars; the
    unconstrained rows between them are not touched."""
    vocab = len(tokenizer)
    generator = torch.Generator().manual_seed(seed)
    matchers = [
        (row, advanced(grammars, tokenizer, constraint, steps, seed))
        for row, constraint, steps in zip(
            [0, 2, 3, 5], CONSTRAINTS, [0, 2, 1, 3][seed:] + [0, 2, 1, 3][:seed], strict=True
        )
    ]
    logits = torch.randn(7, vocab, generator=generator)
    expected = logits.clone()
    for row, matcher in matchers:
        expected[row] = expected[row].masked_fill(~reference_allowed(matcher, vocab), NEG_INF)
    assert mask_disallowed(logits, matchers) == {}
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("extra", [0, 13, 45])
@pytest.mark.parametrize("logits_extra", [-5, 0, 40])
def test_masks_fit_logits_wider_or_narrower_than_the_grammars_vocabulary(
    tokenizer, extra, logits_extra
):
    """The grammar's vocabulary (the model's, maybe more than the tokenizer's and not a
    multiple of 32) against logits of another width: tokens past the mask are never allowed,
    a mask wider than the logits is cut."""
    grammars = Grammars(tokenizer, len(tokenizer) + extra, [tokenizer.eos_token_id])
    matcher = grammars.matcher(Constraint("regex", "[a-z]+"))
    width = len(tokenizer) + logits_extra
    logits = torch.zeros(2, width)
    assert mask_disallowed(logits, [(1, matcher)]) == {}
    assert torch.equal(logits[0], torch.zeros(width))
    expected = torch.zeros(width).masked_fill(~reference_allowed(matcher, width), NEG_INF)
    assert torch.equal(logits[1], expected)
    assert (logits[1, len(tokenizer) + extra :] == NEG_INF).all()


def test_unpacking_matches_the_bit_order_of_llguidance():
    words = np.array([[1, -(2**31), 0b1010], [-1, 0, 3]], dtype=np.int32)
    unpacked = unpack_bitmask(words, 70, torch.device("cpu"))
    expected = (
        (torch.from_numpy(words).unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    ).flatten(1)[:, :70]
    assert torch.equal(unpacked, expected.bool())
    assert unpacked[0].nonzero().flatten().tolist() == [0, 63, 65, 67]


def in_error(grammars: Grammars, tokenizer) -> GrammarMatcher:
    matcher = grammars.matcher(Constraint("regex", "[0-9]+"))
    assert not matcher.matcher.consume_token(tokenizer.convert_tokens_to_ids("a"))
    return matcher


def test_a_matcher_in_error_fails_its_row_and_no_other(grammars, tokenizer):
    broken = in_error(grammars, tokenizer)
    fine = grammars.matcher(Constraint("regex", "[0-9]+"))
    logits = torch.zeros(2, len(tokenizer))
    failures = mask_disallowed(logits, [(0, broken), (1, fine)])
    assert list(failures) == [0]
    assert isinstance(failures[0], BadRequest)
    assert str(failures[0]).startswith("structured output failed:")
    assert "\n" not in str(failures[0])
    assert torch.equal(logits[1] > NEG_INF, reference_allowed(fine, len(tokenizer)))


def test_a_token_the_grammar_refuses_is_a_400(grammars, tokenizer):
    matcher = grammars.matcher(Constraint("regex", "[0-9]+"))
    with pytest.raises(BadRequest, match="structured output failed"):
        matcher.consume(tokenizer.convert_tokens_to_ids("a"))


def test_a_grammar_with_nothing_left_but_the_end_is_complete(grammars, tokenizer):
    matcher = grammars.matcher(Constraint("choice", '["1"]'))
    assert not matcher.complete
    for token in tokenizer("1", add_special_tokens=False).input_ids:
        matcher.consume(token)
    assert matcher.complete
    logits = torch.zeros(1, len(tokenizer))
    mask_disallowed(logits, [(0, matcher)])
    assert (logits[0] > NEG_INF).nonzero().flatten().tolist() == [tokenizer.eos_token_id]


@pytest.fixture(scope="module")
def thinking_tokenizer(tmp_path_factory):
    """The tiny Llama's tokenizer with reasoning markers as tokens (as thinking models have)."""
    tokenizer = train_llama_tokenizer(tmp_path_factory.mktemp("thinking"))
    tokenizer.add_tokens(["<think>", "</think>"])
    return tokenizer


@pytest.mark.parametrize("seed", range(3))
def test_a_constraint_after_the_reasoning_leaves_the_reasoning_free(thinking_tokenizer, seed):
    tokenizer = thinking_tokenizer
    grammars = Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    constraint = Constraint("choice", '["red", "green"]', after="</think>")
    matcher = grammars.matcher(constraint)
    for token in tokenizer.encode("<think>Any text, even {", add_special_tokens=False):
        logits = torch.zeros(1, len(tokenizer))
        assert mask_disallowed(logits, [(0, matcher)]) == {}
        assert not logits.isinf().any()  # every token, the end of sequence too
        matcher.consume(token)
    matcher.consume(tokenizer.convert_tokens_to_ids("</think>"))
    assert walk_from(matcher, tokenizer, seed) in ("red", "green")


def test_an_end_marker_the_vocabulary_lacks_is_a_400(grammars):
    with pytest.raises(BadRequest, match="'</think>' as one token"):
        grammars.matcher(Constraint("choice", '["red", "green"]', after="</think>"))
