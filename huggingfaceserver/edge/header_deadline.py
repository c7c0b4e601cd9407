"""A deadline for each request's headers, which uvicorn does not have.

uvicorn's keep-alive timeout runs only while a connection is idle between requests and stops at
the first byte of the next one: a client that connects and sends nothing, or sends part of its
headers and stalls, holds its connection (a file descriptor and its buffers) for as long as it
likes, and a flood of such clients would use up the process's descriptors and refuse everyone
else. :func:`protocol_with_header_deadline` gives uvicorn an HTTP protocol (its own, on
httptools) that times each request from the start of its connection, or from its first byte
after the previous response, to the end of its headers: past the deadline the client gets a 408
in KServe's error shape (no route is known before the headers) and the connection is closed.
The body has a deadline of its own in the gateway, counted once the headers are in (both are
``--request_read_timeout_seconds``).
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ..errors import ReadTimeout
from .http_errors import KSERVE, json_body


def timeout_response(seconds: float) -> bytes:
    """The whole 408 response: ``{"error": ...}``, as KServe's routes answer errors."""
    error = ReadTimeout(
        f"the request's headers did not arrive within {seconds:g} s "
        "(--request_read_timeout_seconds)"
    )
    body = json_body(KSERVE.content(error))
    head = (
        "HTTP/1.1 408 Request Timeout\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class HeaderDeadlineProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, each request's headers due within :attr:`header_timeout_s`
    (set by :func:`protocol_with_header_deadline`)."""

    header_timeout_s = 30.0
    header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.arm_header_deadline()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.arm_header_deadline()  # a later request on the connection: its own deadline

    def on_headers_complete(self) -> None:
        self.disarm_header_deadline()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self.disarm_header_deadline()
        super().connection_lost(exc)

    def arm_header_deadline(self) -> None:
        if self.header_deadline is None:
            self.header_deadline = asyncio.get_running_loop().call_later(
                self.header_timeout_s, self.headers_overdue
            )

    def disarm_header_deadline(self) -> None:
        if self.header_deadline is not None:
            self.header_deadline.cancel()
            self.header_deadline = None

    def headers_overdue(self) -> None:
        """The deadline passed: 408 and close, unless a response is still being sent on the
        connection (a pipelined request behind it waits for that response to end first)."""
        self.header_deadline = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self.arm_header_deadline()
            return
        self.transport.write(timeout_response(self.header_timeout_s))
        self.transport.close()


def protocol_with_header_deadline(seconds: float) -> type[HeaderDeadlineProtocol]:
    """The protocol class for uvicorn's ``Config(http=...)``, headers due within ``seconds``."""
    return type("HeaderDeadlineProtocol", (HeaderDeadlineProtocol,), {"header_timeout_s": seconds})
