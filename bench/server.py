"""The server under test, started as a user starts it and stopped with SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import httpx

READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    """A running ``python -m huggingfaceserver`` process."""

    process: subprocess.Popen[bytes]
    http_port: int
    log_path: Path
    started_at: float
    ready_path: str = "/v2/health/ready"
    ready_s: float = float("nan")
    """Seconds from the start of the process to the first ready answer."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def wait_ready(server: Server, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Poll the readiness route until 200, with a deadline; fail if the process exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(
                f"server exited with {server.process.returncode}:\n{server.log_tail()}"
            )
        try:
            if httpx.get(server.url + server.ready_path, timeout=2).status_code == 200:
                server.ready_s = time.monotonic() - server.started_at
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"server not ready after {timeout_s}s:\n{server.log_tail()}")


def launch(
    command: Sequence[str],
    http_port: int,
    log_path: Path,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    ready_path: str = "/v2/health/ready",
) -> Server:
    """Start ``command`` (which listens on ``http_port``), its output to ``log_path``, with
    ``env`` added to this environment and ``HF_HUB_OFFLINE=1``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started_at = time.monotonic()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            list(command),
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
            cwd=cwd,
        )
    return Server(process, http_port, log_path, started_at, ready_path)


def start(
    args: Sequence[str],
    log_path: Path,
    source_tree: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> Server:
    """``python -m huggingfaceserver ARGS --http_port P --grpc_port Q`` on free ports.

    ``source_tree``: the package is imported from that folder (an older commit's, with this
    interpreter and its packages) instead of the installed one: the process runs there with
    the folder first on ``PYTHONPATH``.
    """
    http_port, grpc_port = free_port(), free_port()
    command = [sys.executable, "-m", "huggingfaceserver", *args]
    command += ["--http_port", str(http_port), "--grpc_port", str(grpc_port)]
    env = dict(env or {})
    if source_tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(source_tree), os.environ.get("PYTHONPATH", "")) if p
        )
    return launch(command, http_port, log_path, env, cwd=source_tree)


def stop(server: Server) -> None:
    """SIGTERM, then SIGKILL (to its descendants too) if it has not exited after
    :data:`STOP_TIMEOUT_S`."""
    if server.process.poll() is not None:
        return
    server.process.send_signal(signal.SIGTERM)
    try:
        server.process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        for pid in reversed(family(server.process.pid)):
            with suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        server.process.wait()


@contextmanager
def serving(
    args: Sequence[str],
    log_path: Path,
    source_tree: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> Iterator[Server]:
    """A ready server for the ``with`` block, stopped after it."""
    with ready(start(args, log_path, source_tree, env)) as server:
        yield server


@contextmanager
def ready(server: Server) -> Iterator[Server]:
    """``server`` once ready, for the ``with`` block, stopped after it (also if it never was)."""
    try:
        wait_ready(server)
        yield server
    finally:
        stop(server)


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue  # the thread has just exited
    return found


def _kib(path: Path, field: str) -> int:
    """The ``FIELD: N kB`` figure of a ``/proc`` file; 0 once the process is gone (or a zombie,
    which has none)."""
    try:
        text = path.read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    return 0


def status_kib(pid: int, field: str) -> int:
    """A memory figure of ``/proc/PID/status`` (``VmRSS``, ``VmHWM``)."""
    return _kib(Path(f"/proc/{pid}/status"), field)


def pss_kib(pid: int) -> int:
    """``Pss`` of ``/proc/PID/smaps_rollup``: the pages it shares with other processes counted
    once over them."""
    return _kib(Path(f"/proc/{pid}/smaps_rollup"), "Pss")


def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after ``pid (comm)`` (the state is ``[0]``, the parent
    ``[1]``); None once the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()


def family(pid: int) -> list[int]:
    """``pid`` and all its descendants."""
    pending, found = [pid], []
    while pending:
        current = pending.pop()
        found.append(current)
        pending += _children(current)
    return found


def family_size(pid: int) -> int:
    """How many processes ``pid`` and its descendants are."""
    return len(family(pid))


def peak_rss_mb(pid: int) -> float:
    """Peak resident memory (VmHWM) of ``pid`` and all its descendants, in MiB."""
    return sum(status_kib(member, "VmHWM") for member in family(pid)) / 1024


def rss_mb(pid: int) -> float:
    """Resident memory (VmRSS) of ``pid`` alone, in MiB."""
    return status_kib(pid, "VmRSS") / 1024


def family_rss_mb(pid: int) -> float:
    """Resident memory (VmRSS) of ``pid`` and all its descendants, in MiB."""
    return sum(status_kib(member, "VmRSS") for member in family(pid)) / 1024


def _cpu_ticks(pid: int) -> int:
    fields = stat_fields(pid)
    return 0 if fields is None else int(fields[11]) + int(fields[12])  # utime, stime


def cpu_seconds(pid: int) -> float:
    """CPU time used so far by ``pid`` and its live descendants, in seconds."""
    return sum(_cpu_ticks(member) for member in family(pid)) / os.sysconf("SC_CLK_TCK")
