"""Decode steps replayed from recorded graphs: the bucket a batch runs in, its padding rows, the
whole-buffer forward, recording again when the buffers change, and the eager fall back.

On a CPU the recording is :func:`~huggingfaceserver.backends.pytorch.step_graphs.eager` (the
same padded whole-buffer forward, run at every replay): every row's logits must equal those of
the plain reserved batch, which ``test_kv_cache`` checks against transformers' own cache. The
CUDA graph itself is checked where a GPU is (``gpu``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator

import pytest
import torch

from huggingfaceserver.backends.pytorch import kv_cache
from huggingfaceserver.backends.pytorch.decode_batch import ReservedCausalLMBatch
from huggingfaceserver.backends.pytorch.kv_cache import ReservedCache
from huggingfaceserver.backends.pytorch.step_graphs import (
    Forward,
    StepGraphs,
    bucket_for,
    bucket_sizes,
    cuda_graph,
    eager,
    torch_compiled,
)
from huggingfaceserver.generation.params import SamplingParams
from huggingfaceserver.observability.syncs import SyncCounter

from .generation_helpers import (
    MAX_TOKENS,
    PROMPTS,
    Choice,
    load,
    prompt,
    reference_greedy,
    run,
)

TEXTS = [*PROMPTS, "One two three four five six", "Why?", "The quick brown fox jumps over"]

TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}
"""float32 sums over more columns (masked ones add exact zeros) in another order: the tolerance
``test_kv_cache`` gives a padded batch."""


@pytest.fixture(autouse=True)
def small_growth(monkeypatch: pytest.MonkeyPatch) -> None:
    """Buffers grow by 3 columns at least, so that a few steps cross their capacity."""
    monkeypatch.setattr(kv_cache, "MIN_GROWTH", 3)


def test_buckets_double_up_to_the_batch_limit() -> None:
    assert bucket_sizes(32) == (1, 2, 4, 8, 16, 32)
    assert bucket_sizes(12) == (1, 2, 4, 8, 12)
    assert bucket_sizes(1) == (1,)
    sizes = bucket_sizes(12)
    assert [bucket_for(rows, sizes) for rows in (1, 2, 3, 5, 8, 9, 12)] == [1, 2, 4, 8, 8, 12, 12]
    assert bucket_for(13, sizes) is None


class Counting:
    """A recording that counts the graphs recorded, each replayed eagerly."""

    def __init__(self) -> None:
        self.recorded = 0

    def __call__(self, forward: Forward) -> Forward:
        self.recorded += 1
        return forward


@pytest.fixture
def fresh_compiles() -> Iterator[None]:
    """torch's compile caches emptied around the test (``torch.compiler.reset``): a step's
    forward is one function whose compiles add up across the tests of a process, against
    torch's limit of recompiles per function (past which it runs uncompiled)."""
    torch.compiler.reset()
    yield
    torch.compiler.reset()


class CountingCompiler:
    """A ``torch.compile`` backend (torch's custom-backend interface): keeps each graph that
    dynamo traced and runs it as traced (no inductor: seconds, not minutes, on a CPU), counting
    its runs, so that a test sees what was compiled and that the compiled step ran."""

    def __init__(self) -> None:
        self.compiled: list[torch.fx.GraphModule] = []
        self.runs = 0

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
        self.compiled.append(graph)

        def run(*args: torch.Tensor):
            self.runs += 1
            return graph.forward(*args)

        return run


def batch_pair(backend, graphs: StepGraphs, max_rows: int = 8):
    """The same rows in a graphed batch and a plain one."""

    def new(with_graphs: StepGraphs | None) -> ReservedCausalLMBatch:
        cache = ReservedCache(backend.cache_layers, max_rows, backend.model.device)
        return ReservedCausalLMBatch(backend.model, cache, with_graphs)

    return new(graphs), new(None)


def tokens(batch: ReservedCausalLMBatch, step: int, vocab: int) -> torch.Tensor:
    """A column of tokens that differ per row and step."""
    rows = torch.arange(batch.cache.rows)
    return (rows * 7 + step * 13) % vocab


