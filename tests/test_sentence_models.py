"""The folders of sentence_models.py, checked with sentence-transformers 6.2 itself: each layout of
a model loads, all layouts give the same outputs, and pooling, head, prompts, max_seq_length and
activation are the ones meant."""

import filecmp
import json
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from tests.sentence_models import (
    CROSS_ENCODER_LAYOUTS,
    CROSS_ENCODERS,
    EMBEDDERS,
    LAYOUTS,
    QWEN_QUERY_PROMPT,
    SPARSE,
    UNSUPPORTED,
)
from tiny_models import CORPUS, MAX_LENGTH

sentence_transformers = pytest.importorskip("sentence_transformers")
CrossEncoder = sentence_transformers.CrossEncoder
SentenceTransformer = sentence_transformers.SentenceTransformer
SparseEncoder = sentence_transformers.SparseEncoder

# tokens (BERT / Qwen): 73 / 119, over every max_seq_length but under 128; 489 / 1059
MID_TEXT = " ".join(CORPUS[:7])
LONG_TEXT = " ".join(CORPUS)
TEXTS = ["Paris", "The capital of France is Paris.", "Hello World! How are YOU today?"]
TEXTS += [MID_TEXT, LONG_TEXT]
PAIRS = [
    ("What is the capital of France?", "Paris is the capital and the largest city of France."),
    ("What is the capital of France?", "The cat sat on the mat."),
    ("Who wrote this book?", LONG_TEXT),
]


class Expected(NamedTuple):
    """What an embedder's spec says."""

    dimension: int
    pooling: str | tuple[str, ...]
    max_seq_length: int = 32
    prompts: dict[str, str] = {}
    default_prompt_name: str | None = None
    similarity_fn_name: str = "cosine"
    normalized: bool = True
    include_prompt: bool = True


EXPECTED = {
    "mean_norm_short": Expected(32, "mean", 16, {"query": "query: ", "passage": "passage: "}),
    "cls_dense_tanh": Expected(16, "cls", 64, {"query": "query: ", "document": ""}, "query"),
    "two_dense": Expected(16, "mean"),
    "weightedmean": Expected(32, "weightedmean"),
    "max_nonorm": Expected(32, "max", normalized=False),
    "mean_sqrt_len": Expected(32, "mean_sqrt_len_tokens"),
    "cls_mean_concat": Expected(64, ("cls", "mean")),
    "lasttoken_layernorm": Expected(32, "lasttoken", normalized=False),
    "instructor": Expected(
        32,
        "mean",
        prompts={
            "query": "Represent the question for retrieval: ",
            "passage": "Represent the document: ",
        },
        default_prompt_name="query",
        include_prompt=False,
    ),
    "lowercase": Expected(32, "mean"),
    "dot_gelu": Expected(32, "mean", similarity_fn_name="dot", normalized=False),
    "qwen3_lasttoken": Expected(32, "lasttoken", 64, {"query": QWEN_QUERY_PROMPT}),
}
OLD_POOLING_KEYS = {
    "cls": "pooling_mode_cls_token",
    "mean": "pooling_mode_mean_tokens",
    "max": "pooling_mode_max_tokens",
    "mean_sqrt_len_tokens": "pooling_mode_mean_sqrt_len_tokens",
    "weightedmean": "pooling_mode_weightedmean_tokens",
    "lasttoken": "pooling_mode_lasttoken",
}
SPLADE = {"splade_max": "max", "splade_sum_log1p": "sum", "splade_transformer": "max"}
CROSS_ENCODER_ACTIVATIONS = {
    "ce_default": torch.nn.Sigmoid,
    "ce_identity": torch.nn.Identity,
    "ce_tanh": torch.nn.Tanh,
    "ce_three_labels": torch.nn.Identity,
}


@pytest.fixture(scope="module")
def models(sentence_models) -> dict[tuple[str, str], Path]:
    return sentence_models


