"""Routes that answer every failure in their protocol's own error shape: a route class per
protocol (OpenAI's, TEI's) renders our exceptions and bodies that do not validate, each with its
status, so that KServe's routes keep their own shape beside them."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import ValidationError

from ..errors import ServerError


class ShapedErrorRoute(APIRoute):
    """A route whose failures its protocol renders (:meth:`server_error`, :meth:`invalid`)."""

    @staticmethod
    @abstractmethod
    def server_error(exc: ServerError) -> Response:
        """One of our errors, with its status."""

    @staticmethod
    @abstractmethod
    def invalid(exc: ValidationError | RequestValidationError) -> Response:
        """A body that does not validate: a 400."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except ServerError as exc:
                return self.server_error(exc)
            except (ValidationError, RequestValidationError) as exc:
                return self.invalid(exc)

        return route