def step_both(graphed, plain, step: int, vocab: int) -> None:
    column = tokens(plain, step, vocab)
    torch.testing.assert_close(graphed.step(column), plain.step(column), **TOLERANCE)


@pytest.mark.usefixtures("fresh_compiles")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_graphed_steps_equal_eager_ones_as_rows_join_and_leave(
    backends, name: str, compiled: bool
) -> None:
    """Rows join (3, then 6: buckets 4 and 8, padded), leave (2 left: bucket 2), and the
    buffers grow on the way: every step's logits equal the plain batch's, and a graph is
    recorded once per bucket and buffers, not per step. ``compiled`` (``--torch_compile``):
    each bucket's forward goes through ``torch.compile`` before it is recorded: every step
    ran the compiled graph, and the compiler ran a handful of times (a size that changes goes
    symbolic), not per bucket and buffers."""
    backend = backends(name)
    recording = Counting()
    compiler = CountingCompiler()
    graphs = StepGraphs(8, recording, torch_compiled(compiler) if compiled else None)
    graphed, plain = batch_pair(backend, graphs)
    vocab = backend.vocab_size
    with torch.inference_mode():
        first = [prompt(backend, text) for text in TEXTS[:3]]
        for batch in (graphed, plain):
            batch.prefill_together(first, [1, 1, 1])
        for step in range(6):
            step_both(graphed, plain, step, vocab)
        assert graphed.cache.rows == 3 and set(graphs.replays) == {4}
        steps_before_join = recording.recorded
        assert steps_before_join <= 3  # once per layout of the buffers, not per step

        later = [prompt(backend, text) for text in TEXTS[3:6]]
        for batch in (graphed, plain):
            joining = ReservedCausalLMBatch(
                backend.model, ReservedCache(backend.cache_layers, 8, backend.model.device)
            )
            joining.prefill_together(later, [1, 1, 1])
            assert batch.absorb(joining)
        for step in range(6, 14):
            step_both(graphed, plain, step, vocab)
        assert graphed.cache.rows == 6 and 8 in graphs.replays

        for batch in (graphed, plain):
            batch.keep([1, 4])
        for step in range(14, 20):
            step_both(graphed, plain, step, vocab)
        assert 2 in graphs.replays
    assert graphs.broken is None
    assert recording.recorded == graphs.recordings
    assert graphs.replayed == 20  # every step
    assert recording.recorded <= 12  # 3 buckets, over a few layouts of the buffers
    assert graphed.cache.layout >= 2  # the buffers did grow while graphs were recorded
    if compiled:
        # each recording ran its compiled forward once before (the compile), then each
        # replay; a graph break would only make more runs per step
        assert compiler.runs >= graphs.replayed + recording.recorded
        assert 1 <= len(compiler.compiled) <= 4 and graphs.uncompiled is None
    else:
        assert not compiler.compiled


def test_the_rows_padding_a_bucket_attend_to_every_column(backends) -> None:
    backend = backends("llama")
    graphs = StepGraphs(8, eager)
    graphed, plain = batch_pair(backend, graphs)
    with torch.inference_mode():
        ids = [prompt(backend, text) for text in TEXTS[:3]]
        for batch in (graphed, plain):
            batch.prefill_together(ids, [1, 1, 1])
        step_both(graphed, plain, 0, backend.vocab_size)
    mask = graphs.inputs[4].mask
    assert mask.shape == (4, 1, 1, graphed.cache.column_capacity)
    assert (mask[3] == 0).all()  # the padding row: every column, finite outputs
    lowest = torch.finfo(mask.dtype).min
    for row in range(3):  # a real row: its tokens and the step's column only
        held = graphed.cache.mask_buffer[row, : graphed.cache.end].bool()
        assert (mask[row, 0, 0, : graphed.cache.end][held] == 0).all()
        assert (mask[row, 0, 0, : graphed.cache.end][~held] == lowest).all()
        assert (mask[row, 0, 0, graphed.cache.end :] == lowest).all()


