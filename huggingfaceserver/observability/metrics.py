"""Prometheus metrics: what the server does, on ``GET /metrics``.

HTTP figures per route template (bounded label values), the encoder batcher's and the
generation decode loop's, and the model's load time. The decode loop's figures use vLLM's
names and labels (``vllm:num_requests_waiting``, ...), so that dashboards and autoscaling rules
written for vLLM work unchanged; they are created only when the transformers backend generates,
since vLLM's own stat logger registers the same names when vLLM serves.

With ``--api_workers`` > 1 every process writes its values to a private folder
(prometheus_client's multiprocess mode, set up by :func:`shared_across_processes` before the
processes start) and ``/metrics`` in any front shows counters and gauges summed over all of
them. An update costs about a microsecond (two when processes share a folder); the decode
loop makes one per running request per step, as vLLM's stat logger does.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
ENGINE_LABEL = "0"
"""vLLM labels its series with the engine's index; ours are those of engine 0."""

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
)  # fmt: skip
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# vLLM's own buckets (vllm/v1/metrics/loggers.py), so that its dashboards' quantiles read alike
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
FINISHED_REASONS = ("stop", "length", "abort", "error")
"""vLLM's ``finished_reason`` label values that this server produces."""

# --- HTTP (called by the server's middleware for every request) -------------------------------

REQUESTS = Counter(
    "hfserver_requests",
    "HTTP requests answered, by route template, model and status code.",
    ["route", "model_name", "status"],
)
REQUEST_SECONDS = Histogram(
    "hfserver_request_duration_seconds",
    "End-to-end HTTP request latency (to the last byte of a stream), by route template.",
    ["route"],
    buckets=LATENCY_BUCKETS,
)
REJECTED = Counter(
    "hfserver_requests_rejected",
    "Requests refused by admission control (429), by route template.",
    ["route"],
)
IN_FLIGHT = Gauge(
    "hfserver_requests_in_flight",
    "HTTP requests being served.",
    multiprocess_mode="livesum",
)
queued = Gauge(
    "hfserver_requests_queued",
    "Requests accepted and waiting for the model (encoder batch queue, generation queue).",
    multiprocess_mode="livesum",
)
"""A plain gauge: ``queued.inc()`` when a request starts waiting, ``queued.dec()`` when it
stops. The batchers drive it; anything else that makes requests wait may too."""

_request_children: dict[tuple[str, str, int], Any] = {}
_latency_children: dict[str, Any] = {}


def http_request_started() -> None:
    """A request came in (the in-flight gauge)."""
    IN_FLIGHT.inc()


def http_request_finished(route: str, model: str, status: int, seconds: float) -> None:
    """A request was answered: ``route`` is its route template (``/v1/models/{model_name}:predict``,
    never the raw path), ``model`` the model it named ('' for none)."""
    IN_FLIGHT.dec()
    key = (route, model, status)
    counter = _request_children.get(key)
    if counter is None:
        counter = _request_children[key] = REQUESTS.labels(route, model, str(int(status)))
    counter.inc()
    latency = _latency_children.get(route)
    if latency is None:
        latency = _latency_children[route] = REQUEST_SECONDS.labels(route)
    latency.observe(seconds)


def admission_rejected(route: str) -> None:
    """A request was refused with 429 before it reached the model."""
    REJECTED.labels(route).inc()


# --- model load ---------------------------------------------------------------------------------

MODEL_LOAD_SECONDS = Gauge(
    "hfserver_model_load_seconds",
    "Seconds from the start of loading to a served model (weights, tokenizer, warm-up); with "
    "--api_workers, the longest of the processes.",
    ["model_name"],
    multiprocess_mode="max",
)


def model_loaded(model_name: str, seconds: float) -> None:
    MODEL_LOAD_SECONDS.labels(model_name).set(seconds)


# --- encoder batches ----------------------------------------------------------------------------

