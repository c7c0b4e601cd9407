"""The KV cache budget: the memory two bursts take, with the budget binding and without.

The long-output Llama (hidden 64, 2 layers, 16,384 positions: 1 KiB of KV cache per token in
float32) on the transformers backend, two servers in turn: default flags (on this machine the
default budget, 40% of the memory available after the weights, is gigabytes: it does not bind)
and ``--kv-cache-memory-bytes`` :data:`BUDGET` (a small pod's). The bursts:

- a long prompt: :data:`SHORT` streamed completions of short prompts, greedy, exactly
  :data:`SHORT_TOKENS` tokens each; once each has streamed its first token, one completion
  whose prompt is :data:`LONG_PROMPT` token ids (:data:`LONG_TOKENS` new tokens). Unbounded,
  the long prompt joins the running rows and every row's cache becomes that wide (the rows
  share the cache's columns); bounded, it waits for room;
- long answers: :data:`SHORT` streamed completions of :data:`LONG_ANSWER` tokens each, whose
  rows together outgrow the budget: bounded, the latest admitted leave the batch (preempted)
  and go on once there is room again.

The server's RSS (its process family) is sampled every :data:`SAMPLE_S` from ready to the end
of the burst, a fresh server each burst. Every request must come back with all its tokens;
bounded, the RSS may grow by the budget and :data:`SLACK_MIB` (a prompt's own cache while it is
fed in parts, activations, allocator noise) at most.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from huggingfaceserver.units import MiB

from . import server
from .report import table
from .targets import Target
from .workloads import Settings

logger = logging.getLogger(__name__)

KEY = "kv_budget"
MODEL_NAME = "llm"
BUDGET = 64 * MiB
"""The bounded server's ``--kv-cache-memory-bytes``: 65,536 tokens of this model."""
SHORT = 15
SHORT_TOKENS = 400
LONG_PROMPT = 12_000
LONG_TOKENS = 16
LONG_ANSWER = 6_000
BURSTS = (
    f"a {LONG_PROMPT:,}-token prompt among {SHORT} streams",
    f"{SHORT} answers of {LONG_ANSWER:,} tokens",
)
PREEMPTED = "left the running rows for the KV cache budget"
"""What the server logs for each request that leaves the running rows."""
SAMPLE_S = 0.1
SLACK_MIB = 96
TIMEOUT_S = 900
MODES = {"default flags": (), "--kv-cache-memory-bytes 64M": ("--kv-cache-memory-bytes", "64M")}
COLUMNS = ("burst", "server", "RSS at ready MiB", "peak MiB", "growth MiB", "burst s",
           "long request s", "preempted", "tokens as asked", "errors")  # fmt: skip


@dataclass
class Burst:
    """One server's burst."""

    kind: str
    ready_mib: float
    peak_mib: float
    seconds: float
    long_s: float | None
    """The long prompt's request, from its start to its end."""
    tokens: list[int]
    """Completion tokens per request, the long prompt's last."""
    errors: list[str] = field(default_factory=list)
    preempted: int = 0
    """Requests that left the running rows, from the server's log."""

    @property
    def growth_mib(self) -> float:
        return self.peak_mib - self.ready_mib

    @property
    def complete(self) -> bool:
        if self.kind == BURSTS[0]:
            wanted = [SHORT_TOKENS] * SHORT + [LONG_TOKENS]
        else:
            wanted = [LONG_ANSWER] * SHORT
        return not self.errors and self.tokens == wanted