def poison(batch: ReservedCausalLMBatch, row: int) -> None:
    """NaN in every cell of a row, as a request that broke the model leaves it."""
    for layer in batch.cache.reserved_layers:
        for buffer in layer.buffers():
            buffer[row].fill_(float("nan"))


def joining(backend, text: str, rows: int = 1) -> ReservedCausalLMBatch:
    batch = ReservedCausalLMBatch(
        backend.model, ReservedCache(backend.cache_layers, 8, backend.model.device)
    )
    batch.prefill(prompt(backend, text), rows)
    return batch


def test_rows_left_by_a_failed_request_leave_nothing_behind_in_recorded_steps(backends) -> None:
    """A recorded step reads every column of its rows, those past the columns in use too: a
    row whose request broke the model (NaN in its cells) is cleared as it leaves, so that the
    request put in its place next, in the same batch or in the next wave on the kept cache,
    gets what it gets on a plain batch."""
    backend = backends("llama")
    graphs = StepGraphs(8, eager)
    graphed, plain = batch_pair(backend, graphs)
    vocab = backend.vocab_size
    with torch.inference_mode():
        ids = prompt(backend, PROMPTS[2])
        for batch in (graphed, plain):
            batch.prefill(ids, 2)
        step_both(graphed, plain, 0, vocab)
        for batch in (graphed, plain):
            poison(batch, 1)
            batch.keep([0])
            assert batch.absorb(joining(backend, PROMPTS[0]))
        for step in range(1, 4):
            step_both(graphed, plain, step, vocab)

        poison(graphed, 0)  # then every row leaves: the cache is kept for the next wave
        graphed.keep([])
        kept = graphed.cache
        assert kept.rows == 0
        graphed, plain = joining(backend, PROMPTS[1], 2), joining(backend, PROMPTS[1], 2)
        graphed.graphs = graphs
        graphed.move_to(kept)
        for step in range(4, 8):
            step_both(graphed, plain, step, vocab)


def test_graphs_are_refused_without_ready_masks(backends) -> None:
    """Load decides; a batch built against that decision is a programming error, said at once."""
    backend = backends("llama")
    cache = ReservedCache(backend.cache_layers, 4, backend.model.device)
    with pytest.raises(ValueError, match="recorded decode steps need ready masks"):
        ReservedCausalLMBatch(backend.model, cache, StepGraphs(4, eager), ready_masks=False)


def test_a_recording_that_fails_leaves_the_steps_eager(backends, caplog) -> None:
    backend = backends("llama")
    calls = []

    def failing(forward: Forward) -> Forward:
        calls.append(forward)
        raise RuntimeError("operation not permitted when stream is capturing")

    graphs = StepGraphs(8, failing)
    graphed, plain = batch_pair(backend, graphs)
    with torch.inference_mode(), caplog.at_level(logging.WARNING):
        ids = prompt(backend, PROMPTS[0])
        for batch in (graphed, plain):
            batch.prefill(ids, 2)
        for step in range(5):
            step_both(graphed, plain, step, backend.vocab_size)
    assert len(calls) == 1
    assert graphs.broken == "RuntimeError: operation not permitted when stream is capturing"
    warnings = [r.getMessage() for r in caplog.records if "eagerly" in r.getMessage()]
    assert len(warnings) == 1 and "stream is capturing" in warnings[0]


def test_a_batch_past_the_largest_bucket_runs_eagerly(backends) -> None:
    backend = backends("llama")
    recording = Counting()
    graphs = StepGraphs(2, recording)
    graphed, plain = batch_pair(backend, graphs)
    with torch.inference_mode():
        ids = prompt(backend, PROMPTS[0])
        for batch in (graphed, plain):
            batch.prefill(ids, 3)
        step_both(graphed, plain, 0, backend.vocab_size)
    assert recording.recorded == 0 and graphs.broken is None


