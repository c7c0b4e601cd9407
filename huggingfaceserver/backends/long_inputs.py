"""Texts far longer than the model's maximum, tokenized in bounded work.

Truncation keeps an input's first tokens, so tokenizing a 5 MB text whole (a million tokens:
seconds and hundreds of MiB) to keep 512 of them is waste. A long text is cut to a window of
its first characters instead, one checked (not assumed) to hold those tokens whole.

Why the check holds: the tokenizer splits the text at its added tokens, normalizes each part
(character by character, or over a few neighbours), pre-tokenizes it into pieces (words,
punctuation, whitespace runs) from left to right, and the model tokenizes each piece on its
own. Cutting the text can only change what lies at the cut: its last piece (and, to be safe
with a pre-tokenizer's look-ahead, the one before), and the pieces from where an added token
that the cut split begins (``[M`` is two pieces, ``[`` and ``m``; ``<|im_start`` more).
The window's tokens before those are *settled*: the whole text has them too, at the same
places (and offsets). When a window has more settled tokens than truncation keeps,
truncating the window gives exactly what truncating the whole text gives, and the whole text
has at least that many tokens.
Otherwise (a window of whitespace or of characters the normalizer drops, or a tokenizer
without a pre-tokenizer, whose one piece never settles) the window grows, up to the whole
text: such inputs cost what they cost before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import BadRequest

if TYPE_CHECKING:
    from tokenizers import Encoding, Tokenizer

GROWTH = 4
"""A window that settles too few tokens grows this many times."""


SERVER_HINT = "(--max_length); shorten it or run without --no_truncation"


class InputTooLong(BadRequest):
    """An input over the maximum length, with ``--no_truncation`` or a request's own
    ``truncate: false`` (400); ``hint``: what the message suggests (the flags by default)."""

    def __init__(
        self,
        what: str,
        index: int,
        tokens: int,
        max_length: int,
        at_least: bool = False,
        hint: str | None = None,
    ):
        self.index = index
        self.tokens = tokens
        self.max_length = max_length
        self.at_least = at_least
        self.hint = hint
        counted = f"at least {tokens}" if at_least else str(tokens)
        super().__init__(
            f"{what} has {counted} tokens, more than the maximum of {max_length} "
            f"{SERVER_HINT if hint is None else '; ' + hint}".replace(" ;", ";")
        )

    def named(self, what: str) -> InputTooLong:
        """The same refusal, the input called ``what`` (``document 3``)."""
        return InputTooLong(
            what, self.index, self.tokens, self.max_length, self.at_least, self.hint
        )


def longest_token_chars(tokenizer: Tokenizer) -> int:
    """The longest token's length in characters (added tokens included): more than any one
    token covers of a text, unless the normalizer drops characters."""
    return max((len(token) for token in tokenizer.get_vocab(with_added_tokens=True)), default=1)


@dataclass(frozen=True)
class Cut:
    """A text, or the window of it that tokenizes to the same first tokens."""

    text: str
    settled: int | None = None
    """None: the text whole. Else the window's settled tokens (special tokens left out); the
    whole text has at least as many."""


class LongInputs:
    """Cuts long texts to windows, for one tokenizer (right truncation only: cut at the end).

    The tokenizer is used as it is, truncation included: what truncation cuts off an encoding
    is still in its ``overflowing`` parts."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.token_chars = longest_token_chars(tokenizer)
        added = tokenizer.get_added_tokens_decoder().values()
        self.added_chars = max((len(token.content) for token in added), default=0)

    def first_window(self, needed: int) -> int:
        """Characters that hold ``needed`` tokens and the pieces at the cut, unless the
        normalizer drops characters."""
        return (needed + 3) * self.token_chars + self.added_chars

    def cut(self, text: str, needed: int) -> Cut:
        """``text``, or its first characters when they hold ``needed`` settled tokens."""
        window = self.first_window(needed)
        while len(text) > window:
            settled = self.settled_tokens(text[:window])
            if settled >= needed:
                return Cut(text[:window], settled)
            window *= GROWTH
        return Cut(text)

    def settled_tokens(self, window: str) -> int:
        """How many of ``window``'s first tokens the text it was cut from has too: those of
        the pieces before the last two, and before any piece that reaches where an added
        token cut in two may begin."""
        parts = self.encode(window)
        words = [word for part in parts for word in part.word_ids]
        known = [word for word in words if word is not None]
        if not known:
            return 0
        changed = max(known) - 1  # the first piece the cut may have changed
        limit = self.before_added_token(window)
        ends = (end for part in parts for _, end in part.offsets)
        for word, end in zip(words, ends, strict=True):
            if word is not None and end > limit:
                changed = min(changed, word)
                break
        settled = 0
        for word in words:  # in text order: the settled tokens come first
            if word is None or word >= changed:
                break
            settled += 1
        return settled

    def before_added_token(self, window: str) -> int:
        """Where an added token (``[MASK]``, ``<|im_start|>``) that the cut split may begin,
        the whitespace before it included (``lstrip`` tokens take it): the window's last
        ``longest - 1`` characters could be one's start."""
        if not self.added_chars:
            return len(window)
        start = max(0, len(window) - self.added_chars + 1)
        return len(window[:start].rstrip())

    def count(self, text: str) -> int:
        """A text's tokens, special tokens left out."""
        return sum(len(part.ids) for part in self.encode(text))

    def encode(self, text: str) -> list[Encoding]:
        """``text`` tokenized whole, without special tokens: the parts truncation made."""
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        return [encoding, *encoding.overflowing]
