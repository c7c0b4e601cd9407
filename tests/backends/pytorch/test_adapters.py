"""LoRA adapters on the transformers backend: greedy tokens equal PEFT's own
``PeftModel.generate`` for each adapter, with two adapters and the base model decoding in one
batch; prompts and prompts' parts of any adapter are fed in the running rows' decode step, each
token with its own adapter (equal to PEFT's forwards run apart), except an adapter that is not
plain LoRA linear layers, fed there only beside rows of its own; each row keeps its adapter as
rows are repeated, dropped, absorbed and split; no CUDA graph is replayed for them; adapters
that cannot be served are startup errors; adapters loaded and unloaded at run time while
requests decode."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from huggingfaceserver.backends.pytorch.adapters import BASE, LoraAdapters
from huggingfaceserver.backends.pytorch.decode_batch import PromptPart, ReservedCausalLMBatch
from huggingfaceserver.backends.pytorch.generator import TransformersGenerator, records_steps
from huggingfaceserver.backends.pytorch.kv_cache import ReservedCache
from huggingfaceserver.backends.pytorch.ragged import MIXED
from huggingfaceserver.backends.pytorch.step_graphs import StepGraphs, cuda_graph, eager
from huggingfaceserver.errors import BadRequest, Conflict, NotFound, StartupError
from huggingfaceserver.generation.params import SamplingParams
from huggingfaceserver.observability.syncs import SyncCounter
from tiny_models import LORA_TARGETS, build_lora_adapter

from .generation_helpers import PROMPTS, Choice, check_delta, load, prompt, run

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
ADAPTERS = ("sql", "chat")


@pytest.fixture(scope="module")
def adapter_dirs(tiny_models: dict[str, Path], tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    return {
        name: build_lora_adapter(tiny_models["llama"], root / name, seed)
        for seed, name in enumerate(ADAPTERS, start=1)
    }


def lora_flags(adapter_dirs: dict[str, Path]) -> list[str]:
    modules = [f"{name}={path}" for name, path in adapter_dirs.items()]
    return ["--enable-lora", "--lora-modules", *modules]


@pytest.fixture(scope="module")
def served(tiny_models, adapter_dirs) -> Iterator[TransformersGenerator]:
    """The tiny Llama with both adapters, chunked prefill of 8 tokens."""
    backend = load(tiny_models["llama"], *lora_flags(adapter_dirs), "--prefill_chunk_tokens", "8")
    yield backend
    backend.shutdown()


@pytest.fixture(scope="module")
def peft_greedy(tiny_models, adapter_dirs) -> Callable[[list[int], str | None], list[int]]:
    """PEFT's own ``generate``, greedy, on a model of its own per adapter (None: the base)."""
    models: dict[str | None, torch.nn.Module] = {}

    def greedy(prompt_ids: list[int], adapter: str | None) -> list[int]:
        if adapter not in models:
            model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"])
            if adapter is not None:
                model = PeftModel.from_pretrained(model, adapter_dirs[adapter])
            models[adapter] = model.eval()
        with torch.no_grad():
            output = models[adapter].generate(
                input_ids=torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=MAX_TOKENS
            )
        return output[0, len(prompt_ids) :].tolist()

    return greedy


def forward_adapters(lora: LoraAdapters, adapter_names: list[str]) -> list[str]:
    """The adapters of a PEFT forward: ``adapter_names`` (one per row), or for a forward by
    token (PEFT's rows all :data:`BASE`, the hooks adding each adapter) each token's."""
    if lora.token_groups is None:
        return adapter_names
    names = [BASE] * len(lora.grouped_for)
    for name, index in lora.token_groups.items():
        for i in index.tolist():
            names[i] = name
    return names


@contextmanager
def peft_forwards(
    backend: TransformersGenerator, slow: bool = False
) -> Iterator[list[tuple[list[str], list[int], list[int]]]]:
    """Each PEFT forward made inside the block: its adapters (:func:`forward_adapters`: one
    per batch row, or one per token of a forward by token, such as a decode step that feeds
    prompts of several adapters in its one row), the
    lengths of the prompts it fed in a decode step and the tokens of the prompts' parts it fed
    there (none for any other forward). ``slow``: every forward takes a little longer, so that
    later requests reliably find earlier ones still running."""
    seen: list[tuple[list[str], list[int], list[int]]] = []
    lora = backend.lora
    assert lora is not None

    def record(_module, _args, kwargs) -> None:
        if slow:
            threading.Event().wait(0.005)
        mixed = kwargs.get(MIXED)
        names = forward_adapters(lora, list(kwargs["adapter_names"]))
        if mixed is None:
            seen.append((names, [], []))
            return
        parts = [part.tokens for part in mixed.columns.parts]
        seen.append((names, [*mixed.columns.lengths], parts))

    handle = lora.peft_model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


