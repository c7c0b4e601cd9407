"""One choice being generated, row by row: its settings, random generator, tokens, text and
finish state, and the step that turns a batch of rows' logits into their next tokens.

Backend-neutral torch: the rows of one decode batch may belong to different requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .detokenize import IncrementalDetokenizer
from .logits import choose_next_tokens
from .params import ChoiceDelta, FinishReason, SamplingParams, TokenLogprob


@dataclass(eq=False)
class SequenceState:
    """One choice being generated: its settings, generator, tokens, text and finish state."""

    index: int
    params: SamplingParams
    prompt_ids: list[int]
    stop_ids: frozenset[int]
    """Tokens that end the choice: EOS (unless ignore_eos) and the stop token ids."""
    budget: int
    """New tokens at most: max_tokens, capped by the context length."""
    generator: torch.Generator | None
    detokenizer: IncrementalDetokenizer
    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None

    def append(self, token_id: int, logprob: TokenLogprob | None) -> ChoiceDelta:
        """Take the next token; the delta it makes, with the finish reason when it ends."""
        self.output_ids.append(token_id)
        if token_id in self.stop_ids:
            self.finish_reason = "stop"
            keep = self.params.include_stop_str_in_output
            text = (self.detokenizer.push(token_id) if keep else "") + self.detokenizer.flush()
        else:
            text = self.detokenizer.push(token_id)
            if self.detokenizer.stopped:
                self.finish_reason = "stop"
            elif len(self.output_ids) >= self.budget:
                self.finish_reason = "length"
                text += self.detokenizer.flush()
        logprobs = None if logprob is None else [logprob]
        return ChoiceDelta(self.index, text, [token_id], logprobs, self.finish_reason)


def advance(rows: list[SequenceState], logits: torch.Tensor) -> list[ChoiceDelta]:
    """Choose each row's next token from its logits ``[rows, vocab]``; their deltas."""
    tokens, logprobs = choose_next_tokens(logits, rows)
    return [row.append(token, lp) for row, token, lp in zip(rows, tokens, logprobs, strict=True)]
