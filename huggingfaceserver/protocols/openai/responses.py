"""Completion and chat responses: our own models of the OpenAI wire format (encoder responses
are in :mod:`.encoder_responses`).

Each model declares the fields we send of its ``openai`` SDK counterpart, in the same order and
with the same names, so that the SDK parses the JSON (tests/protocols/openai/test_responses.py
parses it with the SDK's types) while an SDK release cannot change what we send. Where we send
more than the SDK declares: a streamed choice has ``finish_reason: null`` until its last chunk,
an echoed prompt's first token has a null logprob, vLLM's ``prompt_logprobs`` extension adds
a field to completion choices and chat completions, and with ``--reasoning-parser`` chat
messages and deltas carry ``reasoning`` and ``reasoning_content`` (the SDK keeps them in
``model_extra``).

Serialize with :func:`~.bodies.to_json`: the builders set exactly the fields that belong in the
JSON (``exclude_unset``), so a chat delta carries ``role`` only when asked to and stream chunks
carry ``usage`` only when the client asked for usage.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel

from .bodies import now
from .logprobs import ChatLogprobs, CompletionLogprobs

PromptLogprobs = list[dict[str, dict[str, Any]] | None]
"""vLLM's ``prompt_logprobs``: per prompt token (None for the first), ``{token id: {"logprob",
"rank", "decoded_token"}}`` for the token and its top alternatives."""

CompletionFinishReason = Literal["stop", "length"]
ChatFinishReason = Literal["stop", "length", "tool_calls"]


class CompletionTokensDetails(BaseModel):
    """What the completion tokens were: ``reasoning_tokens``, given a reasoning parser."""

    reasoning_tokens: int


class CompletionUsage(BaseModel):
    """The ``usage`` of a completion or chat response (the SDK's ``CompletionUsage``)."""

    completion_tokens: int
    prompt_tokens: int
    total_tokens: int
    completion_tokens_details: CompletionTokensDetails | None = None


def completion_usage(
    prompt_tokens: int, completion_tokens: int, reasoning_tokens: int | None = None
) -> CompletionUsage:
    """Token counts for completions and chat (no padding, ever); ``reasoning_tokens`` only
    where a reasoning parser split the output."""
    details = (
        None
        if reasoning_tokens is None
        else CompletionTokensDetails(reasoning_tokens=reasoning_tokens)
    )
    return CompletionUsage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        **_set_unless_none(completion_tokens_details=details),
    )


# --- completions ---------------------------------------------------------------------------


class ScoredCompletionChoice(BaseModel):
    """A finished completion choice: logprobs may start with an echoed prompt's null, and
    ``prompt_logprobs`` (vLLM's extension) is set when asked for."""

    finish_reason: CompletionFinishReason
    index: int
    logprobs: CompletionLogprobs | None = None
    text: str
    prompt_logprobs: PromptLogprobs | None = None


class ScoredCompletion(BaseModel):
    """A whole completion (the SDK's ``Completion``), of :class:`ScoredCompletionChoice`
    choices."""

    id: str
    choices: list[ScoredCompletionChoice]
    created: int
    model: str
    object: Literal["text_completion"]
    usage: CompletionUsage


class CompletionStreamChoice(BaseModel):
    """A streamed completion choice: ``finish_reason`` stays null until the choice's last chunk."""

    finish_reason: CompletionFinishReason | None = None
    index: int
    logprobs: CompletionLogprobs | None = None
    text: str


class CompletionChunk(BaseModel):
    """One streamed completion chunk (the SDK parses it as a ``Completion``): a choice's
    delta, or no choice and the usage."""

    id: str
    choices: list[CompletionStreamChoice]
    created: int
    model: str
    object: Literal["text_completion"]
    usage: CompletionUsage | None = None


def completion_choice(
    index: int,
    text: str,
    finish_reason: CompletionFinishReason,
    logprobs: CompletionLogprobs | None = None,
    prompt_logprobs: PromptLogprobs | None = None,
) -> ScoredCompletionChoice:
    """One finished choice of a completion (``prompt_logprobs`` only when asked for)."""
    return ScoredCompletionChoice(
        index=index,
        text=text,
        finish_reason=finish_reason,
        logprobs=logprobs,
        **_set_unless_none(prompt_logprobs=prompt_logprobs),
    )


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
    logprobs: CompletionLogprobs | None = None,
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


class FunctionCall(BaseModel):
    """The function a tool call calls, and its arguments as JSON text."""

    arguments: str
    name: str


class ToolCall(BaseModel):
    """One call of a function tool (the SDK's ``ChatCompletionMessageFunctionToolCall``)."""

    id: str
    function: FunctionCall
    type: Literal["function"]


class ChatCompletionMessage(BaseModel):
    """The assistant's message (the SDK's ``ChatCompletionMessage``): ``tool_calls`` only when
    it called tools; ``reasoning`` and ``reasoning_content`` (vLLM's and DeepSeek's names, the
    same text; the SDK keeps them in ``model_extra``) only when a reasoning parser found some."""

    content: str | None = None
    role: Literal["assistant"]
    tool_calls: list[ToolCall] | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatChoiceLogprobs(BaseModel):
    """A chat choice's ``logprobs``: one entry per generated token."""

    content: ChatLogprobs | None = None


