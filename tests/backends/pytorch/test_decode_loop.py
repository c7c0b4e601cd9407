"""Continuous batching in the transformers generation backend: requests that arrive while
others run join their decode batch, each keeps its own settings, and every output equals the
same request run alone (greedy tokens identical, logprobs within 1e-4)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY

from huggingfaceserver.backends.pytorch.decode_loop import (
    PADDING_LIMIT,
    SCORED_GROUP_TOKENS,
    DecodeRequest,
    prefill_groups,
)
from huggingfaceserver.backends.pytorch.generator import TransformersGenerator
from huggingfaceserver.backends.pytorch.ragged import MIXED
from huggingfaceserver.backends.pytorch.sequence import SequenceState
from huggingfaceserver.backends.pytorch.step_graphs import StepGraphs, eager
from huggingfaceserver.errors import NotReady, ServerError
from huggingfaceserver.generation.params import SamplingParams, TokenLogprob
from huggingfaceserver.observability.metrics import ENGINE_LABEL
from huggingfaceserver.observability.syncs import SyncCounter

from .generation_helpers import (
    PROMPTS,
    Choice,
    check_delta,
    forward_batch_sizes,
    forward_shapes,
    load,
    prompt,
    reference_greedy,
    run,
    wait_until_idle,
)

Prompted = tuple[list[int], SamplingParams]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@contextmanager
def slow_forward(backend: TransformersGenerator, seconds: float = 0.005) -> Iterator[None]:
    """Every forward takes a little longer, so that later requests reliably find earlier ones
    still running."""

    def wait(*_) -> None:
        threading.Event().wait(seconds)

    handle = backend.model.register_forward_pre_hook(wait)
    try:
        yield
    finally:
        handle.remove()


async def staggered(
    backend: TransformersGenerator, requests: list[Prompted], after: int = 2
) -> list[list[Choice]]:
    """Run the requests, each started once the one before has received ``after`` steps."""
    started = [asyncio.Event() for _ in requests]

    async def one(i: int, prompt_ids: list[int], params: SamplingParams) -> list[Choice]:
        if i:
            await started[i - 1].wait()
        choices = [Choice() for _ in range(params.n)]
        received = 0
        try:
            async for deltas in backend.generate(prompt_ids, params):
                for delta in deltas:
                    check_delta(choices[delta.index], delta)
                received += 1
                if received == after:
                    started[i].set()
        finally:
            started[i].set()
        return choices

    return await asyncio.gather(*(one(i, *request) for i, request in enumerate(requests)))


@asynccontextmanager
async def admitted_together(backend: TransformersGenerator) -> AsyncIterator[None]:
    """Requests started in the block reach the decode loop's queue before it admits any of
    them: the block holds the loop's lock (reentrant, so ``submit`` from this thread passes)
    until every task started in it has submitted."""
    with backend.batcher.wake:
        yield
        await asyncio.sleep(0.05)


async def alone(backend: TransformersGenerator, requests: list[Prompted]) -> list[list[Choice]]:
    return [await run(backend, *request) for request in requests]


def tokens(results: list[list[Choice]]) -> list[list[list[int]]]:
    return [[choice.token_ids for choice in choices] for choices in results]


def assert_same_choices(together: list[list[Choice]], expected: list[list[Choice]]) -> None:
    """Each request's choices as expected: tokens, texts, finish reasons, the logprobs' tokens
    (and their top tokens) and values within 1e-4."""
    assert tokens(together) == tokens(expected)
    for got, want in zip(together, expected, strict=True):
        assert [c.text for c in got] == [c.text for c in want]
        assert [c.finish_reason for c in got] == [c.finish_reason for c in want]
        for mine, theirs in zip(got, want, strict=True):
            assert [lp.token_id for lp in mine.logprobs] == [lp.token_id for lp in theirs.logprobs]
            for a, b in zip(mine.logprobs, theirs.logprobs, strict=True):
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
                assert [t for t, _ in a.top] == [t for t, _ in b.top]


@pytest.mark.parametrize("name", ["llama", "gpt2"])
async def test_late_requests_join_the_batch_and_greedy_is_unchanged(backends, name) -> None:
    backend = backends(name, sharp=name == "gpt2")
    requests = [(prompt(backend, text), GREEDY) for text in reversed(PROMPTS)]
    expected = await alone(backend, requests)
    with slow_forward(backend), forward_batch_sizes(backend) as sizes:
        together = await staggered(backend, requests)
    assert tokens(together) == tokens(expected)
    for (prompt_ids, _), choices in zip(requests, together, strict=True):
        until_eos = reference_greedy(backend, prompt_ids, GREEDY.max_tokens or 0)
        assert choices[0].token_ids[: len(until_eos)] == until_eos
    assert max(sizes) == len(requests)  # all three decoded in one forward at some point
    assert all(choices[0].finish_reason == "length" for choices in together)


@contextmanager
def packed_prompts(backend: TransformersGenerator) -> Iterator[tuple[list[int], list[int]]]:
    """The prompt lengths fed in decode steps (packed forwards), and the widths of the
    forwards that ran a prompt on its own, inside the block."""
    packed: list[int] = []
    apart: list[int] = []

    def record(_module, _args, kwargs) -> None:
        if MIXED in kwargs:
            packed.extend(kwargs[MIXED].columns.lengths)
        elif kwargs["input_ids"].shape[1] > 1:
            apart.append(int(kwargs["input_ids"].shape[1]))

    handle = backend.model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        yield packed, apart
    finally:
        handle.remove()


@pytest.mark.parametrize("name", ["llama", "gpt2"])
async def test_requests_that_arrive_while_others_decode_are_fed_in_their_step(
    backends, name
) -> None:
    backend = backends(name, sharp=name == "gpt2")
    requests = [(prompt(backend, text), GREEDY) for text in reversed(PROMPTS)]
    expected = await alone(backend, requests)
    with slow_forward(backend), packed_prompts(backend) as (packed, apart):
        together = await staggered(backend, requests)
    assert tokens(together) == tokens(expected)
    assert packed == [len(ids) for ids, _ in requests[1:]]
    assert apart == [len(requests[0][0])]  # only the first, which found nothing running


async def test_a_request_for_several_choices_is_fed_in_a_step_and_keeps_its_seeds(
    backends,
) -> None:
    """Its prompt runs once, its rows are copies of it; each seeded choice samples what it
    samples alone."""
    backend = backends("llama")
    sampled = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, n=3, seed=11)
    requests = [(prompt(backend, PROMPTS[2]), GREEDY), (prompt(backend, PROMPTS[1]), sampled)]
    expected = await alone(backend, requests)
    with slow_forward(backend), packed_prompts(backend) as (packed, apart):
        together = await staggered(backend, requests)
    assert tokens(together) == tokens(expected)
    assert len({tuple(ids) for ids in tokens(together)[1]}) > 1  # the choices differ
    assert packed == [len(requests[1][0])]
    assert apart == [len(requests[0][0])]


async def test_a_packed_step_that_fails_runs_its_prompts_apart_and_every_request_goes_on(
    backends, caplog
) -> None:
    backend = backends("llama")
    failed = threading.Event()

    def fail_once_packed(_module, _args, kwargs) -> None:
        if MIXED in kwargs and not failed.is_set():
            failed.set()
            raise RuntimeError("out of memory")

    requests = [(prompt(backend, text), GREEDY) for text in PROMPTS]
    expected = await alone(backend, requests)
    hook = backend.model.register_forward_pre_hook(fail_once_packed, with_kwargs=True)
    try:
        with slow_forward(backend):
            together = await staggered(backend, requests)
    finally:
        hook.remove()
    assert failed.is_set()
    assert "running them apart" in caplog.text
    assert tokens(together) == tokens(expected)


async def test_graphed_decode_steps_give_the_tokens_eager_ones_give(backends) -> None:
    """Requests joining at different times, their steps replayed from recorded graphs (on a
    CPU: the same padded whole-buffer forward, run eagerly): the same greedy tokens."""
    backend = backends("llama")
    requests = [(prompt(backend, text), GREEDY) for text in reversed(PROMPTS)]
    expected = await alone(backend, requests)
    backend.graphs = graphs = StepGraphs(backend.max_rows, eager)
    try:
        with slow_forward(backend):
            together = await staggered(backend, requests)
    finally:
        backend.graphs = None
    assert tokens(together) == tokens(expected)
    assert graphs.recordings >= 2 and graphs.broken is None  # buckets 1 and 2 at least


async def test_a_wave_after_an_idle_spell_replays_the_graphs_recorded_before_it(
    backends,
) -> None:
    """A batch whose rows have all ended leaves its KV cache to the next one: a request after
    an idle spell runs on the same buffers and replays the graph recorded for the one before
    (none recorded again), with the tokens it gets alone; more rows than the buffers hold grow
    them, and only the new bucket is recorded."""
    backend = backends("llama")
    assert backend.graphs is None
    await check_waves_after_idle(backend, StepGraphs(backend.max_rows, eager))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_cuda_graphs_serve_a_wave_after_an_idle_spell(tiny_models) -> None:
    backend = load(tiny_models["llama"], "--dtype", "float32")
    try:
        graphs = backend.graphs
        assert backend.device.type == "cuda" and graphs is not None
        backend.graphs = None
        await check_waves_after_idle(backend, graphs)
    finally:
        backend.shutdown()


async def check_waves_after_idle(backend: TransformersGenerator, graphs: StepGraphs) -> None:
    """Requests one after another, with ``graphs`` and without: the same tokens; the graphs
    recorded for the first serve the next ones, over the same cache."""
    first, second = prompt(backend, PROMPTS[2]), prompt(backend, PROMPTS[0])
    sampled = SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    requests: list[Prompted] = [
        (first, GREEDY),
        (second, replace(GREEDY, max_tokens=9)),
        (second, sampled),
        (first, replace(sampled, n=3)),
    ]
    expected = await alone(backend, requests)
    assert backend.idle_cache is None  # no graphs: nothing kept
    backend.graphs = graphs

    def kept():  # read on the decode thread, once the step that ended the wave is done
        return backend.batcher.run_on_loop(lambda: backend.idle_cache)

    try:
        waves = [await run(backend, *requests[0])]
        cache = kept()
        assert cache is not None and graphs.records_over(cache)
        assert graphs.recordings == 1  # bucket 1
        for request in requests[1:3]:
            waves.append(await run(backend, *request))
            assert kept() is cache
        assert graphs.recordings == 1  # replayed, not recorded again
        waves.append(await run(backend, *requests[3]))  # three rows: bucket 4, wider buffers
        assert kept() is cache and graphs.records_over(cache)
        assert graphs.recordings == 2
        assert graphs.broken is None
    finally:
        backend.graphs = None
        backend.idle_cache = None
    assert tokens(waves) == tokens(expected)


async def test_the_kept_cache_goes_to_the_batch_that_runs(in_parts) -> None:
    """After an idle spell, a long prompt (fed in parts) and a short one admitted together: the
    short one's rows run first, on the cache kept from the wave before (whose buffers the
    recorded steps write), and the long one's rows join them there; the same tokens as each
    request alone, and the same cache kept after."""
    backend = in_parts
    short, long = prompt(backend, "Hello"), prompt(backend, PROMPTS[2])
    assert len(short) <= 4 < len(long)
    requests: list[Prompted] = [(short, replace(GREEDY, max_tokens=24)), (long, GREEDY)]
    expected = await alone(backend, requests)
    backend.graphs = graphs = StepGraphs(backend.max_rows, eager)
    try:
        await run(backend, *requests[0])
        cache = backend.batcher.run_on_loop(lambda: backend.idle_cache)
        assert cache is not None
        with forwards(backend) as seen:
            async with admitted_together(backend):
                runs = [asyncio.ensure_future(run(backend, *request)) for request in requests]
            together = await asyncio.gather(*runs)
        assert any(parts for _, _, parts in seen)  # the long prompt's parts, in steps
        assert backend.batcher.run_on_loop(lambda: backend.idle_cache) is cache
        assert graphs.broken is None
    finally:
        backend.graphs = None
        backend.idle_cache = None
    assert tokens(together) == tokens(expected)


async def test_each_request_keeps_its_own_settings(backends) -> None:
    backend = backends("llama")
    ids = [prompt(backend, text) for text in PROMPTS]
    requests: list[Prompted] = [
        (ids[0], replace(GREEDY, logprobs=2)),
        (ids[1], SamplingParams(n=2, seed=7, max_tokens=12, ignore_eos=True)),
        (ids[2], SamplingParams(temperature=0.7, top_k=20, seed=3, max_tokens=20, logprobs=0)),
        (ids[0], replace(GREEDY, n=2, presence_penalty=2.0, max_tokens=10)),
        (ids[1], SamplingParams(seed=1, top_p=0.8, repetition_penalty=1.3, max_tokens=14)),
    ]
    expected = await alone(backend, requests)
    with slow_forward(backend), forward_batch_sizes(backend) as sizes:
        together = await staggered(backend, requests)
    assert max(sizes) > 2
    assert_same_choices(together, expected)


async def test_requests_admitted_together_prefill_together_and_keep_their_settings(
    backends,
) -> None:
    backend = backends("llama")
    longer = prompt(backend, PROMPTS[2])
    shorter = longer[len(longer) // 4 :]  # within the padding limit of the longer one
    requests: list[Prompted] = [
        (shorter, replace(GREEDY, logprobs=2)),
        (shorter, SamplingParams(n=2, seed=7, max_tokens=12, ignore_eos=True)),
        (longer, SamplingParams(temperature=0.7, top_k=20, seed=3, max_tokens=20, logprobs=0)),
        (longer, replace(GREEDY, n=2, presence_penalty=2.0, max_tokens=10)),
    ]
    expected = await alone(backend, requests)
    with forward_shapes(backend) as shapes:
        async with admitted_together(backend):
            tasks = [asyncio.create_task(run(backend, *r)) for r in requests]
        together = await asyncio.gather(*tasks)
    prefills = [shape for shape in shapes if shape[1] > 1]
    assert prefills == [(len(requests), len(longer))]  # one forward, padded to the longest
    assert max(rows for rows, _ in shapes) == 6  # and their six rows step together
    assert tokens(together) == tokens(expected)
    for got, want in zip(together, expected, strict=True):
        assert [c.text for c in got] == [c.text for c in want]
        for mine, theirs in zip(got, want, strict=True):
            for a, b in zip(mine.logprobs, theirs.logprobs, strict=True):
                assert a.token_id == b.token_id
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


async def test_requests_scoring_their_prompts_prefill_together(backends) -> None:
    """Requests that score their prompts, admitted together, run their prompts in one forward
    apart from the others; each gets the prompt logprobs and tokens it gets alone."""
    backend = backends("llama")
    short, long = prompt(backend, PROMPTS[0]), prompt(backend, PROMPTS[1])
    requests: list[Prompted] = [
        (short, replace(GREEDY, prompt_logprobs=2)),
        (long, GREEDY),
        (long, replace(GREEDY, prompt_logprobs=0, n=2)),
        (long, replace(GREEDY, prompt_logprobs=1)),
    ]
    expected = [await scored_run(backend, *r) for r in requests]
    with forward_shapes(backend) as shapes:
        async with admitted_together(backend):
            tasks = [asyncio.create_task(scored_run(backend, *r)) for r in requests]
        together = await asyncio.gather(*tasks)
    assert len(long) * 3 <= PADDING_LIMIT * (2 * len(long) + len(short))  # one group
    assert sorted(shape for shape in shapes if shape[1] > 1) == [(1, len(long)), (3, len(long))]
    for (got_choices, got_scores), (want_choices, want_scores) in zip(
        together, expected, strict=True
    ):
        assert tokens([got_choices]) == tokens([want_choices])
        assert (got_scores is None) == (want_scores is None)
        for got, want in zip(got_scores or [], want_scores or [], strict=True):
            if want is None:  # the first prompt token
                assert got is None
                continue
            assert got is not None
            assert (got.token_id, got.rank) == (want.token_id, want.rank)
            assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
            assert [t for t, _ in got.top] == [t for t, _ in want.top]


async def scored_run(
    backend: TransformersGenerator, prompt_ids: list[int], params: SamplingParams
) -> tuple[list[Choice], list[TokenLogprob | None] | None]:
    """:func:`run`, and the prompt logprobs the request's first deltas carry."""
    choices = [Choice() for _ in range(params.n)]
    scores = None
    async for deltas in backend.generate(prompt_ids, params):
        for delta in deltas:
            check_delta(choices[delta.index], delta)
            if delta.prompt_logprobs is not None:
                assert scores is None or scores == delta.prompt_logprobs
                scores = delta.prompt_logprobs
    return choices, scores


