"""Tool calling on chat: what ``tools`` and ``tool_choice`` ask for, and the model's output as
``tool_calls``, on every backend (the template, the constraint and the parsing are all here).

- ``none``: the tools go to the chat template (as in vLLM); the output is content.
- ``auto`` (the default with tools): the server must run with ``--enable-auto-tool-choice`` and
  ``--tool-call-parser`` (vLLM's rule, else a 400); the output is parsed into calls
  (:mod:`.tool_parsers`), and what does not parse stays content.
- ``required``: decoding is constrained to a JSON list of ``{"name", "parameters"}`` calls of
  the given tools (one at most without ``parallel_tool_calls``), so even a small model produces
  calls that parse against each function's schema.
- a named function: decoding is constrained to that function's parameters schema, and the
  output is that call's arguments.

A choice that calls tools ends with ``finish_reason: "tool_calls"``.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ...generation.params import Constraint
from ...generation.tool_parsers import (
    TOOL_PARSERS,
    ParsedCall,
    ParsedMessage,
    ToolParser,
    call_from_object,
)
from .errors import InvalidParameter

ANY_OBJECT: dict[str, Any] = {"type": "object"}


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(pattern=r"^[a-zA-Z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    """One entry of ``tools``: a function the model may call."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass
class ToolPlan:
    """How a chat request's output becomes a message: content, tool calls, or both."""

    mode: Literal["none", "auto", "required", "named"] = "none"
    constraint: Constraint | None = None
    parser: ToolParser | None = None
    function: str | None = None
    """The named function (mode ``named``)."""

    @property
    def calls_tools(self) -> bool:
        return self.mode != "none"

    def message(self, text: str) -> ParsedMessage:
        """The model's whole text as content and calls."""
        if self.mode == "auto":
            assert self.parser is not None
            return self.parser.parse(text)
        if self.mode == "required":
            return _required_calls(text)
        if self.mode == "named":
            assert self.function is not None
            if not text.strip():  # nothing after the reasoning (cut, or ended in it): no call
                return ParsedMessage(None)
            return ParsedMessage(None, (ParsedCall(self.function, text.strip()),))
        return ParsedMessage(text)


def plan_tools(
    tools: list[Tool] | None,
    choice: ToolChoice | None,
    parallel: bool | None,
    auto_parser: str | None,
) -> ToolPlan:
    """What the request's ``tools`` / ``tool_choice`` ask for; a 400 for what cannot be.
    ``auto_parser``: the server's ``--tool-call-parser`` when it runs with
    ``--enable-auto-tool-choice``, else None."""
    if not tools:
        if choice is not None and choice != "none":
            raise InvalidParameter("tool_choice needs tools", param="tool_choice")
        return ToolPlan()
    names = [tool.function.name for tool in tools]
    if len(set(names)) != len(names):
        raise InvalidParameter("tools: each function needs a name of its own", param="tools")
    mode = "auto" if choice is None else choice
    if mode == "none":
        return ToolPlan()
    if mode == "auto":
        if auto_parser is None:
            raise InvalidParameter(
                '"auto" tool choice needs the server to run with --enable-auto-tool-choice '
                "and --tool-call-parser",
                param="tool_choice",
            )
        return ToolPlan("auto", parser=TOOL_PARSERS[auto_parser]())
    if mode == "required":
        schema = _required_schema(tools, parallel is not False)
        return ToolPlan("required", Constraint("json", json.dumps(schema)))
    assert isinstance(mode, NamedToolChoice)
    named = {tool.function.name: tool for tool in tools}.get(mode.function.name)
    if named is None:
        raise InvalidParameter(
            f"tool_choice names {mode.function.name!r}, which is not in tools",
            param="tool_choice",
        )
    parameters = named.function.parameters or ANY_OBJECT
    return ToolPlan(
        "named",
        Constraint("json", json.dumps(parameters)),
        function=named.function.name,
    )


def _required_schema(tools: list[Tool], parallel: bool) -> dict[str, Any]:
    """A JSON list of calls, each ``{"name": one of the tools, "parameters": its schema}``."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool.function.name]},
                "parameters": tool.function.parameters or ANY_OBJECT,
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _required_calls(text: str) -> ParsedMessage:
    try:
        items = json.loads(text)
    except ValueError:  # cut by max_tokens: what came is content
        return ParsedMessage(text)
    found = (call_from_object(item, ("parameters",)) for item in items)
    calls = tuple(call for call in found if call is not None)
    return ParsedMessage(None, calls) if calls else ParsedMessage(text)


def tool_call_dicts(calls: tuple[ParsedCall, ...]) -> list[dict[str, Any]]:
    """The calls in OpenAI's shape, each with a new id."""
    return [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for call in calls
    ]


@dataclass
class ToolStream:
    """One streamed choice under a tool plan: content goes out while it cannot be the start
    of a call, the rest is held and parsed when the choice ends, so that the deltas add up
    to the non-streamed message."""

    plan: ToolPlan
    text: str = ""
    sent: int = 0
    """How much of ``text`` went out as content."""

    def push(self, delta_text: str) -> str:
        """The content that can go out now."""
        self.text += delta_text
        if self.plan.mode in ("required", "named"):
            return ""
        held = len(self.text)
        if self.plan.parser is not None:
            marker = self.plan.parser.held_from(self.text)
            held = marker if marker is not None else held
        held = len(self.text[:held].rstrip()) if held > self.sent else held
        out = self.text[self.sent : max(held, self.sent)]
        self.sent = max(held, self.sent)
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """At the choice's end: the content still to send, and the calls."""
        message = self.plan.message(self.text)
        content = message.content or ""
        rest = content[self.sent :] if content.startswith(self.text[: self.sent]) else ""
        return rest, tool_call_dicts(message.calls)
