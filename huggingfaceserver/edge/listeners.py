"""The HTTP and gRPC servers this package owns, as MLServer owns its servers.

KServe's V1/V2 routes go on a FastAPI app of ours (through KServe's published
``register_v1_endpoints`` / ``register_v2_endpoints``), served by our uvicorn on a socket we bind
ourselves (several front processes share a port with ``SO_REUSEPORT``); KServe's gRPC servicer
goes on our ``grpc.aio`` server. Our stop signal handlers drain: readiness false and new requests
refused at once, uvicorn told to stop (requests in flight finish), then gRPC stopped with the
grace period. KServe's timing middleware is left out (two ``getrusage`` calls and two trace log
lines per request, the largest single cost of a small request), and so are its OpenAI and
time-series routes (this server mounts its own OpenAI routes and serves no time series).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from collections.abc import Awaitable
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.responses import ORJSONResponse
from grpc import aio
from kserve.constants.constants import DEFAULT_HTTP_PORT, DEFAULT_HTTPS_PORT
from kserve.errors import (
    InferenceError,
    InvalidInput,
    ModelNotFound,
    ModelNotReady,
    ServerNotLive,
    ServerNotReady,
    UnsupportedProtocol,
    generic_exception_handler,
    inference_error_handler,
    invalid_input_handler,
    model_not_found_handler,
    model_not_ready_handler,
    not_implemented_error_handler,
    server_not_live_handler,
    server_not_ready_handler,
    unsupported_protocol_error_handler,
)
from kserve.protocol.dataplane import DataPlane
from kserve.protocol.grpc import grpc_predict_v2_pb2_grpc
from kserve.protocol.grpc.servicer import InferenceServicer
from kserve.protocol.model_repository_extension import ModelRepositoryExtension
from kserve.protocol.rest.server import metrics_handler
from kserve.protocol.rest.ssl_cert_refresher import SSLCertRefresher
from kserve.protocol.rest.v1_endpoints import register_v1_endpoints
from kserve.protocol.rest.v2_endpoints import register_v2_endpoints
from kserve.utils.inference_client_factory import InferenceClientFactory
from starlette.routing import BaseRoute

from .. import __version__
from ..cli import KServeFlags
from ..errors import StartupError
from ..observability import metrics
from ..protocols.openai.models import ServedModels
from ..protocols.openai.routes import mount_openai
from ..protocols.tei.routes import mount_tei
from .admission import Admission
from .gateway import ServerState
from .grpc_policy import PolicyInterceptor
from .header_deadline import protocol_with_header_deadline
from .http_errors import install_error_handlers
from .repository import REPOSITORY_PATH

logger = logging.getLogger(__name__)

HTTP_HOST = "0.0.0.0"  # as KServe's uvicorn binds
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)  # those KServe stopped on

KSERVE_ERROR_HANDLERS: tuple[tuple[type[Exception], Any], ...] = (
    (InvalidInput, invalid_input_handler),
    (InferenceError, inference_error_handler),
    (ModelNotFound, model_not_found_handler),
    (ModelNotReady, model_not_ready_handler),
    (NotImplementedError, not_implemented_error_handler),
    (UnsupportedProtocol, unsupported_protocol_error_handler),
    (ServerNotLive, server_not_live_handler),
    (ServerNotReady, server_not_ready_handler),
    (Exception, generic_exception_handler),
)
"""What KServe's REST server installs on its app, in its order."""


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


def http_port(flags: KServeFlags) -> int:
    """``--http_port``; KServe's HTTPS port instead of its default HTTP port with TLS."""
    if flags.ssl_certfile and flags.ssl_keyfile and flags.http_port == DEFAULT_HTTP_PORT:
        logger.info("SSL enabled, switching listen port to %d", DEFAULT_HTTPS_PORT)
        return DEFAULT_HTTPS_PORT
    return flags.http_port


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
    request_timeout_s: float | None = None
    """``--request_timeout_seconds``: a gRPC call's deadline as an HTTP request's (None: none)."""


