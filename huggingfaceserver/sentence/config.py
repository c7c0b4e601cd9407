"""A folder's sentence-transformers configuration, read as sentence-transformers 6.2 reads it.

The published layouts:

- **2.x-3.x** (most Hub models): ``modules.json`` names ``sentence_transformers.models.<Class>``;
  ``1_Pooling/config.json`` has a ``pooling_mode_*`` boolean per mode; ``sentence_bert_config.json``
  has ``max_seq_length`` and ``do_lower_case``; ``config_sentence_transformers.json`` (3.x) has
  ``prompts``, ``default_prompt_name`` and ``similarity_fn_name``.
- **5.x sparse encoders**: ``sentence_transformers.sparse_encoder.models.<Class>``.
- **6.x**: each module by its module path (``sentence_transformers.base.modules.dense.Dense``);
  pooling as ``pooling_mode`` (a name or a list); the maximum length in the saved tokenizer's
  ``model_max_length``; ``model_type`` in ``config_sentence_transformers.json``.
- **cross-encoders**: no ``modules.json`` before 6.x; the activation in ``config.json``, as
  ``sbert_ce_default_activation_function`` (< 4.0) or ``sentence_transformers.activation_fn``
  (4.x-5.x), or in ``config_sentence_transformers.json`` (6.x).

A module this server does not run (``Router``/``Asym``, ``CLIPModel``, static embeddings, a
module of the model's own code) is a :class:`StartupError` that names it. Pure JSON: no torch,
no sentence-transformers (whose import installs an import hook of its own).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import StartupError

PACKAGE = "sentence_transformers."
MODULES_FILE = "modules.json"
SETTINGS_FILE = "config_sentence_transformers.json"
TRANSFORMER_FILES = (
    "sentence_bert_config.json",
    "sentence_roberta_config.json",
    "sentence_distilbert_config.json",
    "sentence_camembert_config.json",
    "sentence_albert_config.json",
    "sentence_xlm-roberta_config.json",
    "sentence_xlnet_config.json",
)
"""Where the Transformer module's settings are, the first that exists (as sentence-transformers
looks for them)."""

POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
"""sentence-transformers' pooling modes, in the order it concatenates them."""
LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
"""2.x-5.x pooling configs: a boolean per mode."""
SPLADE_STRATEGIES = ("max", "sum")
SPLADE_ACTIVATIONS = ("relu", "log1p_relu")
SIMILARITY_FUNCTIONS = ("cosine", "dot", "euclidean", "manhattan")
TRANSFORMER_TASKS = {
    "feature-extraction": "SentenceTransformer",
    "fill-mask": "SparseEncoder",
    "sequence-classification": "CrossEncoder",
}
"""The Transformer module's tasks this server runs, and the model type each goes with."""
DEFAULT_DENSE_ACTIVATION = "torch.nn.modules.activation.Tanh"
SENTENCE_EMBEDDING = "sentence_embedding"
"""The feature the modules after pooling read and write (others: multi-vector models)."""


@dataclass(frozen=True)
class Pooling:
    """Token states to one vector per text: the modes' vectors, concatenated in this order."""

    modes: tuple[str, ...] = ("mean",)
    include_prompt: bool = True
    """False: a prompt's tokens are left out of the pooling (Instructor-style models)."""


@dataclass(frozen=True)
class Dense:
    """A linear layer and its activation (``torch.nn`` class name), weights in ``folder``."""

    folder: Path
    in_features: int
    out_features: int
    bias: bool = True
    activation: str = "Tanh"
    residual: bool = False
    """Adds the input (projected without bias when the sizes differ) to the output."""


@dataclass(frozen=True)
class LayerNorm:
    folder: Path
    dimension: int


@dataclass(frozen=True)
class Normalize:
    """L2 normalisation."""


@dataclass(frozen=True)
class Dropout:
    """Nothing at inference."""


@dataclass(frozen=True)
class SpladePooling:
    """Masked-LM logits to one vocabulary-sized sparse vector: ``log(1 + relu(x))`` (twice
    for ``log1p_relu``), then the max or the sum over the tokens."""

    strategy: str = "max"
    activation: str = "relu"


Module = Pooling | Dense | LayerNorm | Normalize | Dropout | SpladePooling


