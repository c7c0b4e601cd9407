"""The soak's requests: the encoder's V1, V2 REST, V2 gRPC and OpenAI embeddings, the
generative server's OpenAI completions and streamed chats, each sent and its answer checked.

A call takes the request's number and returns what was wrong with the answer, or None.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from huggingfaceserver.units import MiB

from . import texts

MAX_TOKENS = 16
REQUEST_TIMEOUT_S = 120.0
ATOL = 1e-3
"""An encoder answer may differ this much from the warm-up's (batched with other texts)."""
ENCODER_NAME = "encoder"
GENERATION_NAME = "llm"
ENCODER_KINDS = ("V1 predict", "V2 REST infer", "V2 gRPC infer", "OpenAI embeddings")
GENERATION_KINDS = ("OpenAI completions", "OpenAI chat (streamed)")
GRPC_CLIENT = Path(__file__).resolve().parent.parent / "tests" / "grpc_load_client.py"
"""A subprocess: ``tritonclient.grpc`` cannot be imported beside ``kserve`` (see that file)."""
JSON = {"content-type": "application/json"}


@dataclass(frozen=True)
class Servers:
    """Where the two servers answer, and their processes (label -> pid) to sample."""

    encoder_url: str
    encoder_grpc: str
    """``host:port``."""
    generation_url: str
    families: dict[str, int]
    encoder_model: str = ENCODER_NAME
    generation_model: str = GENERATION_NAME


Call = Callable[[int], Awaitable[str | None]]
"""Sends request number N; what was wrong with its answer, or None."""


def encoder_texts(index: int) -> list[str]:
    """One text, or two every other request (answers made of more than one row)."""
    pool = texts.SENTENCES
    return [pool[(index + k) % len(pool)] for k in range(1 + index % 2)]


def compare(got: Any, want: list[list[float]]) -> str | None:
    """None if ``got`` is ``want``'s rows within :data:`ATOL`, else what differs."""
    if not isinstance(got, list) or [len(row) for row in got] != [len(row) for row in want]:
        return f"rows of {[len(r) for r in want]} numbers expected, got {str(got)[:200]}"
    pairs = (pair for g, w in zip(got, want, strict=True) for pair in zip(g, w, strict=True))
    diff = max(abs(a - b) for a, b in pairs)
    return None if diff <= ATOL else f"{diff:.2g} from the warm-up's vectors"


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Any:
    """The JSON answer, or what was wrong with it (a string)."""
    async with session.post(url, data=orjson.dumps(body), headers=JSON) as response:
        raw = await response.read()
    if response.status != 200:
        return f"HTTP {response.status}: {raw[:200]!r}"
    return orjson.loads(raw)


@dataclass
class EncoderCalls:
    """The encoder's four kinds of request, checked against the warm-up's V1 vectors."""

    session: aiohttp.ClientSession
    servers: Servers
    grpc: GrpcClient
    reference: dict[str, list[float]] = field(default_factory=dict)

    def want(self, batch: list[str]) -> list[list[float]]:
        return [self.reference[text] for text in batch]

    async def learn(self) -> None:
        """The V1 vector of every text, one text a request: the reference."""
        url = f"{self.servers.encoder_url}/v1/models/{self.servers.encoder_model}:predict"
        for text in texts.SENTENCES:
            answer = await post(self.session, url, {"instances": [text]})
            if isinstance(answer, str):
                raise RuntimeError(f"the encoder's warm-up failed: {answer}")
            self.reference[text] = answer["predictions"][0]

    async def v1(self, index: int) -> str | None:
        batch = encoder_texts(index)
        url = f"{self.servers.encoder_url}/v1/models/{self.servers.encoder_model}:predict"
        answer = await post(self.session, url, {"instances": batch})
        if isinstance(answer, str):
            return answer
        return compare(answer["predictions"], self.want(batch))

    async def v2(self, index: int) -> str | None:
        batch, request_id = encoder_texts(index), f"soak-{index}"
        tensor = {"name": "input-0", "datatype": "BYTES", "shape": [len(batch)], "data": batch}
        url = f"{self.servers.encoder_url}/v2/models/{self.servers.encoder_model}/infer"
        answer = await post(self.session, url, {"id": request_id, "inputs": [tensor]})
        if isinstance(answer, str):
            return answer
        if answer.get("id") != request_id:
            return f"the answer to {request_id} says {answer.get('id')}"
        [output] = answer["outputs"]
        rows, width = output["shape"]
        data = output["data"]
        return compare([data[r * width : (r + 1) * width] for r in range(rows)], self.want(batch))

    async def grpc_infer(self, index: int) -> str | None:
        batch = encoder_texts(index)
        answer = await self.grpc.infer(batch)
        return answer.get("error") or compare(answer["data"], self.want(batch))

    async def embeddings(self, index: int) -> str | None:
        batch = encoder_texts(index)
        body = {"model": self.servers.encoder_model, "input": batch}
        answer = await post(self.session, f"{self.servers.encoder_url}/openai/v1/embeddings", body)
        if isinstance(answer, str):
            return answer
        data = sorted(answer["data"], key=lambda item: item["index"])
        return compare([item["embedding"] for item in data], self.want(batch))

    def calls(self) -> dict[str, Call]:
        kinds = (self.v1, self.v2, self.grpc_infer, self.embeddings)
        return dict(zip(ENCODER_KINDS, kinds, strict=True))


