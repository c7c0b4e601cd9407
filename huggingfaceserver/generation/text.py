"""The text side of a choice: its tokens turned into text, cut at the first stop string.

Torch-free: it runs in the decode loop when the server is one process, and in the front
process that serves the request otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from .detokenize import IncrementalDetokenizer
from .params import FinishReason, SamplingParams


@dataclass(eq=False)
class ChoiceText:
    """The text side of a choice: its tokens turned into text, cut at the first stop string.

    Runs where the text is made: in the decode loop when the server is one process, in the
    front process that serves the request otherwise (the engine then sends token ids only).
    """

    detokenizer: IncrementalDetokenizer

    @classmethod
    def for_params(cls, tokenizer: PreTrainedTokenizerBase, params: SamplingParams) -> ChoiceText:
        return cls(
            IncrementalDetokenizer(
                tokenizer,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
                min_tokens=params.min_tokens,
            )
        )

    def take(self, token_id: int, ended: FinishReason | None) -> tuple[str, FinishReason | None]:
        """The text ``token_id`` adds, and the choice's finish reason after it.

        ``ended`` is what the token side decided: "stop" for a stop token (EOS or a stop token
        id), "length" when the token budget is spent; a stop string in the text also ends the
        choice ("stop"), and wins over "length".
        """
        if ended == "stop":
            keep = self.detokenizer.include_stop_str_in_output
            text = self.detokenizer.push(token_id) if keep else ""
            return text + self.detokenizer.flush(), "stop"
        text = self.detokenizer.push(token_id)
        if self.detokenizer.stopped:
            return text, "stop"
        if ended == "length":
            return text + self.detokenizer.flush(), "length"
        return text, None
