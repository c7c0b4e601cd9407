"""Tiny, random, deterministic sentence-transformers models, in the folder layouts ST publishes.

Each builder takes ``(out_dir, layout)`` and writes one folder:

- ``"st6"``: saved by sentence-transformers 6.2 itself (``model.save``): ``modules.json`` with the
  6.x type names (``sentence_transformers.base.modules.transformer.Transformer``, ...),
  ``1_Pooling/config.json`` as ``{"embedding_dimension", "pooling_mode", "include_prompt"}``, Dense
  and Normalize configs with ``module_input_name`` / ``module_output_name``, a
  ``sentence_bert_config.json`` with ``transformer_task`` and ``modality_config`` (no
  ``max_seq_length``: 6.2 keeps it as the tokenizer's ``model_max_length``), a README model card,
  ``"use_cache": false`` in ``config.json``.
- ``"st3"``: written by hand the way sentence-transformers 2.x-3.x saved (most Hub models):
  ``sentence_transformers.models.*`` type names, ``pooling_mode_*`` booleans with
  ``word_embedding_dimension``, ``sentence_bert_config.json`` =
  ``{"max_seq_length", "do_lower_case"}`` while the tokenizer's ``model_max_length`` stays
  :data:`~tiny_models.MAX_LENGTH`; SPLADE models get the 5.x layout instead.
- cross-encoders also come as ``"st4"`` (ST 4.x-5.x: no ``modules.json``, the activation in
  ``config.json["sentence_transformers"]``); their ``"st3"`` is ST < 4 (no ``modules.json``, at
  most ``config.json["sbert_ce_default_activation_function"]``).

Both layouts of a model hold identical weights: the backbone is seeded like
:mod:`tiny_models` (with ``initializer_range`` 0.4, so that CLS pooling and cross-encoder
scores vary with the text) and every Dense / LayerNorm is built from its own seed, with random,
non-identity weights. Building twice gives byte-identical files; :func:`build_sentence_models`
builds all 48 folders in 2-5 s, plus about 5 s to import sentence-transformers (which only the
``"st6"`` and ``router`` builds need).
"""

import json
import shutil
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Regex, normalizers, pre_tokenizers, processors
from torch import nn
from transformers import (
    BertForMaskedLM,
    BertForSequenceClassification,
    BertModel,
    Qwen2Tokenizer,
    Qwen3Config,
    Qwen3Model,
)
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from tiny_models import (
    MAX_LENGTH,
    SEED,
    _bert_config,
    _labels,
    _save_model,
    _train_bytelevel_bpe,
    _write_json,
    train_wordpiece_tokenizer,
)

LAYOUTS = ("st6", "st3")
CROSS_ENCODER_LAYOUTS = ("st6", "st4", "st3")
HIDDEN = 32
INITIALIZER_RANGE = 0.4
"""20x BERT's default: with 0.02, CLS pooling gives the same vector for every text."""
QWEN_EOS = "<|endoftext|>"
QWEN_QUERY_PROMPT = (
    "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
)
ST3_VERSIONS = {"sentence_transformers": "3.0.1", "transformers": "4.41.2", "pytorch": "2.3.0"}
ST5_VERSIONS = {"sentence_transformers": "5.0.0", "transformers": "4.53.0", "pytorch": "2.7.1"}
OLD = "sentence_transformers.models."
"""The 2.x-3.x module type prefix, which 6.2 resolves through its deprecated-import aliases."""
POOLING_KEYS = {
    "cls": "pooling_mode_cls_token",
    "mean": "pooling_mode_mean_tokens",
    "max": "pooling_mode_max_tokens",
    "mean_sqrt_len_tokens": "pooling_mode_mean_sqrt_len_tokens",
    "weightedmean": "pooling_mode_weightedmean_tokens",
    "lasttoken": "pooling_mode_lasttoken",
}
"""6.x pooling mode -> the 2.x-3.x boolean key, in the order 2.x-3.x wrote them."""


def _fullname(cls: type) -> str:
    """``torch.nn.modules.activation.Tanh`` for ``nn.Tanh``: how ST names an activation."""
    return f"{cls.__module__}.{cls.__name__}"