async def test_a_request_scoring_its_prompt_prefills_apart(backends) -> None:
    backend = backends("llama")
    ids = prompt(backend, PROMPTS[1])
    requests: list[Prompted] = [
        (ids, GREEDY),
        (ids, replace(GREEDY, prompt_logprobs=1)),
        (ids, GREEDY),
    ]
    expected = await alone(backend, requests)
    with forward_shapes(backend) as shapes:
        async with admitted_together(backend):
            tasks = [asyncio.create_task(run(backend, *r)) for r in requests]
        together = await asyncio.gather(*tasks)
    assert sorted(shape for shape in shapes if shape[1] > 1) == [(1, len(ids)), (2, len(ids))]
    assert tokens(together) == tokens(expected)


async def test_a_prompt_that_fails_a_group_prefill_fails_only_its_request(backends) -> None:
    backend = backends("llama")
    good_ids = prompt(backend, PROMPTS[1])
    poison = next(i for i in range(backend.vocab_size) if i not in good_ids)
    bad_ids = [*good_ids[:-1], poison]
    (expected,) = await run(backend, good_ids, GREEDY)

    def fail_on_poison(_module, _args, kwargs) -> None:
        ids = kwargs["input_ids"]
        if ids.shape[1] > 1 and bool((ids == poison).any()):
            raise RuntimeError("this prompt breaks the model")

    with forward_shapes(backend) as shapes:  # its hook runs first: it sees the failing call
        hook = backend.model.register_forward_pre_hook(fail_on_poison, with_kwargs=True)
        try:
            async with admitted_together(backend):
                tasks = [
                    asyncio.create_task(run(backend, good_ids, GREEDY)),
                    asyncio.create_task(run(backend, bad_ids, GREEDY)),
                ]
            results = await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            hook.remove()
    assert (2, len(good_ids)) in shapes  # tried together first, then one at a time
    assert results[0] == [expected]
    assert isinstance(results[1], RuntimeError)
    assert await asyncio.to_thread(wait_until_idle, backend)


