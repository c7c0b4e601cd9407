"""The way in and out of every HTTP request: an ASGI middleware around KServe's application.

In order, for a request:

- its id: the client's ``x-request-id`` or a new one, seen by the handlers and sent back;
- the API key (``--api_key``): every route but health and metrics needs ``Authorization:
  Bearer <key>`` (401 otherwise, compared in constant time);
- while the server drains (SIGTERM), a new request is a 503 and health says not ready;
- the body, read here up to ``--max_request_bytes`` (413 beyond it, before anything parses it)
  within ``--request_read_timeout_seconds`` (408 past it, and the connection is closed);
  bodies being read share a byte budget (:class:`ReadingBudget`, 429 when full), so that
  memory stays bounded however many clients upload at once;
- admission (``--max_concurrent_requests``): a request that would exceed the server's limit is
  a 429 with ``Retry-After`` at once. It is taken once the body is in: clients that stall
  mid-upload hold no slot, and cannot lock out those that send whole requests;
- the handler then runs in a task of its own, cancelled when the client disconnects (streaming
  or not: the cancellation reaches the batcher and the decode loop, which drop its rows) or when
  ``--request_timeout_seconds`` passes (a 504, or an error event that ends a stream);
- one log line per request (id, method, path, status, milliseconds, and what the handler noted
  of its inputs: :mod:`..observability.request_notes`) and the request metrics
  (health and ``/metrics`` themselves are logged but not counted).

Each refusal is one of our :class:`~huggingfaceserver.errors.ServerError` classes, carrying its
status and headers, answered in the route's own error shape (:class:`~.http_errors.ErrorShapes`):
OpenAI's on the OpenAI routes, TEI's on TEI's, KServe's ``{"error": ...}`` elsewhere.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from ..cli import ServerConfig
from ..errors import (
    DeadlineExceeded,
    NotReady,
    PayloadTooLarge,
    ReadTimeout,
    ServerError,
    TooManyRequests,
    Unauthorized,
)
from ..observability import metrics, request_notes
from ..observability.request_ids import client_request_id, new_request_id
from .admission import Admission
from .http_errors import ErrorShapes, ResponseState, end_with_error
from .shared_count import SharedCount

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/", "/v2/health/live", "/v2/health/ready", "/health", "/metrics"})
"""Health and metrics (``GET``): never behind the key, never refused, never counted."""
OPEN_METHODS = frozenset({"GET", "HEAD"})

NO_DEADLINE_PATH = "/v2/repository/"
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
"""Requests whose body is read here and that are admitted; the others (metadata) are cheap."""
RETRY_AFTER_S = 1
RETRY_LATER = {"retry-after": str(RETRY_AFTER_S)}
CLOSE = {"connection": "close"}
ASK_FOR_KEY = {"www-authenticate": "Bearer"}
"""The challenge that goes with a refused API key (HTTP header, gRPC trailing metadata)."""
SHUTTING_DOWN = "the server is shutting down"
CLIENT_CLOSED = 499  # nginx's status for a client that left; nobody reads it


def is_open(scope: Scope) -> bool:
    """Health and metrics; ``POST /`` is a model route (text-embeddings-inference's)."""
    return scope["path"] in OPEN_PATHS and scope["method"] in OPEN_METHODS


@dataclass(frozen=True)
class GatewayPolicy:
    """The request rules, from the command line."""

    api_key: str | None = None
    max_request_bytes: int = ServerConfig.max_request_bytes
    request_timeout_s: float | None = ServerConfig.request_timeout_seconds
    read_timeout_s: float = ServerConfig.request_read_timeout_seconds
    log_requests: bool = not ServerConfig.disable_log_requests
    openai_prefix: str = "/openai"
    model_name: str = ServerConfig.model_name


class ReadyFronts:
    """How many front processes have their model loaded and warmed up, counted once for the
    server: it says ready only once every front does, so that a probe gets the same answer
    whichever front the shared port hands it to."""

    def __init__(self, path: str, fronts: int):
        self.count = SharedCount(path)
        self.fronts = fronts
        self.counted = False

    def front_ready(self) -> None:
        """This front's model is ready (counted once, whatever reloads come later)."""
        if not self.counted:
            self.counted = True
            self.count.add(1)

    def all_ready(self) -> bool:
        return self.count.value() >= self.fronts


READING_BUDGET_REQUESTS = 4
"""Bodies being read may hold this many largest bodies' worth of bytes, together."""


class ReadingBudget:
    """The bytes of request bodies being read, before admission, in this process: at most
    ``limit`` together. A stalled upload holds only what it sent; a full budget refuses the
    body that would overflow it (429) rather than let uploads grow memory without bound."""

    def __init__(self, limit: int):
        self.limit = limit
        self.held = 0

    def take(self, size: int) -> bool:
        if self.held + size > self.limit:
            return False
        self.held += size
        return True

    def give_back(self, size: int) -> None:
        self.held -= size


class ServerState:
    """What the whole server is doing: draining once a stop signal came; with front
    processes, whether every front is ready."""

    def __init__(self, fronts: ReadyFronts | None = None) -> None:
        self.draining = False
        self.fronts = fronts

    def front_ready(self) -> None:
        if self.fronts is not None:
            self.fronts.front_ready()

    def fronts_ready(self) -> bool:
        return self.fronts is None or self.fronts.all_ready()


class Exchange(ResponseState):
    """One request's response as it goes out: how far it went, its status, its id header."""

    def __init__(self, send: Send, request_id: str, body_unread: bool = False):
        super().__init__()
        self._send = send
        self.request_id = request_id.encode("latin-1")
        self.status = 0
        self.body_unread = body_unread
        """Whether the request has a body not read yet: a response sent meanwhile closes the
        connection (uvicorn would drop the rest of the body as it came, its keep-alive timer
        stopped by each byte: a connection held for as long as the client drips)."""

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            headers = [*message.get("headers", []), (b"x-request-id", self.request_id)]
            if self.body_unread and not any(k.lower() == b"connection" for k, _ in headers):
                headers.append((b"connection", b"close"))
            message = {**message, "headers": headers}
        self.saw(message)
        await self._send(message)


def has_body(scope: Scope) -> bool:
    """Whether a request says it has a body (a length over 0, or chunks)."""
    length = header(scope, b"content-length")
    return (length is not None and length.strip() not in (b"", b"0")) or (
        header(scope, b"transfer-encoding") is not None
    )


def bearer_matches(authorization: bytes, key: bytes) -> bool:
    """Whether an ``Authorization`` value is ``Bearer <key>`` (compared in constant time)."""
    scheme, _, token = authorization.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key)