class ChatChoice(BaseModel):
    """One finished choice of a chat completion (the SDK's ``chat_completion.Choice``)."""

    finish_reason: ChatFinishReason
    index: int
    logprobs: ChatChoiceLogprobs | None = None
    message: ChatCompletionMessage


class ChatCompletion(BaseModel):
    """A whole chat completion; ``prompt_logprobs`` is vLLM's extension, set when asked for."""

    id: str
    choices: list[ChatChoice]
    created: int
    model: str
    object: Literal["chat.completion"]
    usage: CompletionUsage
    prompt_logprobs: PromptLogprobs | None = None


class DeltaToolCall(BaseModel):
    """A tool call in a stream (the SDK's ``ChoiceDeltaToolCall``): we send each call whole, in
    the choice's last delta."""

    index: int
    id: str
    function: FunctionCall
    type: Literal["function"]


class ChatDelta(BaseModel):
    """What a chunk adds to a choice (the SDK's ``ChoiceDelta``); reasoning as in
    :class:`ChatCompletionMessage`."""

    content: str | None = None
    role: Literal["assistant"] | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatStreamChoice(BaseModel):
    """One choice's delta in a chat stream (the SDK's ``chat_completion_chunk.Choice``):
    ``finish_reason`` stays null until the choice's last chunk."""

    delta: ChatDelta
    index: int
    finish_reason: ChatFinishReason | None = None
    logprobs: ChatChoiceLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    """One streamed chat chunk: a choice's delta, or no choice and the usage."""

    id: str
    choices: list[ChatStreamChoice]
    created: int
    model: str
    object: Literal["chat.completion.chunk"]
    usage: CompletionUsage | None = None


def chat_choice(
    index: int,
    text: str | None,
    finish_reason: ChatFinishReason,
    logprobs: ChatLogprobs | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
    reasoning: str | None = None,
) -> ChatChoice:
    """One finished choice of a chat completion: an assistant message, with its
    ``tool_calls`` when it called tools and its ``reasoning`` when it has some.

    ``logprobs`` (from :func:`chat_logprobs`) is None when the client did not ask for them.
    """
    called: dict[str, Any] = {"tool_calls": tool_calls} if tool_calls else {}  # else unset
    return ChatChoice(
        index=index,
        message=ChatCompletionMessage(
            role="assistant", content=text, **called, **_reasoning_fields(reasoning)
        ),
        finish_reason=finish_reason,
        logprobs=None if logprobs is None else ChatChoiceLogprobs(content=logprobs),
    )


def chat_response(
    request_id: str,
    model: str,
    choices: Sequence[ChatChoice],
    prompt_tokens: int,
    completion_tokens: int,
    created: int | None = None,
    prompt_logprobs: PromptLogprobs | None = None,
    reasoning_tokens: int | None = None,
) -> ChatCompletion:
    """The whole ``/v1/chat/completions`` response; ``prompt_logprobs`` when asked for,
    ``reasoning_tokens`` in the usage where a reasoning parser split the output."""
    return ChatCompletion(
        id=request_id,
        object="chat.completion",
        created=now() if created is None else created,
        model=model,
        choices=list(choices),
        usage=completion_usage(prompt_tokens, completion_tokens, reasoning_tokens),
        **_set_unless_none(prompt_logprobs=prompt_logprobs),
    )


def chat_stream_choice(
    index: int,
    text: str | None = None,
    finish_reason: ChatFinishReason | None = None,
    logprobs: ChatLogprobs | None = None,
    *,
    first: bool = False,
    tool_calls: list[dict[str, Any]] | None = None,
    reasoning: str | None = None,
) -> ChatStreamChoice:
    """One choice's delta in a chat stream (``tool_calls``, whole, in its last delta).

    ``first`` puts ``role: "assistant"`` in the delta (the first delta of each choice only);
    ``text=None`` leaves ``content`` out (the final delta that only carries ``finish_reason``);
    ``reasoning``, when not None, is the reasoning this delta adds.
    """
    delta: dict[str, Any] = {"role": "assistant"} if first else {}
    if text is not None:
        delta["content"] = text
    delta.update(_reasoning_fields(reasoning))
    if tool_calls:
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(tool_calls)]
    return ChatStreamChoice(
        index=index,
        delta=ChatDelta(**delta),
        finish_reason=finish_reason,
        logprobs=None if logprobs is None else ChatChoiceLogprobs(content=logprobs),
    )


def chat_chunk(
    request_id: str,
    model: str,
    created: int,
    choice: ChatStreamChoice | None = None,
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


def _reasoning_fields(reasoning: str | None) -> dict[str, Any]:
    # Both names: clients read vLLM's "reasoning" or DeepSeek's "reasoning_content".
    return {} if reasoning is None else {"reasoning": reasoning, "reasoning_content": reasoning}


def _set_unless_none(**fields: Any) -> dict[str, Any]:
    # A field left unset is left out of the JSON (to_json excludes unset fields), not null.
    return {name: value for name, value in fields.items() if value is not None}