@dataclass(frozen=True)
class ServingOptions:
    """How the servers run: KServe's ModelServer flags, read from our parsed config."""

    grpc_port: int | None
    """None: no gRPC server (``--enable_grpc false``)."""
    grace_period: int
    """Seconds that requests in flight get to finish once a stop signal came."""
    max_threads: int = 4
    max_asyncio_workers: int | None = None
    """Threads of the event loop's default executor; None: asyncio's default (KServe's
    ``ModelServer`` sized the pool of a loop that ``asyncio.run`` then replaced, so the
    flag had no effect there)."""
    timeout_keep_alive: int = 65
    header_timeout_s: float = 30.0
    """Each request's headers are due within this long (``--request_read_timeout_seconds``):
    408 and the connection closed past it (:mod:`.header_deadline`)."""
    event_loop: str = "auto"
    """Given to uvicorn's config, as KServe does; the servers run under ``asyncio.run``, as
    under KServe's ``ModelServer``, so that uvicorn does not pick the loop."""
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    access_log_format: str | None = None
    grpc_max_send_message_length: int | None = None
    grpc_max_receive_message_length: int | None = None

    @classmethod
    def from_flags(
        cls, flags: KServeFlags, grace_period: int, header_timeout_s: float
    ) -> ServingOptions:
        """From ``ServerConfig.server`` (the KServe flags)."""
        return cls(
            grpc_port=flags.grpc_port if flags.enable_grpc else None,
            grace_period=grace_period,
            header_timeout_s=header_timeout_s,
            max_threads=flags.max_threads,
            max_asyncio_workers=flags.max_asyncio_workers,
            timeout_keep_alive=flags.timeout_keep_alive,
            event_loop=flags.event_loop,
            ssl_certfile=flags.ssl_certfile,
            ssl_keyfile=flags.ssl_keyfile,
            access_log_format=flags.access_log_format,
            grpc_max_send_message_length=flags.grpc_max_send_message_length,
            grpc_max_receive_message_length=flags.grpc_max_receive_message_length,
        )


def prune_repository_routes(app: FastAPI) -> None:
    """KServe's ``/v2/repository/...`` routes, gone (404) unless the repository is enabled."""
    kept: list[BaseRoute] = [
        r for r in app.router.routes if not getattr(r, "path", "").startswith(REPOSITORY_PATH)
    ]
    app.router.routes[:] = kept


def build_app(
    dataplane: DataPlane,
    repository: ModelRepositoryExtension,
    openai_prefix: str,
    enable_repository: bool = True,
    enable_docs_url: bool = False,
) -> FastAPI:
    """The HTTP app: ``/metrics``, our OpenAI and TEI routes, KServe's liveness, V1 and V2
    routes, then KServe's error handlers with ours over them. Call once the models are
    registered; the gateway and CORS go around it afterwards (:func:`~.serving.install_gateway`)."""
    app = FastAPI(
        title="huggingfaceserver",
        version=__version__,
        docs_url="/docs" if enable_docs_url else None,
        redoc_url=None,
        default_response_class=ORJSONResponse,  # as KServe's app: its routes return dicts
    )
    if os.environ.get(metrics.MULTIPROC_ENV):
        metrics.mount(app)  # every front process's values, read from their shared folder
    else:  # this process's registry, answered on the loop, as KServe answers it
        app.add_api_route("/metrics", metrics_handler, methods=["GET"])
    install_error_handlers(app, openai_prefix)  # its middleware inside the gateway's
    models = ServedModels(dataplane.model_registry)
    mount_openai(app, models, openai_prefix)
    mount_tei(app, models, dataplane.ready)
    app.add_api_route("/", dataplane.live)
    register_v1_endpoints(app, dataplane, repository)
    register_v2_endpoints(app, dataplane, repository)
    if not enable_repository:
        prune_repository_routes(app)
    for exception, handler in KSERVE_ERROR_HANDLERS:
        app.add_exception_handler(exception, handler)
    install_error_handlers(app, openai_prefix)  # ours win over KServe's
    return app


def install_access_log(app: FastAPI, access_log_format: str | None) -> None:
    """``--access_log_format``: asgi-logger's access lines, outermost, as KServe adds them."""
    if not access_log_format:
        return
    from asgi_logger import AccessLoggerMiddleware

    logging.getLogger("uvicorn.access").handlers = []  # no duplicate lines
    app.add_middleware(AccessLoggerMiddleware, format=access_log_format)
    logging.getLogger("access").propagate = False


def grpc_server(
    options: ServingOptions,
    dataplane: DataPlane,
    repository: ModelRepositoryExtension,
    rules: Rules,
) -> aio.Server:
    """KServe's gRPC servicer behind our rules' interceptor, which also maps its errors."""
    policy = PolicyInterceptor(
        rules.admission,
        rules.state,
        rules.api_key,
        rules.enable_repository,
        rules.log_requests,
        rules.request_timeout_s,
    )
    server = aio.server(
        futures.ThreadPoolExecutor(max_workers=options.max_threads),
        interceptors=(policy,),
        options=[
            ("grpc.max_send_message_length", options.grpc_max_send_message_length),
            ("grpc.max_receive_message_length", options.grpc_max_receive_message_length),
        ],
    )
    servicer = InferenceServicer(dataplane, repository)
    grpc_predict_v2_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    server.add_insecure_port(f"[::]:{options.grpc_port}")
    return server


