"""One request check for every generation backend (generation/checks.py, through
``GenerationBackend.check_request``): each refusal with its message, the vLLM backend's on top
of it (vLLM's own parameter checks), and no backend with a check of its own besides."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from huggingfaceserver.backends.base import GenerationBackend
from huggingfaceserver.backends.pytorch.generator import TransformersGenerator
from huggingfaceserver.errors import BadRequest
from huggingfaceserver.generation.constraints import Grammars, LazyGrammars
from huggingfaceserver.generation.params import ChoiceDelta, Constraint, SamplingParams
from huggingfaceserver.topology.engine.backend import EngineGenerator


class Checked(GenerationBackend):
    """A backend that generates nothing: what it refuses is the shared check."""

    name = "checked"

    def __init__(self, grammars: Grammars, encoder_decoder: bool = False):
        self.max_model_len = 8
        self.vocab_size = 100
        self.adapters = {"sql": object()}
        self.is_encoder_decoder = encoder_decoder
        self.grammars = LazyGrammars(lambda: grammars)

    def load(self) -> None:
        pass

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, adapter: str | None = None
    ) -> AsyncIterator[list[ChoiceDelta]]:
        yield []


@pytest.fixture
def backend(grammars: Grammars) -> Checked:
    return Checked(grammars)


def test_a_request_the_model_can_serve_passes(backend):
    backend.check_request([1, 2, 3], SamplingParams(max_tokens=5, logit_bias={99: 1.0}), "sql")
    constrained = SamplingParams(constraint=Constraint("regex", "[ab]+"))
    backend.check_request([1, 2], constrained)


@pytest.mark.parametrize(
    ("prompt", "params", "adapter", "message"),
    [
        ([1], SamplingParams(), "nope", "unknown LoRA adapter 'nope'"),
        ([], SamplingParams(), None, "the prompt is empty"),
        (
            list(range(8)),
            SamplingParams(),
            None,
            "This model's maximum context length is 8 tokens; the prompt has 8, leaving no "
            "room for a completion",
        ),
        ([1], SamplingParams(n=0), None, "n and max_tokens must be at least 1"),
        ([1], SamplingParams(max_tokens=0), None, "n and max_tokens must be at least 1"),
        ([1, 100], SamplingParams(), None, "token ids outside the vocabulary (0-99): [100]"),
        (
            [1],
            SamplingParams(logit_bias={-1: 1.0}, stop_token_ids=[200]),
            None,
            "token ids outside the vocabulary (0-99): [-1, 200]",
        ),
        ([1], SamplingParams(constraint=Constraint("regex", "(unclosed")), None, "invalid regex"),
    ],
)
def test_each_refusal_is_a_400_with_its_message(backend, prompt, params, adapter, message):
    with pytest.raises(BadRequest) as refused:
        backend.check_request(prompt, params, adapter)
    assert message in str(refused.value)


def test_n_choices_must_fit_in_the_kv_cache_budget_together(backend):
    """Their rows cannot leave the batch to go on later: ``n`` times the most each may reach
    (the prompt and max_tokens, at most the context) must fit in the budget."""
    backend.kv_cache_tokens = 10
    backend.check_request([1, 2], SamplingParams(n=2, max_tokens=3))  # 2 x 5
    backend.check_request([1, 2], SamplingParams(n=1))  # one choice can leave
    with pytest.raises(BadRequest, match="n=2 choices of up to 6 tokens each"):
        backend.check_request([1, 2], SamplingParams(n=2, max_tokens=4))
    with pytest.raises(BadRequest, match="n=2 choices of up to 8 tokens each .* 16 tokens"):
        backend.check_request([1, 2], SamplingParams(n=2))  # up to the context


def test_prompt_logprobs_need_a_decoder_only_model(grammars):
    params = SamplingParams(prompt_logprobs=1)
    Checked(grammars).check_request([1, 2], params)
    with pytest.raises(BadRequest, match="prompt_logprobs needs a decoder-only model"):
        Checked(grammars, encoder_decoder=True).check_request([1, 2], params)


@pytest.mark.parametrize("backend_class", [TransformersGenerator, EngineGenerator])
def test_the_backends_check_is_the_shared_one(backend_class):
    assert backend_class.check_request is GenerationBackend.check_request


@pytest.mark.vllm
def test_vllm_checks_the_shared_check_then_its_own_parameters(grammars):
    pytest.importorskip("vllm")
    from huggingfaceserver.backends.vllm.generation import VLLMGenerator

    backend: Any = VLLMGenerator.__new__(VLLMGenerator)  # what check_request reads, no engine
    checked = Checked(grammars)
    for name in ("max_model_len", "vocab_size", "adapters", "is_encoder_decoder", "grammars"):
        setattr(backend, name, getattr(checked, name))
    with pytest.raises(BadRequest, match="the prompt is empty"):
        backend.check_request([], SamplingParams())
    with pytest.raises(BadRequest, match=r"outside the vocabulary \(0-99\): \[100\]"):
        backend.check_request([100], SamplingParams())
    with pytest.raises(BadRequest, match="min_p"):  # vLLM's own check, after the shared one
        backend.check_request([1], SamplingParams(min_p=2.0))
    backend.check_request([1, 2], SamplingParams(max_tokens=4), "sql")
