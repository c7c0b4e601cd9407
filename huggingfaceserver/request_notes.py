"""What a handler adds to its request's one log line; the gateway writes the line.

The gateway opens a note for each request before its handler runs (the handler's task inherits
the context, so both see the same list); a handler that describes its inputs adds to it. Outside
the gateway (a model driven directly) nothing collects: :func:`add` says so, and the caller logs
its own line.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_NOTES: ContextVar[list[str] | None] = ContextVar("request_notes", default=None)


@contextmanager
def collecting() -> Iterator[list[str]]:
    """The notes added by this request's handler, for the ``with`` block."""
    notes: list[str] = []
    token = _NOTES.set(notes)
    try:
        yield notes
    finally:
        _NOTES.reset(token)


def add(detail: str) -> bool:
    """Add ``detail`` to the current request's line; False when no gateway collects."""
    notes = _NOTES.get()
    if notes is None:
        return False
    notes.append(detail)
    return True


def suffix(notes: list[str]) -> str:
    """The notes as the end of a log line: each after a space."""
    return "".join(" " + note for note in notes)