def test_adapters_change_the_output(served, peft_greedy) -> None:
    ids = prompt(served, PROMPTS[1])
    outputs = {adapter: tuple(peft_greedy(ids, adapter)) for adapter in (None, *ADAPTERS)}
    assert len(set(outputs.values())) == 3  # else the comparisons below would prove little


async def test_each_adapter_alone_equals_peft_generate(served, peft_greedy) -> None:
    ids = prompt(served, PROMPTS[1])
    for adapter in (None, *ADAPTERS):
        (choice,) = await run(served, ids, GREEDY, adapter)
        assert choice.token_ids == peft_greedy(ids, adapter), adapter


async def test_two_adapters_and_the_base_model_share_the_batch(served, peft_greedy) -> None:
    """Requests of both adapters and of the base model at once, some of several choices,
    some stopping early (their rows dropped), one prompt fed in parts: each equals PEFT."""
    requests = [
        (prompt(served, PROMPTS[2]), "sql", GREEDY),  # fed in parts of 8
        (prompt(served, PROMPTS[1]), None, GREEDY),
        (prompt(served, PROMPTS[0]), "chat", SamplingParams(n=2, temperature=0, max_tokens=5)),
        (prompt(served, PROMPTS[1]), "chat", GREEDY),
        (prompt(served, PROMPTS[0]), "sql", SamplingParams(temperature=0, max_tokens=7)),
        (prompt(served, PROMPTS[0]), None, SamplingParams(n=2, temperature=0, max_tokens=9)),
    ]
    assert len(requests[0][0]) > 8
    with peft_forwards(served) as forwards:
        results = await asyncio.gather(
            *(run(served, ids, params, adapter) for ids, adapter, params in requests)
        )
    for (ids, adapter, params), choices in zip(requests, results, strict=True):
        expected = peft_greedy(ids, adapter)[: params.max_tokens]
        assert [choice.token_ids for choice in choices] == [expected] * params.n, adapter
    assert any({BASE, *ADAPTERS} <= set(names) for names, _, _ in forwards)  # one mixed


Adapted = tuple[list[int], str | None, SamplingParams]


async def staggered(backend: TransformersGenerator, requests: list[Adapted]) -> list[list[Choice]]:
    """Run the requests, each started once the one before has received two steps."""
    started = [asyncio.Event() for _ in requests]

    async def one(i: int, ids: list[int], adapter: str | None, params: SamplingParams):
        if i:
            await started[i - 1].wait()
        choices = [Choice() for _ in range(params.n)]
        received = 0
        try:
            async for deltas in backend.generate(ids, params, adapter):
                for delta in deltas:
                    check_delta(choices[delta.index], delta)
                received += 1
                if received == 2:
                    started[i].set()
        finally:
            started[i].set()
        return choices

    return await asyncio.gather(*(one(i, *request) for i, request in enumerate(requests)))


def check_peft(
    backend: TransformersGenerator,
    results: list[list[Choice]],
    requests: list[Adapted],
    peft_greedy,
) -> None:
    """Each choice's tokens are PEFT's, up to where PEFT's ``generate`` stopped: its own
    length, or an end-of-sequence token (the requests ignore it and go on)."""
    for (ids, adapter, params), choices in zip(requests, results, strict=True):
        expected = peft_greedy(ids, adapter)[: params.max_tokens]
        assert len(expected) == params.max_tokens or expected[-1] in backend.eos_token_ids
        got = [choice.token_ids[: len(expected)] for choice in choices]
        assert got == [expected] * params.n, adapter


@pytest.mark.parametrize("adapter", ["sql", None])
async def test_prompts_of_the_running_rows_adapter_are_fed_in_their_step(
    served, peft_greedy, adapter
) -> None:
    """While every running row and the joining request have one adapter (or all the base
    model), the request's prompt is fed in the rows' decode step, one PEFT forward with that
    adapter; each request gets PEFT's tokens."""
    assert served.mixes
    short, shorter = prompt(served, PROMPTS[1])[:8], prompt(served, PROMPTS[0])[:5]
    requests: list[Adapted] = [
        (prompt(served, PROMPTS[2]), adapter, GREEDY),  # fed in parts of 8
        (short, adapter, GREEDY),  # the next two within the 8 prompt tokens of a step
        (shorter, adapter, SamplingParams(n=2, temperature=0, max_tokens=9)),
    ]
    with peft_forwards(served, slow=True) as forwards:
        results = await staggered(served, requests)
    check_peft(served, results, requests, peft_greedy)
    packed = [(set(names), lengths) for names, lengths, _ in forwards if lengths]
    name = adapter or BASE
    assert packed == [({name}, [len(short)]), ({name}, [len(shorter)])]


