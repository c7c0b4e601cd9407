"""``python -m huggingfaceserver.backends.onnx``: an image stores the export its server will
read at start."""

from __future__ import annotations

from huggingfaceserver.backends.onnx.__main__ import main
from huggingfaceserver.backends.onnx.store import CACHE_ENV
from tests.harness import load_model


def test_the_prebuilt_export_is_the_one_the_server_reads(
    tiny_models, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    flags = [
        "--model_dir",
        str(tiny_models["bert_token_classification"]),
        "--return_offsets_mapping",
    ]
    assert main(flags) == 0
    built = capsys.readouterr().out.strip()
    assert built.endswith("(built)") and built.startswith(str(tmp_path))
    model = load_model(flags)
    assert model.backend.graph.origin == "cache"
    assert str(model.backend.graph.path) == built.removesuffix(" (built)")


def test_a_generative_model_is_refused(tiny_models, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    assert main(["--model_dir", str(tiny_models["gpt2"])]) == 1
    assert "not an encoder task" in capsys.readouterr().err
