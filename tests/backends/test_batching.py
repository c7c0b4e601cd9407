"""Dynamic batching of encoder requests: merged forwards, identical results, isolated failures."""

from __future__ import annotations

import asyncio
import time

import httpx
import numpy as np
import pytest
import torch

from huggingfaceserver.backends.batching import (
    BatchLimits,
    EncodeRequest,
    collate,
    plan_batches,
)
from huggingfaceserver.backends.row_tokenizer import RowTokenizer
from tests.harness import build_app, client_for, load_model

TEXTS = [
    "john lives in new york",
    "the capital of france is paris .",
    "food",
    "a man is eating food and bread in paris with john",
    "new york",
    "the man lives in france",
] * 3


def rows_of(lengths: list[int]) -> list[tuple[EncodeRequest, int]]:
    rows = [{"input_ids": np.ones(n, dtype=np.int64)} for n in lengths]
    request = EncodeRequest(rows, lambda outcome: None)
    return [(request, i) for i in range(len(rows))]


def test_plan_batches_sorts_by_length_and_keeps_the_limits():
    pending = rows_of([5, 30, 2, 7, 29, 3, 31])
    batches = plan_batches(pending, BatchLimits(max_batch_tokens=64, max_batch_size=3))
    lengths = [[len(r.rows[i]["input_ids"]) for r, i in batch] for batch in batches]
    assert [n for batch in lengths for n in batch] == sorted([5, 30, 2, 7, 29, 3, 31])
    assert all(len(batch) <= 3 and len(batch) * max(batch) <= 64 for batch in lengths)
    assert sorted(i for batch in batches for _, i in batch) == list(range(7))


def test_a_row_longer_than_the_token_budget_still_runs_alone():
    batches = plan_batches(rows_of([100, 4]), BatchLimits(max_batch_tokens=64, max_batch_size=8))
    assert [len(batch) for batch in batches] == [1, 1]


def test_rows_collated_are_the_tokenizers_padded_batch(tiny_models):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_models["bert_token_classification"])
    batch = tokenizer(TEXTS[:4], padding=True, return_offsets_mapping=True, return_tensors="pt")
    rows = RowTokenizer(tokenizer, 64, offsets=True).texts(TEXTS[:4])
    again = collate(rows, {"input_ids": tokenizer.pad_token_id})
    assert set(again) == set(batch)
    for key in batch:
        assert torch.equal(again[key], batch[key]), key


def forward_shapes(model) -> list[tuple[int, ...]]:
    """The shape of every batch the backend's runtime (torch or ONNX Runtime) runs, from now."""
    shapes: list[tuple[int, ...]] = []
    forward_batch = model.backend.forward_batch

    def recording(batch):
        shapes.append(tuple(batch["input_ids"].shape))
        return forward_batch(batch)

    model.backend.forward_batch = recording
    return shapes


async def predict_each(model, texts, **extra):
    async with client_for(model) as client:
        responses = await asyncio.gather(
            *(
                client.post(f"/v1/models/{model.name}:predict", json={"instances": [t]})
                for t in texts
            ),
            **extra,
        )
    return responses


@pytest.mark.parametrize("name", ["bert_token_classification", "st_cls"])
async def test_concurrent_requests_equal_one_at_a_time(tiny_models, name):
    path = str(tiny_models[name])
    batched = load_model(["--model_dir", path, "--return_raw_logits", "--batch_wait_ms", "20"])
    alone = load_model(["--model_dir", path, "--return_raw_logits", "--max_batch_size", "1"])
    shapes = forward_shapes(batched)
    got = await predict_each(batched, TEXTS)
    want = await predict_each(alone, TEXTS)
    assert len(shapes) < len(TEXTS), "requests that arrive together share forward passes"
    for g, w in zip(got, want, strict=True):
        assert g.status_code == w.status_code == 200
        assert torch.allclose(as_tensor(g.json()), as_tensor(w.json()), atol=1e-5)


def as_tensor(body) -> torch.Tensor:
    prediction = body["predictions"][0]
    if isinstance(prediction, list) and prediction and isinstance(prediction[0], dict):
        return torch.tensor([list(d.values()) for d in prediction])
    return torch.tensor(prediction)


async def test_max_batch_size_1_turns_batching_off(tiny_models):
    model = load_model(["--model_dir", str(tiny_models["st_cls"]), "--max_batch_size", "1"])
    shapes = forward_shapes(model)
    responses = await predict_each(model, TEXTS[:8])
    assert all(r.status_code == 200 for r in responses)
    assert len(shapes) == 8 and all(rows == 1 for rows, _ in shapes)


