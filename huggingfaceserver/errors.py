"""Exceptions that carry their status, and what a client is told of an unexpected one.

No framework here: each protocol renders them in its own shape, HTTP in :mod:`.edge.http_errors`
(the shape of each route family, chosen there once) and gRPC in :mod:`.edge.grpc_errors` (the
status code for each HTTP status).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from http import HTTPStatus

logger = logging.getLogger(__name__)


class StartupError(Exception):
    """A configuration or model problem found before serving: one line, exit status 1."""


class ProcessDied(Exception):
    """A process of the server's layout (the engine or a front, under ``--api_workers N``)
    exited unasked once the server was serving: a run-time failure, not a startup one, ended
    as one is (the others stopped, this one line, exit status 1) so that it is restarted."""


class ServerError(Exception):
    """A request failure with the HTTP status it should be answered with, and the headers
    that go with it (``Retry-After``, ``WWW-Authenticate``, ``Connection: close``)."""

    status_code: int = HTTPStatus.INTERNAL_SERVER_ERROR
    code: str | None = None
    """A machine-readable code, for the shapes that have room for one (OpenAI's ``code``)."""
    param: str | None = None
    """The request field at fault, for the shapes that name it (OpenAI's ``param``)."""

    def __init__(self, message: str, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.headers: dict[str, str] = dict(headers or {})

    def __str__(self) -> str:
        return self.message


class BadRequest(ServerError):
    """The request is malformed or asks for something the model cannot do (400)."""

    status_code = HTTPStatus.BAD_REQUEST


class Unauthorized(ServerError):
    """No API key, or the wrong one (401)."""

    status_code = HTTPStatus.UNAUTHORIZED
    code = "invalid_api_key"


class NotFound(ServerError):
    """No such model (404)."""

    status_code = HTTPStatus.NOT_FOUND


class ReadTimeout(ServerError):
    """The request (its headers or its body) did not arrive in time (408)."""

    status_code = HTTPStatus.REQUEST_TIMEOUT


class HeadersTooLarge(ServerError):
    """The request line and headers are over the size the server reads (431)."""

    status_code = HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE


class Conflict(ServerError):
    """The request conflicts with what is under way, e.g. unloading an adapter in use (409)."""

    status_code = HTTPStatus.CONFLICT


class PayloadTooLarge(ServerError):
    """The request body is over ``--max_request_bytes`` (413)."""

    status_code = HTTPStatus.REQUEST_ENTITY_TOO_LARGE


class TooManyRequests(ServerError):
    """The server holds as many requests as it may; retry later (429)."""

    status_code = HTTPStatus.TOO_MANY_REQUESTS
    code = "rate_limit_exceeded"


class NotReady(ServerError):
    """Not serving now: the model is still loading, or the server is shutting down (503)."""

    status_code = HTTPStatus.SERVICE_UNAVAILABLE


class EngineDied(ServerError):
    """The engine (our engine process, or vLLM's) stopped while serving, a run-time failure:
    the requests waiting on it fail with a 503, and the server exits non-zero with this one
    line, as for a :class:`StartupError`, so that it is restarted."""

    status_code = HTTPStatus.SERVICE_UNAVAILABLE


class ClientClosedRequest(ServerError):
    """The client went away before the answer was ready (nginx's 499; nobody reads it)."""

    status_code = 499


class Unimplemented(ServerError):
    """What the request asks is not implemented (501)."""

    status_code = HTTPStatus.NOT_IMPLEMENTED


class UpstreamError(ServerError):
    """The remote predictor (transformer mode) failed or is unreachable (502)."""

    status_code = HTTPStatus.BAD_GATEWAY


class UpstreamTimeout(ServerError):
    """The remote predictor did not answer within ``--predictor_request_timeout_seconds``."""

    status_code = HTTPStatus.GATEWAY_TIMEOUT


class DeadlineExceeded(ServerError):
    """The answer was not ready within ``--request_timeout_seconds`` (504)."""

    status_code = HTTPStatus.GATEWAY_TIMEOUT


INTERNAL_ERROR = (
    "internal server error while serving request {request_id}; "
    "the server log has the details under that id"
)


def internal_error_message(request_id: str) -> str:
    """What a client is told of an unexpected failure: the request id, nothing of the cause."""
    return INTERNAL_ERROR.format(request_id=request_id)


def log_unexpected(request_id: str, exc: BaseException) -> None:
    """The exception and its traceback, for the log only, under the request id."""
    logger.error(
        "request %s failed: %s: %s",
        request_id,
        type(exc).__name__,
        exc,
        exc_info=exc,
        extra={"request_id": request_id},
    )