async def test_long_prompts_of_any_adapter_are_fed_in_the_running_rows_steps(
    served, peft_greedy
) -> None:
    """The parts of a long prompt of the running rows' adapter, then of another adapter's,
    are each fed in the running rows' decode steps (one forward each, every token with its own
    adapter: every part of both is fed there, once); each request gets PEFT's tokens."""
    long = prompt(served, PROMPTS[2])  # fed in parts of 8
    turns = -(-len(long) // 8)
    assert turns > 1
    short = prompt(served, PROMPTS[1])[:6]
    requests: list[Adapted] = [
        (short, "sql", SamplingParams(temperature=0, max_tokens=60)),
        (long, "sql", GREEDY),
        (long, "chat", GREEDY),
    ]
    with peft_forwards(served, slow=True) as forwards:
        results = await staggered(served, requests)
    check_peft(served, results, requests, peft_greedy)
    in_steps = [(names, parts) for names, _, parts in forwards if parts]
    assert [sum(parts) for _, parts in in_steps] == [*chunks(len(long), 8)] * 2
    # one PEFT row of "sql" while all are its; by token once the "chat" part joins
    fed = [set(names[-parts[0] :]) for names, parts in in_steps]
    turns = len(chunks(len(long), 8))
    assert fed == [{"sql"}] * turns + [{"chat"}] * turns
    assert all(len(names) > parts[0] for names, parts in in_steps[turns:])
    assert all(names[0] == "sql" for names, _ in in_steps)  # the running row's token


def chunks(length: int, size: int) -> list[int]:
    """The sizes of the parts a prompt of ``length`` tokens is fed in."""
    return [min(size, length - start) for start in range(0, length, size)]


async def test_prompts_of_other_adapters_are_fed_in_the_running_rows_step(
    served, peft_greedy
) -> None:
    """A request whose adapter is not the running rows' has its prompt fed in their decode
    step all the same, each token with its own adapter (PEFT runs the rows' layers as the base
    model and each adapter's LoRA output is added to its own tokens), the rows of each
    adapter and of the base model together; each request gets PEFT's tokens."""
    requests: list[Adapted] = [
        (prompt(served, PROMPTS[1])[:8], "sql", GREEDY),
        (prompt(served, PROMPTS[0])[:7], "chat", GREEDY),
        (prompt(served, PROMPTS[1])[:5], None, SamplingParams(temperature=0, max_tokens=8)),
        (prompt(served, PROMPTS[0])[:6], "sql", SamplingParams(n=2, temperature=0, max_tokens=6)),
    ]
    with peft_forwards(served, slow=True) as forwards:
        results = await staggered(served, requests)
    check_peft(served, results, requests, peft_greedy)
    packed = [(names, lengths) for names, lengths, _ in forwards if lengths]
    assert [lengths for _, lengths in packed] == [[7], [5], [6]]
    assert [names[-lengths[0] :] for names, lengths in packed] == [
        ["chat"] * 7,
        [BASE] * 5,
        ["sql"] * 6,
    ]
    assert {"sql", "chat", BASE} <= set(packed[-1][0][:-6])  # beside rows of all three


def test_a_step_feeding_prompts_of_other_adapters_gives_what_peft_gives_apart(served) -> None:
    """One decode step of rows of an adapter and of the base model that also feeds a prompt
    of each adapter (one of them for two rows) and another adapter's prompt part: every logits
    row equals PEFT's forwards run apart, and the rows step on with their own adapters."""
    running = [prompt(served, PROMPTS[0]), prompt(served, PROMPTS[1])]
    joining = [prompt(served, PROMPTS[1])[:6], prompt(served, PROMPTS[0])[:4]]
    long = prompt(served, PROMPTS[2])
    vocab = served.vocab_size
    with torch.inference_mode():
        apart = served.new_batch()
        apart.prefill_together(running, [1, 1], ["sql", None])
        alone, in_parts = [served.new_batch(), served.new_batch()], served.new_batch()
        in_parts.prefill_part(long[:5], 0, "sql")
        expected = torch.cat(
            [
                apart.step([3, 4]),
                alone[0].prefill(joining[0], 1, adapter="chat")[0],
                alone[1].prefill(joining[1], 2, adapter="sql")[0],
                in_parts.score_part(long[5:11], 5, "sql"),
            ]
        )
        later = [
            torch.cat([apart.step([5, 6]), alone[0].step([7]), alone[1].step([8, 9])]),
            torch.cat([apart.step([1, 2]), alone[0].step([3]), alone[1].step([4, 5])]),
        ]

        packed, parted = served.new_batch(), served.new_batch()
        packed.prefill_together(running, [1, 1], ["sql", None])
        parted.prefill_part(long[:5], 0, "sql")
        assert packed.mixes_for("chat") and packed.mixes_for(None)
        part = PromptPart(parted, long[5:11], 5, every_position=True, adapter="sql")
        got = packed.step_mixing([3, 4], joining, [1, 2], ["chat", "sql"], [part])
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        assert packed.adapters == ["sql", BASE, "chat", "sql", "sql"]
        assert parted.adapters == ["sql"]
        for tokens, want in zip(([5, 6, 7, 8, 9], [1, 2, 3, 4, 5]), later, strict=True):
            torch.testing.assert_close(packed.step(tokens), want, atol=1e-4, rtol=1e-4)
    assert vocab > 9


def test_tokens_of_each_adapter_in_one_forward_give_peft_rows(served) -> None:
    """A forward by token (each token's adapter, or each row's for rows of several adapters)
    gives, row by row, PEFT's own mixed-adapter batch with each row's adapter; a token's
    adapter changes its own output only."""
    lora = served.lora
    assert lora is not None and lora.per_token == set(ADAPTERS)
    ids = torch.randint(0, served.vocab_size, (3, 5), generator=torch.Generator().manual_seed(3))
    rows = ["sql", BASE, "chat"]
    with torch.inference_mode():
        expected = lora.peft_model(adapter_names=rows, input_ids=ids).logits
        by_token = lora.forward_tokens([name for name in rows for _ in range(5)], input_ids=ids)
        by_row = lora.forward(rows, input_ids=ids)
        base = lora.peft_model(adapter_names=[BASE] * 3, input_ids=ids).logits
    for got in (by_token.logits, by_row.logits):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(expected[0], base[0]) and not torch.allclose(expected[2], base[2])
    torch.testing.assert_close(by_row.logits[1], base[1])
    assert lora.token_groups is None  # only during the forward


def test_a_step_of_rows_of_several_adapters_reads_no_host_index(served) -> None:
    """A decode step of rows of two adapters and the base model: inside the model nothing
    waits for the device (PEFT's own mixed batch indexes each LoRA layer's rows with a Python
    list, copied to a GPU from pageable memory, once per adapter and layer), and the rows'
    logits are PEFT's."""
    prompts = [prompt(served, text) for text in PROMPTS]
    adapters = ["sql", None, "chat"]
    with torch.inference_mode():
        batch = served.new_batch()
        batch.prefill_together(prompts, [1, 1, 1], adapters)
        with SyncCounter() as counter, counter.separating(served.model):
            got = batch.step([3, 4, 5])
        alone = []
        for ids, adapter, token in zip(prompts, adapters, [3, 4, 5], strict=True):
            one = served.new_batch()
            one.prefill(ids, 1, adapter=adapter)
            alone.append(one.step([token]))
    assert counter.in_module == 0, counter.counts
    torch.testing.assert_close(got, torch.cat(alone), atol=1e-4, rtol=1e-4)
    with torch.inference_mode(), SyncCounter() as peft_counter:
        served.lora.peft_model(
            adapter_names=["sql", BASE, "chat"], input_ids=torch.ones(3, 1).long()
        )
    assert peft_counter.total > 0  # what the step would have waited for on a GPU


@pytest.fixture(scope="module")
def with_embedding_adapter(tiny_models, adapter_dirs, peft_greedy, tmp_path_factory):
    """The tiny Llama with the ``sql`` adapter and ``vocab``, whose LoRA also targets the
    token embeddings (no plain linear layer: not mixed per token), and PEFT's greedy tokens
    for it."""
    vocab = build_lora_adapter(
        tiny_models["llama"],
        tmp_path_factory.mktemp("lora-vocab") / "vocab",
        7,
        (*LORA_TARGETS, "embed_tokens"),
    )
    dirs = {"sql": adapter_dirs["sql"], "vocab": vocab}
    backend = load(tiny_models["llama"], *lora_flags(dirs), "--prefill_chunk_tokens", "8")
    base = AutoModelForCausalLM.from_pretrained(tiny_models["llama"])
    model = PeftModel.from_pretrained(base, vocab).eval()

    def greedy(ids: list[int], adapter: str | None) -> list[int]:
        if adapter != "vocab":
            return peft_greedy(ids, adapter)
        with torch.no_grad():
            output = model.generate(
                input_ids=torch.tensor([ids]), do_sample=False, max_new_tokens=30
            )
        return output[0, len(ids) :].tolist()

    yield backend, greedy
    backend.shutdown()


async def test_an_adapter_not_mixed_per_token_is_fed_only_beside_its_own_rows(
    with_embedding_adapter,
) -> None:
    """An adapter on the token embeddings is not mixed per token: its prompt runs in a
    forward of its own beside rows of another adapter, and is fed in the rows' step where
    they all have its adapter; each request gets PEFT's tokens."""
    backend, greedy = with_embedding_adapter
    lora = backend.lora
    assert lora.per_token == {"sql"}
    assert not lora.packs(["sql", "vocab"]) and lora.packs(["vocab"]) and lora.packs(["sql", BASE])
    first, second = prompt(backend, PROMPTS[1])[:8], prompt(backend, PROMPTS[0])[:6]
    requests: list[Adapted] = [
        (first, "sql", GREEDY),
        (second, "vocab", GREEDY),  # beside a sql row: apart
    ]
    with peft_forwards(backend, slow=True) as forwards:
        results = await staggered(backend, requests)
    check_peft(backend, results, requests, greedy)
    assert not [lengths for _, lengths, _ in forwards if lengths]
    requests = [
        (first, "vocab", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)),
        (second, "vocab", GREEDY),  # beside a vocab row: in its step
    ]
    with peft_forwards(backend, slow=True) as forwards:
        results = await staggered(backend, requests)
    check_peft(backend, results, requests, greedy)
    assert [(set(names), lengths) for names, lengths, _ in forwards if lengths] == [
        ({"vocab"}, [len(second)])
    ]


