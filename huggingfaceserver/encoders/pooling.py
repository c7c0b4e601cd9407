"""Sentence embedding pooling, following the model's sentence-transformers configuration."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import StartupError

if TYPE_CHECKING:
    import torch

TRANSFORMER_MODULE = "sentence_transformers.models.Transformer"
POOLING_MODULE = "sentence_transformers.models.Pooling"
NORMALIZE_MODULE = "sentence_transformers.models.Normalize"
# 1_Pooling/config.json key -> the pooling it turns on
POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_lasttoken": "lasttoken",
}


@dataclass(frozen=True)
class PoolingConfig:
    mode: str = "mean"
    normalize: bool = True

    @classmethod
    def from_sentence_transformers(
        cls, path: Path, modules: list[dict[str, Any]] | None
    ) -> PoolingConfig:
        """Mean pooling with L2 normalisation unless ``modules.json`` says otherwise."""
        if modules is None:
            return cls()
        mode = "mean"
        normalize = False
        for module in modules:
            kind = module.get("type", "")
            if kind == POOLING_MODULE:
                mode = _read_pooling_mode(path / module.get("path", ""))
            elif kind == NORMALIZE_MODULE:
                normalize = True
            elif kind != TRANSFORMER_MODULE:
                raise StartupError(
                    f"sentence-transformers module {kind!r} in {path / 'modules.json'} is not "
                    f"supported (supported: Transformer, Pooling, Normalize)"
                )
        return cls(mode, normalize)


def _read_pooling_mode(folder: Path) -> str:
    config_file = folder / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise StartupError(f"cannot read the pooling config {config_file}: {exc}") from None
    enabled = [key for key, on in config.items() if key.startswith("pooling_mode_") and on]
    if len(enabled) != 1 or enabled[0] not in POOLING_KEYS:
        raise StartupError(
            f"pooling config {config_file} must enable exactly one of {', '.join(POOLING_KEYS)}"
            f" (found {', '.join(enabled) or 'none'})"
        )
    return POOLING_KEYS[enabled[0]]


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, config: PoolingConfig) -> torch.Tensor:
    """Pool token states ``[B, S, D]`` into sentence vectors ``[B, D]`` (right-padded input)."""
    import torch  # where the model runs (a front process only reads the configuration)
    import torch.nn.functional as F

    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    if config.mode == "cls":
        pooled = hidden[:, 0]
    elif config.mode == "lasttoken":
        last = attention_mask.sum(dim=1).long() - 1
        pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    elif config.mode == "max":
        pooled = hidden.masked_fill(mask == 0, torch.finfo(hidden.dtype).min).max(dim=1).values
    else:
        summed = (hidden * mask).sum(dim=1)
        counts = mask.sum(dim=1).clamp(min=1e-9)
        pooled = summed / (counts.sqrt() if config.mode == "mean_sqrt_len" else counts)
    return F.normalize(pooled, p=2, dim=1) if config.normalize else pooled
