"""The two-front layout's lifecycle (``--api_workers 2``), as a user starts the server: the
process started (the supervisor) has one engine process and, through multiprocessing's fork
server (which imports the front's modules once), two front processes below it.
Readiness waits for the engine's model and both fronts; the fronts share the port; a client
that leaves frees its work in the engine; a child that dies stops the whole server (exit 1,
our last line naming it); SIGTERM lets streams finish, then exit 0; the supervisor's death
leaves no child behind. Each ending gets a server of its own."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
import pytest

from huggingfaceserver.cli import parse_args
from huggingfaceserver.edge.listeners import HTTP_HOST, http_port
from huggingfaceserver.errors import ProcessDied, StartupError
from huggingfaceserver.topology.supervisor import ProcessGroup, Wiring, run_processes
from tests.harness import (
    Proc,
    ServerProcess,
    children,
    descendants,
    leave_stream_after,
    proc,
    run_server,
    status,
    wait_ready,
    wait_until,
)
from tiny_models import build_llama

pytestmark = pytest.mark.slow

ERROR_PREFIX = "huggingfaceserver: error: "
PIDS = re.compile(r"engine pid (\d+), fronts pids (\d+), (\d+)")
CANCELLED = re.compile(r" (\d+) \S+ INFO generation cancelled \(client gone\) after (\d+) tokens")
COMPLETION_LOGGED = re.compile(
    r' (\d+) huggingfaceserver\.edge\.gateway INFO request \S+ "POST /openai/v1/completions" 200 '
)
EXIT_S = 20.0
"""From a child's death to the supervisor's exit (the others have nothing in flight)."""
DRAIN_S = 30.0
"""From SIGTERM to exit, streams finished on the way (Kubernetes' default grace period)."""
GONE_S = 10.0
"""For the children of a server that has exited to be gone."""
VICTIMS = ["engine", "front-0", "front-1"]


@dataclass(frozen=True)
class Group:
    """A two-front server's processes."""

    supervisor: Proc
    engine: Proc
    fronts: list[Proc]
    children: list[Proc]
    """Every process below the supervisor: engine, fronts, and multiprocessing's resource
    tracker and fork server (the fronts' parent)."""

    def named(self, name: str) -> Proc:
        """A child by the supervisor's name for it: ``engine``, ``front-0``, ``front-1``."""
        return self.engine if name == "engine" else self.fronts[int(name.split("-")[1])]

    def everyone(self) -> list[Proc]:
        return [self.supervisor, *self.children]


def group_of(server: ServerProcess) -> Group:
    """The processes named in the supervisor's log line, checked against those below it."""
    pids = [int(pid) for pid in server.wait_for_log(PIDS).groups()]
    supervisor = proc(server.process.pid)
    assert supervisor is not None
    found = {child.pid: child for child in descendants(supervisor.pid)}
    assert set(pids) <= set(found), (pids, found)
    engine, *fronts = (found[pid] for pid in pids)
    return Group(supervisor, engine, fronts, list(found.values()))


def survivors(processes: list[Proc]) -> list[Proc]:
    """Those of ``processes`` still alive after waiting up to GONE_S for them to go."""
    wait_until(lambda: not any(p.alive() for p in processes), GONE_S)
    return [p for p in processes if p.alive()]


def llama_args(tiny_models: dict[str, Path], *flags: str) -> list[str]:
    path = str(tiny_models["llama"])
    return ["--model_dir", path, "--model_name", "llama", "--backend", "huggingface", *flags]


def classifier_args(tiny_models: dict[str, Path]) -> list[str]:
    path = str(tiny_models["bert_sequence_classification"])
    return ["--model_dir", path, "--model_name", "tiny", "--api_workers", "2"]


def readiness(server: ServerProcess, times: int) -> list[tuple[int, dict]]:
    """``GET /v2/health/ready`` ``times`` times, each on a new connection."""
    answers = []
    for _ in range(times):
        response = httpx.get(f"{server.url}/v2/health/ready", timeout=10)
        answers.append((response.status_code, response.json()))
    return answers


def refuses_connections(url: str) -> bool:
    try:
        httpx.get(url, timeout=2)
    except httpx.ConnectError:
        return True
    except httpx.HTTPError:
        pass
    return False


@dataclass
class Stream:
    """A streamed completion as the client saw it: each SSE payload and when it came."""

    events: list[str] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    failure: str | None = None
    """How the connection failed, if it did."""

    def chunks(self) -> list[dict]:
        return [json.loads(event) for event in self.events if event != "[DONE]"]


def read_stream(url: str, body: dict, started: threading.Event) -> Stream:
    """Read a streamed completion to its end; ``started`` is set at its first event."""
    stream = Stream()
    try:
        with httpx.stream("POST", f"{url}/openai/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    stream.events.append(line.removeprefix("data: "))
                    stream.times.append(time.monotonic())
                    started.set()
    except httpx.HTTPError as exc:
        stream.failure = repr(exc)
    finally:
        started.set()
    return stream


# --- readiness, the shared port, disconnects, bad input: one server -------------------------


@dataclass(frozen=True)
class Served:
    server: ServerProcess
    group: Group
    engine_held: list[tuple[int, dict]]
    """Readiness while the engine was stopped (SIGSTOP) and front 1 too."""
    front_held: list[tuple[int, dict]]
    """Readiness once the engine had loaded the model, front 1 still stopped."""
    ready: list[tuple[int, dict]]
    """Readiness once both were let go and the server said ready."""


@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory) -> Iterator[Served]:
    """A two-front tiny Llama whose engine and second front are held (SIGSTOP) from their
    start, and let go one after the other: readiness is read at each stage."""
    args = llama_args(tiny_models, "--api_workers", "2")
    root = tmp_path_factory.mktemp("supervisor")
    with run_server(args, root, ready=False, stop_timeout=10) as server:
        group = group_of(server)  # logged at spawn: the children are still importing
        held = [group.engine, group.fronts[1]]
        for child in held:
            os.kill(child.pid, signal.SIGSTOP)
        try:
            assert wait_until(lambda: status(server.url + "/v2/health/live") == 200, 120)
            engine_held = readiness(server, 5)
            os.kill(group.engine.pid, signal.SIGCONT)
            # the weights are in; the engine then waits for every front before it times its
            # forward passes (tune) and says it is loaded
            server.wait_for_log("loaded LlamaForCausalLM")
            front_held = readiness(server, 5)
        finally:
            for child in held:
                os.kill(child.pid, signal.SIGCONT)
        wait_ready(server)
        yield Served(server, group, engine_held, front_held, readiness(server, 10))


def test_not_ready_while_the_engine_loads(served):
    assert served.engine_held == [(503, {"error": "Server is not ready."})] * 5


def test_not_ready_until_every_front_said_hello(served):
    assert served.front_held == [(503, {"error": "Server is not ready."})] * 5


def test_ready_once_the_model_is_loaded_and_both_fronts_are_up(served):
    assert served.ready == [(200, {"ready": True})] * 10


def fork_server(group: Group) -> Proc:
    [server] = [p for p in children(group.supervisor.pid) if "forkserver" in p.cmdline]
    return server


def test_the_supervisor_has_the_engine_and_the_fronts_fork_server_as_children(served):
    """The same processes as at their start (none restarted): the engine, multiprocessing's
    resource tracker and its fork server as the supervisor's children, the two fronts as the
    fork server's, and nothing else."""
    group = served.group
    assert set(descendants(group.supervisor.pid)) == set(group.children)
    now = children(group.supervisor.pid)
    trackers = [p for p in now if "resource_tracker" in p.cmdline]
    assert len(trackers) == 1, [p.cmdline for p in now]
    assert set(now) == {group.engine, fork_server(group), *trackers}
    assert set(children(fork_server(group).pid)) == set(group.fronts)


def loads_torch(process: Proc) -> bool:
    """Whether torch's library is mapped into ``process``."""
    return "libtorch" in Path(f"/proc/{process.pid}/maps").read_text()


def test_only_the_engine_loads_torch(served):
    """The fronts tokenize, render and detokenize with the tokenizer alone (and the fork server
    they come from imports what they import); the supervisor reads config.json as JSON: none
    of them imports torch (nor transformers' model config)."""
    group = served.group
    assert loads_torch(group.engine)
    lean = [group.supervisor, fork_server(group), *group.fronts]
    assert [loads_torch(p) for p in lean] == [False] * 4


def test_only_the_engine_loads_torch_for_an_encoder(tiny_models, tmp_path):
    """The same for an encoder task, whose fronts have the config's facts (labels, maximum
    length) from the engine; their answers are the engine's results."""
    with run_server(classifier_args(tiny_models), tmp_path, stop_timeout=5) as server:
        group = group_of(server)
        assert loads_torch(group.engine)
        assert [loads_torch(p) for p in [group.supervisor, *group.fronts]] == [False] * 3
        response = httpx.post(
            f"{server.url}/v1/models/tiny:predict", json={"instances": ["a b c"] * 4}, timeout=30
        )
        assert response.status_code == 200, response.text
        [prediction] = set(response.json()["predictions"])
        assert prediction in (0, 1)


def test_both_fronts_answer_on_the_shared_port(served):
    """Each request on a connection of its own: the kernel spreads them over both fronts,
    whose request log lines carry their process id."""
    server = served.server
    since = len(server.log())

    def complete(_: int) -> int:
        body = {"model": "llama", "prompt": "Hello", "max_tokens": 2}
        return httpx.post(f"{server.url}/openai/v1/completions", json=body, timeout=60).status_code

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(complete, range(32))) == [200] * 32

    def logged() -> list[int]:
        return [int(pid) for pid in COMPLETION_LOGGED.findall(server.log(), since)]

    assert wait_until(lambda: len(logged()) >= 32, 15), server.log()[since:]
    assert set(logged()) == {front.pid for front in served.group.fronts}


