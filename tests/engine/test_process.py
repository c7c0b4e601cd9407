"""The engine and a front's client in one process: :class:`Engine` serves a tiny encoder on an
``ipc://`` socket from a thread with its own event loop, :class:`EngineClient` talks to it from
the test's loop, exactly as a front process does over the same socket."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import huggingfaceserver.engine.process as engine_process
from huggingfaceserver.backends.base import EncoderBackend
from huggingfaceserver.cli import parse_args
from huggingfaceserver.engine.client import EngineClient
from huggingfaceserver.engine.messages import Abort
from huggingfaceserver.engine.process import Engine
from huggingfaceserver.errors import StartupError
from huggingfaceserver.server import engine_local_backend

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


@contextmanager
def engine_thread(backend: EncoderBackend, address: str) -> Iterator[EngineThread]:
    loop = asyncio.new_event_loop()
    engine = Engine(backend, address, fronts=1)
    running = EngineThread(engine, loop, threading.Thread(target=lambda: None))
    stop_known = threading.Event()

    def add_signal_handler(_signal: int, callback: Callable[[], None]) -> None:
        # signal handlers need the main thread; the test calls the callback instead
        running.stops.append(callback)
        stop_known.set()

    loop.add_signal_handler = add_signal_handler  # type: ignore[method-assign]

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


async def test_task_rows_and_pair_rows_in_flight_together(tiny_models, encoder, tmp_path):
    """Each request's kind travels with its rows: a task request and a pair request sent at
    once get the task's predictions and the pair scores the backend computes itself."""
    flags = ["--return_probabilities"]
    local = encoder(tiny_models["bert_sequence_classification"], *flags).backend
    _, task_rows = local.prepare_rows(["I love this movie!", "The food was okay."])
    _, pair_rows = local.prepare_pair_rows("Paris", ["Paris is in France.", "A red ball."])
    expected_task = await local_results(local, task_rows, "task")
    expected_pairs = await local_results(local, pair_rows, "pair")
    backend = engine_backend(tiny_models["bert_sequence_classification"], *flags)
    with (
        engine_thread(backend, f"ipc://{tmp_path}/engine.sock") as running,
        clients(running.engine.address, fronts=1) as [client],
    ):
        await ready(client)
        got_task, got_pairs = await asyncio.gather(
            client.encode(task_rows, "task"), client.encode(pair_rows, "pair")
        )
    assert got_task == expected_task
    assert got_pairs == pytest.approx(expected_pairs, abs=1e-6)


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
