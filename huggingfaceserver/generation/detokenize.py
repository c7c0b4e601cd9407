"""Incremental detokenization of one choice: text that is safe to emit, token by token.

Decoding the whole output again for every token costs O(n) per token (seconds of CPU for a
long answer), so each push decodes a window of a few ids instead, as vLLM's detokenizer does:
the window starts at ``prefix_offset``, its ids before ``read_offset`` are already read, and the
new text is what decoding the whole window adds to decoding its read part. Decoders render a
token by itself and by its place in what they are given (sentencepiece drops the first token's
leading space, WordPiece glues a "##" piece to the token before, byte-level BPE joins the bytes
of a character), so a window that starts at a token with text of its own gives the new ids the
text the full decode gives them. Special tokens that decoding skips never reach the decoder on
the fast path, and a window never starts at a token without text on the generic one. Where a
decoder still changes text before the window (byte-fallback bytes that stop forming valid
characters), that step reads the full decode.

Held back: text ending in "\\ufffd" (an incomplete UTF-8 sequence that the next token may
complete: the read offset only moves past complete text) and any tail that could still grow
into a stop string. Concatenating everything :meth:`IncrementalDetokenizer.push` and
:meth:`IncrementalDetokenizer.flush` return gives :attr:`IncrementalDetokenizer.text`: the full
decode of the tokens (``clean_up_tokenization_spaces=False``), cut at a stop string. (But a
byte-fallback decoder turns a whole run of byte tokens into "\\ufffd" once a byte in it cannot
complete a character, characters of the run that were emitted before included: those stay.)
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"


SPACE_MARKERS: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, str | None] = (
    weakref.WeakKeyDictionary()
)
"""Each tokenizer's :func:`space_marker`, read once."""


