"""The completion and chat handlers: non-streamed responses and Server-Sent Event streams."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from transformers import PreTrainedTokenizerBase

from ...backends.base import GenerationBackend
from ...errors import ServerError, internal_error_message, log_unexpected
from ...generation.params import ChoiceDelta, SamplingParams
from ...observability.request_ids import request_id_in
from .bodies import JSONBody, new_id, now, to_json
from .chat_reasoning import ReasoningPlan, ThoughtStreams, count_reasoning_tokens, plan_reasoning
from .errors import InvalidParameter, error_content
from .logprobs import chat_logprobs, completion_logprobs
from .models import ServedModels, resolve_generation
from .prompts import prepare_chat, prepare_completion
from .requests import ChatCompletionRequest, CompletionRequest
from .responses import (
    ChatFinishReason,
    ScoredCompletionChoice,
    chat_choice,
    chat_chunk,
    chat_response,
    chat_stream_choice,
    completion_choice,
    completion_chunk,
    completion_response,
    completion_stream_choice,
    completion_usage,
)
from .serving_generation import (
    SSE_DONE,
    ChoiceState,
    Job,
    collect,
    echoed_logprob_texts,
    fill_prompt_texts,
    generate_all,
    logprob_texts,
    plan_jobs_off_loop,
    prompt_logprobs_json,
    sse,
    until_disconnected,
)
from .tools import ParsedMessage, ToolPlan, ToolStream, plan_tools, tool_call_dicts


@dataclass
class Exchange:
    """A request on its way: who serves it and what to generate."""

    request_id: str
    model: str
    created: int
    backend: GenerationBackend
    jobs: list[Job]
    include_usage: bool
    want_logprobs: bool
    x_request_id: str
    """The gateway's request id (``request_id`` is the response's own id)."""

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.backend.tokenizer

    @property
    def prompt_tokens(self) -> int:
        return sum(len(job.prompt_ids) for job in self.jobs)

    @classmethod
    def start(
        cls,
        id_prefix: str,
        model: str,
        backend: GenerationBackend,
        jobs: list[Job],
        include_usage: bool,
        raw: Request,
    ) -> Exchange:
        want_logprobs = jobs[0].params.logprobs is not None
        return cls(
            new_id(id_prefix), model, now(), backend, jobs, include_usage, want_logprobs,
            request_id_in(raw.headers),
        )  # fmt: skip

    def respond(
        self, build: Callable[..., BaseModel], choices: list[Any], states: list[ChoiceState]
    ) -> Response:
        """The whole (non-streamed) response, with usage counted from the choices' states."""
        completion_tokens = sum(s.tokens for s in states)
        response = build(
            self.request_id, self.model, choices, self.prompt_tokens, completion_tokens,
            self.created,
        )  # fmt: skip
        return JSONBody(to_json(response))

    def job_of(self, index: int) -> Job:
        n = self.jobs[0].params.n
        return self.jobs[index // n]


async def create_completion(
    models: ServedModels, request: CompletionRequest, raw: Request
) -> Response:
    model, backend, adapter = resolve_generation(models, request.model, "/v1/completions")
    params = request.to_sampling_params()
    prompts = await prepare_completion(backend, model, request)
    jobs = await plan_jobs_off_loop(backend, prompts, params, "prompt", adapter)
    exchange = Exchange.start(
        "cmpl", adapter or model.name, backend, jobs, request.include_usage, raw
    )
    echo = bool(request.echo)
    if echo:
        await asyncio.to_thread(fill_prompt_texts, backend.tokenizer, jobs)
    if request.stream:
        return event_stream(completion_events(exchange, echo))
    states = await until_disconnected(raw, collect(backend, jobs))
    choices = await asyncio.to_thread(completion_choices, exchange, request, states)
    return exchange.respond(completion_response, choices, states)


def completion_choices(
    exchange: Exchange, request: CompletionRequest, states: list[ChoiceState]
) -> list[ScoredCompletionChoice]:
    """The finished choices (blocking: token texts are decoded for logprobs)."""
    tokenizer, echo = exchange.tokenizer, bool(request.echo)
    choices = []
    for index, state in enumerate(states):
        job = exchange.job_of(index)
        prefix = (job.prompt_text or "") if echo else ""
        logprobs = None
        if exchange.want_logprobs:
            entries = logprob_texts(tokenizer, state.logprobs)
            if request.echo_logprobs:
                scored = state.prompt_logprobs
                echoed = echoed_logprob_texts(
                    tokenizer, job.prompt_ids, scored, request.logprobs or 0
                )
                entries = echoed + entries
            logprobs = completion_logprobs(entries, 0 if request.echo_logprobs else len(prefix))
        prompt_logprobs = None
        if request.prompt_logprobs is not None and state.prompt_logprobs is not None:
            prompt_logprobs = prompt_logprobs_json(tokenizer, state.prompt_logprobs)
        text = prefix + "".join(state.text)
        choices.append(
            completion_choice(index, text, state.final_reason, logprobs, prompt_logprobs)
        )
    return choices


async def create_chat_completion(
    models: ServedModels, request: ChatCompletionRequest, raw: Request
) -> Response:
    model, backend, adapter = resolve_generation(models, request.model, "/v1/chat/completions")
    tools = plan_tools(
        request.tools, request.tool_choice, request.parallel_tool_calls, model.auto_tool_parser
    )
    params = with_tool_plan(request.to_sampling_params(), tools)
    reasoning, params = plan_reasoning(model.reasoning, request, params)
    prompt = await prepare_chat(backend, model, request)
    jobs = await plan_jobs_off_loop(backend, [prompt], params, "messages", adapter)
    exchange = Exchange.start(
        "chatcmpl", adapter or model.name, backend, jobs, request.include_usage, raw
    )
    if request.stream:
        return event_stream(chat_events(exchange, tools, reasoning))
    states = await until_disconnected(raw, collect(backend, jobs))
    choices = []
    reasonings = []
    for index, state in enumerate(states):
        logprobs = None
        if exchange.want_logprobs:
            logprobs = chat_logprobs(logprob_texts(exchange.tokenizer, state.logprobs))
        message, thought = chat_message("".join(state.text), tools, reasoning)
        reasonings.append(thought or "")
        calls = tool_call_dicts(message.calls)
        reason = "tool_calls" if calls else state.final_reason
        shown = None if reasoning is None else reasoning.shown(thought)
        choices.append(chat_choice(index, message.content, reason, logprobs, calls, shown))
    scored = states[0].prompt_logprobs if request.prompt_logprobs is not None else None
    prompt_logprobs = None
    if scored is not None:
        prompt_logprobs = await asyncio.to_thread(prompt_logprobs_json, exchange.tokenizer, scored)
    reasoning_tokens = None
    if reasoning is not None:
        reasoning_tokens = await asyncio.to_thread(
            count_reasoning_tokens, exchange.tokenizer, reasonings
        )
    build = functools.partial(
        chat_response, prompt_logprobs=prompt_logprobs, reasoning_tokens=reasoning_tokens
    )
    return exchange.respond(build, choices, states)


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


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream")


async def framed(
    exchange: Exchange,
    choice_for: Callable[[int, ChoiceDelta], BaseModel | None],
    chunk: Callable[..., BaseModel],
    reasoning_tokens: Callable[[], Awaitable[int]] | None = None,
) -> AsyncIterator[str]:
    """The SSE framing both routes share: a chunk per delta (``chunk`` builds it around the
    choice ``choice_for`` gives, None to send nothing), the usage chunk when asked for (with
    the count ``reasoning_tokens`` gives, where given), an error event (not a cut connection)
    if generation fails, then ``[DONE]``."""
    ids = (exchange.request_id, exchange.model, exchange.created)
    completion_tokens = 0
    try:
        async for index, delta in generate_all(exchange.backend, exchange.jobs):
            completion_tokens += len(delta.token_ids)
            choice = choice_for(index, delta)
            if choice is not None:
                yield sse(chunk(*ids, choice, include_usage=exchange.include_usage))
        if exchange.include_usage:
            counted = None if reasoning_tokens is None else await reasoning_tokens()
            usage = completion_usage(exchange.prompt_tokens, completion_tokens, counted)
            yield sse(chunk(*ids, usage=usage))
    except ServerError as exc:  # the body these routes answer it with, as an event
        yield sse(error_content(exc))
    except Exception as exc:  # the stream has started: report it in-band, never cut it
        log_unexpected(exchange.x_request_id, exc)
        yield sse(error_content(ServerError(internal_error_message(exchange.x_request_id))))
    yield SSE_DONE


def _has_content(delta: ChoiceDelta) -> bool:
    return bool(delta.text or delta.finish_reason or delta.logprobs)


def completion_events(exchange: Exchange, echo: bool) -> AsyncIterator[str]:
    sent: dict[int, int] = {}

    def choice_for(index: int, delta: ChoiceDelta) -> BaseModel | None:
        first = index not in sent
        prefix = (exchange.job_of(index).prompt_text or "") if echo and first else ""
        if not (prefix or _has_content(delta)):
            return None
        offset = sent.get(index, 0) + len(prefix)
        logprobs = None
        if exchange.want_logprobs:
            texts = logprob_texts(exchange.tokenizer, delta.logprobs or [])
            logprobs = completion_logprobs(texts, offset)
        text = prefix + delta.text
        sent[index] = sent.get(index, 0) + len(text)
        return completion_stream_choice(index, text, delta.finish_reason, logprobs)

    return framed(exchange, choice_for, completion_chunk)


def chat_events(
    exchange: Exchange, tools: ToolPlan, reasoning: ReasoningPlan | None = None
) -> AsyncIterator[str]:
    started: set[int] = set()
    streams: dict[int, ToolStream] = {}
    thoughts = ThoughtStreams(reasoning)

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
                reason = "tool_calls" if calls else reason
        if not (text or thought or reason or delta.logprobs):
            return None
        first = index not in started
        started.add(index)
        logprobs = None
        if exchange.want_logprobs:
            logprobs = chat_logprobs(logprob_texts(exchange.tokenizer, delta.logprobs or []))
        content = text if (text or (first and not thought)) else None
        return chat_stream_choice(
            index, content, reason, logprobs, first=first, tool_calls=calls or None,
            reasoning=thought,
        )  # fmt: skip

    counted = None
    if reasoning is not None:
        counted = functools.partial(thoughts.count_tokens, exchange.tokenizer)
    return framed(exchange, choice_for, chat_chunk, counted)
