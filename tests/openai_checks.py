"""Checks on OpenAI answers that hold whichever backend serves them."""

from __future__ import annotations

from typing import Any

import openai


def check_streamed_chat_adds_up(client: openai.OpenAI, model: str, messages: Any) -> None:
    """The streamed chat equals the whole answer: role in the first delta only, finish_reason
    in the last chunk only, then the usage chunk (``stream_options.include_usage``)."""
    request = {"model": model, "messages": messages, "temperature": 0, "max_tokens": 16}
    whole = client.chat.completions.create(**request)
    chunks = list(
        client.chat.completions.create(
            **request, stream=True, stream_options={"include_usage": True}
        )
    )
    *deltas, last = chunks
    assert deltas[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in deltas[1:])
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == (
        whole.choices[0].message.content
    )
    assert [c.choices[0].finish_reason for c in deltas[:-1]] == [None] * (len(deltas) - 1)
    assert deltas[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert last.choices == [] and last.usage == whole.usage
