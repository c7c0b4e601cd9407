"""Hostile clients and long life: a whole request's latency while hundreds of clients stall
mid-upload, and the memory of a server whose model is unloaded and loaded again many times.

Stalled uploads. The bench classifier (MiniLM dimensions) served with default flags. Each
round: 20 V1 predict requests one after the other on a quiet server (their latency is the
reference), then :data:`STALLED` connections that each send a request's headers and 5 bytes of
its body and stall, then the same 20 requests again while they stall; then the stalled
connections are read until the server closes them (each gets a 408 at
``--request_read_timeout_seconds``, set to :data:`READ_TIMEOUT_S` here so a round does not wait
the default 30 s).

Reloads. The same classifier with ``--enable_model_repository``, on torch
(``--backend huggingface``) and on the default backend (ONNX Runtime): :data:`RELOADS`
unload/load cycles, each followed by one predict, the server's RSS and thread count read after
each; the growth from the 2nd cycle to the last is the figure.
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from . import server
from .report import num, table
from .stats import median, percentile
from .targets import Target
from .workloads import Settings

logger = logging.getLogger(__name__)

KEY = "resilience"
MODEL_NAME = "classifier"
STALLED = 600
REQUESTS = 20
READ_TIMEOUT_S = 10
ANSWER_TARGET_S = 1.0
"""With the stalled connections open, every whole request answered 200 within this."""
BODY = b'{"instances": ["a whole request, sent at once"]}'
RELOADS = 20
RELOAD_GROWTH_MIB = 100.0
"""RSS growth from the 2nd unload/load cycle to the last, at most this."""
RELOAD_BACKENDS = {"torch": ("--backend", "huggingface"), "ONNX Runtime (auto)": ()}


@dataclass
class Reloads:
    """One server's unload/load cycles: RSS (MiB) and threads after each."""

    rss_mb: list[float] = field(default_factory=list)
    threads: list[int] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def growth_mb(self) -> float:
        return self.rss_mb[-1] - self.rss_mb[1] if len(self.rss_mb) > 1 else float("nan")


@dataclass
class StallRound:
    quiet_ms: list[float] = field(default_factory=list)
    stalled_ms: list[float] = field(default_factory=list)
    statuses: list[int] = field(default_factory=list)
    """Of the whole requests sent while the others stalled."""
    closed_408: int = 0
    closed_after_s: float = 0.0
    rss_mb: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """Server RSS before the stalls, while they stall, after they were closed."""


@dataclass
class ResilienceResult:
    settings: Settings
    rounds: list[StallRound] = field(default_factory=list)
    reloads: dict[str, Reloads] = field(default_factory=dict)

    def worst_s(self) -> float:
        return max((max(r.stalled_ms) for r in self.rounds if r.stalled_ms), default=0) / 1000

    def targets(self) -> list[Target]:
        answered = all(r.statuses and set(r.statuses) == {200} for r in self.rounds)
        closed = all(r.closed_408 == STALLED for r in self.rounds)
        return [
            Target(
                f"{KEY}: with {STALLED} connections stalled mid-upload, every whole request "
                f"answered 200 within {ANSWER_TARGET_S:g} s",
                answered and self.worst_s() <= ANSWER_TARGET_S,
                f"slowest {self.worst_s() * 1000:.0f} ms over {len(self.rounds)} round(s) of "
                f"{REQUESTS}; statuses {sorted({s for r in self.rounds for s in r.statuses})}",
            ),
            Target(
                f"{KEY}: the stalled connections get a 408 and are closed at the deadline",
                closed,
                ", ".join(
                    f"{r.closed_408}/{STALLED} in {r.closed_after_s:.1f} s" for r in self.rounds
                ),
            ),
            *(
                Target(
                    f"{KEY}: {RELOADS} unload/load cycles on {label} grow RSS by under "
                    f"{RELOAD_GROWTH_MIB:.0f} MiB (2nd to last)",
                    not r.failures and r.growth_mb() < RELOAD_GROWTH_MIB,
                    f"{r.rss_mb[1]:.0f} -> {r.rss_mb[-1]:.0f} MiB ({r.growth_mb():+.0f}); "
                    f"threads {r.threads[1]} -> {r.threads[-1]}"
                    + (f"; failures: {r.failures[:3]}" if r.failures else ""),
                )
                for label, r in self.reloads.items()
                if len(r.rss_mb) > 1
            ),
        ]

    def section(self) -> list[str]:
        rows = []
        for index, r in enumerate(self.rounds, 1):
            rows.append(
                [str(index), num(median(r.quiet_ms)), num(percentile(r.quiet_ms, 100))]
                + [num(median(r.stalled_ms)), num(percentile(r.stalled_ms, 100))]
                + [f"{r.statuses.count(200)}/{len(r.statuses)}"]
                + [f"{r.closed_408}/{STALLED}", num(r.closed_after_s)]
                + [" / ".join(f"{mb:.0f}" for mb in r.rss_mb)]
            )
        columns = ("round", "quiet p50 ms", "quiet max ms", "stalled p50 ms", "stalled max ms",
                   "200s", "408s", "closed after s (deadline "
                   f"{READ_TIMEOUT_S} s)", "RSS MiB before / stalled / after")  # fmt: skip
        reload_rows = [
            [label, f"{len(r.rss_mb)}", num(r.rss_mb[0], 0), num(r.rss_mb[1], 0)]
            + [num(r.rss_mb[-1], 0), f"{r.growth_mb():+.0f}", f"{r.threads[1]} → {r.threads[-1]}"]
            for label, r in self.reloads.items()
            if len(r.rss_mb) > 1
        ]
        reload_columns = ("backend", "cycles", "RSS after 1st MiB", "after 2nd", "after last",
                          "growth 2nd → last MiB", "threads 2nd → last")  # fmt: skip
        return [
            "## Hostile clients: whole requests while hundreds stall mid-upload",
            "",
            f"Method. The bench classifier (MiniLM dimensions), default flags but "
            f"`--request_read_timeout_seconds {READ_TIMEOUT_S}`. Each round: {REQUESTS} V1 "
            f"predict requests one after the other on a quiet server, then {STALLED} "
            "connections that each send a request's headers and 5 bytes of its body and stall, "
            f"then the same {REQUESTS} requests while they stall (latency from send to the whole "
            "answer, new connection each), then the stalled connections are read until the "
            "server closes them. RSS is the server process's VmRSS.",
            "",
            *table(columns, rows),
            "",
            "## Long life: unload/load cycles of the model",
            "",
            f"Method. The bench classifier with `--enable_model_repository`, on torch "
            f"(`--backend huggingface`) and on the default backend (ONNX Runtime): {RELOADS} "
            "cycles of `POST /v2/repository/models/classifier/unload` then `.../load`, each "
            "followed by one V1 predict; the server's VmRSS and thread count after each cycle.",
            "",
            *table(reload_columns, reload_rows),
            "",
        ]