def test_steps_with_adapters_are_recorded_on_a_gpu_uncompiled() -> None:
    """With LoRA adapters a step is recorded with every adapter masked per row: as a CUDA
    graph on a GPU; never compiled (``--torch_compile`` on a CPU records nothing then)."""
    assert records_steps(True, "cuda", False, lora=False)
    assert records_steps(True, "cuda", False, lora=True)
    assert not records_steps(True, "cuda", True, lora=False)
    assert not records_steps(False, "cuda", False, lora=False)
    assert not records_steps(True, "cpu", False, lora=False)
    # --torch_compile records (compiles) the steps on a CPU too, never with adapters
    assert records_steps(True, "cpu", False, lora=False, compiles=True)
    assert not records_steps(True, "cpu", False, lora=True, compiles=True)
    assert not records_steps(False, "cpu", False, lora=False, compiles=True)


def lora_batch(backend: TransformersGenerator, graphs: StepGraphs | None) -> ReservedCausalLMBatch:
    cache = ReservedCache(backend.cache_layers, 4, backend.model.device)
    return ReservedCausalLMBatch(backend.model, cache, graphs, lora=backend.lora)


def step_pair(graphed, plain, step: int, vocab: int) -> None:
    column = (torch.arange(graphed.cache.rows) * 7 + step * 13) % vocab
    got, want = graphed.step(column), plain.step(column)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_recorded_steps_of_rows_of_several_adapters_equal_the_eager_ones(served) -> None:
    """A recorded step (a CUDA graph on a GPU; replayed eagerly here) runs every adapter on
    every row, each masked to its own rows: rows of two adapters and of the base model, then
    fewer of them, give the logits of the eager batch, which the tests above hold to PEFT's;
    without waiting for the device."""
    graphs = StepGraphs(4, eager)
    graphed, plain = lora_batch(served, graphs), lora_batch(served, None)
    vocab = served.vocab_size
    with torch.inference_mode():
        prompts = [prompt(served, text) for text in PROMPTS[:3]]
        for batch in (graphed, plain):
            batch.prefill_together(prompts, [1, 1, 1], ["sql", None, "chat"])
        for step in range(4):
            step_pair(graphed, plain, step, vocab)
        column = ((torch.arange(3) * 7 + 4 * 13) % vocab).to(served.device)
        with SyncCounter() as counter:
            got = graphed.step(column)
        torch.testing.assert_close(got, plain.step(column), atol=1e-4, rtol=1e-4)
        for batch in (graphed, plain):
            batch.keep([2, 0])  # chat, then sql: the masks follow the rows
        for step in range(5, 9):
            step_pair(graphed, plain, step, vocab)
    assert graphs.broken is None and graphs.replayed == 9
    assert graphs.over is not None and graphs.over[2] == ("sql", "chat")
    assert counter.total == 0, counter.counts  # the masks made once, on their way ahead
    recorded = graphs.recordings
    graphs.forget()  # as loading or unloading an adapter does: its name may come back
    assert graphs.over is None and not graphs.replays
    with torch.inference_mode():
        step_pair(graphed, plain, 9, vocab)
    assert graphs.recordings == recorded + 1 and graphs.over[2] == ("sql", "chat")


