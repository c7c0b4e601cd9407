"""Request bodies that do not validate: how one is described, and the route class of the
handlers that parse their own bodies (the OpenAI and TEI routes), for which such a body is the
client's fault, like one FastAPI refuses. The shape of the answer is the edge's to choose, by
route (:mod:`huggingfaceserver.edge.http_errors`), as for every other error."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import ValidationError


def describe_validation_error(exc: RequestValidationError | ValidationError) -> str:
    """One readable line out of FastAPI's validation error list."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        msg = err.get("msg", "invalid value")
        parts.append(f"{where}: {msg}" if where else msg)
    return "invalid request body: " + "; ".join(parts)


class OwnBodyRoute(APIRoute):
    """A route whose handler parses its own body (``model_validate_json``): pydantic's
    :class:`ValidationError` from it is raised as FastAPI's :class:`RequestValidationError`,
    which the server's handler answers with a 400 in the route's error shape (elsewhere a
    stray ``ValidationError`` is a bug in the server, a 500)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except ValidationError as exc:
                raise RequestValidationError(exc.errors()) from exc

        return route
