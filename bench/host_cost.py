"""The host's cost of a decode step and of an encoder row, on models whose forward costs almost
nothing: the CPU figures that stand for the GPU's (where every host operation and every wait
for the device is paid in full each step), measurable on any machine.

Generation, on :func:`bench.models.build_long_llama` (hidden 64, 2 layers):

- **In the benchmark process**, the server's generation backend loaded as the server loads it:
  ``rows`` requests of :data:`TOKENS` sampled tokens (temperature 1, unseeded, token ids only,
  as the engine process decodes them) admitted together into its decode loop. The loop's
  thread CPU per forward, minus the forward's own (model forward hooks, thread CPU time): the
  **host CPU per decode step**; and the **host synchronisations per step**, counted on the
  decode thread by :class:`~huggingfaceserver.observability.syncs.SyncCounter` (each read of
  the device's values, as it would wait on a GPU). Against transformers' ``generate`` on the
  same prompts at the same batch (sampling, left-padded), measured the same way, in turn.
- **The engine process**, a server with ``--api_workers 2`` (two fronts make the text): 32
  streamed completions of :data:`TOKENS` tokens together, then one; the engine process's CPU
  (``/proc``) per decode step of 32 rows (its CPU per generated token, times 32) against
  ``generate``'s CPU per step at batch 32, in the benchmark process, measured in turn with
  the engine's runs (the server idle meanwhile).
- **Decode-step graphs recorded again, and steps queued ahead**, in the benchmark process:
  mixed traffic with the steps recorded per bucket as on a GPU, replayed eagerly, and queued
  ahead as on a GPU (:func:`graph_recordings`).

Encoders, on :func:`bench.models.build_overhead_encoder` (a BERT classifier, hidden 32, 2
layers):

- **In the benchmark process**, the torch backend (``--backend huggingface``) loaded as the
  server loads it: :data:`ENCODER_ROWS` single-text requests, tokenized before (as a front
  tokenizes them), submitted at once to its batcher as the engine submits them. The batcher
  thread's CPU per row, minus the forward's own: the **host CPU per encoder row** (merging the
  rows, the forward's inputs, the results, settling each request).
- **The engine process** of a ``--api_workers 2`` server, on its default runtime (ONNX Runtime)
  and on torch: its CPU per row under single-text V1 ``:predict`` requests at concurrency
  :data:`ENCODER_CONCURRENCY` (the lean load generator of :mod:`bench.fastload`).

Torch runs on one intra-op thread in the benchmark process and in the generation engine
(``OMP_NUM_THREADS=1``: what the server's calibration keeps for these models on a small CPU,
unless a busy minute sways it); the encoder servers calibrate their own.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from huggingfaceserver.backends.batching import EncodeRequest
from huggingfaceserver.backends.pytorch.decode_loop import DecodeRequest
from huggingfaceserver.backends.pytorch.encoder import TransformersEncoder
from huggingfaceserver.backends.pytorch.generator import TransformersGenerator
from huggingfaceserver.backends.pytorch.step_graphs import StepGraphs, eager
from huggingfaceserver.cli import parse_args
from huggingfaceserver.encoder_tasks.params import Output
from huggingfaceserver.generation.params import SamplingParams
from huggingfaceserver.loading import load_source
from huggingfaceserver.observability.syncs import SyncCounter

from . import plans, process_memory, routes, server, texts
from .fastload import LoadClients
from .models import BenchModels
from .stats import Spread
from .targets import Target
from .workloads import Settings

logger = logging.getLogger(__name__)

KEY = "host_cost"
MODEL_NAME = "llm"
TOKENS = 512
"""Tokens per request (and ``generate``'s new tokens): long enough that a run of 32 rows lasts
seconds, not a few clock ticks of ``/proc``'s CPU time."""
ROWS = (1, 32)
STREAMS = 32
SYNCS_PER_STEP = 1.0
"""Host synchronisations per decode step, at every row count."""
ENGINE_CPU_FACTOR = 1.5
"""The engine process's CPU per decode step at 32 streams: at most this many times
``generate``'s CPU per step at batch 32."""
ISSUE_FIGURES = "14.5 ms against 4.5 ms (3.2x) at 32; 2.3 against 1.1 ms at 1 (2026-11-27)"
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
"""The engine's torch threads, as ``generate``'s here: its calibration, which times a prefill
of 8 x 32 tokens at load, is left out (on this model a busy minute can make it keep 2 threads,
whose spinning doubles the engine's CPU while its decode steps gain nothing)."""
GRAPH_REQUESTS = 240
GRAPH_CLIENTS = 16
GRAPH_PROMPT_TOKENS = (16, 32, 64, 128, 256, 512)
GRAPH_NEW_TOKENS = (16, 128)
"""The mixed traffic of :func:`graph_recordings`: closed-loop clients, each request's prompt
length drawn from these and its new tokens from this range (seeded)."""
ENCODER_ROWS = 512
ENCODER_CONCURRENCY = 64
ENCODER_MODEL_NAME = "overhead"
ENCODER_RUNTIMES = {"ONNX Runtime (default)": (), "torch": ("--backend", "huggingface")}


@dataclass(frozen=True)
class LoopRun:
    """One run of ``rows`` rows through a decode loop (the server's or ``generate``)."""

    forwards: int
    cpu_s: float
    """The decoding thread's CPU."""
    forward_cpu_s: float
    """Of which inside the model's forwards."""
    syncs: int = 0
    """Host synchronisations outside the model's forward (the server's own)."""
    model_syncs: int = 0
    """Inside the model's forward (transformers' own)."""

    @property
    def cpu_per_step_ms(self) -> float:
        return 1000 * self.cpu_s / self.forwards

    @property
    def host_per_step_ms(self) -> float:
        return 1000 * (self.cpu_s - self.forward_cpu_s) / self.forwards

    @property
    def syncs_per_step(self) -> float:
        return self.syncs / self.forwards

    @property
    def model_syncs_per_step(self) -> float:
        return self.model_syncs / self.forwards


@dataclass
class RowsRuns:
    """Every repeat at one row count: the server's loop and ``generate``, alternated."""

    rows: int
    syncs_per_step: float = float("nan")
    """The server's own, outside the model's forward; counted in a run of its own."""
    model_syncs_per_step: float = float("nan")
    """The model's forward's own (transformers'), in the same run."""
    server: list[LoopRun] = field(default_factory=list)
    generate: list[LoopRun] = field(default_factory=list)


@dataclass(frozen=True)
class EngineRun:
    """One engine-process run: ``streams`` completions together."""

    streams: int
    tokens: int
    engine_cpu_s: float
    fronts_cpu_s: float
    seconds: float

    @property
    def per_step_ms(self) -> float:
        """The engine's CPU per decode step of ``streams`` rows."""
        return 1000 * self.engine_cpu_s * self.streams / self.tokens


@dataclass(frozen=True)
class GraphRun:
    """Mixed traffic through the decode loop, its steps replayed from recorded graphs."""

    requests: int
    replayed: int
    """Decode steps run from a graph."""
    recordings: int
    buckets: int
    """The bucket sizes a graph may be recorded for."""
    forwards: int = 0
    """Every forward: decode steps, those that fed prompts too, prompts' own."""
    stepped_ahead: int = 0
    """Decode steps queued before the host read the tokens of the step before."""


@dataclass
class HostCostResult:
    settings: Settings
    rows: list[RowsRuns]
    engine: list[EngineRun] = field(default_factory=list)
    generate_32: list[LoopRun] = field(default_factory=list)
    failure: str | None = None
    encoder: list[LoopRun] = field(default_factory=list)
    """In-process encoder runs: ``forwards`` counts rows here (see :func:`encoder_rows`)."""
    encoder_engine: list[EncoderEngineRun] = field(default_factory=list)
    encoder_failure: str | None = None
    graphs: GraphRun | None = None

    def targets(self) -> list[Target]:
        found = []
        for runs in self.rows:
            syncs = runs.syncs_per_step
            found.append(
                Target(
                    f"{KEY}: {runs.rows} row(s), the server's host synchronisations per "
                    f"decode step <= {SYNCS_PER_STEP:g}",
                    syncs <= SYNCS_PER_STEP,
                    f"{syncs:.2f} (reads of the device's values per forward, outside the "
                    f"model's forward; the forward itself adds {runs.model_syncs_per_step:.2f}: "
                    "a decode step passes its mask ready-made, a prompt's forward leaves "
                    "transformers' SDPA mask check its one read)",
                )
            )
        busy = [run for run in self.engine if run.streams == STREAMS]
        if busy and self.generate_32:
            engine = Spread.of([run.per_step_ms for run in busy])
            plain = Spread.of([run.cpu_per_step_ms for run in self.generate_32])
            factor = engine.median / plain.median
            found.append(
                Target(
                    f"{KEY}: engine process CPU per decode step at {STREAMS} streams "
                    f"(--api_workers 2) <= {ENGINE_CPU_FACTOR}x generate's at batch {STREAMS}",
                    factor <= ENGINE_CPU_FACTOR,
                    f"{factor:.2f}x: {_spread(engine)} against {_spread(plain)} ms "
                    f"(the issue's: {ISSUE_FIGURES})",
                )
            )
        elif self.failure:
            found.append(Target(f"{KEY}: engine process run", False, self.failure))
        if self.graphs is not None:
            run = self.graphs
            found.append(
                Target(
                    f"{KEY}: mixed traffic, decode-step graphs recorded <= one per bucket size "
                    f"({run.buckets})",
                    run.recordings <= run.buckets,
                    f"{run.recordings} recorded for {run.replayed} steps replayed "
                    f"({run.requests} requests, {GRAPH_CLIENTS} closed-loop clients; "
                    f"the CPU proxy for CUDA graphs recorded again)",
                )
            )
        return found

    def section(self) -> list[str]:
        lines = [
            f"## Host cost: decode steps and encoder rows ({KEY})",
            "",
            _markdown(__doc__.split("\n\n", 1)[1].strip()),
            "",
            "| rows | loop | CPU per step ms | forward ms | host per step ms |",
            "|---|---|---|---|---|",
        ]
        for runs in self.rows:
            for label, loop in (("server", runs.server), ("`generate`", runs.generate)):
                lines.append(
                    f"| {runs.rows} | {label} | "
                    f"{_spread(Spread.of([r.cpu_per_step_ms for r in loop]))} | "
                    f"{_spread(Spread.of([1000 * r.forward_cpu_s / r.forwards for r in loop]))} | "
                    f"{_spread(Spread.of([r.host_per_step_ms for r in loop]))} |"
                )
        syncs = ", ".join(
            f"{r.syncs_per_step:.2f} the server's and {r.model_syncs_per_step:.2f} the model "
            f"forward's at {r.rows} row(s)"
            for r in self.rows
        )
        lines += ["", f"Host synchronisations per decode step, counted: {syncs}."]
        lines += ["", "Engine process (`--api_workers 2`):", ""]
        if self.failure:
            lines.append(f"- {self.failure}")
        lines += [
            "| streams | engine CPU per step of the streams' rows ms | engine CPU s | "
            "fronts CPU s | seconds |",
            "|---|---|---|---|---|",
        ]
        for streams in sorted({run.streams for run in self.engine}):
            mine = [run for run in self.engine if run.streams == streams]
            lines.append(
                f"| {streams} | {_spread(Spread.of([r.per_step_ms for r in mine]))} | "
                f"{_spread(Spread.of([r.engine_cpu_s for r in mine]))} | "
                f"{_spread(Spread.of([r.fronts_cpu_s for r in mine]))} | "
                f"{_spread(Spread.of([r.seconds for r in mine]))} |"
            )
        if self.generate_32:
            plain = Spread.of([r.cpu_per_step_ms for r in self.generate_32])
            lines.append(f"\n`generate` at batch {STREAMS}: {_spread(plain)} ms CPU per step.")
        if self.graphs is not None:
            run = self.graphs
            lines += [
                "",
                " ".join(_markdown(graph_recordings.__doc__ or "").split("\n\n")[0].split()),
                "",
                f"**{run.recordings} graphs recorded for {run.replayed} decode steps replayed** "
                f"({run.requests} requests; {run.buckets} bucket sizes). "
                f"**{run.stepped_ahead} of {run.forwards} forwards queued ahead** "
                f"({run.stepped_ahead / max(run.forwards, 1):.0%}; the others: prompts' own "
                "forwards, the steps after a prompt's last part).",
            ]
        lines += [
            "",
            f"Encoder rows ({ENCODER_ROWS} single-text requests at once, in-process, torch):",
            "",
        ]
        if self.encoder:
            cpu = Spread.of([1000 * r.cpu_s / r.forwards for r in self.encoder])
            forward = Spread.of([1000 * r.forward_cpu_s / r.forwards for r in self.encoder])
            host = Spread.of(
                [1000 * (r.cpu_s - r.forward_cpu_s) / r.forwards for r in self.encoder]
            )
            lines += [
                "| batcher thread CPU per row us | forward us | host per row us |",
                "|---|---|---|",
                " | ".join(["", *(_spread(_us(x), 0) for x in (cpu, forward, host)), ""]).strip(),
            ]
        lines += [
            "",
            f"Encoder engine process (`--api_workers 2`, V1 c={ENCODER_CONCURRENCY}):",
            "",
        ]
        if self.encoder_failure:
            lines.append(f"- {self.encoder_failure}")
        lines += ["| runtime | engine CPU per row us | requests/s |", "|---|---|---|"]
        for runtime in ENCODER_RUNTIMES:
            served = [r for r in self.encoder_engine if r.runtime == runtime]
            if served:
                per_row = Spread.of([r.per_row_us for r in served])
                rate = Spread.of([r.requests_per_s for r in served])
                lines.append(f"| {runtime} | {_spread(per_row, 0)} | {_spread(rate, 0)} |")
        return lines


@dataclass(frozen=True)
class EncoderEngineRun:
    """Single-text requests against one runtime's engine process."""

    runtime: str
    requests: int
    engine_cpu_s: float
    seconds: float

    @property
    def per_row_us(self) -> float:
        return 1e6 * self.engine_cpu_s / self.requests

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds


def _markdown(text: str) -> str:
    """A docstring's reStructuredText roles and literals as Markdown."""
    text = re.sub(r":(?:func|class|mod|data):`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def _us(spread: Spread) -> Spread:
    return Spread(1000 * spread.median, 1000 * spread.low, 1000 * spread.high)


def _spread(spread: Spread, digits: int = 2) -> str:
    return f"{spread.median:.{digits}f} ({spread.low:.{digits}f}-{spread.high:.{digits}f})"


@contextmanager
def forward_cpu(model: Any) -> Iterator[list[float]]:
    """``[forwards, CPU seconds]`` of the model's forward calls in the block (thread CPU time
    of the thread that runs them)."""
    totals = [0.0, 0.0]
    started: dict[int, float] = {}

    def before(*_: Any) -> None:
        started[threading.get_ident()] = time.thread_time()

    def after(*_: Any) -> None:
        totals[0] += 1
        totals[1] += time.thread_time() - started.pop(threading.get_ident())

    handles = [model.register_forward_pre_hook(before), model.register_forward_hook(after)]
    try:
        yield totals
    finally:
        for handle in handles:
            handle.remove()


def server_loop(
    backend: TransformersGenerator, prompts: list[list[int]], count_syncs: bool = False
) -> LoopRun:
    """The prompts' rows through the backend's decode loop, admitted together; with
    ``count_syncs``, its host synchronisations counted (the counter sees every torch call,
    which costs CPU: such a run's CPU is not a figure)."""
    finished = threading.Semaphore(0)

    def emit(item: object) -> None:
        if item is None or isinstance(item, BaseException):
            if item is not None:
                logger.error("%s: a request failed: %r", KEY, item)
            finished.release()

    params = SamplingParams(temperature=1.0, max_tokens=TOKENS, ignore_eos=True)
    requests = [
        DecodeRequest(backend.new_sequences(ids, params, with_text=False), emit) for ids in prompts
    ]
    batcher = backend.batcher
    counter = SyncCounter(backend.device)
    with forward_cpu(backend.model) as forwards, counter.separating(backend.model):
        if count_syncs:
            batcher.run_on_loop(counter.__enter__)
        start = batcher.run_on_loop(time.thread_time)
        batcher.run_on_loop(lambda: _submit_all(batcher, requests))
        for _ in requests:
            finished.acquire()
        cpu = batcher.run_on_loop(time.thread_time) - start
        if count_syncs:
            batcher.run_on_loop(lambda: counter.__exit__(None, None, None))
    return LoopRun(int(forwards[0]), cpu, forwards[1], counter.outside_module, counter.in_module)


def _submit_all(batcher: Any, requests: list[DecodeRequest]) -> None:
    """On the decode thread: the requests are admitted at the same step."""
    for request in requests:
        batcher.submit(request)


def plain_generate(model: Any, tokenizer: Any, prompts: list[str]) -> LoopRun:
    """``generate`` of the prompts (sampling, left-padded) on this thread."""
    batch = tokenizer(prompts, padding=True, return_tensors="pt")
    with forward_cpu(model) as forwards, torch.inference_mode():
        start = time.thread_time()
        model.generate(
            **batch,
            do_sample=True,
            top_k=0,
            max_new_tokens=TOKENS,
            min_new_tokens=TOKENS,
            pad_token_id=tokenizer.eos_token_id,
        )
        cpu = time.thread_time() - start
    return LoopRun(int(forwards[0]), cpu, forwards[1])


def in_process(model_dir: Path, repeats: int) -> list[RowsRuns]:
    """The server's decode loop and ``generate``, alternated, at each of :data:`ROWS`."""
    config = parse_args(["--model_dir", str(model_dir), "--max_batch_size", str(max(ROWS))])
    backend = TransformersGenerator(load_source(config), config)
    backend.load()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    tokenizer.pad_token = tokenizer.eos_token
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    backend.batcher.run_on_loop(lambda: torch.set_num_threads(1))
    try:
        results = []
        for rows in ROWS:
            prompts = texts.cycle(texts.prompts(), rows)
            ids = [backend.tokenizer(p).input_ids for p in prompts]
            runs = RowsRuns(rows)
            server_loop(backend, ids)  # warm-up: the first calls allocate
            counted = server_loop(backend, ids, count_syncs=True)
            runs.syncs_per_step = counted.syncs_per_step
            runs.model_syncs_per_step = counted.model_syncs_per_step
            plain_generate(backend.model, tokenizer, prompts)
            for _ in range(repeats):
                runs.server.append(server_loop(backend, ids))
                runs.generate.append(plain_generate(backend.model, tokenizer, prompts))
            mine, theirs = runs.server[-1], runs.generate[-1]
            logger.info(
                "  %s, %d rows: host per step %.2f ms (generate %.2f), syncs per step %.2f",
                KEY, rows, mine.host_per_step_ms, theirs.host_per_step_ms, runs.syncs_per_step,
            )  # fmt: skip
            results.append(runs)
        return results
    finally:
        torch.set_num_threads(threads)
        backend.shutdown()


def graph_recordings(model_dir: Path) -> GraphRun:
    """The CPU proxy for CUDA graphs recorded again (each costs a recording on a GPU where a
    replay would do): :data:`GRAPH_REQUESTS` requests of mixed lengths from
    :data:`GRAPH_CLIENTS` closed-loop clients, in-process, the decode steps recorded per
    bucket as on a GPU but replayed eagerly (``step_graphs.eager``); the graphs recorded
    against the steps replayed. A graph is recorded once per bucket and KV cache buffers:
    more means the buffers were replaced (grown, or moved where they had room) or the loop
    stepped on another cache. Target: at most one per bucket size.

    The decode steps are queued ahead as on a GPU (the next step queued on the device's
    tokens before the host reads them and makes their text, a step that feeds new prompts
    too); the steps queued so against every forward: on a GPU the host's work of the step
    before each of the others is not overlapped.

    Requests are greedy, with ``ignore_eos``."""
    config = parse_args(["--model_dir", str(model_dir), "--max_batch_size", str(STREAMS)])
    backend = TransformersGenerator(load_source(config), config)
    backend.load()
    graphs = StepGraphs(backend.max_rows, eager)
    backend.graphs = graphs
    backend.batcher.step_ahead = True
    draw = random.Random(0)
    jobs = [
        (
            [draw.randrange(backend.vocab_size) for _ in range(draw.choice(GRAPH_PROMPT_TOKENS))],
            draw.randint(*GRAPH_NEW_TOKENS),
        )
        for _ in range(GRAPH_REQUESTS)
    ]

    async def client(queue: list[tuple[list[int], int]]) -> None:
        while queue:
            ids, tokens = queue.pop()
            params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
            async for _ in backend.generate(ids, params):
                pass

    async def clients() -> None:
        queue = list(jobs)
        await asyncio.gather(*(client(queue) for _ in range(GRAPH_CLIENTS)))

    try:
        with forward_cpu(backend.model) as forwards:
            asyncio.run(clients())
    finally:
        backend.shutdown()
    ahead = backend.batcher.stepped_ahead
    logger.info(
        "  %s, mixed traffic: %d graphs recorded for %d steps replayed; %d of %d forwards "
        "queued ahead",
        KEY, graphs.recordings, graphs.replayed, ahead, forwards[0],
    )  # fmt: skip
    sizes = len(graphs.sizes)
    return GraphRun(
        GRAPH_REQUESTS, graphs.replayed, graphs.recordings, sizes, int(forwards[0]), ahead
    )


async def _streams(url: str, prompts: list[str]) -> int:
    """The prompts' streamed completions together; their tokens."""
    body = {"temperature": 1.0, "ignore_eos": True}
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        traces = await asyncio.gather(
            *(
                routes.traced_completion_stream(
                    session,
                    f"{url}/openai/v1/completions",
                    routes.completion_body(MODEL_NAME, prompt, TOKENS, body),
                )
                for prompt in prompts
            )
        )
    errors = [trace.error for trace in traces if trace.error]
    if errors:
        raise RuntimeError(f"{len(errors)} streams failed: {errors[0]}")
    return sum(trace.usage_tokens or 0 for trace in traces)


def engine_pid(root: int) -> int:
    for pid in server.family(root):
        if process_memory.role(pid, root, process_memory.maps_torch(pid)) == "engine":
            return pid
    raise RuntimeError("no engine process in the server's family")


def engine_runs(
    model_dir: Path,
    settings: Settings,
    log_dir: Path,
    source_tree: Path | None = None,
    between: Callable[[], None] = lambda: None,
) -> list[EngineRun]:
    """32 streams together, then 1, ``settings.repeats`` times, on one ``--api_workers 2``
    server (``source_tree``: the server's code from that folder, e.g. an older commit's);
    ``between()`` after each 32-stream run (``generate`` measured in turn with the server)."""
    args = ["--model_dir", str(model_dir), "--model_name", MODEL_NAME, "--backend", "huggingface"]
    args += ["--api_workers", "2", *settings.server_args]
    runs = []
    log = log_dir / f"{KEY}.log"
    with server.serving(args, log, source_tree, ONE_THREAD) as running:
        root = running.process.pid
        engine = engine_pid(root)

        def measure(streams: int) -> EngineRun:
            prompts = texts.cycle(texts.prompts(), streams)
            cpu = server.cpu_seconds(engine)
            total = server.cpu_seconds(root)  # the whole family
            start = time.perf_counter()
            tokens = asyncio.run(_streams(running.url, prompts))
            seconds = time.perf_counter() - start
            engine_cpu = server.cpu_seconds(engine) - cpu
            others = server.cpu_seconds(root) - total - engine_cpu
            return EngineRun(streams, tokens, engine_cpu, others, seconds)

        measure(STREAMS)  # warm-up
        for _ in range(settings.repeats):
            for streams in (STREAMS, 1):
                run = measure(streams)
                logger.info(
                    "  %s, engine: %d streams, %.2f ms CPU per step", KEY, streams, run.per_step_ms
                )
                runs.append(run)
                if streams == STREAMS:
                    between()
    return runs


def encoder_rows(model_dir: Path, repeats: int) -> list[LoopRun]:
    """:data:`ENCODER_ROWS` single-row requests through the torch backend's batcher, submitted
    at once (as the engine submits the fronts' rows), ``repeats`` times after a warm-up: the
    batcher thread's CPU and the forwards' (``forwards``: the rows)."""
    config = parse_args(["--model_dir", str(model_dir), "--backend", "huggingface"])
    backend = TransformersEncoder(load_source(config), config)
    backend.load()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    backend.batcher.run_on_worker(lambda: torch.set_num_threads(1))
    sentences = texts.cycle(list(texts.SENTENCES), ENCODER_ROWS)
    rows = [backend.prepare_rows([text])[1] for text in sentences]

    def run() -> LoopRun:
        settled = threading.Semaphore(0)

        def settle(outcome: object) -> None:
            if isinstance(outcome, BaseException):
                logger.error("%s: an encoder request failed: %r", KEY, outcome)
            settled.release()

        requests = [EncodeRequest(row, settle, Output.task.value) for row in rows]
        batcher = backend.batcher
        with forward_cpu(backend.model) as forwards:
            start = batcher.run_on_worker(time.thread_time)
            for request in requests:
                batcher.submit(request)
            for _ in requests:
                settled.acquire()
            cpu = batcher.run_on_worker(time.thread_time) - start
        return LoopRun(len(requests), cpu, forwards[1])

    try:
        run()  # warm-up
        return [run() for _ in range(repeats)]
    finally:
        torch.set_num_threads(threads)
        backend.shutdown()


def encoder_engine_runs(
    model_dir: Path, settings: Settings, log_dir: Path
) -> list[EncoderEngineRun]:
    """Each runtime's ``--api_workers 2`` server in turn, ``settings.repeats`` runs each."""
    runs = []
    with LoadClients(1) as clients:
        for runtime, flags in ENCODER_RUNTIMES.items():
            args = ["--model_dir", str(model_dir), "--model_name", ENCODER_MODEL_NAME]
            args += ["--api_workers", "2", *flags, *settings.server_args]
            log = log_dir / f"{KEY}-encoder-{flags[-1] if flags else 'default'}.log"
            with server.serving(args, log) as running:
                engine = engine_pid(running.process.pid)
                port = running.http_port
                warm_up = plans.v1_predict(ENCODER_MODEL_NAME, 2.0, 1, port)
                clients.run(warm_up, ENCODER_CONCURRENCY)
                plan = plans.v1_predict(ENCODER_MODEL_NAME, settings.duration_s, 1, port)
                for _ in range(settings.repeats):
                    result = clients.run(
                        plan, ENCODER_CONCURRENCY, around=partial(server.cpu_seconds, engine)
                    )
                    if result.error_count:
                        raise RuntimeError(f"{result.error_count} errors: {result.errors[:1]}")
                    run = EncoderEngineRun(
                        runtime, result.answered, result.server_cpu_s, result.elapsed_s
                    )
                    logger.info(
                        "  %s, encoder engine, %s: %.0f us CPU per row",
                        KEY, runtime, run.per_row_us,
                    )  # fmt: skip
                    runs.append(run)
    return runs


def measure(models: BenchModels, settings: Settings, log_dir: Path) -> HostCostResult:
    model_dir = models.long_llama
    result = HostCostResult(settings, in_process(model_dir, settings.repeats))
    result.graphs = graph_recordings(model_dir)
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    tokenizer.pad_token = tokenizer.eos_token
    prompts = texts.cycle(texts.prompts(), STREAMS)

    def plain() -> None:  # in turn with the engine's runs, so that both see the same minutes
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            result.generate_32.append(plain_generate(model, tokenizer, prompts))
        finally:
            torch.set_num_threads(threads)

    try:
        result.engine = engine_runs(model_dir, settings, log_dir, between=plain)
    except (RuntimeError, TimeoutError) as exc:
        result.failure = f"the engine-process run failed: {str(exc).splitlines()[0][:300]}"
    result.encoder = encoder_rows(models.overhead, settings.repeats)
    try:
        result.encoder_engine = encoder_engine_runs(models.overhead, settings, log_dir)
    except (RuntimeError, TimeoutError) as exc:
        result.encoder_failure = f"the engine-process run failed: {str(exc).splitlines()[0][:300]}"
    return result