def timed_requests(url: str, requests: int = REQUESTS) -> tuple[list[float], list[int]]:
    latencies, statuses = [], []
    for _ in range(requests):
        start = time.perf_counter()
        response = httpx.post(
            f"{url}/v1/models/{MODEL_NAME}:predict",
            content=BODY,
            headers={"content-type": "application/json"},
            timeout=60,
        )
        latencies.append((time.perf_counter() - start) * 1000)
        statuses.append(response.status_code)
    return latencies, statuses


def stall(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=READ_TIMEOUT_S + 60)
    head = (
        f"POST /v1/models/{MODEL_NAME}:predict HTTP/1.1\r\nhost: bench\r\n"
        f"content-type: application/json\r\ncontent-length: {len(BODY)}\r\n\r\n"
    )
    sock.sendall(head.encode() + BODY[:5])
    return sock


def read_to_end(sock: socket.socket) -> bytes:
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except OSError:
        pass
    return b"".join(chunks)


def stall_round(running: server.Server) -> StallRound:
    pid = running.process.pid
    result = StallRound()
    result.quiet_ms, _ = timed_requests(running.url)
    before = server.rss_mb(pid)
    stalled = [stall(running.http_port) for _ in range(STALLED)]
    opened = time.monotonic()
    try:
        result.stalled_ms, result.statuses = timed_requests(running.url)
        during = server.rss_mb(pid)
        answers = [read_to_end(sock) for sock in stalled]
        result.closed_after_s = time.monotonic() - opened
    finally:
        for sock in stalled:
            sock.close()
    result.closed_408 = sum(answer.startswith(b"HTTP/1.1 408") for answer in answers)
    result.rss_mb = (before, during, server.rss_mb(pid))
    return result


def threads(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/task").iterdir()))


def reload_cycles(running: server.Server) -> Reloads:
    pid = running.process.pid
    result = Reloads()
    base = f"{running.url}/v2/repository/models/{MODEL_NAME}"
    for _ in range(RELOADS):
        for action in ("unload", "load"):
            answer = httpx.post(f"{base}/{action}", timeout=300)
            if answer.status_code != 200:
                result.failures.append(f"{action} {answer.status_code} {answer.text[:200]}")
        _, statuses = timed_requests(running.url, requests=1)
        if statuses != [200]:
            result.failures.append(f"predict {statuses}")
        result.rss_mb.append(server.rss_mb(pid))
        result.threads.append(threads(pid))
    return result


def measure(model_dir: Path, settings: Settings, log_dir: Path) -> ResilienceResult:
    args = ["--model_dir", str(model_dir), "--model_name", MODEL_NAME]
    args += ["--request_read_timeout_seconds", str(READ_TIMEOUT_S), *settings.server_args]
    result = ResilienceResult(settings)
    with server.serving(args, log_dir / f"{KEY}.log") as running:
        timed_requests(running.url)  # warm-up
        for round_ in range(settings.repeats):
            outcome = stall_round(running)
            result.rounds.append(outcome)
            logger.info(
                "  %s, round %d: stalled max %.0f ms, %d/%d closed with 408",
                KEY, round_ + 1, max(outcome.stalled_ms), outcome.closed_408, STALLED,
            )  # fmt: skip
    for label, flags in RELOAD_BACKENDS.items():
        args = ["--model_dir", str(model_dir), "--model_name", MODEL_NAME, *flags]
        args += ["--enable_model_repository", *settings.server_args]
        log = log_dir / f"{KEY}-reload-{flags[-1] if flags else 'auto'}.log"
        with server.serving(args, log) as running:
            timed_requests(running.url)  # warm-up
            reloads = reload_cycles(running)
        result.reloads[label] = reloads
        logger.info(
            "  %s, reloads on %s: %.0f -> %.0f MiB, %d failures",
            KEY, label, reloads.rss_mb[1], reloads.rss_mb[-1], len(reloads.failures),
        )  # fmt: skip
    return result
