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
import json
import logging
import sys
import threading
import time
import warnings
from typing import TextIO

from ..cli import ServerConfig

LOG_FORMAT = "%(asctime)s.%(msecs)03d %(process)s %(name)s %(levelname)s %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"
BATCH_INTERVAL_S = 0.02


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


class JSONFormatter(logging.Formatter):
    """One JSON object per line (``--log_format json``) for log collectors: time (ISO 8601,
    UTC), level, logger, pid, message, the request id where the line has one, and the
    traceback when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        moment = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        entry: dict[str, object] = {
            "time": f"{moment}.{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "pid": record.process,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id is not None:
            entry["request_id"] = request_id
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def formatter(log_format: str = ServerConfig.log_format) -> logging.Formatter:
    if log_format == "json":
        return JSONFormatter()
    return logging.Formatter(LOG_FORMAT, DATE_FORMAT)


def format_every_handler(log_format: str) -> None:
    """Once KServe has configured its loggers: every handler in ``log_format`` (KServe's and
    uvicorn's lines too, so that a collector reads one format)."""
    if log_format != "json":
        return
    names = ["", "kserve", "kserve.trace", "uvicorn", "uvicorn.error", "huggingfaceserver"]
    for name in names:
        for handler in logging.getLogger(name).handlers:
            handler.setFormatter(JSONFormatter())


def configure_logging(log_format: str = ServerConfig.log_format) -> None:
    """Our package's lines on stderr; uvicorn's access lines batched too (see the module)."""
    handler = BatchedStreamHandler(sys.stderr)
    handler.setFormatter(formatter(log_format))
    package_logger = logging.getLogger("huggingfaceserver")
    package_logger.handlers[:] = [handler]
    package_logger.setLevel(logging.INFO)
    package_logger.propagate = False
    # KServe's routes answer with FastAPI's ORJSONResponse, which FastAPI now deprecates:
    # a warning on the first request that the operator can do nothing about.
    warnings.filterwarnings("ignore", message="ORJSONResponse is deprecated")


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


def quiet_access_log() -> None:
    """Once KServe has configured logging: no uvicorn access lines (the gateway writes one
    line per request, with its id and duration)."""
    access = logging.getLogger("uvicorn.access")
    access.handlers[:] = []
    access.propagate = False


def flush_logs() -> None:
    """Write every batched line now (before a last line of our own)."""
    for name in ("huggingfaceserver", "uvicorn.access"):
        for handler in logging.getLogger(name).handlers:
            handler.flush()
