"""What choosing a row's next token needs, row-wise over a batch ``[rows, vocab]``: the
sampling filters (temperature, top-k, top-p, min-p, each row with its own), why a row's logits
leave nothing to choose from, and the prompt's logprobs. :mod:`.sampling` runs a decode
step with them; reported logprobs are the model's own: ``log_softmax`` of the raw logits.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

import torch

from ...devices import to_device
from ...errors import BadRequest, ServerError
from ...generation.constraints import GrammarMatcher
from ...generation.params import SamplingParams, TokenLogprob
from .penalties import wants_penalty


class SamplingRow(Protocol):
    """What choosing a row's next token needs to know about the row."""

    @property
    def params(self) -> SamplingParams: ...

    @property
    def prompt_ids(self) -> Sequence[int]: ...

    @property
    def output_ids(self) -> Sequence[int]:
        """The row's tokens so far: after a step, a row that did not fail takes its token here
        before the next step."""

    @property
    def stop_ids(self) -> Collection[int]:
        """Tokens that end the row (EOS unless ignore_eos, stop_token_ids): held back by
        ``min_tokens``."""

    @property
    def generator(self) -> torch.Generator | None:
        """The row's own random generator when it has a seed; None otherwise."""

    @property
    def matcher(self) -> GrammarMatcher | None:
        """The row's structured-output matcher; None for unconstrained rows."""


def holds_back_stops(row: SamplingRow) -> bool:
    """Whether ``min_tokens`` still forbids the row's stop tokens."""
    return len(row.output_ids) < row.params.min_tokens and bool(row.stop_ids)


def why_unusable(raw: torch.Tensor, processed: torch.Tensor, row: SamplingRow) -> Exception:
    """Why one row's processed logits are unusable: the model's own logits (a server error),
    or what the request asked for (a 400 that names it)."""
    if raw.isnan().any():
        return ServerError("the model's logits are NaN")
    top = float(raw.amax())
    if top == float("inf"):
        return ServerError("the model's logits hold +inf")
    if top == float("-inf"):
        return ServerError("the model's logits are all -inf")
    if processed.isnan().any() or processed.isposinf().any():
        return BadRequest("logit_bias or the penalties make the logits NaN or +inf")
    return nothing_allowed(row)


def nothing_allowed(row: SamplingRow) -> BadRequest:
    """The 400 of a row whose settings and grammar exclude every token."""
    params = row.params
    ending_forbidden = holds_back_stops(row)
    if row.matcher is not None and ending_forbidden and row.matcher.complete:
        return BadRequest(
            f"no token is allowed: the grammar is complete but min_tokens={params.min_tokens} "
            "forbids ending"
        )
    causes = [
        cause
        for cause, present in (
            ("the grammar", row.matcher is not None),
            (f"min_tokens={params.min_tokens} (no stop token yet)", ending_forbidden),
            ("logit_bias", bool(params.logit_bias)),
            ("the penalties", wants_penalty(params)),
        )
        if present
    ]
    excluded_by = " and ".join(causes or ["the sampling settings"])
    return BadRequest(f"no token is allowed: every token is excluded by {excluded_by}")


def filter_for_sampling(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    max_top_k: int = 0,
) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p: the logits to draw from (-inf: excluded).

    Per row: ``temperature``, ``top_p`` and ``min_p`` are ``[rows, 1]`` columns, ``top_k``
    ``[rows]`` (0: off for that row; ties with the k-th logit are kept) with ``max_top_k`` its
    largest value; None (or 0) leaves a filter out for every row. A fixed number of device
    operations, whatever the rows, and no wait for the device.
    """
    logits = logits / temperature
    if top_k is not None and max_top_k:
        top = logits.topk(max_top_k, dim=-1).values
        kth = top.gather(1, (top_k.clamp(min=1) - 1).unsqueeze(1))
        logits = logits.masked_fill((logits < kth) & (top_k > 0).unsqueeze(1), float("-inf"))
    if top_p is not None:
        ascending, order = logits.sort(dim=-1)
        tail_mass = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = tail_mass <= 1.0 - top_p
        drop[:, -1] = False  # the most likely token always stays
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    if min_p is not None:
        probs = logits.softmax(dim=-1)
        floor = min_p * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


PROMPT_LOGPROB_CHUNK = 256
"""Prompt positions scored at once: a ``[chunk, vocab]`` log-softmax, not ``[prompt, vocab]``."""


def prompt_token_logprobs(
    logits: torch.Tensor, prompt_ids: Sequence[int], num_top: int
) -> list[TokenLogprob | None]:
    """Each prompt token's log-probability given the tokens before it, its rank, and the
    ``num_top`` most likely tokens there; ``logits[i]`` is the model's raw output at position
    ``i`` (which predicts token ``i + 1``). The first token has none: None."""
    result: list[TokenLogprob | None] = [None]
    targets = to_device(prompt_ids[1:], logits.device, torch.long)
    for start in range(0, len(targets), PROMPT_LOGPROB_CHUNK):
        chunk = logits[start : start + PROMPT_LOGPROB_CHUNK].float().log_softmax(dim=-1)
        wanted = targets[start : start + PROMPT_LOGPROB_CHUNK]
        chosen = chunk.gather(1, wanted.unsqueeze(1))
        ranks = (chunk > chosen).sum(dim=1).add(1).tolist()
        top_values, top_ids = (t.tolist() for t in chunk.topk(min(num_top, chunk.shape[-1]), -1))
        for offset, token in enumerate(wanted.tolist()):
            top = tuple(zip(top_ids[offset], top_values[offset], strict=True))
            result.append(TokenLogprob(token, float(chosen[offset, 0]), top, ranks[offset]))
    return result
