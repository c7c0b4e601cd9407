"""A lean closed-loop HTTP/1.1 load generator, in processes of its own.

For thousands of small requests per second the aiohttp loop of :mod:`bench.load` costs about
0.15 ms of CPU per request, as much as the server's own work on a tiny model. Here each
connection is an :class:`asyncio.Protocol` on a keep-alive connection that writes its next
request, prebuilt as bytes, the moment the last response is complete: no coroutine, future,
header dictionary or JSON parsing per request (a response is checked by its status and a
substring of its body). The loop is uvloop's where it is installed, and the clients run in
their own processes, so that the benchmark process (and its torch) stays out of the way and
several processes can share the connections when one core is not enough.

Only responses with a ``Content-Length`` are understood (no chunked or streamed bodies).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from multiprocessing.connection import Connection
from typing import cast

from .stats import percentile

SLACK_S = 60.0
"""A run that has not finished this long after its duration is cut short (a stuck server)."""
MAX_ERRORS_KEPT = 5


def http_request(
    method: str, path: str, host: str, body: bytes = b"", content_type: str = "application/json"
) -> bytes:
    """The bytes of one keep-alive HTTP/1.1 request."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}"]
    if body or method == "POST":
        lines += [f"Content-Type: {content_type}", f"Content-Length: {len(body)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


@dataclass(frozen=True)
class Plan:
    """What to send: ``requests`` in turn (each connection starts at its own offset) to
    ``host:port`` for ``duration_s``; a good answer is a 200 whose body holds ``expect``."""

    host: str
    port: int
    requests: tuple[bytes, ...]
    expect: bytes
    duration_s: float


@dataclass
class ClientReport:
    """What one client process measured."""

    answered: int = 0
    error_count: int = 0
    errors: list[str] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)
    elapsed_s: float = 0.0
    cpu_s: float = 0.0

    def fail(self, error: str) -> None:
        self.error_count += 1
        if len(self.errors) < MAX_ERRORS_KEPT:
            self.errors.append(error)


@dataclass
class FastResult:
    """One loaded run over all client processes, and the server's side of it."""

    concurrency: int
    processes: int
    elapsed_s: float
    answered: int
    error_count: int
    errors: list[str]
    latencies_ms: list[float]
    client_cpu_s: float
    server_cpu_s: float = float("nan")
    other_servers_cpu_s: float = float("nan")
    """CPU seconds of the servers that were up but not loaded (should be about 0)."""
    peak_rss_mb: float = float("nan")

    @property
    def requests_per_s(self) -> float:
        return self.answered / self.elapsed_s if self.elapsed_s else float("nan")

    @property
    def server_cpu_ms_per_request(self) -> float:
        return 1000 * self.server_cpu_s / self.answered if self.answered else float("nan")

    @property
    def client_cpu_ms_per_request(self) -> float:
        return 1000 * self.client_cpu_s / self.answered if self.answered else float("nan")

    def latency_ms(self, q: float) -> float:
        return percentile(self.latencies_ms, q)


class _Exchange(asyncio.Protocol):
    """One keep-alive connection that sends its next request when the last one answered."""

    def __init__(self, run: _Run, offset: int) -> None:
        self.run, self.index = run, offset
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.body_at = -1
        self.length = 0
        self.sent_at = 0.0
        self.busy = False
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def send(self) -> None:
        requests = self.run.plan.requests
        self.index += 1
        self.busy = True
        self.sent_at = time.perf_counter()
        assert self.transport is not None
        self.transport.write(requests[self.index % len(requests)])

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer
        buffer += data
        if self.body_at < 0:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            self.body_at = end + 4
            self.length = _content_length(bytes(buffer[:end]))
            if self.length < 0:
                self.run.report.fail("a response without Content-Length (chunked?)")
                self.busy = False
                assert self.transport is not None
                self.transport.close()
                return
        if len(buffer) - self.body_at < self.length:
            return
        now = time.perf_counter()
        status = bytes(buffer[9:12])
        body = buffer[self.body_at : self.body_at + self.length]
        if status == b"200" and self.run.plan.expect in body:
            self.run.report.answered += 1
            self.run.report.latencies_s.append(now - self.sent_at)
        else:
            self.run.report.fail(f"HTTP {status.decode(errors='replace')}: {bytes(body[:200])!r}")
        del buffer[: self.body_at + self.length]
        self.body_at = -1
        self.busy = False
        self.run.last_answer = now
        if now < self.run.deadline:
            self.send()
        else:
            assert self.transport is not None
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.busy:
            self.run.report.fail(f"connection lost: {exc}")
        if not self.closed.done():
            self.closed.set_result(None)


