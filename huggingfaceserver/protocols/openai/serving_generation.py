"""What ``/v1/completions`` (:mod:`.serving_completions`), ``/v1/chat/completions``
(:mod:`.serving_chat`) and the Responses API share, on any :class:`GenerationBackend`.

Requests become jobs here, the context limit checked (prompts are made in :mod:`.prompts`), the
backend's deltas are collected or streamed (one SSE framing, :func:`framed`), and a request in
flight is a :class:`GenerationRun`. Nothing here knows which backend runs.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from transformers import PreTrainedTokenizerBase

from ...backends.base import GenerationBackend
from ...errors import ClientClosedRequest, ServerError, internal_error_message, log_unexpected
from ...generation.detokenize import token_texts
from ...generation.params import ChoiceDelta, FinishReason, SamplingParams, TokenLogprob
from ...observability.request_ids import request_id_in
from .bodies import JSONBody, new_id, now, to_json
from .errors import InvalidParameter, context_length_error, error_content
from .logprobs import TokenLogprobText, json_logprob
from .responses import completion_usage

T = TypeVar("T")
DISCONNECT_POLL_S = 0.1


@dataclass
class Job:
    """One prompt to generate ``params.n`` choices for; its choices start at ``first_index``."""

    prompt_ids: list[int]
    prompt_text: str | None
    """None for a prompt sent as token ids, until :func:`fill_prompt_texts` (``echo``)."""
    params: SamplingParams
    first_index: int
    adapter: str | None = None


@dataclass
class ChoiceState:
    """One choice, accumulated from its deltas."""

    text: list[str] = field(default_factory=list)
    tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """The prompt's, from the choice's first delta, when asked for."""

    @property
    def final_reason(self) -> FinishReason:
        """Why the choice ended; backends always say so in a choice's last delta."""
        assert self.finish_reason is not None, "a choice ended without a finish reason"
        return self.finish_reason


def plan_jobs(
    backend: GenerationBackend,
    prompts: list[tuple[list[int], str | None]],
    params: SamplingParams,
    param_name: str,
    adapter: str | None = None,
) -> list[Job]:
    """One job per prompt, with ``max_tokens`` settled against the context length (a 400 with
    OpenAI's wording when prompt plus completion do not fit)."""
    limit = backend.max_model_len
    jobs = []
    for number, (ids, text) in enumerate(prompts):
        wanted = params.max_tokens if params.max_tokens is not None else limit - len(ids)
        if len(ids) + wanted > limit or wanted < 1:
            raise context_length_error(limit, len(ids), max(wanted, 1), param=param_name)
        if params.min_tokens > wanted:
            raise InvalidParameter(
                f"min_tokens ({params.min_tokens}) is more than the {wanted} tokens the "
                "completion may have",
                param="min_tokens",
            )
        job_params = SamplingParams(**{**vars(params), "max_tokens": wanted})
        backend.check_request(ids, job_params, adapter)
        jobs.append(Job(ids, text, job_params, number * params.n, adapter))
    return jobs


async def plan_jobs_off_loop(
    backend: GenerationBackend,
    prompts: list[tuple[list[int], str | None]],
    params: SamplingParams,
    param_name: str,
    adapter: str | None = None,
) -> list[Job]:
    """:func:`plan_jobs`, in a worker thread when the request has a structured-output
    constraint (checking it compiles a grammar)."""
    if params.constraint is None:
        return plan_jobs(backend, prompts, params, param_name, adapter)
    return await asyncio.to_thread(plan_jobs, backend, prompts, params, param_name, adapter)


def fill_prompt_texts(tokenizer: PreTrainedTokenizerBase, jobs: list[Job]) -> None:
    """Decode the prompts sent as token ids (blocking: for ``echo``, in a worker thread)."""
    for job in jobs:
        if job.prompt_text is None:
            job.prompt_text = decode(tokenizer, job.prompt_ids)


def decode(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
    text = tokenizer.decode(ids)
    assert isinstance(text, str)
    return text


async def generate_all(
    backend: GenerationBackend, jobs: list[Job]
) -> AsyncIterator[tuple[int, ChoiceDelta]]:
    """Run every job concurrently; yield (choice index, delta) as they come. Leaving early (a
    client that went away) cancels every generation."""
    if len(jobs) == 1:  # the usual request: its one stream, with no task and queue between
        [job] = jobs
        stream = backend.generate(job.prompt_ids, job.params, job.adapter)
        try:
            async for deltas in stream:
                for delta in deltas:
                    yield job.first_index + delta.index, delta
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
        return
    queue: asyncio.Queue[tuple[int, ChoiceDelta] | BaseException | None] = asyncio.Queue()

    async def pump(job: Job) -> None:
        stream = backend.generate(job.prompt_ids, job.params, job.adapter)
        try:
            async for deltas in stream:
                for delta in deltas:
                    queue.put_nowait((job.first_index + delta.index, delta))
        except Exception as exc:  # handed to the consumer, which re-raises it as it is
            queue.put_nowait(exc)
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
            queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(job)) for job in jobs]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it if the client disconnects first."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientClosedRequest("client disconnected")
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def collect(backend: GenerationBackend, jobs: list[Job]) -> list[ChoiceState]:
    """Every choice's final state (non-streamed responses)."""
    states = [ChoiceState() for job in jobs for _ in range(job.params.n)]
    async for index, delta in generate_all(backend, jobs):
        state = states[index]
        state.text.append(delta.text)
        state.tokens += len(delta.token_ids)
        state.logprobs.extend(delta.logprobs or [])
        state.finish_reason = delta.finish_reason or state.finish_reason
        if delta.prompt_logprobs is not None:
            state.prompt_logprobs = delta.prompt_logprobs
    return states


