"""What tools and tool_choice ask for: the plan, its constraint, and the 400s."""

from __future__ import annotations

import json

import jsonschema
import pytest

from huggingfaceserver.protocols.openai.errors import InvalidParameter
from huggingfaceserver.protocols.openai.tools import NamedToolChoice, Tool, plan_tools

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
}
TOOLS = [
    Tool.model_validate({"function": {"name": "get_weather", "parameters": WEATHER}}),
    Tool.model_validate({"function": {"name": "get_time"}}),
]


def named(name: str) -> NamedToolChoice:
    return NamedToolChoice.model_validate({"function": {"name": name}})


def test_without_tools_or_with_none_the_output_is_content():
    for tools, choice in [(None, None), (None, "none"), (TOOLS, "none")]:
        plan = plan_tools(tools, choice, None, "hermes")
        assert plan.mode == "none" and plan.constraint is None
        assert plan.message("hi").content == "hi"


def test_auto_is_the_default_with_tools_and_needs_the_servers_parser():
    assert plan_tools(TOOLS, None, None, "hermes").mode == "auto"
    with pytest.raises(InvalidParameter, match="--enable-auto-tool-choice") as caught:
        plan_tools(TOOLS, "auto", None, None)
    assert caught.value.param == "tool_choice"


def test_required_constrains_to_a_list_of_calls_of_the_tools():
    plan = plan_tools(TOOLS, "required", None, None)
    assert plan.constraint is not None and plan.constraint.kind == "json"
    schema = json.loads(plan.constraint.spec)
    good = [
        {"name": "get_weather", "parameters": {"city": "Paris"}},
        {"name": "get_time", "parameters": {}},
    ]
    jsonschema.validate(good, schema)
    for bad in (
        [],
        [{"name": "nope", "parameters": {}}],
        [{"name": "get_weather", "parameters": {}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    message = plan.message(json.dumps(good))
    assert [(c.name, json.loads(c.arguments)) for c in message.calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    single = json.loads(plan_tools(TOOLS, "required", False, None).constraint.spec)
    assert single["maxItems"] == 1


def test_a_named_function_constrains_to_its_parameters():
    plan = plan_tools(TOOLS, named("get_weather"), None, None)
    assert json.loads(plan.constraint.spec) == WEATHER
    (call,) = plan.message('{"city": "Rome"}').calls
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Rome"}')
    no_parameters = plan_tools(TOOLS, named("get_time"), None, None)
    assert json.loads(no_parameters.constraint.spec) == {"type": "object"}


@pytest.mark.parametrize(
    ("tools", "choice", "in_message"),
    [
        (TOOLS, "unknown-choice-placeholder", "not in tools"),
        (None, "required", "needs tools"),
        (TOOLS + TOOLS[:1], "required", "name of its own"),
    ],
)
def test_what_cannot_be_is_a_400(tools, choice, in_message):
    choice = named("get_news") if choice == "unknown-choice-placeholder" else choice
    with pytest.raises(InvalidParameter, match=in_message):
        plan_tools(tools, choice, None, "hermes")
