"""A request's own truncation against the server's: what it resolves to, and what is a 400."""

from __future__ import annotations

import pytest

from huggingfaceserver.backends.truncation import Truncation, asked_truncation
from huggingfaceserver.encoder_tasks.params import EncodeParams
from huggingfaceserver.errors import BadRequest

SERVER = Truncation(True, "right", 128)
SPECIALS = 2


@pytest.mark.parametrize(
    ("params", "resolved"),
    [
        (EncodeParams(), None),
        (EncodeParams(truncate=True, truncation_side="right"), None),  # the server's own
        (EncodeParams(truncation_side="left"), Truncation(True, "left", 128)),
        (EncodeParams(truncate=False), Truncation(False, "right", 128)),
        (EncodeParams(max_tokens=16), Truncation(True, "right", 16)),
        (EncodeParams(max_tokens=-1, truncation_side="left"), Truncation(True, "left", 128)),
    ],
)
def test_what_a_request_asks_for(params, resolved):
    assert asked_truncation(params, SERVER, SPECIALS) == resolved


def test_a_request_may_truncate_a_server_that_does_not():
    server = Truncation(False, "right", 128)
    assert asked_truncation(EncodeParams(truncate=True), server, SPECIALS) == SERVER
    assert asked_truncation(EncodeParams(max_tokens=8), server, SPECIALS) == Truncation(
        True, "right", 8
    )
    assert asked_truncation(EncodeParams(truncation_side="left"), server, SPECIALS) == Truncation(
        False, "left", 128
    )


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (lambda: EncodeParams(max_tokens=129), "exceeds the maximum of 128 tokens"),
        (lambda: EncodeParams(max_tokens=2), "leaves no room for text beside the model's 2"),
        (lambda: EncodeParams(max_tokens=0), "must be -1 (the maximum) or a positive number"),
        (lambda: EncodeParams(max_tokens=4, truncate=False), "truncate is false"),
        (lambda: EncodeParams(truncation_side="middle"), "is not one of right, left"),
        (lambda: EncodeParams(prompt="a", prompt_name="b"), "not both"),
    ],
)
def test_requests_that_contradict_themselves_or_the_model(params, message):
    with pytest.raises(BadRequest, match=message.replace("(", r"\(").replace(")", r"\)")):
        asked_truncation(params(), SERVER, SPECIALS)
