"""Prometheus metrics in-process: the HTTP figures the middleware reports, the encoder batcher's,
the decode loop's under vLLM's names (token counts checked against the tokenizer), KServe's
histograms, and the weighted histogram update the decode loop relies on."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi import FastAPI
from prometheus_client import REGISTRY, CollectorRegistry, Histogram, generate_latest
from transformers import AutoTokenizer

from huggingfaceserver import metrics
from huggingfaceserver.backends.batching import BatchLimits, EncoderBatcher
from huggingfaceserver.generation.params import SamplingParams
from huggingfaceserver.protocols.kserve_model import BackendModel
from tests.harness import client_for, load_model, wait_until
from tests.prometheus import Samples

ROUTE = "/v1/models/{model_name}:predict"
LLM = {"model_name": "metrics-llm", "engine": "0"}


def current() -> Samples:
    return Samples.parse(generate_latest(REGISTRY).decode())


def moved(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return after.value(name, **labels) - before.value(name, **labels)


def test_observe_many_equals_that_many_observations():
    registry = CollectorRegistry()
    one_by_one = Histogram("one", "", buckets=(0.1, 1.0), registry=registry)
    weighted = Histogram("many", "", buckets=(0.1, 1.0), registry=registry)
    for amount, count in [(0.05, 3), (0.1, 2), (0.5, 4), (7.0, 1)]:
        for _ in range(count):
            one_by_one.observe(amount)
        metrics.observe_many(weighted, amount, count)
    samples = Samples.parse(generate_latest(registry).decode()).samples
    kept = [(n, labels, v) for n, labels, v in samples if not n.endswith("_created")]
    ones = [(n[len("one") :], labels, v) for n, labels, v in kept if n.startswith("one")]
    manys = [(n[len("many") :], labels, v) for n, labels, v in kept if n.startswith("many")]
    assert ones == manys
    assert ("_count", {}, 10.0) in ones


def test_http_requests_move_the_counter_the_latency_and_the_in_flight_gauge():
    before = current()
    metrics.http_request_started()
    during = current()
    metrics.http_request_finished(ROUTE, "m", 200, 0.02)
    metrics.http_request_started()
    metrics.http_request_finished(ROUTE, "m", 429, 0.001)
    metrics.admission_rejected(ROUTE)
    after = current()
    assert moved(before, during, "hfserver_requests_in_flight") == 1
    assert moved(before, after, "hfserver_requests_in_flight") == 0
    labels = {"route": ROUTE, "model_name": "m"}
    assert moved(before, after, "hfserver_requests_total", **labels, status="200") == 1
    assert moved(before, after, "hfserver_requests_total", **labels, status="429") == 1
    assert moved(before, after, "hfserver_request_duration_seconds_count", route=ROUTE) == 2
    assert moved(before, after, "hfserver_request_duration_seconds_sum", route=ROUTE) == (
        pytest.approx(0.021)
    )
    bucket = {"route": ROUTE, "le": "0.025"}
    assert moved(before, after, "hfserver_request_duration_seconds_bucket", **bucket) == 2
    assert moved(before, after, "hfserver_requests_rejected_total", route=ROUTE) == 1


async def test_the_mounted_route_serves_the_registry_in_prometheus_text():
    app = FastAPI()
    metrics.mount(app)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert Samples.parse(response.text).has("hfserver_requests_in_flight")
    assert metrics.registry() is REGISTRY  # one process: no shared folder


async def test_encoder_batches_report_their_size_occupancy_and_queue_time():
    seen_occupancy: list[float | None] = []
    labels = {"model_name": "unit-encoder"}

    def run_batch(batch, kinds: list[str]) -> list[int]:
        occupancy = REGISTRY.get_sample_value("hfserver_encoder_batch_occupancy", labels)
        seen_occupancy.append(occupancy)
        return [0] * len(kinds)

    limits = BatchLimits(max_batch_size=4, wait_s=0)
    batcher = EncoderBatcher(run_batch, {}, limits, model_name="unit-encoder")
    rows = [{"input_ids": np.ones(3, dtype=np.int64)}] * 3
    before = current()
    await asyncio.gather(batcher.put(rows), batcher.put(rows))
    occupancy = "hfserver_encoder_batch_occupancy"
    assert wait_until(lambda: current().value(occupancy, **labels) == 0, 10, interval=0.01)
    after = current()
    assert moved(before, after, "hfserver_encoder_batch_size_sum", **labels) == 6
    batches = moved(before, after, "hfserver_encoder_batch_size_count", **labels)
    assert batches == len(seen_occupancy) >= 2  # 6 rows, at most 4 per pass
    assert sum(seen_occupancy) * limits.max_batch_size == 6  # each pass: its rows / 4
    assert moved(before, after, "hfserver_encoder_queue_time_seconds_count", **labels) == 2
    assert moved(before, after, "hfserver_requests_queued") == 0


@pytest.fixture(scope="module")
def encoder_model(tiny_models: dict[str, Path], encoder) -> BackendModel:
    return encoder(tiny_models["st_cls"], name="metrics-enc")


async def test_kserve_histograms_are_still_observed(encoder_model):
    async with client_for(encoder_model) as client:
        before = Samples.parse((await client.get("/metrics")).text)
        response = await client.post(
            "/v1/models/metrics-enc:predict", json={"instances": ["a b", "c", "d e f"]}
        )
        assert response.status_code == 200, response.text
        after = Samples.parse((await client.get("/metrics")).text)
    for stage in ("preprocess", "predict", "postprocess"):
        name = f"request_{stage}_seconds_count"
        assert moved(before, after, name, model_name="metrics-enc") == 1
    assert moved(before, after, "hfserver_encoder_batch_size_sum") == 3


@pytest.fixture(scope="module")
def llm(tiny_models: dict[str, Path]):
    model = load_model(
        ["--model_dir", str(tiny_models["llama"]), "--model_name", "metrics-llm",
         "--backend", "huggingface"]
    )  # fmt: skip
    yield model
    model.backend.shutdown()


async def test_generation_reports_vllms_figures(llm, tiny_models):
    prompt_ids = AutoTokenizer.from_pretrained(tiny_models["llama"])("Hello world")["input_ids"]
    body = {
        "model": "metrics-llm", "prompt": "Hello world", "max_tokens": 5, "n": 2,
        "temperature": 0, "ignore_eos": True,
    }  # fmt: skip
    async with client_for(llm) as client:
        before = Samples.parse((await client.get("/metrics")).text)
        response = await client.post("/openai/v1/completions", json=body)
        assert response.status_code == 200, response.text
        after = Samples.parse((await client.get("/metrics")).text)
    assert moved(before, after, "vllm:prompt_tokens_total", **LLM) == len(prompt_ids)
    assert moved(before, after, "vllm:generation_tokens_total", **LLM) == 2 * 5
    success = "vllm:request_success_total"
    assert moved(before, after, success, **LLM, finished_reason="length") == 2
    for once in (
        "vllm:request_queue_time_seconds",
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_time_per_output_token_seconds",
    ):
        assert moved(before, after, f"{once}_count", **LLM) == 1, once
    # one request, five tokens: four intervals between them
    assert moved(before, after, "vllm:inter_token_latency_seconds_count", **LLM) == 4
    assert moved(before, after, "vllm:inter_token_latency_seconds_sum", **LLM) > 0
    e2e = moved(before, after, "vllm:e2e_request_latency_seconds_sum", **LLM)
    ttft = moved(before, after, "vllm:time_to_first_token_seconds_sum", **LLM)
    assert 0 < ttft <= e2e
    assert after.value("vllm:num_requests_running", **LLM) == 0
    assert after.value("vllm:num_requests_waiting", **LLM) == 0


async def test_a_generation_whose_consumer_leaves_counts_as_aborted(llm):
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    before = current()
    stream = llm.backend.generate([1, 2, 3], params)
    await anext(stream)
    assert current().value("vllm:num_requests_running", **LLM) == 1
    await stream.aclose()  # type: ignore[attr-defined]
    success = "vllm:request_success_total"
    abort = {**LLM, "finished_reason": "abort"}
    assert wait_until(lambda: moved(before, current(), success, **abort) == 1, 10, interval=0.01)
    assert current().value("vllm:num_requests_running", **LLM) == 0
