"""Chat messages: roles, text content parts, and the dicts a chat template takes."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

TEXT_PART_SEPARATOR = "\n"
"""How the text parts of one message are joined (as vLLM does)."""

Role = Literal["system", "user", "assistant", "tool", "developer"]


def check_content(content: Any) -> Any:
    """A string, ``None``, or a list of ``{"type": "text", "text": str}`` parts.

    Any other part type (``image_url``, ``input_audio``, ``file``, ...) is refused, naming it:
    this server serves text-only models.
    """
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError("expected a string or a list of content parts")
    for part in content:
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise ValueError('each content part must be an object with a "type"')
        if part["type"] != "text":
            raise ValueError(
                f"content part type {part['type']!r} is not supported; only 'text' parts are"
            )
        if not isinstance(part.get("text"), str):
            raise ValueError('a "text" content part needs a string "text"')
    return content


class ChatMessage(BaseModel):
    """One message of a chat. Other fields (``tool_call_id``, ...) pass on to the template."""

    model_config = ConfigDict(extra="allow")

    role: Role
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    _check_content = field_validator("content", mode="before")(check_content)

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        # OpenAI lets only an assistant message (one that calls tools) go without content.
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        """The content as one string: text parts joined, ``None`` as empty."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return TEXT_PART_SEPARATOR.join(part["text"] for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template takes it.

        ``developer`` is OpenAI's newer name for ``system``; chat templates know only the latter.
        """
        message: dict[str, Any] = dict(self.model_extra or {})
        message["role"] = "system" if self.role == "developer" else self.role
        message["content"] = self.text()
        if self.name is not None:
            message["name"] = self.name
        if isinstance(message.get("tool_calls"), list):
            message["tool_calls"] = [call_for_template(call) for call in message["tool_calls"]]
        reasoning = message.get("reasoning_content", message.get("reasoning"))
        if reasoning is not None:
            # Clients send it back as vLLM's "reasoning" or DeepSeek's "reasoning_content";
            # Qwen3's and DeepSeek's templates read the latter.
            message["reasoning_content"] = message["reasoning"] = reasoning
        return message


def call_for_template(call: Any) -> Any:
    """An assistant's earlier tool call as chat templates take it: ``arguments`` as an object
    (OpenAI sends them as JSON text; templates write them with ``tojson``), as vLLM does."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}