def test_prefill_groups_bound_padding_and_keep_scoring_requests_apart() -> None:
    def request(length: int, prompt_logprobs: int | None = None) -> DecodeRequest:
        params = SamplingParams(prompt_logprobs=prompt_logprobs)
        return DecodeRequest(rows=[_row(length, params)], emit=lambda _: None)

    short, short2, mid, long = request(4), request(5), request(6), request(40)
    scoring, scoring2 = request(5, prompt_logprobs=0), request(6, prompt_logprobs=2)
    wide = SCORED_GROUP_TOKENS // 2  # two of these fill a scoring group, a third does not fit
    scoring_wide = [request(wide - i, prompt_logprobs=1) for i in range(3)]
    groups = prefill_groups([long, short, scoring, mid, *scoring_wide, short2, scoring2])
    assert groups == [
        [scoring, scoring2],
        [scoring_wide[2], scoring_wide[1]],
        [scoring_wide[0]],
        [short, short2, mid],
        [long],
    ]
    for group in groups:
        lengths = [len(r.prompt_ids) for r in group]
        assert len(lengths) * max(lengths) <= PADDING_LIMIT * sum(lengths)
        if group[0].rows[0].params.prompt_logprobs is not None:
            assert len(lengths) * max(lengths) <= SCORED_GROUP_TOKENS
    assert prefill_groups([]) == []


