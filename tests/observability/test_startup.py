"""Cold start: an encoder server imports only what serves it; the startup line's phases."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import time

import pytest

from huggingfaceserver.observability import startup
from huggingfaceserver.observability.startup import StartupTimes, importing, process_age
from tests.harness import REPO

NOT_FOR_ENCODERS = (
    "vllm",
    "openai",
    "kserve.protocol.rest.openai",
    "huggingfaceserver.backends.pytorch.generator",
    "huggingfaceserver.backends.pytorch.decode_loop",
    "huggingfaceserver.topology.engine.client",
    "huggingfaceserver.protocols.openai.serving_chat",
    "huggingfaceserver.protocols.openai.serving_completions",
    "huggingfaceserver.protocols.openai.serving_responses",
    "huggingfaceserver.protocols.openai.responses",
)
"""Modules that serving an encoder does not need: each costs startup time (vLLM's and the
openai SDK's seconds) or memory."""

HANDLERS = [
    "huggingfaceserver.protocols.openai.serving_chat",
    "huggingfaceserver.protocols.openai.serving_completions",
    "huggingfaceserver.protocols.openai.serving_responses",
]
"""The generation routes' handlers, imported when a generation model's routes are mounted."""

SCRIPT = """
import json, sys
from tests.harness import build_app, load_model

def loaded(prefixes):
    return sorted(m for m in sys.modules if any(m == p or m.startswith(p + ".") for p in prefixes))

prefixes, encoder, generator = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
HANDLERS = json.loads(sys.argv[4])
build_app(load_model(["--model_dir", encoder, "--backend", "huggingface"]))
after_encoder = loaded(prefixes)
from huggingfaceserver.cli import parse_args
from huggingfaceserver.assembly import build_model
build_app(build_model(parse_args(["--model_dir", generator, "--backend", "huggingface"])))
print(json.dumps([after_encoder, loaded(HANDLERS)]))
"""


@pytest.fixture(scope="module")
def imported(tiny_models) -> list[list[str]]:
    """In a fresh interpreter: the unwanted modules loaded once an encoder is loaded and its
    routes mounted; then whether a generation model's routes import its handlers."""
    paths = [str(tiny_models["st_cls"]), str(tiny_models["gpt2"])]
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(NOT_FOR_ENCODERS), *paths, json.dumps(HANDLERS)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    answer: list[list[str]] = json.loads(result.stdout.strip().splitlines()[-1])
    return answer


def test_an_encoder_imports_neither_vllm_nor_openai_nor_generation_code(imported):
    assert imported[0] == []


def test_a_generation_model_imports_its_handlers_before_serving(imported):
    assert imported[1] == sorted(HANDLERS)


AGE_SCRIPT = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("startup", sys.argv[1])
startup = importlib.util.module_from_spec(spec)
spec.loader.exec_module(startup)
print(startup.process_age())
"""


def test_process_age_counts_from_the_process_start():
    """A child's age, when it prints it, lies between 0 and the time since it was started."""
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", AGE_SCRIPT, startup.__file__], capture_output=True, text=True
    )
    elapsed = time.monotonic() - started
    age = float(done.stdout)
    assert 0 < age <= elapsed + 0.02  # the kernel counts in 10 ms ticks
    assert process_age() is not None


def test_summary_lists_the_phases_in_order_and_the_total():
    times = StartupTimes()
    times.add("warm-up", 0.123)
    times.add("imports", 2.5)
    times.add("imports", 0.8)  # the model's own code, imported when it loads
    with times.phase("config"):
        pass
    line = times.summary(4.0)
    assert line.startswith("startup: imports 3.3 s, config 0.00 s, warm-up 0.12 s, ")
    assert line.endswith(", ready 4.0 s after start")
    assert times.summary(None).endswith("warm-up 0.12 s")


def test_importing_pauses_the_collector_and_restores_its_state():
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    with importing():
        assert not gc.isenabled()
        made = [[] for _ in range(1000)]
    assert gc.isenabled()
    assert gc.get_freeze_count() == frozen  # a library import freezes nothing
    assert made
    gc.disable()
    try:
        with importing():
            pass
        assert not gc.isenabled()  # left as it was
    finally:
        gc.enable()


def test_importing_with_freeze_moves_what_exists_out_of_the_collectors_way():
    before = gc.get_freeze_count()
    with importing(freeze=True):
        made = [[] for _ in range(1000)]
    assert gc.get_freeze_count() >= before + len(made)
    assert gc.isenabled()
