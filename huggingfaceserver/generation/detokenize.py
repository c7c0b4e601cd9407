"""Incremental detokenization of one choice: text that is safe to emit, token by token.

Each push decodes the whole generated sequence, which is robust for multi-byte characters
split over byte-level tokens and for sentencepiece's context-dependent spaces, and emits the
new suffix. Held back: a trailing "\\ufffd" (an incomplete UTF-8 sequence that the next token
may complete) and any tail that could still grow into a stop string. Concatenating everything
:meth:`IncrementalDetokenizer.push` and :meth:`IncrementalDetokenizer.flush` return gives
:attr:`IncrementalDetokenizer.text`.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"


def find_stop(text: str, stop: Sequence[str], start: int) -> tuple[int, str] | None:
    """The earliest stop string in ``text[start:]``: its position and the string."""
    found = [(text.find(s, start), s) for s in stop]
    matches = [(index, s) for index, s in found if index >= 0]
    return min(matches, key=lambda match: (match[0], -len(match[1]))) if matches else None


def partial_stop_length(text: str, stop: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that is the beginning of a stop string."""
    longest = 0
    for s in stop:
        for length in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:length]):
                longest = length
                break
    return longest


class IncrementalDetokenizer:
    """The text of one choice, built token by token and cut at the first stop string.

    Stop strings are looked for once more than ``min_tokens`` tokens were pushed (as vLLM:
    the first ``min_tokens`` tokens never stop the choice). Decoding keeps the tokenizer's
    spaces as they are (``clean_up_tokenization_spaces=False``) so that earlier text never
    changes when a token is added.
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
        self.text = ""
        """Everything emitted so far: the final text once the choice is finished."""
        self.stopped_on: str | None = None
        """The stop string that ended the choice, if one did."""
        self._decoded = ""

    @property
    def stopped(self) -> bool:
        return self.stopped_on is not None

    def push(self, token_id: int) -> str:
        """Add a token; returns the text that became safe to emit (maybe "")."""
        if self.stopped:
            return ""
        self.token_ids.append(token_id)
        self._decoded = str(
            self.tokenizer.decode(
                self.token_ids,
                skip_special_tokens=self.skip_special_tokens,
                clean_up_tokenization_spaces=False,
            )
        )
        checking = bool(self.stop) and len(self.token_ids) > self.min_tokens
        if checking and (match := find_stop(self._decoded, self.stop, len(self.text))):
            index, self.stopped_on = match
            end = index + len(self.stopped_on) if self.include_stop_str_in_output else index
            self._decoded = self._decoded[:end]
            return self._emit(end)
        safe = len(self._decoded.rstrip(REPLACEMENT_CHAR))
        if checking:
            safe -= partial_stop_length(self._decoded[:safe], self.stop)
        return self._emit(safe)

    def flush(self) -> str:
        """Everything held back: call once the choice has finished for another reason."""
        return self._emit(len(self._decoded))

    def _emit(self, end: int) -> str:
        piece = self._decoded[len(self.text) : end]
        self.text += piece
        return piece