def _row(length: int, params: SamplingParams) -> SequenceState:
    return SequenceState(
        index=0,
        params=params,
        prompt_ids=list(range(length)),
        stop_ids=frozenset(),
        budget=8,
        generator=None,
        text=None,
    )


async def test_a_stop_string_ends_its_request_while_others_go_on(backends) -> None:
    backend = backends("llama")
    ids = prompt(backend, PROMPTS[1])
    (free,) = await run(backend, ids, GREEDY)
    stop = free.text[len(free.text) // 3 :][:2]
    requests: list[Prompted] = [
        (prompt(backend, PROMPTS[2]), GREEDY),
        (ids, replace(GREEDY, stop=(stop,))),
        (prompt(backend, PROMPTS[0]), GREEDY),
    ]
    expected = await alone(backend, requests)
    with slow_forward(backend):
        together = await staggered(backend, requests, after=1)
    assert expected[1][0].finish_reason == "stop"
    assert tokens(together) == tokens(expected)
    assert [c[0].text for c in together] == [c[0].text for c in expected]


async def test_max_batch_size_bounds_the_rows_of_a_forward(tiny_models: dict[str, Path]) -> None:
    for limit in (2, 1):
        backend = load(tiny_models["llama"], "--max_batch_size", str(limit))
        try:
            requests = [(prompt(backend, text), GREEDY) for text in PROMPTS * 2]
            requests.append((requests[0][0], replace(GREEDY, n=3)))  # more rows than the limit
            expected = await alone(backend, requests)
            with forward_batch_sizes(backend) as sizes:
                together = await asyncio.gather(*(run(backend, *r) for r in requests))
            assert tokens(together) == tokens(expected)
            assert sizes.count(3) == GREEDY.max_tokens - 1  # the n=3 request's steps
            assert {size for size in sizes if size != 3} == set(range(1, limit + 1))
        finally:
            backend.shutdown()


async def test_a_request_that_leaves_frees_its_rows(backends, caplog) -> None:
    backend = backends("llama")
    staying = (prompt(backend, PROMPTS[2]), replace(GREEDY, max_tokens=30))
    (expected,) = await run(backend, *staying)
    with slow_forward(backend), caplog.at_level(logging.INFO):
        stream = backend.generate(prompt(backend), replace(GREEDY, max_tokens=100))
        await anext(stream)
        stays = asyncio.create_task(run(backend, *staying))
        await asyncio.sleep(0.05)  # both decode together
        await stream.aclose()
        (choice,) = await stays
    assert choice.token_ids == expected.token_ids
    assert await asyncio.to_thread(wait_until_idle, backend)
    assert "generation cancelled (client gone)" in caplog.text


async def test_a_request_whose_client_leaves_while_it_waits_leaves_the_queue_at_once(
    tiny_models: dict[str, Path],
) -> None:
    """With the loop's one row taken, a request waits; its client leaves: it leaves the queue
    then, with the waiting gauge (which autoscalers read), not once the running request ends
    and it reaches the queue's head. The running request goes on to its last token."""
    backend = load(tiny_models["llama"], "--max_batch_size", "1")
    labels = {"model_name": backend.config.model_name, "engine": ENGINE_LABEL}
    try:
        with slow_forward(backend):
            running = backend.generate(prompt(backend), replace(GREEDY, max_tokens=100))
            await anext(running)
            waiting = backend.generate(prompt(backend, PROMPTS[1]), GREEDY)
            next_delta = asyncio.ensure_future(anext(waiting))
            while not backend.batcher.waiting:  # submitted, behind the running request
                await asyncio.sleep(0.001)
            assert REGISTRY.get_sample_value("vllm:num_requests_waiting", labels) == 1
            next_delta.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await next_delta
            await waiting.aclose()
            assert not backend.batcher.waiting
            assert REGISTRY.get_sample_value("vllm:num_requests_waiting", labels) == 0
            assert backend.batcher.running  # the first request still decodes
            generated = 1 + sum([len(deltas) async for deltas in running])
        assert generated == 100
    finally:
        backend.shutdown()


async def test_a_failing_prefill_fails_only_its_request(backends) -> None:
    backend = backends("llama")
    bad_ids = prompt(backend, PROMPTS[2]) * 2
    good = (prompt(backend, PROMPTS[1]), GREEDY)
    (expected,) = await run(backend, *good)

    def fail_on_bad_prompt(_module, _args, kwargs) -> None:
        if kwargs["input_ids"].shape[1] == len(bad_ids):
            raise RuntimeError("this prompt breaks the model")

    hook = backend.model.register_forward_pre_hook(fail_on_bad_prompt, with_kwargs=True)
    try:
        with slow_forward(backend):
            results = await asyncio.gather(
                run(backend, *good), run(backend, bad_ids, GREEDY), return_exceptions=True
            )
    finally:
        hook.remove()
    assert isinstance(results[1], RuntimeError)
    assert results[0] == [expected]


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
async def test_a_step_that_fails_once_is_retried_apart_and_every_request_goes_on(
    backends, caplog, graphed: bool
) -> None:
    """Each request's rows then step in a batch of their own. With recorded decode steps,
    only the first batch replays them: batches on other caches taking turns would record
    them again every step (31 recordings here before)."""
    backend = backends("llama")
    failed = threading.Event()

    def fail_once_while_decoding(_module, _args, kwargs) -> None:
        if kwargs["input_ids"].shape == (2, 1) and not failed.is_set():
            failed.set()
            raise RuntimeError("out of memory")

    requests = [(prompt(backend, text), GREEDY) for text in PROMPTS[:2]]
    expected = await alone(backend, requests)
    graphs = StepGraphs(backend.max_rows, eager)
    backend.graphs = graphs if graphed else None
    hook = backend.model.register_forward_pre_hook(fail_once_while_decoding, with_kwargs=True)
    try:
        with slow_forward(backend):
            results = await asyncio.gather(*(run(backend, *r) for r in requests))
    finally:
        hook.remove()
        backend.graphs = None
        backend.idle_cache = None
    assert failed.is_set()
    assert "retrying each apart" in caplog.text
    assert tokens(results) == tokens(expected)
    if graphed:  # bucket 2; bucket 1 after the split; over the other cache once one is left
        assert 0 < graphs.recordings <= 3 and graphs.broken is None


async def test_a_request_whose_rows_break_the_model_fails_alone(backends) -> None:
    """Every forward that holds the long request's rows past its 3rd token fails: that request
    fails, the others (admitted with it, decoded in one batch) match their solo outputs."""
    backend = backends("llama")
    long_ids = prompt(backend, PROMPTS[2]) * 2
    others = [(prompt(backend, text), GREEDY) for text in PROMPTS[:2]]
    assert all(len(ids) + 16 < len(long_ids) for ids, _ in others)
    expected = await alone(backend, others)

    def fail_past_the_long_prompt(_module, _args, kwargs) -> None:
        if int(kwargs["position_ids"].max()) >= len(long_ids) + 3:
            raise RuntimeError("this request breaks the model")

    hook = backend.model.register_forward_pre_hook(fail_past_the_long_prompt, with_kwargs=True)
    try:
        with slow_forward(backend), forward_batch_sizes(backend) as sizes:
            async with admitted_together(backend):
                runs = [
                    asyncio.ensure_future(run(backend, *r))
                    for r in [others[0], (long_ids, GREEDY), others[1]]
                ]
            results = await asyncio.gather(*runs, return_exceptions=True)
    finally:
        hook.remove()
    assert max(sizes) == 3  # they did share a batch
    assert isinstance(results[1], RuntimeError)
    assert tokens([results[0], results[2]]) == tokens(expected)
    (choice,) = await run(backend, *others[0])  # the loop goes on
    assert choice.token_ids == expected[0][0].token_ids


async def test_a_bug_outside_every_step_fails_its_requests_and_the_loop_goes_on(
    backends,
) -> None:
    """What raises in a turn outside the guards of a prefill or a step (a bug: here the
    callback that settles a new batch) ends the turn's requests with a 500 naming it, instead
    of killing the loop's thread and leaving every request waiting; the next request is
    served as before."""
    backend = backends("llama")
    request = (prompt(backend, PROMPTS[0]), GREEDY)
    (expected,) = await alone(backend, [request])
    batcher = backend.batcher
    settle = batcher.settle

    def broken(_batch) -> None:
        batcher.settle = settle  # once
        raise KeyError("a bug")

    batcher.settle = broken
    try:
        with pytest.raises(ServerError, match="the decode loop failed: KeyError"):
            await asyncio.wait_for(run(backend, *request), 60)  # not waiting for ever
    finally:
        batcher.settle = settle
    assert batcher.thread.is_alive() and not batcher.running
    (choice,) = await run(backend, *request)
    assert choice.token_ids == expected[0].token_ids


async def test_sequence_to_sequence_requests_run_concurrently(backends) -> None:
    backend = backends("t5", sharp=True)
    requests = [(prompt(backend, text), replace(GREEDY, max_tokens=10)) for text in PROMPTS]
    expected = await alone(backend, requests)
    with slow_forward(backend, 0.002):
        together = await staggered(backend, requests)
    assert tokens(together) == tokens(expected)


async def test_after_shutdown_requests_are_refused(tiny_models: dict[str, Path]) -> None:
    backend = load(tiny_models["llama"])
    backend.shutdown()
    assert not backend.batcher.thread.is_alive()
    with pytest.raises(NotReady):
        await run(backend, prompt(backend), GREEDY)
    assert torch.is_grad_enabled()


async def test_a_decode_step_waits_for_the_device_once(backends) -> None:
    """Rows of every kind admitted together: one host synchronisation per forward around the
    model (the step's tokens and logprobs), counted on the decode thread (1 on a GPU as on this
    CPU). A decode step's forward adds none (its mask comes ready-made); a prompt's adds at most
    one (transformers' SDPA mask check reads whether the padding mask is all ones)."""
    backend = backends("llama")
    counter, shapes = await waits_of_every_kind(backend)
    steps = [rows for rows, tokens in shapes if tokens == 1]
    assert max(steps) == len(EVERY_KIND) * 2
    assert len(steps) >= GREEDY.max_tokens - 1  # type: ignore[operator]
    assert counter.outside_module == len(shapes), counter.counts
    assert counter.in_module <= len(shapes) - len(steps), counter.counts


EVERY_KIND = [
    GREEDY,
    replace(GREEDY, logprobs=2, repetition_penalty=1.2),
    SamplingParams(seed=7, top_k=20, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=0.7, top_p=0.8, min_p=0.05, max_tokens=16, ignore_eos=True),
    SamplingParams(frequency_penalty=0.5, logit_bias={5: 3.0}, max_tokens=16, ignore_eos=True),
]
"""Rows of every kind of sampling, each :data:`GREEDY`'s 16 tokens."""


async def waits_of_every_kind(
    backend: TransformersGenerator,
) -> tuple[SyncCounter, list[tuple[int, int]]]:
    """Two requests of each of :data:`EVERY_KIND` submitted at once (admitted at the same
    step): the host synchronisations counted on the decode thread, and every forward's shape
    (rows, positions)."""
    ids = [prompt(backend, text) for text in PROMPTS]
    finished = threading.Semaphore(0)

    def emit(item) -> None:
        if item is None or isinstance(item, BaseException):
            assert item is None
            finished.release()

    requests = [
        DecodeRequest(backend.new_sequences(ids[i % len(ids)], params), emit)
        for i, params in enumerate(EVERY_KIND * 2)
    ]
    counter = SyncCounter()
    batcher = backend.batcher
    batcher.run_on_loop(counter.__enter__)  # the modes are the decode thread's
    with forward_shapes(backend) as shapes, counter.separating(backend.model):
        batcher.run_on_loop(lambda: [batcher.submit(request) for request in requests])
        for _ in requests:
            await asyncio.to_thread(finished.acquire)
    batcher.run_on_loop(lambda: counter.__exit__(None, None, None))
    return counter, shapes


@pytest.fixture(scope="module")
def in_parts(tiny_models: dict[str, Path]) -> Iterator[TransformersGenerator]:
    """The tiny Llama fed prompts in parts of 4 tokens."""
    backend = load(tiny_models["llama"], "--prefill_chunk_tokens", "4")
    yield backend
    backend.shutdown()


@contextmanager
def forwards(backend: TransformersGenerator) -> Iterator[list[tuple[int, int, tuple[int, ...]]]]:
    """Every model forward inside the block: (rows, positions, part tokens) of its input ids,
    the last the tokens of each prompt's part it fed in a decode step (packed forwards)."""
    seen: list[tuple[int, int, tuple[int, ...]]] = []

    def record(_module, _args, kwargs) -> None:
        rows, positions = kwargs["input_ids"].shape
        mixed = kwargs.get(MIXED)
        parts = () if mixed is None else tuple(p.tokens for p in mixed.columns.parts)
        seen.append((int(rows), int(positions), parts))

    handle = backend.model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


def in_parts_of(length: int, size: int) -> list[int]:
    whole, rest = divmod(length, size)
    return [size] * whole + ([rest] if rest else [])


async def test_a_long_prompt_is_fed_in_parts_in_the_running_rows_steps(in_parts) -> None:
    """A prompt of several parts joins a running request: each part is fed in the running
    row's decode step (one forward for both, the row stepping every turn), and both outputs
    are as each request's alone (and as ``generate``'s)."""
    backend = in_parts
    short = prompt(backend, "Hello")
    long = prompt(backend, PROMPTS[2])
    # The short request runs long enough that it is still running when the long one's parts
    # are fed, however late a busy machine lets the test start the long one.
    running = replace(GREEDY, max_tokens=256)
    assert len(short) <= 4 and len(long) > 8
    requests: list[Prompted] = [(short, running), (long, replace(GREEDY, n=2))]
    expected = await alone(backend, requests)
    with forwards(backend) as seen:
        together = await staggered(backend, requests)
    assert tokens(together) == tokens(expected)
    until_eos = reference_greedy(backend, long, GREEDY.max_tokens or 0)
    assert together[1][0].token_ids[: len(until_eos)] == until_eos
    assert seen[0] == (1, len(short), ())  # the short prompt, whole
    feeding = [forward for forward in seen[1:] if forward[1] > 1]
    assert [parts for _, _, parts in feeding] == [(n,) for n in in_parts_of(len(long), 4)]
    assert all(positions == 1 + sum(parts) for _, positions, parts in feeding)  # + the row
    first = seen.index(feeding[0])
    assert seen[first : first + len(feeding)] == feeding  # no step of the row alone between


@asynccontextmanager
async def row_decoding(backend: TransformersGenerator) -> AsyncIterator[None]:
    """A short greedy request decodes (256 tokens) through the block, which starts once it
    has received two steps."""
    started = asyncio.Event()

    async def decoding() -> None:
        received = 0
        async for _ in backend.generate(prompt(backend, "Hello"), replace(GREEDY, max_tokens=256)):
            received += 1
            if received == 2:
                started.set()

    task = asyncio.create_task(decoding())
    await started.wait()
    yield
    await task


async def test_a_long_scored_prompt_is_fed_in_the_running_rows_steps(in_parts, backends) -> None:
    """A scored prompt's parts are fed in a running row's steps too, every position's logits
    kept: the request gets the prompt logprobs and tokens of its prompt scored whole."""
    backend, long = in_parts, prompt(in_parts, PROMPTS[2])
    params = replace(GREEDY, prompt_logprobs=2, n=2)
    expected_choices, expected_scores = await scored_run(backends("llama"), long, params)
    with forwards(backend) as seen:
        async with row_decoding(backend):
            choices, scores = await scored_run(backend, long, params)
    feeding = [(positions, parts) for _, positions, parts in seen[1:] if positions > 1]
    assert feeding == [(1 + n, (n,)) for n in in_parts_of(len(long), 4)]
    assert tokens([choices]) == tokens([expected_choices])
    same_scores(scores, expected_scores, len(long))


async def test_a_scored_prompt_admitted_while_rows_decode_is_fed_in_their_step(backends) -> None:
    """Within a part's tokens, it is one part: one forward with the running row's step."""
    backend = backends("llama")
    ids = prompt(backend, PROMPTS[1])
    params = replace(GREEDY, prompt_logprobs=1, n=2)
    expected_choices, expected_scores = await scored_run(backend, ids, params)
    with forwards(backend) as seen:
        async with row_decoding(backend):
            choices, scores = await scored_run(backend, ids, params)
    feeding = [(positions, parts) for _, positions, parts in seen[1:] if positions > 1]
    assert feeding == [(1 + len(ids), (len(ids),))]
    assert tokens([choices]) == tokens([expected_choices])
    same_scores(scores, expected_scores, len(ids))


def same_scores(
    got: list[TokenLogprob | None] | None, expected: list[TokenLogprob | None] | None, length: int
) -> None:
    """Prompt logprobs as the prompt scored whole gives them."""
    assert got is not None and expected is not None
    assert len(got) == len(expected) == length
    assert got[0] is None and expected[0] is None
    for one, want in zip(got[1:], expected[1:], strict=True):
        assert one is not None and want is not None
        assert (one.token_id, one.rank) == (want.token_id, want.rank)
        assert one.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t for t, _ in one.top] == [t for t, _ in want.top]


