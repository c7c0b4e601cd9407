"""OpenAI's Responses API (``POST /v1/responses``), stateless: the request as a chat, the
answer as output items.

A Responses request is a conversation in another shape: ``instructions`` and ``input`` (a text,
or message, function-call and function-call-output items) become chat messages, function tools
and ``tool_choice`` their chat forms, ``text.format`` a ``response_format``,
``max_output_tokens`` ``max_completion_tokens``. The chat request then runs as chat
completions run (the model's template, tool parsing, structured output, both backends); its
answer becomes output items: a ``message`` with its ``output_text``, and a ``function_call``
per tool call.

The server keeps no state: ``previous_response_id``, ``store: true``, ``background`` and
``conversation`` are refused (400) with the reason, and a client sends the whole conversation
each time (as with chat completions).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .bodies import new_id
from .chat_messages import TEXT_PART_SEPARATOR
from .errors import InvalidParameter
from .fields import FiniteFloat
from .requests import ChatCompletionRequest

STATELESS = (
    "this server keeps no responses: send the whole conversation in `input` (previous "
    "response_id, store, background and conversation need state)"
)
TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
"""Content parts whose text goes into a message (images and files are not taken)."""
MESSAGE_ROLES = frozenset({"user", "system", "developer", "assistant"})
OWN_FIELDS = frozenset(
    {"messages", "max_tokens", "max_completion_tokens", "response_format", "n", "stream"}
    | {"stream_options", "logprobs", "top_logprobs", "echo"}
)
"""Chat fields a Responses request sets through its own (or cannot have): not taken from its
extra fields. The others (``top_k``, ``stop``, ``guided_regex``, ``chat_template_kwargs``,
...) pass through as vLLM's Responses route takes them."""


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``: the fields a stateless server honours; chat completions'
    extensions (:data:`OWN_FIELDS` aside) pass through to the chat form; others are accepted
    and ignored, unless they need state."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: FiniteFloat | None = Field(None, ge=0, le=2)
    top_p: FiniteFloat | None = Field(None, gt=0, le=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    previous_response_id: str | None = None
    store: bool | None = None
    background: bool | None = None
    conversation: Any = None

    @field_validator("previous_response_id", "conversation")
    @classmethod
    def _no_state(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError(STATELESS)
        return value

    @field_validator("store", "background")
    @classmethod
    def _not_kept(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError(STATELESS)
        return value

    @field_validator("input")
    @classmethod
    def _some_input(cls, value: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
        if not value:
            raise ValueError("must not be empty")
        return value

    @field_validator("tools")
    @classmethod
    def _function_tools(cls, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for index, tool in enumerate(tools or []):
            if tool.get("type") != "function":
                raise ValueError(
                    f"tool {index}: only function tools are served here, not "
                    f"{tool.get('type')!r} (a hosted tool)"
                )
            if not isinstance(tool.get("name"), str):
                raise ValueError(f"tool {index}: a function tool needs a name")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, choice: Any) -> Any:
        if isinstance(choice, str) and choice not in ("none", "auto", "required"):
            raise ValueError('must be "none", "auto", "required" or {"type": "function", ...}')
        if isinstance(choice, dict) and (
            choice.get("type") != "function" or not isinstance(choice.get("name"), str)
        ):
            raise ValueError('a forced tool is {"type": "function", "name": ...}')
        return choice

    @field_validator("text")
    @classmethod
    def _text_format(cls, text: dict[str, Any] | None) -> dict[str, Any] | None:
        format_ = (text or {}).get("format")
        if format_ is not None and not isinstance(format_, dict):
            raise ValueError('format must be an object: {"type": "text" | "json_object" | ...}')
        return text

    def to_chat(self) -> ChatCompletionRequest:
        """The same request as chat completions take it (a 400 for what does not convert)."""
        chat: dict[str, Any] = {
            "model": self.model,
            "messages": self.messages(),
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "parallel_tool_calls": self.parallel_tool_calls,
            "user": self.user,
            "seed": self.seed,
        }
        if self.tools:
            chat["tools"] = [chat_tool(tool) for tool in self.tools]
        if self.tool_choice is not None:
            chat["tool_choice"] = chat_tool_choice(self.tool_choice)
        format_ = (self.text or {}).get("format")
        if format_ is not None:
            chat["response_format"] = response_format(format_)
        for name, value in (self.model_extra or {}).items():  # vLLM's extensions, as in chat
            if name in ChatCompletionRequest.model_fields and name not in OWN_FIELDS:
                chat.setdefault(name, value)
        return ChatCompletionRequest.model_validate(
            {key: value for key, value in chat.items() if value is not None}
        )

    def messages(self) -> list[dict[str, Any]]:
        """``instructions`` and ``input`` as chat messages."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        for index, item in enumerate(self.input):
            add_item(messages, index, item)
        return messages


def add_item(messages: list[dict[str, Any]], index: int, item: dict[str, Any]) -> None:
    """One input item onto the chat: a message; a function call (onto the assistant message
    before it, as parallel calls are one message in a chat); a function call's output."""
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in MESSAGE_ROLES:
            raise InvalidParameter(
                f"input[{index}]: role must be one of {sorted(MESSAGE_ROLES)}", param="input"
            )
        messages.append({"role": role, "content": item_text(index, item.get("content"))})
    elif kind == "function_call":
        call = {
            "id": item.get("call_id"),
            "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments", "")},
        }
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and "tool_calls" in last:
            last["tool_calls"].append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        content = output if isinstance(output, str) else item_text(index, output)
        messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": content})
    elif kind != "reasoning":  # a thinking model's earlier reasoning: not sent back
        raise InvalidParameter(
            f"input[{index}]: items of type {kind!r} are not served here", param="input"
        )


def item_text(index: int, content: Any) -> str:
    """A message item's content as text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidParameter(
            f"input[{index}]: content must be a string or a list of parts", param="input"
        )
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise InvalidParameter(
                f"input[{index}]: content parts of type {kind!r} are not served", param="input"
            )
        texts.append(str(part.get("text", "")))
    return TEXT_PART_SEPARATOR.join(texts)  # as its chat form's parts are joined


def chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    keys = ("name", "description", "parameters", "strict")
    function: dict[str, Any] = {key: tool[key] for key in keys if tool.get(key) is not None}
    return {"type": "function", "function": function}


def chat_tool_choice(choice: str | dict[str, Any]) -> Any:
    if isinstance(choice, str):
        return choice
    return {"type": "function", "function": {"name": choice["name"]}}


def response_format(format_: dict[str, Any]) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``."""
    kind = format_.get("type")
    if kind == "json_schema":
        schema = {key: format_[key] for key in ("name", "schema", "strict") if key in format_}
        return {"type": "json_schema", "json_schema": schema}
    if kind in ("json_object", "text"):
        return {"type": kind}
    raise InvalidParameter(
        f"text.format: type must be text, json_object or json_schema, not {kind!r}",
        param="text.format",
    )


# --- output ---------------------------------------------------------------------------------


def message_item(text: str, item_id: str, status: str = "completed") -> dict[str, Any]:
    parts = [output_text_part(text)] if status == "completed" else []
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": parts,
    }


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(text: str, item_id: str, status: str = "completed") -> dict[str, Any]:
    """A thinking model's reasoning, as its text (``reasoning_text``; no summary is made)."""
    parts = [reasoning_text_part(text)] if status == "completed" else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": parts, "status": status}


def reasoning_text_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def function_call_item(
    name: str, arguments: str, call_id: str, item_id: str, status: str = "completed"
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def new_item_id(kind: Literal["msg", "fc", "rs"]) -> str:
    """An output item's id, as OpenAI writes them (``msg_...``, ``fc_...``)."""
    return new_id(kind).replace("-", "_", 1)


def usage(prompt_tokens: int, output_tokens: int, reasoning_tokens: int = 0) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt_tokens + output_tokens,
    }


def response_object(
    request: ResponsesRequest,
    response_id: str,
    model: str,
    created: int,
    output: list[dict[str, Any]],
    status: str,
    usage_: dict[str, Any] | None = None,
    finish_reason: str | None = None,
) -> dict[str, Any]:
    """The ``response`` object: the request's settings echoed, the output, the status."""
    incomplete = None
    if status == "incomplete":
        incomplete = {"reason": "max_output_tokens" if finish_reason == "length" else None}
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "model": model,
        "output": output,
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "previous_response_id": None,
        "reasoning": None,
        "store": False,
        "temperature": request.temperature,
        "text": request.text or {"format": {"type": "text"}},
        "tool_choice": request.tool_choice or "auto",
        "tools": request.tools or [],
        "top_p": request.top_p,
        "truncation": "disabled",
        "usage": usage_,
        "user": request.user,
        "metadata": request.metadata or {},
    }