def test_a_row_of_an_adapter_not_mixed_per_token_steps_eagerly(with_embedding_adapter) -> None:
    backend, _ = with_embedding_adapter
    graphs = StepGraphs(4, eager)
    graphed, plain = lora_batch(backend, graphs), lora_batch(backend, None)
    with torch.inference_mode():
        for batch in (graphed, plain):
            batch.prefill_together([prompt(backend, PROMPTS[0])] * 2, [1, 1], ["sql", "vocab"])
        for step in range(3):
            step_pair(graphed, plain, step, backend.vocab_size)
        assert graphs.replayed == 0  # PEFT's batches: indices chosen in Python
        for batch in (graphed, plain):
            batch.keep([0])  # sql alone: recorded
        for step in range(3, 5):
            step_pair(graphed, plain, step, backend.vocab_size)
    assert graphs.replayed == 2 and graphs.over is not None and graphs.over[2] == ("sql",)
    graphed, plain = lora_batch(backend, graphs), lora_batch(backend, None)
    with torch.inference_mode():
        for batch in (graphed, plain):  # vocab alone: eager (recorded, it ran as the base)
            batch.prefill_together([prompt(backend, PROMPTS[1])], [1], ["vocab"])
        for step in range(2):
            step_pair(graphed, plain, step, backend.vocab_size)
    assert graphs.replayed == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_of_rows_of_several_adapters_replay_the_eager_steps(served) -> None:
    """On a GPU the server records steps with adapters as CUDA graphs (load decides it)."""
    assert served.graphs is not None
    graphs = StepGraphs(4, cuda_graph)
    graphed, plain = lora_batch(served, graphs), lora_batch(served, None)
    with torch.inference_mode():
        prompts = [prompt(served, text) for text in PROMPTS[:3]]
        for batch in (graphed, plain):
            batch.prefill_together(prompts, [1, 1, 1], ["sql", None, "chat"])
        for step in range(20):
            column = (torch.arange(graphed.cache.rows) * 7 + step * 13) % served.vocab_size
            column = column.to(served.device)
            got, want = graphed.step(column), plain.step(column)
            torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
            if step == 10:
                for batch in (graphed, plain):
                    batch.keep([2, 0])
    assert graphs.broken is None and graphs.replayed == 20