def test_a_client_that_leaves_a_stream_frees_its_rows_in_the_engine(served):
    server = served.server
    since = len(server.log())
    body = {"prompt": "Hi", "max_tokens": 100, "ignore_eos": True, "stream": True}
    received = leave_stream_after(f"{server.url}/openai/v1/completions", body)
    assert all(chunk["choices"][0]["finish_reason"] is None for chunk in received)
    cancelled = server.wait_for_log(CANCELLED, since, timeout=15)
    pid, tokens = (int(group) for group in cancelled.groups())
    assert pid == served.group.engine.pid
    assert tokens < 60
    assert status(f"{server.url}/v2/health/ready") == 200


def test_bad_input_is_a_400_through_a_front(served):
    url = served.server.url
    for _ in range(4):
        v1 = httpx.post(f"{url}/v1/models/llama:predict", json={"instances": [1]}, timeout=30)
        assert v1.status_code == 400, v1.text
        assert isinstance(v1.json()["error"], str)
        # over the context the engine reported to the fronts (128 tokens)
        body = {"model": "llama", "prompt": "Hi", "max_tokens": 1000}
        too_long = httpx.post(f"{url}/openai/v1/completions", json=body, timeout=30)
        assert too_long.status_code == 400, too_long.text
        assert "128" in too_long.json()["error"]["message"]
    body = {"model": "llama", "prompt": "Hi", "max_tokens": 2}
    assert httpx.post(f"{url}/openai/v1/completions", json=body, timeout=30).status_code == 200


