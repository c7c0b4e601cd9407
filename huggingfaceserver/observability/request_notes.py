"""What a handler adds to its request's one log line; the gateway writes the line.

The gateway opens a note for each request before its handler runs (the handler's task inherits
the context, so both see the same list); a handler that describes its inputs adds to it. Outside
the gateway (a model driven directly) nothing collects: :func:`add` says so, and the caller logs
its own line.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
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


def preview(texts: Sequence[str], limit: int) -> str:
    """``repr(texts)`` cut to ``limit`` characters (none for 0), then the texts' whole length
    when cut: ``['the quick brow... (16777216 characters, 16 shown)``.

    Built from the first characters of the first texts only: its cost is bounded by
    ``limit``, never by the size of the inputs (a 16 MiB body must not cost a 16 MiB repr).
    """
    limit = max(limit, 0)
    parts = ["["]
    size = 1
    for index, text in enumerate(texts):
        if size > limit:
            break
        # a slice one character longer than the room left shows whether it overflows
        part = (", " if index else "") + repr(text[: limit - size + 1])
        parts.append(part)
        size += len(part)
    else:
        parts.append("]")
        size += 1
    shown = "".join(parts)
    if size <= limit:
        return shown
    chars = sum(len(text) for text in texts)
    return f"{shown[:limit]}... ({chars} characters, {limit} shown)"
