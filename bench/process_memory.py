"""``python -m bench.process_memory [--requests N] -- SERVER ARGS...``: the resident memory of
each process of a ready server, by role.

Starts ``python -m huggingfaceserver SERVER ARGS`` on free ports, waits for readiness, sends
``N`` single-text V1 ``:predict`` requests on new connections (so that the fronts have served
something), then reads ``VmRSS`` and ``VmHWM`` of every process in the server's family from
``/proc``. A process's role comes from what it maps: the server's own process is the
supervisor (or the only process), a child that maps libtorch is the engine, a child that does
not is a front (or a helper, such as multiprocessing's resource tracker, told apart by its
command line). Prints a Markdown table and writes it beside a JSON copy if ``--output`` says.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from . import server

MODEL_NAME_FLAG = "--model_name"


@dataclass
class ProcessMemory:
    pid: int
    role: str
    rss_mib: float
    hwm_mib: float
    maps_torch: bool


def maps_torch(pid: int) -> bool:
    """Whether the process has libtorch mapped (it imported torch)."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def role(pid: int, root: int, torch_mapped: bool) -> str:
    """supervisor, engine, front or helper (see the module's docstring)."""
    if pid == root:
        return "supervisor"
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        command = ""
    if "resource_tracker" in command or "spawn_main" not in command:
        return "helper"
    return "engine" if torch_mapped else "front"


def measure(root: int) -> list[ProcessMemory]:
    """Every process of the server's family, the supervisor first."""
    processes = []
    for pid in server.family(root):
        torch_mapped = maps_torch(pid)
        processes.append(
            ProcessMemory(
                pid,
                role(pid, root, torch_mapped),
                server.status_kib(pid, "VmRSS") / 1024,
                server.status_kib(pid, "VmHWM") / 1024,
                torch_mapped,
            )
        )
    return processes


def table(processes: Sequence[ProcessMemory]) -> str:
    """The processes as a Markdown table, with the family's total."""
    lines = [
        "| process | pid | VmRSS MiB | VmHWM MiB | libtorch mapped |",
        "|---|---|---|---|---|",
    ]
    for p in processes:
        lines.append(
            f"| {p.role} | {p.pid} | {p.rss_mib:.0f} | {p.hwm_mib:.0f} | "
            f"{'yes' if p.maps_torch else 'no'} |"
        )
    total = sum(p.rss_mib for p in processes)
    lines.append(f"| all {len(processes)} | – | {total:.0f} | – | – |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.process_memory", description=__doc__)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--output", type=Path, help="write the table here (and .json beside)")
    parser.add_argument("--log", type=Path, default=Path(".cache/bench/logs/process-memory.log"))
    parser.add_argument("server_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    server_args = [a for a in args.server_args if a != "--"]
    if MODEL_NAME_FLAG not in server_args:
        parser.error(f"the server's arguments must name the model ({MODEL_NAME_FLAG})")
    model = server_args[server_args.index(MODEL_NAME_FLAG) + 1]
    with server.serving(server_args, args.log) as running:
        for _ in range(args.requests):
            answer = httpx.post(
                f"{running.url}/v1/models/{model}:predict",
                json={"instances": ["The quick brown fox jumps over the lazy dog."]},
                timeout=60,
            )
            answer.raise_for_status()
        processes = measure(running.process.pid)
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
