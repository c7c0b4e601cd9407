"""What sentence-transformers does to a model's tokenizer: ``do_lower_case``."""

from __future__ import annotations

from typing import Any, cast

from transformers import PreTrainedTokenizerBase

from ..errors import StartupError


def lower_case_texts(tokenizer: PreTrainedTokenizerBase) -> None:
    """sentence-transformers' ``do_lower_case``: a lower-casing normaliser before the
    tokenizer's own (as sentence-transformers 6 sets it up), unless it has one."""
    from tokenizers.normalizers import Lowercase, Sequence

    if not tokenizer.is_fast:
        raise StartupError(
            "the model's sentence-transformers config lower-cases texts (do_lower_case), which "
            "this server does with a fast tokenizer; this one is not"
        )
    backend = tokenizer.backend_tokenizer
    normalizer = backend.normalizer
    steps: list[Any] = [normalizer]
    if isinstance(normalizer, Sequence):
        steps = list(cast(Any, normalizer))
    if any(isinstance(step, Lowercase) for step in steps):
        return
    backend.normalizer = Sequence([Lowercase(), *(step for step in steps if step is not None)])