async def test_a_step_feeding_a_part_that_fails_feeds_it_apart_and_both_go_on(
    in_parts, caplog
) -> None:
    """The packed forward of a running row and a prompt's part fails once: the part is fed
    in a forward of its own, the row steps alone, and both requests get their own tokens."""
    backend = in_parts
    failed = threading.Event()

    def fail_once_with_a_part(_module, _args, kwargs) -> None:
        mixed = kwargs.get(MIXED)
        if mixed is not None and mixed.columns.parts and not failed.is_set():
            failed.set()
            raise RuntimeError("out of memory")

    short, long = prompt(backend, "Hello"), prompt(backend, PROMPTS[2])
    requests: list[Prompted] = [(short, replace(GREEDY, max_tokens=256)), (long, GREEDY)]
    expected = await alone(backend, requests)
    with forwards(backend) as seen:  # its hook first: it sees the forward that fails
        hook = backend.model.register_forward_pre_hook(fail_once_with_a_part, with_kwargs=True)
        try:
            together = await staggered(backend, requests)
        finally:
            hook.remove()
    assert failed.is_set() and "running them apart" in caplog.text
    assert tokens(together) == tokens(expected)
    fed = [parts or (positions,) for _, positions, parts in seen[1:] if positions > 1]
    assert sum(map(sum, fed)) == len(long) + 4  # the part that failed, then alone
    assert any(not parts and positions == 4 for _, positions, parts in seen[1:])