ENCODER_QUEUE_SECONDS = Histogram(
    "hfserver_encoder_queue_time_seconds",
    "Encoder requests: time from joining the batch queue to their first forward pass.",
    ["model_name"],
    buckets=LATENCY_BUCKETS,
)
ENCODER_BATCH_SIZE = Histogram(
    "hfserver_encoder_batch_size",
    "Encoder forward passes: rows (texts or pairs) per pass.",
    ["model_name"],
    buckets=BATCH_SIZE_BUCKETS,
)
ENCODER_BATCH_OCCUPANCY = Gauge(
    "hfserver_encoder_batch_occupancy",
    "Rows in the running encoder forward pass over --max_batch_size (0 when idle).",
    ["model_name"],
    multiprocess_mode="livesum",
)


class EncoderBatchMetrics:
    """The encoder batcher's figures for one model."""

    def __init__(self, model_name: str, max_batch_size: int):
        self.queue_seconds = ENCODER_QUEUE_SECONDS.labels(model_name)
        self.batch_size = ENCODER_BATCH_SIZE.labels(model_name)
        self.occupancy = ENCODER_BATCH_OCCUPANCY.labels(model_name)
        self.max_batch_size = max(max_batch_size, 1)

    def submitted(self) -> None:
        queued.inc()

    def taken(self, requests: int) -> None:
        """``requests`` left the queue for the batch planner (or, cancelled, for good)."""
        if requests:
            queued.dec(requests)

    def idle(self) -> None:
        self.occupancy.set(0)

    def batch_started(self, rows: int) -> None:
        self.batch_size.observe(rows)
        self.occupancy.set(rows / self.max_batch_size)

    def first_forward(self, queued_at: float, now: float) -> None:
        self.queue_seconds.observe(now - queued_at)


# --- generation (transformers backend), under vLLM's names --------------------------------------


@dataclass(frozen=True)
class DecodeFamilies:
    running: Gauge
    waiting: Gauge
    queue_seconds: Histogram
    ttft: Histogram
    inter_token: Histogram
    per_output_token: Histogram
    e2e: Histogram
    prompt_tokens: Counter
    generation_tokens: Counter
    success: Counter
    preemptions: Counter


@cache
def decode_families() -> DecodeFamilies:
    """Created once, at the first decode loop: a process that vLLM serves never creates them
    (vLLM's stat logger registers these names itself)."""
    labels = ["model_name", "engine"]

    def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, doc, labels, buckets=buckets)

    return DecodeFamilies(
        running=Gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            labels,
            multiprocess_mode="livesum",
        ),
        waiting=Gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            labels,
            multiprocess_mode="livesum",
        ),
        queue_seconds=histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        ),
        ttft=histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        ),
        inter_token=histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            TOKEN_LATENCY_BUCKETS,
        ),
        per_output_token=histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            TOKEN_LATENCY_BUCKETS,
        ),
        e2e=histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        ),
        prompt_tokens=Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels),
        generation_tokens=Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", labels
        ),
        success=Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
        ),
        preemptions=Counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.", labels
        ),
    )


@dataclass(eq=False, slots=True)
class Timeline:
    """When a generation request reached the decode loop, and got its tokens."""

    arrived: float = field(default_factory=time.perf_counter)
    first_token: float = 0.0
    last_token: float = 0.0


