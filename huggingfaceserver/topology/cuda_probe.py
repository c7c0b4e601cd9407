"""Whether torch sees a CUDA device, asked in a short-lived child process.

``--api_workers auto`` starts front processes only on a CUDA device, so the supervisor must know
whether there is one; but the supervisor serves nothing itself, and importing torch to ask would
keep libtorch in it for the server's whole life (hundreds of MiB more on a GPU node). The child asks
torch itself (``torch.cuda.is_available()``), with this process's interpreter and environment
(``CUDA_VISIBLE_DEVICES``, ``PYTHONPATH``), so its answer is the one the engine will get; then it
exits and its memory goes back. Where ``/dev`` holds no GPU device node (NVIDIA's ``nvidia0``...,
AMD's ``kfd`` for ROCm builds) torch cannot see one, and nothing is started: a CPU node pays no
second torch import at start.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

PROBE = "import torch; print(int(torch.cuda.is_available()))"
PROBE_TIMEOUT_S = 120.0
"""Importing torch and initialising CUDA's driver takes seconds, far less on a sane node."""


GPU_DEVICE_NODES = ("nvidia[0-9]*", "kfd")
"""``/dev`` entries without which torch sees no CUDA (or ROCm) device."""


def gpu_device_nodes(dev: Path = Path("/dev")) -> bool:
    """Whether ``dev`` holds a GPU device node."""
    return any(any(dev.glob(pattern)) for pattern in GPU_DEVICE_NODES)


def cuda_available(
    python: str = sys.executable,
    timeout_s: float = PROBE_TIMEOUT_S,
    dev: Path = Path("/dev"),
) -> bool:
    """torch's ``cuda.is_available()`` as a child process of ``python`` answers it (False at
    once without a GPU device node in ``dev``); False, with a warning, when the child cannot
    answer."""
    if not gpu_device_nodes(dev):
        return False
    try:
        done = subprocess.run(
            [python, "-c", PROBE],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        logger.warning("cannot ask torch whether there is a CUDA device (%s): assuming none", exc)
        return False
    answer = done.stdout.strip().splitlines()[-1:] if done.returncode == 0 else []
    if answer not in (["0"], ["1"]):
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        logger.warning(
            "cannot ask torch whether there is a CUDA device (exit status %d: %s): assuming none",
            done.returncode,
            last,
        )
        return False
    return answer == ["1"]
