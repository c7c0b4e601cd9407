"""``python -m huggingfaceserver``: parse, load, serve. Nothing runs at import."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

LOG_FORMAT = "%(asctime)s.%(msecs)03d %(process)s %(name)s %(levelname)s %(message)s"


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


def configure_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT, "%Y-%m-%d %H:%M:%S"))
    package_logger = logging.getLogger("huggingfaceserver")
    package_logger.handlers[:] = [handler]
    package_logger.setLevel(logging.INFO)
    package_logger.propagate = False
    logging.getLogger("kserve").addFilter(quiet_client_errors)


def stop_resource_tracker() -> None:
    """A dead vLLM engine leaves shared memory behind, and Python's resource tracker warns about
    it when the process exits, after our error line. Stop it first: our line stays the last."""
    from multiprocessing import resource_tracker

    tracker = getattr(resource_tracker, "_resource_tracker", None)
    stop = getattr(tracker, "_stop", None)  # private: checked, and harmless if it is gone
    if callable(stop):
        stop()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the server; returns the process exit status (2 for bad flags, 1 for startup errors)."""
    from .backends import installed_engine_flag_names
    from .cli import parse_args
    from .errors import StartupError

    config = parse_args(
        sys.argv[1:] if argv is None else argv, more_engine_flag_names=installed_engine_flag_names
    )
    configure_logging()
    from .server import serve

    try:
        serve(config)
    except StartupError as exc:
        stop_resource_tracker()
        print(f"huggingfaceserver: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