def space_marker(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The replacement character of a Metaspace pre-tokenizer (SentencePiece's ``▁``: T5's,
    Mistral v0.3's), whose leading instances a token decoded alone loses; None for other
    tokenizers (byte-level, WordPiece), whose tokens decode alone as they read."""
    if tokenizer in SPACE_MARKERS:
        return SPACE_MARKERS[tokenizer]
    marker = None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        pre = json.loads(backend.to_str()).get("pre_tokenizer") or {}
        steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
        for step in steps:
            if isinstance(step, dict) and step.get("type") == "Metaspace":
                marker = step.get("replacement", "\u2581")
                break
    SPACE_MARKERS[tokenizer] = marker
    return marker


def token_texts(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> list[str]:
    """Each token's own text, as vLLM shows tokens in logprobs: decoded alone, with the leading
    spaces that a SentencePiece tokenizer's decode strips from a lone token put back
    (``▁Paris`` is `` Paris``, not ``Paris``)."""
    texts = [str(tokenizer.decode([token]) or "") for token in ids]
    marker = space_marker(tokenizer)
    if marker is None:
        return texts
    pieces = tokenizer.convert_ids_to_tokens(list(ids))
    restored = []
    for piece, text in zip(pieces, texts, strict=True):
        markers = len(piece) - len(piece.lstrip(marker)) if isinstance(piece, str) else 0
        missing = markers - (len(text) - len(text.lstrip(" ")))
        restored.append(" " * missing + text if missing > 0 else text)
    return restored


def find_stop(text: str, stop: Sequence[str], start: int) -> tuple[int, str] | None:
    """The earliest stop string in ``text[start:]`` (the longest at equal positions): its
    position and the string."""
    found = [(text.find(s, start), s) for s in stop]
    matches = [(index, s) for index, s in found if index >= 0]
    return min(matches, key=lambda match: (match[0], -len(match[1]))) if matches else None


def partial_stop_length(text: str, stop: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that is the beginning of a stop string. Only
    tails that start with a stop string's first character are compared, found by ``str.find``
    from the longest: on the decode loop's thread every token, a long stop string costs about
    its length, not its length squared."""
    longest = 0
    end = len(text)
    for s in stop:
        start = text.find(s[0], max(end - len(s) + 1, 0)) if s else -1
        while 0 <= start < end - longest:
            if s.startswith(text[start:]):
                longest = end - start
                break
            start = text.find(s[0], start + 1)
    return longest


class IncrementalDetokenizer:
    """The text of one choice, built token by token and cut at the first stop string.

    Stop strings are looked for once more than ``min_tokens`` tokens were pushed (as vLLM:
    the first ``min_tokens`` tokens never stop the choice), from the end of the emitted text.
    Each push decodes a bounded window of ids and looks for stop strings in a bounded tail of
    the text, so the work per token does not grow with the output.

    A fast tokenizer decodes through its ``backend_tokenizer``: what its ``decode`` does with
    ``clean_up_tokenization_spaces=False``, at a fifth of the cost per call. (Tokenizers whose
    ``decode`` adds rules of its own, Whisper's timestamps or CTC's merged repeats, belong to
    models this server does not generate text with.) Others decode with ``decode``.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.token_ids: list[int] = []
        self.stopped_on: str | None = None
        """The stop string that ended the choice, if one did."""
        self._backend = tokenizer.backend_tokenizer if tokenizer.is_fast else None
        self._skipped = (
            frozenset(
                token.content
                for token in self._backend.get_added_tokens_decoder().values()
                if token.special
            )
            if self._backend is not None and skip_special_tokens
            else frozenset()
        )
        """Contents of the tokens the backend skips: what its ``decode`` filters out by."""
        self._pieces: list[str] = []
        self._emitted = 0
        """Length of :attr:`text`."""
        self._window_ids: list[int] = []
        """The ids that reach the decoder: the window's offsets index this list."""
        self._prefix_offset = 0
        self._read_offset = 0
        self._committed = 0
        """Length of the text of ``_window_ids[:_read_offset]``: complete, final text."""
        self._base = 0
        self._recent = ""
        """The committed text from ``_base`` on: what is not emitted yet, and the emitted tail
        that a stop string may still start in."""
        self._tail: str | None = ""
        """The text of the ids past the read offset (incomplete: it ends in "\\ufffd"); None
        when the window could not tell it, and only a full decode can."""
        self._keep = max((len(s) for s in self.stop), default=1) - 1

    @property
    def text(self) -> str:
        """Everything emitted so far: the final text once the choice is finished."""
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def stopped(self) -> bool:
        return self.stopped_on is not None

    def push(self, token_id: int) -> str:
        """Add a token; returns the text that became safe to emit (maybe "")."""
        if self.stopped:
            return ""
        self.token_ids.append(token_id)
        if self._reaches_decoder(token_id):
            self._window_ids.append(token_id)
            self._read_window()
        visible = self._recent + (self._tail or "")
        start = self._emitted - self._base
        checking = bool(self.stop) and len(self.token_ids) > self.min_tokens
        if checking and (match := find_stop(visible, self.stop, start)):
            index, self.stopped_on = match
            end = index + len(self.stopped_on) if self.include_stop_str_in_output else index
            return self._emit(visible[start:end])
        safe = len(visible.rstrip(REPLACEMENT_CHAR))
        if checking:
            safe -= partial_stop_length(visible[:safe], self.stop)
        piece = self._emit(visible[start:safe])
        # keep the unemitted text and enough emitted text for a stop string's beginning
        base = max(self._base, min(self._emitted, self._committed) - self._keep)
        self._recent, self._base = self._recent[base - self._base :], base
        return piece

    def flush(self) -> str:
        """Everything held back: call once the choice has finished for another reason."""
        if self.stopped:
            return ""
        if self._tail is None:
            return self._emit(self._decode(self._window_ids)[self._emitted :])
        return self._emit((self._recent + self._tail)[self._emitted - self._base :])

    def _reaches_decoder(self, token_id: int) -> bool:
        """Whether the backend's decode keeps ``token_id``: it drops ids it has no token for,
        and skips special tokens by their content. A generic tokenizer keeps them all."""
        if self._backend is None:
            return True
        token = self._backend.id_to_token(token_id)
        return token is not None and token not in self._skipped

    def _read_window(self) -> None:
        """Decode the window: the text past the read offset, committed once it is complete."""
        ids = self._window_ids
        read = self._decode(ids[self._prefix_offset : self._read_offset])
        text = self._decode(ids[self._prefix_offset :])
        if text.startswith(read):
            tail = text[len(read) :]
            if tail.endswith(REPLACEMENT_CHAR):
                self._tail = tail
                return
            self._recent += tail
            self._committed += len(tail)
        elif text.endswith(REPLACEMENT_CHAR):
            self._tail = None  # the next complete window or the flush will tell
            return
        else:
            # The decoder changed text before the window's new ids (byte-fallback bytes that
            # no longer form a valid character): the full decode is the text from now on.
            full = self._decode(ids)
            self._recent, self._base, self._committed = full, 0, len(full)
            tail = full
        self._tail = ""
        if tail:  # a window must start at a token that has text, or sentencepiece drops a space
            self._prefix_offset = self._read_offset
        self._read_offset = len(ids)

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return str(
            self.tokenizer.decode(
                ids,
                skip_special_tokens=self.skip_special_tokens,
                clean_up_tokenization_spaces=False,
            )
        )

    def _emit(self, piece: str) -> str:
        if piece:
            self._pieces.append(piece)
            self._emitted += len(piece)
        return piece
