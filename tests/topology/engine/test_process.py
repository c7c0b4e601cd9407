"""The engine and a front's client in one process: :class:`Engine` serves a tiny encoder or
generator on an ``ipc://`` socket from a thread with its own event loop, :class:`EngineClient`
talks to it from the test's loop, exactly as a front process does over the same socket."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import huggingfaceserver.topology.engine.process as engine_process
from huggingfaceserver import assembly
from huggingfaceserver.assembly import engine_local_backend
from huggingfaceserver.backends.base import EncoderBackend, GenerationBackend
from huggingfaceserver.backends.pytorch.decode_loop import DecodeRequest
from huggingfaceserver.backends.pytorch.generator import TransformersGenerator
from huggingfaceserver.cli import parse_args
from huggingfaceserver.errors import BadRequest, ServerError, StartupError
from huggingfaceserver.generation.params import ChoiceDelta, Constraint, SamplingParams
from huggingfaceserver.topology.engine import backend as front_backends
from huggingfaceserver.topology.engine.backend import EngineGenerator
from huggingfaceserver.topology.engine.client import DeltaQueue, EngineClient
from huggingfaceserver.topology.engine.messages import Abort
from huggingfaceserver.topology.engine.process import Engine

DEADLINE_S = 15.0


@dataclass
class EngineThread:
    """An :class:`Engine` running in a thread; ``stop()`` does what SIGUSR1 does."""

    engine: Engine
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    stops: list[Callable[[], None]] = field(default_factory=list)
    outcome: list[BaseException] = field(default_factory=list)

    def stop(self) -> None:
        for stop in self.stops:
            self.loop.call_soon_threadsafe(stop)
        self.thread.join(DEADLINE_S)
        assert not self.thread.is_alive(), "the engine did not stop"
        if self.outcome:
            raise self.outcome[0]


@pytest.fixture(autouse=True)
def no_heap_freeze(monkeypatch):
    """The engine freezes its loaded heap (``gc.freeze``): here that would be pytest's."""
    monkeypatch.setattr(engine_process, "freeze_loaded_heap", lambda: None)


def engine_backend(path: Path, *flags: str) -> EncoderBackend:
    """The backend an engine process builds for these flags (not loaded: the engine loads)."""
    backend = engine_local_backend(parse_args(["--model_dir", str(path), *flags]))
    assert isinstance(backend, EncoderBackend)
    return backend


def engine_generator(path: Path, *flags: str) -> TransformersGenerator:
    """The generation backend an engine process builds for this model (not loaded)."""
    backend = engine_local_backend(
        parse_args(["--model_dir", str(path), "--backend", "huggingface", *flags])
    )
    assert isinstance(backend, TransformersGenerator)
    return backend


@contextmanager
def engine_thread(
    backend: EncoderBackend | GenerationBackend, address: str, executor: Executor | None = None
) -> Iterator[EngineThread]:
    """``executor``: the engine loop's worker threads (``asyncio.to_thread``), if not the
    default pool."""
    loop = asyncio.new_event_loop()
    if executor is not None:
        loop.set_default_executor(executor)
    engine = Engine(backend, address, fronts=1)
    running = EngineThread(engine, loop, threading.Thread(target=lambda: None))
    stop_known = threading.Event()

    def add_signal_handler(_signal: int, callback: Callable[[], None]) -> None:
        # signal handlers need the main thread; the test calls the callback instead
        running.stops.append(callback)
        stop_known.set()

    loop.add_signal_handler = add_signal_handler  # type: ignore[method-assign, assignment]

    def run() -> None:
        try:
            loop.run_until_complete(engine.run())
        except BaseException as exc:  # reported by stop()
            running.outcome.append(exc)
        finally:
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()

    running.thread = threading.Thread(target=run, name="engine", daemon=True)
    running.thread.start()
    assert stop_known.wait(DEADLINE_S), running.outcome
    try:
        yield running
    finally:
        running.stop()