def test_rows_keep_their_adapters_through_split_absorb_and_keep(served) -> None:
    """Rows prefilled together with different adapters, stepped, split apart, stepped, merged
    back and thinned: every step's logits equal those of each row alone."""
    prompts = [prompt(served, text) for text in PROMPTS]
    adapters = ["sql", None, "chat"]
    tokens = torch.randint(
        0, served.vocab_size, (4, 6), generator=torch.Generator().manual_seed(0)
    ).tolist()
    with torch.inference_mode():
        alone = []
        for ids, adapter, count in zip(prompts, adapters, [1, 2, 1], strict=True):
            batch = served.new_batch()
            batch.prefill(ids, count, adapter=adapter)
            alone.append(batch)
        row_of = [0, 1, 1, 2]  # the prompt of each of the four rows
        expected = []
        for step in range(6):
            logits = [
                alone[p].step([tokens[r][step] for r in range(4) if row_of[r] == p])
                for p in range(3)
            ]
            expected.append(torch.cat(logits))

        batch = served.new_batch()
        batch.prefill_together(prompts, [1, 2, 1], adapters)
        assert batch.adapters == ["sql", BASE, BASE, "chat"]
        got = [batch.step([tokens[r][0] for r in range(4)])]
        moved = batch.split([0, 3])  # the adapter rows out, the base rows stay
        assert (moved.adapters, batch.adapters) == (["sql", "chat"], [BASE, BASE])
        for step in (1, 2):
            apart = moved.step([tokens[0][step], tokens[3][step]])
            rest = batch.step([tokens[1][step], tokens[2][step]])
            got.append(torch.stack([apart[0], rest[0], rest[1], apart[1]]))
        assert moved.absorb(batch)  # rows now: sql, chat, base, base
        assert moved.adapters == ["sql", "chat", BASE, BASE]
        order = [0, 3, 1, 2]
        for step in (3, 4):
            logits = moved.step([tokens[r][step] for r in order])
            got.append(logits[[0, 2, 3, 1]])
        moved.keep([1, 2])  # chat and the first base row
        assert moved.adapters == ["chat", BASE]
        last = moved.step([tokens[3][5], tokens[1][5]])
    for step, (mine, theirs) in enumerate(zip(got, expected[:5], strict=True)):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4, msg=f"step {step}")
    torch.testing.assert_close(last, expected[5][[3, 1]], atol=1e-4, rtol=1e-4)


