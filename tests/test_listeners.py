"""The HTTP listening socket we bind ourselves: TCP_NODELAY on what it accepts, a port that
front processes share, and a port held by another program found before serving."""

from __future__ import annotations

import asyncio
import socket

import pytest

from huggingfaceserver.errors import StartupError
from huggingfaceserver.listeners import check_port_free, http_socket


def test_the_socket_says_it_is_tcp():
    """asyncio sets TCP_NODELAY on accepted connections only for IPPROTO_TCP sockets (with 0,
    small responses waited 40 ms for the client's delayed ACK)."""
    with http_socket(0, shared=False) as sock:
        assert (sock.type, sock.proto) == (socket.SOCK_STREAM, socket.IPPROTO_TCP)
        assert not sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT)


async def test_asyncio_accepts_with_tcp_nodelay():
    accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = writer.get_extra_info("socket")
        accepted.set_result(connection.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    sock = http_socket(0, shared=False)
    server = await asyncio.start_server(handle, sock=sock)
    async with server:
        _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
        assert await asyncio.wait_for(accepted, 5)
        writer.close()


def test_two_shared_sockets_listen_on_one_port():
    with http_socket(0, shared=True) as first:
        port = first.getsockname()[1]
        with http_socket(port, shared=True) as second:
            assert second.getsockname()[1] == port
            for listening in (first, second):
                assert listening.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                pass


def test_an_unshared_port_in_use_is_a_startup_error():
    with http_socket(0, shared=False) as first:
        port = first.getsockname()[1]
        with pytest.raises(StartupError, match=f"cannot listen on HTTP port {port}"):
            http_socket(port, shared=False)


def test_check_port_free_finds_a_port_in_use():
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(StartupError, match=f"cannot listen on gRPC port {port}: "):
            check_port_free(port, "gRPC")
    check_port_free(port, "gRPC")  # released: free again


async def test_the_draining_line_is_logged_on_the_loop_after_the_signal_handler(caplog):
    """A SIGTERM that interrupts a log call must not log from inside the handler: the log
    handler's locks are held then, and the process would never exit."""
    import asyncio
    import logging

    from huggingfaceserver.listeners import announce_draining

    with caplog.at_level(logging.INFO, logger="huggingfaceserver.listeners"):
        announce_draining()
        assert "draining" not in caplog.text, "logged inside the signal handler"
        after = asyncio.Event()
        asyncio.get_running_loop().call_soon(after.set)  # runs after the scheduled log call
        await after.wait()
    assert "draining: readiness false" in caplog.text
