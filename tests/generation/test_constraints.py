"""Grammar-constrained decoding with llguidance: a greedy walk through the masks of a row
spells what its grammar allows, invalid grammars are 400s, and grammars are cached."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from huggingfaceserver.errors import BadRequest
from huggingfaceserver.generation.constraints import Grammars, allowed_tokens, mask_disallowed
from huggingfaceserver.generation.params import Constraint


@pytest.fixture(scope="module")
def tokenizer(tiny_models: dict[str, Path]):
    return AutoTokenizer.from_pretrained(tiny_models["llama"])


@pytest.fixture(scope="module")
def grammars(tokenizer) -> Grammars:
    return Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def walk(grammars: Grammars, tokenizer, constraint: Constraint, logits_seed: int) -> str:
    """Decode under the constraint, choosing the most likely allowed token of random logits,
    until the end of sequence: the text the grammar let through."""
    matcher = grammars.matcher(constraint)
    generator = torch.Generator().manual_seed(logits_seed)
    tokens: list[int] = []
    for _ in range(200):
        logits = torch.randn(len(tokenizer), generator=generator)
        mask_disallowed(logits, matcher)
        token = int(logits.argmax())
        if token == tokenizer.eos_token_id:
            return tokenizer.decode(tokens)
        assert matcher.consume_token(token)
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


def test_a_mask_allows_only_the_grammars_next_tokens(grammars, tokenizer):
    matcher = grammars.matcher(Constraint("choice", '["zebra"]'))
    allowed = allowed_tokens(matcher, len(tokenizer))
    assert 0 < int(allowed.sum()) < len(tokenizer)
    for token in allowed.nonzero().flatten().tolist():
        assert "zebra".startswith(tokenizer.decode([token]))
