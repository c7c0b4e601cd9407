"""``python -m bench [--quick] [--only KEY,...] [--output BENCHMARKS.md]``: run and report."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from .workloads import QUICK, WORKLOADS, Settings, Workload

logger = logging.getLogger("bench")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The benchmark's command line."""
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="1 repeat, short runs (smoke test)")
    parser.add_argument("--repeats", type=int, help="repeats per figure (default 3, quick 1)")
    parser.add_argument("--duration", type=float, help="seconds per encoder run (default 10)")
    parser.add_argument(
        "--only", help="comma list of workloads: " + ",".join(w.key for w in WORKLOADS)
    )
    parser.add_argument("--output", type=Path, default=Path("BENCHMARKS.md"))
    parser.add_argument("--cache", type=Path, default=Path(".cache/bench"))
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra flag for every server, repeatable (e.g. --server-arg=--disable_log_requests)",
    )
    return parser.parse_args(argv)


def settings_from(args: argparse.Namespace) -> Settings:
    """The full run's settings (or the quick ones), with the command line's changes."""
    settings = QUICK if args.quick else Settings()
    settings = dataclasses.replace(settings, server_args=tuple(args.server_arg))
    if args.repeats is not None:
        settings = dataclasses.replace(settings, repeats=args.repeats)
    if args.duration is not None:
        settings = dataclasses.replace(settings, duration_s=args.duration)
    return settings


def selected(only: str | None) -> list[Workload]:
    """The workloads named in ``--only`` (all by default), in their usual order."""
    if only is None:
        return list(WORKLOADS)
    keys = set(only.split(","))
    known = {w.key for w in WORKLOADS}
    if keys - known:
        raise SystemExit(f"unknown workloads {sorted(keys - known)}; known: {sorted(known)}")
    return [w for w in WORKLOADS if w.key in keys]


def main(argv: Sequence[str] | None = None) -> int:
    """Build the models, measure every selected workload, write the report."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the readiness polls
    from . import environment, models, report, runner, targets
    from .health import HealthProber

    settings, workloads = settings_from(args), selected(args.only)
    started = time.monotonic()
    prober = HealthProber()  # spawned before torch warms up anything
    try:
        built = models.build_models(args.cache)
        results = [
            runner.measure_workload(w, built, settings, prober, args.cache / "logs")
            for w in workloads
        ]
    finally:
        prober.close()
    checked = targets.evaluate(results)
    command = shlex.join(["python", "-m", "bench", *argv])
    text = report.render(
        results, checked, environment.describe(), command, settings, time.monotonic() - started
    )
    args.output.write_text(text)
    for target in checked:
        logger.info("%s %s: %s", "PASS" if target.passed else "FAIL", target.name, target.detail)
    logger.info("wrote %s in %.1f min", args.output, (time.monotonic() - started) / 60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