# --- a child dies ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Ending:
    """How a server ended: its exit status (None: still running at the deadline, then
    SIGKILLed), how long after the event, what it left behind, its log."""

    group: Group
    returncode: int | None
    seconds: float
    survivors: list[Proc]
    log: str
    stream: Stream | None = None
    """A stream that was in flight, if there was one."""

    def last_line(self) -> str:
        return self.log.rstrip("\n").splitlines()[-1]


def ending(server: ServerProcess, group: Group, since: float, timeout: float) -> Ending:
    """Wait up to ``timeout`` seconds (from ``since``) for the server to exit by itself."""
    try:
        returncode: int | None = server.process.wait(max(0.0, since + timeout - time.monotonic()))
    except subprocess.TimeoutExpired:
        returncode = None
    seconds = time.monotonic() - since
    if returncode is None:
        server.process.kill()
        server.process.wait()
    return Ending(group, returncode, seconds, survivors(group.everyone()), server.log())


STREAM_IN_FLIGHT = {"prompt": "Hi", "max_tokens": 120, "n": 32, "logprobs": 20, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine_death(tiny_models, tmp_path_factory) -> Ending:
    """A two-front tiny Llama whose engine is SIGKILLed while a stream is in flight."""
    args = llama_args(tiny_models, "--api_workers", "2")
    with run_server(args, tmp_path_factory.mktemp("engine-death"), stop_timeout=5) as server:
        group = group_of(server)
        started = threading.Event()
        body = {**STREAM_IN_FLIGHT, "stream": True}
        with ThreadPoolExecutor(1) as pool:
            reading = pool.submit(read_stream, server.url, body, started)
            assert started.wait(30)
            os.kill(group.engine.pid, signal.SIGKILL)
            killed = time.monotonic()
            stream = reading.result(timeout=30)
        end = ending(server, group, killed, EXIT_S)
    return replace(end, stream=stream)


@pytest.fixture(scope="module", params=VICTIMS)
def death(request, tiny_models, tmp_path_factory) -> tuple[str, Ending]:
    """A two-front server that lost one child to SIGKILL once ready: (its name, the end)."""
    if request.param == "engine":
        return request.param, request.getfixturevalue("engine_death")
    root = tmp_path_factory.mktemp(f"{request.param}-death")
    with run_server(classifier_args(tiny_models), root, stop_timeout=5) as server:
        group = group_of(server)
        os.kill(group.named(request.param).pid, signal.SIGKILL)
        return request.param, ending(server, group, time.monotonic(), EXIT_S)


def test_a_stream_in_flight_ends_with_an_error_when_the_engine_dies(engine_death):
    stream = engine_death.stream
    assert stream is not None and stream.failure is None, stream
    assert stream.events[-1] == "[DONE]"
    error = json.loads(stream.events[-2])["error"]
    assert error["message"] == "the engine process stopped"
    assert all("error" not in chunk for chunk in stream.chunks()[:-1])


def test_a_dead_child_stops_the_whole_server(death):
    """Exit 1 soon, the last line our error naming the child, no process left."""
    victim, end = death
    assert end.returncode == 1, end.log[-3000:]
    assert end.seconds < EXIT_S
    last = end.last_line()
    assert last.startswith(ERROR_PREFIX), end.log[-3000:]
    assert victim in last and "SIGKILL" in last, last
    assert end.survivors == []


def exit_with(status: int) -> None:
    raise SystemExit(status)


@pytest.mark.parametrize(
    ("ready_fronts", "error"), [(0, StartupError), (1, StartupError), (2, ProcessDied)]
)
def test_a_child_that_exits_is_a_startup_error_until_every_front_was_ready(
    tmp_path, ready_fronts, error
):
    """Before the server served, the exit is a startup failure; after, a run-time one (the
    same one line either way)."""
    group = ProcessGroup(parse_args([]), Wiring("ipc://unused", str(tmp_path), fronts=2))
    group.ready_fronts.add(ready_fronts)
    child = multiprocessing.get_context("fork").Process(target=exit_with, args=(3,), name="front-1")
    child.start()
    failure = group.exit_error(child)
    assert type(failure) is error
    assert str(failure) == "the front-1 process exited with status 3"


def test_with_tls_at_the_default_port_the_port_checked_is_the_one_served(tmp_path):
    """KServe's HTTPS port (8443) replaces the default HTTP port with TLS: held by another
    program, the server refuses to start before it starts any child."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.touch()
    key.touch()
    config = parse_args(["--ssl_certfile", str(cert), "--ssl_keyfile", str(key)])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind((HTTP_HOST, http_port(config.server)))
        holder.listen()
        with pytest.raises(StartupError, match="cannot listen on HTTP port 8443"):
            run_processes(config, fronts=2)
    assert multiprocessing.active_children() == []


def test_the_supervisors_death_leaves_no_child_behind(tiny_models, tmp_path):
    with run_server(classifier_args(tiny_models), tmp_path, stop_timeout=5) as server:
        group = group_of(server)
        assert len(group.children) == 5  # engine, two fronts, resource tracker, fork server
        server.process.kill()
        server.process.wait()
        assert survivors(group.children) == []


# --- SIGTERM ----------------------------------------------------------------------------------


STREAMS = 4
DRAINED_STREAM = {"prompt": "Hi", "max_tokens": 500, "n": 16, "logprobs": 20, "ignore_eos": True}
"""Long enough (about 5 s of decoding here) that the first stream is still running when the last
has begun: at 120 tokens one ended before the fourth began, on a busy machine with faster
decode steps."""


@dataclass(frozen=True)
class Drain:
    end: Ending
    signalled: float
    streams: list[Stream]
    refused_after: float | None
    """Seconds from SIGTERM until a new connection was refused (None: not within 10 s)."""
    running_when_refused: bool


@pytest.fixture(scope="module")
def drained(tiny_models, tmp_path_factory) -> Drain:
    """SIGTERM to a two-front tiny Llama (a context of 1,024 tokens, for long streams) once
    each of several streams has begun; all run in one decode batch (``--max_batch_size 64``)."""
    long_llama = build_llama(tmp_path_factory.mktemp("long-llama"), max_length=1024)
    args = ["--model_dir", str(long_llama), "--model_name", "llama", "--backend", "huggingface"]
    args += ["--api_workers", "2", "--max_batch_size", "64"]
    with run_server(args, tmp_path_factory.mktemp("sigterm"), stop_timeout=5) as server:
        group = group_of(server)
        starts = [threading.Event() for _ in range(STREAMS)]
        body = {**DRAINED_STREAM, "stream": True}
        with ThreadPoolExecutor(STREAMS) as pool:
            readers = [pool.submit(read_stream, server.url, body, started) for started in starts]
            assert all(started.wait(30) for started in starts)
            signalled = time.monotonic()
            server.process.send_signal(signal.SIGTERM)
            live = f"{server.url}/v2/health/live"
            refused = wait_until(lambda: refuses_connections(live), 10, interval=0.02)
            refused_after = time.monotonic() - signalled if refused else None
            running = server.process.poll() is None
            streams = [reader.result(timeout=60) for reader in readers]
        end = ending(server, group, signalled, DRAIN_S)
    return Drain(end, signalled, streams, refused_after, running)


def test_sigterm_lets_every_stream_finish(drained):
    for stream in drained.streams:
        assert stream.failure is None, stream.failure
        assert stream.times[-1] > drained.signalled, "the stream had ended before SIGTERM"
        assert stream.events[-1] == "[DONE]"
        chunks = stream.chunks()
        assert all("error" not in chunk for chunk in chunks), chunks[-1]
        endings = [
            (choice["index"], choice["finish_reason"])
            for chunk in chunks
            for choice in chunk["choices"]
            if choice["finish_reason"] is not None
        ]
        assert sorted(endings) == [(index, "length") for index in range(DRAINED_STREAM["n"])]


def test_sigterm_refuses_new_connections_at_once(drained):
    assert drained.refused_after is not None and drained.refused_after < 10
    assert drained.running_when_refused, "refused only because the server had exited"


def test_sigterm_exits_0_soon_and_leaves_no_process(drained):
    end = drained.end
    assert end.returncode == 0, end.log[-3000:]
    assert end.seconds < DRAIN_S
    assert end.survivors == []
    assert "Traceback" not in end.log