def gated(backend: EncoderBackend) -> threading.Event:
    """Hold the backend's load until the returned event is set."""
    gate = threading.Event()
    load = backend.load

    def held_load() -> None:
        assert gate.wait(DEADLINE_S), "the test never let the model load"
        load()

    backend.load = held_load  # type: ignore[method-assign]
    return gate


def close_in_time(client: EngineClient, timeout: float) -> bool:
    """Whether ``client.close()`` returned within ``timeout``. It runs in a thread while this
    one waits (the loop does nothing meanwhile, as if it ran there), so that a close that
    hangs fails one test, not the session."""
    closer = threading.Thread(target=client.close, name="close-client", daemon=True)
    closer.start()
    closer.join(timeout)
    return not closer.is_alive()


@contextmanager
def clients(address: str, fronts: int, count: int | None = None) -> Iterator[list[EngineClient]]:
    """``count`` (default: ``fronts``) clients of a server with ``fronts`` front processes."""
    made = [EngineClient(address, index, fronts) for index in range(count or fronts)]
    try:
        yield made
    finally:
        for client in made:
            close_in_time(client, 1.0)


async def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {DEADLINE_S} s: {what}"
        await asyncio.sleep(0.01)


async def ready(client: EngineClient) -> None:
    """Connect and wait (off the loop, as a front's loader does) until the engine serves."""
    await client.start()
    await asyncio.to_thread(client.wait_ready, DEADLINE_S)


@asynccontextmanager
async def one_front(
    backend: EncoderBackend | GenerationBackend, tmp_path: Path
) -> AsyncIterator[tuple[EngineThread, EngineClient]]:
    """The backend's engine (in a thread) and one front's client, connected and ready."""
    with (
        engine_thread(backend, f"ipc://{tmp_path}/engine.sock") as running,
        clients(running.engine.address, fronts=1) as [client],
    ):
        await ready(client)
        yield running, client


async def local_results(backend: EncoderBackend, rows: Sequence[Any], kind: str) -> list[Any]:
    return await backend.submit_rows(list(rows), kind)  # type: ignore[attr-defined]


def as_json(results: list[Any]) -> Any:
    """Results as the protocol layer renders them (msgpack, like JSON, has lists, not tuples)."""
    return json.loads(json.dumps(results))


ENCODERS = {
    "classification-probabilities-labels": (
        "bert_sequence_classification",
        ["--return_probabilities", "--return_labels"],
        ["I love this movie!", "This film was terrible.", "The food was okay."],
    ),
    "token-classification-offsets": (
        "bert_token_classification",
        ["--return_offsets_mapping"],
        ["John lives in New York.", "My name is Sarah and I live in London."],
    ),
    "fill-mask": ("bert_fill_mask", [], ["The capital of France is [MASK]."]),
    "embedding": ("st_cls", [], ["A man is eating food.", "A man is eating bread."]),
}


@pytest.mark.parametrize(("name", "flags", "texts"), ENCODERS.values(), ids=list(ENCODERS))
async def test_engine_results_are_the_backends_own(
    tiny_models, encoder, tmp_path, name, flags, texts
):
    """Rows tokenized by the in-process backend, encoded by the engine over the socket, give
    the results that backend gives them itself."""
    local = encoder(tiny_models[name], *flags).backend
    _, rows = local.prepare_rows(texts)
    expected = await local_results(local, rows, "task")
    backend = engine_backend(tiny_models[name], *flags)
    with (
        engine_thread(backend, f"ipc://{tmp_path}/engine.sock") as running,
        clients(running.engine.address, fronts=1) as [client],
    ):
        await ready(client)
        assert as_json(await client.encode(rows, "task")) == as_json(expected)
        one_by_one = [await client.encode([row], "task") for row in rows]
        assert as_json([result for [result] in one_by_one]) == as_json(expected)


