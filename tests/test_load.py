"""A load test: 2,000 mixed requests, 64 at a time on each of two servers at once. The real
MiniLM answers V1, V2 REST, gRPC, embeddings and rerank; a tiny llama answers greedy completions
and streamed chats. Every answer is checked against transformers' own result for its input
(nothing lost or mixed up), no answer is a 5xx, liveness answers throughout and the servers'
memory stays bounded."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import ExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from tiny_models import CORPUS

from .harness import REPO, ServerProcess, descendants, run_server, wait_ready
from .openai_checks import Reference

pytestmark = pytest.mark.slow

CONCURRENCY = 64
ENCODER_LOAD = {"v1": 300, "v2": 300, "grpc": 300, "embeddings": 300, "rerank": 200}
GENERATION_LOAD = {"completions": 300, "chat": 300}
TEXTS = CORPUS[:40]
PROMPTS = CORPUS[0::2]
CHATS = CORPUS[1::2]
MAX_TOKENS = 16
ATOL = 1e-4
PROBE_LIMIT_S = 3.0
"""Liveness answers within this while both servers are loaded (Kubernetes' default probe
timeout is 1 s; the load and the probes share two cores here)."""
GRPC_LOAD_CLIENT = Path(__file__).with_name("grpc_load_client.py")
MiB = 1024 * 1024
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
"""Two servers and the client share the machine's cores: one torch thread per server, as an
operator packing servers onto a node sets it (OpenMP workers spin while they wait for a core)."""
REQUEST_IDS = itertools.count()
Check = Callable[[], Awaitable[str | None]]
"""One request: sends it, checks the answer; what was wrong with it, or None."""


@dataclass
class Expected:
    embeddings: dict[str, np.ndarray]
    completions: dict[str, str]
    chats: dict[str, str]


@pytest.fixture(scope="module")
def servers(minilm_path: Path, tiny_models: dict[str, Path], tmp_path_factory):
    """MiniLM and the tiny llama, default admission, started side by side."""
    log_dir = tmp_path_factory.mktemp("load")
    encoder = [
        "--model_dir", str(minilm_path), "--model_name", "minilm", "--task", "text_embedding",
    ]  # fmt: skip
    llama = [
        "--model_dir", str(tiny_models["llama"]), "--model_name", "llama",
        "--backend", "huggingface",
    ]  # fmt: skip
    with ExitStack() as stack:
        started = [
            stack.enter_context(run_server(args, log_dir, ready=False, env=ONE_THREAD))
            for args in (encoder, llama)
        ]
        for server in started:
            wait_ready(server)
        yield started


def mean_pooled(path: Path, texts: list[str]) -> np.ndarray:
    """MiniLM as its sentence-transformers files say: mean pooling, then L2 normalisation."""
    pooling = json.loads((path / "1_Pooling" / "config.json").read_text())
    modules = json.loads((path / "modules.json").read_text())
    assert pooling["pooling_mode_mean_tokens"]
    assert modules[-1]["type"].endswith("Normalize")
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    batch = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    return F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=1).numpy()


@pytest.fixture(scope="module")
def expected(minilm_path: Path, tiny_models: dict[str, Path]) -> Expected:
    """The answer for every distinct input, computed once with transformers."""
    vectors = mean_pooled(minilm_path, TEXTS)
    path = tiny_models["llama"]
    reference = Reference(
        AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    )

    def greedy(ids: list[int]) -> str:
        return reference.text(reference.greedy(ids, MAX_TOKENS))

    answers = Expected(
        embeddings=dict(zip(TEXTS, vectors, strict=True)),
        completions={p: greedy(reference.encode(p)) for p in PROMPTS},
        chats={c: greedy(reference.chat_ids(chat_messages(c))) for c in CHATS},
    )
    # distinct inputs, distinct answers: an answer given to the wrong request would show
    assert len(set(answers.completions.values())) == len(PROMPTS)
    assert len(set(answers.chats.values())) == len(CHATS)
    return answers


def chat_messages(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


# --- what the servers do meanwhile ------------------------------------------------------------


@dataclass
class Prober:
    """Polls /v2/health/live of each server from a thread of its own until stopped."""

    urls: list[str]
    answers: list[tuple[int | None, float]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        with httpx.Client(timeout=PROBE_LIMIT_S) as client:
            while not self.stop.is_set():
                for url in self.urls:
                    start = time.monotonic()
                    try:
                        code: int | None = client.get(f"{url}/v2/health/live").status_code
                    except httpx.HTTPError:
                        code = None
                    self.answers.append((code, time.monotonic() - start))
                self.stop.wait(0.1)


@contextmanager
def probing(urls: list[str]) -> Iterator[Prober]:
    prober = Prober(urls)
    thread = threading.Thread(target=prober.run)
    thread.start()
    try:
        yield prober
    finally:
        prober.stop.set()
        thread.join()


def vmrss_bytes(pid: int) -> int:
    """A process's resident memory (0 once it is gone, or while it is a zombie: a zombie's
    status has no VmRSS line)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    rss_lines = [ln for ln in status.splitlines() if ln.startswith("VmRSS:")]
    return 1024 * int(rss_lines[0].split()[1]) if rss_lines else 0


