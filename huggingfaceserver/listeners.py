"""KServe's HTTP and gRPC servers, started on ports we bind ourselves.

What ``kserve.ModelServer.start`` does, with two differences: the HTTP socket is ours (several
front processes share a port with ``SO_REUSEPORT``; gRPC servers always set it), and KServe's
timing middleware is left out (two ``getrusage`` calls and two trace log lines per request,
the largest single cost of a small request).
"""

from __future__ import annotations

import asyncio
import logging
import socket

from kserve import ModelServer  # noqa: E402 - see above
from kserve.protocol.grpc.server import GRPCServer  # noqa: E402
from kserve.protocol.rest.server import RESTServer  # noqa: E402

from ._kserve import model_server  # first: kserve parses argv when imported without it
from .errors import StartupError

logger = logging.getLogger(__name__)

HTTP_HOST = "0.0.0.0"  # as KServe's uvicorn binds


def http_socket(port: int, shared: bool) -> socket.socket:
    """A listening TCP socket on ``port``; ``shared``: other processes may listen on it too
    (the kernel spreads connections among them)."""
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted connections only for sockets
    # that say so, and without it small responses wait 40 ms for delayed ACKs.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if shared:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((HTTP_HOST, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot listen on HTTP port {port}: {exc.strerror}") from None
    return sock


def check_port_free(port: int, what: str) -> None:
    """Fail now when another program holds ``port`` (before processes share it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HTTP_HOST, port))
        except OSError as exc:
            raise StartupError(f"cannot listen on {what} port {port}: {exc.strerror}") from None


def start_servers(server: ModelServer, sock: socket.socket) -> None:
    """Serve REST on ``sock`` and gRPC on its port until a signal stops them."""
    rest = RESTServer(
        model_server.FASTAPI_APP_IMPORT_STRING,
        server.dataplane,
        server.model_repository_extension,
        server.http_port,
        access_log_format=server.access_log_format,
        grace_period=server.grace_period,
        event_loop=server.event_loop,
        timeout_keep_alive=server.timeout_keep_alive,
        ssl_certfile=server.ssl_certfile,
        ssl_keyfile=server.ssl_keyfile,
    )
    if server.access_log_format:
        from asgi_logger import AccessLoggerMiddleware

        logging.getLogger("uvicorn.access").handlers = []
        model_server.app.add_middleware(AccessLoggerMiddleware, format=server.access_log_format)
        logging.getLogger("access").propagate = False
    rest._register_endpoints(model_server.app)  # noqa: SLF001 - kserve has no public way to reuse them
    rest._add_exception_handlers(model_server.app)  # noqa: SLF001
    server._rest_server = rest  # noqa: SLF001 - what ModelServer.stop looks for
    server.servers.append(rest._server.serve(sockets=[sock]))  # noqa: SLF001
    if server.enable_grpc:
        grpc = GRPCServer(
            server.grpc_port,
            server.dataplane,
            server.model_repository_extension,
            kwargs=vars(model_server.args),
            grace_period=server.grace_period,
        )
        server._grpc_server = grpc  # noqa: SLF001
        server.servers.append(grpc.start(server.max_threads))
    server.setup_event_loop()
    server.register_signal_handler()
    asyncio.run(server._serve())  # noqa: SLF001
