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

Nor does uvicorn bound how long a response may wait for a client that reads none of it: a
handler blocks in ``send`` while the connection's buffer is full, holding its admission slot
(or, its response all written, the buffer holds the memory) for as long as the client
stalls. A connection whose writes stay paused (the transport's buffer over its high-water
mark) for the same deadline is aborted: its handler sees the client gone, its slot and
buffers are freed.

httptools has no bound on the headers' size either: a client streaming headers (or one endless
value) within the deadline would have them kept, and parsed on the event loop, by the
megabyte. A request line and headers past :data:`MAX_HEADER_BYTES` get a 431 and the connection
is closed.
"""

from __future__ import annotations

import asyncio
import logging
from http import HTTPStatus

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ..errors import HeadersTooLarge, ReadTimeout, ServerError
from .http_errors import KSERVE, json_body

logger = logging.getLogger(__name__)

MAX_HEADER_BYTES = 64 * 1024
"""The most a request line and its headers may take (nginx takes 32 KiB, Node 16 KiB)."""


def closing_response(error: ServerError) -> bytes:
    """The whole response of an error answered before any route is known: ``{"error": ...}``,
    as KServe's routes answer errors, and the connection closed."""
    body = json_body(KSERVE.content(error))
    head = (
        f"HTTP/1.1 {error.status_code} {HTTPStatus(error.status_code).phrase}\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def timeout_response(seconds: float) -> bytes:
    """The whole 408 response."""
    return closing_response(
        ReadTimeout(
            f"the request's headers did not arrive within {seconds:g} s "
            "(--request_read_timeout_seconds)"
        )
    )


LINGER_S = 1.0
"""How long a connection refused for its headers' size is read (and its bytes dropped) before
it is closed."""

TOO_LARGE = closing_response(
    HeadersTooLarge(f"the request line and headers exceed {MAX_HEADER_BYTES // 1024} KiB")
)


class HeaderDeadlineProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, each request's headers due within :attr:`header_timeout_s`
    (set by :func:`protocol_with_header_deadline`)."""

    header_timeout_s = 30.0
    header_deadline: asyncio.TimerHandle | None = None
    header_bytes = 0
    """Bytes received since the request's headers began (while :attr:`header_deadline` runs)."""
    refused = False
    """Whether the headers were refused (431): the connection is closing."""
    completed_here = False
    """Whether a request's headers ended in the bytes being parsed (pipelined requests: many
    in one read, none of them counted against the next one's size)."""
    write_deadline: asyncio.TimerHandle | None = None
    """While writes are paused (the client does not read): when the connection is aborted."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return  # what the client still sends after the 431: dropped unparsed
        self.completed_here = False
        super().data_received(data)
        if self.header_deadline is None or self.transport.is_closing():
            return  # not in a request's headers (its body, or between requests)
        if self.completed_here:  # headers ended in this chunk: the next ones start in it
            self.header_bytes = 0
            return
        self.header_bytes += len(data)
        if self.header_bytes > MAX_HEADER_BYTES:
            self.refuse_headers()

    def refuse_headers(self) -> None:
        """431, then the connection closed once the client has had :data:`LINGER_S` to stop
        sending: its bytes meanwhile are read and dropped, since closing with some unread
        would reset the connection, and the client could lose the 431 with it."""
        self.disarm_header_deadline()
        self.refused = True
        self.transport.write(TOO_LARGE)
        asyncio.get_running_loop().call_later(LINGER_S, self.transport.close)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.arm_header_deadline()  # a later request on the connection: its own deadline

    def on_headers_complete(self) -> None:
        self.disarm_header_deadline()
        self.completed_here = True
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self.disarm_header_deadline()
        self.resume_writing_deadline()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.write_deadline is None:
            self.write_deadline = asyncio.get_running_loop().call_later(
                self.header_timeout_s, self.writes_stalled
            )

    def resume_writing(self) -> None:
        self.resume_writing_deadline()
        super().resume_writing()

    def resume_writing_deadline(self) -> None:
        if self.write_deadline is not None:
            self.write_deadline.cancel()
            self.write_deadline = None

    def writes_stalled(self) -> None:
        """The client read none of what was written for the whole deadline: abort (closing
        would wait for the buffer it does not read)."""
        self.write_deadline = None
        logger.info(
            "a client read nothing of its response for %g s (--request_read_timeout_seconds): "
            "connection aborted",
            self.header_timeout_s,
        )
        self.transport.abort()

    def arm_header_deadline(self) -> None:
        if self.header_deadline is None:
            self.header_bytes = 0
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