@pytest.fixture(scope="module")
def load(models):
    """``load(cls, name, layout)``: the folder loaded with ``cls``, once per module."""
    cache = {}

    def get(cls, name: str, layout: str):
        if (cls, name, layout) not in cache:
            cache[cls, name, layout] = cls(str(models[name, layout]), device="cpu")
        return cache[cls, name, layout]

    return get


def _close(a, b, atol: float = 1e-6) -> bool:
    return torch.allclose(torch.as_tensor(a), torch.as_tensor(b), atol=atol, rtol=0)


def _read(path: Path) -> dict | list:
    return json.loads(path.read_text())


def test_everything_is_built(models):
    assert len(models) == 2 * len(EMBEDDERS) + 2 * len(SPARSE) + 3 * len(CROSS_ENCODERS) + len(
        UNSUPPORTED
    )
    assert set(EXPECTED) == set(EMBEDDERS) and set(SPLADE) == set(SPARSE)
    assert set(CROSS_ENCODER_ACTIVATIONS) == set(CROSS_ENCODERS)


@pytest.mark.parametrize("name", EMBEDDERS)
def test_embedder_folders(models, name):
    """st6 has 6.x module types and max_seq_length as the tokenizer's model_max_length; st3 the
    2.x-3.x types, max_seq_length in sentence_bert_config.json and the tokenizer's 128."""
    expected = EXPECTED[name]
    st6, st3 = models[name, "st6"], models[name, "st3"]
    for module in _read(st6 / "modules.json"):
        assert module["type"].startswith(
            ("sentence_transformers.base.modules.", "sentence_transformers.sentence_transformer.")
        )
    assert "max_seq_length" not in _read(st6 / "sentence_bert_config.json")
    assert _read(st6 / "tokenizer_config.json")["model_max_length"] == expected.max_seq_length
    assert set(_read(st6 / "1_Pooling" / "config.json")) == {
        "embedding_dimension",
        "pooling_mode",
        "include_prompt",
    }

    modules = _read(st3 / "modules.json")
    assert all(module["type"].startswith("sentence_transformers.models.") for module in modules)
    assert all((st3 / module["path"]).is_dir() for module in modules)
    bert_config = _read(st3 / "sentence_bert_config.json")
    assert bert_config == {
        "max_seq_length": expected.max_seq_length,
        "do_lower_case": name == "lowercase",
    }
    assert _read(st3 / "tokenizer_config.json")["model_max_length"] == MAX_LENGTH
    pooling = _read(st3 / "1_Pooling" / "config.json")
    modes = (expected.pooling,) if isinstance(expected.pooling, str) else expected.pooling
    assert pooling == {
        "word_embedding_dimension": 32,
        **{key: mode in modes for mode, key in OLD_POOLING_KEYS.items()},
        "include_prompt": expected.include_prompt,
    }
    versions = _read(st3 / "config_sentence_transformers.json")["__version__"]
    assert versions["sentence_transformers"] == "3.0.1"


@pytest.mark.parametrize("name", EMBEDDERS)
def test_embedder_layouts_agree(load, name):
    expected = EXPECTED[name]
    st6, st3 = (load(SentenceTransformer, name, layout) for layout in LAYOUTS)
    for model in (st6, st3):
        assert model.max_seq_length == expected.max_seq_length
        assert model.prompts == {"query": "", "document": "", **expected.prompts}
        assert model.default_prompt_name == expected.default_prompt_name
        assert model.similarity_fn_name == expected.similarity_fn_name
        assert model.get_embedding_dimension() == expected.dimension
        assert model[1].pooling_mode == expected.pooling
        assert model[1].include_prompt == expected.include_prompt

    texts = [text.lower() for text in TEXTS] if name == "lowercase" else TEXTS
    calls = [{}]
    if expected.prompts:
        calls.append({"prompt_name": "query"})
    for kwargs in calls:
        vectors = st3.encode(texts, convert_to_tensor=True, **kwargs)
        assert vectors.shape == (len(texts), expected.dimension)
        assert _close(st6.encode(texts, convert_to_tensor=True, **kwargs), vectors)
        norms = vectors.norm(dim=1)
        assert _close(norms, torch.ones_like(norms), 1e-5) == expected.normalized
    # the long texts are cut at max_seq_length (not at the tokenizer's 128)
    for text in (MID_TEXT, LONG_TEXT):
        longer = st3.encode([text, text + " and then some more words"], convert_to_tensor=True)
        assert _close(longer[0], longer[1])
    if expected.default_prompt_name:  # applied unless another prompt is asked for
        default = st3.encode(TEXTS, convert_to_tensor=True)
        assert _close(default, st3.encode(TEXTS, prompt_name="query", convert_to_tensor=True))
        assert not _close(default, st3.encode(TEXTS, prompt="", convert_to_tensor=True), 1e-3)