def _content_length(head: bytes) -> int:
    """The ``Content-Length`` of a response head, -1 when it has none."""
    at = head.lower().find(b"\r\ncontent-length:")
    if at < 0:
        return -1
    end = head.find(b"\r\n", at + 2)
    return int(head[at + 17 : end if end >= 0 else len(head)])


@dataclass
class _Run:
    plan: Plan
    report: ClientReport = field(default_factory=ClientReport)
    deadline: float = 0.0
    last_answer: float = 0.0


async def _connect(run: _Run, connections: int, first: int) -> list[_Exchange]:
    loop = asyncio.get_running_loop()
    exchanges = []
    for i in range(connections):
        _, exchange = await loop.create_connection(
            partial(_Exchange, run, first + i), run.plan.host, run.plan.port
        )
        exchanges.append(exchange)
    return exchanges


async def _drive(run: _Run, exchanges: Sequence[_Exchange]) -> None:
    """Send on every connection until the deadline; each finishes its last request; a
    connection the server closes early is not replaced (its error is counted)."""
    start = time.perf_counter()
    run.deadline = start + run.plan.duration_s
    run.last_answer = start
    for exchange in exchanges:
        exchange.send()
    waiting = [exchange.closed for exchange in exchanges]
    _, late = await asyncio.wait(waiting, timeout=run.plan.duration_s + SLACK_S)
    for exchange in exchanges:
        if exchange.transport is not None:
            exchange.transport.close()
    if late:
        run.report.fail(f"{len(late)} connections still waiting {SLACK_S:.0f} s after the end")
    run.report.elapsed_s = max(run.last_answer, run.deadline) - start


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _serve(commands: Connection) -> None:
    """A client process: ``(plan, connections, first)`` connects and answers ``ready``; the
    next message starts the run, whose :class:`ClientReport` is sent back; None ends."""
    loop = _new_loop()
    while (job := commands.recv()) is not None:
        plan, connections, first = job
        run = _Run(plan)
        try:
            exchanges = loop.run_until_complete(_connect(run, connections, first))
        except OSError as exc:
            commands.send(f"cannot connect: {exc}")
            commands.recv()
            commands.send(run.report)
            continue
        commands.send("ready")
        commands.recv()
        cpu = time.process_time()
        loop.run_until_complete(_drive(run, exchanges))
        run.report.cpu_s = time.process_time() - cpu
        commands.send(run.report)
    loop.close()


class LoadClients:
    """Client processes started once and reused for every run (spawning is not free).

    ``run(plan, concurrency)`` spreads the connections over the processes (at most one
    process per connection), starts them together and merges their reports.
    """

    def __init__(self, processes: int = 1) -> None:
        context = multiprocessing.get_context("spawn")
        self.pipes: list[Connection] = []
        self.processes = []
        for _ in range(processes):
            ours, theirs = context.Pipe()
            process = context.Process(target=_serve, args=(theirs,), daemon=True)
            process.start()
            self.pipes.append(ours)
            self.processes.append(process)

    def run(
        self,
        plan: Plan,
        concurrency: int,
        around: Callable[[], float] | None = None,
    ) -> FastResult:
        """One closed-loop run at ``concurrency``. ``around`` (e.g. the server's CPU seconds)
        is read just before the clients start and just after the last one finished; the
        difference is the result's ``server_cpu_s``."""
        shares = _shares(concurrency, len(self.pipes))
        busy = [(pipe, share) for pipe, share in zip(self.pipes, shares, strict=True) if share]
        first = 0
        for pipe, share in busy:
            pipe.send((plan, share, first))
            first += share
        setup_errors = [answer for pipe, _ in busy if (answer := pipe.recv()) != "ready"]
        before = around() if around else float("nan")
        for pipe, _ in busy:
            pipe.send("go")
        reports: list[ClientReport] = [pipe.recv() for pipe, _ in busy]
        after = around() if around else float("nan")
        result = FastResult(
            concurrency=concurrency,
            processes=len(busy),
            elapsed_s=max(report.elapsed_s for report in reports),
            answered=sum(report.answered for report in reports),
            error_count=sum(report.error_count for report in reports) + len(setup_errors),
            errors=[*setup_errors, *(e for report in reports for e in report.errors)],
            latencies_ms=[s * 1000 for report in reports for s in report.latencies_s],
            client_cpu_s=sum(report.cpu_s for report in reports),
        )
        result.server_cpu_s = after - before
        return result

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.send(None)
        for process in self.processes:
            process.join(timeout=10)

    def __enter__(self) -> LoadClients:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def _shares(concurrency: int, processes: int) -> list[int]:
    """``concurrency`` connections spread as evenly as possible over ``processes``."""
    base, extra = divmod(concurrency, processes)
    return [base + (i < extra) for i in range(processes)]