@dataclass(frozen=True)
class SentenceConfig:
    """What sentence-transformers makes of a folder, for serving it."""

    model_type: str
    """``SentenceTransformer``, ``SparseEncoder`` or ``CrossEncoder``."""
    modules: tuple[Module, ...] = ()
    """The modules after the transformer, in order."""
    max_seq_length: int | None = None
    """Where the layout keeps it apart from the tokenizer (2.x-5.x ``sentence_bert_config``)."""
    do_lower_case: bool = False
    """Lower-case texts before tokenizing (on top of what the tokenizer does)."""
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    similarity_fn_name: str | None = None
    activation_fn: str | None = None
    """A cross-encoder's activation (``torch.nn`` class name); None: its default (sigmoid for
    one label, identity for more)."""

    @property
    def pooling(self) -> Pooling | None:
        return next((m for m in self.modules if isinstance(m, Pooling)), None)

    @property
    def excludes_prompt(self) -> bool:
        """Whether pooling leaves a prompt's tokens out."""
        return any(isinstance(m, Pooling) and not m.include_prompt for m in self.modules)

    @property
    def is_sparse(self) -> bool:
        return self.model_type == "SparseEncoder"

    @property
    def is_cross_encoder(self) -> bool:
        return self.model_type == "CrossEncoder"

    @property
    def similarity(self) -> str:
        """The similarity function embeddings are compared with (sentence-transformers'
        default: cosine)."""
        return self.similarity_fn_name or "cosine"


def pooling_modes(config: SentenceConfig | None) -> tuple[str, ...]:
    """The pooling an embedding model's vectors get: its Pooling module's modes, mean for a
    model saved without sentence-transformers files."""
    pooling = config.pooling if config is not None else None
    return pooling.modes if pooling is not None else ("mean",)


def read_sentence_config(path: Path, model_config: dict[str, Any]) -> SentenceConfig | None:
    """The folder's sentence-transformers configuration (``model_config``: its ``config.json``
    as JSON); None for a folder sentence-transformers did not save (a plain transformers
    model)."""
    settings = _read_json(path / SETTINGS_FILE, optional=True) or {}
    entries = _read_modules(path)
    if entries is None:
        activation = legacy_cross_encoder_activation(model_config)
        if activation is None and "activation_fn" not in settings:
            return None
        activation = settings.get("activation_fn") or activation
        return SentenceConfig(
            "CrossEncoder", activation_fn=_torch_class(activation, "the cross-encoder's activation")
        )
    return _from_modules(path, entries, settings, model_config)


def legacy_cross_encoder_activation(model_config: dict[str, Any]) -> str | None:
    """A cross-encoder's activation as sentence-transformers < 6 kept it in ``config.json``."""
    saved = model_config.get("sentence_transformers")
    if isinstance(saved, dict) and saved.get("activation_fn"):
        return str(saved["activation_fn"])
    legacy = model_config.get("sbert_ce_default_activation_function")
    return str(legacy) if legacy else None


def _from_modules(
    path: Path,
    entries: list[dict[str, Any]],
    settings: dict[str, Any],
    model_config: dict[str, Any],
) -> SentenceConfig:
    first, *rest = entries
    kind = _class_name(first, path)
    if kind not in ("Transformer", "MLMTransformer"):
        raise _unsupported(first, "its first module must be a Transformer")
    folder = path / str(first.get("path") or "")
    if folder != path:
        raise StartupError(
            f"{path / MODULES_FILE}: the Transformer module is in the subfolder "
            f"{first.get('path')!r}; this server serves the model saved at the top of the folder"
        )
    transformer = _transformer_settings(path)
    task = transformer.get("transformer_task") or (
        "fill-mask" if kind == "MLMTransformer" else "feature-extraction"
    )
    if task not in TRANSFORMER_TASKS:
        raise StartupError(
            f"{path}: the Transformer module's task {task!r} is not served (served: "
            f"{', '.join(TRANSFORMER_TASKS)})"
        )
    modules = tuple(_module(entry, path) for entry in rest)
    model_type = settings.get("model_type") or (
        "SparseEncoder"
        if any(isinstance(m, SpladePooling) for m in modules)
        else TRANSFORMER_TASKS[task]
    )
    if model_type not in TRANSFORMER_TASKS.values():
        raise StartupError(f"{path / SETTINGS_FILE}: model_type {model_type!r} is not served")
    activation = None
    if model_type == "CrossEncoder":
        activation = settings.get("activation_fn") or legacy_cross_encoder_activation(model_config)
    config = SentenceConfig(
        model_type,
        modules,
        max_seq_length=_positive_int(transformer.get("max_seq_length")),
        do_lower_case=bool(transformer.get("do_lower_case", False)),
        prompts=_prompts(settings, path),
        default_prompt_name=settings.get("default_prompt_name") or None,
        similarity_fn_name=_similarity(settings, path),
        activation_fn=_torch_class(activation, "the cross-encoder's activation"),
    )
    _check_shape(config, path)
    return config