def _modules_json(out_dir: Path, modules: list[tuple[str, str]]) -> None:
    """``modules.json`` for ``(path, type)`` pairs."""
    _write_json(
        out_dir / "modules.json",
        [
            {"idx": i, "name": str(i), "path": path, "type": type_}
            for i, (path, type_) in enumerate(modules)
        ],
    )


def _save_weights(state: dict[str, torch.Tensor], folder: Path, file_name: str) -> None:
    """Save a state dict as ``model.safetensors`` or (``torch.save``) ``pytorch_model.bin``."""
    folder.mkdir(parents=True, exist_ok=True)
    state = {key: value.detach().contiguous() for key, value in state.items()}
    if file_name == "model.safetensors":
        save_file(state, folder / file_name)
    else:
        torch.save(state, folder / file_name)


# --- backbones ------------------------------------------------------------------------------


def _build_bert(out_dir: Path, model_class=BertModel, lowercase: bool = True, **config) -> int:
    """A seeded tiny BERT (``model_class``) with a WordPiece tokenizer; returns the vocab size."""
    tokenizer = train_wordpiece_tokenizer(out_dir, lowercase=lowercase)
    bert_config = _bert_config(tokenizer, initializer_range=INITIALIZER_RANGE, **config)
    _save_model(model_class, bert_config, out_dir)
    return len(tokenizer)


def _train_qwen_tokenizer(out_dir: Path) -> Qwen2Tokenizer:
    """A Qwen2Tokenizer (byte-level BPE from :data:`~tiny_models.CORPUS`) like
    Qwen3-Embedding's: its post-processor appends ``<|endoftext|>`` to every text, it pads on the
    left with ``<|endoftext|>``. Normalizer and pre-tokenizer are Qwen2Tokenizer's own (NFC, the
    Qwen split regex), which it rebuilds on load; it keeps the post-processor from tokenizer.json.
    """
    tokenizer = _train_bytelevel_bpe([QWEN_EOS])
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A:0 {QWEN_EOS}:0",
        pair=f"$A:0 {QWEN_EOS}:0 $B:1 {QWEN_EOS}:1",
        special_tokens=[(QWEN_EOS, tokenizer.token_to_id(QWEN_EOS))],
    )
    hf_tokenizer = Qwen2Tokenizer(
        tokenizer_object=tokenizer, model_max_length=MAX_LENGTH, padding_side="left"
    )
    hf_tokenizer.save_pretrained(out_dir)
    return hf_tokenizer


def _build_qwen3(out_dir: Path) -> int:
    """A tiny Qwen3Model (2 layers, 2 heads, 1 kv head, head_dim 16) with a Qwen2Tokenizer."""
    tokenizer = _train_qwen_tokenizer(out_dir)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=MAX_LENGTH,
        initializer_range=INITIALIZER_RANGE,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    _save_model(Qwen3Model, config, out_dir)
    return len(tokenizer)


BACKBONES = {
    "bert": _build_bert,
    "bert_cased": partial(_build_bert, lowercase=False),
    "qwen3": _build_qwen3,
}


# --- embedders ------------------------------------------------------------------------------


@dataclass(frozen=True)
class DenseSpec:
    """One ST Dense layer: ``activation(linear(x))``."""

    in_features: int
    out_features: int
    activation: type[nn.Module] = nn.Tanh
    bias: bool = True


@dataclass(frozen=True)
class EmbedderSpec:
    """A SentenceTransformer: backbone, pooling, then Dense*, LayerNorm?, Normalize?.

    ``similarity_fn_name`` None is ST's default (cosine): "st3" saves ``null`` (as 3.0 did),
    "st6" saves ``"cosine"``. ``st3_weights`` is the file "st3" keeps Dense weights in.
    """

    pooling: tuple[str, ...] = ("mean",)
    dense: tuple[DenseSpec, ...] = ()
    layer_norm: bool = False
    normalize: bool = True
    include_prompt: bool = True
    max_seq_length: int = 32
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    similarity_fn_name: str | None = None
    do_lower_case: bool = False
    backbone: str = "bert"
    st3_weights: str = "model.safetensors"

    @property
    def dimension(self) -> int:
        """The output dimension."""
        return self.dense[-1].out_features if self.dense else HIDDEN * len(self.pooling)


