"""Exceptions that carry their status, and the one handler per protocol that renders them.

Client faults subclass :class:`kserve.errors.InvalidInput` too, so KServe's gRPC interceptor
maps them to ``INVALID_ARGUMENT`` without a handler of ours.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from kserve.errors import InvalidInput
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


class BadRequest(ServerError, InvalidInput):
    """The request is malformed or asks for something the model cannot do (400)."""

    status_code = HTTPStatus.BAD_REQUEST

    def __init__(self, message: str):
        ServerError.__init__(self, message)
        self.reason = message  # what kserve's gRPC interceptor reports


class NotFound(ServerError):
    """No such model (404)."""

    status_code = HTTPStatus.NOT_FOUND


class NotReady(ServerError):
    """The model is still loading (503)."""

    status_code = HTTPStatus.SERVICE_UNAVAILABLE


class ClientClosedRequest(ServerError):
    """The client went away before the answer was ready (nginx's 499; nobody reads it)."""

    status_code = 499


class UpstreamError(ServerError):
    """The remote predictor (transformer mode) failed or is unreachable (502)."""

    status_code = HTTPStatus.BAD_GATEWAY


async def server_error_handler(_: Request, exc: Exception) -> JSONResponse:
    """Render a :class:`ServerError` in the KServe shape ``{"error": message}``."""
    assert isinstance(exc, ServerError)
    if exc.status_code >= 500:
        logger.error("request failed: %s", exc, exc_info=exc)
    return JSONResponse(status_code=exc.status_code, content={"error": exc.message})


def describe_validation_error(exc: RequestValidationError | ValidationError) -> str:
    """One readable line out of FastAPI's validation error list."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        msg = err.get("msg", "invalid value")
        parts.append(f"{where}: {msg}" if where else msg)
    return "invalid request body: " + "; ".join(parts)


async def validation_error_handler(_: Request, exc: Exception) -> JSONResponse:
    """FastAPI's 422 for a body that does not parse is a 400 here, in the KServe shape."""
    assert isinstance(exc, RequestValidationError)
    return JSONResponse(
        status_code=HTTPStatus.BAD_REQUEST, content={"error": describe_validation_error(exc)}
    )


VERSIONS_NOT_SERVED = (
    "model versions are not served: this server serves its model without a version; "
    "leave model_version out"
)


async def not_implemented_handler(_: Request, exc: Exception) -> JSONResponse:
    """KServe answers a ``model_version`` with 501 (its versioning is a TODO): no such version
    exists here, so it is a 404. Anything else not implemented stays a 501."""
    if "version" in str(exc).lower():
        return JSONResponse(
            status_code=HTTPStatus.NOT_FOUND, content={"error": VERSIONS_NOT_SERVED}
        )
    logger.error("not implemented: %s", exc, exc_info=exc)
    return JSONResponse(status_code=HTTPStatus.NOT_IMPLEMENTED, content={"error": str(exc)})


def install_error_handlers(app: FastAPI) -> None:
    """Our exceptions with their status, 400 (not 422) for bodies that do not validate, 404 for
    model versions; call after KServe adds its handlers, so that ours win."""
    app.add_exception_handler(ServerError, server_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(NotImplementedError, not_implemented_handler)
