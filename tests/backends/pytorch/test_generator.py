"""The transformers generation backend against transformers itself: greedy tokens equal
``model.generate``, logprobs equal the model's log-softmax; finish reasons, per-row stops,
sampling seeds, penalties, cancellation and threading."""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from huggingfaceserver.backends.pytorch.generator import (
    model_context_length,
)
from huggingfaceserver.backends.pytorch.threads import (
    LoopThreads,
    TunedLoopThreads,
    decode_bucket,
    prefill_bucket,
)
from huggingfaceserver.errors import BadRequest, StartupError
from huggingfaceserver.generation.params import SamplingParams

from .generation_helpers import (
    MAX_TOKENS,
    PROMPTS,
    forward_calls,
    forward_shapes,
    load,
    prompt,
    reference_greedy,
    reference_logprobs,
    run,
    wait_until_idle,
)


@pytest.mark.parametrize("name", ["gpt2", "llama", "t5"])
@pytest.mark.parametrize("text", PROMPTS)
async def test_greedy_equals_model_generate(backends, name: str, text: str) -> None:
    backend = backends(name, sharp=name != "llama")
    prompt_ids = prompt(backend, text)
    expected = reference_greedy(backend, prompt_ids, MAX_TOKENS)
    assert len(set(expected)) > 1  # not one token repeated
    (choice,) = await run(backend, prompt_ids, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    assert choice.token_ids == expected
    ended_on_eos = len(expected) < MAX_TOKENS or expected[-1] in backend.eos_token_ids
    assert choice.finish_reason == ("stop" if ended_on_eos else "length")
    assert choice.text == backend.tokenizer.decode(expected, skip_special_tokens=True)


@pytest.mark.parametrize("name", ["gpt2", "llama", "t5"])
async def test_logprobs_are_the_models(backends, name: str) -> None:
    backend = backends(name)
    prompt_ids = prompt(backend)
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=6, logprobs=3, ignore_eos=True)
    (choice,) = await run(backend, prompt_ids, params)
    expected = reference_logprobs(backend, prompt_ids, choice.token_ids)
    assert [lp.token_id for lp in choice.logprobs] == choice.token_ids
    for position, (token, reported) in enumerate(
        zip(choice.token_ids, choice.logprobs, strict=True)
    ):
        assert reported.logprob == pytest.approx(float(expected[position, token]), abs=1e-4)
        top_values, top_ids = expected[position].topk(3)
        assert [t for t, _ in reported.top] == top_ids.tolist()
        assert [lp for _, lp in reported.top] == pytest.approx(top_values.tolist(), abs=1e-4)


async def test_no_logprobs_unless_asked(backends) -> None:
    backend = backends("llama")
    (choice,) = await run(backend, prompt(backend), SamplingParams(max_tokens=3))
    assert choice.logprobs == []


async def test_seeded_sampling(backends) -> None:
    backend = backends("llama")
    prompt_ids = prompt(backend)
    rng_before = torch.get_rng_state()

    async def text(seed: int | None) -> str:
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=16, ignore_eos=True)
        return (await run(backend, prompt_ids, params))[0].text

    assert await text(1) == await text(1)
    assert await text(1) != await text(2)
    assert await text(None) != await text(None)
    assert torch.equal(torch.get_rng_state(), rng_before)


async def test_n_choices(backends) -> None:
    backend = backends("llama")
    greedy = SamplingParams(n=3, temperature=0, max_tokens=8)
    choices = await run(backend, prompt(backend), greedy)
    assert len(choices) == 3
    assert len({c.text for c in choices}) == 1
    sampled = SamplingParams(n=3, seed=0, max_tokens=8, ignore_eos=True)
    assert len({c.text for c in await run(backend, prompt(backend), sampled)}) == 3


