"""How gRPC answers errors: the status code for our exceptions (by their HTTP status) and for
KServe's, and for anything else ``INTERNAL`` with the request id and nothing of the cause, whose
text and traceback go to the log. Client faults are not logged with a traceback (the call's one
log line has the code), as on HTTP. The headers an error carries that mean the same to a gRPC
client (:data:`TRAILERS`: when to retry, how to authenticate) go in the call's trailing
metadata."""

from __future__ import annotations

from collections.abc import Sequence
from http import HTTPStatus
from typing import NamedTuple

import grpc
from kserve.errors import (
    InferenceError,
    InvalidInput,
    ModelNotFound,
    ModelNotReady,
    ServerNotLive,
    ServerNotReady,
    UnsupportedProtocol,
)

from ..errors import ServerError, internal_error_message, log_unexpected

CODE_FOR_STATUS: dict[int, grpc.StatusCode] = {
    HTTPStatus.BAD_REQUEST: grpc.StatusCode.INVALID_ARGUMENT,
    HTTPStatus.UNAUTHORIZED: grpc.StatusCode.UNAUTHENTICATED,
    HTTPStatus.FORBIDDEN: grpc.StatusCode.PERMISSION_DENIED,
    HTTPStatus.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    HTTPStatus.REQUEST_TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    HTTPStatus.TOO_MANY_REQUESTS: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    HTTPStatus.NOT_IMPLEMENTED: grpc.StatusCode.UNIMPLEMENTED,
    HTTPStatus.BAD_GATEWAY: grpc.StatusCode.UNAVAILABLE,
    HTTPStatus.SERVICE_UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    HTTPStatus.GATEWAY_TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
}
"""The gRPC code of an HTTP status (the usual mapping; any other 4xx is INVALID_ARGUMENT, any
other 5xx INTERNAL)."""

KSERVE_CODES: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (InvalidInput, grpc.StatusCode.INVALID_ARGUMENT),
    (InferenceError, grpc.StatusCode.INVALID_ARGUMENT),
    (UnsupportedProtocol, grpc.StatusCode.INVALID_ARGUMENT),
    (ModelNotFound, grpc.StatusCode.NOT_FOUND),
    (ModelNotReady, grpc.StatusCode.UNAVAILABLE),
    (ServerNotReady, grpc.StatusCode.UNAVAILABLE),
    (ServerNotLive, grpc.StatusCode.UNAVAILABLE),
    (NotImplementedError, grpc.StatusCode.UNIMPLEMENTED),
)
"""KServe's exceptions, with the codes its own gRPC interceptor gives them."""


TRAILERS = ("retry-after", "www-authenticate")
"""The headers of a :class:`ServerError` that gRPC answers carry too, as trailing metadata
(``Connection: close`` and the like are HTTP's own)."""


class GrpcStatus(NamedTuple):
    """How a call ends: the arguments of ``ServicerContext.abort``."""

    code: grpc.StatusCode
    details: str
    trailing_metadata: Sequence[tuple[str, str]] = ()


def code_for_status(status: int) -> grpc.StatusCode:
    if status in CODE_FOR_STATUS:
        return CODE_FOR_STATUS[status]
    return grpc.StatusCode.INVALID_ARGUMENT if status < 500 else grpc.StatusCode.INTERNAL


def grpc_status(exc: Exception, request_id: str) -> GrpcStatus:
    """How a call that raised ``exc`` ends (unexpected errors logged)."""
    if isinstance(exc, ServerError):
        code = code_for_status(exc.status_code)
        if code is grpc.StatusCode.INTERNAL:
            log_unexpected(request_id, exc)
        trailers = [
            (name.lower(), value) for name, value in exc.headers.items() if name.lower() in TRAILERS
        ]
        return GrpcStatus(code, exc.message, tuple(trailers))
    for kind, code in KSERVE_CODES:
        if isinstance(exc, kind):
            return GrpcStatus(code, str(getattr(exc, "reason", exc)))
    log_unexpected(request_id, exc)
    return GrpcStatus(grpc.StatusCode.INTERNAL, internal_error_message(request_id))
