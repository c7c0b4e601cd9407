"""The server's log: our lines, KServe's and uvicorn's, on stderr and stdout.

A request costs two lines when request logging is on (our request line, uvicorn's access
line). Written one ``write`` call each, with the stream flushed per line, they took an eighth
of the event loop's time under load, and every such system call hands the GIL to the
batching threads and waits to get it back. :class:`BatchedStreamHandler` queues the records
and a writer thread formats and writes those of the next few milliseconds together (a line's
time is still the moment it was logged). Warnings and errors, and everything at exit, are
written at once, in order.
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import time
from typing import TextIO

LOG_FORMAT = "%(asctime)s.%(msecs)03d %(process)s %(name)s %(levelname)s %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"
BATCH_INTERVAL_S = 0.02

# KServe's handlers for these client-side answers (4xx, 503 while loading) log a full
# traceback each time: with readiness probes every few seconds that buries the real log.
QUIET_KSERVE_HANDLERS = frozenset(
    {
        "invalid_input_handler",
        "model_not_found_handler",
        "model_not_ready_handler",
        "server_not_ready_handler",
    }
)


def quiet_client_errors(record: logging.LogRecord) -> bool:
    return record.funcName not in QUIET_KSERVE_HANDLERS


class BatchedStreamHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Formats records as they come, writes them to the stream in batches."""

    def __init__(self, stream: TextIO, interval_s: float = BATCH_INTERVAL_S):
        super().__init__(stream)
        self.interval_s = interval_s
        self.pending: list[logging.LogRecord] = []
        self.wake = threading.Event()
        self.writer: threading.Thread | None = None
        atexit.register(self.flush)

    def emit(self, record: logging.LogRecord) -> None:
        """Called with the handler's lock held (``Handler.handle``)."""
        self.pending.append(record)
        if record.levelno >= logging.WARNING:
            self._write()
            return
        if self.writer is None:
            self.writer = threading.Thread(target=self._run, name="log-writer", daemon=True)
            self.writer.start()
        self.wake.set()

    def flush(self) -> None:
        with self.lock:  # type: ignore[union-attr]
            self._write()

    def _write(self) -> None:
        records, self.pending = self.pending, []
        if not records:
            return
        lines = []
        for record in records:
            try:
                lines.append(self.format(record) + self.terminator)
            except Exception:  # logging's own contract: report, never raise
                self.handleError(record)
        try:
            self.stream.write("".join(lines))
            self.stream.flush()
        except (OSError, ValueError):  # a closed stream at exit: nothing to write to
            pass

    def _run(self) -> None:
        while True:
            self.wake.wait()
            self.wake.clear()
            time.sleep(self.interval_s)
            self.flush()


def configure_logging() -> None:
    """Our package's lines on stderr; uvicorn's access lines batched too (see the module)."""
    handler = BatchedStreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT, DATE_FORMAT))
    package_logger = logging.getLogger("huggingfaceserver")
    package_logger.handlers[:] = [handler]
    package_logger.setLevel(logging.INFO)
    package_logger.propagate = False
    logging.getLogger("kserve").addFilter(quiet_client_errors)


def batch_access_log() -> None:
    """Once KServe has configured logging: uvicorn's access lines through a batched handler
    with the same formatter and stream."""
    access = logging.getLogger("uvicorn.access")
    batched: list[logging.Handler] = []
    for handler in access.handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(
            handler, BatchedStreamHandler
        ):
            replacement = BatchedStreamHandler(handler.stream)
            replacement.setFormatter(handler.formatter)
            replacement.setLevel(handler.level)
            batched.append(replacement)
        else:
            batched.append(handler)
    access.handlers[:] = batched


def flush_logs() -> None:
    """Write every batched line now (before a last line of our own)."""
    for name in ("huggingfaceserver", "uvicorn.access"):
        for handler in logging.getLogger(name).handlers:
            handler.flush()
