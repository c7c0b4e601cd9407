"""``/v1/completions``: the non-streamed response and its Server-Sent Event stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import Request, Response
from pydantic import BaseModel

from ...generation.params import ChoiceDelta
from .logprobs import completion_logprobs
from .models import ServedModels, resolve_generation
from .prompts import prepare_completion
from .requests import CompletionRequest
from .responses import (
    ScoredCompletionChoice,
    completion_choice,
    completion_chunk,
    completion_response,
    completion_stream_choice,
)
from .serving_generation import (
    ChoiceState,
    GenerationRun,
    collect,
    echoed_logprob_texts,
    event_stream,
    fill_prompt_texts,
    framed,
    logprob_texts,
    plan_jobs_off_loop,
    prompt_logprobs_json,
    until_disconnected,
)


async def create_completion(
    models: ServedModels, request: CompletionRequest, raw: Request
) -> Response:
    model, backend, adapter = resolve_generation(models, request.model, "/v1/completions")
    params = request.to_sampling_params(defaults=model.sampling_defaults)
    prompts = await prepare_completion(backend, model, request)
    jobs = await plan_jobs_off_loop(backend, prompts, params, "prompt", adapter)
    run = GenerationRun.start(
        "cmpl", adapter or model.name, backend, jobs, request.include_usage, raw
    )
    echo = bool(request.echo)
    if echo:
        await asyncio.to_thread(fill_prompt_texts, backend.tokenizer, jobs)
    if request.stream:
        return event_stream(completion_events(run, echo))
    states = await until_disconnected(raw, collect(backend, jobs))
    choices = await asyncio.to_thread(completion_choices, run, request, states)
    return run.respond(completion_response, choices, states)


def completion_choices(
    run: GenerationRun, request: CompletionRequest, states: list[ChoiceState]
) -> list[ScoredCompletionChoice]:
    """The finished choices (blocking: token texts are decoded for logprobs)."""
    tokenizer, echo = run.tokenizer, bool(request.echo)
    choices = []
    for index, state in enumerate(states):
        job = run.job_of(index)
        prefix = (job.prompt_text or "") if echo else ""
        logprobs = None
        if run.want_logprobs:
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


def _has_content(delta: ChoiceDelta) -> bool:
    """Whether a delta makes a chunk: any token generated does, its text empty or not (a
    special token left out, a character's bytes not all in, text held back at a stop string's
    start), as vLLM's server streams; a client sees the choice advance with each token."""
    return bool(delta.text or delta.token_ids or delta.finish_reason or delta.logprobs)


def completion_events(run: GenerationRun, echo: bool) -> AsyncIterator[str]:
    sent: dict[int, int] = {}

    def choice_for(index: int, delta: ChoiceDelta) -> BaseModel | None:
        first = index not in sent
        prefix = (run.job_of(index).prompt_text or "") if echo and first else ""
        if not (prefix or _has_content(delta)):
            return None
        offset = sent.get(index, 0) + len(prefix)
        logprobs = None
        if run.want_logprobs:
            texts = logprob_texts(run.tokenizer, delta.logprobs or [])
            logprobs = completion_logprobs(texts, offset)
        text = prefix + delta.text
        sent[index] = sent.get(index, 0) + len(text)
        return completion_stream_choice(index, text, delta.finish_reason, logprobs)

    return framed(run, choice_for, completion_chunk)