def _dense_state(spec: EmbedderSpec, index: int) -> dict[str, torch.Tensor]:
    """The seeded weights of Dense ``index`` (``linear.weight``, ``linear.bias``): ``nn.Linear``'s
    own random init, given to ST's ``Dense`` as ``init_weight`` / ``init_bias`` in "st6"."""
    dense = spec.dense[index]
    torch.manual_seed(SEED + 1 + index)
    linear = nn.Linear(dense.in_features, dense.out_features, bias=dense.bias)
    return {f"linear.{key}": value for key, value in linear.state_dict().items()}


def _layer_norm_state(dimension: int) -> dict[str, torch.Tensor]:
    """Seeded LayerNorm weights far from the identity (scale in [0.5, 1.5], shift ~ N(0, 0.5))."""
    generator = torch.Generator().manual_seed(SEED + 100)
    return {
        "norm.weight": torch.rand(dimension, generator=generator) + 0.5,
        "norm.bias": torch.randn(dimension, generator=generator) * 0.5,
    }


def _head_paths(spec: EmbedderSpec) -> list[tuple[str, str]]:
    """``(folder, kind)`` of every module after the Transformer, in order."""
    kinds = ["Pooling"] + ["Dense"] * len(spec.dense)
    kinds += ["LayerNorm"] * spec.layer_norm + ["Normalize"] * spec.normalize
    return [(f"{i}_{kind}", kind) for i, kind in enumerate(kinds, start=1)]


