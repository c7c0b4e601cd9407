"""OpenAI's two logprob formats, shaped from (token text, logprob, top alternatives) triples.

Completions use parallel lists (``tokens``, ``token_logprobs``, ``top_logprobs`` as
``{token: logprob}`` dicts, ``text_offset``); chat uses one object per token with the token's
UTF-8 ``bytes`` and a ``top_logprobs`` list. Turning token ids into text is the caller's job.

The models declare the fields of the ``openai`` SDK's ``completion_choice.Logprobs``,
``ChatCompletionTokenLogprob`` and ``TopLogprob``, in the same order, without importing it
(tests/protocols/openai/test_responses.py parses their JSON with the SDK's types).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from pydantic import BaseModel

FLOOR_LOGPROB = -9999.0
"""What OpenAI sends for a token too unlikely to matter; JSON has no ``-Infinity``."""


class TokenLogprobText(NamedTuple):
    """One token: its text, its logprob, and the top (text, logprob) alternatives. An echoed
    prompt's first token has neither (None): nothing comes before it."""

    token: str
    logprob: float | None
    top: Sequence[tuple[str, float]] | None = ()


class CompletionLogprobs(BaseModel):
    """The completions format: parallel lists, one entry per token. An echoed prompt's first
    token has a null logprob and null alternatives (as OpenAI and vLLM send them)."""

    text_offset: list[int] | None = None
    token_logprobs: list[float | None] | None = None
    tokens: list[str] | None = None
    top_logprobs: list[dict[str, float] | None] | None = None


class TopLogprob(BaseModel):
    """One of the most likely tokens at a position (chat format)."""

    token: str
    bytes: list[int] | None = None
    logprob: float


class ChatTokenLogprob(BaseModel):
    """One token of a chat choice, with its top alternatives."""

    token: str
    bytes: list[int] | None = None
    logprob: float
    top_logprobs: list[TopLogprob]


ChatLogprobs = list[ChatTokenLogprob]
"""The ``logprobs.content`` of one chat choice (or of one stream delta)."""


def json_logprob(logprob: float) -> float:
    """``logprob`` as JSON can carry it: ``-inf`` and NaN become :data:`FLOOR_LOGPROB`."""
    if math.isnan(logprob) or logprob < FLOOR_LOGPROB:
        return FLOOR_LOGPROB
    return float(logprob)


def completion_logprobs(
    entries: Sequence[TokenLogprobText], text_offset: int = 0
) -> CompletionLogprobs:
    """The completions format for ``entries``: each token's ``top_logprobs`` hold it and its
    top alternatives (``logprobs: 0`` the token alone).

    ``text_offset`` is where the first token starts in the choice's text (the length of the text
    already sent, or of the echoed prompt); later offsets add up the token texts, as vLLM does.
    """
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token, logprob, top in entries:
        tokens.append(token)
        token_logprobs.append(None if logprob is None else json_logprob(logprob))
        top_logprobs.append(
            None
            if top is None
            else {  # the chosen token first, then the top ones, as OpenAI's and vLLM's
                token: json_logprob(math.nan if logprob is None else logprob),
                **{alt: json_logprob(alt_lp) for alt, alt_lp in top},
            }
        )
        offsets.append(text_offset)
        text_offset += len(token)
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=token_logprobs,
        top_logprobs=top_logprobs,
        text_offset=offsets,
    )


def chat_logprobs(entries: Sequence[TokenLogprobText]) -> ChatLogprobs:
    """The chat format for ``entries`` (generated tokens: each has a logprob): pass it to the
    chat choice builders."""
    return [
        ChatTokenLogprob(
            token=token,
            bytes=list(token.encode("utf-8")),
            logprob=json_logprob(logprob if logprob is not None else math.nan),
            top_logprobs=[
                TopLogprob(token=alt, bytes=list(alt.encode("utf-8")), logprob=json_logprob(lp))
                for alt, lp in top or ()
            ],
        )
        for token, logprob, top in entries
    ]