def http_server(app: FastAPI, options: ServingOptions) -> uvicorn.Server:
    """uvicorn configured as KServe's REST server configures it, with a deadline for headers."""
    config = uvicorn.Config(
        app,
        host=HTTP_HOST,
        http=protocol_with_header_deadline(options.header_timeout_s),
        log_config=None,  # logging is configured already
        timeout_graceful_shutdown=options.grace_period,
        timeout_keep_alive=options.timeout_keep_alive,
        loop=options.event_loop,
        ssl_certfile=options.ssl_certfile,
        ssl_keyfile=options.ssl_keyfile,
    )
    return uvicorn.Server(config)


def announce_draining() -> None:
    """Log that the server drains, on the event loop: safe to call from a signal handler too
    (logging there and then could deadlock the process for good, the handler having
    interrupted a log call that holds the log handler's locks)."""
    message = "draining: readiness false, requests in flight finish"
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # no loop: nothing serves yet, so nothing drains
        return
    loop.call_soon_threadsafe(logger.info, message)


class Listeners:
    """The HTTP server on our socket and the gRPC server, from start to a drained stop."""

    def __init__(
        self,
        app: FastAPI,
        sock: socket.socket,
        options: ServingOptions,
        dataplane: DataPlane,
        repository: ModelRepositoryExtension,
        rules: Rules,
    ):
        self.http = http_server(app, options)
        self.sock = sock
        self.options = options
        self.dataplane = dataplane
        self.repository = repository
        self.rules = rules
        self.state = rules.state
        self.grpc: aio.Server | None = None
        """Built on the loop that serves it (grpc.aio binds a server to the loop it is made on)."""

    def stop(self) -> None:
        """A stop signal: at the first, readiness turns false and new requests are refused
        while those in flight finish; uvicorn stops once they have."""
        if not self.state.draining:
            announce_draining()
        self.state.draining = True
        self.http.should_exit = True

    async def serve_http(self) -> None:
        """HTTP until stopped, then the rest: gRPC (its calls get the grace period), KServe's
        predictor clients, and the models (each told to stop, once per name)."""
        config = self.http.config
        config.load()
        refresher = None
        if config.ssl is not None and config.ssl_keyfile and config.ssl_certfile:
            refresher = SSLCertRefresher(  # new certificates without a restart, as KServe's
                ssl_context=config.ssl,
                key_path=str(config.ssl_keyfile),
                cert_path=str(config.ssl_certfile),
            )
        try:
            await self.http.serve(sockets=[self.sock])
        finally:
            if refresher is not None:
                refresher.stop()
        logger.info("stopping the model server")
        if self.grpc is not None:
            await self.grpc.stop(grace=self.options.grace_period)
        await InferenceClientFactory().close()
        registry = self.dataplane.model_registry
        for name in list(registry.get_models()):
            registry.unload(name)

    async def serve_grpc(self) -> None:
        if self.grpc is None:
            return
        await self.grpc.start()
        logger.info("gRPC on port %s", self.options.grpc_port)
        await self.grpc.wait_for_termination()

    async def serve(self, *background: Awaitable[None]) -> None:
        """Serve, with ``background`` work alongside, until a stop signal (SIGTERM, SIGINT,
        SIGQUIT) and the drain after it."""
        loop = asyncio.get_running_loop()
        if self.options.max_asyncio_workers is not None:
            workers = self.options.max_asyncio_workers
            loop.set_default_executor(futures.ThreadPoolExecutor(max_workers=workers))
        if self.options.grpc_port is not None:
            self.grpc = grpc_server(self.options, self.dataplane, self.repository, self.rules)
        # uvicorn also captures SIGTERM and SIGINT while it serves (and re-raises them once
        # stopped); these handlers run on the loop all the same, through its wakeup fd.
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, self.stop)
        await asyncio.gather(self.serve_http(), self.serve_grpc(), *background)


def run_servers(listeners: Listeners, *background: Awaitable[None]) -> None:
    """Serve until stopped (see :meth:`Listeners.serve`), on a new event loop."""
    asyncio.run(listeners.serve(*background))