async def test_rows_for_sentence_transformers_models_keep_their_columns_and_kinds(
    sentence_models, encoder, tmp_path
):
    """A prompt left out of the pooling (the rows' pooling mask) and every kind of result an
    embedding request may ask for travel to the engine and back as the backend makes them."""
    path = sentence_models["instructor", "st6"]
    local = encoder(path).backend
    prompt = local.prompts.default
    _, rows = local.prepare_rows(["A man is eating food.", "bread"], None, prompt)
    assert "pooling_mask" in rows[0] and not rows[0]["pooling_mask"][:3].any()
    backend = engine_backend(path)
    with (
        engine_thread(backend, f"ipc://{tmp_path}/engine.sock") as running,
        clients(running.engine.address, fronts=1) as [client],
    ):
        await ready(client)
        for kind in ("task", "unnormalized", "normalized", "tokens"):
            expected = await local_results(local, rows, kind)
            got = await client.encode(rows, kind)
            for mine, theirs in zip(got, expected, strict=True):  # ("tokens": rows differ)
                assert np.allclose(mine, theirs, atol=1e-6), kind
        with pytest.raises(BadRequest, match="text_embedding model makes no 'scores' results"):
            await client.encode(rows, "scores")


async def test_task_rows_and_pair_rows_in_flight_together(tiny_models, encoder, tmp_path):
    """Each request's kind travels with its rows: a task request and a pair request sent at
    once get the task's predictions and the pair scores the backend computes itself."""
    flags = ["--return_probabilities"]
    local = encoder(tiny_models["bert_sequence_classification"], *flags).backend
    _, task_rows = local.prepare_rows(["I love this movie!", "The food was okay."])
    pairs = [("Paris", "Paris is in France."), ("Paris", "A red ball.")]
    _, pair_rows = local.prepare_pair_rows(pairs)
    expected_task = await local_results(local, task_rows, "task")
    expected_pairs = await local_results(local, pair_rows, "scores")
    backend = engine_backend(tiny_models["bert_sequence_classification"], *flags)
    with (
        engine_thread(backend, f"ipc://{tmp_path}/engine.sock") as running,
        clients(running.engine.address, fronts=1) as [client],
    ):
        await ready(client)
        got_task, got_pairs = await asyncio.gather(
            client.encode(task_rows, "task"), client.encode(pair_rows, "scores")
        )
    assert got_task == expected_task
    assert np.allclose(got_pairs, expected_pairs, atol=1e-6)


async def test_aborts_of_unknown_and_cancelled_requests_are_harmless(
    tiny_models, encoder, tmp_path
):
    local = encoder(tiny_models["st_cls"]).backend
    _, rows = local.prepare_rows(["A man is eating food."])
    expected = await local_results(local, rows, "task")
    with (
        engine_thread(engine_backend(tiny_models["st_cls"]), f"ipc://{tmp_path}/e.sock") as running,
        clients(running.engine.address, fronts=1) as [client],
    ):
        await ready(client)
        client.channel.send(Abort(12345))
        client.channel.send(Abort(12346, [0, 1]))
        assert await client.encode(rows, "task") == expected
        cancelled = asyncio.ensure_future(client.encode(rows, "task"))
        await asyncio.sleep(0)  # sent
        cancelled.cancel()
        assert await client.encode(rows, "task") == expected
        # the abort left before the request above, on the same connection: all settled
        assert running.engine.live == {}
        assert client.waiting == {}
        assert running.thread.is_alive()


async def test_ready_only_once_the_model_is_loaded(tiny_models, tmp_path):
    backend = engine_backend(tiny_models["st_cls"])
    gate = gated(backend)
    with (
        engine_thread(backend, f"ipc://{tmp_path}/engine.sock") as running,
        clients(running.engine.address, fronts=1) as [client],
    ):
        await client.start()
        await until(lambda: client.state is not None, "the engine answers the hello")
        assert client.state is not None
        assert (client.state.loaded, client.state.fronts) == (False, 1)
        with pytest.raises(StartupError, match="not ready"):
            await asyncio.to_thread(client.wait_ready, 0.3)
        gate.set()
        state = await asyncio.to_thread(client.wait_ready, DEADLINE_S)
        assert (state.loaded, state.fronts, state.facts) == (True, 1, None)


