"""Exceptions that carry their status, and what a client is told of an unexpected one.

Each protocol renders them in its own shape: HTTP in :mod:`.edge.http_errors` and the OpenAI
routes, gRPC in :mod:`.edge.grpc_errors` (the status code for each HTTP status).
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

logger = logging.getLogger(__name__)


class StartupError(Exception):
    """A configuration or model problem found before serving: one line, exit status 1."""


class ServerError(Exception):
    """A request failure with the HTTP status it should be answered with."""

    status_code: int = HTTPStatus.INTERNAL_SERVER_ERROR

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class BadRequest(ServerError):
    """The request is malformed or asks for something the model cannot do (400)."""

    status_code = HTTPStatus.BAD_REQUEST


class NotFound(ServerError):
    """No such model (404)."""

    status_code = HTTPStatus.NOT_FOUND


class Conflict(ServerError):
    """The request conflicts with what is under way, e.g. unloading an adapter in use (409)."""

    status_code = HTTPStatus.CONFLICT


class NotReady(ServerError):
    """The model is still loading (503)."""

    status_code = HTTPStatus.SERVICE_UNAVAILABLE


class ClientClosedRequest(ServerError):
    """The client went away before the answer was ready (nginx's 499; nobody reads it)."""

    status_code = 499


class UpstreamError(ServerError):
    """The remote predictor (transformer mode) failed or is unreachable (502)."""

    status_code = HTTPStatus.BAD_GATEWAY


class UpstreamTimeout(ServerError):
    """The remote predictor did not answer within ``--predictor_request_timeout_seconds``."""

    status_code = HTTPStatus.GATEWAY_TIMEOUT


def describe_validation_error(exc: RequestValidationError | ValidationError) -> str:
    """One readable line out of FastAPI's validation error list."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        msg = err.get("msg", "invalid value")
        parts.append(f"{where}: {msg}" if where else msg)
    return "invalid request body: " + "; ".join(parts)


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
