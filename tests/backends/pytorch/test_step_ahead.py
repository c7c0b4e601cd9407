"""Decode steps queued ahead (:meth:`ContinuousBatcher._step_ahead`, on by default on a GPU):
the next step is queued on the tokens just chosen, before the host reads them and makes their
text, so that on a GPU the two overlap. On this CPU each forward runs as it is queued, so the
order is the GPU's and only the overlap is missing: every output equals the one of steps not
queued ahead (greedy and seeded tokens, logprobs, texts, finish reasons), with requests that
join, leave, stop on a string, fail or break the model.

The decode loop's own tests run again here with steps queued ahead (imported below; the
``backends`` and ``in_parts`` fixtures of this module turn it on), besides those that count
forwards or waits, whose counts change by the step queued after the last rows ended: their
versions are here."""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch

from huggingfaceserver.backends.pytorch.decode_loop import DecodeRequest
from huggingfaceserver.backends.pytorch.generator import TransformersGenerator, steps_ahead
from huggingfaceserver.backends.pytorch.ragged import MIXED
from huggingfaceserver.backends.pytorch.step_graphs import Forward, StepGraphs
from huggingfaceserver.generation.params import SamplingParams

from .generation_helpers import PROMPTS, forward_shapes, load, prompt, run
from .test_decode_loop import (  # noqa: F401 - collected here again, with steps queued ahead
    GREEDY,
    Prompted,
    alone,
    assert_same_choices,
    packed_prompts,
    slow_forward,
    staggered,
    test_a_long_prompt_is_fed_in_parts_in_the_running_rows_steps,
    test_a_packed_step_that_fails_runs_its_prompts_apart_and_every_request_goes_on,
    test_a_request_for_several_choices_is_fed_in_a_step_and_keeps_its_seeds,
    test_a_request_that_leaves_during_its_parts_frees_its_rows,
    test_a_request_that_leaves_frees_its_rows,
    test_a_request_whose_rows_break_the_model_fails_alone,
    test_a_step_that_fails_once_is_retried_apart_and_every_request_goes_on,
    test_a_stop_string_ends_its_request_while_others_go_on,
    test_a_wave_after_an_idle_spell_replays_the_graphs_recorded_before_it,
    test_each_request_keeps_its_own_settings,
    test_graphed_decode_steps_give_the_tokens_eager_ones_give,
    test_late_requests_join_the_batch_and_greedy_is_unchanged,
    test_requests_that_arrive_while_others_decode_are_fed_in_their_step,
    test_the_kept_cache_goes_to_the_batch_that_runs,
    tokens,
    waits_of_every_kind,
)

Backend = TransformersGenerator


@pytest.fixture(scope="module")
def backends(backends: Callable[..., Backend]) -> Callable[..., Backend]:
    """The shared backends, their decode steps queued ahead."""

    def get(name: str, sharp: bool = False) -> Backend:
        backend = backends(name, sharp)
        backend.batcher.step_ahead = True
        return backend

    return get


@pytest.fixture(scope="module")
def in_parts(tiny_models: dict[str, Path]) -> Iterator[TransformersGenerator]:
    """The tiny Llama fed prompts in parts of 4 tokens, its decode steps queued ahead."""
    backend = load(tiny_models["llama"], "--prefill_chunk_tokens", "4")
    backend.batcher.step_ahead = True
    yield backend
    backend.shutdown()


