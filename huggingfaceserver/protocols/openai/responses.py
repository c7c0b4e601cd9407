"""Completion and chat responses, built from the ``openai`` package's own types so that the SDK
parses them (encoder responses, without the SDK, are in :mod:`.encoder_responses`).

SDK types narrower than what the API sends are widened by subclasses here: a streamed
completion choice has ``finish_reason: null`` until its last chunk
(:class:`CompletionStreamChoice`); an echoed prompt's first token has a null logprob, and
vLLM's ``prompt_logprobs`` extension adds a field (:class:`ScoredCompletionChoice`, and
``prompt_logprobs`` on a chat completion).

Serialize with :func:`~.bodies.to_json`: the builders set exactly the fields that belong in the
JSON (``exclude_unset``), so a chat delta carries ``role`` only when asked to and stream chunks
carry ``usage`` only when the client asked for usage.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from openai.types import Completion, CompletionChoice, CompletionUsage
from openai.types.chat import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionMessage,
    chat_completion,
    chat_completion_chunk,
)
from openai.types.completion_choice import Logprobs

from .bodies import now
from .logprobs import ChatLogprobs, EchoedLogprobs

PromptLogprobs = list[dict[str, dict[str, Any]] | None]
"""vLLM's ``prompt_logprobs``: per prompt token (None for the first), ``{token id: {"logprob",
"rank", "decoded_token"}}`` for the token and its top alternatives."""

CompletionFinishReason = Literal["stop", "length"]
ChatFinishReason = Literal["stop", "length", "tool_calls"]


def completion_usage(prompt_tokens: int, completion_tokens: int) -> CompletionUsage:
    """Token counts for completions and chat (no padding, ever)."""
    return CompletionUsage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


# --- completions ---------------------------------------------------------------------------


class CompletionStreamChoice(CompletionChoice):
    """A streamed completion choice: ``finish_reason`` stays null until the choice's last chunk."""

    finish_reason: Literal["stop", "length", "content_filter"] | None = None  # type: ignore[assignment]


class ScoredCompletionChoice(CompletionChoice):
    """A finished completion choice: logprobs may start with an echoed prompt's null, and
    ``prompt_logprobs`` (vLLM's extension) is set when asked for."""

    logprobs: EchoedLogprobs | None = None  # type: ignore[assignment]
    prompt_logprobs: PromptLogprobs | None = None


class ScoredCompletion(Completion):
    """A whole completion, of :class:`ScoredCompletionChoice` choices."""

    choices: list[ScoredCompletionChoice]  # type: ignore[assignment]


class CompletionChunk(Completion):
    """One streamed completion chunk: a completion whose choices may be unfinished."""

    choices: list[CompletionStreamChoice]  # type: ignore[assignment]


def completion_choice(
    index: int,
    text: str,
    finish_reason: CompletionFinishReason,
    logprobs: EchoedLogprobs | None = None,
    prompt_logprobs: PromptLogprobs | None = None,
) -> ScoredCompletionChoice:
    """One finished choice of a completion."""
    choice = ScoredCompletionChoice(
        index=index, text=text, finish_reason=finish_reason, logprobs=logprobs
    )
    if prompt_logprobs is not None:
        choice.prompt_logprobs = prompt_logprobs
    return choice


def completion_response(
    request_id: str,
    model: str,
    choices: Sequence[ScoredCompletionChoice],
    prompt_tokens: int,
    completion_tokens: int,
    created: int | None = None,
) -> ScoredCompletion:
    """The whole ``/v1/completions`` response."""
    return ScoredCompletion(
        id=request_id,
        object="text_completion",
        created=now() if created is None else created,
        model=model,
        choices=list(choices),
        usage=completion_usage(prompt_tokens, completion_tokens),
    )


def completion_stream_choice(
    index: int,
    text: str,
    finish_reason: CompletionFinishReason | None = None,
    logprobs: Logprobs | None = None,
) -> CompletionStreamChoice:
    """One choice's delta in a completion stream."""
    return CompletionStreamChoice(
        index=index, text=text, finish_reason=finish_reason, logprobs=logprobs
    )