class DecodeLoopMetrics:
    """The decode loop's figures for one model, under vLLM's names and labels. Per decode
    step the cost is one counter increment and one histogram observation per request that
    got a token (``--max_batch_size`` at most)."""

    def __init__(self, model_name: str):
        families = decode_families()
        labels = (model_name, ENGINE_LABEL)
        self.running = families.running.labels(*labels)
        self.waiting = families.waiting.labels(*labels)
        self.queue_seconds = families.queue_seconds.labels(*labels)
        self.ttft = families.ttft.labels(*labels)
        self.inter_token = families.inter_token.labels(*labels)
        self.per_output_token = families.per_output_token.labels(*labels)
        self.e2e = families.e2e.labels(*labels)
        self.prompt_tokens = families.prompt_tokens.labels(*labels)
        self.generation_tokens = families.generation_tokens.labels(*labels)
        self.success = {
            reason: families.success.labels(*labels, reason) for reason in FINISHED_REASONS
        }
        self.preemptions = families.preemptions.labels(*labels)

    def queue_length(self, waiting: int, changed: int) -> None:
        """The queue now holds ``waiting`` requests, ``changed`` more than before."""
        self.waiting.set(waiting)
        queued.inc(changed)

    def preempted(self) -> None:
        """A running request left the batch to wait until it is fed again (the KV cache's
        budget): waiting, not running, meanwhile (as vLLM counts it)."""
        self.preemptions.inc()
        self.running.dec()

    def admitted(self, timeline: Timeline, now: float, again: bool = False) -> None:
        """A waiting request runs; ``again``: one preempted before (its time in the queue
        was counted the first time)."""
        if not again:
            self.queue_seconds.observe(now - timeline.arrived)
        self.running.inc()

    def first_tokens(self, timeline: Timeline, prompt_tokens: int, rows: int) -> None:
        """The prompt ran and each of the request's ``rows`` has its first token."""
        now = time.perf_counter()
        self.ttft.observe(now - timeline.arrived)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(rows)
        timeline.first_token = timeline.last_token = now

    def step(self, timelines: Iterable[Timeline], tokens: int) -> None:
        """A decode step gave ``tokens`` tokens to the requests of ``timelines``."""
        now = time.perf_counter()
        self.generation_tokens.inc(tokens)
        # one plain observation per request, as vLLM's stat logger makes: prometheus_client
        # has no weighted observe, and its histogram's parts are private
        for timeline in timelines:
            self.inter_token.observe(now - timeline.last_token)
            timeline.last_token = now

    def finished(
        self, timeline: Timeline, reasons: Iterable[str], generated: int, running: bool = True
    ) -> None:
        """An admitted request ended: ``reasons`` per choice, ``generated`` tokens in its
        longest choice; ``running``: whether it was counted as running (not while it waited,
        preempted)."""
        now = time.perf_counter()
        if running:
            self.running.dec()
        self.e2e.observe(now - timeline.arrived)
        if generated > 1 and timeline.first_token:
            self.per_output_token.observe((now - timeline.first_token) / (generated - 1))
        for reason in reasons:
            self.success[reason].inc()


# --- exposition ---------------------------------------------------------------------------------


@contextmanager
def shared_across_processes(folder: str) -> Iterator[None]:
    """Processes started inside write their metrics to ``folder`` (which must exist and
    outlive them): ``/metrics`` in any of them then shows the sum over all. Only processes
    that import prometheus_client afterwards (spawned ones) are affected."""
    previous = os.environ.get(MULTIPROC_ENV)
    os.environ[MULTIPROC_ENV] = folder
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(MULTIPROC_ENV, None)
        else:
            os.environ[MULTIPROC_ENV] = previous


@cache
def registry() -> CollectorRegistry:
    """What ``/metrics`` shows: this process's registry, or every process's values when they
    share a folder."""
    if not os.environ.get(MULTIPROC_ENV):
        return REGISTRY
    from prometheus_client.multiprocess import MultiProcessCollector

    combined = CollectorRegistry()
    MultiProcessCollector(combined)
    return combined


def exposition(accept: str | None) -> tuple[bytes, str]:
    """The metrics in the format the ``Accept`` header asks for, and its content type."""
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry()), content_type


def mount(app: Any) -> None:
    """Serve ``GET /metrics`` from :func:`registry` on a FastAPI app, ahead of KServe's own
    route (which shows only this process's registry)."""
    from starlette.responses import Response

    def metrics(request: Any) -> Response:  # sync, so in a thread: it reads the shared folder
        body, content_type = exposition(request.headers.get("accept"))
        return Response(content=body, media_type=content_type)

    app.add_route("/metrics", metrics, methods=["GET"], include_in_schema=False)
