"""SamplingParams' own arithmetic."""

from __future__ import annotations

import pytest

from huggingfaceserver.generation.params import SamplingParams


@pytest.mark.parametrize(
    ("max_tokens", "prompt", "context", "expected"),
    [
        (None, 10, 100, 90),  # no max_tokens: what the context leaves
        (20, 10, 100, 20),  # max_tokens within the context
        (200, 10, 100, 90),  # max_tokens past it: cut to the context
        (90, 10, 100, 90),  # exactly the rest
    ],
)
def test_answer_tokens_is_max_tokens_within_the_context(
    max_tokens: int | None, prompt: int, context: int, expected: int
) -> None:
    assert SamplingParams(max_tokens=max_tokens).answer_tokens(prompt, context) == expected
