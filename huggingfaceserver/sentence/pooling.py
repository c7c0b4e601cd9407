"""Token states to sentence vectors, as sentence-transformers' ``Pooling`` and ``SpladePooling``
compute them, for right-padded batches (the server pads on the right).

``mask`` is the attention mask, or where a prompt's tokens are left out of the pooling
(``include_prompt: false``) the attention mask with those zeroed; ``attention_mask`` stays the
real tokens (the weights of ``weightedmean`` count positions from the first token).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

MIN_COUNT = 1e-9
"""sentence-transformers' floor on a mean's denominator (an all-masked row pools to zeros)."""


def cls(hidden: torch.Tensor, mask: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The first pooled token's state (the first token unless a prompt is left out)."""
    first = mask.to(torch.int32).argmax(dim=1)
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), first]


def max_tokens(
    hidden: torch.Tensor, mask: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    return hidden.masked_fill(mask.unsqueeze(-1) == 0, float("-inf")).max(dim=1).values


def mean(hidden: torch.Tensor, mask: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=MIN_COUNT)


def mean_sqrt_len(
    hidden: torch.Tensor, mask: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=MIN_COUNT).sqrt()


def weighted_mean(
    hidden: torch.Tensor, mask: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """Later tokens weigh more: position 1, 2, ... from the first token (a prompt left out
    keeps the positions of the tokens after it)."""
    positions = torch.arange(1, hidden.shape[1] + 1, device=hidden.device, dtype=hidden.dtype)
    weights = mask.unsqueeze(-1).to(hidden.dtype) * positions.view(1, -1, 1)
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=MIN_COUNT)


def last_token(
    hidden: torch.Tensor, mask: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """The last pooled token's state (zeros for a row with none)."""
    values, from_end = mask.flip(1).max(dim=1)
    length = hidden.shape[1]
    from_end = torch.where(values == 0, length - 1, from_end)
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    return hidden[rows, length - 1 - from_end] * values.unsqueeze(-1).to(hidden.dtype)


PoolingFunction = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
POOLING_FUNCTIONS: dict[str, PoolingFunction] = {
    "cls": cls,
    "max": max_tokens,
    "mean": mean,
    "mean_sqrt_len_tokens": mean_sqrt_len,
    "weightedmean": weighted_mean,
    "lasttoken": last_token,
}
"""sentence-transformers' pooling modes (:data:`..config.POOLING_MODES`)."""


def pool(
    hidden: torch.Tensor,
    attention_mask: torch.Tensor,
    modes: Sequence[str],
    pooling_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[B, S, D]`` token states to ``[B, D * len(modes)]``: each mode's vector, concatenated."""
    mask = attention_mask if pooling_mask is None else pooling_mask * attention_mask
    vectors = [POOLING_FUNCTIONS[mode](hidden, mask, attention_mask) for mode in modes]
    return vectors[0] if len(vectors) == 1 else torch.cat(vectors, dim=-1)


def splade(
    logits: torch.Tensor, attention_mask: torch.Tensor, strategy: str, activation: str
) -> torch.Tensor:
    """``[B, S, V]`` masked-LM logits to ``[B, V]`` term weights: ``log(1 + relu(x))`` of the
    real tokens' logits (``log1p_relu``: that, once more), then their max or sum."""
    weights = (logits * attention_mask.unsqueeze(-1).to(logits.dtype)).relu_().log1p_()
    if activation == "log1p_relu":
        weights = weights.log1p_()
    return weights.amax(dim=1) if strategy == "max" else weights.sum(dim=1)
