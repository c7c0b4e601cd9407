"""``python -m huggingfaceserver``: parse, load, serve. Nothing runs at import."""

from __future__ import annotations

import sys
from collections.abc import Sequence


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
    from .logs import configure_logging, flush_logs

    config = parse_args(
        sys.argv[1:] if argv is None else argv, more_engine_flag_names=installed_engine_flag_names
    )
    configure_logging(config.log_format)
    from .startup import importing

    with importing(freeze=True):
        from .server import serve
    try:
        serve(config)
    except StartupError as exc:
        stop_resource_tracker()
        flush_logs()
        print(f"huggingfaceserver: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
