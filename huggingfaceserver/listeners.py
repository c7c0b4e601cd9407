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
from concurrent import futures
from dataclasses import dataclass
from types import FrameType
from typing import Any

from fastapi import FastAPI
from grpc import aio
from kserve import ModelServer  # noqa: E402 - see above
from kserve.protocol.grpc import grpc_predict_v2_pb2_grpc
from kserve.protocol.grpc.interceptors import ExceptionToStatusInterceptor
from kserve.protocol.grpc.server import GRPCServer  # noqa: E402
from kserve.protocol.grpc.servicer import InferenceServicer
from kserve.protocol.rest.server import RESTServer  # noqa: E402
from starlette.routing import BaseRoute

from ._kserve import (
    model_server,  # first: kserve parses argv when imported without it
    without_kserve_openai,
)
from .admission import Admission
from .errors import StartupError, install_error_handlers
from .gateway import ServerState
from .grpc_policy import PolicyInterceptor
from .repository import REPOSITORY_PATH

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


@dataclass(frozen=True)
class Rules:
    """What the listeners enforce beyond KServe's own routes (see :mod:`.gateway`)."""

    admission: Admission
    state: ServerState
    api_key: str | None = None
    enable_repository: bool = False
    log_requests: bool = True


def prune_repository_routes(app: FastAPI) -> None:
    """KServe's ``/v2/repository/...`` routes, gone (404) unless the repository is enabled."""
    kept: list[BaseRoute] = [
        r for r in app.router.routes if not getattr(r, "path", "").startswith(REPOSITORY_PATH)
    ]
    app.router.routes[:] = kept


class PolicyGRPCServer(GRPCServer):
    """KServe's gRPC server with our rules' interceptor in front of KServe's own."""

    def __init__(self, *args: Any, rules: Rules, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.rules = rules

    async def start(self, max_workers: int) -> None:
        servicer = InferenceServicer(self._data_plane, self._model_repository_extension)
        rules = self.rules
        policy = PolicyInterceptor(
            rules.admission, rules.state, rules.api_key, rules.enable_repository, rules.log_requests
        )
        self._server = aio.server(
            futures.ThreadPoolExecutor(max_workers=max_workers),
            interceptors=(policy, ExceptionToStatusInterceptor()),
            options=[
                ("grpc.max_send_message_length", self._kwargs.get("grpc_max_send_message_length")),
                (
                    "grpc.max_receive_message_length",
                    self._kwargs.get("grpc_max_receive_message_length"),
                ),
            ],
        )
        grpc_predict_v2_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, self._server)
        self._server.add_insecure_port(f"[::]:{self._port}")
        await self._server.start()
        await self._server.wait_for_termination()


def drain_on_exit_signal(rest: RESTServer, state: ServerState) -> None:
    """The moment uvicorn is told to stop (SIGTERM), readiness turns false and new requests
    are refused while those in flight finish."""
    uvicorn_server = rest._server  # noqa: SLF001
    handle_exit = uvicorn_server.handle_exit

    def draining_exit(sig: int, frame: FrameType | None) -> None:
        if not state.draining:
            announce_draining()
        state.draining = True
        handle_exit(sig, frame)

    uvicorn_server.handle_exit = draining_exit  # type: ignore[method-assign]


def announce_draining() -> None:
    """Log that the server drains, from a signal handler: not there and then (the handler may
    have interrupted a log call holding the handler's locks, which would deadlock the process
    for good), but on the event loop once the handler returns."""
    message = "draining: readiness false, requests in flight finish"
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # no loop: nothing serves yet, so nothing drains
        return
    loop.call_soon_threadsafe(logger.info, message)


def start_servers(server: ModelServer, sock: socket.socket, rules: Rules) -> None:
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
    with without_kserve_openai():
        rest._register_endpoints(model_server.app)  # noqa: SLF001 - kserve has no public way to reuse them
    if not rules.enable_repository:
        prune_repository_routes(model_server.app)
    rest._add_exception_handlers(model_server.app)  # noqa: SLF001
    install_error_handlers(model_server.app)  # ours win over KServe's
    drain_on_exit_signal(rest, rules.state)
    server._rest_server = rest  # noqa: SLF001 - what ModelServer.stop looks for
    server.servers.append(rest._server.serve(sockets=[sock]))  # noqa: SLF001
    if server.enable_grpc:
        grpc = PolicyGRPCServer(
            server.grpc_port,
            server.dataplane,
            server.model_repository_extension,
            kwargs=vars(model_server.args),
            grace_period=server.grace_period,
            rules=rules,
        )
        server._grpc_server = grpc  # noqa: SLF001
        server.servers.append(grpc.start(server.max_threads))
    server.setup_event_loop()
    server.register_signal_handler()
    asyncio.run(server._serve())  # noqa: SLF001