def test_an_unknown_adapter_is_a_bad_request(served) -> None:
    with pytest.raises(BadRequest, match="unknown LoRA adapter 'nope'"):
        served.check_request(prompt(served), GREEDY, "nope")


def test_the_adapters_are_the_served_names(served) -> None:
    assert list(served.adapters) == list(ADAPTERS)


def test_a_directory_without_an_adapter_is_a_startup_error(tiny_models, tmp_path) -> None:
    with pytest.raises(StartupError, match=f"LoRA adapter sql: no PEFT adapter at {tmp_path}"):
        load(tiny_models["llama"], "--enable-lora", "--lora-modules", f"sql={tmp_path}")


def test_an_adapter_of_another_model_is_a_startup_error(tiny_models, adapter_dirs) -> None:
    """An adapter made for the 32-wide tiny Llama on the 64-wide one: its shapes do not fit."""
    flags = ["--enable-lora", "--lora-modules", f"sql={adapter_dirs['sql']}"]
    with pytest.raises(StartupError, match="LoRA adapter sql .* does not fit LlamaForCausalLM"):
        load(tiny_models["llama64"], *flags)


@pytest.mark.parametrize(
    ("setting", "says"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"bias": "lora_only"}, "biases"),
        ({"init_lora_weights": "pissa"}, "rewrites the base model's weights"),
        ({"target_parameters": ["mlp.gate_proj.weight"]}, "target_parameters"),
        ({"alora_invocation_tokens": [5, 6]}, "activated LoRA"),
        ({"peft_type": "NOT_A_PEFT_TYPE"}, "no PEFT adapter"),
    ],
)
def test_adapters_peft_cannot_mix_or_that_change_the_base_are_startup_errors(
    tiny_models, adapter_dirs, tmp_path, setting, says
) -> None:
    """As vLLM refuses them: a trained bias or a PiSSA start changes the base model every
    request shares, target_parameters fails every forward given adapter_names, an activated
    LoRA would decode its answer with the base model; a peft_type PEFT lacks was a 500."""
    folder = tmp_path / "adapter"
    shutil.copytree(adapter_dirs["sql"], folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **setting}))
    with pytest.raises(StartupError, match=f"LoRA adapter sql: .*{says}"):
        load(tiny_models["llama"], "--enable-lora", "--lora-modules", f"sql={folder}")


def test_an_adapter_that_replaces_a_module_is_not_mixed_by_token(
    tiny_models, adapter_dirs, tmp_path
) -> None:
    """``modules_to_save`` (here the LM head): PEFT's mixed batches pick the adapter's own
    module per row; a forward by token would run the base model's for every row. Beside a
    base row, each row gets what PEFT gives it alone."""
    saved = build_lora_adapter(
        tiny_models["llama"], tmp_path / "saved", 9, modules_to_save=("lm_head",)
    )
    backend = load(tiny_models["llama"], *lora_flags({"sql": adapter_dirs["sql"], "saved": saved}))
    try:
        lora = backend.lora
        assert lora.per_token == {"sql"}
        assert not lora.masks_cover(["saved"]) and not lora.packs(["sql", "saved"])
        generator = torch.Generator().manual_seed(4)
        ids = torch.randint(0, backend.vocab_size, (2, 5), generator=generator)
        with torch.inference_mode():
            got = lora.forward([BASE, "saved"], input_ids=ids).logits
        model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"])
        with torch.no_grad():
            base = model(input_ids=ids[:1]).logits
            adapted = PeftModel.from_pretrained(model, saved).eval()(input_ids=ids[1:]).logits
        torch.testing.assert_close(got[:1], base, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got[1:], adapted, atol=1e-4, rtol=1e-4)
    finally:
        backend.shutdown()


def test_a_sequence_to_sequence_model_takes_no_adapter(tiny_models, adapter_dirs) -> None:
    flags = ["--enable-lora", "--lora-modules", f"sql={adapter_dirs['sql']}"]
    with pytest.raises(StartupError, match="need a decoder-only model"):
        load(tiny_models["t5"], *flags)


