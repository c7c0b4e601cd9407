"""/v1/responses in-process: the answer equals chat completions' for the same conversation
(chat completions are checked against transformers in test_generation_routes), output items
for text, function calls and a thinking model's reasoning, every streamed event in order, the
stateless refusals, and the ``openai`` SDK parsing every response and event."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from huggingfaceserver.protocols.kserve_model import BackendModel
from huggingfaceserver.protocols.openai.errors import InvalidParameter
from huggingfaceserver.protocols.openai.responses_api import ResponsesRequest
from tests.harness import client_for, load_model, loader, sdk_for
from tests.thinking_model import ANSWER, REASONING, build_thinking_llama, reasoning_token_count

RESPONSES = "/openai/v1/responses"
CHAT = "/openai/v1/chat/completions"
AUTO = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
TIME_PARAMETERS = {
    "type": "object",
    "properties": {"tz": {"enum": ["CET", "UTC"]}},
    "required": ["tz"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "name": "get_time", "parameters": TIME_PARAMETERS}]
FORCED_HERMES = (
    r'Ok\.\n<tool_call>\{"name": "get_time", "arguments": \{"tz": "(CET|UTC)"\}\}</tool_call>'
)


@pytest.fixture(scope="module")
def served(tiny_models: dict[str, Path]) -> Callable[..., BackendModel]:
    return loader(tiny_models["llama"], "llama")


async def post(model: BackendModel, path: str, body: dict[str, Any]) -> httpx.Response:
    async with client_for(model) as client:
        return await client.post(path, json=body)


async def ok(model: BackendModel, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = await post(model, path, body)
    assert response.status_code == 200, response.text
    return response.json()


sdk = sdk_for


def output_text(response: dict[str, Any]) -> str:
    return "".join(
        part["text"]
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
    )


async def test_text_input_answers_what_chat_answers(served):
    model = served()
    body = {"instructions": "Be terse.", "input": "Hello world", "max_output_tokens": 6}
    body["temperature"] = 0
    response = await ok(model, RESPONSES, body)
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hello world"},
    ]
    chat = await ok(model, CHAT, {"messages": messages, "max_tokens": 6, "temperature": 0})
    assert output_text(response) == chat["choices"][0]["message"]["content"]
    assert response["object"] == "response" and response["id"].startswith("resp_")
    assert response["status"] == "incomplete"  # 6 tokens: cut by max_output_tokens
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    (item,) = response["output"]
    assert item["type"] == "message" and item["role"] == "assistant"
    assert item["id"].startswith("msg_") and item["status"] == "completed"
    usage = chat["usage"]
    assert response["usage"]["input_tokens"] == usage["prompt_tokens"]
    assert response["usage"]["output_tokens"] == usage["completion_tokens"] == 6
    assert response["usage"]["total_tokens"] == usage["total_tokens"]
    assert response["instructions"] == "Be terse." and response["max_output_tokens"] == 6


async def test_the_sdk_parses_a_response_of_message_items(served):
    client = sdk(served())
    response = await client.responses.create(
        model="llama",
        input=[
            {"role": "developer", "content": "Be terse."},
            {"role": "user", "content": [{"type": "input_text", "text": "Hello world"}]},
        ],
        max_output_tokens=5,
        temperature=0,
    )
    messages = [
        {"role": "developer", "content": "Be terse."},
        {"role": "user", "content": "Hello world"},
    ]
    chat = await ok(served(), CHAT, {"messages": messages, "max_tokens": 5, "temperature": 0})
    assert response.output_text == chat["choices"][0]["message"]["content"]
    assert response.usage is not None and response.usage.output_tokens == 5


async def test_streamed_events_come_in_order_and_add_up(served):
    client = sdk(served())
    body = {"model": "llama", "input": "Hello world", "max_output_tokens": 7, "temperature": 0}
    whole = await client.responses.create(**body)
    events = [event async for event in await client.responses.create(stream=True, **body)]
    kinds = [event.type for event in events]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    final = events[-1].response
    assert final.output_text == text and final.status == "incomplete"
    assert final.usage is not None and final.usage.output_tokens == 7
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}


async def test_a_function_call_the_model_writes_is_an_output_item(served):
    model = served(*AUTO)
    body = {"input": "What time is it?", "tools": TOOLS, "max_output_tokens": 80}
    body["temperature"] = 0
    body["guided_regex"] = FORCED_HERMES  # the tiny model writes a Hermes call because of it
    response = await ok(model, RESPONSES, body)
    message, call = response["output"]
    assert (
        output_text({"output": [message]}) == "Ok.\n"
    )  # the text before the call as written, as vLLM's hermes gives it
    assert call["type"] == "function_call" and call["name"] == "get_time"
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_")
    jsonschema.validate(json.loads(call["arguments"]), TIME_PARAMETERS)
    assert response["status"] == "completed"

    extra = {"guided_regex": body.pop("guided_regex")}
    stream = await sdk(model).responses.create(model="llama", stream=True, extra_body=extra, **body)
    events = [event async for event in stream]
    kinds = [event.type for event in events]
    assert kinds[-8:] == [
        "response.output_text.done",  # the message "Ok." first, then the call
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = events[-1].response
    streamed_call = final.output[1]
    assert streamed_call.type == "function_call" and streamed_call.name == "get_time"
    assert json.loads(streamed_call.arguments) == json.loads(call["arguments"])
    assert final.output_text == "Ok.\n"


async def test_a_required_tool_gives_function_calls_only(served):
    response = await sdk(served()).responses.create(
        model="llama",
        input="What time is it?",
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_time"},
        max_output_tokens=40,
    )
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_time"
    jsonschema.validate(json.loads(call.arguments), TIME_PARAMETERS)


async def test_a_json_schema_format_constrains_the_text(served):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    text = {"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}}
    body = {"input": "Answer in JSON", "text": text, "max_output_tokens": 30}
    response = await ok(served(), RESPONSES, body)
    jsonschema.validate(json.loads(output_text(response)), schema)
    assert response["text"] == text


def test_function_calls_and_their_outputs_become_chat_turns():
    request = ResponsesRequest.model_validate(
        {
            "instructions": "Use tools.",
            "input": [
                {"role": "user", "content": "Time in Paris and Rome?"},
                {"type": "function_call", "call_id": "c1", "name": "t", "arguments": '{"a":1}'},
                {"type": "function_call", "call_id": "c2", "name": "t", "arguments": '{"a":2}'},
                {"type": "function_call_output", "call_id": "c1", "output": "10:00"},
                {"type": "function_call_output", "call_id": "c2", "output": "11:00"},
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "message", "role": "assistant", "content": [
                    {"type": "output_text", "text": "It is 10 and 11."}
                ]},
            ],
        }
    )  # fmt: skip
    assert request.messages() == [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Time in Paris and Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "t", "arguments": '{"a":1}'}},
                {"id": "c2", "type": "function", "function": {"name": "t", "arguments": '{"a":2}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "10:00"},
        {"role": "tool", "tool_call_id": "c2", "content": "11:00"},
        {"role": "assistant", "content": "It is 10 and 11."},
    ]
    chat = request.to_chat()
    assert [message.role for message in chat.messages] == [
        "system", "user", "assistant", "tool", "tool", "assistant",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"input": "hi", "previous_response_id": "resp_1"}, "keeps no responses"),
        ({"input": "hi", "store": True}, "keeps no responses"),
        ({"input": "hi", "background": True}, "keeps no responses"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "only function tools"),
        ({"input": ""}, "must not be empty"),
        ({"input": "hi", "tool_choice": "sometimes"}, "must be"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input_image",
        ),
        ({"input": [{"type": "web_search_call", "id": "x"}]}, "web_search_call"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "role must be"),
        ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format"),
    ],
)
async def test_what_is_not_served_is_a_400_that_says_why(served, body, words):
    response = await post(served(), RESPONSES, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"] + str(error.get("param"))


async def test_a_stored_response_is_refused_by_the_sdk_too(served):
    with pytest.raises(openai.BadRequestError, match="keeps no responses"):
        await sdk(served()).responses.create(model="llama", input="hi", store=True)


def test_input_errors_name_their_item():
    request = ResponsesRequest.model_validate({"input": [{"role": "user", "content": 3}]})
    with pytest.raises(InvalidParameter, match=r"input\[0\]"):
        request.messages()


# --- reasoning (--reasoning-parser), on the scripted thinking model -------------------------


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> tuple[BackendModel, Path]:
    model_dir = build_thinking_llama(tmp_path_factory.mktemp("thinker"))
    argv = ["--model_dir", str(model_dir), "--model_name", "thinker", "--backend", "huggingface"]
    return load_model([*argv, "--reasoning-parser", "deepseek_r1"]), model_dir


async def test_a_thinking_models_reasoning_is_an_item_before_the_message(thinker):
    model, model_dir = thinker
    body = {"model": "thinker", "input": "Where is Paris?", "max_output_tokens": 32}
    response = await ok(model, RESPONSES, body)
    reasoning, message = response["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
    assert reasoning["content"] == [{"type": "reasoning_text", "text": REASONING}]
    assert output_text({"output": [message]}) == ANSWER
    details = response["usage"]["output_tokens_details"]
    assert details["reasoning_tokens"] == reasoning_token_count(model_dir)
    hidden = await ok(model, RESPONSES, {**body, "include_reasoning": False})
    assert [item["type"] for item in hidden["output"]] == ["message"]
    assert hidden["usage"] == response["usage"]


async def test_streamed_reasoning_comes_as_its_own_item(thinker):
    model, model_dir = thinker
    client = sdk(model)
    body = {"model": "thinker", "input": "Where is Paris?", "max_output_tokens": 32}
    events = [event async for event in await client.responses.create(stream=True, **body)]
    kinds = [event.type for event in events]
    first_text = kinds.index("response.output_text.delta")
    assert kinds[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",  # the reasoning item
        "response.content_part.added",
        "response.reasoning_text.delta",
    ]
    assert kinds[first_text - 5 : first_text] == [
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",  # the message
        "response.content_part.added",
    ]
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (thought, text) == (REASONING, ANSWER)
    final = events[-1].response
    assert events[-1].type == "response.completed" and final.output_text == ANSWER
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == REASONING
    assert final.usage.output_tokens_details.reasoning_tokens == reasoning_token_count(model_dir)
    whole = await client.responses.create(**body)
    assert whole.output[0].content[0].text == REASONING and whole.output_text == ANSWER


async def test_the_sdks_streaming_helper_assembles_the_response(thinker):
    """``client.responses.stream``: the SDK's own accumulation of the events (it checks that
    each delta lands on an item and a part it was told of) gives the non-streamed answer, the
    reasoning item included. (The helper needs ``response.completed``: the scripted model's
    answer ends by itself.)"""
    client = sdk(thinker[0])
    body = {"model": "thinker", "input": "Where is Paris?", "max_output_tokens": 32}
    whole = await client.responses.create(**body)
    async with client.responses.stream(**body) as stream:
        texts = [
            event.delta async for event in stream if event.type == "response.output_text.delta"
        ]
        final = await stream.get_final_response()
    assert "".join(texts) == final.output_text == whole.output_text == ANSWER
    assert final.status == whole.status == "completed"
    assert final.output[0].type == "reasoning" and final.output[0].content[0].text == REASONING


async def test_cut_in_the_reasoning_streamed_and_whole_give_the_same_items(thinker):
    """An answer cut before the reasoning ends: the reasoning item alone, streamed or not (the
    stream added an empty message); with a named tool, no call either way (the stream made
    one, its arguments empty)."""
    model, _ = thinker
    body: dict[str, Any] = {"model": "thinker", "input": "Where is Paris?", "max_output_tokens": 3}
    named = {"tools": TOOLS, "tool_choice": {"type": "function", "name": "get_time"}}
    for extra in ({}, named):
        whole = await ok(model, RESPONSES, {**body, **extra})
        assert [item["type"] for item in whole["output"]] == ["reasoning"]
        streamed = await post(model, RESPONSES, {**body, **extra, "stream": True})
        events = [
            json.loads(line.removeprefix("data: "))
            for line in streamed.text.splitlines()
            if line.startswith("data: ")
        ]
        final = events[-1]["response"]
        assert [item["type"] for item in final["output"]] == ["reasoning"]
        assert not any(event["type"].startswith("response.output_text") for event in events)


async def test_text_parts_are_joined_as_chat_joins_them_and_big_integers_are_echoed(served):
    """Parts of one message are joined by a newline, as on chat; an integer past 64 bits in
    the request's own settings comes back as sent (orjson refused it: a 500, a cut stream)."""
    model = served()
    parts = [{"type": "input_text", "text": "Hello"}, {"type": "input_text", "text": "world"}]
    request = ResponsesRequest.model_validate({"input": [{"role": "user", "content": parts}]})
    assert request.messages() == [{"role": "user", "content": "Hello\nworld"}]
    text = {"format": {"type": "text"}, "verbosity_budget": 10**20}
    body = {"input": "Hello", "max_output_tokens": 2, "text": text}
    assert (await ok(model, RESPONSES, body))["text"] == text
    streamed = await post(model, RESPONSES, {**body, "stream": True})
    assert streamed.status_code == 200 and '"response.completed"' in streamed.text.replace(
        "response.incomplete", "response.completed"
    )
    assert str(10**20) in streamed.text
