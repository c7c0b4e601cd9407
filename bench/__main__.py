"""``python -m bench [--device cuda [--rehearse]] [--quick] [--only KEY,...] [--output FILE]``:
run and report."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from .suites import Context, Outcome, Suite, for_device
from .workloads import QUICK, Settings

logger = logging.getLogger("bench")
DEFAULT_OUTPUT = {"cpu": Path("BENCHMARKS.md"), "cuda": Path("BENCHMARKS-gpu.md")}
REHEARSAL_OUTPUT = Path(".cache/bench/gpu-rehearsal.md")
"""``--rehearse``'s report: its figures are the CPU's, for no document."""
GPU_REPORT = Path("BENCHMARKS-gpu.md")
"""The GPU figures, taken on a GPU machine; the CPU report carries them as they are."""
DEFAULT_BASELINE = "2bd647e"
"""The server's code before the multi-process work (``--api_workers``)."""


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The benchmark's command line."""
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: the CPU workloads (default); cuda: the GPU workloads, on a GPU machine",
    )
    parser.add_argument(
        "--rehearse",
        action="store_true",
        help="with --device cuda: run the GPU workloads here, on the CPU, with models of the "
        "same architectures a few thousandths the size, once and briefly: every step of the "
        f"GPU run, figures meaningless (report: {REHEARSAL_OUTPUT})",
    )
    parser.add_argument("--quick", action="store_true", help="1 repeat, short runs (smoke test)")
    parser.add_argument(
        "--repeats", type=int, help="repeats per figure (default 3, GPU 2, long_output 2)"
    )
    parser.add_argument("--duration", type=float, help="seconds per encoder run (default 10)")
    parser.add_argument(
        "--only",
        help="comma list of workloads; cpu: "
        + ",".join(s.key for s in for_device("cpu"))
        + "; cuda: "
        + ",".join(s.key for s in for_device("cuda")),
    )
    parser.add_argument(
        "--output", type=Path, help="the report (default BENCHMARKS.md; cuda: BENCHMARKS-gpu.md)"
    )
    parser.add_argument("--cache", type=Path, default=Path(".cache/bench"))
    parser.add_argument(
        "--baseline-ref",
        default=DEFAULT_BASELINE,
        help="overhead and coldstart workloads: the commit whose server is the baseline "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra flag for every server, repeatable (e.g. --server-arg=--disable_log_requests)",
    )
    args = parser.parse_args(argv)
    if args.rehearse and args.device != "cuda":
        parser.error("--rehearse rehearses the GPU workloads: give it with --device cuda")
    return args


def settings_from(args: argparse.Namespace) -> Settings:
    """The full run's settings (or the quick ones) for the device, with the command line's
    changes."""
    if args.rehearse:
        from .gpu import REHEARSAL_SETTINGS

        settings = REHEARSAL_SETTINGS
    elif args.device == "cuda":
        from .gpu import GPU_QUICK, GPU_SETTINGS

        settings = GPU_QUICK if args.quick else GPU_SETTINGS
    else:
        settings = QUICK if args.quick else Settings()
    settings = dataclasses.replace(settings, server_args=tuple(args.server_arg))
    if args.repeats is not None:
        settings = dataclasses.replace(
            settings, repeats=args.repeats, long_output_rounds=args.repeats
        )
    if args.duration is not None:
        settings = dataclasses.replace(settings, duration_s=args.duration)
    return settings


def selected(only: str | None, device: str = "cpu") -> list[Suite]:
    """The workloads named in ``--only`` (all of the device's by default), in their order."""
    suites = for_device(device)
    if only is None:
        return suites
    keys = set(only.split(","))
    known = {s.key for s in suites}
    if keys - known:
        raise SystemExit(
            f"unknown workloads {sorted(keys - known)} for --device {device}; known: "
            f"{sorted(known)}"
        )
    return [s for s in suites if s.key in keys]


def run_all(suites: Sequence[Suite], context: Context) -> tuple[list[Outcome], list[str]]:
    """Every suite that can run here, in order: their outcomes, and a note per skipped one."""
    outcomes, skipped = [], []
    try:
        for suite in suites:
            reason = suite.unavailable(context)
            if reason is not None:
                logger.warning("%s: skipped: %s", suite.key, reason)
                skipped.append(f"{suite.key}: {reason}")
                continue
            logger.info("%s: starting", suite.key)
            outcomes.append(suite.run(context))
    finally:
        context.close()
    return outcomes, skipped


def main(argv: Sequence[str] | None = None) -> int:
    """Build the models, measure every selected workload, write the report."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the readiness polls
    from . import environment, report

    settings, suites = settings_from(args), selected(args.only, args.device)
    output = args.output or (REHEARSAL_OUTPUT if args.rehearse else DEFAULT_OUTPUT[args.device])
    started = time.monotonic()
    context = Context(settings, args.cache.resolve(), args.baseline_ref, args.rehearse)
    outcomes, skipped = run_all(suites, context)
    checked = [target for outcome in outcomes for target in outcome.targets()]
    command = shlex.join(["python", "-m", "bench", *argv])
    text = report.render(
        [outcome.section() for outcome in outcomes],
        checked,
        environment.describe(),
        command,
        settings,
        time.monotonic() - started,
        classic=any(suite.classic for suite in suites),
        skipped=skipped,
    )
    if args.device == "cpu":
        text += report.gpu_appendix(GPU_REPORT)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text)
    for target in checked:
        logger.info("%s %s: %s", "PASS" if target.passed else "FAIL", target.name, target.detail)
    logger.info("wrote %s in %.1f min", output, (time.monotonic() - started) / 60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
