"""The vLLM tier: the vLLM backend on vLLM's CPU build, as a user starts the server.

Every module here is marked ``vllm`` and skips when vLLM is not installed; the ones that start
servers are also ``slow``. A vLLM engine start costs about 20 s on a CPU, so each module shares
one server per configuration. The helpers below import nothing from vLLM.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

# Small and quick on a CPU: no torch.compile, a 128-token context, 8 sequences at once.
VLLM_FLAGS = ["--enforce-eager", "--max-model-len", "128", "--max-num-seqs", "8"]


def vllm_env(root: Path) -> dict[str, str]:
    """Environment for a vLLM server: a 1 GiB KV cache, caches and IPC sockets under ``root``."""
    rpc = root / "rpc"
    rpc.mkdir(parents=True, exist_ok=True)
    return {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CACHE_ROOT": str(root / "vllm-cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor-cache"),
        "VLLM_RPC_BASE_PATH": str(rpc),
    }


@dataclass(frozen=True)
class Proc:
    """A process, told apart from a later one that reuses its pid by its start time."""

    pid: int
    start_time: int
    cmdline: str

    def alive(self) -> bool:
        stat = _stat(self.pid)
        return stat is not None and stat[1] == self.start_time and stat[0] != "Z"


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, start time, parent pid) from /proc/PID/stat; None once the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # the command name may hold spaces and ")"
    return fields[0], int(fields[19]), int(fields[1])


def descendants(root_pid: int) -> list[Proc]:
    """Every process below ``root_pid`` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            children.setdefault(stat[2], []).append(int(entry.name))
    found, todo = [], [root_pid]
    while todo:
        for pid in children.get(todo.pop(), []):
            stat = _stat(pid)
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if stat is not None:
                found.append(Proc(pid, stat[1], cmdline.decode(errors="replace").strip()))
                todo.append(pid)
    return found


def wait_until(condition: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    """Poll ``condition`` until it holds or ``timeout`` seconds pass; whether it held."""
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def status(url: str) -> int | None:
    """The HTTP status of ``GET url``; None when nothing answers."""
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return None