def _check_shape(config: SentenceConfig, path: Path) -> None:
    """The modules a model type serves: pooling for an embedding model, SPLADE pooling for a
    sparse one, nothing after a cross-encoder's transformer."""
    kinds = {type(m) for m in config.modules} - {Dropout}
    expected = {
        "SentenceTransformer": "a Pooling module",
        "SparseEncoder": "a SpladePooling module",
        "CrossEncoder": "no module after the Transformer",
    }[config.model_type]
    if config.model_type == "SentenceTransformer":
        ok = Pooling in kinds and SpladePooling not in kinds
    elif config.model_type == "SparseEncoder":
        ok = kinds == {SpladePooling}
    else:
        ok = not kinds
    if not ok:
        found = ", ".join(type(m).__name__ for m in config.modules) or "none"
        raise StartupError(
            f"{path / MODULES_FILE}: a {config.model_type} needs {expected} (found: {found})"
        )
    if config.default_prompt_name and config.default_prompt_name not in config.prompts:
        raise StartupError(
            f"{path / SETTINGS_FILE}: default_prompt_name {config.default_prompt_name!r} is not "
            f"one of its prompts ({', '.join(config.prompts) or 'none'})"
        )


def _read_json(file: Path, optional: bool = False) -> Any:
    if optional and not file.is_file():
        return None
    try:
        return json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StartupError(f"cannot read {file}: {exc}") from None


def _read_modules(path: Path) -> list[dict[str, Any]] | None:
    entries = _read_json(path / MODULES_FILE, optional=True)
    if entries is None:
        return None
    if (
        not isinstance(entries, list)
        or not entries
        or not all(isinstance(e, dict) and isinstance(e.get("type"), str) for e in entries)
    ):
        raise StartupError(f"{path / MODULES_FILE} is not a list of modules with their types")
    return sorted(entries, key=lambda entry: entry.get("idx", 0))


def _transformer_settings(path: Path) -> dict[str, Any]:
    for name in TRANSFORMER_FILES:
        settings = _read_json(path / name, optional=True)
        if settings is not None:
            if not isinstance(settings, dict):
                raise StartupError(f"{path / name} is not a JSON object")
            return settings
    return {}


def _class_name(entry: dict[str, Any], path: Path) -> str:
    """The module's class, from its type (``sentence_transformers.models.Dense`` or
    ``sentence_transformers.base.modules.dense.Dense``); custom code is refused."""
    kind = entry["type"]
    if not kind.startswith(PACKAGE):
        raise StartupError(
            f"{path / MODULES_FILE}: module {entry.get('name', '?')} is {kind}, code of the "
            "model's own; this server runs sentence-transformers' Transformer, Pooling, Dense, "
            "Normalize, LayerNorm, Dropout and SpladePooling modules"
        )
    return kind.rsplit(".", 1)[-1]


def _unsupported(entry: dict[str, Any], why: str = "") -> StartupError:
    return StartupError(
        f"sentence-transformers module {entry['type']} is not served{': ' + why if why else ''} "
        "(served: Transformer, Pooling, Dense, Normalize, LayerNorm, Dropout, SpladePooling)"
    )


def _module(entry: dict[str, Any], path: Path) -> Module:
    name = _class_name(entry, path)
    reader = MODULE_READERS.get(name)
    if reader is None:
        raise _unsupported(entry)
    folder = path / str(entry.get("path") or "")
    settings = _read_json(folder / "config.json", optional=True) or {}
    if not isinstance(settings, dict):
        raise StartupError(f"{folder / 'config.json'} is not a JSON object")
    reads = settings.get("module_input_name", SENTENCE_EMBEDDING)
    if reads != SENTENCE_EMBEDDING or settings.get("module_output_name") not in (None, reads):
        raise _unsupported(entry, f"it works on {reads!r}, not on one vector per text")
    return reader(folder, settings)