async def test_forwards_stay_within_the_token_budget(tiny_models):
    model = load_model(
        ["--model_dir", str(tiny_models["st_cls"]), "--max_batch_tokens", "48",
         "--batch_wait_ms", "20"]
    )  # fmt: skip
    shapes = forward_shapes(model)
    responses = await predict_each(model, TEXTS)
    assert all(r.status_code == 200 for r in responses)
    assert all(rows * width <= 48 or rows == 1 for rows, width in shapes)


async def test_a_bad_request_fails_alone(tiny_models):
    model = load_model(["--model_dir", str(tiny_models["bert_fill_mask"]), "--batch_wait_ms", "20"])
    texts = ["the capital of france is [MASK] ."] * 5 + ["no mask here"] + ["[MASK] lives"] * 5
    responses = await predict_each(model, texts)
    assert [r.status_code for r in responses] == [200] * 5 + [400] + [200] * 5
    assert "[MASK]" in responses[5].json()["error"]


async def test_a_failing_batch_fails_its_requests_and_the_worker_goes_on(tiny_models):
    model = load_model(["--model_dir", str(tiny_models["st_cls"])])
    backend = model.backend
    real_forward = backend.forward_batch
    calls = 0

    def flaky_forward(batch):
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("boom")
        return real_forward(batch)

    backend.forward_batch = flaky_forward
    # an unexpected error is answered 500 by the server itself (the exception goes to its log)
    transport = httpx.ASGITransport(app=build_app(model), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        first = await client.post("/v1/models/model:predict", json={"instances": ["food"]})
        second = await client.post("/v1/models/model:predict", json={"instances": ["food"]})
    assert first.status_code == 500
    assert second.status_code == 200


async def test_a_bug_after_a_batch_fails_its_requests_and_the_worker_goes_on(tiny_models):
    """What raises outside the guard of a batch's forward (a bug: here a result fewer than the
    batch's rows) answers that round's requests 500 instead of ending the worker's thread
    and leaving every later request waiting."""
    model = load_model(["--model_dir", str(tiny_models["st_cls"])])
    batcher = model.backend.batcher
    run_batch = batcher.run_batch

    def short_once(batch, kinds):
        batcher.run_batch = run_batch
        return run_batch(batch, kinds)[:-1]

    batcher.run_batch = short_once
    transport = httpx.ASGITransport(app=build_app(model), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        body = {"instances": ["food"]}
        first = await asyncio.wait_for(client.post("/v1/models/model:predict", json=body), 60)
        second = await asyncio.wait_for(client.post("/v1/models/model:predict", json=body), 60)
    assert first.status_code == 500
    assert "the encoder batcher failed" in first.text
    assert second.status_code == 200


async def test_a_lone_request_does_not_wait_for_a_batch(tiny_models):
    model = load_model(["--model_dir", str(tiny_models["st_cls"]), "--batch_wait_ms", "5000"])
    await predict_each(model, ["warm up"])
    started = time.monotonic()
    (response,) = await predict_each(model, ["alone"])
    assert response.status_code == 200
    assert time.monotonic() - started < 2.5  # nothing else was on its way: no 5 s wait


def test_run_on_worker_runs_on_the_batch_thread_and_returns_or_raises():
    """What sets torch's CPU threads runs where the forward passes do (OpenMP keeps a thread
    team per calling thread)."""
    import threading

    from huggingfaceserver.backends.batching import EncoderBatcher

    batcher = EncoderBatcher(lambda batch, kinds: [], {}, BatchLimits())
    assert batcher.run_on_worker(lambda: threading.current_thread().name) == "batch"
    assert batcher.thread is not None and batcher.thread.name == "batch"
    with pytest.raises(ZeroDivisionError):
        batcher.run_on_worker(lambda: 1 / 0)
    assert batcher.run_on_worker(lambda: 42) == 42  # the worker went on


async def test_a_request_cancelled_before_its_batch_runs_leaves_the_queue(tiny_models):
    """A client that leaves (or runs past its deadline) frees its rows: the batcher skips them."""
    import threading

    model = load_model(
        ["--model_dir", str(tiny_models["bert_sequence_classification"]), "--model_name", "m"]
    )
    shapes = forward_shapes(model)
    batcher = model.backend.batcher
    hold, held = threading.Event(), threading.Event()

    def busy() -> None:  # the batcher's thread, kept busy until the test lets it go
        held.set()
        hold.wait(30)

    holding = asyncio.get_running_loop().run_in_executor(None, batcher.run_on_worker, busy)
    assert await asyncio.to_thread(held.wait, 30)
    left = asyncio.ensure_future(model.backend.infer(["a long text " * 8]))
    stays = asyncio.ensure_future(model.backend.infer(["short"]))
    await asyncio.sleep(0.05)
    left.cancel()
    await asyncio.sleep(0.05)  # the future's done-callbacks run on the loop
    hold.set()
    await holding
    assert len(await stays) == 1
    assert left.cancelled()
    assert len(shapes) == 1 and shapes[0][0] == 1  # one forward, of the one row that stayed