def logprob_texts(
    tokenizer: PreTrainedTokenizerBase, logprobs: list[TokenLogprob]
) -> list[TokenLogprobText]:
    """Token ids to the token strings OpenAI's logprob formats show."""
    entries = []
    for lp in logprobs:
        token, *alternatives = token_texts(tokenizer, [lp.token_id, *(alt for alt, _ in lp.top)])
        top = [(text, alt_lp) for text, (_, alt_lp) in zip(alternatives, lp.top, strict=True)]
        entries.append(TokenLogprobText(token, lp.logprob, top))
    return entries


def echoed_logprob_texts(
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: list[int],
    scored: list[TokenLogprob | None] | None,
    num_top: int,
) -> list[TokenLogprobText]:
    """An echoed prompt's tokens for the completions logprobs format: the first without a
    logprob, the others with theirs and their top ``num_top`` alternatives (blocking)."""
    assert scored is not None and len(scored) == len(prompt_ids), "the prompt was not scored"
    texts = [TokenLogprobText(token_texts(tokenizer, prompt_ids[:1])[0], None, None)]
    texts += logprob_texts(
        tokenizer, [replace(entry, top=entry.top[:num_top]) for entry in scored[1:] if entry]
    )
    return texts


def prompt_logprobs_json(
    tokenizer: PreTrainedTokenizerBase, scored: list[TokenLogprob | None]
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, None for the first, then ``{token id:
    {"logprob", "rank", "decoded_token"}}`` for the token and its top alternatives (blocking)."""

    def entry(token_id: int, logprob: float, rank: int | None) -> dict[str, Any]:
        [text] = token_texts(tokenizer, [token_id])
        return {"logprob": json_logprob(logprob), "rank": rank, "decoded_token": text}

    out: list[dict[str, dict[str, Any]] | None] = []
    for scored_token in scored:
        if scored_token is None:
            out.append(None)
            continue
        token_id = scored_token.token_id
        position = {str(token_id): entry(token_id, scored_token.logprob, scored_token.rank)}
        for rank, (alternative, logprob) in enumerate(scored_token.top, 1):
            position.setdefault(str(alternative), entry(alternative, logprob, rank))
        out.append(position)
    return out


LINE_BREAKS_JSON_LEAVES = (("\x85", "\\u0085"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029"))
"""Characters JSON writes as they are (inside strings) but that ``str.splitlines`` breaks lines
at: a client that reads the stream with it (httpx's ``iter_lines``) would get a cut event.
Escaped, the JSON means the same."""


def sse(payload: BaseModel | dict[str, Any]) -> str:
    """One Server-Sent Event of JSON data, on one line for every line splitter."""
    text = to_json(payload) if isinstance(payload, BaseModel) else json.dumps(payload)
    for char, escaped in LINE_BREAKS_JSON_LEAVES:
        if char in text:
            text = text.replace(char, escaped)
    return f"data: {text}\n\n"


SSE_DONE = "data: [DONE]\n\n"


@dataclass
class GenerationRun:
    """A completion or chat request on its way: who serves it, what to generate, how its
    answer is identified."""

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
    ) -> GenerationRun:
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


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream")


async def framed(
    run: GenerationRun,
    choice_for: Callable[[int, ChoiceDelta], BaseModel | None],
    chunk: Callable[..., BaseModel],
    reasoning_tokens: Callable[[], Awaitable[int]] | None = None,
) -> AsyncIterator[str]:
    """The SSE framing both routes share: a chunk per delta (``chunk`` builds it around the
    choice ``choice_for`` gives, None to send nothing), the usage chunk when asked for (with
    the count ``reasoning_tokens`` gives, where given), an error event (not a cut connection)
    if generation fails, then ``[DONE]``."""
    ids = (run.request_id, run.model, run.created)
    completion_tokens = 0
    try:
        async for index, delta in generate_all(run.backend, run.jobs):
            completion_tokens += len(delta.token_ids)
            choice = choice_for(index, delta)
            if choice is not None:
                yield sse(chunk(*ids, choice, include_usage=run.include_usage))
        if run.include_usage:
            counted = None if reasoning_tokens is None else await reasoning_tokens()
            usage = completion_usage(run.prompt_tokens, completion_tokens, counted)
            yield sse(chunk(*ids, usage=usage))
    except ServerError as exc:  # the body these routes answer it with, as an event
        yield sse(error_content(exc))
    except Exception as exc:  # the stream has started: report it in-band, never cut it
        log_unexpected(run.x_request_id, exc)
        yield sse(error_content(ServerError(internal_error_message(run.x_request_id))))
    yield SSE_DONE
