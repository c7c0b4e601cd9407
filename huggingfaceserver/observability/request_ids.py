"""Request ids: made for each request (the gateway's, or the client's own), read where a
handler answers or logs."""

from __future__ import annotations

import random
import uuid

from starlette.datastructures import Headers


def new_request_id() -> str:
    """A random UUID4 from Python's generator (seeded from the OS once per process): ids need
    no secrecy, and ``uuid.uuid4()`` reads ``os.urandom`` every time, a system call that hands
    the GIL to the busy batching threads and waits to get it back."""
    return str(uuid.UUID(int=random.getrandbits(128), version=4))


MAX_REQUEST_ID_CHARS = 128
"""The longest client-given request id kept (a longer one, or one with a line break, could
forge or swell log lines: a new id is made instead)."""


def client_request_id(given: str) -> str | None:
    """The id a client gave (an ``x-request-id`` header, a gRPC request's ``id``) when it is a
    sane one: printable, at most :data:`MAX_REQUEST_ID_CHARS`; else None."""
    text = given.strip()
    return text if 0 < len(text) <= MAX_REQUEST_ID_CHARS and text.isprintable() else None


def request_id_in(headers: Headers) -> str:
    """The request's id: the gateway's, which it put in the request headers (a new one for an
    app driven without the gateway)."""
    return headers.get("x-request-id", "").strip() or new_request_id()
