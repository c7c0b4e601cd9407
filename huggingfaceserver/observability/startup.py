"""Cold start: how long each phase of startup took, logged in one line once the model is ready.

Scale-from-zero and rolling updates wait on it. The phases, in the order they run: imports
(everything imported before the model config is read, plus the model's own code, imported when
the weights load), the Hub download if there is one, config, tokenizer, weights, tune (CPU
thread calibration), gc (freezing the loaded heap) and warm-up (one inference). The total is
counted from the start of the server's process (a front process's: its supervisor's), so what
no phase holds (the interpreter, the servers starting) is in it too. With ``--api_workers``,
each front logs its own line; the model's weights load in the engine process.
"""

from __future__ import annotations

import atexit
import gc
import logging
import multiprocessing
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)

PHASES = ("imports", "download", "config", "tokenizer", "weights", "tune", "gc", "warm-up")


def process_age(pid: int | str = "self") -> float | None:
    """Seconds since process ``pid`` started (Linux: from ``/proc/PID/stat``), else None."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start, since boot
        return time.clock_gettime(time.CLOCK_BOOTTIME) - started
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class StartupTimes:
    """Seconds spent in each phase of startup, added up across the threads that run them."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.logged = False

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Count the ``with`` block's time to phase ``name``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def summary(self, age: float | None) -> str:
        """``startup: imports 3.1 s, config 0.05 s, ..., ready 3.7 s after start``."""
        parts = [
            f"{name} {_seconds(self.seconds[name])}" for name in PHASES if name in self.seconds
        ]
        if age is not None:
            parts.append(f"ready {age:.1f} s after start")
        return "startup: " + ", ".join(parts)

    def log_ready(self) -> None:
        """The summary line, at the first readiness only (a reload is no cold start)."""
        if not self.logged:
            self.logged = True
            logger.info("%s", self.summary(server_age()))


def _seconds(value: float) -> str:
    return f"{value:.2f} s" if value < 1 else f"{value:.1f} s"


STARTUP = StartupTimes()
"""This process's startup (a process starts once)."""


def server_age() -> float | None:
    """Seconds since the server started: this process, or the one that started it (the
    ``--api_workers`` supervisor of a front process)."""
    parent = multiprocessing.parent_process()
    return process_age("self" if parent is None or parent.pid is None else parent.pid)


def imports_done() -> None:
    """Count the time from this process's start to now as imports, once (called as the model
    config is read: until then the process imports, parses flags and sets up logging)."""
    age = process_age()
    if age is not None and "imports" not in STARTUP.seconds:
        STARTUP.add("imports", age)


@contextmanager
def importing(freeze: bool = False) -> Iterator[None]:
    """Imports without the cyclic garbage collector: they create hundreds of thousands of
    objects that live as long as the process, and its passes over them cost about 15% of the
    import time, for nothing. ``freeze``: then move every object out of its way for good
    (``gc.freeze``; the little garbage that imports leave, under 1 MB, goes with them), so that
    the full collection after the model loads scans only what loading made (0.5 s less) - for
    the server's process, not for a library import. The collector is left as it was found."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
            atexit.register(gc.unfreeze)  # collected at exit as before
        if enabled:
            gc.enable()