def static_output(forward: Forward) -> Forward:
    """A stand-in for a CUDA graph closer than :func:`~.step_graphs.eager`: every replay
    writes the same output tensor, as a graph's does, so a step queued ahead overwrites the
    logits of the step before it."""
    output: list[torch.Tensor] = []

    def replay() -> torch.Tensor:
        logits = forward()
        if not output:
            output.append(logits.clone())
        return output[0].copy_(logits)

    return replay


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
async def test_steps_queued_ahead_give_what_steps_not_queued_ahead_give(
    backends, name: str, graphed: bool
) -> None:
    """Requests of every kind joining at different times and ending at different steps (by
    length, at their stop token, with ``min_tokens``): the same tokens, texts, logprobs and
    finish reasons as each request alone with no step queued ahead; with recorded steps too,
    whose output tensor each replay overwrites (:func:`static_output`)."""
    backend = backends(name, sharp=name == "gpt2")
    graphs = StepGraphs(backend.max_rows, static_output) if graphed else None
    await check_same_as_not_ahead(backend, graphs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_steps_queued_ahead_on_a_gpu_give_what_steps_not_queued_ahead_give(
    tiny_models,
) -> None:
    """On CUDA, with the CUDA graphs of the decode steps: steps are queued ahead by default."""
    backend = load(tiny_models["llama"], "--dtype", "float32")
    try:
        graphs = backend.graphs
        assert backend.device.type == "cuda" and graphs is not None
        assert backend.batcher.step_ahead
        await check_same_as_not_ahead(backend, graphs)
    finally:
        backend.shutdown()


async def check_same_as_not_ahead(backend: Backend, graphs: StepGraphs | None) -> None:
    """Requests of every kind, each alone with no step queued ahead (nor recorded), then
    staggered with steps queued ahead (and ``graphs``): the same outputs, most decode steps
    queued ahead."""
    ids = [prompt(backend, text) for text in PROMPTS]
    requests = [
        (ids[0], replace(GREEDY, logprobs=2, max_tokens=9)),
        (ids[1], SamplingParams(n=2, seed=7, max_tokens=12, min_tokens=4)),
        (ids[2], SamplingParams(temperature=0.7, top_k=20, seed=3, max_tokens=20, logprobs=0)),
        (ids[0], replace(GREEDY, n=2, presence_penalty=2.0, max_tokens=10)),
        (ids[1], SamplingParams(seed=1, top_p=0.8, repetition_penalty=1.3, max_tokens=14)),
    ]
    kept = backend.graphs
    backend.graphs, backend.batcher.step_ahead = None, False
    try:
        expected = await alone(backend, requests)
    finally:
        backend.batcher.step_ahead = True
    before = backend.batcher.stepped_ahead
    backend.graphs = graphs
    try:
        with slow_forward(backend), forward_shapes(backend) as shapes:
            together = await staggered(backend, requests)
    finally:
        backend.graphs = kept
        backend.idle_cache = None
    steps = [rows for rows, tokens in shapes if tokens == 1]
    assert 2 * (backend.batcher.stepped_ahead - before) > len(steps)  # most of them
    assert graphs is None or (graphs.replayed and graphs.broken is None)
    assert_same_choices(together, expected)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
async def test_prompts_that_arrive_while_a_step_is_queued_ahead_are_fed_in_its_shadow(
    backends, name: str
) -> None:
    """A request arriving while the running rows' next step is queued ahead: the step that
    feeds its prompt is queued on that step's tokens before the host reads them (on a GPU the
    device does not wait for the host between the two), and each request gets its tokens."""
    backend = backends(name, sharp=name == "gpt2")
    requests = [(prompt(backend, text), GREEDY) for text in reversed(PROMPTS)]
    backend.batcher.step_ahead = False
    try:
        expected = await alone(backend, requests)
    finally:
        backend.batcher.step_ahead = True
    in_shadow: list[int] = []

    def record(_module, _args, kwargs) -> None:
        if MIXED in kwargs and any(f.function == "_feed_ahead" for f in inspect.stack(0)):
            in_shadow.extend(kwargs[MIXED].columns.lengths)

    hook = backend.model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        with slow_forward(backend), packed_prompts(backend) as (packed, apart):
            together = await staggered(backend, requests)
    finally:
        hook.remove()
    assert tokens(together) == tokens(expected)
    assert in_shadow == packed == [len(ids) for ids, _ in requests[1:]]
    assert apart == [len(requests[0][0])]


async def alone_not_ahead(backend: TransformersGenerator, requests: list[Prompted]):
    """Each request alone, no step queued ahead: what they must give together."""
    backend.batcher.step_ahead = False
    try:
        return await alone(backend, requests)
    finally:
        backend.batcher.step_ahead = True


@dataclass
class FedAhead:
    """The packed layouts (:class:`~.kv_cache.MixedColumns`) of the steps queued ahead."""

    columns: list = field(default_factory=list)

    def seen(self, kwargs: dict) -> None:
        if MIXED in kwargs and "_feed_ahead" in {f.function for f in inspect.stack(0)}:
            self.columns.append(kwargs[MIXED].columns)


async def test_a_prompt_fed_in_the_shadow_of_a_step_that_ends_every_row_runs_on(backends) -> None:
    """The running request's last token is read while the step that feeds a new prompt is
    queued on it: the batch stays for the new request's rows, which go on as alone."""
    backend = backends("llama")
    first = (prompt(backend, PROMPTS[0]), replace(GREEDY, max_tokens=3))
    second = (prompt(backend, PROMPTS[1]), GREEDY)
    expected = await alone_not_ahead(backend, [first, second])
    fed = FedAhead()
    outputs, ends = submitted_while_the_last_step_is_queued(backend, first, [second], fed.seen)
    in_shadow = [length for columns in fed.columns for length in columns.lengths]
    assert ends == [None, None]
    assert outputs == [choices[0].token_ids for choices in expected]
    assert in_shadow == [len(second[0])]


def submitted_while_the_last_step_is_queued(
    backend: TransformersGenerator,
    running: Prompted,
    arriving: list[Prompted],
    seen: Callable[[dict], None] = lambda kwargs: None,
) -> tuple[list[list[int]], list[object]]:
    """``running`` alone, 3 tokens: the ``arriving`` requests are submitted as the step that
    gives its last token is queued, so that the turn that admits them reads that step (and
    ends its rows). Each request's tokens and last word (None, or what failed it), each
    waited for 60 s at most; ``seen`` gets every forward's keyword arguments."""
    everyone = [running, *arriving]
    outputs: list[list[int]] = [[] for _ in everyone]
    ends: list[object] = ["running" for _ in everyone]
    done = [threading.Event() for _ in everyone]

    def emit_to(index: int) -> Callable[[object], None]:
        def emit(item: object) -> None:
            if isinstance(item, list):
                outputs[index] += [token for delta in item for token in delta.token_ids]
            else:  # None, or what failed it
                ends[index] = item
                done[index].set()

        return emit

    requests = [
        DecodeRequest(backend.new_sequences(ids, params), emit_to(i))
        for i, (ids, params) in enumerate(everyone)
    ]
    batcher = backend.batcher
    submitted = threading.Event()

    def arrive(_module, _args, kwargs) -> None:
        queued_by = {f.function for f in inspect.stack(0)}
        if "_step_ahead" in queued_by and not submitted.is_set() and len(outputs[0]) == 1:
            submitted.set()
            with batcher.wake:  # admitted together, in the next turn
                for request in requests[1:]:
                    batcher.submit(request)
        seen(kwargs)

    hook = backend.model.register_forward_pre_hook(arrive, with_kwargs=True)
    try:
        batcher.submit(requests[0])
        for event in done:
            event.wait(60)
    finally:
        hook.remove()
    assert submitted.is_set()
    return outputs, ends


async def test_a_prompt_part_fed_in_the_shadow_of_a_step_that_ends_every_row_runs_on(
    in_parts,
) -> None:
    """As above, the new prompt fed in parts: its first part goes in the step queued on the
    running request's last token, whose rows then all end; the part's logits are read with
    that step all the same and the prompt goes on (it failed with a 500: the batch was let go
    with its queued step, as if that step had failed)."""
    backend = in_parts
    first = (prompt(backend, "Hello"), replace(GREEDY, max_tokens=3))
    second = (prompt(backend, PROMPTS[2]), replace(GREEDY, max_tokens=8))
    assert len(first[0]) <= 4 < len(second[0])  # whole, and in parts of 4
    expected = await alone_not_ahead(backend, [first, second])
    fed = FedAhead()
    outputs, ends = submitted_while_the_last_step_is_queued(backend, first, [second], fed.seen)
    parts_in_shadow = [part.tokens for columns in fed.columns for part in columns.parts]
    assert ends == [None, None]
    assert outputs == [choices[0].token_ids for choices in expected]
    assert parts_in_shadow[:1] == [4]  # the first part, fed in the step queued ahead


async def test_a_prompt_chosen_to_join_rows_that_end_before_it_is_fed_runs_alone(
    in_parts,
) -> None:
    """Two requests admitted in one turn while the running request's last step is queued:
    one to be fed in the running rows' step, the other whole (no room left in the step). The
    whole one's start reads the queued step first, which ends the running rows, and itself
    ends at its first token: no batch is left to feed the first one, which then starts on
    its own (it was dropped: never a token nor an end, its client waiting for ever)."""
    backend = in_parts
    running = (prompt(backend, "Hello"), replace(GREEDY, max_tokens=3))
    joining = ((prompt(backend, PROMPTS[0]) * 3)[:3], replace(GREEDY, max_tokens=5))
    whole = ((prompt(backend, PROMPTS[1]) * 3)[:3], replace(GREEDY, max_tokens=1))
    assert len(running[0]) <= 4  # whole; the two others fit the step's 4 tokens one at a time
    expected = await alone_not_ahead(backend, [running, joining, whole])
    outputs, ends = submitted_while_the_last_step_is_queued(backend, running, [joining, whole])
    assert ends == [None, None, None]
    assert outputs == [choices[0].token_ids for choices in expected]


async def test_a_step_queued_ahead_that_fails_is_retried_apart(backends, caplog) -> None:
    """The forward of a step queued ahead raises when it is queued: the next turn's step
    fails with it, and each request's rows are stepped again apart (every request goes on,
    with its tokens)."""
    backend = backends("llama")
    requests = [(prompt(backend, text), GREEDY) for text in PROMPTS[:2]]
    expected = await alone(backend, requests)
    failed = threading.Event()

    def fail_once_ahead(_module, _args, kwargs) -> None:
        queued_ahead = any(f.function == "_step_ahead" for f in inspect.stack(context=0))
        if kwargs["input_ids"].shape == (2, 1) and queued_ahead and not failed.is_set():
            failed.set()
            raise RuntimeError("out of memory")

    hook = backend.model.register_forward_pre_hook(fail_once_ahead, with_kwargs=True)
    try:
        with slow_forward(backend):
            results = await asyncio.gather(*(run(backend, *r) for r in requests))
    finally:
        hook.remove()
    assert failed.is_set()
    assert "retrying each apart" in caplog.text
    assert tokens(results) == tokens(expected)


async def test_a_decode_step_queued_ahead_waits_for_the_device_once(backends) -> None:
    """Rows of every kind admitted together, their steps queued ahead: one wait per forward
    whose logits are read, which is every forward but the one queued after the last rows
    ended (its logits dropped with them)."""
    backend = backends("llama")
    before = backend.batcher.stepped_ahead
    counter, shapes = await waits_of_every_kind(backend)
    steps = [rows for rows, tokens in shapes if tokens == 1]
    assert len(steps) == GREEDY.max_tokens  # the 15 after the prompt's, and the one dropped
    assert backend.batcher.stepped_ahead - before == len(steps) - 1  # all but the first
    assert counter.outside_module == len(shapes) - 1, counter.counts


async def test_vllms_switch_turns_steps_ahead_on_and_off(tiny_models, backends) -> None:
    """On a GPU by default, on a CPU not; ``--async-scheduling`` / ``--no-async-scheduling``
    (vLLM's switch) turn it on or off on either, and the tokens are the same."""
    assert steps_ahead(None, "cuda") and not steps_ahead(None, "cpu")
    assert steps_ahead(True, "cpu") and not steps_ahead(False, "cuda")
    ids = prompt(backends("llama"), PROMPTS[0])
    (expected,) = await run(backends("llama"), ids, GREEDY)
    for flag, on in (("--async-scheduling", True), ("--no-async-scheduling", False)):
        backend = load(tiny_models["llama"], flag)
        try:
            assert backend.batcher.step_ahead is on
            (choice,) = await run(backend, ids, GREEDY)
            assert choice.token_ids == expected.token_ids
            assert (backend.batcher.stepped_ahead > 0) is on
        finally:
            backend.shutdown()