def _build_embedder_st6(spec: EmbedderSpec, out_dir: Path) -> None:
    """Build the modules in memory and let sentence-transformers 6.2 save them."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import (
        Dense,
        LayerNorm,
        Normalize,
        Pooling,
        Transformer,
    )

    with tempfile.TemporaryDirectory() as raw:
        BACKBONES[spec.backbone](Path(raw))
        modules = [
            Transformer(raw, max_seq_length=spec.max_seq_length, do_lower_case=spec.do_lower_case),
            Pooling(HIDDEN, list(spec.pooling), include_prompt=spec.include_prompt),
        ]
        for i, dense in enumerate(spec.dense):
            state = _dense_state(spec, i)
            modules.append(
                Dense(
                    dense.in_features,
                    dense.out_features,
                    bias=dense.bias,
                    activation_function=dense.activation(),
                    init_weight=state["linear.weight"],
                    init_bias=state.get("linear.bias"),
                )
            )
        if spec.layer_norm:
            layer_norm = LayerNorm(spec.dimension)
            layer_norm.load_state_dict(_layer_norm_state(spec.dimension))
            modules.append(layer_norm)
        if spec.normalize:
            modules.append(Normalize())
        model = SentenceTransformer(
            modules=modules,
            device="cpu",
            prompts=dict(spec.prompts),
            default_prompt_name=spec.default_prompt_name,
            similarity_fn_name=spec.similarity_fn_name,
        )
        model.save(str(out_dir))


def _st3_pooling_config(pooling: tuple[str, ...], include_prompt: bool) -> dict:
    """``1_Pooling/config.json`` as 2.x-3.x wrote it: one boolean per mode."""
    config = {"word_embedding_dimension": HIDDEN}
    config.update({key: mode in pooling for mode, key in POOLING_KEYS.items()})
    config["include_prompt"] = include_prompt
    return config


def _build_embedder_st3(spec: EmbedderSpec, out_dir: Path) -> None:
    """Write the 2.x-3.x layout by hand around a ``save_pretrained`` backbone."""
    BACKBONES[spec.backbone](out_dir)
    heads = _head_paths(spec)
    _modules_json(out_dir, [("", OLD + "Transformer")] + [(p, OLD + k) for p, k in heads])
    _write_json(
        out_dir / "sentence_bert_config.json",
        {"max_seq_length": spec.max_seq_length, "do_lower_case": spec.do_lower_case},
    )
    _write_json(
        out_dir / "config_sentence_transformers.json",
        {
            "__version__": ST3_VERSIONS,
            "prompts": dict(spec.prompts),
            "default_prompt_name": spec.default_prompt_name,
            "similarity_fn_name": spec.similarity_fn_name,
        },
    )
    dense_index = 0
    for path, kind in heads:
        folder = out_dir / path
        folder.mkdir(parents=True, exist_ok=True)  # Normalize: an empty folder
        if kind == "Pooling":
            _write_json(
                folder / "config.json", _st3_pooling_config(spec.pooling, spec.include_prompt)
            )
        elif kind == "Dense":
            dense = spec.dense[dense_index]
            _write_json(
                folder / "config.json",
                {
                    "in_features": dense.in_features,
                    "out_features": dense.out_features,
                    "bias": dense.bias,
                    "activation_function": _fullname(dense.activation),
                },
            )
            _save_weights(_dense_state(spec, dense_index), folder, spec.st3_weights)
            dense_index += 1
        elif kind == "LayerNorm":
            _write_json(folder / "config.json", {"dimension": spec.dimension})
            _save_weights(_layer_norm_state(spec.dimension), folder, "model.safetensors")


def _build_embedder(spec: EmbedderSpec, out_dir: str | Path, layout: str) -> Path:
    """Build the embedder ``spec`` into ``out_dir`` in ``layout`` (one of :data:`LAYOUTS`)."""
    out_dir = Path(out_dir)
    if layout == "st6":
        _build_embedder_st6(spec, out_dir)
    elif layout == "st3":
        _build_embedder_st3(spec, out_dir)
    else:
        raise ValueError(f"unknown layout: {layout!r}")
    return out_dir


_TANH_16 = DenseSpec(HIDDEN, 16)
EMBEDDER_SPECS = {
    "mean_norm_short": EmbedderSpec(
        max_seq_length=16, prompts={"query": "query: ", "passage": "passage: "}
    ),
    "cls_dense_tanh": EmbedderSpec(
        pooling=("cls",),
        dense=(_TANH_16,),
        max_seq_length=64,
        prompts={"query": "query: ", "document": ""},
        default_prompt_name="query",
    ),
    # embeddinggemma's head: a bias-free projection, then a Tanh one
    "two_dense": EmbedderSpec(
        dense=(DenseSpec(HIDDEN, 24, nn.Identity, bias=False), DenseSpec(24, 16)),
        st3_weights="pytorch_model.bin",
        similarity_fn_name="cosine",
    ),
    "weightedmean": EmbedderSpec(pooling=("weightedmean",)),
    "max_nonorm": EmbedderSpec(pooling=("max",), normalize=False),
    "mean_sqrt_len": EmbedderSpec(pooling=("mean_sqrt_len_tokens",)),
    "cls_mean_concat": EmbedderSpec(pooling=("cls", "mean")),
    "lasttoken_layernorm": EmbedderSpec(pooling=("lasttoken",), layer_norm=True, normalize=False),
    "instructor": EmbedderSpec(
        include_prompt=False,
        prompts={
            "query": "Represent the question for retrieval: ",
            "passage": "Represent the document: ",
        },
        default_prompt_name="query",
    ),
    "lowercase": EmbedderSpec(backbone="bert_cased", do_lower_case=True),
    "dot_gelu": EmbedderSpec(
        dense=(DenseSpec(HIDDEN, HIDDEN, nn.GELU),),
        normalize=False,
        similarity_fn_name="dot",
        st3_weights="pytorch_model.bin",
    ),
    "qwen3_lasttoken": EmbedderSpec(
        pooling=("lasttoken",),
        max_seq_length=64,
        prompts={"query": QWEN_QUERY_PROMPT},
        backbone="qwen3",
    ),
}
"""The embedders' specs. Unless stated, max_seq_length is 32 (the tokenizers' 128 in "st3")."""

EMBEDDERS: dict[str, Callable[[Path, str], Path]] = {
    name: partial(_build_embedder, spec) for name, spec in EMBEDDER_SPECS.items()
}
"""SentenceTransformer builders, ``build(out_dir, layout)``.