def rss_bytes(server: ServerProcess) -> int:
    """The resident memory of the server and every process under it."""
    pids = [server.process.pid, *(child.pid for child in descendants(server.process.pid))]
    return sum(vmrss_bytes(pid) for pid in pids)


class GrpcLoad:
    """tests/grpc_load_client.py as a subprocess; :meth:`infer` sends one ModelInfer through it
    and waits for its answer."""

    def __init__(self, process: asyncio.subprocess.Process):
        self.process = process
        self.waiting: dict[int, asyncio.Future[dict]] = {}
        self.sent = 0
        self.reader = asyncio.create_task(self.read())

    @classmethod
    @asynccontextmanager
    async def running(cls, server: ServerProcess, model: str) -> AsyncIterator[GrpcLoad]:
        """The client, connected; on the way out its input is closed and it is waited for."""
        process = await asyncio.create_subprocess_exec(
            sys.executable, str(GRPC_LOAD_CLIENT), f"127.0.0.1:{server.grpc_port}", model,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, cwd=REPO, limit=MiB,
        )  # fmt: skip
        assert process.stdout is not None and process.stdin is not None
        try:
            ready = await asyncio.wait_for(process.stdout.readline(), timeout=60)
            assert json.loads(ready) == {"ready": True}, ready
            load = cls(process)
            yield load
            process.stdin.close()
            assert await asyncio.wait_for(process.wait(), timeout=30) == 0
            await load.reader
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()

    async def read(self) -> None:
        assert self.process.stdout is not None
        while line := await self.process.stdout.readline():
            answer = json.loads(line)
            self.waiting.pop(answer["id"]).set_result(answer)
        for future in self.waiting.values():
            future.set_exception(RuntimeError("the gRPC client exited"))

    async def infer(self, texts: list[str]) -> dict:
        assert self.process.stdin is not None
        self.sent += 1
        future = self.waiting[self.sent] = asyncio.get_running_loop().create_future()
        self.process.stdin.write(json.dumps({"id": self.sent, "texts": texts}).encode() + b"\n")
        await self.process.stdin.drain()
        return await future


# --- the requests -------------------------------------------------------------------------------


@dataclass
class Load:
    encoder: httpx.AsyncClient
    llama: httpx.AsyncClient
    grpc: GrpcLoad
    expected: Expected
    statuses: Counter[int | str] = field(default_factory=Counter)

    async def post(self, client: httpx.AsyncClient, path: str, body: dict) -> dict | str:
        """The JSON answer, or what was wrong with it."""
        response = await client.post(path, json=body)
        self.statuses[response.status_code] += 1
        if response.status_code != 200:
            return f"{response.status_code} {response.text[:300]}"
        return response.json()

    def compare(self, got: object, texts: list[str]) -> str | None:
        want = np.stack([self.expected.embeddings[text] for text in texts])
        vectors = np.asarray(got, dtype=np.float32)
        if vectors.shape != want.shape:
            return f"shape {vectors.shape}, expected {want.shape} for {texts}"
        diff = float(np.abs(vectors - want).max())
        return None if diff <= ATOL else f"{diff:.2g} from transformers' embeddings of {texts}"