# --- adapters at run time -------------------------------------------------------------------


@pytest.fixture(scope="module")
def runtime(tiny_models, adapter_dirs) -> Iterator[TransformersGenerator]:
    """The tiny Llama with no adapter at startup, loading them at run time from the folder
    that holds ``sql`` and ``chat``."""
    folder = adapter_dirs["sql"].parent
    backend = load(
        tiny_models["llama"], "--enable-lora", "--enable_runtime_lora", "--lora_adapter_dir",
        str(folder),
    )  # fmt: skip
    yield backend
    backend.shutdown()


async def test_adapters_load_and_unload_while_requests_run(runtime, peft_greedy) -> None:
    """A base request decodes while ``sql`` is loaded and later ``chat``; both serve PEFT's
    output at once; an unloaded adapter is refused from then on. The base request, under way
    throughout, is the base model's."""
    ids = prompt(runtime, PROMPTS[1])
    base = runtime.generate(ids, GREEDY)
    received = [(await anext(base))[0].token_ids[0]]
    await runtime.load_adapter("sql", "sql")
    received.append((await anext(base))[0].token_ids[0])
    await runtime.load_adapter("chat", str(runtime.config.lora_adapter_dir) + "/chat")
    assert list(runtime.adapters) == ["sql", "chat"]
    sql, chat = await asyncio.gather(
        run(runtime, ids, GREEDY, "sql"), run(runtime, ids, GREEDY, "chat")
    )
    received += [deltas[0].token_ids[0] async for deltas in base]
    assert received == peft_greedy(ids, None)
    assert sql[0].token_ids == peft_greedy(ids, "sql")
    assert chat[0].token_ids == peft_greedy(ids, "chat")
    await runtime.unload_adapter("sql")
    with pytest.raises(BadRequest, match="unknown LoRA adapter 'sql'"):
        await run(runtime, ids, GREEDY, "sql")
    assert (await run(runtime, ids, GREEDY, "chat"))[0].token_ids == peft_greedy(ids, "chat")
    await runtime.unload_adapter("chat")
    assert (await run(runtime, ids, GREEDY))[0].token_ids == peft_greedy(ids, None)


async def test_an_adapter_in_use_is_not_unloaded(runtime, peft_greedy) -> None:
    await runtime.load_adapter("sql", "sql")
    ids = prompt(runtime, PROMPTS[0])
    stream = runtime.generate(ids, GREEDY, "sql")
    first = await anext(stream)
    with pytest.raises(Conflict, match="in use by 1 requests"):
        await runtime.unload_adapter("sql")
    rest = [deltas[0].token_ids[0] async for deltas in stream]
    assert [first[0].token_ids[0], *rest] == peft_greedy(ids, "sql")
    await runtime.unload_adapter("sql")
    assert "sql" not in runtime.adapters


async def test_a_left_request_frees_its_adapter(runtime) -> None:
    """A consumer that leaves mid-stream no longer holds the adapter: it unloads, and the
    requests still decoding go on."""
    await runtime.load_adapter("sql", "sql")
    others = runtime.generate(prompt(runtime, PROMPTS[2]), GREEDY, None)
    await anext(others)
    stream = runtime.generate(prompt(runtime, PROMPTS[0]), GREEDY, "sql")
    await anext(stream)
    await stream.aclose()
    await runtime.unload_adapter("sql")
    assert len([deltas async for deltas in others]) == MAX_TOKENS - 1


async def test_a_runtime_adapter_that_does_not_fit_is_a_bad_request(
    runtime, tiny_models, tmp_path_factory
) -> None:
    folder = Path(str(runtime.config.lora_adapter_dir))
    wide = build_lora_adapter(tiny_models["llama64"], folder / "wide", 3)
    with pytest.raises(BadRequest, match="LoRA adapter wide .* does not fit"):
        await runtime.load_adapter("wide", str(wide))
    assert "wide" not in runtime.adapters and not runtime.adapters.loading
    with pytest.raises(BadRequest, match="outside --lora_adapter_dir"):
        await runtime.load_adapter("x", str(tmp_path_factory.mktemp("outside")))


async def test_runtime_loading_is_a_404_unless_enabled(served) -> None:
    with pytest.raises(NotFound, match="--enable_runtime_lora"):
        await served.load_adapter("x", "/tmp")
    with pytest.raises(NotFound, match="--enable_runtime_lora"):
        await served.unload_adapter("sql")
