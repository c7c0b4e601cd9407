"""Whether torch sees a CUDA device, asked in a child process: torch's own answer where a GPU
device node exists, no child at all where none does, False with a warning when the child
cannot answer."""

from __future__ import annotations

import logging
import stat
from pathlib import Path

import pytest
import torch

from huggingfaceserver.topology.cuda_probe import cuda_available, gpu_device_nodes


def fake_python(folder: Path, body: str) -> str:
    """An executable that stands in for the interpreter (it ignores ``-c PROBE``)."""
    path = folder / "python"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.fixture
def gpu_dev(tmp_path: Path) -> Path:
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "nvidia0").touch()
    (dev / "nvidiactl").touch()
    return dev


def test_device_nodes(tmp_path: Path, gpu_dev: Path):
    assert gpu_device_nodes(gpu_dev)
    (tmp_path / "rocm").mkdir()
    (tmp_path / "rocm" / "kfd").touch()
    assert gpu_device_nodes(tmp_path / "rocm")
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "nvidiactl").touch()  # the control node alone: no device
    assert not gpu_device_nodes(tmp_path / "cpu")


def test_without_a_device_node_no_child_is_started(tmp_path: Path, caplog):
    marker = tmp_path / "ran"
    python = fake_python(tmp_path, f"touch {marker}; echo 1")
    with caplog.at_level(logging.WARNING):
        assert cuda_available(python, dev=tmp_path) is False
    assert not marker.exists()
    assert not caplog.records


def test_the_answer_is_torchs_own(gpu_dev: Path):
    assert cuda_available(dev=gpu_dev) is torch.cuda.is_available()


def test_a_child_that_sees_a_device(tmp_path: Path, gpu_dev: Path):
    assert cuda_available(fake_python(tmp_path, "echo 1"), dev=gpu_dev) is True
    assert cuda_available(fake_python(tmp_path, "echo 0"), dev=gpu_dev) is False


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ("echo 'ModuleNotFoundError: No module named torch' >&2; exit 1", "No module named torch"),
        ("echo maybe", "exit status 0"),
        ("exec sleep 30", "timed out"),
    ],
    ids=["no-torch", "garbled", "hung"],
)
def test_a_child_that_cannot_answer_means_no_device(
    tmp_path: Path, gpu_dev: Path, caplog, body: str, named: str
):
    with caplog.at_level(logging.WARNING):
        assert cuda_available(fake_python(tmp_path, body), timeout_s=1.0, dev=gpu_dev) is False
    assert named in caplog.text
    assert "assuming none" in caplog.text