def completion_chunk(
    request_id: str,
    model: str,
    created: int,
    choice: CompletionStreamChoice | None = None,
    *,
    include_usage: bool = False,
    usage: CompletionUsage | None = None,
) -> CompletionChunk:
    """A streamed completion chunk: one choice's delta, or (no ``choice``) the usage chunk.

    With ``include_usage`` the chunk has a ``usage`` field (null unless ``usage`` is given).
    """
    return CompletionChunk(
        id=request_id,
        object="text_completion",
        created=created,
        model=model,
        choices=[] if choice is None else [choice],
        **_usage_field(include_usage, usage),
    )


# --- chat ----------------------------------------------------------------------------------


def chat_choice(
    index: int,
    text: str | None,
    finish_reason: ChatFinishReason,
    logprobs: ChatLogprobs | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> chat_completion.Choice:
    """One finished choice of a chat completion: an assistant message, with its
    ``tool_calls`` when it called tools.

    ``logprobs`` (from :func:`chat_logprobs`) is None when the client did not ask for them.
    """
    called: dict[str, Any] = {"tool_calls": tool_calls} if tool_calls else {}  # else unset
    return chat_completion.Choice(
        index=index,
        message=ChatCompletionMessage(role="assistant", content=text, **called),
        finish_reason=finish_reason,
        logprobs=None if logprobs is None else chat_completion.ChoiceLogprobs(content=logprobs),
    )


def chat_response(
    request_id: str,
    model: str,
    choices: Sequence[chat_completion.Choice],
    prompt_tokens: int,
    completion_tokens: int,
    created: int | None = None,
    prompt_logprobs: PromptLogprobs | None = None,
) -> ChatCompletion:
    """The whole ``/v1/chat/completions`` response; ``prompt_logprobs`` (vLLM's extension, an
    extra field the SDK keeps) when asked for."""
    response = ChatCompletion(
        id=request_id,
        object="chat.completion",
        created=now() if created is None else created,
        model=model,
        choices=list(choices),
        usage=completion_usage(prompt_tokens, completion_tokens),
    )
    if prompt_logprobs is not None:
        response.prompt_logprobs = prompt_logprobs  # type: ignore[attr-defined]
    return response


def chat_stream_choice(
    index: int,
    text: str | None = None,
    finish_reason: ChatFinishReason | None = None,
    logprobs: ChatLogprobs | None = None,
    *,
    first: bool = False,
    tool_calls: list[dict[str, Any]] | None = None,
) -> chat_completion_chunk.Choice:
    """One choice's delta in a chat stream (``tool_calls``, whole, in its last delta).

    ``first`` puts ``role: "assistant"`` in the delta (the first delta of each choice only);
    ``text=None`` leaves ``content`` out (the final delta that only carries ``finish_reason``).
    """
    delta: dict[str, Any] = {"role": "assistant"} if first else {}
    if text is not None:
        delta["content"] = text
    if tool_calls:
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(tool_calls)]
    return chat_completion_chunk.Choice(
        index=index,
        delta=chat_completion_chunk.ChoiceDelta(**delta),
        finish_reason=finish_reason,
        logprobs=(
            None if logprobs is None else chat_completion_chunk.ChoiceLogprobs(content=logprobs)
        ),
    )


def chat_chunk(
    request_id: str,
    model: str,
    created: int,
    choice: chat_completion_chunk.Choice | None = None,
    *,
    include_usage: bool = False,
    usage: CompletionUsage | None = None,
) -> ChatCompletionChunk:
    """A streamed chat chunk: one choice's delta, or (no ``choice``) the usage chunk.

    With ``include_usage`` the chunk has a ``usage`` field (null unless ``usage`` is given).
    """
    return ChatCompletionChunk(
        id=request_id,
        object="chat.completion.chunk",
        created=created,
        model=model,
        choices=[] if choice is None else [choice],
        **_usage_field(include_usage, usage),
    )


def _usage_field(include_usage: bool, usage: CompletionUsage | None) -> dict[str, Any]:
    # OpenAI: with include_usage, every chunk has "usage" (null but in the last one); else none.
    return {"usage": usage} if include_usage or usage is not None else {}