@pytest.mark.parametrize("name", ["llama", "t5"])
async def test_a_stop_string_stops_only_its_choice(backends, name: str) -> None:
    backend = backends(name)
    prompt_ids = prompt(backend)
    params = SamplingParams(n=4, seed=3, max_tokens=16, ignore_eos=True, skip_special_tokens=False)
    free = await run(backend, prompt_ids, params)
    text = free[0].text
    # three characters from the second half of choice 0 that choice 1 never produced
    stop = next(
        text[i : i + 3]
        for i in range(len(text) // 2, len(text) - 3)
        if "\ufffd" not in text[i : i + 3] and text[i : i + 3] not in free[1].text
    )
    stopped = await run(backend, prompt_ids, replace(params, stop=(stop,)))
    assert stopped[0].finish_reason == "stop"
    assert stopped[0].text == text[: text.index(stop)]
    assert len(stopped[0].token_ids) < 16
    assert stopped[1].finish_reason == "length"
    assert stopped[1].text == free[1].text
    for before, after in zip(free, stopped, strict=True):
        assert stop not in after.text
        if after.finish_reason == "length":
            assert after.token_ids == before.token_ids


async def test_max_tokens_gives_length(backends) -> None:
    backend = backends("gpt2")
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    (choice,) = await run(backend, prompt(backend), params)
    assert len(choice.token_ids) == 5
    assert choice.finish_reason == "length"


async def test_the_context_limit_gives_length(backends) -> None:
    backend = backends("llama")
    prompt_ids = (prompt(backend) * 40)[: backend.max_model_len - 3]
    params = SamplingParams(temperature=0, ignore_eos=True)
    (choice,) = await run(backend, prompt_ids, params)
    assert len(choice.token_ids) == 3
    assert choice.finish_reason == "length"


@pytest.mark.parametrize("name", ["gpt2", "llama", "t5"])
async def test_eos_gives_stop(backends, name: str) -> None:
    backend = backends(name)
    eos = backend.tokenizer.eos_token_id
    params = SamplingParams(temperature=0, max_tokens=10, logit_bias={eos: 100.0})
    (choice,) = await run(backend, prompt(backend), params)
    assert choice.token_ids == [eos]
    assert choice.text == ""
    assert choice.finish_reason == "stop"


async def test_min_tokens_holds_eos_back(backends) -> None:
    backend = backends("llama")
    eos = backend.tokenizer.eos_token_id
    params = SamplingParams(temperature=0, max_tokens=10, min_tokens=4, logit_bias={eos: 100.0})
    (choice,) = await run(backend, prompt(backend), params)
    assert len(choice.token_ids) == 5
    assert eos not in choice.token_ids[:4]
    assert choice.token_ids[4] == eos
    assert choice.finish_reason == "stop"


async def test_ignore_eos_makes_eos_a_regular_token(backends) -> None:
    backend = backends("llama")
    eos = backend.tokenizer.eos_token_id
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logit_bias={eos: 100.0})
    (choice,) = await run(backend, prompt(backend), params)
    assert choice.token_ids == [eos] * 4
    assert choice.finish_reason == "length"


async def test_stop_token_ids(backends) -> None:
    backend = backends("llama")
    prompt_ids = prompt(backend)
    expected = reference_greedy(backend, prompt_ids, MAX_TOKENS)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=(expected[3],))
    (choice,) = await run(backend, prompt_ids, params)
    assert choice.token_ids == expected[: expected.index(expected[3]) + 1]
    assert choice.finish_reason == "stop"


async def test_logit_bias_forces_a_token(backends) -> None:
    backend = backends("llama")
    token = prompt(backend, " Paris")[-1]
    params = SamplingParams(temperature=0, max_tokens=5, logit_bias={token: 100.0})
    (choice,) = await run(backend, prompt(backend), params)
    assert choice.token_ids == [token] * 5


@pytest.mark.parametrize("penalty", ["presence_penalty", "frequency_penalty"])
async def test_penalties_stop_repetition(backends, penalty: str) -> None:
    backend = backends("gpt2")  # greedily repeats one token
    prompt_ids = prompt(backend)
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    (repeating,) = await run(backend, prompt_ids, plain)
    assert len(set(repeating.token_ids)) == 1
    penalized = replace(plain, **{penalty: 100.0})
    (choice,) = await run(backend, prompt_ids, penalized)
    assert len(set(choice.token_ids)) == 8


async def test_repetition_penalty_equals_model_generate(backends) -> None:
    backend = backends("gpt2")
    prompt_ids = prompt(backend)
    with torch.no_grad():
        output = backend.model.generate(
            torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=8, repetition_penalty=5.0
        )
    params = SamplingParams(temperature=0, max_tokens=8, repetition_penalty=5.0)
    (choice,) = await run(backend, prompt_ids, params)
    assert choice.token_ids == output[0, len(prompt_ids) :].tolist()


