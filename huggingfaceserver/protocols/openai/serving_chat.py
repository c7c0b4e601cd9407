"""``/v1/chat/completions``: the non-streamed response (message, tool calls, reasoning) and its
Server-Sent Event stream."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi import Request, Response
from pydantic import BaseModel

from ...generation.params import ChoiceDelta, SamplingParams
from .chat_reasoning import ReasoningPlan, ThoughtStreams, count_reasoning_tokens, plan_reasoning
from .errors import InvalidParameter
from .logprobs import chat_logprobs
from .models import ServedModels, resolve_generation
from .prompts import prepare_chat
from .requests import ChatCompletionRequest
from .responses import (
    ChatFinishReason,
    chat_choice,
    chat_chunk,
    chat_response,
    chat_stream_choice,
)
from .serving_generation import (
    GenerationRun,
    collect,
    event_stream,
    framed,
    logprob_texts,
    plan_jobs_off_loop,
    prompt_logprobs_json,
    until_disconnected,
)
from .tools import ParsedMessage, ToolPlan, ToolStream, plan_tools, tool_call_dicts


async def create_chat_completion(
    models: ServedModels, request: ChatCompletionRequest, raw: Request
) -> Response:
    model, backend, adapter = resolve_generation(models, request.model, "/v1/chat/completions")
    tools = plan_tools(
        request.tools, request.tool_choice, request.parallel_tool_calls, model.auto_tool_parser
    )
    params = with_tool_plan(request.to_sampling_params(defaults=model.sampling_defaults), tools)
    reasoning, params = plan_reasoning(model.reasoning, request, params)
    prompt = await prepare_chat(backend, model, request)
    jobs = await plan_jobs_off_loop(backend, [prompt], params, "messages", adapter)
    run = GenerationRun.start(
        "chatcmpl", adapter or model.name, backend, jobs, request.include_usage, raw
    )
    if request.stream:
        return event_stream(chat_events(run, tools, reasoning))
    states = await until_disconnected(raw, collect(backend, jobs))
    choices = []
    reasonings = []
    for index, state in enumerate(states):
        logprobs = None
        if run.want_logprobs:
            logprobs = chat_logprobs(logprob_texts(run.tokenizer, state.logprobs))
        message, thought = chat_message("".join(state.text), tools, reasoning)
        reasonings.append(thought or "")
        calls = tool_call_dicts(message.calls)
        reason = with_calls(state.final_reason, bool(calls))
        shown = None if reasoning is None else reasoning.shown(thought)
        choices.append(chat_choice(index, message.content, reason, logprobs, calls, shown))
    scored = states[0].prompt_logprobs if request.prompt_logprobs is not None else None
    prompt_logprobs = None
    if scored is not None:
        prompt_logprobs = await asyncio.to_thread(prompt_logprobs_json, run.tokenizer, scored)
    reasoning_tokens = None
    if reasoning is not None:
        reasoning_tokens = await asyncio.to_thread(
            count_reasoning_tokens, run.tokenizer, reasonings
        )
    build = functools.partial(
        chat_response, prompt_logprobs=prompt_logprobs, reasoning_tokens=reasoning_tokens
    )
    return run.respond(build, choices, states)


def chat_message(
    text: str, tools: ToolPlan, reasoning: ReasoningPlan | None
) -> tuple[ParsedMessage, str | None]:
    """A choice's whole text as its message (content and tool calls, parsed from what follows
    the reasoning) and its reasoning (None without a parser, or none found)."""
    if reasoning is None:
        return tools.message(text), None
    split = reasoning.split(text)
    message = ParsedMessage(None) if split.content is None else tools.message(split.content)
    return message, split.reasoning


def with_calls(reason: ChatFinishReason, calls: bool) -> ChatFinishReason:
    """A choice's finish reason once its tool calls are parsed: ``tool_calls`` where it made
    some, but ``length`` where ``max_tokens`` cut it (a named function's arguments may then
    end mid-value, which the client must be told)."""
    return "tool_calls" if calls and reason != "length" else reason


def with_tool_plan(params: SamplingParams, tools: ToolPlan) -> SamplingParams:
    """The sampling settings a tool plan needs: its constraint (``required`` or a named
    function; not beside another structured output), and the special tokens an auto parser's
    markers are."""
    if tools.constraint is not None:
        if params.constraint is not None:
            raise InvalidParameter(
                "tool_choice required or a named function constrains the output already: "
                "leave out response_format and the guided fields",
                param="tool_choice",
            )
        params = replace(params, constraint=tools.constraint)
    if tools.parser is not None and tools.parser.keeps_special_tokens:
        params = replace(params, skip_special_tokens=False)
    return params


def chat_events(
    run: GenerationRun, tools: ToolPlan, reasoning: ReasoningPlan | None = None
) -> AsyncIterator[str]:
    started: set[int] = set()
    streams: dict[int, ToolStream] = {}
    thoughts = ThoughtStreams(reasoning)

    # Without a parser every token makes a chunk, its content empty or not, as vLLM's server
    # streams; a parser's held-back tokens make none until it lets text out.
    plain = reasoning is None and not tools.calls_tools

    def choice_for(index: int, delta: ChoiceDelta) -> BaseModel | None:
        thought, text = thoughts.push(index, delta)
        calls = None
        reason: ChatFinishReason | None = delta.finish_reason
        if tools.calls_tools:
            stream = streams.setdefault(index, ToolStream(tools))
            text = stream.push(text)
            if reason is not None:
                rest, calls = stream.finish()
                text += rest
                reason = with_calls(reason, bool(calls))
        if not (text or thought or reason or delta.logprobs or (plain and delta.token_ids)):
            return None
        first = index not in started
        started.add(index)
        logprobs = None
        if run.want_logprobs:
            logprobs = chat_logprobs(logprob_texts(run.tokenizer, delta.logprobs or []))
        content = text if (text or plain or (first and not thought)) else None
        return chat_stream_choice(
            index, content, reason, logprobs, first=first, tool_calls=calls or None,
            reasoning=thought,
        )  # fmt: skip

    counted = None
    if reasoning is not None:
        counted = functools.partial(thoughts.count_tokens, run.tokenizer)
    return framed(run, choice_for, chat_chunk, counted)
