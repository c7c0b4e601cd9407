"""The decode loop's KV cache budget (:mod:`.kv_budget`): sized from ``--kv-cache-memory-bytes``
or the memory free after the weights, the context lowered where one full sequence does not fit
(an explicit ``--max_model_len`` then a startup error), and requests admitted only while the
rows decoded together, times the longest of them, fit: a request with a long prompt and
``max_tokens`` makes the others wait instead of widening every row's cache, and every output
equals the request run alone."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
from prometheus_client import REGISTRY
from transformers import AutoConfig

from huggingfaceserver.backends.pytorch.decode_loop import DecodeRequest
from huggingfaceserver.backends.pytorch.generator import TransformersGenerator
from huggingfaceserver.backends.pytorch.kv_budget import (
    KV_MEMORY_SHARE,
    MIN_CONTEXT,
    UNBOUNDED,
    plan_kv_budget,
)
from huggingfaceserver.backends.pytorch.kv_cache import ReservedCache
from huggingfaceserver.errors import BadRequest, StartupError
from huggingfaceserver.generation.params import ChoiceDelta, SamplingParams
from huggingfaceserver.model_facts import attention_shape
from huggingfaceserver.observability.metrics import ENGINE_LABEL
from huggingfaceserver.pod import Memory
from huggingfaceserver.units import GiB, MiB

from .generation_helpers import load, prompt, run

# --- the budget -----------------------------------------------------------------------------


def test_the_budget_is_the_flag_in_tokens_else_a_share_of_what_is_free() -> None:
    free = Memory(10 * GiB, "this host")
    flagged = plan_kv_budget(1024, 64 * MiB, free)
    assert flagged.tokens == 64 * 1024
    assert "--kv-cache-memory-bytes" in flagged.reason
    default = plan_kv_budget(1024, None, free)
    assert default.tokens == int(10 * GiB * KV_MEMORY_SHARE) // 1024
    assert "40% of 10.00 GiB available on this host" in default.reason


def test_caches_are_held_within_it_and_admitted_within_nine_tenths() -> None:
    budget = plan_kv_budget(1, None, Memory(1000, "this host"))  # 400 tokens
    assert budget.holds(400) and not budget.holds(401)
    assert budget.admits(360) and not budget.admits(361)


def test_a_model_whose_attention_is_unknown_is_not_bounded() -> None:
    budget = plan_kv_budget(None, 64 * MiB, Memory(GiB, "this host"))
    assert budget.tokens is None and budget.admits(10**12)
    assert UNBOUNDED.admits(10**12) and UNBOUNDED.holds(10**12)


# --- at load --------------------------------------------------------------------------------


def bytes_per_token(path: Path) -> int:
    """The tiny model's KV cache per token in float32, as the server counts it."""
    shape = attention_shape(AutoConfig.from_pretrained(path).get_text_config())
    assert shape is not None
    return shape.kv_bytes_per_token(4)


@contextmanager
def loaded(path: Path, *flags: str) -> Iterator[TransformersGenerator]:
    backend = load(path, *flags)
    try:
        yield backend
    finally:
        backend.shutdown()


def test_the_budget_on_a_cpu_comes_from_the_memory_available_and_is_logged(
    tiny_models, caplog
) -> None:
    with caplog.at_level(logging.INFO), loaded(tiny_models["llama"]) as backend:
        assert backend.kv_budget.tokens is not None
        assert backend.kv_budget.tokens >= backend.max_model_len == 128
        assert backend.batcher.kv_budget is backend.kv_budget
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache up to")]
    assert said and "40% of" in said[0] and "after the weights" in said[0]


def test_a_budget_under_the_full_context_lowers_it_and_says_so(tiny_models, caplog) -> None:
    path = tiny_models["llama"]
    size = str(100 * bytes_per_token(path))
    with caplog.at_level(logging.WARNING), loaded(path, "--kv-cache-memory-bytes", size) as b:
        assert b.kv_budget.tokens == 100
        assert b.max_model_len == 100  # the model's 128 do not fit
    assert any(
        "serving a context of 100 tokens, not the model's 128" in r.getMessage()
        for r in caplog.records
    )


