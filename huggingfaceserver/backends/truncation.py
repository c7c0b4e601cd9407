"""How a text is truncated: the server's way (``--max_length``, ``--no_truncation``, the
tokenizer's side), or a request's own (``truncate``, ``truncation_direction``,
``truncate_prompt_tokens``).

Another truncation than the server's is made with public ``tokenizers`` calls on a copy that
does not truncate: the text encoded without special tokens, cut with ``Encoding.truncate`` and
given its special tokens by ``post_process``, the steps the Rust tokenizer itself takes when
truncation is set (checked on probe texts, :func:`truncates_alike`), so that no request needs a
tokenizer of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenizers import Tokenizer

from ..encoder_tasks.params import EncodeParams
from ..errors import BadRequest

if TYPE_CHECKING:
    from tokenizers import Encoding

PROBES = (
    "Hello, World! How are you today?",
    "  spaces   before, between\tand after \n ",
    "naïve café, Ångström, façade, Straße",
    "日本語のテキストと中文文本",
    "emoji 🤗🚀 and symbols @#$%^&*()[]{}",
    "",
)
"""Texts on which :func:`truncated` must encode as the Rust tokenizer truncating does."""


@dataclass(frozen=True)
class Truncation:
    """How inputs over ``limit`` tokens are treated: cut on ``side`` (``right`` keeps the
    start), or refused (``enabled`` False)."""

    enabled: bool
    side: str
    limit: int


def asked_truncation(params: EncodeParams, default: Truncation, specials: int) -> Truncation | None:
    """The truncation a request asks for, against the server's ``default``; None when it asks
    for that one. ``specials``: the special tokens a text gets (a limit must leave room for
    text beside them). A limit above the maximum is a 400."""
    if params.truncate is None and params.truncation_side is None and params.max_tokens is None:
        return None
    enabled = params.truncate
    if enabled is None:
        enabled = params.max_tokens is not None or default.enabled
    limit = default.limit
    if params.max_tokens is not None and params.max_tokens != -1:
        if params.max_tokens > default.limit:
            raise BadRequest(
                f"truncate_prompt_tokens {params.max_tokens} exceeds the maximum of "
                f"{default.limit} tokens"
            )
        if params.max_tokens <= specials:
            raise BadRequest(
                f"truncate_prompt_tokens {params.max_tokens} leaves no room for text beside "
                f"the model's {specials} special tokens"
            )
        limit = params.max_tokens
    truncation = Truncation(enabled, params.truncation_side or default.side, limit)
    return None if truncation == default else truncation


def truncated(
    plain: Tokenizer, encoding: Encoding, keep: int, side: str, specials: bool
) -> Encoding:
    """``encoding`` (of a text without special tokens) cut to ``keep`` tokens on ``side``,
    then given its special tokens: what ``plain`` would encode with truncation set."""
    if len(encoding.ids) > keep:
        encoding.truncate(keep, 0, side)
    return plain.post_process(encoding, None, specials) if specials else encoding


def truncates_alike(rust: Tokenizer, plain: Tokenizer, limit: int) -> bool:
    """Whether :func:`truncated` encodes the probe texts (and one over ``limit``) as ``rust``
    (truncating at ``limit``) does, on both sides, to ``limit`` tokens and to fewer."""
    texts = [*PROBES, "probe " * (limit + 8)]
    specials = plain.num_special_tokens_to_add(False)
    reference = Tokenizer.from_str(rust.to_str())
    for side in ("right", "left"):
        for keep in {limit, max(specials + 1, limit // 2)}:
            reference.enable_truncation(keep, stride=0, direction=side)
            for text in texts:
                theirs = reference.encode(text)
                ours = truncated(
                    plain, plain.encode(text, add_special_tokens=False), keep - specials, side, True
                )
                if (ours.ids, ours.type_ids, ours.offsets) != (
                    theirs.ids,
                    theirs.type_ids,
                    theirs.offsets,
                ):
                    return False
    return True
