"""The ONNX Runtime backend as the server runs it: ``auto`` serves encoders on it and falls back
to torch, with the reason logged, wherever it cannot (custom code, a dtype other than float32, a
failed export); ``--backend onnx`` refuses to start there instead; bad input gets the same 4xx as
on torch; ``--quantize int8`` runs a quantised export close to the float32 one."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from huggingfaceserver.backends.onnx import OnnxUnavailable
from huggingfaceserver.backends.onnx.encoder import OnnxEncoder
from huggingfaceserver.backends.onnx.store import ExportStore
from huggingfaceserver.cli import parse_args
from huggingfaceserver.errors import StartupError
from huggingfaceserver.loading import load_source
from tests.backends.pytorch.test_encoder import custom_code_model  # noqa: F401 - a fixture
from tests.harness import client_for, load_model

TEXTS = ["the capital of france is paris .", "john lives in new york"]


class FailingStore(ExportStore):
    """An export that fails, as one of an unsupported model does."""

    def __init__(self) -> None:
        super().__init__(None)

    def open(self, source, spec, trust_remote_code, use):  # type: ignore[override]
        raise OnnxUnavailable("torch.onnx.export failed: an operator it cannot export")


def encoder_for(path: Path, *flags: str, fallback: bool, store: ExportStore) -> OnnxEncoder:
    config = parse_args(["--model_dir", str(path), *flags])
    backend = OnnxEncoder(
        load_source(config),
        config,
        fallback=fallback,
        store=store,
        backend=config.backend if config.backend in ("onnx", "openvino") else "onnx",
    )
    backend.load()
    return backend


async def test_auto_serves_encoders_on_onnx_runtime(tiny_models):
    model = load_model(["--model_dir", str(tiny_models["bert_sequence_classification"])])
    assert model.backend.name == "onnx"
    assert model.backend.session is not None


async def test_auto_falls_back_to_torch_when_the_export_fails(tiny_models, caplog):
    path = tiny_models["bert_sequence_classification"]
    with caplog.at_level(logging.WARNING):
        backend = encoder_for(path, fallback=True, store=FailingStore())
    assert (backend.name, backend.session) == ("huggingface", None)
    assert "an operator it cannot export" in caplog.text
    assert "running it on torch" in caplog.text
    onnx = encoder_for(path, fallback=True, store=ExportStore(None))
    assert onnx.session is not None
    assert await backend.infer(TEXTS) == await onnx.infer(TEXTS)
    backend.shutdown()
    onnx.shutdown()


def test_backend_onnx_refuses_to_start_when_the_export_fails(tiny_models):
    with pytest.raises(StartupError, match="--backend onnx: .*cannot export"):
        encoder_for(tiny_models["bert_embedding"], fallback=False, store=FailingStore())


@pytest.mark.parametrize(
    ("flags", "reason"),
    [
        (["--dtype", "bfloat16"], "--dtype bfloat16: the export runs in float32"),
        (["--trust_remote_code"], "custom model code"),
    ],
)
def test_auto_runs_on_torch_where_onnx_does_not_apply(custom_code_model, flags, reason, caplog):  # noqa: F811
    with caplog.at_level(logging.WARNING):
        model = load_model(["--model_dir", str(custom_code_model), "--trust_remote_code", *flags])
    assert model.backend.name == "huggingface"
    assert reason in caplog.text


def test_backend_onnx_with_another_dtype_is_a_startup_error(tiny_models):
    with pytest.raises(StartupError, match="float32"):
        load_model(
            [
                "--model_dir",
                str(tiny_models["bert_embedding"]),
                "--backend",
                "onnx",
                "--dtype",
                "half",
            ]
        )


@pytest.mark.parametrize(
    ("flags", "match"),
    [(["--dtype", "half"], "float32"), (["--quantize", "int8"], "ONNX Runtime")],
)
def test_openvino_refuses_what_it_does_not_run(tiny_models, flags, match):
    path = str(tiny_models["bert_embedding"])
    with pytest.raises(StartupError, match=match):
        load_model(["--model_dir", path, "--backend", "openvino", *flags])


async def test_openvino_bfloat16_stays_close_to_float32(minilm_path, tmp_path):
    """``--dtype bfloat16``: OpenVINO's bfloat16 inference precision (what it picks itself on
    CPUs with bfloat16 instructions), on the same float32 export."""
    flags = ["--task", "text_embedding", "--backend", "openvino"]
    store = ExportStore(tmp_path)
    half = encoder_for(minilm_path, *flags, "--dtype", "bfloat16", fallback=False, store=store)
    exact = encoder_for(minilm_path, *flags, fallback=False, store=store)
    assert (half.session.precision, exact.session.precision) == ("bf16", "f32")
    assert half.graph.path == exact.graph.path, "one export, two precisions"
    cosines = (np.array(await half.infer(TEXTS)) * np.array(await exact.infer(TEXTS))).sum(axis=1)
    assert cosines.min() >= 0.999
    half.shutdown()
    exact.shutdown()


def test_quantize_needs_the_onnx_backend(tiny_models):
    with pytest.raises(StartupError, match="--quantize int8 .*ONNX"):
        load_model(
            [
                "--model_dir",
                str(tiny_models["bert_embedding"]),
                "--backend",
                "huggingface",
                "--quantize",
                "int8",
            ]
        )


BAD_REQUESTS = [
    ("bert_fill_mask", {"instances": ["no mask here"]}),
    ("bert_fill_mask", {"instances": [[1, 2, 100000]]}),
    ("bert_sequence_classification", {"instances": [[]]}),
]


@pytest.mark.parametrize(("name", "body"), BAD_REQUESTS)
async def test_bad_input_gets_the_same_answer_on_both_runtimes(tiny_models, encoder, name, body):
    answers = []
    for backend in ("onnx", "huggingface"):
        model = encoder(tiny_models[name], "--backend", backend)
        async with client_for(model) as client:
            response = await client.post(f"/v1/models/{model.name}:predict", json=body)
        answers.append((response.status_code, response.json()))
    assert answers[0] == answers[1]
    assert 400 <= answers[0][0] < 500


async def test_int8_embeddings_stay_close_to_float32(minilm_path, tmp_path):
    flags = ["--task", "text_embedding", "--backend", "onnx"]
    int8 = encoder_for(
        minilm_path, *flags, "--quantize", "int8", fallback=False, store=ExportStore(tmp_path)
    )
    exact = encoder_for(minilm_path, *flags, fallback=False, store=ExportStore(tmp_path))
    quantized = np.array(await int8.infer(TEXTS))
    reference = np.array(await exact.infer(TEXTS))
    cosines = (quantized * reference).sum(axis=1)  # both normalised
    assert cosines.min() >= 0.98
    assert not np.array_equal(quantized, reference), "the int8 graph is another graph"
    int8.shutdown()
    exact.shutdown()


def test_an_export_runs_8_rows_a_batch_unless_told_otherwise(tiny_models):
    path = str(tiny_models["bert_embedding"])

    def rows(*flags: str) -> int:
        return load_model(["--model_dir", path, *flags]).backend.batcher.limits.max_batch_size

    assert rows() == 8
    assert rows("--backend", "openvino") == 8
    assert rows("--max_batch_size", "16") == 16
    assert rows("--backend", "huggingface") == 16