def _pooling(folder: Path, settings: dict[str, Any]) -> Pooling:
    mode = settings.get("pooling_mode")
    if mode is None:
        modes = tuple(m for key, m in LEGACY_POOLING_KEYS.items() if settings.get(key))
    else:
        modes = (mode,) if isinstance(mode, str) else tuple(mode)
    modes = modes or ("mean",)
    unknown = [m for m in modes if m not in POOLING_MODES]
    if unknown:
        raise StartupError(
            f"{folder / 'config.json'}: pooling mode {unknown[0]!r} is not one of "
            f"{', '.join(POOLING_MODES)}"
        )
    return Pooling(modes, bool(settings.get("include_prompt", True)))


def _dense(folder: Path, settings: dict[str, Any]) -> Dense:
    try:
        in_features, out_features = int(settings["in_features"]), int(settings["out_features"])
    except (KeyError, TypeError, ValueError):
        raise StartupError(
            f"{folder / 'config.json'}: a Dense module needs in_features and out_features"
        ) from None
    activation = settings.get("activation_function", DEFAULT_DENSE_ACTIVATION)
    return Dense(
        folder,
        in_features,
        out_features,
        bool(settings.get("bias", True)),
        _torch_class(activation, f"the activation of {folder}") or "Identity",
        bool(settings.get("use_residual", False)),
    )


def _layer_norm(folder: Path, settings: dict[str, Any]) -> LayerNorm:
    dimension = _positive_int(settings.get("dimension"))
    if dimension is None:
        raise StartupError(f"{folder / 'config.json'}: a LayerNorm module needs its dimension")
    return LayerNorm(folder, dimension)


def _splade(folder: Path, settings: dict[str, Any]) -> SpladePooling:
    strategy = settings.get("pooling_strategy", "max")
    activation = settings.get("activation_function", "relu")
    if strategy not in SPLADE_STRATEGIES or activation not in SPLADE_ACTIVATIONS:
        raise StartupError(
            f"{folder / 'config.json'}: SPLADE pooling {strategy!r} with {activation!r} is not "
            f"served (strategies: {', '.join(SPLADE_STRATEGIES)}; activations: "
            f"{', '.join(SPLADE_ACTIVATIONS)})"
        )
    return SpladePooling(strategy, activation)


MODULE_READERS: dict[str, Callable[[Path, dict[str, Any]], Module]] = {
    "Pooling": _pooling,
    "Dense": _dense,
    "LayerNorm": _layer_norm,
    "Normalize": lambda folder, settings: Normalize(),
    "Dropout": lambda folder, settings: Dropout(),
    "SpladePooling": _splade,
}
"""The modules this server runs after the transformer, by class name."""


def _torch_class(dotted: str | None, what: str) -> str | None:
    """The ``torch.nn`` class a dotted path names (``torch.nn.modules.activation.Tanh`` ->
    ``Tanh``): sentence-transformers loads only torch's without ``trust_remote_code``, and this
    server runs no code of the model's own there."""
    if dotted is None:
        return None
    if not isinstance(dotted, str) or not dotted.startswith("torch.nn."):
        raise StartupError(
            f"{what} is {dotted!r}, not one of torch.nn's modules: code of the model's own is "
            "not run"
        )
    return dotted.rsplit(".", 1)[-1]


def _positive_int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None
    return value


def _prompts(settings: dict[str, Any], path: Path) -> dict[str, str]:
    prompts = settings.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(
        isinstance(k, str) and isinstance(v, str | None) for k, v in prompts.items()
    ):
        raise StartupError(f"{path / SETTINGS_FILE}: prompts is not a map of names to texts")
    return {name: text or "" for name, text in prompts.items()}


def _similarity(settings: dict[str, Any], path: Path) -> str | None:
    name = settings.get("similarity_fn_name")
    if name is not None and name not in SIMILARITY_FUNCTIONS:
        raise StartupError(
            f"{path / SETTINGS_FILE}: similarity_fn_name {name!r} is not one of "
            f"{', '.join(SIMILARITY_FUNCTIONS)}"
        )
    return name
