"""The gateway's rules for the gRPC port: the API key (``authorization: Bearer <key>``
metadata), the model repository methods off unless enabled, admission counted with HTTP's, no
new call while the server drains, and errors answered with their status code. Health methods
stay open. Each refusal is the :class:`~huggingfaceserver.errors.ServerError` the HTTP gateway
raises for the same rule, ended by :func:`.grpc_errors.grpc_status` as every error is."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc import aio
from grpc.aio import ServerInterceptor

from ..errors import (
    DeadlineExceeded,
    NotFound,
    NotReady,
    ServerError,
    TooManyRequests,
    Unauthorized,
    Unimplemented,
)
from ..observability import request_notes
from ..observability.request_ids import client_request_id, new_request_id
from .admission import Admission
from .gateway import ASK_FOR_KEY, RETRY_LATER, SHUTTING_DOWN, ServerState, bearer_matches
from .grpc_errors import grpc_status
from .http_errors import VERSIONS_NOT_SERVED
from .repository import DISABLED, REPOSITORY_GRPC_METHODS

logger = logging.getLogger(__name__)

OPEN_METHODS = frozenset({"ServerLive", "ServerReady"})
ADMITTED_METHODS = frozenset({"ModelInfer"})


UNAUTHENTICATED = Unauthorized(
    "missing or wrong API key: send the metadata 'authorization: Bearer <key>'",
    headers=ASK_FOR_KEY,
)


def _refusal(error: ServerError) -> grpc.RpcMethodHandler:
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(*grpc_status(error, ""))

    return grpc.unary_unary_rpc_method_handler(refuse)


def requested_version(request: Any) -> str:
    """The model version a call names (KServe's servicer would ignore it and serve anyway)."""
    return getattr(request, "model_version", "") or getattr(request, "version", "")


class PolicyInterceptor(ServerInterceptor):  # type: ignore[misc]
    def __init__(
        self,
        admission: Admission,
        state: ServerState,
        api_key: str | None,
        enable_repository: bool,
        log_calls: bool = True,
        timeout_s: float | None = None,
    ):
        self.admission = admission
        self.state = state
        self.key = api_key.encode() if api_key else None
        self.enable_repository = enable_repository
        self.log_calls = log_calls
        self.timeout_s = timeout_s
        """``--request_timeout_seconds``: past it a call ends DEADLINE_EXCEEDED and its work is
        cancelled, as an HTTP request gets its 504."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = details.method.rsplit("/", 1)[-1]
        if method in OPEN_METHODS:
            return self.wrapped(await continuation(details), method, admit=False, log=False)
        if not self.authorized(details):
            return _refusal(UNAUTHENTICATED)
        if method in REPOSITORY_GRPC_METHODS and not self.enable_repository:
            return _refusal(Unimplemented(DISABLED))
        if self.state.draining:
            return _refusal(NotReady(SHUTTING_DOWN))
        handler = await continuation(details)
        return self.wrapped(handler, method, method in ADMITTED_METHODS, self.log_calls)

    def wrapped(
        self, handler: grpc.RpcMethodHandler | None, method: str, admit: bool, log: bool
    ) -> grpc.RpcMethodHandler | None:
        """A unary call's handler served by :meth:`served` (every method of KServe's servicer
        is unary)."""
        if handler is None or handler.unary_unary is None:
            return handler
        return grpc.unary_unary_rpc_method_handler(
            self.served(handler.unary_unary, method, admit, log),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def authorized(self, details: grpc.HandlerCallDetails) -> bool:
        if self.key is None:
            return True
        for key, value in details.invocation_metadata or ():
            if key.lower() == "authorization":
                given = value.encode() if isinstance(value, str) else bytes(value)
                return bearer_matches(given, self.key)
        return False

    def served(
        self, inner: Callable[..., Awaitable[Any]], method: str, admit: bool, log: bool
    ) -> Callable[..., Awaitable[Any]]:
        """``inner`` admitted (when ``admit``), its errors answered with their status code
        (:mod:`.grpc_errors`), and logged (when ``log``) in one line with its request id."""

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            start = time.perf_counter()
            request_id = client_request_id(getattr(request, "id", "")) or new_request_id()
            code = grpc.StatusCode.OK
            ended: grpc.StatusCode | None = None
            with request_notes.collecting() as notes:
                try:
                    try:
                        return await self.answer(inner, request, context, admit)
                    except aio.AbortError:
                        raise
                    except Exception as exc:
                        status = grpc_status(exc, request_id)
                        ended = status.code
                        await context.abort(*status)
                except BaseException:
                    code = context.code() or ended or grpc.StatusCode.UNKNOWN
                    raise
                finally:
                    if log:
                        logger.info(
                            "grpc %s %s %s %.1f ms%s",
                            request_id,
                            method,
                            getattr(code, "name", code),
                            (time.perf_counter() - start) * 1000,
                            request_notes.suffix(notes),
                            extra={"request_id": request_id},
                        )

        return call

    async def answer(
        self,
        inner: Callable[..., Awaitable[Any]],
        request: Any,
        context: grpc.aio.ServicerContext,
        admit: bool,
    ) -> Any:
        """``inner``'s answer, unless the call names a version (404) or finds no free slot
        (429, when ``admit``): refusals raised as HTTP's gateway raises them."""
        if requested_version(request):
            raise NotFound(VERSIONS_NOT_SERVED)
        if not admit:
            return await inner(request, context)
        if not self.admission.try_enter():
            raise TooManyRequests(self.admission.refusal(), headers=RETRY_LATER)
        deadline = asyncio.timeout(self.timeout_s)
        try:
            async with deadline:
                return await inner(request, context)
        except TimeoutError:
            if not deadline.expired():
                raise
            raise DeadlineExceeded(
                f"the request took longer than {self.timeout_s:g} s (--request_timeout_seconds)"
            ) from None
        finally:
            self.admission.leave()
