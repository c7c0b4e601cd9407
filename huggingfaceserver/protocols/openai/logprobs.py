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
    """One generated token: its text, its logprob, and the top (text, logprob) alternatives."""

    token: str
    logprob: float
    top: Sequence[tuple[str, float]] = ()


def json_logprob(logprob: float) -> float:
    """``logprob`` as JSON can carry it: ``-inf`` and NaN become :data:`FLOOR_LOGPROB`."""
    if math.isnan(logprob) or logprob < FLOOR_LOGPROB:
        return FLOOR_LOGPROB
    return float(logprob)


def completion_logprobs(entries: Sequence[TokenLogprobText], text_offset: int = 0) -> Logprobs:
    """The completions format for ``entries``.

    ``text_offset`` is where the first token starts in the choice's text (the length of the text
    already sent, or of the echoed prompt); later offsets add up the token texts, as vLLM does.
    """
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    offsets: list[int] = []
    for token, logprob, top in entries:
        tokens.append(token)
        token_logprobs.append(json_logprob(logprob))
        top_logprobs.append({alt: json_logprob(alt_logprob) for alt, alt_logprob in top})
        offsets.append(text_offset)
        text_offset += len(token)
    return Logprobs(
        tokens=tokens,
        token_logprobs=token_logprobs,
        top_logprobs=top_logprobs,
        text_offset=offsets,
    )


def chat_logprobs(entries: Sequence[TokenLogprobText]) -> ChatLogprobs:
    """The chat format for ``entries``: pass it to the chat choice builders."""
    return [
        ChatCompletionTokenLogprob(
            token=token,
            bytes=list(token.encode("utf-8")),
            logprob=json_logprob(logprob),
            top_logprobs=[
                TopLogprob(token=alt, bytes=list(alt.encode("utf-8")), logprob=json_logprob(lp))
                for alt, lp in top
            ],
        )
        for token, logprob, top in entries
    ]
