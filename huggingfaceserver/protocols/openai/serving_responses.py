"""The Responses handler: a stateless ``POST /v1/responses``, non-streamed and streamed.

The request runs as its chat form (:meth:`~.responses_api.ResponsesRequest.to_chat`) through
what chat completions run: the prompt, the tool plan, structured output, the backend's
generation. Streamed, the events come in the order OpenAI sends them: ``response.created``,
``response.in_progress``; per output item ``response.output_item.added``, its content
(``response.content_part.added``, ``response.output_text.delta`` ..., ``.done``; a function
call's ``response.function_call_arguments.delta`` and ``.done``), ``response.output_item.done``;
then ``response.completed`` (or ``response.incomplete`` when ``max_output_tokens`` cut it, and
``response.failed`` when generation failed once the stream had started). Every event carries
its ``sequence_number``; the stream ends with the last event (no ``[DONE]``, as OpenAI's).

With ``--reasoning-parser``, a thinking model's reasoning is a ``reasoning`` output item before
the message (its ``content`` a ``reasoning_text`` part; streamed with
``response.reasoning_text.delta`` and ``.done``), split as chat completions split it
(:mod:`.chat_reasoning`), and ``usage.output_tokens_details.reasoning_tokens`` counts it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from ...backends.base import GenerationBackend
from ...errors import ServerError, internal_error_message, log_unexpected
from ...observability.request_ids import request_id_in
from .bodies import JSONBody, new_id, now
from .chat_reasoning import ReasoningPlan, ThoughtStreams, count_reasoning_tokens, plan_reasoning
from .models import ServedModels, resolve_generation
from .prompts import prepare_chat
from .responses_api import (
    ResponsesRequest,
    function_call_item,
    message_item,
    new_item_id,
    output_text_part,
    reasoning_item,
    reasoning_text_part,
    response_object,
    usage,
)
from .serving_chat import chat_message, with_tool_plan
from .serving_generation import Job, collect, generate_all, plan_jobs_off_loop, until_disconnected
from .tools import ToolPlan, ToolStream, plan_tools, tool_call_dicts

ROUTE = "/v1/responses"


@dataclass
class Run:
    """A response on its way."""

    request: ResponsesRequest
    model: str
    backend: GenerationBackend
    job: Job
    tools: ToolPlan
    reasoning: ReasoningPlan | None
    x_request_id: str
    response_id: str = field(default_factory=lambda: new_id("resp").replace("-", "_", 1))
    created: int = field(default_factory=now)

    def response(
        self,
        output: list[dict[str, Any]],
        status: str,
        output_tokens: int | None = None,
        finish_reason: str | None = None,
        reasoning_tokens: int = 0,
    ) -> dict[str, Any]:
        used = None
        if output_tokens is not None:
            used = usage(len(self.job.prompt_ids), output_tokens, reasoning_tokens)
        return response_object(
            self.request, self.response_id, self.model, self.created, output, status, used,
            finish_reason,
        )  # fmt: skip

    async def reasoning_tokens(self, reasonings: list[str]) -> int:
        if self.reasoning is None:
            return 0
        return await asyncio.to_thread(count_reasoning_tokens, self.backend.tokenizer, reasonings)


async def create_response(
    models: ServedModels, request: ResponsesRequest, raw: Request
) -> Response:
    chat = request.to_chat()
    model, backend, adapter = resolve_generation(models, chat.model, ROUTE)
    tools = plan_tools(
        chat.tools, chat.tool_choice, chat.parallel_tool_calls, model.auto_tool_parser
    )
    params = with_tool_plan(chat.to_sampling_params(defaults=model.sampling_defaults), tools)
    reasoning, params = plan_reasoning(model.reasoning, chat, params)
    prompt = await prepare_chat(backend, model, chat)
    [job] = await plan_jobs_off_loop(backend, [prompt], params, "input", adapter)
    run = Run(
        request, adapter or model.name, backend, job, tools, reasoning,
        request_id_in(raw.headers),
    )  # fmt: skip
    if request.stream:
        return StreamingResponse(events(run), media_type="text/event-stream")
    [state] = await until_disconnected(raw, collect(backend, [job]))
    message, thought = chat_message("".join(state.text), tools, reasoning)
    output = []
    shown = None if reasoning is None else reasoning.shown(thought)
    if shown:
        output.append(reasoning_item(shown, new_item_id("rs")))
    if message.content or not (message.calls or shown):
        output.append(message_item(message.content or "", new_item_id("msg")))
    for call in tool_call_dicts(message.calls):
        function = call["function"]
        output.append(
            function_call_item(
                function["name"], function["arguments"], call["id"], new_item_id("fc")
            )
        )
    reason = state.final_reason
    status = "incomplete" if reason == "length" else "completed"
    counted = await run.reasoning_tokens([thought or ""])
    return JSONBody(dumps(run.response(output, status, state.tokens, reason, counted)))


def dumps(body: dict[str, Any]) -> bytes:
    """A response (or event) as JSON: orjson's, but the standard library's where it holds an
    integer past 64 bits, which orjson refuses (a request's own ``tools``, ``tool_choice``
    or ``text`` settings are echoed back as they came: a schema's ``"maximum": 10**20``)."""
    try:
        return orjson.dumps(body)
    except TypeError:
        return json.dumps(body).encode()


class Events:
    """Numbered Server-Sent Events of one response."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + dumps(body) + b"\n\n"


class StreamedItem:
    """A streamed output item of text: the message (``output_text``) or the reasoning
    (``reasoning_text``), opened at its first text, closed when the next item starts or the
    answer ends."""

    def __init__(self, index: int, reasoning: bool):
        self.index = index
        self.reasoning = reasoning
        self.id = new_item_id("rs" if reasoning else "msg")
        self.text = ""
        self.delta_event = "response.reasoning_text" if reasoning else "response.output_text"

    def item(self, status: str = "completed") -> dict[str, Any]:
        if self.reasoning:
            return reasoning_item(self.text, self.id, status)
        return message_item(self.text, self.id, status)

    def part(self) -> dict[str, Any]:
        return reasoning_text_part(self.text) if self.reasoning else output_text_part(self.text)

    def where(self) -> dict[str, Any]:
        return {"item_id": self.id, "output_index": self.index, "content_index": 0}

    def opening(self, event: Events) -> list[bytes]:
        return [
            event(
                "response.output_item.added",
                output_index=self.index,
                item=self.item("in_progress"),
            ),
            event("response.content_part.added", **self.where(), part=self.part()),
        ]

    def delta(self, event: Events, text: str) -> bytes:
        self.text += text
        extra: dict[str, Any] = {} if self.reasoning else {"logprobs": []}
        return event(f"{self.delta_event}.delta", **self.where(), delta=text, **extra)

    def closing(self, event: Events) -> list[bytes]:
        extra: dict[str, Any] = {} if self.reasoning else {"logprobs": []}
        return [
            event(f"{self.delta_event}.done", **self.where(), text=self.text, **extra),
            event("response.content_part.done", **self.where(), part=self.part()),
            event("response.output_item.done", output_index=self.index, item=self.item()),
        ]


def call_events(event: Events, index: int, call: dict[str, Any]) -> tuple[list[bytes], dict]:
    """A parsed call's events (its arguments in one delta: they are parsed whole), and its
    item."""
    function = call["function"]
    item_id = new_item_id("fc")
    done = function_call_item(function["name"], function["arguments"], call["id"], item_id)
    where = {"item_id": item_id, "output_index": index}
    return [
        event(
            "response.output_item.added",
            output_index=index,
            item={**done, "arguments": "", "status": "in_progress"},
        ),
        event("response.function_call_arguments.delta", **where, delta=function["arguments"]),
        event(
            "response.function_call_arguments.done",
            **where,
            name=function["name"],
            arguments=function["arguments"],
        ),
        event("response.output_item.done", output_index=index, item=done),
    ], done


class Output:
    """The streamed answer's output items, in order: at most one open at a time."""

    def __init__(self, event: Events):
        self.event = event
        self.items: list[dict[str, Any]] = []
        self.open: StreamedItem | None = None

    def text(self, text: str, reasoning: bool) -> list[bytes]:
        """Text for the reasoning or the message: the item opened (the other closed) first."""
        chunks: list[bytes] = []
        if self.open is not None and self.open.reasoning != reasoning:
            chunks += self.close()
        if self.open is None:
            self.open = StreamedItem(len(self.items), reasoning)
            chunks += self.open.opening(self.event)
        return [*chunks, self.open.delta(self.event, text)]

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        chunks = self.open.closing(self.event)
        self.items.append(self.open.item())
        self.open = None
        return chunks

    def calls(self, calls: list[dict[str, Any]]) -> list[bytes]:
        chunks = self.close()
        for call in calls:
            events, item = call_events(self.event, len(self.items), call)
            chunks += events
            self.items.append(item)
        return chunks

    @property
    def has_message(self) -> bool:
        return any(item["type"] in ("message", "function_call") for item in self.items) or (
            self.open is not None and not self.open.reasoning
        )

    @property
    def has_reasoning(self) -> bool:
        return any(item["type"] == "reasoning" for item in self.items) or (
            self.open is not None and self.open.reasoning
        )


async def events(run: Run) -> AsyncIterator[bytes]:
    event = Events()
    yield event("response.created", response=run.response([], "in_progress"))
    yield event("response.in_progress", response=run.response([], "in_progress"))
    stream = ToolStream(run.tools) if run.tools.calls_tools else None
    thoughts = ThoughtStreams(run.reasoning)
    output = Output(event)
    tokens, reason = 0, None
    try:
        async for _, delta in generate_all(run.backend, [run.job]):
            tokens += len(delta.token_ids)
            reason = delta.finish_reason or reason
            thought, content = thoughts.push(0, delta)
            if stream is not None:
                content = stream.push(content)
            calls: list[dict[str, Any]] = []
            if delta.finish_reason is not None and stream is not None:
                rest, calls = stream.finish()
                content += rest
            chunks = output.text(thought, reasoning=True) if thought else []
            if content:
                chunks += output.text(content, reasoning=False)
            if delta.finish_reason is not None:
                if not (output.has_message or output.has_reasoning or calls):
                    # no answer, no reasoning shown: an empty message (as the whole response)
                    chunks += output.text("", reasoning=False)
                chunks += output.calls(calls) if calls else output.close()
            for chunk in chunks:
                yield chunk
        counted = await thoughts.count_tokens(run.backend.tokenizer) if run.reasoning else 0
    except Exception as exc:  # the stream has started: report it in-band, never cut it
        if isinstance(exc, ServerError):
            message, code = exc.message, str(exc.status_code)
        else:
            log_unexpected(run.x_request_id, exc)
            message, code = internal_error_message(run.x_request_id), "500"
        failed = run.response(output.items, "failed", tokens)
        failed["error"] = {"code": code, "message": message}
        yield event("response.failed", response=failed)
        return
    status = "incomplete" if reason == "length" else "completed"
    final = run.response(output.items, status, tokens, reason, counted)
    yield event(f"response.{status}", response=final)
