"""The export cache: a second start reads what the first built; a changed model, spec or
library version is a miss; a damaged entry (record, size, a graph ONNX Runtime refuses) is built
again and mended; an unwritable cache costs only the export; a folder's own ``onnx/model.onnx``
is used when it fits and checks out, and skipped when it does not; where the cache is."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest

from huggingfaceserver.backends.onnx import OnnxUnavailable
from huggingfaceserver.backends.onnx.export import GraphSpec
from huggingfaceserver.backends.onnx.session import OnnxSession
from huggingfaceserver.backends.onnx.store import (
    CACHE_ENV,
    GRAPH_FILE,
    RECORD_FILE,
    ExportStore,
    StoredGraph,
    cache_dir,
    export_key,
    library_versions,
)
from huggingfaceserver.cli import parse_args
from huggingfaceserver.loading import ModelSource, load_source

SPEC = GraphSpec(
    "AutoModelForSequenceClassification",
    ("input_ids", "token_type_ids", "attention_mask"),
    "logits",
)


@pytest.fixture
def model(tiny_models, tmp_path) -> Path:
    """A private copy of the tiny classifier (tests change its files)."""
    path = tmp_path / "model"
    shutil.copytree(tiny_models["bert_sequence_classification"], path)
    return path


def source_of(path: Path) -> ModelSource:
    return load_source(parse_args(["--model_dir", str(path)]))


def loaded(graph: StoredGraph) -> StoredGraph:
    """What the encoder does with a stored graph: load it (OnnxUnavailable if it cannot)."""
    OnnxSession.load(str(graph.path), "logits", threads=1)
    return graph


def open_graph(store: ExportStore, path: Path, spec: GraphSpec = SPEC) -> StoredGraph:
    return store.open(source_of(path), spec, False, loaded)


def entries(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if not p.name.startswith("."))


def test_the_second_open_reads_the_first_ones_export(model, tmp_path):
    store = ExportStore(tmp_path / "cache")
    first = open_graph(store, model)
    second = open_graph(store, model)
    assert (first.origin, second.origin) == ("built", "cache")
    assert first.path == second.path
    assert entries(tmp_path / "cache") == [first.path.parent]
    record = json.loads((first.path.parent / RECORD_FILE).read_text())
    assert record["files"] == {GRAPH_FILE: first.path.stat().st_size}
    assert record["libraries"] == library_versions()
    assert record["built"]["max_difference"] < 1e-4
    assert not list((tmp_path / "cache").glob(".*")), "no temporary folder is left behind"


@pytest.mark.parametrize(
    "change",
    [
        lambda path: (path / "config.json").write_text(
            (path / "config.json")
            .read_text()
            .replace('"num_hidden_layers": 2', '"num_hidden_layers": 1')
        ),
        lambda path: (path / "model.safetensors").write_bytes(
            (path / "model.safetensors").read_bytes()[:-4] + b"\0\0\0\0"
        ),
    ],
    ids=["config", "weights"],
)
def test_a_changed_model_is_exported_again(model, tmp_path, change):
    store = ExportStore(tmp_path / "cache")
    first = open_graph(store, model)
    change(model)
    second = open_graph(store, model)
    assert second.origin == "built"
    assert second.path != first.path


def test_the_key_follows_the_spec_and_the_library_versions(model):
    source = source_of(model)
    versions = library_versions()
    key = export_key(source, SPEC, versions)
    assert key == export_key(source, SPEC, dict(versions))
    assert key != export_key(source, dataclasses.replace(SPEC, quantize="int8"), versions)
    assert key != export_key(source, SPEC, {**versions, "onnxruntime": "0.0.1"})
    (model / "tokenizer_config.json").write_text("{}")  # the tokenizer is not in the graph
    assert key == export_key(source, SPEC, versions)


@pytest.mark.parametrize(
    "damage",
    [
        lambda folder: (folder / RECORD_FILE).write_text("{not json"),
        lambda folder: (folder / RECORD_FILE).unlink(),
        lambda folder: (folder / GRAPH_FILE).write_bytes((folder / GRAPH_FILE).read_bytes()[:100]),
        # the same size, but not a graph: only ONNX Runtime can tell
        lambda folder: (folder / GRAPH_FILE).write_bytes(
            b"\xff" * (folder / GRAPH_FILE).stat().st_size
        ),
    ],
    ids=["record-unreadable", "record-missing", "graph-truncated", "graph-garbage"],
)
def test_a_damaged_entry_is_built_again_and_mended(model, tmp_path, damage):
    store = ExportStore(tmp_path / "cache")
    first = open_graph(store, model)
    damage(first.path.parent)
    again = open_graph(store, model)
    assert again.origin == "built"
    assert again.path == first.path
    assert open_graph(store, model).origin == "cache"


def test_an_unwritable_cache_costs_only_the_export(model, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    store = ExportStore(blocker / "onnx")
    graph = open_graph(store, model)
    assert graph.origin == "built, not stored"
    assert not graph.path.exists(), "the temporary export is removed once loaded"
    assert open_graph(ExportStore(None), model).origin == "built, not stored"


def test_an_export_stored_by_another_start_first_is_used(model, tmp_path):
    store = ExportStore(tmp_path / "cache")
    first = open_graph(store, model)
    source = source_of(model)
    again = store.build_into_store(source, SPEC, False, first.path.parent.name)
    assert again == first.path.parent
    assert store.read(again) is not None
    assert not list((tmp_path / "cache").glob(".*"))


def test_the_folders_own_export_is_used_when_it_checks_out(model, tmp_path):
    exported = open_graph(ExportStore(tmp_path / "cache"), model)
    (model / "onnx").mkdir()
    shutil.copy(exported.path, model / "onnx" / "model.onnx")
    graph = open_graph(ExportStore(tmp_path / "other"), model)
    assert graph.record["built"]["origin"] == "onnx/model.onnx"


def test_a_foreign_or_broken_shipped_file_is_skipped_for_an_export(model, tmp_path):
    (model / "onnx").mkdir()
    (model / "onnx" / "model.onnx").write_bytes(b"not onnx at all")
    graph = open_graph(ExportStore(tmp_path / "cache"), model)
    assert graph.record["built"]["origin"] == "export"


def test_a_graph_that_does_not_load_is_unavailable(tmp_path):
    (tmp_path / "bad.onnx").write_bytes(b"nothing")
    with pytest.raises(OnnxUnavailable, match="cannot load"):
        OnnxSession.load(str(tmp_path / "bad.onnx"), "logits")


def test_a_shipped_graph_that_differs_from_the_weights_is_skipped_for_an_export(model, tmp_path):
    """A folder whose onnx/model.onnx was exported from other weights (a stale export)."""
    stale = open_graph(ExportStore(tmp_path / "cache"), model)
    (model / "onnx").mkdir()
    shutil.copy(stale.path, model / "onnx" / "model.onnx")
    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-4000:] = bytes(4000)  # the last tensors' values zeroed: other outputs
    weights.write_bytes(bytes(data))
    graph = open_graph(ExportStore(tmp_path / "other"), model)
    assert graph.record["built"]["origin"] == "export"


def test_where_the_cache_is(monkeypatch):
    assert cache_dir({CACHE_ENV: "/volume/cache"}) == Path("/volume/cache")
    assert cache_dir({"XDG_CACHE_HOME": "/xdg"}) == Path("/xdg/huggingfaceserver")
    assert cache_dir({}) == Path.home() / ".cache" / "huggingfaceserver"
    monkeypatch.setattr(os.path, "expanduser", lambda path: path)  # no HOME, no passwd entry
    assert cache_dir({}) is None