``lowercase``: a cased tokenizer with ST's ``do_lower_case`` true. "st3" keeps it in
``sentence_bert_config.json``, which 6.2 still reads (it prepends a ``Lowercase`` normalizer).
ST 6.2 writes no ``do_lower_case`` anywhere but in that normalizer, which goes into
``tokenizer.json``; transformers 5's ``BertTokenizer`` rebuilds its normalizer from
``tokenizer_config.json`` (``"do_lower_case": false``) on load, so the "st6" folder no longer
lower-cases: ST 6.2 gives different vectors for mixed-case text from its own save.
"""


# --- SPLADE ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SparseSpec:
    """A SPLADE SparseEncoder: BertForMaskedLM, then SpladePooling."""

    pooling_strategy: str = "max"
    activation_function: str = "relu"
    module: str = "MLMTransformer"
    """"MLMTransformer" (deprecated since 5.4) or "Transformer" (fill-mask) in "st6"."""
    max_seq_length: int = 64


MLM_BIAS_MEAN = -3.0


def _build_bert_mlm(out_dir: Path) -> int:
    """BertForMaskedLM whose output bias ~ N(-3, 1): with initializer_range 0.4 (logits' std
    about 2.3), relu keeps some but not all of the 367 vocab dimensions: "Paris" has 50
    non-zeros, "The capital of France is Paris." 69, texts cut at 64 tokens about 125."""
    tokenizer = train_wordpiece_tokenizer(out_dir)
    torch.manual_seed(SEED)
    model = BertForMaskedLM(_bert_config(tokenizer, initializer_range=INITIALIZER_RANGE)).eval()
    with torch.no_grad():
        model.cls.predictions.bias.normal_(MLM_BIAS_MEAN, 1.0)
    model.save_pretrained(out_dir)
    return len(tokenizer)


def _build_sparse_st6(spec: SparseSpec, out_dir: Path) -> None:
    """Let sentence-transformers 6.2 save Transformer (or MLMTransformer) + SpladePooling."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import (
        MLMTransformer,
        SpladePooling,
        Transformer,
    )

    with tempfile.TemporaryDirectory() as raw:
        vocab_size = _build_bert_mlm(Path(raw))
        if spec.module == "MLMTransformer":
            transformer = MLMTransformer(raw, max_seq_length=spec.max_seq_length)
        else:
            transformer = Transformer(
                raw, transformer_task="fill-mask", max_seq_length=spec.max_seq_length
            )
        pooling = SpladePooling(
            spec.pooling_strategy, spec.activation_function, embedding_dimension=vocab_size
        )
        with warnings.catch_warnings():  # the model card's example similarity
            warnings.filterwarnings("ignore", "Sparse CSR tensor support", UserWarning)
            SparseEncoder(modules=[transformer, pooling], device="cpu").save(str(out_dir))


def _build_sparse_st5(spec: SparseSpec, out_dir: Path) -> None:
    """The sentence-transformers 5.0-5.3 layout (MLMTransformer, SpladePooling with
    ``word_embedding_dimension``), written by hand."""
    vocab_size = _build_bert_mlm(out_dir)
    _modules_json(
        out_dir,
        [
            ("", "sentence_transformers.sparse_encoder.models.MLMTransformer"),
            ("1_SpladePooling", "sentence_transformers.sparse_encoder.models.SpladePooling"),
        ],
    )
    _write_json(
        out_dir / "1_SpladePooling" / "config.json",
        {
            "pooling_strategy": spec.pooling_strategy,
            "activation_function": spec.activation_function,
            "word_embedding_dimension": vocab_size,
        },
    )
    _write_json(
        out_dir / "sentence_bert_config.json",
        {"max_seq_length": spec.max_seq_length, "do_lower_case": False},
    )
    _write_json(
        out_dir / "config_sentence_transformers.json",
        {
            "model_type": "SparseEncoder",
            "__version__": ST5_VERSIONS,
            "prompts": {"query": "", "document": ""},
            "default_prompt_name": None,
            "similarity_fn_name": "dot",
        },
    )


