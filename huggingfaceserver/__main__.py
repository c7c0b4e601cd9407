"""``python -m huggingfaceserver``: parse, load, serve. Nothing runs at import."""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping, Sequence
from pathlib import Path

QUIET_RESOURCE_TRACKER = "ignore::UserWarning:multiprocessing.resource_tracker"
"""A warnings filter (``PYTHONWARNINGS``) for multiprocessing's resource tracker only."""


def quiet_resource_tracker(environ: MutableMapping[str, str] = os.environ) -> None:
    """multiprocessing's resource tracker, a process of its own, warns as the server exits
    about the semaphores and shared memory a killed child left (it then removes them): printed
    after our one-line error, the warning would bury it. Its interpreter reads the
    ``PYTHONWARNINGS`` it inherits, to which this adds a filter for that module's warnings."""
    current = [part for part in environ.get("PYTHONWARNINGS", "").split(",") if part]
    if QUIET_RESOURCE_TRACKER not in current:
        environ["PYTHONWARNINGS"] = ",".join([*current, QUIET_RESOURCE_TRACKER])


INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
"""Where inductor keeps its compiled kernels (torch's variable; default: under ``/tmp``). Torch
sets it to its default when its compiler is first imported: it is decided here, before."""


def keep_compiled_kernels(
    compiles: bool, cache_dir: Path | None, environ: MutableMapping[str, str] = os.environ
) -> Path | None:
    """With ``--torch_compile`` (``compiles``), inductor's kernels in the server's cache,
    ``torch-compile/`` (where a mounted volume outlives the pod's ``/tmp``), unless
    ``TORCHINDUCTOR_CACHE_DIR`` says where or there is no cache directory: a start that finds
    them compiles five times faster (BENCHMARKS.md). Child processes inherit it. Returns
    the folder set, None if none was."""
    if not compiles or cache_dir is None or environ.get(INDUCTOR_CACHE_ENV):
        return None
    folder = cache_dir / "torch-compile"
    environ[INDUCTOR_CACHE_ENV] = str(folder)
    return folder


def main(argv: Sequence[str] | None = None) -> int:
    """Run the server; returns the process exit status (2 for bad flags, 1 for startup errors)."""
    from .backends import installed_engine_flag_names
    from .cli import parse_args
    from .errors import EngineDied, ProcessDied, StartupError
    from .observability.logs import configure_logging, flush_logs

    config = parse_args(
        sys.argv[1:] if argv is None else argv, more_engine_flag_names=installed_engine_flag_names
    )
    configure_logging(config.log_format)
    quiet_resource_tracker()  # before any child process or semaphore starts the tracker
    keep_compiled_kernels(config.torch_compile, config.cache_dir)  # before torch is imported
    from .observability.startup import importing

    with importing(freeze=True):
        from .server import serve
    try:
        serve(config)
    except (StartupError, EngineDied, ProcessDied) as exc:  # one line, exit status 1
        flush_logs()
        print(f"huggingfaceserver: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
