"""The liveness prober: ``GET /v2/health/live`` every 100 ms, like a kubelet, in its own process.

It runs in a separate process so that the load generator's busy event loop cannot delay it:
what it measures is the server. Each probe opens a new connection (kubelet does not keep
connections alive) and a probe that overruns its period is followed at once by the next.
"""

from __future__ import annotations

import http.client
import multiprocessing
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

PERIOD_S = 0.1
TIMEOUT_S = 5.0


@dataclass
class Probes:
    """Latencies of the probes that answered 200, and how many did not."""

    latencies_ms: list[float] = field(default_factory=list)
    failures: int = 0


def probe(host: str, port: int) -> float | None:
    """Milliseconds for one ``GET /v2/health/live`` on a new connection; None unless 200."""
    start = time.perf_counter()
    connection = http.client.HTTPConnection(host, port, timeout=TIMEOUT_S)
    try:
        connection.request("GET", "/v2/health/live")
        response = connection.getresponse()
        response.read()
        ok = response.status == 200
    except OSError:
        ok = False
    finally:
        connection.close()
    return (time.perf_counter() - start) * 1000 if ok else None


def _poll(host: str, port: int, commands: Connection) -> Probes:
    """Probe every :data:`PERIOD_S` until anything arrives on ``commands``."""
    probes = Probes()
    next_at = time.perf_counter()
    while not commands.poll(max(0.0, next_at - time.perf_counter())):
        next_at += PERIOD_S
        latency = probe(host, port)
        if latency is None:
            probes.failures += 1
        else:
            probes.latencies_ms.append(latency)
        next_at = max(next_at, time.perf_counter())
    return probes


def _serve(commands: Connection) -> None:
    """The prober process: ``(host, port)`` starts polling, the next message stops it and
    sends the Probes back; None ends the process."""
    while (target := commands.recv()) is not None:
        host, port = target
        commands.send("polling")
        probes = _poll(host, port, commands)
        commands.recv()
        commands.send(probes)


class HealthProber:
    """One prober process for the whole benchmark (started once: spawning is not free).

    ``begin(host, port)`` starts polling, ``end()`` stops it and returns the :class:`Probes`,
    ``close()`` ends the process.
    """

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        self.ours, theirs = context.Pipe()
        self.process = context.Process(target=_serve, args=(theirs,), daemon=True)
        self.process.start()

    def begin(self, host: str, port: int) -> None:
        self.ours.send((host, port))
        if self.ours.recv() != "polling":
            raise RuntimeError("the health prober did not start")

    def end(self) -> Probes:
        self.ours.send("stop")
        probes: Probes = self.ours.recv()
        return probes

    def close(self) -> None:
        self.ours.send(None)
        self.process.join(timeout=10)