async def test_a_long_scored_prompt_is_fed_in_parts(in_parts, backends) -> None:
    """A prompt that is scored is fed in parts too, each part's logprobs taken as it runs (in
    forwards of their own: nothing else runs): the request gets the prompt logprobs and
    tokens of its prompt scored whole."""
    long = prompt(in_parts, PROMPTS[2])
    params = replace(GREEDY, prompt_logprobs=2, n=2)
    expected_choices, expected_scores = await scored_run(backends("llama"), long, params)
    with forward_shapes(in_parts) as shapes:
        choices, scores = await scored_run(in_parts, long, params)
    sizes = in_parts_of(len(long), 4)
    assert [s for s in shapes if s[1] > 1] == [(1, n) for n in sizes if n > 1]
    assert tokens([choices]) == tokens([expected_choices])
    same_scores(scores, expected_scores, len(long))


async def test_a_request_that_leaves_during_its_parts_frees_its_rows(in_parts) -> None:
    """The consumer leaves while the second part runs: the request ends before its other
    parts, its rows are freed, and the loop goes on."""
    backend = in_parts
    long = prompt(backend, PROMPTS[2])
    entered, release = threading.Event(), threading.Event()
    parts = 0

    def hold_second_part(_module, args, kwargs) -> None:
        nonlocal parts
        if kwargs["input_ids"].shape == (1, 4):
            parts += 1
            if parts == 2:
                entered.set()
                release.wait()

    handle = backend.model.register_forward_pre_hook(hold_second_part, with_kwargs=True)
    try:
        stream = backend.generate(long, replace(GREEDY, n=2))
        task = asyncio.create_task(anext(stream))
        await asyncio.to_thread(entered.wait)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        release.set()
        assert await asyncio.to_thread(wait_until_idle, backend)
    finally:
        release.set()
        handle.remove()
    assert parts == 2, "the parts after the consumer left were not fed"
    assert not backend.batcher.prefilling and backend.batcher.running_rows == 0
    (choice,) = await run(backend, long, GREEDY)
    until_eos = reference_greedy(backend, long, GREEDY.max_tokens or 0)
    assert choice.token_ids[: len(until_eos)] == until_eos
