"""Reasoning output on /v1/chat/completions (``--reasoning-parser``) on the transformers backend,
in-process, with a tiny model whose greedy output is ``<think>REASONING</think>ANSWER``
(:mod:`tests.thinking_model`): the message's ``reasoning`` / ``reasoning_content`` and
``content``, streamed and not, ``include_reasoning``, the usage's reasoning tokens, thinking
turned off by the template's kwargs, tool parsing and structured output after the reasoning,
and the ``openai`` SDK reading it all."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from huggingfaceserver.protocols.kserve_model import BackendModel
from huggingfaceserver.protocols.openai.prompts import chat_text
from huggingfaceserver.protocols.openai.requests import ChatCompletionRequest
from tests.harness import client_for, load_model, sdk_for
from tests.thinking_model import (
    ANSWER,
    REASONING,
    THINK_END,
    THINK_START,
    build_thinking_llama,
    reasoning_token_count,
)

CHAT = "/openai/v1/chat/completions"
RAW = THINK_START + REASONING + THINK_END + ANSWER
MESSAGES = [{"role": "user", "content": "Where is Paris?"}]
BODY: dict[str, Any] = {"model": "thinker", "messages": MESSAGES, "max_tokens": 32}
PARSERS = ["deepseek_r1", "qwen3"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_thinking_llama(tmp_path_factory.mktemp("thinker"))


@pytest.fixture(scope="module")
def served(model_dir: Path) -> Callable[..., BackendModel]:
    """``served(*flags)``: the thinking model loaded as the server loads it, once per flags."""
    cache: dict[tuple[str, ...], BackendModel] = {}

    def get(*flags: str) -> BackendModel:
        if flags not in cache:
            argv = ["--model_dir", str(model_dir), "--model_name", "thinker"]
            cache[flags] = load_model([*argv, "--backend", "huggingface", *flags])
        return cache[flags]

    return get


async def post(model: BackendModel, body: dict[str, Any]) -> httpx.Response:
    async with client_for(model) as client:
        return await client.post(CHAT, json=body)


async def answer(model: BackendModel, body: dict[str, Any]) -> dict[str, Any]:
    response = await post(model, body)
    assert response.status_code == 200, response.text
    return response.json()


async def chunks(model: BackendModel, body: dict[str, Any]) -> list[dict[str, Any]]:
    response = await post(model, {**body, "stream": True})
    assert response.status_code == 200, response.text
    events = response.text.removesuffix("\n\n").split("\n\n")
    assert events[-1] == "data: [DONE]"
    return [json.loads(event.removeprefix("data: ")) for event in events[:-1]]


def joined(deltas: list[dict[str, Any]], name: str) -> str:
    return "".join(delta.get(name) or "" for delta in deltas)


def deltas_of(stream: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [choice["delta"] for chunk in stream for choice in chunk["choices"]]


async def test_without_a_parser_the_markers_stay_in_the_content(served):
    response = await answer(served(), BODY)
    message = response["choices"][0]["message"]
    assert message == {"content": RAW, "role": "assistant"}
    assert "completion_tokens_details" not in response["usage"]
    deltas = deltas_of(await chunks(served(), BODY))
    assert joined(deltas, "content") == RAW
    assert not any("reasoning" in delta for delta in deltas)


@pytest.mark.parametrize("parser", PARSERS)
async def test_the_message_carries_the_reasoning_apart(served, model_dir, parser):
    response = await answer(served("--reasoning-parser", parser), {**BODY, "n": 2})
    for choice in response["choices"]:
        message = choice["message"]
        assert message["reasoning"] == message["reasoning_content"] == REASONING
        assert message["content"] == ANSWER and choice["finish_reason"] == "stop"
    usage = response["usage"]
    assert usage["completion_tokens_details"] == {
        "reasoning_tokens": 2 * reasoning_token_count(model_dir)
    }


@pytest.mark.parametrize("parser", PARSERS)
async def test_streamed_deltas_add_up_to_the_message(served, model_dir, parser):
    model = served("--reasoning_parser", parser)
    body = {**BODY, "stream_options": {"include_usage": True}}
    stream = await chunks(model, body)
    deltas = deltas_of(stream)
    assert deltas[0]["role"] == "assistant"
    assert joined(deltas, "reasoning") == joined(deltas, "reasoning_content") == REASONING
    assert joined(deltas, "content") == ANSWER
    for delta in deltas:
        assert delta.get("reasoning") == delta.get("reasoning_content")
    # the reasoning comes first, as generated: no content delta before the last reasoning one
    kinds = [
        ("r" if d.get("reasoning") else "c")
        for d in deltas
        if d.get("reasoning") or d.get("content")
    ]
    assert kinds[0] == "r" and "r" not in kinds[kinds.index("c") :]
    usage = stream[-1]["usage"]
    assert usage["completion_tokens_details"]["reasoning_tokens"] == reasoning_token_count(
        model_dir
    )


async def test_include_reasoning_false_leaves_it_out(served, model_dir):
    model = served("--reasoning-parser", "deepseek_r1")
    body = {**BODY, "include_reasoning": False}
    response = await answer(model, body)
    assert response["choices"][0]["message"] == {"content": ANSWER, "role": "assistant"}
    assert response["usage"]["completion_tokens_details"]["reasoning_tokens"] == (
        reasoning_token_count(model_dir)
    )
    deltas = deltas_of(await chunks(model, body))
    assert joined(deltas, "content") == ANSWER
    assert not any("reasoning" in delta or "reasoning_content" in delta for delta in deltas)


async def test_enable_thinking_false_makes_it_all_content_for_qwen3(served):
    model = served("--reasoning-parser", "qwen3")
    body = {**BODY, "chat_template_kwargs": {"enable_thinking": False}}
    thinking = await answer(model, BODY)
    response = await answer(model, body)
    assert response["choices"][0]["message"] == {"content": RAW, "role": "assistant"}
    # the template read the flag: its prompt has "/no_think" more
    assert response["usage"]["prompt_tokens"] > thinking["usage"]["prompt_tokens"]
    assert response["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    assert joined(deltas_of(await chunks(model, body)), "content") == RAW


async def test_the_sdk_reads_reasoning_and_its_tokens(served, model_dir):
    client = sdk_for(served("--reasoning-parser", "qwen3"))
    response = await client.chat.completions.create(
        model="thinker", messages=MESSAGES, max_tokens=32
    )
    message = response.choices[0].message
    assert message.content == ANSWER
    assert message.model_extra == {"reasoning": REASONING, "reasoning_content": REASONING}
    assert response.usage is not None and response.usage.completion_tokens_details is not None
    assert response.usage.completion_tokens_details.reasoning_tokens == reasoning_token_count(
        model_dir
    )
    stream = await client.chat.completions.create(
        model="thinker", messages=MESSAGES, max_tokens=32, stream=True
    )
    reasoning, content = "", ""
    async for chunk in stream:
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning") or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == (REASONING, ANSWER)


async def test_tool_parsing_reads_the_content_after_the_reasoning(served):
    model = served(
        "--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"
    )
    body = {**BODY, "tools": [TOOL]}
    message = (await answer(model, body))["choices"][0]["message"]
    assert message["content"] == ANSWER and message["reasoning"] == REASONING
    assert "tool_calls" not in message
    deltas = deltas_of(await chunks(model, body))
    assert (joined(deltas, "reasoning"), joined(deltas, "content")) == (REASONING, ANSWER)


CITY = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Lyon"]}},
    "required": ["city"],
    "additionalProperties": False,
}
"""A schema the tiny model's answer can complete within max_tokens."""
TOOL = {"type": "function", "function": {"name": "locate", "parameters": CITY}}


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"guided_choice": ["yes", "no"]}, lambda message: message["content"] in ("yes", "no")),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "c", "schema": CITY},
                }
            },
            lambda message: json.loads(message["content"])["city"] in ("Paris", "Lyon"),
        ),
        (
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "locate"}}},
            lambda message: (
                json.loads(message["tool_calls"][0]["function"]["arguments"])["city"]
                in ("Paris", "Lyon")
            ),
        ),
    ],
)
async def test_structured_output_starts_after_the_reasoning(served, parser, extra, check):
    # The scripted model writes its reasoning free, then the grammar takes over from its
    # </think> (as vLLM's engine does): without that its answer would not validate.
    model = served("--reasoning-parser", parser)
    message = (await answer(model, {**BODY, **extra}))["choices"][0]["message"]
    assert message["reasoning"] == REASONING and check(message)
    deltas = deltas_of(await chunks(model, {**BODY, **extra}))
    assert joined(deltas, "reasoning") == REASONING


async def test_structured_output_without_thinking_starts_at_once(served):
    model = served("--reasoning-parser", "qwen3")
    body = {**BODY, "guided_choice": ["yes", "no"]}
    body["chat_template_kwargs"] = {"enable_thinking": False}
    message = (await answer(model, body))["choices"][0]["message"]
    assert message["content"] in ("yes", "no") and "reasoning" not in message


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_earlier_reasoning_reaches_the_template_as_reasoning_content(model_dir, field):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    earlier = {"role": "assistant", "content": "France.", field: "I recall it."}
    request = ChatCompletionRequest(messages=[*MESSAGES, earlier, *MESSAGES])
    text = chat_text(tokenizer, request, None)
    assert "<|assistant|>\n<think>I recall it.</think>France.\n" in text
