"""The transformers backend: --dtype and --trust_remote_code take effect."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from huggingfaceserver.backends.batching import collate
from huggingfaceserver.backends.pytorch.encoder import model_inputs_on
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


def test_the_model_inputs_go_to_the_device_in_one_copy():
    rows = [
        {"input_ids": np.array([2, 7, 9, 3]), "token_type_ids": np.array([0, 0, 1, 1])},
        {"input_ids": np.array([2, 5, 3]), "token_type_ids": np.array([0, 0, 0])},
    ]
    batch = collate(rows, {"input_ids": 0})
    batch["offset_mapping"] = torch.zeros(2, 4, 2, dtype=torch.int64)  # not the model's
    names = {"input_ids", "attention_mask", "token_type_ids", "return_dict"}
    inputs = model_inputs_on(torch.device("cpu"), batch, names)
    assert list(inputs) == ["input_ids", "token_type_ids", "attention_mask"]
    for name, tensor in inputs.items():
        assert tensor.dtype == torch.int64 and torch.equal(tensor, batch[name])
    # views of one tensor, copied once, not the batch's own
    storage = {tensor.untyped_storage().data_ptr() for tensor in inputs.values()}
    assert len(storage) == 1 and storage != {batch["input_ids"].untyped_storage().data_ptr()}
