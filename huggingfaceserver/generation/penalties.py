"""The repetition, presence and frequency penalties over a batch of rows, from counts each row
keeps up to date token by token (instead of recounting its prompt and output every step).

Only the rows whose params ask for a penalty get counts, and only those rows are touched,
vectorised over them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from .params import SamplingParams


class PenalizedRow(Protocol):
    """What penalizing a row needs to know about the row."""

    @property
    def params(self) -> SamplingParams: ...

    @property
    def prompt_ids(self) -> Sequence[int]: ...

    @property
    def output_ids(self) -> Sequence[int]: ...

    penalties: PenaltyCounts | None
    """Made here on the row's first step when its params ask for a penalty (None otherwise,
    and to start with)."""


class PenaltyCounts:
    """A row's tokens as its penalties see them, kept up to date token by token instead of
    recounted every step: ``seen`` (prompt and output, for the repetition penalty) and
    ``counts`` (output, for the presence and frequency penalties), each only when the row's
    params use it."""

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int], like: torch.Tensor):
        """``like``: a row of the logits, for their vocabulary, dtype and device."""
        vocab, device = like.shape[-1], like.device
        self.seen: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None
        self.counted = 0
        """How many output tokens were taken in."""
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            if prompt_ids:
                self.seen[torch.tensor(list(prompt_ids), device=device)] = True
        if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
            self.counts = torch.zeros(vocab, dtype=like.dtype, device=device)

    @staticmethod
    def wanted(params: SamplingParams) -> bool:
        """Whether ``params`` ask for any penalty."""
        return (
            params.repetition_penalty != 1.0
            or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0
        )

    def catch_up(self, output_ids: Sequence[int]) -> None:
        """Take in the output tokens added since the last call (usually one)."""
        new = list(output_ids[self.counted :])
        if not new:
            return
        for tensor in (self.seen, self.counts):
            if tensor is not None:
                index = torch.tensor(new, device=tensor.device)
                if tensor.dtype == torch.bool:
                    tensor[index] = True
                else:
                    tensor.index_add_(0, index, torch.ones_like(index, dtype=tensor.dtype))
        self.counted = len(output_ids)

    def seen_mask(self) -> torch.Tensor:
        assert self.seen is not None, "the row has no repetition penalty"
        return self.seen

    def output_counts(self) -> torch.Tensor:
        assert self.counts is not None, "the row has no presence or frequency penalty"
        return self.counts


def row_penalties(row: PenalizedRow, logits_row: torch.Tensor) -> PenaltyCounts:
    """The row's :class:`PenaltyCounts`, made on first use, with its latest tokens taken in."""
    if row.penalties is None:
        row.penalties = PenaltyCounts(row.params, row.prompt_ids, logits_row)
    row.penalties.catch_up(row.output_ids)
    return row.penalties


def apply_penalties(logits: torch.Tensor, rows: Sequence[PenalizedRow]) -> None:
    """The repetition, presence and frequency penalties, in place, on the rows that ask for
    one (vectorised over them; the other rows are not touched)."""
    counts = {
        i: row_penalties(row, logits[i])
        for i, row in enumerate(rows)
        if PenaltyCounts.wanted(row.params)
    }
    repeating = [i for i in counts if counts[i].seen is not None]
    if repeating:
        seen = torch.stack([counts[i].seen_mask() for i in repeating])
        penalties = [rows[i].params.repetition_penalty for i in repeating]
        on_rows(logits, repeating, lambda part: apply_repetition_penalty(part, seen, penalties))
    counting = [i for i in counts if counts[i].counts is not None]
    if counting:
        output = torch.stack([counts[i].output_counts() for i in counting])
        presence = [rows[i].params.presence_penalty for i in counting]
        frequency = [rows[i].params.frequency_penalty for i in counting]
        on_rows(
            logits,
            counting,
            lambda part: apply_presence_frequency_penalties(part, output, presence, frequency),
        )


def on_rows(
    logits: torch.Tensor, indices: list[int], apply: Callable[[torch.Tensor], None]
) -> None:
    """``apply`` (in place) to the rows ``indices`` (ascending) of ``logits`` alone."""
    if len(indices) == logits.shape[0]:
        apply(logits)
        return
    index = torch.tensor(indices, device=logits.device)
    part = logits[index]
    apply(part)
    logits[index] = part


def per_row(values: Sequence[float], logits: torch.Tensor) -> torch.Tensor:
    """A ``[rows, 1]`` column of per-row values, to broadcast over the vocabulary."""
    return torch.tensor(values, dtype=logits.dtype, device=logits.device).unsqueeze(1)


def apply_repetition_penalty(
    logits: torch.Tensor, seen: torch.Tensor, penalties: Sequence[float]
) -> None:
    """CTRL / transformers: logits of tokens already seen (``seen``: a bool mask ``[rows,
    vocab]``) are divided by the penalty when positive and multiplied by it when negative."""
    if all(p == 1.0 for p in penalties):
        return
    penalty = per_row(penalties, logits)
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits.copy_(torch.where(seen, penalized, logits))


def apply_presence_frequency_penalties(
    logits: torch.Tensor,
    counts: torch.Tensor,
    presence: Sequence[float],
    frequency: Sequence[float],
) -> None:
    """OpenAI: ``logit -= presence * (count > 0) + frequency * count``; ``counts``: each
    token's occurrences in the row's output, ``[rows, vocab]``."""
    if all(p == 0.0 for p in presence) and all(f == 0.0 for f in frequency):
        return
    logits -= per_row(presence, logits) * (counts > 0) + per_row(frequency, logits) * counts
