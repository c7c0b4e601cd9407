"""What the server needs to know of a model besides running it: the context length its config
declares, the size of the weights it loads, the dtype they are stored in, the shape of its
attention (what a KV cache holds per token). Each is computed here and nowhere else
(:attr:`.loading.ModelSource.facts` holds the first three for the served model).

Imports neither torch nor transformers: the supervisor sizes the layout from the weights alone
(:func:`weight_bytes`), and never reads transformers' config.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig

CONTEXT_LENGTH_ATTRIBUTES = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
"""Config attributes that bound the positions a model takes: those vLLM reads (its
``_get_and_verify_max_len``); where several are set, the smallest binds."""

PADDING_OFFSET_POSITIONS: dict[str, int | None] = {
    "roberta": None,
    "roberta-prelayernorm": None,
    "xlm-roberta": None,
    "xlm-roberta-xl": None,
    "camembert": None,
    "data2vec-text": None,
    "ibert": None,
    "longformer": None,
    "luke": None,
    "markuplm": None,
    "xmod": None,
    "mpnet": 1,
}
"""Model types whose position ids begin after the padding id (transformers'
``create_position_ids_from_input_ids``), by that id: None, the config's ``pad_token_id``
(MPNet's is 1 whatever its config says). Of their ``max_position_embeddings``, the first
``padding id + 1`` hold no token (RoBERTa's 514 take 512 tokens)."""

WEIGHT_FORMATS = ((".safetensors",), (".bin", ".pt", ".pth"))
"""Weight files by format, as transformers and vLLM prefer them: safetensors where there are,
else PyTorch's pickles. A folder with both holds the same weights twice and loads one set."""
TRAINING_STATE = frozenset(
    {
        "training_args.bin",
        "optimizer.bin",
        "optimizer.pt",
        "scheduler.pt",
        "scaler.pt",
        "rng_state.pth",
    }
)
"""What a Trainer checkpoint keeps beside the weights (no weights: an optimizer's state is
twice their size), left out as vLLM leaves them out."""
INDEX_SUFFIX = ".index.json"
"""A sharded checkpoint's index (``model.safetensors.index.json``): its ``weight_map`` names
the shards that are loaded (a folder may keep a consolidated copy beside them)."""


@dataclass(frozen=True)
class ModelFacts:
    """What the model's config and folder say of it."""

    context_length: int | None
    """The longest sequence the config declares (:func:`context_length`); None: none (a
    relative-position model, as T5): each backend then has its own default."""
    weight_bytes: int
    """The size of the weight files it loads (:func:`weight_bytes`)."""
    dtype: str | None
    """The dtype its weights are stored in (torch's name: ``bfloat16``); None: not said."""

    @classmethod
    def of(cls, config: PretrainedConfig, folder: Path) -> ModelFacts:
        """The facts of the model whose transformers config is ``config``, in ``folder``."""
        return cls(context_length(config), weight_bytes(folder), stored_dtype(config))


def context_length(config: PretrainedConfig) -> int | None:
    """The smallest of the position limits :data:`CONTEXT_LENGTH_ATTRIBUTES` that the config
    sets, read on its text config (a composite model's language part, else the config
    itself), the positions before the first token taken off where the model has some
    (:data:`PADDING_OFFSET_POSITIONS`); None where it sets none."""
    text = config.get_text_config()
    limits = [getattr(text, name, None) for name in CONTEXT_LENGTH_ATTRIBUTES]
    known = [int(limit) for limit in limits if isinstance(limit, int) and limit > 0]
    positions = getattr(text, "max_position_embeddings", None)
    if text.model_type in PADDING_OFFSET_POSITIONS and isinstance(positions, int):
        pad = PADDING_OFFSET_POSITIONS[text.model_type]
        if pad is None:
            pad = getattr(text, "pad_token_id", None)
        first = pad + 1 if isinstance(pad, int) and pad >= 0 else 2  # RoBERTa's: pad id 1
        known = [limit for limit in known if limit != positions]
        known.append(max(1, positions - first))
    return min(known) if known else None


@dataclass(frozen=True)
class AttentionShape:
    """What a model's KV cache holds per token: keys and values of ``kv_heads`` heads of
    ``head_size`` in each of ``layers`` layers."""

    layers: int
    kv_heads: int
    head_size: int

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_size * dtype_bytes


def attention_shape(text: object) -> AttentionShape | None:
    """The attention of a model's text config (its ``get_text_config()``); None where the
    config does not say it in the usual names."""
    layers = first_int(text, "num_hidden_layers", "n_layer", "num_layers")
    heads = first_int(text, "num_attention_heads", "n_head", "num_heads")
    size = head_size(text)
    if not (layers and heads and size):
        return None
    return AttentionShape(layers, first_int(text, "num_key_value_heads") or heads, size)


def head_size(text: object) -> int | None:
    """The size of an attention head, from a model's text config (None where it does not say)."""
    heads = first_int(text, "num_attention_heads", "n_head", "num_heads")
    if not heads:
        return None
    return first_int(text, "head_dim") or (first_int(text, "hidden_size") or 0) // heads or None


def first_int(config: object, *names: str) -> int | None:
    """The first positive integer among these attributes."""
    values = [v for n in names if isinstance(v := getattr(config, n, None), int) and v > 0]
    return values[0] if values else None


def stored_dtype(config: PretrainedConfig) -> str | None:
    """The dtype of the stored weights (``dtype`` in ``config.json``, ``torch_dtype`` in older
    ones: transformers reads both into ``dtype``), by torch's name."""
    return str(getattr(config, "dtype", None) or "").removeprefix("torch.") or None


def weight_bytes(folder: Path) -> int:
    """The size of the weight files loaded from ``folder``: its safetensors files where it has
    some, else its ``.bin``, ``.pt`` and ``.pth`` files (a Trainer's :data:`TRAINING_STATE` left
    out); of a sharded checkpoint, the shards its index names. 0: no weight files."""
    for suffixes in WEIGHT_FORMATS:
        files = [path for path in folder.iterdir() if path.name.endswith(suffixes)]
        files = [path for path in files if path.is_file() and path.name not in TRAINING_STATE]
        if files:
            indexed = indexed_shards(folder, suffixes)
            files = [path for path in files if path.name in indexed] or files
            return sum(path.stat().st_size for path in files)
    return 0


def indexed_shards(folder: Path, suffixes: tuple[str, ...]) -> set[str]:
    """The shard files that the folder's indexes for these formats name (empty: no readable
    index; an index none of whose shards is there is ignored by :func:`weight_bytes`)."""
    names: set[str] = set()
    for suffix in suffixes:
        for index in folder.glob(f"*{suffix}{INDEX_SUFFIX}"):
            try:
                data = json.loads(index.read_text())
            except (OSError, UnicodeDecodeError, ValueError):
                continue
            weight_map = data.get("weight_map") if isinstance(data, dict) else None
            if isinstance(weight_map, dict):
                names.update(str(name) for name in weight_map.values())
    return names