async def test_ready_only_once_every_front_said_hello(tiny_models, tmp_path):
    backend = engine_backend(tiny_models["st_cls"])
    with (
        engine_thread(backend, f"ipc://{tmp_path}/engine.sock") as running,
        clients(running.engine.address, fronts=2) as [first, second],
    ):
        await first.start()
        await until(lambda: first.state is not None and first.state.loaded, "the model is loaded")
        assert first.state is not None and first.state.fronts == 1
        with pytest.raises(StartupError, match="not ready"):
            await asyncio.to_thread(first.wait_ready, 0.3)
        await second.start()
        states = await asyncio.gather(
            *(asyncio.to_thread(client.wait_ready, DEADLINE_S) for client in (first, second))
        )
        assert [(state.loaded, state.fronts) for state in states] == [(True, 2), (True, 2)]


async def test_a_client_closes_at_once(tiny_models, tmp_path):
    """A stopping front closes its client (``Context.term`` once waited forever for the
    unclosed monitor socket: the front hung until the supervisor killed it)."""
    backend = engine_backend(tiny_models["st_cls"])
    with (
        engine_thread(backend, f"ipc://{tmp_path}/engine.sock") as running,
        clients(running.engine.address, fronts=1) as [client],
    ):
        await ready(client)
        assert close_in_time(client, 5.0), "EngineClient.close() still blocked after 5 s"


CHOICES = ("red", "green")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
CHOSEN = SamplingParams(
    temperature=0.0, max_tokens=8, constraint=Constraint("choice", json.dumps(CHOICES))
)


@dataclass
class HeldChecks:
    """Constrained requests' checks (where their grammar compiles), held until ``gate``."""

    entered: threading.Event = field(default_factory=threading.Event)
    gate: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)
    """The threads that checked a constrained request."""

    async def wait_entered(self) -> None:
        assert await asyncio.to_thread(self.entered.wait, DEADLINE_S), "no compile started"


def hold_constrained_checks(
    monkeypatch: pytest.MonkeyPatch, backend: TransformersGenerator | EngineGenerator
) -> HeldChecks:
    """Hold ``backend.check_request``, which compiles a constrained request's grammar, for
    constrained requests until the returned gate is set; unconstrained ones pass."""
    held = HeldChecks()
    check = backend.check_request

    def held_check(
        prompt_ids: list[int], params: SamplingParams, adapter: str | None = None
    ) -> None:
        if params.constraint is not None:
            held.threads.append(threading.current_thread())
            held.entered.set()
            assert held.gate.wait(DEADLINE_S), "the test never released the compile"
        check(prompt_ids, params, adapter)

    monkeypatch.setattr(backend, "check_request", held_check)
    return held


async def collected(queue: DeltaQueue) -> list[ChoiceDelta]:
    """A one-choice generation's deltas from the engine until it finishes; a failure raises."""
    deltas: list[ChoiceDelta] = []
    while (item := await asyncio.wait_for(queue.get(), DEADLINE_S)) is not None:
        if isinstance(item, BaseException):
            raise item
        deltas += item
    return deltas


def token_ids(deltas: list[ChoiceDelta]) -> list[int]:
    return [token_id for delta in deltas for token_id in delta.token_ids]


def chosen_text(backend: TransformersGenerator, deltas: list[ChoiceDelta]) -> str:
    """The text of a ``CHOSEN`` generation's tokens, its finish checked."""
    assert deltas[-1].finish_reason == "stop"
    text = backend.tokenizer.decode(token_ids(deltas), skip_special_tokens=True)
    assert isinstance(text, str)
    return text


