"""One client call per benchmarked route: send a request, check the answer, time it.

A call takes the session and the request's index (which picks its text) and returns a
:class:`Sample`; an unexpected answer is a failed sample with the reason, never an exception,
except a completion that did not generate exactly the asked tokens: then the benchmark itself
is wrong (EOS reachable?) and stops.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson


@dataclass(frozen=True)
class Sample:
    """One request: its latency, time to first token (streams), tokens generated, error."""

    latency_s: float
    ttft_s: float | None = None
    tokens: int = 0
    error: str | None = None


Call = Callable[[aiohttp.ClientSession, int], Awaitable[Sample]]
JSON = {"content-type": "application/json"}


class TokenCountMismatch(RuntimeError):
    """A completion did not generate exactly ``max_tokens`` tokens."""


async def _post_json(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[float, Any, str | None]:
    """Seconds, parsed body and an error (status and text) for one JSON POST."""
    start = time.perf_counter()
    async with session.post(url, data=orjson.dumps(body), headers=JSON) as response:
        raw = await response.read()
    seconds = time.perf_counter() - start
    if response.status != 200:
        return seconds, None, f"HTTP {response.status}: {raw[:200]!r}"
    return seconds, orjson.loads(raw), None


def v1_predict(base_url: str, model: str, texts: Sequence[str]) -> Call:
    """``POST /v1/models/MODEL:predict`` with one instance; expects one prediction."""
    url = f"{base_url}/v1/models/{model}:predict"

    async def call(session: aiohttp.ClientSession, index: int) -> Sample:
        body = {"instances": [texts[index % len(texts)]]}
        seconds, answer, error = await _post_json(session, url, body)
        if error is None and len(answer.get("predictions", [])) != 1:
            error = f"expected one prediction, got {str(answer)[:200]}"
        return Sample(seconds, error=error)

    return call


def openai_embeddings(base_url: str, model: str, texts: Sequence[str]) -> Call:
    """``POST /openai/v1/embeddings`` with one input; expects one embedding."""
    url = f"{base_url}/openai/v1/embeddings"

    async def call(session: aiohttp.ClientSession, index: int) -> Sample:
        body = {"model": model, "input": texts[index % len(texts)]}
        seconds, answer, error = await _post_json(session, url, body)
        if error is None and len(answer.get("data", [])) != 1:
            error = f"expected one embedding, got {str(answer)[:200]}"
        return Sample(seconds, error=error)

    return call


def _events(line: bytes) -> Any:
    """The JSON of one SSE ``data:`` line; None for other lines and ``[DONE]``."""
    if not line.startswith(b"data:"):
        return None
    data = line[5:].strip()
    return None if data == b"[DONE]" else orjson.loads(data)


def completion_body(
    model: str, prompt: str, max_tokens: int, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A greedy streamed completion of exactly ``max_tokens`` tokens, with usage at the end
    (and the ``extra`` fields, e.g. a structured-output constraint)."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }


def is_token_chunk(event: dict[str, Any]) -> bool:
    """Whether a streamed event carries a token: any chunk with a choice, its text empty or
    not (a special token left out of the text still makes one, from this server and vLLM's
    alike; counting only chunks with text made a LoRA adapter that writes BOS look 1 s late).
    The usage chunk at the end has no choice."""
    return bool(event.get("choices"))


async def _stream(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[Sample, int | None]:
    """One streamed completion: its sample and the usage's ``completion_tokens``."""
    start = time.perf_counter()
    first: float | None = None
    tokens: int | None = None
    async with session.post(url, data=orjson.dumps(body), headers=JSON) as response:
        if response.status != 200:
            error = f"HTTP {response.status}: {(await response.read())[:200]!r}"
            return Sample(time.perf_counter() - start, error=error), None
        async for line in response.content:
            event = _events(line)
            if event is None:
                continue
            if "error" in event:
                return Sample(time.perf_counter() - start, error=str(event["error"])[:200]), None
            if first is None and is_token_chunk(event):
                first = time.perf_counter() - start
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return Sample(time.perf_counter() - start, first, tokens or 0), tokens


def openai_completion_stream(
    base_url: str,
    model: str,
    prompts: Sequence[str],
    max_tokens: int | Sequence[int],
    path: str = "/openai/v1/completions",
    extra: dict[str, Any] | None = None,
) -> Call:
    """A streamed completion (``POST /openai/v1/completions``, or ``path``: vLLM's own server
    has it at ``/v1/completions``): latency, time to the first token's chunk and tokens.
    ``max_tokens`` may be several: request ``i`` of a run asks for the ``i``-th, in turn, so
    that streams end at different steps and new ones arrive while others decode."""
    url = f"{base_url}{path}"
    lengths = [max_tokens] if isinstance(max_tokens, int) else list(max_tokens)

    async def call(session: aiohttp.ClientSession, index: int) -> Sample:
        wanted = lengths[index % len(lengths)]
        body = completion_body(model, prompts[index % len(prompts)], wanted, extra)
        sample, tokens = await _stream(session, url, body)
        if sample.error is None and tokens != wanted:
            raise TokenCountMismatch(
                f"asked for {wanted} tokens, the server generated {tokens}: the benchmark "
                "needs every request to generate exactly max_tokens (is EOS reachable?)"
            )
        return sample

    return call


@dataclass(frozen=True)
class StreamTrace:
    """One streamed completion, chunk by chunk: when each chunk with a choice arrived (seconds
    from the request; :func:`is_token_chunk`), the usage's ``completion_tokens`` and the total
    time."""

    latency_s: float
    chunk_s: tuple[float, ...] = ()
    usage_tokens: int | None = None
    error: str | None = None

    @property
    def ttft_s(self) -> float:
        return self.chunk_s[0] if self.chunk_s else float("nan")

    @property
    def gaps_s(self) -> list[float]:
        """Seconds between consecutive chunks: inter-token latencies when each chunk carries
        one token."""
        return [later - earlier for earlier, later in itertools.pairwise(self.chunk_s)]


async def traced_completion_stream(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> StreamTrace:
    """``POST url`` (a streamed completion ``body``) with the arrival time of every chunk
    that carries a choice; an unexpected answer is a trace with its error."""
    start = time.perf_counter()
    arrivals: list[float] = []
    tokens: int | None = None
    async with session.post(url, data=orjson.dumps(body), headers=JSON) as response:
        if response.status != 200:
            error = f"HTTP {response.status}: {(await response.read())[:200]!r}"
            return StreamTrace(time.perf_counter() - start, error=error)
        async for line in response.content:
            event = _events(line)
            if event is None:
                continue
            if "error" in event:
                error = str(event["error"])[:200]
                return StreamTrace(time.perf_counter() - start, tuple(arrivals), error=error)
            if is_token_chunk(event):
                arrivals.append(time.perf_counter() - start)
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return StreamTrace(time.perf_counter() - start, tuple(arrivals), tokens)