def test_lowercase_is_lost_by_st6(load):
    """do_lower_case survives in st3's sentence_bert_config.json; ST 6.2's own save keeps it only
    in tokenizer.json's normalizer, which BertTokenizer rebuilds from tokenizer_config.json."""
    st6, st3 = (load(SentenceTransformer, "lowercase", layout) for layout in LAYOUTS)
    lower = [text.lower() for text in TEXTS]
    assert _close(st3.encode(TEXTS), st3.encode(lower))
    assert not _close(st6.encode(TEXTS), st6.encode(lower), 1e-3)
    assert st3.tokenizer("Hello World").input_ids == st3.tokenizer("hello world").input_ids
    assert st6.tokenizer("Hello World").input_ids != st6.tokenizer("hello world").input_ids


@pytest.mark.parametrize(("name", "position"), [("lasttoken_layernorm", 2), ("dot_gelu", 2)])
def test_head_layers_change_the_vectors(load, name, position):
    """A server that skipped the Dense or LayerNorm would give clearly different vectors."""
    model = load(SentenceTransformer, name, "st3")
    features = model.preprocess(TEXTS)
    with torch.no_grad():
        for module in list(model)[:position]:
            features = module(features)
        pooled = features["sentence_embedding"].clone()
        head = list(model)[position](features)["sentence_embedding"]
    assert pooled.shape == head.shape
    assert (pooled - head).abs().max() > 0.5


def test_qwen3_left_padding(load):
    for layout in LAYOUTS:
        model = load(SentenceTransformer, "qwen3_lasttoken", layout)
        tokenizer = model.tokenizer
        assert tokenizer.padding_side == "left"
        assert tokenizer("Paris").input_ids[-1] == tokenizer.eos_token_id
        for kwargs in ({}, {"prompt_name": "query"}):
            alone = model.encode(["Paris"], convert_to_tensor=True, **kwargs)[0]
            batch = model.encode(["Paris", MID_TEXT, LONG_TEXT], convert_to_tensor=True, **kwargs)
            assert _close(alone, batch[0], 1e-5)
            assert not _close(batch[0], batch[1], 1e-2)


