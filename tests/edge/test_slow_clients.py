"""Clients that stall mid-upload, against a real server process: they hold no admission slot
(a whole request is served meanwhile), are told 408 at ``--request_read_timeout_seconds`` with
their connections closed, and the server's sockets are returned."""

from __future__ import annotations

import contextlib
import json
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


SILENT = 100
MID_HEADERS = 100
SECOND_REQUEST = 20


def connect(server: ServerProcess) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.http_port), timeout=30)


def mid_headers(server: ServerProcess) -> socket.socket:
    """A connection that sends part of a request's headers, then nothing."""
    sock = connect(server)
    sock.sendall(b"POST /v1/models/m:predict HTTP/1.1\r\nhost: t\r\ncontent-ty")
    return sock


def second_request_mid_headers(server: ServerProcess) -> socket.socket:
    """A keep-alive connection whose first request is answered, and whose second request's
    headers stop half-way."""
    sock = connect(server)
    sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nhost: t\r\n\r\n")
    received = b""
    while b"\r\n\r\n" not in received:
        received += sock.recv(65536)
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    length = int(
        next(
            line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
        ).split(b":")[1]
    )
    while len(body) < length:
        body += sock.recv(65536)
    sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nho")
    return sock


def test_connections_whose_headers_stall_are_closed_at_the_deadline(server):
    """Connections that send nothing, stop half-way through their headers, or do so on their
    second request hold nothing either: a whole request is served meanwhile, and each of them
    gets a 408 in KServe's shape at the deadline, its connection closed."""
    pid = server.process.pid
    before = open_sockets(pid)
    kinds = [
        (connect, SILENT),
        (mid_headers, MID_HEADERS),
        (second_request_mid_headers, SECOND_REQUEST),
    ]
    stalled = [open_one(server) for open_one, count in kinds for _ in range(count)]
    try:
        assert wait_until(lambda: accepted(pid, stalled) == len(stalled), 60)
        response = httpx.post(
            f"{server.url}/v1/models/m:predict", json={"instances": ["a whole request"]}, timeout=30
        )
        assert response.status_code == 200, response.text
        assert answered(stalled) == []
        started = time.monotonic()
        answers = [read_to_end(sock) for sock in stalled]
        waited = time.monotonic() - started
    finally:
        for sock in stalled:
            sock.close()
    heads = {answer.partition(b"\r\n\r\n")[0].split(b"\r\n", 1)[0] for answer in answers}
    assert heads == {b"HTTP/1.1 408 Request Timeout"}, heads
    errors = {json.loads(answer.partition(b"\r\n\r\n")[2])["error"] for answer in answers}
    assert errors == {
        f"the request's headers did not arrive within {READ_TIMEOUT_S} s "
        "(--request_read_timeout_seconds)"
    }
    assert waited < READ_TIMEOUT_S + 30, waited
    assert wait_until(lambda: open_sockets(pid) <= before, 30), (open_sockets(pid), before)
    again = httpx.post(f"{server.url}/v1/models/m:predict", json={"instances": ["x"]}, timeout=30)
    assert again.status_code == 200


def oversized_headers(server: ServerProcess, header: bytes) -> bytes:
    """What a connection is answered that sends a request line, then ``header`` until the
    server stops it (or 1 MiB)."""
    sock = connect(server)
    try:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nhost: t\r\n")
        with contextlib.suppress(OSError):  # the server closes it mid-way
            for _ in range((1 << 20) // len(header)):
                sock.sendall(header)
        return read_to_end(sock)
    finally:
        sock.close()


@pytest.mark.parametrize("header", [b"x-a: b\r\n", b"a" * 4096], ids=["many", "one-endless"])
def test_headers_past_64_kib_are_a_431_and_the_connection_is_closed(server, header):
    """httptools keeps headers of any size: many small ones, or one value with no end, are
    cut at 64 KiB with a 431 in KServe's shape, and the server serves on."""
    answer = oversized_headers(server, header)
    head, _, body = answer.partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0]
    assert status == b"HTTP/1.1 431 Request Header Fields Too Large", answer[:200]
    assert json.loads(body) == {"error": "the request line and headers exceed 64 KiB"}
    response = httpx.get(f"{server.url}/v2/health/live", headers={"x-a": "b" * 8000}, timeout=30)
    assert response.status_code == 200


@pytest.mark.parametrize(
    "request_head",
    [
        b"GET /v2/health/live HTTP/1.1\r\nhost: t\r\ncontent-length: 1000000\r\n\r\n",
        b"POST /v1/models/m:predict HTTP/1.1\r\nhost: t\r\ncontent-length: 99999999999\r\n\r\n",
    ],
    ids=["open-route", "413"],
)
def test_a_response_before_the_body_is_read_closes_the_connection(server, request_head):
    """A health check, or a 413, answered while the body is still to come: the connection is
    closed with the answer (it stayed open, each byte of the body the client dripped keeping
    it, with no deadline)."""
    sock = connect(server)
    try:
        sock.sendall(request_head + b"x")
        answer = read_to_end(sock)  # the server's close ends it (a held connection: a timeout)
    finally:
        sock.close()
    head = answer.partition(b"\r\n\r\n")[0].lower()
    status = head.split(b"\r\n", 1)[0]
    assert status in (b"http/1.1 200 ok", b"http/1.1 413 request entity too large")
    assert b"\r\nconnection: close" in head


def test_a_client_that_reads_none_of_its_answers_is_disconnected_at_the_deadline(server):
    """Pipelined requests whose answers the client never reads: the server's writes stay
    paused, and at --request_read_timeout_seconds the connection is aborted (it was held, and
    a handler blocked in it, for as long as the client liked); the server serves meanwhile."""
    pid = server.process.pid
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window, never read
    sock.settimeout(READ_TIMEOUT_S + 30)
    sock.connect(("127.0.0.1", server.http_port))
    try:
        assert wait_until(lambda: accepted(pid, [sock]) == 1, 30)
        started = time.monotonic()
        with contextlib.suppress(OSError):  # the server stops reading, then aborts
            sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nhost: t\r\n\r\n" * 20000)
        assert httpx.get(f"{server.url}/v2/health/live", timeout=30).status_code == 200
        assert wait_until(lambda: accepted(pid, [sock]) == 0, READ_TIMEOUT_S + 30)
        assert time.monotonic() - started >= READ_TIMEOUT_S - 1  # at the deadline, not before
    finally:
        sock.close()
