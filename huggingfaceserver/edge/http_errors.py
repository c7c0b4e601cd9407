"""How HTTP answers errors, in one place: the error shape of each route family (KServe's
``{"error": message}``, OpenAI's, TEI's), chosen by the request's route in :class:`ErrorShapes`
for every error path (the gateway's refusals, the exception handlers, the middleware that
catches what no handler took, a response already under way); our exceptions with their status
and headers, KServe's client-side ones without a traceback, 400 (not 422) for bodies that do not
validate, 404 for model versions, and a 500 that names the request id and nothing of the cause
for anything else."""

from __future__ import annotations

import functools
import inspect
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from kserve.errors import InvalidInput, ModelNotFound, ModelNotReady, ServerNotReady
from pydantic import ValidationError
from starlette.datastructures import Headers, QueryParams
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import (
    BadRequest,
    NotFound,
    NotReady,
    ServerError,
    Unimplemented,
    internal_error_message,
    log_unexpected,
)
from ..observability.request_ids import request_id_in
from ..protocols.error_routes import describe_validation_error
from ..protocols.openai import errors as openai
from ..protocols.tei import routes as tei

logger = logging.getLogger(__name__)

Invalid = RequestValidationError | ValidationError


@dataclass(frozen=True)
class ErrorShape:
    """One protocol's error body: ``content`` renders one of our errors (its status, message,
    and the code and param where the shape has room for them) as JSON content; ``invalid``
    turns a body that does not validate into the 400 the protocol answers."""

    name: str
    content: Callable[[ServerError], dict[str, Any]]
    invalid: Callable[[Invalid], ServerError]


def kserve_content(exc: ServerError) -> dict[str, Any]:
    return {"error": exc.message}


def described(exc: Invalid) -> ServerError:
    return BadRequest(describe_validation_error(exc))


KSERVE = ErrorShape("kserve", kserve_content, described)
"""KServe's V1 and V2 routes, and any other route (and a request with no route yet)."""
OPENAI = ErrorShape("openai", openai.error_content, openai.invalid_body)
TEI = ErrorShape("tei", tei.error_content, described)


def is_openai_route(path: str, prefix: str) -> bool:
    """OpenAI's routes; with an empty prefix ``/v1/models`` stays KServe's (its merged body)."""
    if not path.startswith(prefix + "/v1/"):
        return False
    return bool(prefix) or not path.startswith("/v1/models")


def json_body(content: dict[str, Any]) -> bytes:
    """JSON as Starlette's ``JSONResponse`` writes it."""
    text = json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return text.encode("utf-8")


class ErrorShapes:
    """The one place that decides an error's shape: the first route family whose test the
    request's path and method pass, else KServe's. Built once with the app, from the prefix
    of the OpenAI routes."""

    def __init__(self, openai_prefix: str):
        self.families: tuple[tuple[Callable[[str, str], bool], ErrorShape], ...] = (
            (lambda path, _method: is_openai_route(path, openai_prefix), OPENAI),
            (tei.is_tei_route, TEI),  # POST / among them (GET / is KServe's liveness)
        )

    def shape_for(self, path: str, method: str) -> ErrorShape:
        for belongs, shape in self.families:
            if belongs(path, method):
                return shape
        return KSERVE

    def body(self, scope: Scope, exc: ServerError) -> bytes:
        """``exc`` in the shape of the request's route."""
        shape = self.shape_for(scope["path"], scope["method"])
        return json_body(shape.content(exc))

    def response(self, scope: Scope, exc: ServerError) -> Response:
        """``exc`` answered in the shape of the request's route, with its status and headers."""
        return Response(
            self.body(scope, exc),
            exc.status_code,
            headers=exc.headers,
            media_type="application/json",
        )

    def invalid(self, scope: Scope, exc: Invalid) -> ServerError:
        """A body that does not validate, as the 400 of the request's route."""
        return self.shape_for(scope["path"], scope["method"]).invalid(exc)