def header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value)
    return None


def request_id_of(scope: Scope) -> str:
    """The client's id when it is a sane one, else a new one; handlers see it as a header."""
    given = header(scope, b"x-request-id")
    if given is not None and (sane := client_request_id(given.decode("latin-1"))):
        return sane
    request_id = new_request_id()
    headers = [(k, v) for k, v in scope.get("headers", ()) if k.lower() != b"x-request-id"]
    scope["headers"] = [*headers, (b"x-request-id", request_id.encode())]
    return request_id


class Gateway:
    """The middleware (see the module docstring)."""

    def __init__(
        self,
        app: ASGIApp,
        policy: GatewayPolicy,
        admission: Admission,
        state: ServerState,
        routes: Callable[[], Sequence[Any]] = tuple,
    ):
        self.app = app
        self.policy = policy
        self.admission = admission
        self.state = state
        self.routes = routes
        """The application's routes, to name the route of a request refused before routing."""
        self.key = policy.api_key.encode() if policy.api_key else None
        self.reading = ReadingBudget(READING_BUDGET_REQUESTS * policy.max_request_bytes)
        self.shapes = ErrorShapes(policy.openai_prefix)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        exchange = Exchange(send, request_id_of(scope), has_body(scope))
        if not is_open(scope):
            metrics.http_request_started()
        with request_notes.collecting() as notes:
            try:
                await self.serve(scope, receive, exchange)
            except BaseException:
                exchange.status = exchange.status or HTTPStatus.INTERNAL_SERVER_ERROR
                raise
            finally:
                self.done(scope, exchange, time.perf_counter() - start, notes)

    async def serve(self, scope: Scope, receive: Receive, exchange: Exchange) -> None:
        if is_open(scope):
            await self.app(scope, receive, exchange.send)
            return
        try:
            body = await self.admit(scope, receive)
        except ServerError as refusal:
            await self.refuse(scope, exchange, refusal)
            return
        if body is not None:
            exchange.body_unread = False
        if scope["method"] not in BODY_METHODS:
            await self.app(scope, receive, exchange.send)  # metadata: cheap, not admitted
        elif body is None:  # the client left while sending it
            exchange.status = CLIENT_CLOSED
        else:
            try:
                await self.run(scope, body, receive, exchange)
            finally:
                self.admission.leave()

    async def admit(self, scope: Scope, receive: Receive) -> bytes | None:
        """What comes before the handler, each step a refusal (a :class:`ServerError`) when it
        fails: the key, draining, and for a request with a body, the body (None when there is
        none to read, or the client left while sending it), then a slot."""
        self.check_key(scope)
        if self.state.draining:
            raise NotReady(SHUTTING_DOWN, headers=CLOSE)
        if scope["method"] not in BODY_METHODS:
            return None
        body = await self.read_body(scope, receive)
        if body is not None and not self.admission.try_enter():
            metrics.admission_rejected(self.route_of(scope))
            raise TooManyRequests(self.admission.refusal(), headers=RETRY_LATER)
        return body

    def check_key(self, scope: Scope) -> None:
        if self.key is None:
            return
        if not bearer_matches(header(scope, b"authorization") or b"", self.key):
            raise Unauthorized(
                "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                headers=ASK_FOR_KEY,
            )

    async def read_body(self, scope: Scope, receive: Receive) -> bytes | None:
        """The whole body (None if the client left), refused as soon as it is known to exceed
        the limit (413), when it is not in by the deadline (408) or when the bytes of the
        bodies being read would overflow their budget (429)."""
        limit = self.policy.max_request_bytes
        declared = header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise PayloadTooLarge(too_large(int(declared), limit))
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.policy.read_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunk = message.get("body", b"")
                    if size + len(chunk) > limit:
                        raise PayloadTooLarge(too_large(size + len(chunk), limit))
                    if not self.reading.take(len(chunk)):
                        raise TooManyRequests(
                            "the server is receiving too many request bodies at once; retry later",
                            headers={**RETRY_LATER, **CLOSE},
                        )
                    size += len(chunk)
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError:
            seconds = self.policy.read_timeout_s
            raise ReadTimeout(
                f"the request body was not received within {seconds:g} s "
                "(--request_read_timeout_seconds)",
                headers=CLOSE,
            ) from None
        finally:
            self.reading.give_back(size)

    async def run(self, scope: Scope, body: bytes, receive: Receive, exchange: Exchange) -> None:
        """The handler in a task of its own, until it ends, the client leaves or time is up."""
        gone = asyncio.Event()
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        handler = asyncio.ensure_future(self.app(scope, replay, exchange.send))
        watcher = asyncio.ensure_future(watch())
        # loading a model again (repository load) takes what it takes
        timeout = (
            None if scope["path"].startswith(NO_DEADLINE_PATH) else self.policy.request_timeout_s
        )
        try:
            done, _ = await asyncio.wait(
                {handler, watcher}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            watcher.cancel()
        if handler in done:
            handler.result()  # its exception, if any, goes on up
            return
        handler.cancel()
        await asyncio.gather(handler, return_exceptions=True)
        if watcher in done:
            exchange.status = exchange.status if exchange.finished else CLIENT_CLOSED
            logger.info("request %s: the client left; its work is cancelled", exchange_id(exchange))
            return
        await self.time_out(scope, exchange)

    async def time_out(self, scope: Scope, exchange: Exchange) -> None:
        """Past the deadline: a 504, or (a response already under way) its end."""
        seconds = self.policy.request_timeout_s
        message = f"the request took longer than {seconds:g} s (--request_timeout_seconds)"
        await self.refuse(scope, exchange, DeadlineExceeded(message))
        exchange.status = HTTPStatus.GATEWAY_TIMEOUT

    async def refuse(self, scope: Scope, exchange: Exchange, refusal: ServerError) -> None:
        """The refusal in the route's error shape, with its status and headers; a response
        already under way (a deadline passed mid-stream) is ended with it instead."""
        body = self.shapes.body(scope, refusal)
        headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in refusal.headers.items()]
        await end_with_error(exchange.send, exchange, refusal.status_code, body, headers)

    def done(self, scope: Scope, exchange: Exchange, seconds: float, notes: list[str]) -> None:
        if not is_open(scope):
            metrics.http_request_finished(
                self.route_of(scope), self.policy.model_name, exchange.status, seconds
            )
        if self.policy.log_requests:
            request_id = exchange_id(exchange)
            logger.info(
                'request %s "%s %s" %d %.1f ms%s',
                request_id,
                scope["method"],
                logged_path(scope),
                exchange.status,
                seconds * 1000,
                request_notes.suffix(notes),
                extra={"request_id": request_id},
            )

    def route_of(self, scope: Scope) -> str:
        """The path template of the route that served (or would have served) the request: a
        bounded label value, never the raw path."""
        from starlette.routing import Match

        route = scope.get("route")
        if route is None:
            for candidate in self.routes():
                if candidate.matches(scope)[0] is Match.FULL:
                    route = candidate
                    break
        path = getattr(route, "path", None)
        return path if isinstance(path, str) else "other"


def logged_path(scope: Scope) -> str:
    """The path as the client sent it (percent-encoded), so that a quote cannot break the line."""
    raw = scope.get("raw_path")
    path = raw.decode("latin-1") if isinstance(raw, bytes) and raw else scope["path"]
    return path.replace('"', "%22")


def exchange_id(exchange: Exchange) -> str:
    return exchange.request_id.decode("latin-1")


def too_large(size: int, limit: int) -> str:
    return (
        f"the request body is {size} bytes or more, over the limit of {limit} bytes "
        "(--max_request_bytes)"
    )
