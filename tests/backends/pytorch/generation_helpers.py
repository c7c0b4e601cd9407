"""Shared by the tests of the transformers generation backend: loading, running a request to
its choices, and transformers' own results to compare with."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from huggingfaceserver.backends.pytorch.generator import TransformersGenerator
from huggingfaceserver.cli import parse_args
from huggingfaceserver.generation.params import ChoiceDelta, SamplingParams, TokenLogprob
from huggingfaceserver.loading import load_source

from ...openai_checks import model_log_softmax

PROMPTS = [
    "Hello world",
    "A man is eating a piece of bread.",
    "Translate English to German: the house is wonderful.",
]
MAX_TOKENS = 12


@dataclass
class Choice:
    """One choice put back together from its deltas."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    deltas: int = 0


def load(path: Path, *flags: str) -> TransformersGenerator:
    config = parse_args(["--model_dir", str(path), *flags])
    backend = TransformersGenerator(load_source(config), config)
    backend.load()
    return backend


async def run(
    backend: TransformersGenerator,
    prompt_ids: list[int],
    params: SamplingParams,
    adapter: str | None = None,
) -> list[Choice]:
    choices = [Choice() for _ in range(params.n)]
    async for deltas in backend.generate(prompt_ids, params, adapter):
        for delta in deltas:
            check_delta(choices[delta.index], delta)
    return choices


def check_delta(choice: Choice, delta: ChoiceDelta) -> None:
    assert choice.finish_reason is None, "a delta after the choice finished"
    choice.text += delta.text
    choice.token_ids += delta.token_ids
    choice.logprobs += delta.logprobs or []
    choice.finish_reason = delta.finish_reason
    choice.deltas += 1


def prompt(backend: TransformersGenerator, text: str = PROMPTS[0]) -> list[int]:
    return backend.tokenizer(text).input_ids


def reference_greedy(backend: TransformersGenerator, prompt_ids: list[int], k: int) -> list[int]:
    """``model.generate`` greedy: the new tokens, up to and with the EOS if it came."""
    with torch.no_grad():
        output = backend.model.generate(
            torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=k
        )[0].tolist()
    new = output[1:] if backend.is_encoder_decoder else output[len(prompt_ids) :]
    return new[:k]


def reference_logprobs(
    backend: TransformersGenerator, prompt_ids: list[int], output_ids: list[int]
) -> torch.Tensor:
    """The model's log-softmax at each generated position: ``[len(output_ids), vocab]``."""
    return model_log_softmax(backend.model, prompt_ids, output_ids)


@contextmanager
def forward_calls(backend: TransformersGenerator) -> Iterator[list[int]]:
    """The thread id of every model forward call made inside the block."""
    threads: list[int] = []
    handle = backend.model.register_forward_hook(lambda *_: threads.append(threading.get_ident()))
    try:
        yield threads
    finally:
        handle.remove()


@contextmanager
def forward_batch_sizes(backend: TransformersGenerator) -> Iterator[list[int]]:
    """The batch size (rows) of every model forward call made inside the block."""
    sizes: list[int] = []

    def record(_module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", kwargs.get("decoder_input_ids"))
        sizes.append(int(ids.shape[0]))

    handle = backend.model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        yield sizes
    finally:
        handle.remove()


@contextmanager
def forward_shapes(backend: TransformersGenerator) -> Iterator[list[tuple[int, int]]]:
    """The (rows, positions) of every model forward call's input ids inside the block."""
    shapes: list[tuple[int, int]] = []

    def record(_module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", kwargs.get("decoder_input_ids"))
        shapes.append((int(ids.shape[0]), int(ids.shape[1])))

    handle = backend.model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        yield shapes
    finally:
        handle.remove()


def wait_until_idle(backend: TransformersGenerator, timeout: float = 10.0) -> bool:
    """Wait until the backend's decode loop has no request left; False on timeout."""
    deadline = time.monotonic() + timeout
    batcher = backend.batcher
    while batcher.running_rows or batcher.waiting:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True
