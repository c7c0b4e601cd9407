"""Prometheus metrics in-process: the HTTP figures the middleware reports, the encoder batcher's,
the decode loop's under vLLM's names (token counts checked against the tokenizer), KServe's
histograms, and the decode step's inter-token histogram (the same as plain observations, in one
process and summed over processes that share a folder)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi import FastAPI
from prometheus_client import REGISTRY, CollectorRegistry, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from transformers import AutoTokenizer

from huggingfaceserver.backends.batching import BatchLimits, EncoderBatcher
from huggingfaceserver.generation.params import SamplingParams
from huggingfaceserver.observability import metrics
from huggingfaceserver.protocols.kserve_model import BackendModel
from tests.harness import REPO, client_for, load_model, wait_until
from tests.prometheus import Samples

ROUTE = "/v1/models/{model_name}:predict"
LLM = {"model_name": "metrics-llm", "engine": "0"}


def current() -> Samples:
    return Samples.parse(generate_latest(REGISTRY).decode())


def moved(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return after.value(name, **labels) - before.value(name, **labels)


INTER_TOKEN = "vllm:inter_token_latency_seconds"
SINCE_LAST_TOKEN = (0.03, 0.03, 0.03, 0.35, 9.0, 9.0, 100.0)
"""Seconds since each request's last token before a decode step: three requests share one
previous token time (several observations of one amount at once), the rest span the buckets."""

STEP_IN_A_PROCESS = """
import json, sys, time
from huggingfaceserver.observability.metrics import DecodeLoopMetrics, Timeline
decode = DecodeLoopMetrics(sys.argv[1])
start = time.perf_counter()
timelines = [Timeline(last_token=start - ago) for ago in json.loads(sys.argv[2])]
previous = [timeline.last_token for timeline in timelines]
decode.step(timelines, len(timelines))
print(json.dumps([t.last_token - p for t, p in zip(timelines, previous, strict=True)]))
"""
"""One decode step in a process of its own; prints the intervals the step observed."""


def histogram_of(text: str, family: str, **labels: str) -> dict[tuple[str, str], float]:
    """One histogram series of a scrape: (sample suffix, ``le``) -> value."""
    return {
        (name[len(family) :], sample_labels.get("le", "")): value
        for name, sample_labels, value in Samples.parse(text).samples
        if name.startswith(family)
        and not name.endswith("_created")
        and all(sample_labels.get(k) == v for k, v in labels.items())
    }


def observed_one_by_one(intervals: Sequence[float]) -> dict[tuple[str, str], float]:
    """The inter-token histogram that plain ``observe`` calls of ``intervals`` give."""
    registry = CollectorRegistry()
    reference = Histogram("reference", "", buckets=metrics.TOKEN_LATENCY_BUCKETS, registry=registry)
    for interval in intervals:
        reference.observe(interval)
    return histogram_of(generate_latest(registry).decode(), "reference")


def test_a_decode_step_observes_each_requests_interval():
    labels = {"model_name": "unit-decode", "engine": "0"}
    decode = metrics.DecodeLoopMetrics(labels["model_name"])
    start = time.perf_counter()
    timelines = [metrics.Timeline(last_token=start - ago) for ago in SINCE_LAST_TOKEN]
    previous = [timeline.last_token for timeline in timelines]
    before = histogram_of(generate_latest(REGISTRY).decode(), INTER_TOKEN, **labels)
    decode.step(timelines, len(timelines))
    after = histogram_of(generate_latest(REGISTRY).decode(), INTER_TOKEN, **labels)
    intervals = [t.last_token - p for t, p in zip(timelines, previous, strict=True)]
    expected = observed_one_by_one(intervals)
    assert expected[("_count", "")] == len(SINCE_LAST_TOKEN)
    assert {key: after[key] - before.get(key, 0) for key in after} == pytest.approx(expected)


def test_decode_steps_in_processes_that_share_a_folder_add_up(tmp_path: Path):
    """As with ``--api_workers`` > 1: each process writes its own file, ``/metrics`` sums them."""
    labels = {"model_name": "unit-decode-shared", "engine": "0"}
    intervals: list[float] = []
    with metrics.shared_across_processes(str(tmp_path)):
        for _ in range(2):
            step = subprocess.run(
                [sys.executable, "-c", STEP_IN_A_PROCESS, labels["model_name"],
                 json.dumps(SINCE_LAST_TOKEN)],
                cwd=REPO, capture_output=True, text=True, timeout=120, check=True,
            )  # fmt: skip
            intervals += json.loads(step.stdout)
    combined = CollectorRegistry()
    MultiProcessCollector(combined, path=str(tmp_path))
    shared = histogram_of(generate_latest(combined).decode(), INTER_TOKEN, **labels)
    expected = observed_one_by_one(intervals)
    assert expected[("_count", "")] == 2 * len(SINCE_LAST_TOKEN)
    assert shared == pytest.approx(expected)


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