def test_padding_rows_past_the_kv_cache_budget_run_the_step_eagerly(backends) -> None:
    """5 rows replay the graph of 8 while 8 rows at their columns fit in the cache's budget;
    as the columns grow past that (the 5 rows alone still fit: the decode loop keeps to the
    budget by them), the steps run eagerly, in buffers never past the budget, instead of the
    buffers being cut below the 8 rows a recorded step writes (which broke the graphs for
    good). Every step's logits equal the plain batch's."""
    backend = backends("llama")
    graphs = StepGraphs(8, Counting())
    ids = (prompt(backend, PROMPTS[0]) * 10)[:10]
    budget = 8 * 14 - 1  # 8 rows fit for 3 steps, 5 rows for 11
    cache = ReservedCache(backend.cache_layers, 8, backend.model.device, budget)
    graphed = ReservedCausalLMBatch(backend.model, cache, graphs)
    _, plain = batch_pair(backend, graphs)
    steps = 0
    with torch.inference_mode():
        for batch in (graphed, plain):
            batch.prefill(ids, 5)
        while 5 * (cache.end - cache.start + 2) <= budget:
            step_both(graphed, plain, steps, backend.vocab_size)
            steps += 1
            assert cache.row_capacity * cache.column_capacity <= budget
    assert graphs.broken is None
    assert 0 < graphs.replayed < steps  # graphed while the padding fit, eager after
    assert steps >= 6


