"""The transformers backend: --dtype and --trust_remote_code take effect; the CPU thread
calibration stops as soon as its decision is clear."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from huggingfaceserver.backends.transformers import (
    CALIBRATION_ROUNDS,
    MIN_CALIBRATION_ROUNDS,
    MIN_THREAD_SPEEDUP,
    time_thread_counts,
)
from huggingfaceserver.errors import StartupError
from tests.harness import client_for, load_model

TEXTS = ["the capital of france is paris .", "john lives in new york"]

CONFIGURATION = """
from transformers import BertConfig


class TinyCustomConfig(BertConfig):
    model_type = "tiny-custom"
"""

MODELING = """
from transformers import BertForSequenceClassification

from .configuration_tiny import TinyCustomConfig


class TinyCustomForSequenceClassification(BertForSequenceClassification):
    config_class = TinyCustomConfig
"""


@pytest.fixture(scope="module")
def custom_code_model(tiny_models, tmp_path_factory) -> Path:
    """The tiny BERT classifier re-declared as a custom-code architecture (``auto_map``)."""
    path = tmp_path_factory.mktemp("custom") / "model"
    shutil.copytree(tiny_models["bert_sequence_classification"], path)
    (path / "configuration_tiny.py").write_text(CONFIGURATION)
    (path / "modeling_tiny.py").write_text(MODELING)
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "tiny-custom"
    config["architectures"] = ["TinyCustomForSequenceClassification"]
    config["auto_map"] = {
        "AutoConfig": "configuration_tiny.TinyCustomConfig",
        "AutoModelForSequenceClassification": "modeling_tiny.TinyCustomForSequenceClassification",
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


def reference_logits(path: Path) -> torch.Tensor:
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        return model(**tokenizer(TEXTS, padding=True, return_tensors="pt")).logits


async def logits_served(model) -> torch.Tensor:
    async with client_for(model) as client:
        response = await client.post(f"/v1/models/{model.name}:predict", json={"instances": TEXTS})
    assert response.status_code == 200, response.text
    return torch.tensor([list(d.values()) for d in response.json()["predictions"]])


def test_custom_code_needs_trust_remote_code(custom_code_model):
    with pytest.raises(StartupError, match="trust_remote_code"):
        load_model(["--model_dir", str(custom_code_model)])


async def test_trust_remote_code_runs_the_models_own_classes(custom_code_model, tiny_models):
    model = load_model(
        ["--model_dir", str(custom_code_model), "--trust_remote_code", "--return_raw_logits"]
    )
    assert type(model.backend.model).__name__ == "TinyCustomForSequenceClassification"
    want = reference_logits(tiny_models["bert_sequence_classification"])
    assert torch.allclose(await logits_served(model), want, atol=1e-5)


@pytest.mark.parametrize(
    ("flag", "dtype"),
    [("auto", torch.float32), ("float", torch.float32), ("bfloat16", torch.bfloat16)],
)
async def test_dtype_loads_the_weights_in_that_dtype(encoder, tiny_models, flag, dtype):
    path = tiny_models["bert_sequence_classification"]
    model = encoder(path, "--dtype", flag, "--return_raw_logits", "--backend", "huggingface")
    assert next(model.backend.model.parameters()).dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 5e-2
    assert torch.allclose(await logits_served(model), reference_logits(path), atol=tolerance)


class FakeForward:
    """A forward pass whose duration depends on the thread count set, on a fake clock."""

    def __init__(self, seconds_on: dict[int, list[float]]):
        self.seconds_on = {threads: list(times) for threads, times in seconds_on.items()}
        self.now = 0.0
        self.threads = 0
        self.ran_on: list[int] = []

    def set_threads(self, threads: int) -> None:
        self.threads = threads

    def __call__(self) -> None:
        self.ran_on.append(self.threads)
        self.now += self.seconds_on[self.threads].pop(0)

    def clock(self) -> float:
        return self.now


def calibrate(fake: FakeForward):
    return time_thread_counts(fake, 2, set_threads=fake.set_threads, clock=fake.clock)


@pytest.mark.parametrize("one_thread_s", [0.2, 0.1])  # 2x faster on 2 threads; no faster
def test_calibration_stops_after_two_rounds_when_the_answer_is_clear(one_thread_s):
    fake = FakeForward({2: [0.5, 0.1, 0.1, 0.1], 1: [one_thread_s] * 3})
    timings = calibrate(fake)
    assert MIN_CALIBRATION_ROUNDS == 2
    assert fake.ran_on == [2, 2, 1, 2, 1]  # warm-up, then two rounds
    assert (timings.many, timings.one) == pytest.approx((0.1, one_thread_s))


def test_calibration_runs_every_round_near_the_threshold_and_keeps_the_fastest():
    many = [0.5, 0.11, 0.1, 0.12]  # the warm-up's 0.5 s is not counted
    one = [MIN_THREAD_SPEEDUP * 0.1 + 0.01, MIN_THREAD_SPEEDUP * 0.1, 0.2]
    fake = FakeForward({2: many, 1: one})
    timings = calibrate(fake)
    assert fake.ran_on == [2] + [2, 1] * CALIBRATION_ROUNDS
    assert timings.many == pytest.approx(0.1)
    assert timings.one == pytest.approx(MIN_THREAD_SPEEDUP * 0.1)
    assert timings.speedup == pytest.approx(MIN_THREAD_SPEEDUP)


def test_one_disturbed_timing_does_not_decide():
    """Seen in a benchmark: a forward on 2 threads slowed by other work (103 ms for 50-65 ms)
    made the first round say that threads do not pay; the second round, undisturbed, says
    they do."""
    fake = FakeForward({2: [0.5, 0.103, 0.055, 0.06], 1: [0.086, 0.09, 0.09]})
    timings = calibrate(fake)
    assert fake.ran_on == [2, 2, 1, 2, 1]
    assert timings.speedup == pytest.approx(0.086 / 0.055)
    assert timings.speedup >= MIN_THREAD_SPEEDUP