def test_a_max_model_len_or_a_context_the_budget_cannot_hold_is_a_startup_error(
    tiny_models,
) -> None:
    path = tiny_models["llama"]
    size = str(100 * bytes_per_token(path))
    with pytest.raises(StartupError, match=r"one sequence of 128 tokens does not fit.*at most 100"):
        load(path, "--kv-cache-memory-bytes", size, "--max_model_len", "128")
    tiny = str((MIN_CONTEXT - 1) * bytes_per_token(path))
    with pytest.raises(StartupError, match="--kv-cache-memory-bytes"):
        load(path, "--kv-cache-memory-bytes", tiny)


# --- admission and preemption ---------------------------------------------------------------


class Collected:
    """A request's output as the decode loop emits it (on its own thread)."""

    def __init__(self, rows: int):
        self.tokens: list[list[int]] = [[] for _ in range(rows)]
        self.outcome: BaseException | None = None
        self.done = threading.Event()

    def __call__(self, item: list[ChoiceDelta] | BaseException | None) -> None:
        if item is None or isinstance(item, BaseException):
            self.outcome = item
            self.done.set()
            return
        for delta in item:
            self.tokens[delta.index] += delta.token_ids


@dataclass
class Held:
    """What the decode loop held at each forward: rows admitted, and the token cells of the
    running batches' KV cache buffers."""

    rows: list[int] = field(default_factory=list)
    cells: list[int] = field(default_factory=list)
    beside_first: list[int] = field(default_factory=list)
    """Rows admitted while the first request was still running."""


def cache_cells(backend: TransformersGenerator) -> int:
    """The running batches' KV cache: a reserved cache's buffers as allocated, transformers'
    own as its rows and columns."""
    cells = 0
    for group in backend.batcher.running:
        cache = group.batch.cache
        if isinstance(cache, ReservedCache):
            cells += cache.row_capacity * cache.column_capacity
        else:
            cells += len(group.rows) * group.batch.columns
    return cells


def submitted_together(
    backend: TransformersGenerator,
    requests: list[tuple[list[int], SamplingParams]],
    each_forward: Callable[[], None] = lambda: None,
) -> tuple[list[Collected], Held]:
    """Queue every request before the decode loop admits any (under its lock), run them to
    their end (``each_forward`` called before every forward, on the loop's thread); their
    outputs, and what the loop held at each forward."""
    held = Held()

    outputs = [Collected(params.n) for _, params in requests]

    def count(*_) -> None:
        held.rows.append(backend.batcher.running_rows)
        held.cells.append(cache_cells(backend))
        if not outputs[0].done.is_set():
            held.beside_first.append(backend.batcher.running_rows)
        each_forward()

    handle = backend.model.register_forward_pre_hook(count)
    try:
        with backend.batcher.wake:
            for (prompt_ids, params), output in zip(requests, outputs, strict=True):
                rows = backend.new_sequences(prompt_ids, params)
                backend.batcher.submit(DecodeRequest(rows, output))
        for output in outputs:
            assert output.done.wait(60), "a request never ended"
    finally:
        handle.remove()
    assert all(output.outcome is None for output in outputs)
    return outputs, held


RUNNING, PREEMPTIONS = "vllm:num_requests_running", "vllm:num_preemptions_total"
BUDGET = 200
"""Tokens of the bounded backend's KV cache: two rows of 100 columns."""


def traffic(backend: TransformersGenerator) -> list[tuple[list[int], SamplingParams]]:
    """A request with a prompt of 80 tokens that reaches 120; one admitted beside it whose
    answer (60 tokens, seeded sampling) takes both rows past 100 columns; two short ones that
    arrive behind them."""
    long_prompt = (prompt(backend, "the long one") * 80)[:80]
    sampled = SamplingParams(temperature=0.8, seed=7, max_tokens=60, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    return [
        (long_prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)),
        ((prompt(backend, "two") * 5)[:5], sampled),
        ((prompt(backend, "three") * 5)[:5], short),
        ((prompt(backend, "four") * 5)[:5], short),
    ]