@dataclass
class KvBudgetResult:
    settings: Settings
    bursts: dict[str, list[Burst]] = field(default_factory=dict)
    """By server mode."""

    def targets(self) -> list[Target]:
        bounded = self.bursts[list(MODES)[1]]
        limit = BUDGET / MiB + SLACK_MIB
        growth = max(burst.growth_mib for burst in bounded)
        every = all(burst.complete for bursts in self.bursts.values() for burst in bursts)
        return [
            Target(
                f"{KEY}: every request of the burst answered with all its tokens",
                every,
                "; ".join(
                    f"{mode}: {sum(b.complete for b in bursts)}/{len(bursts)} complete"
                    for mode, bursts in self.bursts.items()
                ),
            ),
            Target(
                f"{KEY}: bounded, the server grows by the budget and {SLACK_MIB} MiB at most",
                growth <= limit,
                f"peak growth {growth:.0f} MiB (limit {limit:.0f})",
            ),
        ]

    def section(self) -> list[str]:
        rows = [
            [
                burst.kind,
                mode,
                f"{burst.ready_mib:.0f}",
                f"{burst.peak_mib:.0f}",
                f"{burst.growth_mib:.0f}",
                f"{burst.seconds:.1f}",
                "–" if burst.long_s is None else f"{burst.long_s:.1f}",
                str(burst.preempted),
                "yes" if burst.complete else f"no: {burst.tokens}",
                str(len(burst.errors)),
            ]
            for kind in BURSTS
            for mode, bursts in self.bursts.items()
            for burst in bursts
            if burst.kind == kind
        ]
        return [
            "## KV cache budget: a long prompt among short streams",
            "",
            "Method. The long-output Llama (hidden 64, 2 layers, 16,384 positions: 1 KiB of KV "
            "cache per token in float32) on the transformers backend; two servers in turn, "
            f"{self.settings.repeats} round(s): default flags (the default budget, 40% of the "
            "memory available after the weights, does not bind on this machine) and "
            f"`--kv-cache-memory-bytes 64M` (65,536 tokens). Two bursts, a fresh server each: "
            f"{SHORT} streamed completions of short prompts, greedy, exactly {SHORT_TOKENS} "
            "tokens each (`ignore_eos`), and once each has streamed its first token one "
            f"completion of a {LONG_PROMPT:,}-token prompt ({LONG_TOKENS} new tokens); then "
            f"{SHORT} streamed completions of exactly {LONG_ANSWER:,} tokens each, together "
            f"{SHORT * LONG_ANSWER:,} tokens of KV cache at their end. RSS of the server's "
            f"process family sampled every {SAMPLE_S:g} s from ready to the burst's end; growth "
            "= peak - RSS at ready; preempted: the requests that left the running rows (server "
            "log).",
            "",
            *table(COLUMNS, rows),
            "",
        ]


async def _completion(
    session: aiohttp.ClientSession,
    url: str,
    prompt: str | list[int],
    max_tokens: int,
    started: asyncio.Event | None = None,
) -> int:
    """A streamed completion: its completion tokens (from the usage chunk); ``started`` is
    set at its first chunk."""
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tokens = 0
    async with session.post(f"{url}/openai/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{response.status}: {(await response.text())[:300]}")
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if started is not None:
                started.set()
            usage = json.loads(line[6:]).get("usage")
            if usage:
                tokens = int(usage["completion_tokens"])
    return tokens


async def _burst(url: str, pid: int, kind: str) -> Burst:
    ready = server.family_rss_mb(pid)
    peak = ready
    done = asyncio.Event()

    async def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, server.family_rss_mb(pid))
            try:
                await asyncio.wait_for(done.wait(), SAMPLE_S)
            except TimeoutError:
                continue

    timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=SHORT + 1)
    errors: list[str] = []
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        sampler = asyncio.create_task(sample())
        began = time.monotonic()
        answer = SHORT_TOKENS if kind == BURSTS[0] else LONG_ANSWER
        started = [asyncio.Event() for _ in range(SHORT)]
        tasks = [
            asyncio.create_task(
                _completion(session, url, f"short request {i}:", answer, started[i])
            )
            for i in range(SHORT)
        ]
        long_s: float | None = None
        long = None
        if kind == BURSTS[0]:
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), TIMEOUT_S)
            long_began = time.monotonic()
            ids = [(7 * i) % 200 + 3 for i in range(LONG_PROMPT)]
            long = asyncio.create_task(_completion(session, url, ids, LONG_TOKENS))
            tasks.append(long)
        tokens: list[int] = []
        for task in tasks:
            try:
                tokens.append(await task)
            except Exception as exc:  # a failed request is a finding
                tokens.append(0)
                errors.append(repr(exc)[:300])
            if task is long:
                long_s = time.monotonic() - long_began
        seconds = time.monotonic() - began
        done.set()
        await sampler
    return Burst(kind, ready, peak, seconds, long_s, tokens, errors)


def measure(model_dir: Path, settings: Settings, log_dir: Path) -> KvBudgetResult:
    """Each server in turn, :attr:`Settings.repeats` rounds (a fresh server each burst: the
    peak is the burst's own)."""
    args = ["--model_dir", str(model_dir), "--model_name", MODEL_NAME, "--backend", "huggingface"]
    result = KvBudgetResult(settings)
    for round_ in range(settings.repeats):
        for kind_number, kind in enumerate(BURSTS):
            for number, (mode, flags) in enumerate(MODES.items()):
                with ExitStack() as stack:
                    log_path = log_dir / f"{KEY}-{kind_number}-{number}-{round_}.log"
                    launched = server.start([*args, *flags, *settings.server_args], log_path)
                    running = stack.enter_context(server.ready(launched))
                    burst = asyncio.run(_burst(running.url, running.process.pid, kind))
                burst.preempted = log_path.read_text().count(PREEMPTED)
                result.bursts.setdefault(mode, []).append(burst)
                logger.info(
                    "  %s, %s, %s, round %d: +%.0f MiB, %.1f s, %d preempted, %d errors",
                    KEY, kind, mode, round_ + 1, burst.growth_mib, burst.seconds,
                    burst.preempted, len(burst.errors),
                )  # fmt: skip
    return result