async def v1(load: Load, texts: list[str]) -> str | None:
    answer = await load.post(load.encoder, "/v1/models/minilm:predict", {"instances": texts})
    return answer if isinstance(answer, str) else load.compare(answer["predictions"], texts)


async def v2(load: Load, texts: list[str]) -> str | None:
    request_id = f"load-{next(REQUEST_IDS)}"
    tensor = {"name": "input-0", "datatype": "BYTES", "shape": [len(texts)], "data": texts}
    body = {"id": request_id, "inputs": [tensor]}
    answer = await load.post(load.encoder, "/v2/models/minilm/infer", body)
    if isinstance(answer, str):
        return answer
    if answer["id"] != request_id:
        return f"the answer to {request_id} says {answer['id']}"
    [output] = answer["outputs"]
    return load.compare(np.reshape(output["data"], output["shape"]), texts)


async def grpc(load: Load, texts: list[str]) -> str | None:
    answer = await load.grpc.infer(texts)
    load.statuses["grpc " + ("OK" if "data" in answer else answer["error"].split()[0])] += 1
    return answer.get("error") or load.compare(answer["data"], texts)


async def embeddings(load: Load, texts: list[str]) -> str | None:
    body = {"model": "minilm", "input": texts}
    answer = await load.post(load.encoder, "/openai/v1/embeddings", body)
    if isinstance(answer, str):
        return answer
    data = sorted(answer["data"], key=lambda item: item["index"])
    return load.compare([item["embedding"] for item in data], texts)


async def rerank(load: Load, texts: list[str]) -> str | None:
    query, *documents = texts
    body = {"model": "minilm", "query": query, "documents": documents}
    answer = await load.post(load.encoder, "/openai/v1/rerank", body)
    if isinstance(answer, str):
        return answer
    vectors = load.expected.embeddings
    cosines = [float(vectors[query] @ vectors[document]) for document in documents]
    results = answer["results"]
    scores = [result["relevance_score"] for result in results]
    if sorted(result["index"] for result in results) != list(range(len(documents))):
        return f"results {results} for {len(documents)} documents"
    if scores != sorted(scores, reverse=True):
        return f"scores out of order: {scores}"
    diff = max(abs(r["relevance_score"] - cosines[r["index"]]) for r in results)
    return None if diff <= ATOL else f"scores {diff:.2g} from the cosines for {query!r}"


async def completion(load: Load, prompt: str) -> str | None:
    body = {"model": "llama", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    answer = await load.post(load.llama, "/openai/v1/completions", body)
    if isinstance(answer, str):
        return answer
    text, want = answer["choices"][0]["text"], load.expected.completions[prompt]
    return None if text == want else f"{prompt!r} completed as {text!r}, not {want!r}"


async def streamed_chat(load: Load, content: str) -> str | None:
    body = {
        "model": "llama", "messages": chat_messages(content), "max_tokens": MAX_TOKENS,
        "temperature": 0, "stream": True,
    }  # fmt: skip
    async with load.llama.stream("POST", "/openai/v1/chat/completions", json=body) as response:
        load.statuses[response.status_code] += 1
        if response.status_code != 200:
            return f"{response.status_code} {(await response.aread())[:300]!r}"
        events = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    if not events or events[-1] != "data: [DONE]":
        return f"the stream for {content!r} ended with {events[-1:]}"
    chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-1]]
    choices = [choice for chunk in chunks for choice in chunk["choices"]]
    text = "".join(choice["delta"].get("content") or "" for choice in choices)
    want = load.expected.chats[content]
    if not choices or choices[-1]["finish_reason"] is None:
        return f"the stream for {content!r} has no finish_reason"
    return None if text == want else f"{content!r} answered {text!r}, not {want!r}"


