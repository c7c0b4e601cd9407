"""What a chat request decides about its reasoning (:mod:`...openai.chat_reasoning`), without a
model: the sampling settings (special tokens kept, a constraint started after the reasoning),
tool calls parsed from the content after the reasoning (whole and streamed, adding up to the
same message), and the reasoning token count."""

from __future__ import annotations

import json
from typing import Any

import pytest

from huggingfaceserver.generation.params import ChoiceDelta, Constraint, SamplingParams
from huggingfaceserver.generation.reasoning import REASONING_PARSERS
from huggingfaceserver.protocols.openai.chat_reasoning import (
    ReasoningPlan,
    ThoughtStreams,
    count_reasoning_tokens,
    plan_reasoning,
)
from huggingfaceserver.protocols.openai.requests import ChatCompletionRequest
from huggingfaceserver.protocols.openai.serving_chat import chat_message
from huggingfaceserver.protocols.openai.tools import Tool, ToolStream, plan_tools

MESSAGES = [{"role": "user", "content": "Weather?"}]
CALL = '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>'
TOOLS = [Tool.model_validate({"function": {"name": "weather", "parameters": {"type": "object"}}})]
CHOICE = Constraint("choice", json.dumps(["yes", "no"]))
PARAMS = SamplingParams()


def request(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=MESSAGES, **fields)


def plan(name: str, **fields: Any) -> ReasoningPlan:
    found, _ = plan_reasoning(REASONING_PARSERS[name], request(**fields), PARAMS)
    assert found is not None
    return found


def test_without_a_parser_nothing_changes():
    assert plan_reasoning(None, request(), PARAMS) == (None, PARAMS)


def test_qwen3_keeps_special_tokens_as_vllms_parser_asks():
    _, params = plan_reasoning(REASONING_PARSERS["qwen3"], request(), PARAMS)
    assert params.skip_special_tokens is False
    _, params = plan_reasoning(REASONING_PARSERS["deepseek_r1"], request(), PARAMS)
    assert params.skip_special_tokens is True


def test_a_constraint_starts_after_the_reasoning_of_a_model_that_thinks():
    constrained = SamplingParams(constraint=CHOICE)
    form = REASONING_PARSERS["qwen3"]
    _, params = plan_reasoning(form, request(), constrained)
    assert params.constraint == Constraint(CHOICE.kind, CHOICE.spec, "</think>", thinking="{}")
    told = request(chat_template_kwargs={"enable_thinking": True})
    assert plan_reasoning(form, told, constrained)[1].constraint.thinking == (
        '{"enable_thinking": true}'  # for vLLM's engine's parser
    )
    off = request(chat_template_kwargs={"enable_thinking": False})
    assert plan_reasoning(form, off, constrained)[1].constraint == CHOICE  # from the start
    assert plan_reasoning(form, request(), PARAMS)[1].constraint is None


@pytest.mark.parametrize(
    ("name", "text", "reasoning", "content", "calls"),
    [
        ("qwen3", f"<think>Look it up.</think>{CALL}", "Look it up.", None, 1),
        ("qwen3", f"Look it up.{CALL}", "Look it up.", None, 1),  # a call ends Qwen3's thinking
        ("deepseek_r1", f"Look it up.{CALL}", f"Look it up.{CALL}", None, 0),  # still thinking
        ("deepseek_r1", f"Hm {CALL}</think>Sunny.", f"Hm {CALL}", "Sunny.", 0),
    ],
)
def test_tool_calls_come_from_the_content_after_the_reasoning(
    name, text, reasoning, content, calls
):
    tools = plan_tools(TOOLS, "auto", None, "hermes")
    reasoning_plan = plan(name)
    message, thought = chat_message(text, tools, reasoning_plan)
    assert (thought, message.content, len(message.calls)) == (reasoning, content, calls)

    thoughts, stream = ThoughtStreams(reasoning_plan), ToolStream(tools)
    sent_thought, sent, streamed_calls = "", "", []
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]  # markers cut anywhere
    for number, piece in enumerate(pieces):
        last = number == len(pieces) - 1
        delta = ChoiceDelta(0, piece, [], finish_reason="stop" if last else None)
        thought_delta, content_delta = thoughts.push(0, delta)
        sent_thought += thought_delta or ""
        sent += stream.push(content_delta)
        if last:
            rest, streamed_calls = stream.finish()
            sent += rest
    assert (sent_thought, sent or None, len(streamed_calls)) == (reasoning, content, calls)


def test_include_reasoning_false_hides_it_but_counts_it():
    hidden = plan("deepseek_r1", include_reasoning=False)
    thoughts = ThoughtStreams(hidden)
    assert thoughts.push(0, ChoiceDelta(0, "a b</think>c", [])) == (None, "c")
    assert thoughts.streams[0].reasoning == "a b"


def test_reasoning_tokens_are_the_reasoning_texts_tokens(tokenizer):
    texts = ["The capital of France", "", "is Paris."]
    expected = sum(len(tokenizer.encode(t, add_special_tokens=False)) for t in texts)
    assert count_reasoning_tokens(tokenizer, texts) == expected > 0
