"""What a generative model refuses in a request, the same on every backend
(:meth:`.backends.base.GenerationBackend.check_request`): checked where the request arrives (a
400 before a stream starts) and again where it decodes."""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

from ..errors import BadRequest
from .params import SamplingParams

if TYPE_CHECKING:  # llguidance: only where a constraint is compiled
    from .constraints import LazyGrammars


def check_generation_request(
    prompt_ids: list[int],
    params: SamplingParams,
    adapter: str | None,
    adapters: Collection[str],
    max_model_len: int,
    vocab_size: int,
    is_encoder_decoder: bool,
    grammars: LazyGrammars,
    kv_cache_tokens: int | None = None,
) -> None:
    """What the model refuses (the protocol layer should have caught most of it), an invalid
    structured-output constraint included; ``adapters``: the LoRA adapters served;
    ``kv_cache_tokens``: the KV cache budget that ``n`` > 1 choices must fit in together (their
    rows cannot leave the batch to go on later, as one choice's can), None: no bound."""
    if adapter is not None and adapter not in adapters:
        raise BadRequest(f"unknown LoRA adapter {adapter!r}")
    if not prompt_ids:
        raise BadRequest("the prompt is empty")
    if len(prompt_ids) >= max_model_len:
        raise BadRequest(
            f"This model's maximum context length is {max_model_len} tokens; "
            f"the prompt has {len(prompt_ids)}, leaving no room for a completion"
        )
    if params.n < 1 or (params.max_tokens is not None and params.max_tokens < 1):
        raise BadRequest("n and max_tokens must be at least 1")
    if kv_cache_tokens is not None and params.n > 1:
        reach = len(prompt_ids) + params.answer_tokens(len(prompt_ids), max_model_len)
        if params.n * reach > kv_cache_tokens:
            raise BadRequest(
                f"n={params.n} choices of up to {reach} tokens each (the prompt and "
                f"max_tokens) need {params.n * reach} tokens of KV cache together; the server's "
                f"budget holds {kv_cache_tokens}: lower n or max_tokens"
            )
    ids = {*prompt_ids, *params.logit_bias, *params.stop_token_ids}
    outside = sorted(i for i in ids if not 0 <= i < vocab_size)
    if outside:
        raise BadRequest(f"token ids outside the vocabulary (0-{vocab_size - 1}): {outside}")
    if params.prompt_logprobs is not None and is_encoder_decoder:
        raise BadRequest(
            "prompt_logprobs needs a decoder-only model: a sequence-to-sequence model's "
            "prompt is its encoder's input, which it does not predict"
        )
    if params.constraint is not None:
        grammars.get().grammar(params.constraint)  # compiled and checked once, then cached
