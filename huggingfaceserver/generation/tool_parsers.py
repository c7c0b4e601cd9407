"""Tool calls out of a model's text, for ``tool_choice: auto`` (``--tool-call-parser NAME``).

Each parser knows how one family of models writes its calls, as vLLM's parsers of the same name
do: ``hermes`` (Hermes, Qwen 2.5 and later: ``<tool_call>{"name", "arguments"}</tool_call>``),
``llama3_json`` (Llama 3.1 and later: ``{"name", "parameters"}`` objects, optionally after
``<|python_tag|>``, separated by ``;``) and ``mistral`` (``[TOOL_CALLS]`` then a JSON list of
``{"name", "arguments"}``, or ``name[ARGS]{...}`` pairs). Text that does not parse as calls
stays content, as in vLLM.

Where it lives: parsing is about how a model writes (a model's concern, not a protocol's), so it
sits beside the reasoning parsers, below the protocols, as vLLM keeps ``vllm/tool_parsers`` beside
``vllm/reasoning`` and outside its OpenAI entrypoint; the CLI checks ``--tool-call-parser`` against
:data:`TOOL_PARSERS` at parse time, as vLLM's ``cli_args`` checks its registry. The OpenAI shape
of a call (``tool_calls``, ids, deltas) is made in :mod:`huggingfaceserver.protocols.openai.tools`.

Streaming: content is sent as it comes until the text may be starting a call (a parser's
marker, or the opening of a call's JSON); from there it is held, and parsed once the choice
ends, so the deltas add up to exactly the non-streamed message.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class ParsedCall:
    """A function the model called, with its arguments as JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ParsedMessage:
    """The model's text split into content (None when there is none) and tool calls."""

    content: str | None
    calls: tuple[ParsedCall, ...] = ()


class ToolParser:
    """How one model family writes tool calls."""

    name: ClassVar[str]
    starts: ClassVar[tuple[str, ...]]
    """Text that may begin a call: content from there on is held back while streaming."""
    keeps_special_tokens: ClassVar[bool] = False
    """Whether the call markers are special tokens, which the text must keep."""

    def parse(self, text: str) -> ParsedMessage:
        raise NotImplementedError

    def held_from(self, text: str) -> int | None:
        """Where, in the text so far, a call may be starting (None: nowhere yet)."""
        found = [text.find(marker) for marker in self.starts if marker in text]
        if found:
            return min(found)
        for marker in self.starts:  # the text ends with the beginning of a marker
            for size in range(min(len(marker) - 1, len(text)), 0, -1):
                if text.endswith(marker[:size]):
                    return len(text) - size
        return None


def call_from_object(item: Any, arguments_keys: tuple[str, ...]) -> ParsedCall | None:
    """A ``{"name": ..., <arguments key>: {...}}`` object as a call (None if it is not one)."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    arguments: Any = next((item[key] for key in arguments_keys if key in item), {})
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ParsedCall(item["name"], text)


def _content(text: str) -> str | None:
    """The text before the calls, without the whitespace that led up to them."""
    text = text.rstrip()
    return text or None


class HermesParser(ToolParser):
    name = "hermes"
    starts = ("<tool_call>",)
    CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> ParsedMessage:
        if "<tool_call>" not in text:
            return ParsedMessage(text)
        calls = []
        for body in self.CALL.findall(text):
            try:
                call = call_from_object(json.loads(body), ("arguments", "parameters"))
            except ValueError:
                call = None
            if call is None:
                return ParsedMessage(text)
            calls.append(call)
        content = text[: text.index("<tool_call>")]  # as it came, as vLLM's hermes gives it
        return ParsedMessage(content or None, tuple(calls))


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    starts = ("<|python_tag|>", "{")
    keeps_special_tokens = True

    def parse(self, text: str) -> ParsedMessage:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return ParsedMessage(text)
        decoder = json.JSONDecoder()
        calls, at = [], 0
        while at >= 0:  # each object from a brace past the last one; text between is skipped
            try:
                item, end = decoder.raw_decode(body, at)
            except ValueError:
                return ParsedMessage(text)
            call = call_from_object(item, ("parameters", "arguments"))
            if call is None:
                return ParsedMessage(text)
            calls.append(call)
            at = body.find("{", end)
        return ParsedMessage(None, tuple(calls))


class MistralParser(ToolParser):
    name = "mistral"
    starts = ("[TOOL_CALLS]",)
    keeps_special_tokens = True
    NAMED = re.compile(r"\s*([\w.\-]+)\s*\[ARGS\]")

    def parse(self, text: str) -> ParsedMessage:
        if "[TOOL_CALLS]" not in text:
            return ParsedMessage(text)
        content, _, rest = text.partition("[TOOL_CALLS]")
        calls = self._json_list(rest) or self._named(rest)
        if calls is None:
            return ParsedMessage(text)
        return ParsedMessage(_content(content), tuple(calls))

    def _json_list(self, rest: str) -> list[ParsedCall] | None:
        try:
            items = json.loads(rest.strip())
        except ValueError:
            return None
        items = items if isinstance(items, list) else [items]
        calls = [call_from_object(item, ("arguments", "parameters")) for item in items]
        return None if not calls or None in calls else calls  # type: ignore[return-value]

    def _named(self, rest: str) -> list[ParsedCall] | None:
        """The newer form: ``name[ARGS]{...}``, repeated after ``[TOOL_CALLS]``."""
        decoder = json.JSONDecoder()
        calls = []
        for chunk in rest.split("[TOOL_CALLS]"):
            match = self.NAMED.match(chunk)
            if match is None:
                return None
            try:
                arguments, _ = decoder.raw_decode(chunk, match.end())
            except ValueError:
                return None
            calls.append(ParsedCall(match.group(1), json.dumps(arguments, ensure_ascii=False)))
        return calls or None


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesParser, Llama3JsonParser, MistralParser)
}
