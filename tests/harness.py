"""In-process and subprocess servers for tests: the real stack, built from argv."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
from fastapi import FastAPI
from kserve.model_repository import ModelRepository
from kserve.protocol.model_repository_extension import ModelRepositoryExtension

from huggingfaceserver.assembly import build_model
from huggingfaceserver.cli import parse_args
from huggingfaceserver.edge import listeners
from huggingfaceserver.edge.serving import ModelAwareDataPlane
from huggingfaceserver.protocols.kserve_model import BackendModel

REPO = Path(__file__).resolve().parent.parent

if TYPE_CHECKING:  # see sdk_for
    import openai


def build_app(model: BackendModel, openai_prefix: str = "/openai") -> FastAPI:
    """The server's app (:func:`huggingfaceserver.edge.listeners.build_app`), without the gateway,
    serving ``model``."""
    registry = ModelRepository()
    registry.update(model)
    dataplane = ModelAwareDataPlane(model_registry=registry)
    return listeners.build_app(dataplane, ModelRepositoryExtension(registry), openai_prefix)


def load_model(argv: Sequence[str]) -> BackendModel:
    model = build_model(parse_args(list(argv)))
    model.load_backend()
    model.ready = True  # the server warms up first (ModelLoader); tests need not
    return model


def loader(model_dir: Path, name: str) -> Callable[..., BackendModel]:
    """``load(*flags)``: the model in ``model_dir`` on the transformers backend, served as
    ``name`` and loaded as the server loads it, once per flags."""
    cache: dict[tuple[str, ...], BackendModel] = {}

    def load(*flags: str) -> BackendModel:
        if flags not in cache:
            argv = ["--model_dir", str(model_dir), "--model_name", name, "--backend"]
            cache[flags] = load_model([*argv, "huggingface", *flags])
        return cache[flags]

    return load


def client_for(model: BackendModel, openai_prefix: str = "/openai") -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=build_app(model, openai_prefix))
    return httpx.AsyncClient(transport=transport, base_url="http://test")


def sdk_for(model: BackendModel) -> openai.AsyncOpenAI:
    """The ``openai`` SDK's async client of ``model``'s app, in-process. (Imported here: the
    startup tests run servers from this module, which must not import the SDK.)"""
    import openai

    return openai.AsyncOpenAI(
        base_url="http://test/openai/v1", api_key="unused", http_client=client_for(model)
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    process: subprocess.Popen
    http_port: int
    grpc_port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_log(
        self, pattern: str | re.Pattern[str], since: int = 0, timeout: float = 60.0
    ) -> re.Match[str]:
        """The first match of ``pattern`` in the log after offset ``since`` (a length of
        :meth:`log` taken earlier), waiting up to ``timeout`` seconds for it to be written."""
        compiled = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            exited = self.process.poll() is not None
            log = self.log()
            if match := compiled.search(log, since):
                return match
            if exited or time.monotonic() > deadline:
                why = "the server exited" if exited else f"not within {timeout}s"
                raise AssertionError(f"{compiled.pattern!r} not logged ({why}):\n{log[since:]}")
            time.sleep(0.05)


def wait_ready(server: ServerProcess, timeout: float = 120.0) -> None:
    """Poll /v2/health/ready until it says ready, with a deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"server exited with {server.process.returncode}:\n{server.log()}")
        try:
            if httpx.get(server.url + "/v2/health/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"server not ready after {timeout}s:\n{server.log()}")


@contextmanager
def run_server(
    args: Sequence[str],
    log_dir: Path,
    ready: bool = True,
    env: Mapping[str, str] | None = None,
    stop_timeout: float = 30.0,
) -> Iterator[ServerProcess]:
    """``python -m huggingfaceserver ARGS`` as a user starts it, on free ports.

    ``env`` adds to (or overrides) this process's environment for the server. On the way out a
    server still running gets SIGTERM, and SIGKILL if it has not exited ``stop_timeout``
    seconds later.
    """
    http_port, grpc_port = free_port(), free_port()
    log_path = log_dir / f"server-{http_port}.log"
    server_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "huggingfaceserver",
                *args,
                "--http_port",
                str(http_port),
                "--grpc_port",
                str(grpc_port),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=server_env,
            cwd=REPO,
        )
    server = ServerProcess(process, http_port, grpc_port, log_path)
    try:
        if ready:
            wait_ready(server)
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=stop_timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


# --- processes ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Proc:
    """A process, told apart from a later one that reuses its pid by its start time."""

    pid: int
    start_time: int
    cmdline: str

    def alive(self) -> bool:
        stat = _stat(self.pid)
        return stat is not None and stat[1] == self.start_time and stat[0] != "Z"


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, start time, parent pid) from /proc/PID/stat; None once the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # the command name may hold spaces and ")"
    return fields[0], int(fields[19]), int(fields[1])


def proc(pid: int) -> Proc | None:
    """The process ``pid`` now; None once it is gone."""
    stat = _stat(pid)
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return None
    if stat is None:
        return None
    return Proc(pid, stat[1], cmdline.decode(errors="replace").strip())


def children(pid: int) -> list[Proc]:
    """The direct children of ``pid`` (from /proc/PID/task/*/children)."""
    pids: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            pids.update(int(child) for child in task.read_text().split())
        except OSError:
            continue  # the thread has just exited
    return [p for child in sorted(pids) if (p := proc(child)) is not None]


def descendants(root_pid: int) -> list[Proc]:
    """Every process below ``root_pid`` (children, their children, ...)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            parents.setdefault(stat[2], []).append(int(entry.name))
    found, todo = [], [root_pid]
    while todo:
        for pid in parents.get(todo.pop(), []):
            if (child := proc(pid)) is not None:
                found.append(child)
                todo.append(pid)
    return found


def wait_until(condition: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    """Poll ``condition`` until it holds or ``timeout`` seconds pass; whether it held."""
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def status(url: str) -> int | None:
    """The HTTP status of ``GET url``; None when nothing answers."""
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return None


def leave_stream_after(url: str, body: dict, chunks: int = 2) -> list[dict]:
    """POST a streamed completion, read ``chunks`` SSE data events, then close the connection
    (a client that goes away mid-stream)."""
    received: list[dict] = []
    with httpx.stream("POST", url, json=body, timeout=30) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                received.append(json.loads(line.removeprefix("data: ")))
            if len(received) == chunks:
                break
    return received
