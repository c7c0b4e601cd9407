"""The server raises its soft limit on open files to the hard one at start (each connection is
a file descriptor), seen in a real server process started under a lowered soft limit."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest

from tests.harness import run_server

LOWERED = 1024


def open_files_limits(pid: int) -> tuple[int, int]:
    """(soft, hard) of "Max open files" in ``/proc/PID/limits``."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no open files limit")


def test_a_server_started_under_a_low_soft_limit_raises_it_to_the_hard_one(tiny_models, tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard <= LOWERED:
        pytest.skip(f"the hard limit ({hard}) leaves no room to lower the soft one under it")
    args = ["--model_dir", str(tiny_models["bert_sequence_classification"]), "--model_name", "m"]
    resource.setrlimit(resource.RLIMIT_NOFILE, (LOWERED, hard))  # the server inherits it
    try:
        with run_server(args, tmp_path) as server:
            limits = open_files_limits(server.process.pid)
            log = server.log()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert limits == (hard, hard)
    assert f"open files: soft limit raised from {LOWERED} to the hard limit, {hard}" in log
