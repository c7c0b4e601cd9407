"""The GPU benchmark rehearsed on this CPU (``python -m bench --device cuda --rehearse``): the
same runs as on the GPU machine (plain torch in fp32 and fp16, the encoder server in each; eager
and static-cache ``generate``, the generation server at C=1 and C=32; the LoRA adapters' mixed
batch against the base model alone), on the same architectures
a few thousandths the size. A GPU session has minutes; the benchmark must not spend them on a
bug of its own. The figures are the CPU's and say nothing: the test checks that every run
happened, answered without errors, and that issue 32's targets were all checked."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import pytest

from bench.__main__ import parse_args
from bench.gpu import REHEARSAL_SETTINGS, measure_encoder, said
from bench.gpu_models import GpuModels

from .harness import REPO

TARGETS = [
    "gpu encoder fp32: single-text V1 c=256 >= 1.0x plain torch fp32 at its best batch",
    "gpu encoder fp16: single-text V1 c=256 >= 0.8x plain torch fp16 at its best batch",
    "gpu encoder fp32: 16 texts per request c=64 >= 0.8x plain torch fp32 at its best batch",
    "gpu encoder fp16: 16 texts per request c=64 >= 0.8x plain torch fp16 at its best batch",
    "gpu encoder: fp16 at least as fast as fp32, single-text V1, at every concurrency",
    "gpu generation: streamed completions c=32 >= 1.0x eager generate at batch 32",
    "gpu generation: streamed completions c=1 >= 0.9x eager generate at batch 1",
    "gpu generation: streamed completions c=32 >= 0.4x static-cache compiled generate at batch 32",
    "gpu generation: TTFT p50 at c=32 <= 500 ms",
    "LoRA mixed batch vs the base model alone",
]
PLAIN_ROWS = [
    "plain torch fp32, batch 1",
    "plain torch fp16, batch 1",
    "plain generate, batch 1",
    "plain generate, batch 32",
    "plain generate, static cache, batch 32",
]
SERVER_ROWS = [
    *(
        (f"server {dtype}, 1 text per request (V1)", c)
        for dtype in ("fp32", "fp16")
        for c in ("1", "64", "256")
    ),
    ("server fp32, 16 texts per request (V1)", "64"),
    ("server fp16, 16 texts per request (V1)", "64"),
    ("server, streamed completions", "1"),
    ("server, streamed completions", "32"),
    ("base model alone", "16"),
    ("base + 2 adapters, mixed", "16"),
]


def _rows(report: str) -> dict[tuple[str, str], list[str]]:
    """The report's table rows by (configuration, C)."""
    rows = {}
    for line in report.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) > 2 and not set(cells[0]) <= {"-"}:
            rows[(cells[0], cells[1])] = cells
    return rows


@pytest.mark.slow
def test_the_rehearsal_makes_every_run_of_the_gpu_mode_and_checks_every_target(tmp_path):
    report = tmp_path / "gpu-rehearsal.md"
    command = [sys.executable, "-m", "bench", "--device", "cuda", "--rehearse"]
    command += ["--cache", str(tmp_path / "cache"), "--output", str(report)]
    done = subprocess.run(
        command,
        cwd=REPO,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    text = report.read_text()
    checked = re.findall(r"^- \*\*(?:PASS|FAIL)\*\* (.+)$", text, re.MULTILINE)
    assert len(checked) == len(TARGETS), checked
    for line, target in zip(checked, TARGETS, strict=True):
        assert line.startswith(f"{target}: "), (line, target)
    assert text.count("REHEARSAL on the CPU") == 3  # every section says what its figures are
    assert "- `backend huggingface: --backend huggingface`" in text  # the server's own word
    assert "- `loaded LlamaForCausalLM (" in text
    for dtype in ("fp32", "fp16"):
        assert f"- {dtype}: `batches of up to " in text
    rows = _rows(text)
    for name in PLAIN_ROWS:
        assert (name, "–") in rows, name
    for key in SERVER_ROWS:
        errors = rows[key][6]
        failed, answered = map(int, errors.split("/"))
        assert failed == 0 and answered > 0, (key, errors)


def test_rehearse_is_for_the_gpu_workloads(capsys):
    with pytest.raises(SystemExit) as exited:
        parse_args(["--rehearse"])
    assert exited.value.code == 2
    assert "--device cuda" in capsys.readouterr().err
    assert parse_args(["--device", "cuda", "--rehearse"]).rehearse


@pytest.mark.parametrize("flag", [("--dtype=float16",), ("--dtype", "float16")])
def test_the_encoder_workload_keeps_its_own_dtypes(tmp_path, flag):
    """It labels its runs fp32 and fp16: a --dtype for every server would make both fp16."""
    settings = dataclasses.replace(REHEARSAL_SETTINGS, server_args=flag)
    with pytest.raises(SystemExit, match="drop --dtype"):
        measure_encoder(GpuModels(tmp_path), settings, tmp_path, "cpu")


def test_the_report_quotes_how_the_server_said_it_runs_the_model():
    log = "\n".join(
        [
            "2026-11-29 12:00:00.000 1 huggingfaceserver.assembly INFO backend huggingface: why",
            "2026-11-29 12:00:00.100 1 huggingfaceserver.server INFO 2 front processes",
            "2026-11-29 12:00:01.000 1 huggingfaceserver.backends.pytorch.generator INFO "
            "decoding up to 256 rows together (...)",
            "2026-11-29 12:00:02.000 1 huggingfaceserver.backends.pytorch.generator INFO "
            "decoding up to 16 rows together (a second load)",
            "2026-11-29 12:00:03.000 1 huggingfaceserver.backends.pytorch.step_graphs WARNING "
            "recording failed (...): eager from now on",
        ]
    )
    assert said(log) == [
        "backend huggingface: why",
        "decoding up to 256 rows together (...)",
        "warning: recording failed (...): eager from now on",
    ]
