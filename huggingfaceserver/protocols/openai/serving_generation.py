"""``/v1/completions`` and ``/v1/chat/completions`` on any :class:`GenerationBackend`.

Requests are validated and converted here, prompts tokenized (chat through the chat template),
the context limit checked, and the backend's deltas turned into OpenAI responses or
Server-Sent Events. Nothing here knows which backend runs.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel
from transformers import PreTrainedTokenizerBase

from ...backends.base import GenerationBackend
from ...errors import BadRequest, ClientClosedRequest
from ...generation.params import ChoiceDelta, FinishReason, SamplingParams, TokenLogprob
from ..kserve_model import GenerationModel
from .errors import context_length_error
from .logprobs import TokenLogprobText
from .models import ServedModels
from .requests import ChatCompletionRequest, CompletionRequest
from .responses import to_json

T = TypeVar("T")
DISCONNECT_POLL_S = 0.1


@dataclass
class Job:
    """One prompt to generate ``params.n`` choices for; its choices start at ``first_index``."""

    prompt_ids: list[int]
    prompt_text: str
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

    @property
    def final_reason(self) -> FinishReason:
        """Why the choice ended; backends always say so in a choice's last delta."""
        assert self.finish_reason is not None, "a choice ended without a finish reason"
        return self.finish_reason


def resolve_generation(
    models: ServedModels, name: str | None, route: str
) -> tuple[GenerationModel, GenerationBackend, str | None]:
    """The model, its backend, and the LoRA adapter when ``name`` is an adapter's name."""
    model = models.get(name)
    backend = models.backend(model.name, GenerationBackend, route)  # type: ignore[type-abstract]
    assert isinstance(model, GenerationModel)
    adapter = name if name is not None and name != model.name else None
    return model, backend, adapter


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
        job_params = SamplingParams(**{**vars(params), "max_tokens": wanted})
        backend.check_request(ids, job_params, adapter)
        if text is None:
            text = decode(backend.tokenizer, ids)
        jobs.append(Job(ids, text, job_params, number * params.n, adapter))
    return jobs


def completion_prompts(
    tokenizer: PreTrainedTokenizerBase, request: CompletionRequest
) -> list[tuple[list[int], str | None]]:
    """(token ids, text or None) per prompt; texts are tokenized as the tokenizer does by
    default, token-id prompts are used as they are."""
    out: list[tuple[list[int], str | None]] = []
    for prompt in request.prompts():
        if isinstance(prompt, str):
            out.append((tokenizer(prompt)["input_ids"], prompt))
        else:
            ids = list(prompt)
            out.append((ids, None))  # decoded once the ids are known to be valid
    return out


def decode(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
    text = tokenizer.decode(ids)
    assert isinstance(text, str)
    return text


def chat_prompt(
    tokenizer: PreTrainedTokenizerBase, request: ChatCompletionRequest, server_template: str | None
) -> tuple[list[int], str | None]:
    """Render the conversation with the chat template and tokenize it (no special tokens added a
    second time: the template writes them)."""
    template = request.chat_template or server_template or tokenizer.chat_template
    if not template:
        raise BadRequest(
            "this model has no chat template: pass --chat_template at startup, send "
            "chat_template in the request, or use /v1/completions"
        )
    try:
        text = tokenizer.apply_chat_template(
            request.conversation(),
            chat_template=template,
            tokenize=False,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            **(request.chat_template_kwargs or {}),
        )
    except Exception as exc:  # the template is code from the request or the model: any failure
        raise BadRequest(f"the chat template failed on these messages: {exc!r}") from None
    assert isinstance(text, str)
    return tokenizer(text, add_special_tokens=False)["input_ids"], text


async def generate_all(
    backend: GenerationBackend, jobs: list[Job]
) -> AsyncIterator[tuple[int, ChoiceDelta]]:
    """Run every job concurrently; yield (choice index, delta) as they come. Leaving early (a
    client that went away) cancels every generation."""
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
    return states


def logprob_texts(
    tokenizer: PreTrainedTokenizerBase, logprobs: list[TokenLogprob]
) -> list[TokenLogprobText]:
    """Token ids to the token strings OpenAI's logprob formats show."""
    return [
        TokenLogprobText(
            decode(tokenizer, [lp.token_id]),
            lp.logprob,
            [(decode(tokenizer, [alt]), alt_lp) for alt, alt_lp in lp.top],
        )
        for lp in logprobs
    ]


def sse(payload: BaseModel | dict[str, Any]) -> str:
    """One Server-Sent Event of JSON data."""
    text = to_json(payload) if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {text}\n\n"


SSE_DONE = "data: [DONE]\n\n"
