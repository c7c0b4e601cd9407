"""``python -m bench.process_memory [--requests N] -- SERVER ARGS...``: the resident memory of
each process of a ready server, by role.

Starts ``python -m huggingfaceserver SERVER ARGS`` on free ports, waits for readiness, sends
``N`` single-text V1 ``:predict`` requests on new connections (so that the fronts have served
something), then reads ``VmRSS``, ``VmHWM`` and ``Pss`` of every process in the server's family
from ``/proc``, and how long each took from its start to listening (from the server's log). A
process's role comes from what it maps: the server's own process is the
supervisor (or the only process), a child that maps libtorch is the engine, multiprocessing's
fork server is the supervisor's child that the fronts are forked from, and its children are the
fronts (a spawned child that maps no libtorch is a front too; a helper, such as
multiprocessing's resource tracker, is told apart by its command line). Prints a Markdown table
and writes it beside a JSON copy if ``--output`` says.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

import httpx

from . import server

MODEL_NAME_FLAG = "--model_name"
LISTENING = "Application startup complete"
LOG_TIME = "%Y-%m-%d %H:%M:%S.%f"
"""The server log's timestamps (local time, as logging writes them)."""
LOG_TIME_WIDTH = len("2026-01-01 00:00:00.000")


@dataclass
class ProcessMemory:
    pid: int
    role: str
    rss_mib: float
    hwm_mib: float
    pss_mib: float
    """Its proportional share: the pages it shares with others (a forked front's imports)
    counted once over the family, as the pod's memory limit counts them."""
    maps_torch: bool
    listening_s: float | None = None
    """From the process's start to its HTTP server's startup (uvicorn's "Application startup
    complete" in the server's log, which a front reaches once it listens); None if it has none."""


def maps_torch(pid: int) -> bool:
    """Whether the process has libtorch mapped (it imported torch)."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def started_at(pid: int) -> float:
    """When ``pid`` started, in seconds since the epoch (``/proc/PID/stat``'s start time)."""
    fields = server.stat_fields(pid)
    if fields is None:
        raise ProcessLookupError(pid)
    boot = next(
        float(line.split()[1])
        for line in Path("/proc/stat").read_text().splitlines()
        if line.startswith("btime")
    )
    return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def listening_after(pid: int, log: str) -> float | None:
    """Seconds from ``pid``'s start to its "Application startup complete" log line."""
    for line in log.splitlines():
        if f" {pid} " in line and LISTENING in line:
            logged = datetime.strptime(line[:LOG_TIME_WIDTH], LOG_TIME)
            return logged.timestamp() - started_at(pid)
    return None


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _parent(pid: int) -> int:
    fields = server.stat_fields(pid)
    return 0 if fields is None else int(fields[1])


def role(pid: int, root: int, torch_mapped: bool) -> str:
    """supervisor, engine, fork server, front or helper (see the module's docstring)."""
    if pid == root:
        return "supervisor"
    command = _command(pid)
    if "forkserver" in command:  # the fork server, or a front forked from it
        return "fork server" if _parent(pid) == root else "front"
    if "resource_tracker" in command or "spawn_main" not in command:
        return "helper"
    return "engine" if torch_mapped else "front"


def measure(root: int, log: str = "") -> list[ProcessMemory]:
    """Every process of the server's family, the supervisor first (``log``: the server's, for
    when each process listened)."""
    processes = []
    for pid in server.family(root):
        torch_mapped = maps_torch(pid)
        processes.append(
            ProcessMemory(
                pid,
                role(pid, root, torch_mapped),
                server.status_kib(pid, "VmRSS") / 1024,
                server.status_kib(pid, "VmHWM") / 1024,
                server.pss_kib(pid) / 1024,
                torch_mapped,
                listening_after(pid, log),
            )
        )
    return processes


def table(processes: Sequence[ProcessMemory]) -> str:
    """The processes as a Markdown table, with the family's total."""
    lines = [
        "| process | pid | VmRSS MiB | VmHWM MiB | Pss MiB | libtorch mapped | listening s |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in processes:
        listening = "–" if p.listening_s is None else f"{p.listening_s:.2f}"
        lines.append(
            f"| {p.role} | {p.pid} | {p.rss_mib:.0f} | {p.hwm_mib:.0f} | {p.pss_mib:.0f} | "
            f"{'yes' if p.maps_torch else 'no'} | {listening} |"
        )
    rss, pss = sum(p.rss_mib for p in processes), sum(p.pss_mib for p in processes)
    lines.append(f"| all {len(processes)} | – | {rss:.0f} | – | {pss:.0f} | – | – |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.process_memory", description=__doc__)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--output", type=Path, help="write the table here (and .json beside)")
    parser.add_argument("--log", type=Path, default=Path(".cache/bench/logs/process-memory.log"))
    parser.add_argument(
        "--source-tree", type=Path, help="run the server from this tree (another commit's)"
    )
    parser.add_argument("server_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    server_args = [a for a in args.server_args if a != "--"]
    if MODEL_NAME_FLAG not in server_args:
        parser.error(f"the server's arguments must name the model ({MODEL_NAME_FLAG})")
    model = server_args[server_args.index(MODEL_NAME_FLAG) + 1]
    with server.serving(server_args, args.log, args.source_tree) as running:
        for _ in range(args.requests):
            answer = httpx.post(
                f"{running.url}/v1/models/{model}:predict",
                json={"instances": ["The quick brown fox jumps over the lazy dog."]},
                timeout=60,
            )
            answer.raise_for_status()
        processes = measure(running.process.pid, args.log.read_text(errors="replace"))
        text = f"Ready after {running.ready_s:.1f} s.\n\n{table(processes)}\n"
    print(text)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text)
        args.output.with_suffix(".json").write_text(
            json.dumps([asdict(p) for p in processes], indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