@pytest.mark.parametrize("ahead", [(), ("--async-scheduling",)], ids=["", "steps-ahead"])
@pytest.mark.parametrize("reserved", [True, False], ids=["reserved", "transformers-cache"])
async def test_rows_over_the_budget_wait_or_leave_and_every_output_stays_as_alone(
    tiny_models, caplog, ahead, reserved
) -> None:
    """Admitted while they fit, the rows that would widen the cache past the budget wait; the
    answer that grows it past the budget leaves the batch (preempted) and goes on once the
    long request ended: every output is the request's alone (seeded sampling too), and the
    cache's buffers never hold more than the budget. The same traffic unbounded runs all four
    rows together, in buffers well past it. With steps queued ahead (as on a GPU), the rows
    that leave have fed one step more, dropped with them. On transformers' own cache (a model
    with sliding-window or recurrent layers) each prompt's rows keep a cache of their own, as
    wide as they are: there all four fit side by side."""
    path = tiny_models["llama"]
    size = str(BUDGET * bytes_per_token(path))
    flags = ("--kv-cache-memory-bytes", size, *ahead)
    with loaded(path, *ahead) as unbounded, loaded(path, *flags) as bounded:
        if not reserved:
            unbounded.cache_layers = bounded.cache_layers = 0  # as for a sliding-window model
        requests = traffic(bounded)
        _, free = submitted_together(unbounded, requests)
        assert max(free.rows) == 4
        with caplog.at_level(logging.INFO):
            outputs, held = submitted_together(bounded, requests)
        assert max(held.cells) <= BUDGET
        left = [r for r in caplog.records if "left the running rows" in r.getMessage()]
        if reserved:
            assert max(free.cells) > BUDGET
            assert max(held.beside_first) == 2  # the two short ones waited for room
            assert held.beside_first[-1] == 1 and len(left) == 1  # the answer left
            assert max(held.rows) == 3  # it went on beside the two short ones
        else:
            assert max(held.rows) == 4 and not left
        for (prompt_ids, params), output in zip(requests, outputs, strict=True):
            [alone] = await run(bounded, prompt_ids, params)
            assert output.tokens == [alone.token_ids]
            assert len(alone.token_ids) == params.max_tokens


def test_a_preempted_request_whose_client_left_ends_in_the_queue(tiny_models) -> None:
    """A request that left the rows and waits to go on, whose client left meanwhile, ends
    there (its end counted): it is not fed again. While it waits it counts as waiting, not
    running (as vLLM counts a preempted request)."""
    path = tiny_models["llama"]
    size = str(BUDGET * bytes_per_token(path))
    with loaded(path, "--kv-cache-memory-bytes", size) as backend:
        left = threading.Event()
        labels = {"model_name": backend.config.model_name, "engine": ENGINE_LABEL}

        def sample(name: str) -> float:
            return REGISTRY.get_sample_value(name, labels) or 0.0

        running_while_it_waited: list[float] = []

        def leave_when_preempted() -> None:
            for waiting in backend.batcher.waiting:
                if waiting.resumed and not left.is_set():
                    running_while_it_waited.append(sample(RUNNING))
                    waiting.cancelled.set()
                    left.set()

        running, preemptions = sample(RUNNING), sample(PREEMPTIONS)
        outputs, _ = submitted_together(backend, traffic(backend)[:2], leave_when_preempted)
        assert left.is_set()
        assert running_while_it_waited == [running + 1]  # the first request only
        assert len(outputs[0].tokens[0]) == 40
        assert 0 < len(outputs[1].tokens[0]) < 60  # stopped where it left
        assert not backend.batcher.waiting
        assert sample(PREEMPTIONS) == preemptions + 1
        assert sample(RUNNING) == running  # both ended, the one that left the rows included


async def test_rows_admitted_while_a_prompt_is_fed_in_parts_count_its_width(
    tiny_models,
) -> None:
    """A 90-token prompt fed in parts of 16 joins the running rows once its last part is in,
    and they all then share its columns: requests that arrive meanwhile are admitted only
    where they fit beside it at that width (counted by their own rows' columns, two short
    ones joined it and took the rows past the budget). Every output is the request's alone."""
    path = tiny_models["llama"]
    budget = 250  # two rows of 100 columns fit, three do not
    size = str(budget * bytes_per_token(path))
    flags = ("--kv-cache-memory-bytes", size, "--prefill_chunk_tokens", "16")
    with loaded(path, *flags) as backend:
        short = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        requests = [
            ((prompt(backend, "running") * 5)[:5], replace(short, max_tokens=30)),
            ((prompt(backend, "the long one") * 90)[:90], short),
            ((prompt(backend, "three") * 5)[:5], short),
            ((prompt(backend, "four") * 5)[:5], short),
        ]
        outputs, held = submitted_together(backend, requests)
        assert max(held.cells) <= budget
        for (prompt_ids, params), output in zip(requests, outputs, strict=True):
            [alone] = await run(backend, prompt_ids, params)
            assert output.tokens == [alone.token_ids]


