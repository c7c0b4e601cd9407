"""The vLLM generation backend: our protocol layer on vLLM's async engine.

Prompts arrive as token ids (our layer renders chat templates with the model's tokenizer), so a
request means the same thing on both backends. Deltas stream from vLLM with
``RequestOutputKind.DELTA``; a consumer that leaves aborts the engine request.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import vllm

from ...cli import ServerConfig
from ...errors import BadRequest, EngineDied
from ...generation.constraints import LazyGrammars
from ...generation.params import (
    ChoiceDelta,
    Constraint,
    FinishReason,
    SamplingParams,
    TokenLogprob,
)
from ...loading import ModelSource, load_tokenizer
from ..base import GenerationBackend
from ..lora import ServedAdapters, served_adapters
from . import compat
from .engine import ENGINE_DIED, EngineHolder
from .engine_args import build_engine_args

logger = logging.getLogger(__name__)

FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "stop"}
SEEDS = 2**63
"""vLLM's server takes seeds of int64's range; ours go to 2**64 - 1 (torch's ``manual_seed``'s),
and vLLM seeds the ``n`` choices ``seed + index``, which its engine's messages must carry as
uint64: a seed past int64 is taken modulo :data:`SEEDS`."""


def to_vllm_params(params: SamplingParams) -> vllm.SamplingParams:
    """Our backend-neutral parameters, one to one onto vLLM's (same meanings by design).

    vLLM refuses ``n > 1`` with greedy sampling; greedy choices are all the same, so one is
    generated and repeated (see :meth:`VLLMGenerator.generate`).
    """
    try:
        return _vllm_params(params)
    except (ValueError, compat.ParamsError) as exc:  # vLLM refuses a value we let through
        raise BadRequest(str(exc)) from None


def _vllm_params(params: SamplingParams) -> vllm.SamplingParams:
    return vllm.SamplingParams(
        n=1 if params.greedy else params.n,
        max_tokens=params.max_tokens,
        min_tokens=params.min_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k if params.top_k > 0 else -1,
        min_p=params.min_p,
        seed=params.seed % SEEDS
        if params.seed is not None and params.seed >= SEEDS
        else params.seed,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        logit_bias=dict(params.logit_bias) or None,
        stop=list(params.stop) or None,
        stop_token_ids=list(params.stop_token_ids) or None,
        ignore_eos=params.ignore_eos,
        logprobs=params.logprobs,
        prompt_logprobs=params.prompt_logprobs,
        include_stop_str_in_output=params.include_stop_str_in_output,
        skip_special_tokens=params.skip_special_tokens,
        output_kind=compat.DELTA,
        structured_outputs=structured_outputs(params.constraint),
    )


def structured_outputs(constraint: Constraint | None) -> compat.StructuredOutputsParams | None:
    """Our constraint as vLLM's structured-output parameters (compact JSON, the engine's
    default here: see :mod:`.engine_args`)."""
    if constraint is None:
        return None
    spec: Any = json.loads(constraint.spec) if constraint.kind == "choice" else constraint.spec
    return compat.StructuredOutputsParams(**{constraint.kind: spec})


def to_logprobs(positions: Any, k: int) -> list[TokenLogprob]:
    """vLLM's per-token ``{token id: Logprob}`` dicts as ours (the top ``k`` by rank)."""
    out = []
    for chosen, position in positions:
        top = sorted(
            ((tid, lp) for tid, lp in position.items() if lp.rank is not None and lp.rank <= k),
            key=lambda item: item[1].rank,
        )
        out.append(
            TokenLogprob(
                chosen,
                float(position[chosen].logprob),
                tuple((tid, float(lp.logprob)) for tid, lp in top),
            )
        )
    return out


def to_prompt_logprobs(
    prompt_ids: list[int], positions: list[Any], k: int
) -> list[TokenLogprob | None]:
    """vLLM's prompt logprobs (None for the first token, then ``{token id: Logprob}``) as ours,
    with each prompt token's rank."""
    scored = to_logprobs(zip(prompt_ids[1:], positions[1:], strict=True), k)
    ranked = [
        replace(entry, rank=position[entry.token_id].rank)
        for entry, position in zip(scored, positions[1:], strict=True)
    ]
    return [None, *ranked]


