"""How a vLLM server ends: on SIGTERM (exit 0, engine processes and IPC sockets gone) and when
its engine core dies (readiness drops, the server exits non-zero with our one-line error so that
Kubernetes restarts it). Each case gets a short-lived server of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.backends.vllm import VLLM_FLAGS, vllm_env
from tests.harness import Proc, ServerProcess, descendants, run_server, status, wait_until

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ERROR_PREFIX = "huggingfaceserver: error: "
ENGINE_CORE_NAMES = ("EngineCore", "VLLM::EngineCor")


@pytest.fixture(scope="module")
def llama_path(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama64"]


def server_args(llama_path: Path) -> list[str]:
    return ["--model_dir", str(llama_path), "--model_name", "llm", *VLLM_FLAGS]


def serve_one_request(server: ServerProcess) -> None:
    # greedy: vLLM's CPU build compiles its sampling kernels (seconds) on the first sampled request
    body = {"prompt": "Hello world", "max_tokens": 4, "temperature": 0}
    response = httpx.post(f"{server.url}/openai/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text


def survivors(processes: list[Proc], timeout: float) -> list[Proc]:
    """The processes still alive after waiting up to ``timeout`` seconds for them to go."""
    wait_until(lambda: not any(p.alive() for p in processes), timeout)
    return [p for p in processes if p.alive()]


# --- SIGTERM --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shutdown:
    """A SIGTERM'd server: how it exited and what it left behind."""

    returncode: int | None
    seconds: float
    processes: list[Proc]
    """The server's descendants while it served."""
    survivors: list[Proc]
    sockets_before: set[str]
    sockets_while_serving: set[str]
    sockets_after: set[str]
    log: str


@pytest.fixture(scope="module")
def shutdown(llama_path: Path, tmp_path_factory) -> Shutdown:
    root = tmp_path_factory.mktemp("vllm-sigterm")
    env = vllm_env(root, kv_cache_gib=1)  # as a user sizes it: the server leaves it to vLLM
    rpc = Path(env["VLLM_RPC_BASE_PATH"])
    before = set(os.listdir(rpc))
    with run_server(server_args(llama_path), root, env=env) as server:
        serve_one_request(server)
        processes = descendants(server.process.pid)
        serving = set(os.listdir(rpc))
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        try:
            returncode: int | None = server.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            returncode = None  # run_server kills it on the way out
        seconds = time.monotonic() - signalled
    left = survivors(processes, timeout=10)
    return Shutdown(
        returncode, seconds, processes, left, before, serving, set(os.listdir(rpc)), server.log()
    )


def test_a_kv_cache_the_user_sized_is_left_to_vllm(shutdown):
    (line,) = [x for x in shutdown.log.splitlines() if " backend vllm: " in x]
    assert "KV cache" not in line
    assert "Explicitly set (1.0/" in shutdown.log  # vLLM's CPU worker: VLLM_CPU_KVCACHE_SPACE=1


def test_sigterm_exits_0_within_30_seconds(shutdown):
    assert shutdown.returncode == 0, shutdown.log[-3000:]
    assert shutdown.seconds < 30
    assert "Traceback" not in shutdown.log


def test_sigterm_ends_every_engine_process(shutdown):
    names = [p.cmdline for p in shutdown.processes]
    assert any(name in cmdline for cmdline in names for name in ENGINE_CORE_NAMES), names
    assert shutdown.survivors == []


def test_vllm_uses_the_configured_rpc_directory(shutdown):
    assert shutdown.sockets_while_serving - shutdown.sockets_before


def test_sigterm_leaves_no_ipc_sockets(shutdown):
    assert shutdown.sockets_after - shutdown.sockets_before == set()


# --- engine death ---------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineDeath:
    """A server whose engine core was SIGKILLed: how soon it noticed, and how it ended."""

    not_ready_after: float | None
    """Seconds until readiness was no longer 200 (an error status or no answer)."""
    returncode: int | None
    exited_after: float | None
    survivors: list[Proc]
    log: str
    waiting: tuple[int, str] | None
    """The status and body of a request sent as the engine core died (None: no answer)."""


def request_as_it_dies(server: ServerProcess) -> tuple[int, str] | None:
    body = {"prompt": "Hello world", "max_tokens": 8, "temperature": 0}
    try:
        response = httpx.post(f"{server.url}/openai/v1/completions", json=body, timeout=30)
    except httpx.HTTPError:
        return None
    return response.status_code, response.text


@pytest.fixture(scope="module")
def engine_death(llama_path: Path, tmp_path_factory) -> EngineDeath:
    root = tmp_path_factory.mktemp("vllm-engine-death")
    with run_server(server_args(llama_path), root, env=vllm_env(root)) as server:
        serve_one_request(server)
        processes = descendants(server.process.pid)
        core = [p for p in processes if any(n in p.cmdline for n in ENGINE_CORE_NAMES)]
        assert len(core) == 1, [p.cmdline for p in processes]
        os.kill(core[0].pid, signal.SIGKILL)
        killed = time.monotonic()
        waiting = request_as_it_dies(server)
        not_ready_after = exited_after = None
        while time.monotonic() - killed < 30:
            if server.process.poll() is not None:
                exited_after = time.monotonic() - killed
                break
            if not_ready_after is None and status(f"{server.url}/v2/health/ready") != 200:
                not_ready_after = time.monotonic() - killed
            time.sleep(0.2)
        returncode = server.process.poll()
    left = survivors(processes, timeout=15)
    return EngineDeath(not_ready_after, returncode, exited_after, left, server.log(), waiting)


def test_engine_death_is_noticed_within_20_seconds(engine_death):
    times = (engine_death.not_ready_after, engine_death.exited_after)
    noticed = [t for t in times if t is not None]
    assert noticed and min(noticed) < 20, engine_death.log[-3000:]


def test_a_request_waiting_on_the_dead_engine_gets_a_503_saying_so(engine_death):
    assert engine_death.waiting is not None, engine_death.log[-3000:]
    status_code, body = engine_death.waiting
    assert status_code == 503, body
    assert "the vLLM engine died" in body


def test_engine_death_exits_1(engine_death):
    assert engine_death.returncode == 1, engine_death.log[-3000:]
    assert engine_death.exited_after is not None and engine_death.exited_after < 30


def test_engine_death_leaves_no_process_behind(engine_death):
    assert engine_death.survivors == []


def server_lines(log: str) -> list[str]:
    """The log without what Python's multiprocessing resource tracker (a child process that
    outlives the server by a moment) writes after it."""
    lines = log.rstrip("\n").splitlines()
    while lines and ("resource_tracker" in lines[-1] or lines[-1].startswith("  warnings.warn(")):
        lines.pop()
    return lines


def test_engine_death_ends_with_our_one_line_error(engine_death):
    last = server_lines(engine_death.log)[-1]
    assert last.startswith(ERROR_PREFIX + "the vLLM engine died"), engine_death.log[-3000:]
    assert sum(line.startswith(ERROR_PREFIX) for line in engine_death.log.splitlines()) == 1


def test_engine_death_error_is_the_last_line(engine_death):
    assert engine_death.log.rstrip("\n").splitlines()[-1].startswith(ERROR_PREFIX)