def prompt_of(backend: TransformersGenerator | EngineGenerator) -> list[int]:
    return backend.tokenizer("My favourite colour is")["input_ids"]


async def test_a_compiling_grammar_holds_up_no_other_request(tiny_models, tmp_path, monkeypatch):
    """A constrained request's grammar compiles in a worker thread: while it is held there,
    the engine's loop serves an unconstrained generation sent after it (the tokens it gives
    alone) and an abort of an unknown request; released, the constrained request ends with
    one of its choices."""
    backend = engine_generator(tiny_models["llama"])
    held = hold_constrained_checks(monkeypatch, backend)
    async with one_front(backend, tmp_path) as (running, client):
        prompt = prompt_of(backend)
        _, alone = client.generate(prompt, GREEDY, None)
        expected = token_ids(await collected(alone))
        _, constrained = client.generate(prompt, CHOSEN, None)
        await held.wait_entered()
        assert len(running.engine.compiling) == 1
        client.channel.send(Abort(12345))
        _, meanwhile = client.generate(prompt, GREEDY, None)
        assert token_ids(await collected(meanwhile)) == expected
        assert constrained.empty() and len(running.engine.compiling) == 1
        held.gate.set()
        assert chosen_text(backend, await collected(constrained)) in CHOICES
        assert held.threads and running.thread not in held.threads
        assert running.engine.compiling == {}
        assert running.engine.live == {}


async def test_an_abort_while_compiling_drops_the_request(tiny_models, tmp_path, monkeypatch):
    """An abort that arrives while the request's grammar compiles cancels it: once the
    compile ends, its rows never join the decode loop, and the engine serves on."""
    backend = engine_generator(tiny_models["llama"])
    held = hold_constrained_checks(monkeypatch, backend)
    # one worker thread: a compile that follows the aborted one ends after it, so once its
    # request is served, whatever the aborted compile's end set off on the loop has run
    executor = ThreadPoolExecutor(1, thread_name_prefix="engine-worker")
    with (
        engine_thread(backend, f"ipc://{tmp_path}/engine.sock", executor) as running,
        clients(running.engine.address, fronts=1) as [client],
    ):
        await ready(client)
        submitted: list[DecodeRequest] = []
        submit = backend.batcher.submit

        def recorded(request: DecodeRequest) -> None:
            submitted.append(request)
            submit(request)

        monkeypatch.setattr(backend.batcher, "submit", recorded)
        prompt = prompt_of(backend)
        aborted_id, aborted = client.generate(prompt, CHOSEN, None)
        await held.wait_entered()
        client.abort(aborted_id)
        await until(lambda: not running.engine.compiling, "the abort cancels the compile")
        held.gate.set()
        _, after = client.generate(prompt, CHOSEN, None)
        assert chosen_text(backend, await collected(after)) in CHOICES
        assert len(submitted) == 1, "the aborted request's rows reached the decode loop"
        assert len(held.threads) == 2  # both compiled: the aborted one's too, then dropped
        _, unconstrained = client.generate(prompt, GREEDY, None)
        assert token_ids(await collected(unconstrained))
        assert aborted.empty()
        assert running.engine.compiling == {}
        assert running.engine.live == {}
        assert client.waiting == {}


async def test_an_invalid_grammar_fails_its_request_with_a_400(tiny_models, tmp_path):
    backend = engine_generator(tiny_models["llama"])
    invalid = SamplingParams(temperature=0.0, constraint=Constraint("regex", "("))
    async with one_front(backend, tmp_path) as (running, client):
        prompt = prompt_of(backend)
        _, failing = client.generate(prompt, invalid, None)
        with pytest.raises(ServerError, match="invalid regex") as caught:
            await collected(failing)
        assert caught.value.status_code == 400
        assert running.engine.compiling == {}
        _, unconstrained = client.generate(prompt, GREEDY, None)
        assert token_ids(await collected(unconstrained))
        _, constrained = client.generate(prompt, CHOSEN, None)
        assert chosen_text(backend, await collected(constrained)) in CHOICES
        assert running.engine.live == {}


