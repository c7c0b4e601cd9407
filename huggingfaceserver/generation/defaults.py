"""A model's own sampling defaults: what its ``generation_config.json`` sets (Qwen2.5-Instruct:
temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.05), applied to a request that leaves
them out, as vLLM's OpenAI server applies them (``ModelConfig.get_diff_sampling_param``): on
both backends alike, since this server makes the sampling parameters itself.

vLLM's flags choose them: ``--generation-config auto`` (the default: the model's folder),
``vllm`` (none: the neutral defaults), or a folder holding a ``generation_config.json``; and
``--override-generation-config '{"temperature": 0.5}'`` sets some over those. Read as JSON: a
front process imports no transformers.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import StartupError

logger = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"
FIELDS = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "repetition_penalty": float,
    "max_new_tokens": int,
}
"""The sampling settings vLLM takes from a generation config, and their types."""


@dataclass(frozen=True)
class SamplingDefaults:
    """The defaults of a request's sampling settings (None: the neutral one)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None
    """``max_new_tokens``: the answer's length where the request gives none."""

    @classmethod
    def of(cls, values: dict[str, Any]) -> SamplingDefaults:
        """From a generation config's settings (other keys ignored, wrong types refused)."""
        kept: dict[str, Any] = {}
        for name, kind in FIELDS.items():
            value = values.get(name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise StartupError(f"generation config: {name} must be a number, got {value!r}")
            kept["max_tokens" if name == "max_new_tokens" else name] = kind(value)
        return cls(**kept)

    @property
    def given(self) -> dict[str, float | int]:
        return {name: value for name, value in vars(self).items() if value is not None}


NO_DEFAULTS = SamplingDefaults()
"""Every setting's neutral default (vLLM's ``--generation-config vllm``)."""


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise StartupError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise StartupError(f"{path} is not a JSON object")
    return data


def sampling_defaults(
    folder: Path, source: str = "auto", overrides: str = "{}"
) -> SamplingDefaults:
    """The defaults the model's folder (or ``--generation-config``'s ``source``) and
    ``--override-generation-config``'s ``overrides`` set, logged where there are any."""
    values: dict[str, Any] = {}
    if source != "vllm":
        values = read_json((folder if source == "auto" else Path(source)) / GENERATION_CONFIG)
    try:
        override = json.loads(overrides)
    except ValueError:
        raise StartupError(f"--override-generation-config: not JSON: {overrides!r}") from None
    if not isinstance(override, dict):
        raise StartupError(f"--override-generation-config: not a JSON object: {overrides!r}")
    defaults = SamplingDefaults.of({**values, **override})
    if defaults.given:
        logger.info(
            "sampling defaults from the model's generation config (where a request gives none; "
            "--generation-config vllm for none): %s",
            ", ".join(f"{name}={value}" for name, value in defaults.given.items()),
        )
    return defaults
