"""The tiny Llama's tokenizer and its grammars, shared by the modules that constrain rows."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from huggingfaceserver.generation.constraints import Grammars


@pytest.fixture(scope="module")
def tokenizer(tiny_models: dict[str, Path]):
    return AutoTokenizer.from_pretrained(tiny_models["llama"])


@pytest.fixture(scope="module")
def grammars(tokenizer) -> Grammars:
    return Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