ENCODER_CHECKS = {"v1": v1, "v2": v2, "grpc": grpc, "embeddings": embeddings, "rerank": rerank}


def encoder_jobs(load: Load, rng: random.Random) -> Iterator[tuple[str, Check]]:
    for kind, count in ENCODER_LOAD.items():
        check = ENCODER_CHECKS[kind]
        for _ in range(count):
            texts = rng.sample(TEXTS, rng.randint(3, 6) if kind == "rerank" else rng.randint(1, 4))
            yield kind, lambda check=check, texts=texts: check(load, texts)


def generation_jobs(load: Load, rng: random.Random) -> Iterator[tuple[str, Check]]:
    for _ in range(GENERATION_LOAD["completions"]):
        prompt = rng.choice(PROMPTS)
        yield "completions", lambda prompt=prompt: completion(load, prompt)
    for _ in range(GENERATION_LOAD["chat"]):
        content = rng.choice(CHATS)
        yield "chat", lambda content=content: streamed_chat(load, content)


async def run(jobs: list[tuple[str, Check]], rng: random.Random) -> list[str]:
    """Every job, in a shuffled order, at most :data:`CONCURRENCY` at a time; the problems."""
    rng.shuffle(jobs)
    slots = asyncio.Semaphore(CONCURRENCY)

    async def one(kind: str, check: Check) -> str | None:
        async with slots:
            try:
                problem = await check()
            except Exception as exc:  # a request that failed is a finding, not a crash
                problem = repr(exc)
        return None if problem is None else f"{kind}: {problem}"

    return [p for p in await asyncio.gather(*(one(*job) for job in jobs)) if p]


def client(server: ServerProcess) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    return httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits)


async def drive(servers: list[ServerProcess], expected: Expected) -> tuple[Load, list[str]]:
    """Both loads at once; what was wrong with any answer."""
    encoder, llama = servers
    rng = random.Random(11)
    async with (
        GrpcLoad.running(encoder, "minilm") as grpc_load,
        client(encoder) as encoder_http,
        client(llama) as llama_http,
    ):
        load = Load(encoder_http, llama_http, grpc_load, expected)
        loads = await asyncio.gather(
            run(list(encoder_jobs(load, rng)), random.Random(1)),
            run(list(generation_jobs(load, rng)), random.Random(2)),
        )
    return load, loads[0] + loads[1]


async def test_mixed_load_is_answered_right_with_probes_answering(servers, expected):
    rss_before = [rss_bytes(server) for server in servers]
    start = time.monotonic()
    with probing([server.url for server in servers]) as prober:
        load, problems = await drive(servers, expected)
    elapsed = time.monotonic() - start
    rss_after = [rss_bytes(server) for server in servers]
    probes = Counter(code for code, _ in prober.answers)
    slowest_probe = max(seconds for _, seconds in prober.answers)
    print(
        f"\n{sum(ENCODER_LOAD.values()) + sum(GENERATION_LOAD.values())} requests in "
        f"{elapsed:.1f}s; answers {dict(load.statuses)}; probes {dict(probes)}, slowest "
        f"{slowest_probe * 1000:.0f} ms; RSS MiB {[r // MiB for r in rss_before]} -> "
        f"{[r // MiB for r in rss_after]}"
    )
    assert not problems, f"{len(problems)} wrong answers:\n" + "\n".join(problems[:30])
    http = sum(n for kind, n in {**ENCODER_LOAD, **GENERATION_LOAD}.items() if kind != "grpc")
    assert load.statuses == {200: http, "grpc OK": ENCODER_LOAD["grpc"]}  # no 5xx, nothing else
    assert probes == {200: len(prober.answers)} and len(prober.answers) >= 2 * elapsed  # 1/s each
    assert slowest_probe < PROBE_LIMIT_S
    for server, before, after in zip(servers, rss_before, rss_after, strict=True):
        assert server.process.poll() is None
        assert after < 2 * before + 500 * MiB, (server.url, before // MiB, after // MiB)