async def test_closing_the_stream_stops_the_decode_loop(backends) -> None:
    backend = backends("llama")

    def slow_down(*_) -> None:
        threading.Event().wait(0.01)

    slow = backend.model.register_forward_pre_hook(slow_down)
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    try:
        with forward_calls(backend) as calls:
            stream = backend.generate(prompt(backend), params)
            received = [await anext(stream), await anext(stream)]
            await stream.aclose()
            assert await asyncio.to_thread(wait_until_idle, backend)
    finally:
        slow.remove()
    assert len(received) == 2
    assert len(calls) <= 2 + 3  # prefill + one step, then at most a few more


async def test_concurrent_generations_and_no_torch_on_the_event_loop(backends) -> None:
    backend = backends("llama")
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [prompt(backend, text) for text in PROMPTS]
    alone = [await run(backend, ids, params) for ids in prompts]
    with forward_calls(backend) as calls:
        together = await asyncio.gather(*(run(backend, ids, params) for ids in prompts))
    assert [c[0].token_ids for c in together] == [c[0].token_ids for c in alone]
    assert all(c[0].finish_reason == "length" for c in together)
    assert calls and threading.get_ident() not in calls


async def test_bad_requests(backends) -> None:
    backend = backends("gpt2")
    too_long = [1] * backend.max_model_len
    for prompt_ids, params in [
        ([], SamplingParams()),
        (too_long, SamplingParams()),
        ([1, 2], SamplingParams(logit_bias={10**6: 1.0})),
    ]:
        with pytest.raises(BadRequest):
            await run(backend, prompt_ids, params)


def test_context_length(tiny_models: dict[str, Path], backends) -> None:
    assert backends("gpt2").max_model_len == 128  # n_positions
    t5 = backends("t5")
    assert t5.is_encoder_decoder and t5.max_model_len == 128  # the tokenizer's limit
    assert not backends("llama").is_encoder_decoder
    assert load(tiny_models["llama"], "--max_model_len", "64").max_model_len == 64
    with pytest.raises(StartupError, match="exceeds"):
        load(tiny_models["llama"], "--max_model_len", "129")
    unlimited = SimpleNamespace(model_max_length=int(1e30))
    assert model_context_length(t5.model.config, unlimited) == 512  # type: ignore[arg-type]


def test_an_encoder_task_is_refused(tiny_models: dict[str, Path]) -> None:
    with pytest.raises(StartupError, match="not a generation task"):
        load(tiny_models["bert_fill_mask"])


async def test_threads_are_calibrated_on_decode_steps(tiny_models, monkeypatch, caplog) -> None:
    """A decoder-only model's thread calibration times decode steps of a full batch over a
    prompt's cache, off the running batch: the loop serves as before afterwards."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    backend = load(tiny_models["llama"], "--max_batch_size", "4")
    threads = torch.get_num_threads()
    backend.batcher.run_on_loop(lambda: torch.set_num_threads(2))  # earlier tests may set 1
    try:
        with forward_shapes(backend) as shapes, caplog.at_level(logging.INFO):
            backend.tune()
        assert "ms on 1 thread" in caplog.text
        assert shapes[0][0] == 1 and shapes[0][1] > 1  # the prompt
        assert set(shapes[1:]) == {(4, 1)}  # then decode steps of 4 rows
        assert backend.batcher.running_rows == 0
        ids = prompt(backend)
        (choice,) = await run(backend, ids, SamplingParams(temperature=0, max_tokens=6))
        until_eos = reference_greedy(backend, ids, 6)
        assert choice.token_ids[: len(until_eos)] == until_eos
        # its forwards were timed again while serving (alternating thread counts): same tokens
        loop_threads = backend.batcher.threads
        assert isinstance(loop_threads, TunedLoopThreads)
        assert decode_bucket(1) in loop_threads.buckets
        assert prefill_bucket(len(ids)) in loop_threads.buckets
    finally:
        backend.batcher.run_on_loop(lambda: torch.set_num_threads(threads))
        torch.set_num_threads(threads)
        backend.shutdown()


def test_threads_set_by_the_environment_stay_as_they_are(tiny_models, monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    backend = load(tiny_models["llama"], "--max_batch_size", "4")
    try:
        backend.tune()
        assert type(backend.batcher.threads) is LoopThreads
    finally:
        backend.shutdown()
