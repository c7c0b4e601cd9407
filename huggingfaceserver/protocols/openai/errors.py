"""OpenAI's error shape, ``{"error": {"message", "type", "param", "code"}}``: how a failure on
the OpenAI routes is rendered (typed server errors, unknown models, and request bodies that do not
validate: 400 here, never FastAPI's 422 ``detail``). The edge answers with it on these routes
(:mod:`huggingfaceserver.edge.http_errors`), the chat and completion streams end with it.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from huggingfaceserver.errors import BadRequest, ServerError

# OpenAI's error types by status; any other 4xx is an invalid request (OpenAI's type for an
# unknown model too, told apart by its code), any other 5xx a server error.
_ERROR_TYPES: dict[int, str] = {
    HTTPStatus.UNAUTHORIZED: "authentication_error",
    HTTPStatus.FORBIDDEN: "permission_error",
    HTTPStatus.TOO_MANY_REQUESTS: "rate_limit_error",
}
# Codes for statuses that mean one thing on these routes: a ServerError 404 is an unknown model.
_DEFAULT_CODES: dict[int, str] = {HTTPStatus.NOT_FOUND: "model_not_found"}


def error_type(status_code: int) -> str:
    """The OpenAI ``type`` for an HTTP status."""
    default = "server_error" if status_code >= 500 else "invalid_request_error"
    return _ERROR_TYPES.get(status_code, default)


class OpenAIError(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIErrorResponse(BaseModel):
    """The body of every error on the OpenAI routes."""

    error: OpenAIError

    @classmethod
    def build(
        cls, message: str, status_code: int, param: str | None = None, code: str | None = None
    ) -> OpenAIErrorResponse:
        """The body for ``status_code``; ``code`` defaults by status (404: model_not_found)."""
        if code is None:
            code = _DEFAULT_CODES.get(status_code)
        return cls(
            error=OpenAIError(message=message, type=error_type(status_code), param=param, code=code)
        )


class InvalidParameter(BadRequest):
    """A 400 about one request field, named in the error's ``param``."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


def context_length_error(
    max_len: int, prompt_tokens: int, completion_tokens: int, param: str = "messages"
) -> InvalidParameter:
    """OpenAI's own 400 for a prompt plus ``max_tokens`` beyond the context.

    ``param`` is ``"messages"`` on chat, ``"prompt"`` on completions.
    """
    requested = prompt_tokens + completion_tokens
    return InvalidParameter(
        f"This model's maximum context length is {max_len} tokens. However, you requested "
        f"{requested} tokens ({prompt_tokens} in the messages, {completion_tokens} in the "
        "completion). Please reduce the length of the messages or completion.",
        param=param,
        code="context_length_exceeded",
    )


def prompt_too_long_error(
    max_len: int, at_least: int, chars: int, param: str = "messages"
) -> InvalidParameter:
    """The context-length 400 for a prompt refused after tokenizing only its first ``chars``
    characters (``at_least`` tokens)."""
    where = "messages" if param == "messages" else "prompt"
    return InvalidParameter(
        f"This model's maximum context length is {max_len} tokens. However, your {where} "
        f"has at least {at_least} tokens (in its first {chars} characters alone). Please "
        f"reduce the length of the {where}.",
        param=param,
        code="context_length_exceeded",
    )


def error_content(exc: ServerError) -> dict[str, Any]:
    """``exc`` in the OpenAI shape (its status, param and code), as JSON content."""
    return OpenAIErrorResponse.build(exc.message, exc.status_code, exc.param, exc.code).model_dump()


def openai_error_response(exc: ServerError) -> JSONResponse:
    """``exc`` answered in the OpenAI shape, with its own status."""
    return JSONResponse(status_code=exc.status_code, content=error_content(exc))


def _field_path(loc: tuple[int | str, ...]) -> str | None:
    """``("body", "messages", 0, "content")`` -> ``"messages.0.content"``."""
    parts = [str(part) for part in loc if part != "body"]
    return ".".join(parts) or None


def _describe(error: Any) -> tuple[str, str | None]:
    """One pydantic error as (message naming the field, dotted field path)."""
    if error.get("type") == "json_invalid":
        return f"request body is not valid JSON: {error.get('msg', '')}", None
    param = _field_path(tuple(error.get("loc", ())))
    message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
    if param is None:
        return ("request body: " if error.get("loc") else "") + message, None
    return f"{param}: {message}", param


def invalid_body(exc: RequestValidationError | ValidationError) -> InvalidParameter:
    """A body that failed validation, as a 400: every problem in the message, the first one's
    field path as ``param``."""
    described = [_describe(error) for error in exc.errors()] or [("invalid request body", None)]
    message = "; ".join(dict.fromkeys(message for message, _ in described))
    return InvalidParameter(message, param=described[0][1])


def validation_error_body(exc: RequestValidationError | ValidationError) -> OpenAIErrorResponse:
    """The body of :func:`invalid_body`'s 400."""
    error = invalid_body(exc)
    return OpenAIErrorResponse.build(error.message, error.status_code, param=error.param)