def _build_sparse(spec: SparseSpec, out_dir: str | Path, layout: str) -> Path:
    """Build the SPLADE model ``spec`` into ``out_dir``: "st6" as 6.2 saves it, "st3" the 5.x
    layout (SparseEncoder first shipped in 5.0)."""
    out_dir = Path(out_dir)
    if layout == "st6":
        _build_sparse_st6(spec, out_dir)
    elif layout == "st3":
        _build_sparse_st5(spec, out_dir)
    else:
        raise ValueError(f"unknown layout: {layout!r}")
    return out_dir


SPARSE_SPECS = {
    "splade_max": SparseSpec(),
    "splade_sum_log1p": SparseSpec(pooling_strategy="sum", activation_function="log1p_relu"),
    "splade_transformer": SparseSpec(module="Transformer"),
}
SPARSE: dict[str, Callable[[Path, str], Path]] = {
    name: partial(_build_sparse, spec) for name, spec in SPARSE_SPECS.items()
}
"""SparseEncoder builders, ``build(out_dir, layout)``.

``splade_transformer`` is 6.2's non-deprecated form, ``Transformer(transformer_task="fill-mask")``
+ SpladePooling, in "st6"; no older release saved that, so its "st3" is the 5.x MLMTransformer
layout, the same folder as ``splade_max``'s "st3".
"""


# --- cross-encoders -------------------------------------------------------------------------


@dataclass(frozen=True)
class CrossEncoderSpec:
    """A CrossEncoder on BertForSequenceClassification. ``activation`` None: ST's default
    (Sigmoid for one label, else Identity), saved by 4.x and later, not by ST < 4."""

    labels: tuple[str, ...] = ()
    activation: type[nn.Module] | None = None

    @property
    def resolved_activation(self) -> type[nn.Module]:
        """The activation ST applies."""
        if self.activation is not None:
            return self.activation
        return nn.Sigmoid if len(self.labels) <= 1 else nn.Identity


def _build_bert_classifier(spec: CrossEncoderSpec, out_dir: Path) -> None:
    """A plain ``save_pretrained`` BertForSequenceClassification (1 label unless ``labels``)."""
    labels = _labels(spec.labels) if spec.labels else {"num_labels": 1}
    _build_bert(out_dir, BertForSequenceClassification, **labels)


def _patch_config(config_path: Path, **entries) -> None:
    """Add ``entries`` to a transformers ``config.json`` (written like transformers does)."""
    config = json.loads(config_path.read_text())
    config.update(entries)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _build_cross_encoder(spec: CrossEncoderSpec, out_dir: str | Path, layout: str) -> Path:
    """Build the cross-encoder ``spec`` into ``out_dir`` in one of :data:`CROSS_ENCODER_LAYOUTS`.

    "st6": saved by 6.2 (one Transformer module with ``transformer_task``
    "sequence-classification"; ``activation_fn`` in config_sentence_transformers.json, always).
    "st4": ``config.json["sentence_transformers"] = {"activation_fn", "version": "4.0.0"}``, always
    (4.x-5.x wrote the resolved activation). "st3": ``config.json`` gets
    ``sbert_ce_default_activation_function`` only for an explicit activation, as ST < 4 did.
    """
    out_dir = Path(out_dir)
    if layout == "st6":
        from sentence_transformers import CrossEncoder

        with tempfile.TemporaryDirectory() as raw:
            _build_bert_classifier(spec, Path(raw))
            activation = spec.activation() if spec.activation else None
            CrossEncoder(raw, device="cpu", activation_fn=activation).save(str(out_dir))
        return out_dir
    _build_bert_classifier(spec, out_dir)
    if layout == "st4":
        entry = {"activation_fn": _fullname(spec.resolved_activation), "version": "4.0.0"}
        _patch_config(out_dir / "config.json", sentence_transformers=entry)
    elif layout == "st3":
        if spec.activation is not None:
            _patch_config(
                out_dir / "config.json",
                sbert_ce_default_activation_function=_fullname(spec.activation),
            )
    else:
        raise ValueError(f"unknown layout: {layout!r}")
    return out_dir


