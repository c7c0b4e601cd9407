"""Tool-call parsers on outputs recorded from real models of each family, whole and streamed:
the streamed deltas add up to the whole message."""

from __future__ import annotations

import json

import pytest

from huggingfaceserver.generation.tool_parsers import TOOL_PARSERS, ParsedCall
from huggingfaceserver.protocols.openai.tools import ToolPlan, ToolStream

PARIS = ParsedCall("get_weather", json.dumps({"city": "Paris", "unit": "celsius"}))
CASES = [
    # Qwen2.5-7B-Instruct
    (
        "hermes",
        "I'll check the weather for you.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
        "I'll check the weather for you.\n",  # as vLLM's hermes keeps it
        [PARIS],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>',
        None,
        [PARIS, ParsedCall("get_time", '{"tz": "CET"}')],
    ),
    ("hermes", "The weather in Paris is mild.", "The weather in Paris is mild.", []),
    ("hermes", "<tool_call>\n{not json\n</tool_call>", "<tool_call>\n{not json\n</tool_call>", []),
    # Llama-3.1-8B-Instruct
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
        None,
        [PARIS],
    ),
    (  # text after the calls is left out, as vLLM's llama3_json does
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}} Hope so.',
        None,
        [PARIS],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
        '; {"name": "get_time", "parameters": {"tz": "CET"}}',
        None,
        [PARIS, ParsedCall("get_time", '{"tz": "CET"}')],
    ),
    ("llama3_json", "It is sunny {mostly}.", "It is sunny {mostly}.", []),
    # Mistral-7B-Instruct-v0.3, and the newer name[ARGS] form (Mistral Small 3.2)
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
        None,
        [PARIS],
    ),
    (
        "mistral",
        'Let me look.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
        '[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}',
        "Let me look.",
        [PARIS, ParsedCall("get_time", '{"tz": "CET"}')],
    ),
    ("mistral", "No tools needed.", "No tools needed.", []),
]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_recorded_outputs_parse_into_calls(parser, text, content, calls):
    parsed = TOOL_PARSERS[parser]().parse(text)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        (c.name, json.loads(c.arguments)) for c in calls
    ]


def pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_streamed_deltas_add_up_to_the_whole_message(parser, text, content, calls, size):
    stream = ToolStream(ToolPlan("auto", parser=TOOL_PARSERS[parser]()))
    sent = "".join(stream.push(piece) for piece in pieces(text, size))
    rest, streamed_calls = stream.finish()
    assert (sent + rest) == (content or "")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in streamed_calls] == [
        (c.name, c.arguments) for c in TOOL_PARSERS[parser]().parse(text).calls
    ]
    if calls:  # nothing of a call went out as content
        assert "<tool_call>" not in sent and "[TOOL_CALLS]" not in sent and '"name"' not in sent