@dataclass
class GenerationCalls:
    """Greedy completions and streamed chats of at most :data:`MAX_TOKENS` tokens."""

    session: aiohttp.ClientSession
    servers: Servers

    def body(self, index: int) -> dict[str, Any]:
        prompts = texts.prompts()
        return {
            "model": self.servers.generation_model,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "prompt": prompts[index % len(prompts)],
        }

    async def completion(self, index: int) -> str | None:
        url = f"{self.servers.generation_url}/openai/v1/completions"
        answer = await post(self.session, url, self.body(index))
        if isinstance(answer, str):
            return answer
        [choice] = answer["choices"]
        tokens = answer["usage"]["completion_tokens"]
        if not isinstance(choice["text"], str) or not 1 <= tokens <= MAX_TOKENS:
            return f"{tokens} tokens, text {choice['text']!r}"
        return None if choice["finish_reason"] in ("length", "stop") else f"{choice}"

    async def chat(self, index: int) -> str | None:
        body = self.body(index)
        body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
        body["stream"] = True
        url = f"{self.servers.generation_url}/openai/v1/chat/completions"
        async with self.session.post(url, data=orjson.dumps(body), headers=JSON) as response:
            if response.status != 200:
                return f"HTTP {response.status}: {(await response.read())[:200]!r}"
            events = [line.strip() async for line in response.content if line.startswith(b"data:")]
        if not events or events[-1] != b"data: [DONE]":
            return f"the stream ended with {events[-1:]}"
        chunks = [orjson.loads(event.removeprefix(b"data:")) for event in events[:-1]]
        if errors := [chunk["error"] for chunk in chunks if "error" in chunk]:
            return f"the stream carried an error: {errors[0]}"
        choices = [choice for chunk in chunks for choice in chunk["choices"]]
        if not choices or choices[-1]["finish_reason"] not in ("length", "stop"):
            return f"no finish_reason at the end of the stream: {choices[-1:]}"
        contents = [choice["delta"].get("content") or "" for choice in choices]
        return None if all(isinstance(c, str) for c in contents) else f"deltas {contents}"

    def calls(self) -> dict[str, Call]:
        return dict(zip(GENERATION_KINDS, (self.completion, self.chat), strict=True))


class GrpcClient:
    """tests/grpc_load_client.py as a subprocess: :meth:`infer` sends one ModelInfer through it
    and waits for its answer (``{"data": rows}`` or ``{"error": "STATUS message"}``)."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.ids = itertools.count()
        self.reader = asyncio.create_task(self.read())

    @classmethod
    @asynccontextmanager
    async def running(cls, target: str, model: str) -> AsyncIterator[GrpcClient]:
        """The client connected to ``target`` (``host:port``); closed and waited for after."""
        process = await asyncio.create_subprocess_exec(
            sys.executable, str(GRPC_CLIENT), target, model,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=MiB,
        )  # fmt: skip
        assert process.stdout is not None and process.stdin is not None
        try:
            ready = await asyncio.wait_for(process.stdout.readline(), timeout=60)
            if json.loads(ready or b"null") != {"ready": True}:
                raise RuntimeError(f"the gRPC client did not start: {ready!r}")
            client = cls(process)
            yield client
            process.stdin.close()
            await asyncio.wait_for(process.wait(), timeout=30)
            await client.reader
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()

    async def read(self) -> None:
        assert self.process.stdout is not None
        while line := await self.process.stdout.readline():
            answer = json.loads(line)
            future = self.waiting.pop(answer["id"], None)
            if future is not None and not future.done():  # not given up on (timed out)
                future.set_result(answer)
        for future in self.waiting.values():
            if not future.done():
                future.set_exception(RuntimeError("the gRPC client exited"))

    async def infer(self, batch: list[str]) -> dict[str, Any]:
        assert self.process.stdin is not None
        request_id = next(self.ids)
        future = self.waiting[request_id] = asyncio.get_running_loop().create_future()
        try:
            self.process.stdin.write(orjson.dumps({"id": request_id, "texts": batch}) + b"\n")
            await self.process.stdin.drain()
            return await asyncio.wait_for(future, REQUEST_TIMEOUT_S)
        finally:
            self.waiting.pop(request_id, None)