CROSS_ENCODER_SPECS = {
    "ce_default": CrossEncoderSpec(),
    "ce_identity": CrossEncoderSpec(activation=nn.Identity),
    "ce_tanh": CrossEncoderSpec(activation=nn.Tanh),
    "ce_three_labels": CrossEncoderSpec(labels=("contradiction", "entailment", "neutral")),
}
CROSS_ENCODERS: dict[str, Callable[[Path, str], Path]] = {
    name: partial(_build_cross_encoder, spec) for name, spec in CROSS_ENCODER_SPECS.items()
}
"""CrossEncoder builders, ``build(out_dir, layout)`` with a layout of
:data:`CROSS_ENCODER_LAYOUTS`."""


# --- layouts a server without custom code cannot serve --------------------------------------


def _st3_bert_with(out_dir: str | Path, modules: list[tuple[str, str]]) -> Path:
    """A BERT saved in ``out_dir`` plus the 3.x root files for ``modules``, ``(path, type)``
    (``sentence_bert_config.json`` only where one is a Transformer)."""
    out_dir = Path(out_dir)
    _build_bert(out_dir)
    _modules_json(out_dir, modules)
    if any(type_ == OLD + "Transformer" for _, type_ in modules):
        config = {"max_seq_length": 32, "do_lower_case": False}
        _write_json(out_dir / "sentence_bert_config.json", config)
    _write_json(
        out_dir / "config_sentence_transformers.json",
        {
            "__version__": ST3_VERSIONS,
            "prompts": {},
            "default_prompt_name": None,
            "similarity_fn_name": None,
        },
    )
    if any(path == "1_Pooling" for path, _ in modules):
        _write_json(out_dir / "1_Pooling" / "config.json", _st3_pooling_config(("mean",), True))
    return out_dir


def _write_dense(folder: Path, seed: int, activation: str = _fullname(nn.Tanh)) -> None:
    """A 2.x-3.x Dense(32 -> 16) folder with seeded weights."""
    torch.manual_seed(seed)
    linear = nn.Linear(HIDDEN, 16)
    _write_json(
        folder / "config.json",
        {
            "in_features": HIDDEN,
            "out_features": 16,
            "bias": True,
            "activation_function": activation,
        },
    )
    state = {f"linear.{key}": value for key, value in linear.state_dict().items()}
    _save_weights(state, folder, "model.safetensors")


def build_asym(out_dir: str | Path) -> Path:
    """Transformer, Pooling, then an ``Asym`` (2.x-3.x) with a Dense per input type (query/doc):
    ``2_Asym/config.json`` = ``{"types", "structure", "parameters"}``. ST 6.2 loads it as a
    Router; without a task it takes the first route (query)."""
    out_dir = _st3_bert_with(
        out_dir,
        [("", OLD + "Transformer"), ("1_Pooling", OLD + "Pooling"), ("2_Asym", OLD + "Asym")],
    )
    types = {"query_0_Dense": OLD + "Dense", "doc_0_Dense": OLD + "Dense"}
    _write_json(
        out_dir / "2_Asym" / "config.json",
        {
            "types": types,
            "structure": {"query": ["query_0_Dense"], "doc": ["doc_0_Dense"]},
            "parameters": {"allow_empty_key": True},
        },
    )
    for seed, model_id in enumerate(types, start=SEED + 1):
        _write_dense(out_dir / "2_Asym" / model_id, seed)
    return out_dir