async def test_a_number_past_64_bits_is_a_400_and_the_requests_beside_it_go_on(
    tiny_models, tmp_path
):
    """msgpack carries integers of 64 bits: a request with a larger one (a top_k, a token id)
    is refused where it is sent, not in the front's next flush, which would lose the messages
    of the requests sent beside it."""
    backend = engine_generator(tiny_models["llama"])
    async with one_front(backend, tmp_path) as (running, client):
        prompt = prompt_of(backend)
        _, before = client.generate(prompt, GREEDY, None)
        with pytest.raises(BadRequest, match="out of range"):
            client.generate(prompt, replace(GREEDY, top_k=2**70), None)
        with pytest.raises(BadRequest, match="out of range"):
            client.generate([*prompt, 2**64], GREEDY, None)
        _, after = client.generate(prompt, GREEDY, None)
        assert token_ids(await collected(before)) == token_ids(await collected(after))
        assert len(client.waiting) == 0 and running.engine.live == {}


async def all_deltas(deltas: AsyncIterator[list[ChoiceDelta]]) -> list[ChoiceDelta]:
    return [delta for step in [step async for step in deltas] for delta in step]


@asynccontextmanager
async def front_of(
    path: Path, tmp_path: Path, *flags: str
) -> AsyncIterator[tuple[EngineGenerator, EngineClient]]:
    """A generative model's engine (in a thread) and a front's backend, connected and loaded,
    with its engine client."""
    config = parse_args(["--model_dir", str(path), "--backend", "huggingface", *flags])
    with (
        engine_thread(engine_generator(path, *flags), f"ipc://{tmp_path}/engine.sock") as running,
        clients(running.engine.address, fronts=1) as [client],
    ):
        source, _ = assembly.locate(config, vllm=False)
        front = front_backends.engine_backend(source, config, client)
        assert isinstance(front, EngineGenerator)
        await front.connect()
        await asyncio.to_thread(front.load)
        yield front, client


async def test_a_front_checks_a_grammar_off_its_event_loop(tiny_models, tmp_path, monkeypatch):
    """A front's :class:`EngineGenerator` compiles a constrained request's grammar (its 400
    check) in a worker thread: while that is held, the front's loop runs other tasks."""
    async with front_of(tiny_models["llama"], tmp_path) as (front, client):
        held = hold_constrained_checks(monkeypatch, front)
        generation = asyncio.create_task(all_deltas(front.generate(prompt_of(front), CHOSEN)))
        await held.wait_entered()
        other = asyncio.Event()

        async def other_task() -> None:
            other.set()

        setter = asyncio.create_task(other_task())
        await asyncio.wait_for(other.wait(), DEADLINE_S)
        await setter
        assert not generation.done()
        assert client.waiting == {}  # not sent to the engine before it is checked
        held.gate.set()
        deltas = await asyncio.wait_for(generation, DEADLINE_S)
        assert "".join(delta.text for delta in deltas) in CHOICES
        assert deltas[-1].finish_reason == "stop"
        assert held.threads and threading.current_thread() not in held.threads


async def test_a_front_checks_n_choices_against_the_engines_kv_cache_budget(tiny_models, tmp_path):
    """The engine's facts carry its KV cache budget: a front refuses ``n`` choices that could
    not fit in it together before sending the request, as the engine would."""
    flags = ("--kv-cache-memory-bytes", str(200 * 512))  # 200 tokens of the tiny Llama
    async with front_of(tiny_models["llama"], tmp_path, *flags) as (front, _):
        assert front.kv_cache_tokens == 200
        front.check_request(prompt_of(front), SamplingParams(n=2, max_tokens=10))
        with pytest.raises(BadRequest, match="n=2 choices of up to 128 tokens each"):
            front.check_request(prompt_of(front), SamplingParams(n=2))
