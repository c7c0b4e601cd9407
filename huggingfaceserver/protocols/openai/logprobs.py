"""OpenAI's two logprob formats, shaped from (token text, logprob, top alternatives) triples.

Completions use parallel lists (``tokens``, ``token_logprobs``, ``top_logprobs`` as
``{token: logprob}`` dicts, ``text_offset``); chat uses one object per token with the token's
UTF-8 ``bytes`` and a ``top_logprobs`` list. Turning token ids into text is the caller's job.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from openai.types.chat import ChatCompletionTokenLogprob
from openai.types.chat.chat_completion_token_logprob import TopLogprob
from openai.types.completion_choice import Logprobs

FLOOR_LOGPROB = -9999.0
"""What OpenAI sends for a token too unlikely to matter; JSON has no ``-Infinity``."""

ChatLogprobs = list[ChatCompletionTokenLogprob]
"""The ``logprobs.content`` of one chat choice (or of one stream delta)."""


class TokenLogprobText(NamedTuple):
    """One token: its text, its logprob, and the top (text, logprob) alternatives. An echoed
    prompt's first token has neither (None): nothing comes before it."""

    token: str
    logprob: float | None
    top: Sequence[tuple[str, float]] | None = ()


class EchoedLogprobs(Logprobs):
    """The completions format, widened to the nulls of an echoed prompt's first token (as
    OpenAI and vLLM send them)."""

    token_logprobs: list[float | None] | None = None  # type: ignore[assignment]
    top_logprobs: list[dict[str, float] | None] | None = None  # type: ignore[assignment]


def json_logprob(logprob: float) -> float:
    """``logprob`` as JSON can carry it: ``-inf`` and NaN become :data:`FLOOR_LOGPROB`."""
    if math.isnan(logprob) or logprob < FLOOR_LOGPROB:
        return FLOOR_LOGPROB
    return float(logprob)


def completion_logprobs(
    entries: Sequence[TokenLogprobText], text_offset: int = 0
) -> EchoedLogprobs:
    """The completions format for ``entries``.

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
            None if top is None else {alt: json_logprob(alt_lp) for alt, alt_lp in top}
        )
        offsets.append(text_offset)
        text_offset += len(token)
    return EchoedLogprobs(
        tokens=tokens,
        token_logprobs=token_logprobs,
        top_logprobs=top_logprobs,
        text_offset=offsets,
    )


def chat_logprobs(entries: Sequence[TokenLogprobText]) -> ChatLogprobs:
    """The chat format for ``entries`` (generated tokens: each has a logprob): pass it to the
    chat choice builders."""
    return [
        ChatCompletionTokenLogprob(
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
