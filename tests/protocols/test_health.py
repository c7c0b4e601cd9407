"""Readiness follows loading, and inference never blocks the event loop that answers probes."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from huggingfaceserver.assembly import build_model
from huggingfaceserver.cli import parse_args
from tests.harness import build_app, client_for

NAME = "loading"
TEXT = "the capital of france is [MASK] ."
V2_BODY = {"inputs": [{"name": "input-0", "datatype": "BYTES", "shape": [1], "data": [TEXT]}]}


async def wait_until(condition, what: str, timeout: float = 60.0) -> None:
    """Yield to the event loop until ``condition()`` holds, with a deadline."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.005)


async def test_ready_only_after_the_model_is_loaded(tiny_models):
    model = build_model(
        parse_args(["--model_dir", str(tiny_models["bert_fill_mask"]), "--model_name", NAME])
    )
    transport = httpx.ASGITransport(app=build_app(model))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        live = await client.get("/v2/health/live")
        assert (live.status_code, live.json()) == (200, {"live": True})
        assert (await client.get("/")).json() == {"status": "alive"}

        not_ready = [
            await client.get("/v2/health/ready"),
            await client.get(f"/v1/models/{NAME}"),
            await client.get(f"/v2/models/{NAME}/ready"),
            await client.post(f"/v1/models/{NAME}:predict", json={"instances": [TEXT]}),
            await client.post(f"/v2/models/{NAME}/infer", json=V2_BODY),
        ]
        for response in not_ready:
            assert response.status_code == 503, (response.request.url, response.text)
            assert isinstance(response.json()["error"], str)
        assert not model.ready, "a request must not load the model (on the event loop)"

        await asyncio.to_thread(model.load_backend)
        loaded = await client.get("/v2/health/ready")
        assert loaded.status_code == 503, "ready only after the warm-up inference"
        await model.warm_up()  # what the server's loader does next, before it says ready
        model.ready = True

        ready = await client.get("/v2/health/ready")
        assert (ready.status_code, ready.json()) == (200, {"ready": True})
        model_ready = await client.get(f"/v1/models/{NAME}")
        assert (model_ready.status_code, model_ready.json()) == (200, {"name": NAME, "ready": True})
        model_ready = await client.get(f"/v2/models/{NAME}/ready")
        assert model_ready.status_code == 200
        assert model_ready.json()["ready"] is True
        predict = await client.post(f"/v1/models/{NAME}:predict", json={"instances": [TEXT]})
        assert predict.status_code == 200, predict.text
        infer = await client.post(f"/v2/models/{NAME}/infer", json=V2_BODY)
        assert infer.status_code == 200, infer.text


class ThreadRecordingInputs:
    """Delegates to the backend's input encoder and records the threads it tokenizes on."""

    def __init__(self, inputs):
        self._inputs = inputs
        self.threads: set[int] = set()

    def texts(self, *args, **kwargs):
        self.threads.add(threading.get_ident())
        return self._inputs.texts(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inputs, name)


def long_texts(count: int, words: int = 100) -> list[str]:
    vocabulary = (
        "a man is eating a piece of bread while the quick brown fox jumps over the lazy dog "
        "near the river in paris on a sunny day"
    ).split()
    return [
        " ".join(vocabulary[(i + j) % len(vocabulary)] for j in range(words)) for i in range(count)
    ]


async def test_inference_runs_off_the_event_loop(encoder, minilm_path, monkeypatch):
    """Probes are answered while a large predict is in its forward pass."""
    model = encoder(minilm_path, name="minilm")
    backend = model.backend
    tokenizer = ThreadRecordingInputs(backend.inputs)
    monkeypatch.setattr(backend, "inputs", tokenizer)
    forward_threads: set[int] = set()
    forward_started, forward_finished = threading.Event(), threading.Event()
    forward_batch = backend.forward_batch

    def recording_forward(batch):  # whichever runtime runs the model (torch, ONNX Runtime)
        forward_threads.add(threading.get_ident())
        forward_started.set()
        try:
            return forward_batch(batch)
        finally:
            forward_finished.set()

    monkeypatch.setattr(backend, "forward_batch", recording_forward)
    loop_thread = threading.get_ident()
    texts = long_texts(32)
    async with client_for(model) as client:
        predict = asyncio.create_task(
            client.post("/v1/models/minilm:predict", json={"instances": texts})
        )
        await wait_until(
            lambda: forward_started.is_set() or predict.done(), "the forward pass to start"
        )
        answered_during_forward = 0
        while not forward_finished.is_set():
            live = await client.get("/v2/health/live")
            assert (live.status_code, live.json()) == (200, {"live": True})
            if not forward_finished.is_set():
                assert not predict.done()
                answered_during_forward += 1
        response = await predict

    assert response.status_code == 200, response.text
    assert len(response.json()["predictions"]) == len(texts)
    assert tokenizer.threads, "the backend did not tokenize with backend.inputs"
    assert loop_thread not in tokenizer.threads, "tokenization ran on the event loop"
    assert forward_threads and loop_thread not in forward_threads, "forward ran on the event loop"
    assert answered_during_forward >= 3, (
        f"only {answered_during_forward} live probes were answered during the forward pass"
    )
