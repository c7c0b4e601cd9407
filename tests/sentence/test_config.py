"""A folder's sentence-transformers configuration, read as sentence-transformers reads it, from
every layout it has published; modules this server does not run are startup errors naming them."""

from __future__ import annotations

import json
import shutil

import pytest

from huggingfaceserver.errors import StartupError
from huggingfaceserver.loading import read_config_json
from huggingfaceserver.sentence.config import (
    Dense,
    LayerNorm,
    Pooling,
    SentenceConfig,
    SpladePooling,
    read_sentence_config,
)
from tests.sentence_models import CROSS_ENCODER_LAYOUTS, LAYOUTS, QWEN_QUERY_PROMPT


def read(path) -> SentenceConfig | None:
    return read_sentence_config(path, read_config_json(path))


def kinds(config: SentenceConfig) -> list[str]:
    return [type(module).__name__ for module in config.modules]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_embedder_with_dense_layers(sentence_models, layout):
    config = read(sentence_models["two_dense", layout])
    assert config is not None and config.model_type == "SentenceTransformer"
    assert kinds(config) == ["Pooling", "Dense", "Dense", "Normalize"]
    pooling, first, second, _ = config.modules
    assert pooling == Pooling(("mean",))
    assert isinstance(first, Dense) and isinstance(second, Dense)
    assert (first.in_features, first.out_features, first.bias, first.activation) == (
        32,
        24,
        False,
        "Identity",
    )
    assert (second.in_features, second.out_features, second.bias, second.activation) == (
        24,
        16,
        True,
        "Tanh",
    )
    weights = {path.name for path in first.folder.iterdir()}
    assert ("pytorch_model.bin" if layout == "st3" else "model.safetensors") in weights


@pytest.mark.parametrize("layout", LAYOUTS)
def test_prompts_lengths_and_similarity(sentence_models, layout):
    config = read(sentence_models["cls_dense_tanh", layout])
    assert config is not None
    assert config.prompts == {"query": "query: ", "document": ""}
    assert config.default_prompt_name == "query"
    # 2.x-3.x keep it in sentence_bert_config.json; 6.x in the tokenizer's model_max_length
    assert config.max_seq_length == (64 if layout == "st3" else None)
    assert config.similarity == "cosine"
    assert read(sentence_models["dot_gelu", layout]).similarity == "dot"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_pooling_mode_and_module(sentence_models, layout):
    expected = {
        "weightedmean": ("weightedmean",),
        "max_nonorm": ("max",),
        "mean_sqrt_len": ("mean_sqrt_len_tokens",),
        "cls_mean_concat": ("cls", "mean"),
        "lasttoken_layernorm": ("lasttoken",),
        "qwen3_lasttoken": ("lasttoken",),
    }
    for name, modes in expected.items():
        config = read(sentence_models[name, layout])
        assert config is not None and config.pooling == Pooling(modes), name
    layer_norm = read(sentence_models["lasttoken_layernorm", layout])
    assert [type(m) for m in layer_norm.modules] == [Pooling, LayerNorm]
    instructor = read(sentence_models["instructor", layout])
    assert instructor.excludes_prompt and instructor.default_prompt_name == "query"
    qwen = read(sentence_models["qwen3_lasttoken", layout])
    assert qwen.prompts["query"] == QWEN_QUERY_PROMPT


def test_lower_casing_where_the_layout_keeps_it(sentence_models):
    assert read(sentence_models["lowercase", "st3"]).do_lower_case
    # sentence-transformers 6.2 does not save it (its reload does not lower-case either)
    assert not read(sentence_models["lowercase", "st6"]).do_lower_case


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    ("name", "strategy", "activation"),
    [
        ("splade_max", "max", "relu"),
        ("splade_sum_log1p", "sum", "log1p_relu"),
        ("splade_transformer", "max", "relu"),
    ],
)
def test_sparse_encoders(sentence_models, layout, name, strategy, activation):
    config = read(sentence_models[name, layout])
    assert config is not None and config.model_type == "SparseEncoder" and config.is_sparse
    assert config.modules == (SpladePooling(strategy, activation),)


@pytest.mark.parametrize("layout", CROSS_ENCODER_LAYOUTS)
def test_cross_encoders_and_their_activation(sentence_models, layout):
    tanh = read(sentence_models["ce_tanh", layout])
    assert tanh is not None and tanh.is_cross_encoder and tanh.activation_fn == "Tanh"
    default = read(sentence_models["ce_default", layout])
    if layout == "st3":  # sentence-transformers < 4 saved no activation: its default applies
        assert default is None
    else:
        assert default is not None and default.activation_fn == "Sigmoid"


def test_a_plain_transformers_folder_has_none(tiny_models):
    assert read(tiny_models["bert_sequence_classification"]) is None
    assert read(tiny_models["bert_embedding"]) is None


@pytest.mark.parametrize(
    ("name", "named"),
    [
        ("asym", "sentence_transformers.models.Asym"),
        ("router", "sentence_transformers.base.modules.router.Router"),
        ("clip", "sentence_transformers.models.CLIPModel"),
        ("custom_module", "my_package.pooling.CustomPooling"),
        ("custom_dense_activation", "my_package.activations.Swish"),
        ("static_embedding", "sentence_transformers.models.StaticEmbedding"),
    ],
)
def test_modules_it_does_not_run_are_named(sentence_models, name, named):
    with pytest.raises(StartupError, match=named.replace(".", r"\.")):
        read(sentence_models[name, "unsupported"])


def test_a_pooling_mode_it_does_not_know(sentence_models, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(sentence_models["mean_norm_short", "st6"], folder)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "median"}))
    with pytest.raises(StartupError, match="pooling mode 'median'"):
        read(folder)


def test_a_default_prompt_name_it_does_not_have(sentence_models, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(sentence_models["mean_norm_short", "st6"], folder)
    settings = json.loads((folder / "config_sentence_transformers.json").read_text())
    settings["default_prompt_name"] = "missing"
    (folder / "config_sentence_transformers.json").write_text(json.dumps(settings))
    with pytest.raises(StartupError, match="default_prompt_name 'missing'"):
        read(folder)
