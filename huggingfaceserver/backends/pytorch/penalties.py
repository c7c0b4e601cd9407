"""The repetition, presence and frequency penalties over a batch of rows, from counts kept on
the device (:mod:`.sampling` keeps them up to date token by token instead of recounting
each row's prompt and output every step). Each function is row-wise: per-row values are
``[rows, 1]`` columns.
"""

from __future__ import annotations

import torch

from ...generation.params import SamplingParams


def wants_seen(params: SamplingParams) -> bool:
    """Whether the row needs the tokens it has seen (prompt and output): a repetition penalty."""
    return params.repetition_penalty != 1.0


def wants_counts(params: SamplingParams) -> bool:
    """Whether the row needs its output's token counts: a presence or frequency penalty."""
    return params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def wants_penalty(params: SamplingParams) -> bool:
    """Whether ``params`` ask for any penalty."""
    return wants_seen(params) or wants_counts(params)


def apply_repetition_penalty(
    logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor
) -> None:
    """CTRL / transformers, in place: logits of tokens already seen (``seen``: a bool mask
    ``[rows, vocab]``) are divided by the row's penalty when positive and multiplied by it when
    negative."""
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits.copy_(torch.where(seen, penalized, logits))


def apply_presence_frequency_penalties(
    logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor
) -> None:
    """OpenAI, in place: ``logit -= presence * (count > 0) + frequency * count``; ``counts``:
    each token's occurrences in the row's output, ``[rows, vocab]``."""
    logits -= presence * (counts > 0) + frequency * counts