def build_router(out_dir: str | Path) -> Path:
    """Transformer, Pooling, a 6.x ``Router`` (query -> Dense, document -> another Dense),
    Normalize, saved by sentence-transformers 6.2 (``2_Router/router_config.json``)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import (
        Dense,
        Normalize,
        Pooling,
        Router,
        Transformer,
    )

    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory() as raw:
        _build_bert(Path(raw))
        routes = {}
        for seed, task in enumerate(("query", "document"), start=SEED + 1):
            torch.manual_seed(seed)
            routes[task] = [Dense(HIDDEN, 16)]
        router = Router(routes, default_route="document")
        modules = [Transformer(raw), Pooling(HIDDEN, "mean"), router, Normalize()]
        SentenceTransformer(modules=modules, device="cpu").save(str(out_dir))
    return out_dir


def build_clip(out_dir: str | Path) -> Path:
    """A BERT in the root that ``modules.json`` declares a ``CLIPModel`` (an image model)."""
    return _st3_bert_with(out_dir, [("", OLD + "CLIPModel")])


def build_custom_module(out_dir: str | Path) -> Path:
    """Transformer then ``my_package.pooling.CustomPooling``: code from outside ST."""
    out_dir = _st3_bert_with(
        out_dir,
        [("", OLD + "Transformer"), ("1_CustomPooling", "my_package.pooling.CustomPooling")],
    )
    _write_json(out_dir / "1_CustomPooling" / "config.json", {"embedding_dimension": HIDDEN})
    return out_dir


def build_custom_dense_activation(out_dir: str | Path) -> Path:
    """Transformer, Pooling, a Dense whose activation is ``my_package.activations.Swish``,
    Normalize. ST 6.2 loads it without ``trust_remote_code`` but (with a warning) puts Tanh in
    place of the activation; with it, it imports ``my_package``."""
    out_dir = _st3_bert_with(
        out_dir,
        [
            ("", OLD + "Transformer"),
            ("1_Pooling", OLD + "Pooling"),
            ("2_Dense", OLD + "Dense"),
            ("3_Normalize", OLD + "Normalize"),
        ],
    )
    _write_dense(out_dir / "2_Dense", SEED + 1, activation="my_package.activations.Swish")
    (out_dir / "3_Normalize").mkdir()
    return out_dir


def build_static_embedding(out_dir: str | Path) -> Path:
    """A ``StaticEmbedding`` (token embeddings averaged, no Transformer) in
    ``0_StaticEmbedding`` (``tokenizer.json`` + ``embedding.weight``), then Normalize, with a
    BERT in the root that ``modules.json`` does not use."""
    out_dir = _st3_bert_with(
        out_dir,
        [
            ("0_StaticEmbedding", OLD + "StaticEmbedding"),
            ("1_Normalize", OLD + "Normalize"),
        ],
    )
    static = out_dir / "0_StaticEmbedding"
    static.mkdir()
    shutil.copy(out_dir / "tokenizer.json", static / "tokenizer.json")
    vocab_size = json.loads((out_dir / "config.json").read_text())["vocab_size"]
    generator = torch.Generator().manual_seed(SEED)
    weights = {"embedding.weight": torch.randn(vocab_size, HIDDEN, generator=generator)}
    _save_weights(weights, static, "model.safetensors")
    (out_dir / "1_Normalize").mkdir()
    return out_dir


UNSUPPORTED: dict[str, Callable[[Path], Path]] = {
    "asym": build_asym,
    "router": build_router,
    "clip": build_clip,
    "custom_module": build_custom_module,
    "custom_dense_activation": build_custom_dense_activation,
    "static_embedding": build_static_embedding,
}
"""Builders ``build(out_dir)`` of folders that ST layouts allow but that need modules other than
Transformer / Pooling / Dense / LayerNorm / Normalize (or code from outside ST), each with a
plain BERT in the root that a server ignoring ``modules.json`` would wrongly serve.

In ST 6.2 (no ``trust_remote_code``): asym, router, static_embedding and custom_dense_activation
(with Tanh) load and encode; clip loads but cannot encode (a BERT has no
``get_text_features``); custom_module is refused (ValueError naming ``trust_remote_code``).
"""


def build_sentence_models(root: str | Path) -> dict[tuple[str, str], Path]:
    """Build every model into ``root/<layout>/<name>`` and return ``{(name, layout): path}``.

    Embedders and SPARSE in :data:`LAYOUTS`, CROSS_ENCODERS in :data:`CROSS_ENCODER_LAYOUTS`,
    UNSUPPORTED under the layout ``"unsupported"``.
    """
    root = Path(root)
    built = {}
    for builders, layouts in (
        (EMBEDDERS, LAYOUTS),
        (SPARSE, LAYOUTS),
        (CROSS_ENCODERS, CROSS_ENCODER_LAYOUTS),
    ):
        for name, build in builders.items():
            for layout in layouts:
                built[name, layout] = build(root / layout / name, layout)
    for name, build in UNSUPPORTED.items():
        built[name, "unsupported"] = build(root / "unsupported" / name)
    return built