async def test_rows_left_as_wide_as_transformers_cache_holds_them_leave_for_the_budget(
    tiny_models, caplog
) -> None:
    """On transformers' own cache (a model with sliding-window layers) the rows of a batch
    keep its columns after its widest row ends: three prompts of 40 and 30 tokens prefilled
    together, the 40-token one ends at once, the two others grow past the budget at the
    40-token width although their own tokens would fit. One of them leaves (preempted) and
    goes on after; counted by their own tokens, none left and the cache outgrew the budget.
    Every output is the request's alone."""
    path = tiny_models["llama"]
    size = str(BUDGET * bytes_per_token(path))
    with loaded(path, "--kv-cache-memory-bytes", size) as backend:
        backend.cache_layers = 0  # as for a sliding-window model
        growing = SamplingParams(temperature=0, max_tokens=75, ignore_eos=True)
        requests = [
            ((prompt(backend, "wide") * 40)[:40], replace(growing, max_tokens=3)),
            ((prompt(backend, "two") * 30)[:30], growing),
            ((prompt(backend, "three") * 30)[:30], growing),
        ]
        with caplog.at_level(logging.INFO):
            outputs, held = submitted_together(backend, requests)
        assert max(held.rows) == 3 and max(held.cells) <= BUDGET
        assert [r for r in caplog.records if "left the running rows" in r.getMessage()]
        for (prompt_ids, params), output in zip(requests, outputs, strict=True):
            [alone] = await run(backend, prompt_ids, params)
            assert output.tokens == [alone.token_ids]


# --- requests of n choices ------------------------------------------------------------------


def test_n_choices_that_cannot_fit_together_are_a_bad_request(tiny_models) -> None:
    """``n`` choices' rows cannot leave the batch to go on later: they must fit in the budget
    together at the most they may reach (the prompt and max_tokens, else the context)."""
    path = tiny_models["llama"]
    size = str(BUDGET * bytes_per_token(path))
    with loaded(path, "--kv-cache-memory-bytes", size) as backend:
        prompt_ids = (prompt(backend, "n choices") * 10)[:10]
        fits = SamplingParams(n=2, max_tokens=90)  # 2 x 100 tokens
        backend.check_request(prompt_ids, fits)
        with pytest.raises(BadRequest, match=r"n=2 choices of up to 101 tokens each .* 202 "):
            backend.check_request(prompt_ids, SamplingParams(n=2, max_tokens=91))
        with pytest.raises(BadRequest, match="up to 128 tokens each"):  # the context
            backend.check_request(prompt_ids, SamplingParams(n=2))
        backend.check_request(prompt_ids, SamplingParams(n=1))  # one choice can leave


async def test_requests_of_n_choices_are_admitted_with_room_for_all_they_may_reach(
    tiny_models,
) -> None:
    """Two requests of 2 choices that may each reach 100 tokens: the second waits until the
    first has ended (4 rows of 100 would exceed the budget, and none of them could leave), and
    the cache never holds more than the budget; every output is the request's alone. Admitted
    by the tokens they hold so far, all 4 rows would run together and outgrow it."""
    path = tiny_models["llama"]
    size = str(BUDGET * bytes_per_token(path))
    with loaded(path, "--kv-cache-memory-bytes", size) as backend:
        requests = [
            ((prompt(backend, text) * 10)[:10], SamplingParams(n=2, max_tokens=90, seed=3))
            for text in ("first", "second")
        ]
        outputs, held = submitted_together(backend, requests)
        assert max(held.beside_first) == 2 and max(held.rows) == 2
        assert max(held.cells) <= BUDGET
        for (prompt_ids, params), output in zip(requests, outputs, strict=True):
            alone = await run(backend, prompt_ids, params)
            assert output.tokens == [choice.token_ids for choice in alone]


def test_a_seq2seq_models_budget_only_sizes_its_rows(tiny_models, caplog) -> None:
    """A seq2seq model's decoder tokens cannot be fed again as a prompt: its budget is logged
    and sizes its rows (on a GPU), but the loop does not keep to it, nor lower the context."""
    path = tiny_models["t5"]
    with caplog.at_level(logging.INFO), loaded(path, "--kv-cache-memory-bytes", "4096") as b:
        assert b.kv_budget is UNBOUNDED and b.batcher.kv_budget is UNBOUNDED
        assert b.kv_cache_tokens is None
        b.check_request(prompt(b, "two choices"), SamplingParams(n=2))
    assert any("is not kept to, it sizes the rows" in r.getMessage() for r in caplog.records)