def shapes_of(request: Request) -> ErrorShapes:
    """The app's error shapes (:func:`install_error_handlers` keeps them in its state)."""
    shapes: ErrorShapes = request.app.state.error_shapes
    return shapes


async def server_error_handler(request: Request, exc: Exception) -> Response:
    """A :class:`ServerError` with its status and headers, in the route's shape. A 5xx is
    logged with its traceback, but for a 503 (loading, draining, the engine gone: states the
    log tells once, not faults of a request)."""
    assert isinstance(exc, ServerError)
    if exc.status_code >= 500 and exc.status_code != HTTPStatus.SERVICE_UNAVAILABLE:
        logger.error("request failed: %s", exc, exc_info=exc)
    return shapes_of(request).response(request.scope, exc)


async def validation_error_handler(request: Request, exc: Exception) -> Response:
    """FastAPI's 422 for a body that does not parse is a 400 here, in the route's shape."""
    assert isinstance(exc, RequestValidationError)
    shapes = shapes_of(request)
    return shapes.response(request.scope, shapes.invalid(request.scope, exc))


VERSIONS_NOT_SERVED = (
    "model versions are not served: this server serves its model without a version; "
    "leave model_version out"
)


async def not_implemented_handler(request: Request, exc: Exception) -> Response:
    """A 501, logged (KServe's own handler, which this replaces, logs it as "Exception:")."""
    logger.error("not implemented: %s", exc, exc_info=exc)
    return shapes_of(request).response(request.scope, Unimplemented(str(exc)))


class ModelVersions:
    """ASGI middleware: a request that names a ``model_version`` to a route that takes one
    (KServe's V2 model routes: ``/v2/models/{model_name}/versions/{model_version}...``, or
    ``?model_version=`` on the others) is a 404, answered before the route runs. KServe's route
    would answer 501 (its versioning is a TODO), but no such version exists here: the server
    serves its model without one."""

    def __init__(
        self, app: ASGIApp, routes: Callable[[], Sequence[BaseRoute]], shapes: ErrorShapes
    ):
        self.app = app
        self.routes = routes
        """The application's routes (read per request: KServe's are registered later)."""
        self.shapes = shapes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.names_a_version(scope):
            response = self.shapes.response(scope, NotFound(VERSIONS_NOT_SERVED))
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def names_a_version(self, scope: Scope) -> bool:
        """Whether the route that will serve the request (the first that fully matches, as the
        router picks it) takes a ``model_version`` and the request gives it one, in the path
        or else the query (as FastAPI reads it)."""
        if "/versions/" not in scope["path"] and not scope.get("query_string"):
            return False  # most requests: no route to match
        for route in self.routes():
            match, child = route.matches(scope)
            if match is Match.FULL:
                if not takes_a_version(getattr(route, "endpoint", None)):
                    return False
                version = child.get("path_params", {}).get("model_version")
                query = QueryParams(scope.get("query_string", b""))
                return bool(version or query.get("model_version"))
        return False


@functools.cache
def takes_a_version(endpoint: Callable[..., Any] | None) -> bool:
    """Whether a route's endpoint has a ``model_version`` parameter (KServe's published one)."""
    if endpoint is None:
        return False
    return "model_version" in inspect.signature(endpoint).parameters


KSERVE_CLIENT_ERRORS: dict[type[Exception], type[ServerError]] = {
    InvalidInput: BadRequest,
    ModelNotFound: NotFound,
    ModelNotReady: NotReady,
    ServerNotReady: NotReady,
}
"""KServe's exceptions for a client fault or a server still loading, as ours of the status
KServe answers them with."""


async def kserve_client_error_handler(request: Request, exc: Exception) -> Response:
    """KServe's answer to its client-side exceptions (:data:`KSERVE_CLIENT_ERRORS`), without
    the error and traceback its handlers log for each: with readiness probes every few
    seconds while the model loads, those bury the real log. The gateway's request line has
    the status."""
    ours = next(KSERVE_CLIENT_ERRORS[c] for c in type(exc).__mro__ if c in KSERVE_CLIENT_ERRORS)
    return shapes_of(request).response(request.scope, ours(str(exc)))


