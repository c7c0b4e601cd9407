"""Loaded generation backends, shared within a test module."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from huggingfaceserver.backends.pytorch.generator import TransformersGenerator

from .generation_helpers import load


@pytest.fixture(scope="module")
def backends(tiny_models: dict[str, Path]) -> Iterator[Callable[..., TransformersGenerator]]:
    """``backends(name, sharp=False)``: a loaded backend per tiny model, shared in the module.

    ``sharp`` multiplies the weight matrices by 20: the random tiny GPT-2 and T5 otherwise
    repeat one token greedily, which would make "equals model.generate" a weak check.
    """
    cache: dict[tuple[str, bool], TransformersGenerator] = {}

    def get(name: str, sharp: bool = False) -> TransformersGenerator:
        if (name, sharp) not in cache:
            backend = load(tiny_models[name])
            if sharp:
                with torch.no_grad():
                    for weight in backend.model.parameters():
                        if weight.dim() > 1:
                            weight.mul_(20)
            cache[name, sharp] = backend
        return cache[name, sharp]

    yield get
    for backend in cache.values():
        backend.shutdown()
