"""Nothing on the transformers path imports vLLM (an optional extra), installed or not."""

from __future__ import annotations

import subprocess
import sys

from tests.harness import REPO

SCRIPT = """
import sys
from huggingfaceserver.cli import parse_args
from huggingfaceserver.assembly import build_model
for path in sys.argv[1:]:
    build_model(parse_args(["--model_dir", path, "--backend", "huggingface"])).load_backend()
assert not [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")], "vllm imported"
print("ok")
"""


def test_serving_every_task_never_imports_vllm(tiny_models):
    paths = [str(tiny_models[name]) for name in ("gpt2", "t5", "bert_fill_mask", "st_cls")]
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, *paths], capture_output=True, text=True, cwd=REPO
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