@pytest.mark.usefixtures("fresh_compiles")
def test_a_compile_that_fails_leaves_the_steps_recorded_uncompiled(backends, caplog) -> None:
    backend = backends("llama")
    tries = []

    def failing(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
        tries.append(graph)
        raise RuntimeError("no C++ compiler")

    recording = Counting()
    graphs = StepGraphs(8, recording, torch_compiled(failing))
    graphed, plain = batch_pair(backend, graphs)
    with torch.inference_mode(), caplog.at_level(logging.WARNING):
        ids = prompt(backend, PROMPTS[0])
        for batch in (graphed, plain):
            batch.prefill(ids, 2)
        for step in range(3):
            step_both(graphed, plain, step, backend.vocab_size)
        for batch in (graphed, plain):  # a new bucket: recorded, not compiled again
            assert batch.absorb(joining(backend, PROMPTS[1], 2))
        for step in range(3, 6):
            step_both(graphed, plain, step, backend.vocab_size)
    assert len(tries) == 1
    assert graphs.uncompiled is not None and "no C++ compiler" in graphs.uncompiled
    assert graphs.broken is None and graphs.replayed == 6 and recording.recorded >= 2
    warnings = [r.getMessage() for r in caplog.records if "uncompiled" in r.getMessage()]
    assert len(warnings) == 1 and "no C++ compiler" in warnings[0]


@pytest.mark.usefixtures("fresh_compiles")
async def test_torch_compile_serves_what_transformers_generates(tiny_models, caplog) -> None:
    """The flag end to end on a CPU, with torch's own compiler (inductor): compiled at
    start-up, then greedy tokens equal ``model.generate``'s, from the compiled steps. On a
    CPU the log says that it does not pay there."""
    with caplog.at_level(logging.WARNING):
        backend = load(tiny_models["llama"], "--torch_compile", "--max_batch_size", "4")
    try:
        said = [r.getMessage() for r in caplog.records]
        (warning,) = [line for line in said if line.startswith("--torch_compile on a CPU")]
        assert "(BENCHMARKS.md: 45% at 16 streams)" in warning  # as printed, %-formatting done
        graphs = backend.graphs
        assert graphs is not None and graphs.compile is not None
        backend.tune()
        assert graphs.uncompiled is None and graphs.broken is None and graphs.recordings >= 3
        ids = [prompt(backend, text) for text in PROMPTS[:3]]
        expected = [reference_greedy(backend, one, MAX_TOKENS) for one in ids]
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        replayed = graphs.replayed
        got = await asyncio.gather(*(run(backend, one, params) for one in ids))
        assert [choice.token_ids for (choice,) in got] == expected
        assert graphs.replayed - replayed >= MAX_TOKENS - 1 and graphs.uncompiled is None
    finally:
        backend.shutdown()


@pytest.mark.usefixtures("fresh_compiles")
async def test_steps_are_compiled_at_start_up_not_while_serving(tiny_models) -> None:
    """Start-up compiles the steps (the largest bucket, the next, one row, over two cache
    widths); then requests of every bucket size, joining and leaving, over caches that grow,
    compile nothing more, and every step runs compiled."""
    backend = load(tiny_models["llama"], "--torch_compile", "--max_batch_size", "8")
    compiler = CountingCompiler()
    try:
        graphs = backend.graphs
        assert graphs is not None
        graphs.compile = torch_compiled(compiler)  # the same compiles, traced only
        backend.tune()
        at_start = len(compiler.compiled)
        assert 1 <= at_start <= 4
        texts = [" ".join(TEXTS[: i + 1]) for i in range(len(TEXTS))]
        lengths = (3, 40, 7, 25, 12, 60, 5, 33)

        async def one(text: str, tokens: int) -> list[Choice]:
            params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
            return await run(backend, prompt(backend, text), params)

        replayed, runs = graphs.replayed, compiler.runs
        await asyncio.gather(*(one(t, n) for t, n in zip(texts * 2, lengths, strict=False)))
        await one(TEXTS[0], 20)  # alone: one row
        assert len(compiler.compiled) == at_start, "serving compiled a step again"
        # steps that feed a prompt run eagerly (their shapes change with every prompt)
        assert graphs.replayed - replayed >= 60 - 8
        assert compiler.runs - runs >= graphs.replayed - replayed
        assert graphs.uncompiled is None and graphs.broken is None
    finally:
        backend.shutdown()


def test_torch_compile_on_a_model_without_graphs_says_so(tiny_models, caplog) -> None:
    with caplog.at_level(logging.WARNING):
        backend = load(tiny_models["t5"], "--torch_compile")
    try:
        assert backend.graphs is None
    finally:
        backend.shutdown()
    said = [r.getMessage() for r in caplog.records]
    assert any("--torch_compile: decode steps run uncompiled" in line for line in said)


def test_a_graphed_step_does_not_wait_for_the_device(backends) -> None:
    """Inputs copied into the recorded ones, the replay, the logits: no read of values (the
    model's own mask check included: the mask comes ready-made)."""
    backend = backends("llama")
    graphed, _ = batch_pair(backend, StepGraphs(8, eager))
    with torch.inference_mode():
        graphed.prefill(prompt(backend, PROMPTS[0]), 3)
        column = tokens(graphed, 0, backend.vocab_size)
        graphed.step(column)  # records
        with SyncCounter() as counter:
            for step in range(1, 4):
                graphed.step(tokens(graphed, step, backend.vocab_size))
    assert counter.total == 0, counter.counts


needs_cuda: Callable[..., object] = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"
)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.usefixtures("fresh_compiles")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_cuda_graphs_replay_what_eager_steps_compute(tiny_models, compiled: bool) -> None:
    """The recorded steps on a GPU; ``compiled`` (``--torch_compile``): inductor's kernels
    recorded as the CUDA graphs."""
    backend = load(tiny_models["llama"], "--dtype", "float32")
    try:
        assert backend.device.type == "cuda" and backend.graphs is not None
        graphs = StepGraphs(8, cuda_graph, torch_compiled() if compiled else None)
        graphed, plain = batch_pair(backend, graphs)
        with torch.inference_mode():
            ids = [prompt(backend, text) for text in TEXTS[:3]]
            for batch in (graphed, plain):
                batch.prefill_together(ids, [1, 1, 1])
            for step in range(40):
                column = tokens(plain, step, backend.vocab_size).to(backend.device)
                got, want = graphed.step(column), plain.step(column)
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert graphs.uncompiled is None and graphs.broken is None and graphs.recordings >= 1
    finally:
        backend.shutdown()