class VLLMGenerator(EngineHolder, GenerationBackend):
    name = "vllm"

    def __init__(
        self, source: ModelSource, config: ServerConfig, kv_cache_bytes: int | None = None
    ):
        self.source = source
        self.config = config
        self.engine_args = build_engine_args(source, config, kv_cache_bytes)
        self.adapters: ServedAdapters = served_adapters(config)
        """LoRA adapters, each a model name of its own: named at startup or loaded at run time
        (``--enable_runtime_lora``: the engine's ``add_lora``)."""

    def load(self) -> None:
        """Start the engine and wait until it serves."""
        self.tokenizer = load_tokenizer(self.source, self.config)
        self.start_engine()
        self.max_model_len = compat.max_model_len(self.engine)
        self.is_encoder_decoder = bool(self.source.config.is_encoder_decoder)
        self.vocab_size = len(self.tokenizer)
        self.grammars = LazyGrammars.for_tokenizer(self.tokenizer, self.vocab_size)
        self.lora_ids = {name: i + 1 for i, name in enumerate(self.adapters)}
        self.next_lora_id = len(self.lora_ids) + 1
        """vLLM's number for the next adapter loaded at run time (never reused)."""

    def check_request(
        self, prompt_ids: list[int], params: SamplingParams, adapter: str | None = None
    ) -> None:
        """Every backend's check (a constraint compiled as the engine's guidance backend
        would), then what vLLM's own parameters refuse."""
        super().check_request(prompt_ids, params, adapter)
        to_vllm_params(params)

    def lora_request(self, adapter: str | None) -> compat.LoRARequest | None:
        if adapter is None:
            return None
        module = self.adapters.modules[adapter]
        return compat.LoRARequest(module.name, self.lora_ids[adapter], module.path)

    async def load_adapter(self, name: str, path: str) -> None:
        """The engine loads the adapter (``add_lora``); 400 where it cannot."""
        module = self.adapters.begin_load(name, path)
        lora_id, self.next_lora_id = self.next_lora_id, self.next_lora_id + 1
        loaded = False
        try:
            loaded = await self.engine.add_lora(compat.LoRARequest(name, lora_id, module.path))
        except (ValueError, OSError, RuntimeError) as exc:
            raise BadRequest(f"LoRA adapter {name} ({module.path}): {exc}") from None
        finally:
            if loaded:
                self.lora_ids[name] = lora_id
            self.adapters.end_load(module, loaded)
        if not loaded:
            raise BadRequest(f"LoRA adapter {name} ({module.path}): the engine did not load it")

    async def unload_adapter(self, name: str) -> None:
        """The engine drops the adapter (``remove_lora``); 409 while requests use it."""
        self.adapters.begin_unload(name)
        await self.engine.remove_lora(self.lora_ids.pop(name))

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, adapter: str | None = None
    ) -> AsyncIterator[list[ChoiceDelta]]:
        self.check_request(prompt_ids, params, adapter)
        request_id = uuid.uuid4().hex
        self.adapters.acquire(adapter)  # not unloaded while in use
        stream = self.engine.generate(
            compat.TokensPrompt(prompt_token_ids=prompt_ids),
            to_vllm_params(params),
            request_id,
            lora_request=self.lora_request(adapter),
            **self.reasoning(params.constraint),
        )
        copies = params.n if params.greedy else 1
        seen: dict[int, ChoiceDelta] = {}  # each choice so far: all its text and token ids
        finished = False
        generated = 0
        try:
            async for output in stream:
                deltas = [self._delta(c, params, seen) for c in output.outputs]
                if params.prompt_logprobs is not None and output.prompt_logprobs:
                    scored = to_prompt_logprobs(
                        prompt_ids, output.prompt_logprobs, params.prompt_logprobs
                    )
                    for delta in deltas:
                        delta.prompt_logprobs = scored
                generated += max((len(d.token_ids) for d in deltas), default=0)
                yield (
                    [replace(d, index=i) for d in deltas for i in range(copies)]
                    if copies > 1
                    else deltas
                )
                finished = output.finished
        except compat.EngineDeadError:
            finished = True  # nothing left to abort
            raise EngineDied(ENGINE_DIED) from None
        finally:
            self.adapters.release(adapter)
            if not finished:  # the consumer left: free the engine's slot at once
                await self.engine.abort(request_id)
                logger.info("generation cancelled (client gone) after %d tokens", generated)

    def reasoning(self, constraint: Constraint | None) -> dict[str, Any]:
        """What the engine's reasoning parser (``--reasoning-parser``) needs to start a
        structured output's grammar where the transformers backend starts it, as vLLM's own
        server tells it: after the reasoning where the request's model thinks (the parser
        made with the request's ``chat_template_kwargs``), from the first token where it
        does not."""
        if constraint is None or self.config.reasoning_parser is None:
            return {}
        if constraint.after is None:
            return {"reasoning_ended": True}
        kwargs = json.loads(constraint.thinking or "{}")
        return {
            "reasoning_ended": False,
            "reasoning_parser_kwargs": {"chat_template_kwargs": kwargs},
        }

    def _delta(
        self, completion: Any, params: SamplingParams, seen: dict[int, ChoiceDelta]
    ) -> ChoiceDelta:
        logprobs = None
        if params.logprobs is not None and completion.logprobs:
            positions = zip(completion.token_ids, completion.logprobs, strict=True)
            logprobs = to_logprobs(positions, params.logprobs)
        reason = FINISH_REASONS.get(completion.finish_reason) if completion.finish_reason else None
        delta = ChoiceDelta(
            completion.index, completion.text, list(completion.token_ids), logprobs, reason
        )
        so_far = seen.setdefault(delta.index, ChoiceDelta(delta.index, "", []))
        so_far.text += delta.text
        so_far.token_ids += delta.token_ids
        if reason is not None and not isinstance(completion.stop_reason, str):
            delta.text += self._held_back(so_far, params)
        return delta

    def _held_back(self, choice: ChoiceDelta, params: SamplingParams) -> str:
        """What vLLM keeps back at the end of a text that stops inside a multi-byte character
        (the replacement characters the transformers backend emits too): same text on both."""
        full = self.tokenizer.decode(
            choice.token_ids,
            skip_special_tokens=params.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )
        if isinstance(full, str) and full.startswith(choice.text):
            return full[len(choice.text) :]
        return ""
