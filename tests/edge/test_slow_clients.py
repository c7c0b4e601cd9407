"""Clients that stall mid-upload, against a real server process: they hold no admission slot
(a whole request is served meanwhile), are told 408 at ``--request_read_timeout_seconds`` with
their connections closed, and the server's sockets are returned."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import time
from pathlib import Path

import httpx
import pytest

from tests.harness import ServerProcess, run_server, wait_until

pytestmark = pytest.mark.slow

STALLED = 600
LIMIT = 4
"""Admission slots: far fewer than the stalled clients, as ``--max_concurrent_requests``."""
READ_TIMEOUT_S = 15
BODY = b'{"instances": ["a stalled upload"]}'


@pytest.fixture(scope="module")
def server(tiny_models: dict[str, Path], tmp_path_factory):
    args = [
        "--model_dir", str(tiny_models["bert_sequence_classification"]), "--model_name", "m",
        "--max_concurrent_requests", str(LIMIT),
        "--request_read_timeout_seconds", str(READ_TIMEOUT_S),
    ]  # fmt: skip
    with run_server(args, tmp_path_factory.mktemp("slow-clients")) as process:
        yield process


def socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets process ``pid`` has open."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(FileNotFoundError):  # closed meanwhile
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(int(target[len("socket:[") : -1]))
    return inodes


def open_sockets(pid: int) -> int:
    return len(socket_inodes(pid))


def accepted(pid: int, clients: list[socket.socket]) -> int:
    """How many of ``clients``' connections process ``pid`` has accepted: the server's side
    of each (its remote port is the client's) among the process's open sockets."""
    ports = {sock.getsockname()[1] for sock in clients}
    mine = socket_inodes(pid)
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        remote_port = int(fields[2].split(":")[1], 16)
        if remote_port in ports and int(fields[9]) in mine:
            count += 1
    return count


def stall(server: ServerProcess) -> socket.socket:
    """A connection that sends a request's headers and 5 bytes of its body, then nothing."""
    sock = socket.create_connection(("127.0.0.1", server.http_port), timeout=30)
    head = (
        "POST /v1/models/m:predict HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
        f"content-length: {len(BODY)}\r\n\r\n"
    )
    sock.sendall(head.encode() + BODY[:5])
    return sock


def answered(sockets: list[socket.socket]) -> list[socket.socket]:
    """Those that have something to read (a response, or the server's close)."""
    readable: list[socket.socket] = []
    for start in range(0, len(sockets), 256):
        readable += select.select(sockets[start : start + 256], [], [], 0)[0]
    return readable


def read_to_end(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def test_stalled_uploads_hold_no_slot_and_are_closed_at_the_deadline(server):
    pid = server.process.pid
    before = open_sockets(pid)
    stalled = [stall(server) for _ in range(STALLED)]
    try:
        # every stalled request has reached the server (its connection is accepted)
        assert wait_until(lambda: accepted(pid, stalled) == STALLED, 60), accepted(pid, stalled)
        response = httpx.post(
            f"{server.url}/v1/models/m:predict", json={"instances": ["a whole request"]}, timeout=30
        )
        assert response.status_code == 200, response.text
        assert len(response.json()["predictions"]) == 1
        # the stalled ones were still waiting when the whole request was served
        assert answered(stalled) == []
        started = time.monotonic()
        answers = [read_to_end(sock) for sock in stalled]  # the server closes each
        waited = time.monotonic() - started
    finally:
        for sock in stalled:
            sock.close()
    statuses = {answer.split(b"\r\n", 1)[0] for answer in answers}
    assert statuses == {b"HTTP/1.1 408 Request Timeout"}, statuses
    assert all(b"--request_read_timeout_seconds" in answer for answer in answers)
    assert waited < READ_TIMEOUT_S + 30, waited  # closed at the deadline, not never
    assert wait_until(lambda: open_sockets(pid) <= before, 30), (open_sockets(pid), before)
    # and the server goes on serving
    again = httpx.post(f"{server.url}/v1/models/m:predict", json={"instances": ["x"]}, timeout=30)
    assert again.status_code == 200