@pytest.mark.parametrize("name", SPARSE)
def test_sparse_layouts_agree(models, load, name):
    st6_types = [module["type"] for module in _read(models[name, "st6"] / "modules.json")]
    transformer = "Transformer" if name == "splade_transformer" else "MLMTransformer"
    assert st6_types[0].endswith(f".{transformer}") and st6_types[1].endswith(".SpladePooling")
    st3_types = [module["type"] for module in _read(models[name, "st3"] / "modules.json")]
    assert st3_types == [
        "sentence_transformers.sparse_encoder.models.MLMTransformer",
        "sentence_transformers.sparse_encoder.models.SpladePooling",
    ]

    outputs = []
    for layout in LAYOUTS:
        model = load(SparseEncoder, name, layout)
        assert model.max_seq_length == 64
        assert model[1].pooling_strategy == SPLADE[name]
        assert model.similarity_fn_name == "dot"
        outputs.append(model.encode(TEXTS, convert_to_tensor=True).to_dense())
    assert _close(outputs[0], outputs[1])
    vocab_size = outputs[0].shape[1]
    nonzeros = (outputs[0] > 0).sum(dim=1)
    assert ((nonzeros >= 10) & (nonzeros <= vocab_size // 2)).all(), nonzeros


@pytest.mark.parametrize("name", CROSS_ENCODERS)
def test_cross_encoder_layouts_agree(models, load, name):
    """Every layout scores like the activation meant, applied to transformers' own logits."""
    plain = models[name, "st3"]  # a plain transformers folder
    tokenizer = AutoTokenizer.from_pretrained(plain)
    classifier = AutoModelForSequenceClassification.from_pretrained(plain).eval()
    firsts, seconds = zip(*PAIRS, strict=True)
    encoded = tokenizer(
        list(firsts), list(seconds), padding=True, truncation=True, return_tensors="pt"
    )
    with torch.no_grad():
        logits = classifier(**encoded).logits
    activation = CROSS_ENCODER_ACTIVATIONS[name]
    expected = activation()(logits)
    if logits.shape[1] == 1:
        expected = expected[:, 0]
    assert expected.abs().max() > 0.3  # scores far enough from 0 to tell tanh from identity
    assert "modules.json" not in {path.name for path in plain.iterdir()}

    for layout in CROSS_ENCODER_LAYOUTS:
        model = load(CrossEncoder, name, layout)
        assert type(model.activation_fn) is activation, layout
        assert model.num_labels == logits.shape[1]
        scores = model.predict(PAIRS, convert_to_tensor=True)
        assert _close(scores, expected, 1e-5), layout
    if name == "ce_three_labels":
        assert model.config.id2label == {0: "contradiction", 1: "entailment", 2: "neutral"}


@pytest.mark.parametrize("name", UNSUPPORTED)
def test_unsupported_folders(models, name):
    path = models[name, "unsupported"]
    types = [module["type"] for module in _read(path / "modules.json")]
    unsupported = {
        "asym": "sentence_transformers.models.Asym",
        "router": "sentence_transformers.base.modules.router.Router",
        "clip": "sentence_transformers.models.CLIPModel",
        "custom_module": "my_package.pooling.CustomPooling",
        "custom_dense_activation": "sentence_transformers.models.Dense",
        "static_embedding": "sentence_transformers.models.StaticEmbedding",
    }
    assert unsupported[name] in types
    assert _read(path / "config.json")["model_type"] == "bert"
    for module in _read(path / "modules.json"):
        assert (path / module["path"]).is_dir()


def test_custom_code_in_st6(models):
    """ST 6.2 refuses a module class from outside ST, and swaps Tanh in for an untrusted
    activation (with a warning)."""
    with pytest.raises(ValueError, match="trust_remote_code"):
        SentenceTransformer(str(models["custom_module", "unsupported"]), device="cpu")
    model = SentenceTransformer(str(models["custom_dense_activation", "unsupported"]), device="cpu")
    assert type(model[2].activation_function) is torch.nn.Tanh


@pytest.mark.parametrize(
    ("name", "layout"),
    [("two_dense", "st3"), ("cls_dense_tanh", "st6"), ("splade_max", "st6"), ("ce_tanh", "st4")],
)
def test_builds_are_byte_identical(models, tmp_path, name, layout):
    builders = {**EMBEDDERS, **SPARSE, **CROSS_ENCODERS}
    again = builders[name](tmp_path / name, layout)
    comparison = filecmp.dircmp(models[name, layout], again)
    files = [path.relative_to(again) for path in again.rglob("*") if path.is_file()]
    _, mismatch, errors = filecmp.cmpfiles(models[name, layout], again, files, shallow=False)
    assert not comparison.left_only and not comparison.right_only
    assert not mismatch and not errors