def internal_error(request_id: str) -> ServerError:
    """The 500 of an unexpected failure: the request id, nothing of the cause."""
    return ServerError(internal_error_message(request_id))


class UnexpectedErrors:
    """ASGI middleware for the exceptions no handler took (a bug, a model that raised): the
    answer is a 500 that names the request id and nothing of the exception, whose text and
    traceback go to the log under that id. A response already under way is ended: a stream
    with an error event and ``[DONE]``, as the gateway ends one past its deadline.

    It sits inside the gateway (which adds the ``x-request-id`` header and logs the status)
    and outside Starlette's exception middleware, whose handlers answer the exceptions that
    carry a status. Starlette's own last resort, a handler keyed on ``Exception``, runs
    outside every middleware, then re-raises to uvicorn, which logs the traceback again."""

    def __init__(self, app: ASGIApp, shapes: ErrorShapes):
        self.app = app
        self.shapes = shapes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = ResponseState()

        async def sending(message: Message) -> None:
            sent.saw(message)
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as exc:
            request_id = request_id_in(Headers(scope=scope))
            log_unexpected(request_id, exc)
            body = self.shapes.body(scope, internal_error(request_id))
            await end_with_error(sending, sent, HTTPStatus.INTERNAL_SERVER_ERROR, body)


class ResponseState:
    """How far a response went: started, a Server-Sent Events stream, finished."""

    def __init__(self) -> None:
        self.started = self.streaming = self.finished = False

    def saw(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            self.streaming = any(
                name.lower() == b"content-type" and value.startswith(b"text/event-stream")
                for name, value in message.get("headers", ())
            )
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.finished = True


async def end_with_error(
    send: Send,
    sent: ResponseState,
    status: int,
    body: bytes,
    headers: Sequence[tuple[bytes, bytes]] = (),
) -> None:
    """Answer ``status`` with the JSON error ``body`` (and ``headers``) if no response started;
    else end the one under way: a stream with the error as its last event and ``[DONE]``,
    any other body where it stands (all that can be done once part of it went out)."""
    if sent.finished:
        return
    if not sent.started:
        start = [(b"content-type", b"application/json")]
        start += [(b"content-length", str(len(body)).encode()), *headers]
        await send({"type": "http.response.start", "status": status, "headers": start})
    elif sent.streaming:
        body = b"data: " + body + b"\n\ndata: [DONE]\n\n"
    else:
        body = b""
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def outermost_error_handler(request: Request, exc: Exception) -> Response:
    """The same answer for an exception raised outside :class:`UnexpectedErrors` (by another
    middleware): Starlette's outermost middleware sends it past the gateway, so it carries its
    request id itself."""
    request_id = request_id_in(request.headers)
    log_unexpected(request_id, exc)
    response = shapes_of(request).response(request.scope, internal_error(request_id))
    response.headers["x-request-id"] = request_id
    return response


def install_error_handlers(app: FastAPI, openai_prefix: str) -> None:
    """Our exceptions with their status, KServe's client-side ones answered without a
    traceback, 400 (not 422) for bodies that do not validate, 404 for model versions, and a
    500 that leaks nothing for any other exception, each in the shape of its route (the OpenAI
    routes' under ``openai_prefix``); call after KServe adds its handlers, so that ours win,
    and before the gateway is added around the app."""
    shapes = ErrorShapes(openai_prefix)
    app.state.error_shapes = shapes
    app.add_exception_handler(ServerError, server_error_handler)
    for kserve_error in KSERVE_CLIENT_ERRORS:
        app.add_exception_handler(kserve_error, kserve_client_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(NotImplementedError, not_implemented_handler)
    app.add_exception_handler(Exception, outermost_error_handler)  # instead of KServe's
    installed = {middleware.cls for middleware in app.user_middleware}
    if ModelVersions not in installed:
        app.add_middleware(ModelVersions, routes=lambda: app.router.routes, shapes=shapes)
    if UnexpectedErrors not in installed:
        app.add_middleware(UnexpectedErrors, shapes=shapes)
