"""From a decode step's logits to the next token of each row, and the logprobs to report.

Pure torch over a batch of rows ``[rows, vocab]``; each row brings its own
:class:`~.params.SamplingParams`, so one call can serve rows of different requests. The order
follows vLLM: logit bias, min_tokens, repetition penalty, presence/frequency penalties; then
greedy argmax, or temperature, top-k, top-p, min-p and a draw from the row's own generator
(never the global RNG). Reported logprobs are the model's own: ``log_softmax`` of the raw
logits, before any of the above.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Protocol

import llguidance
import torch

from .constraints import mask_disallowed
from .params import SamplingParams, TokenLogprob


class SamplingRow(Protocol):
    """What choosing a row's next token needs to know about the row."""

    @property
    def params(self) -> SamplingParams: ...

    @property
    def prompt_ids(self) -> Sequence[int]: ...

    @property
    def output_ids(self) -> Sequence[int]: ...

    @property
    def stop_ids(self) -> Collection[int]:
        """Tokens that end the row (EOS unless ignore_eos, stop_token_ids): held back by
        ``min_tokens``."""

    @property
    def generator(self) -> torch.Generator | None:
        """The row's own random generator; None for greedy rows."""

    @property
    def matcher(self) -> llguidance.LLMatcher | None:
        """The row's structured-output matcher; None for unconstrained rows."""


def choose_next_tokens(
    logits: torch.Tensor, rows: Sequence[SamplingRow]
) -> tuple[list[int], list[TokenLogprob | None]]:
    """The next token of each row, and its logprobs where the row asked for them."""
    raw = logits.float()
    processed = process_logits(raw.clone(), rows)
    tokens = sample(processed, rows)
    logprobs = token_logprobs(raw, tokens, [row.params.logprobs for row in rows])
    return tokens.tolist(), logprobs


def process_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Bias, min_tokens, penalties (in vLLM's order), then each constrained row's grammar mask
    (in place; returns ``logits``)."""
    apply_logit_bias(logits, [row.params.logit_bias for row in rows])
    suppress_tokens(
        logits,
        [row.stop_ids if len(row.output_ids) < row.params.min_tokens else () for row in rows],
    )
    apply_repetition_penalty(
        logits,
        [[*row.prompt_ids, *row.output_ids] for row in rows],
        [row.params.repetition_penalty for row in rows],
    )
    apply_presence_frequency_penalties(
        logits,
        [row.output_ids for row in rows],
        [row.params.presence_penalty for row in rows],
        [row.params.frequency_penalty for row in rows],
    )
    for index, row in enumerate(rows):
        if row.matcher is not None:
            mask_disallowed(logits[index], row.matcher)
    return logits


def apply_logit_bias(logits: torch.Tensor, biases: Sequence[Mapping[int, float]]) -> None:
    """Add each row's ``{token id: bias}`` to its logits."""
    for row, bias in enumerate(biases):
        if bias:
            ids = torch.tensor(list(bias), device=logits.device)
            values = torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
            logits[row].index_add_(0, ids, values)


def suppress_tokens(logits: torch.Tensor, token_ids: Sequence[Collection[int]]) -> None:
    """Make each row's listed tokens impossible (logit -inf)."""
    for row, ids in enumerate(token_ids):
        if ids:
            logits[row, list(ids)] = float("-inf")


def _occurrences(logits: torch.Tensor, token_ids: Sequence[Sequence[int]]) -> torch.Tensor:
    """How often each vocabulary token occurs in each row's ``token_ids``: ``[rows, vocab]``."""
    counts = torch.zeros_like(logits)
    for row, ids in enumerate(token_ids):
        if ids:
            index = torch.tensor(ids, device=logits.device)
            counts[row].index_add_(0, index, torch.ones_like(index, dtype=logits.dtype))
    return counts


def _per_row(values: Sequence[float], logits: torch.Tensor) -> torch.Tensor:
    """A ``[rows, 1]`` column of per-row values, to broadcast over the vocabulary."""
    return torch.tensor(values, dtype=logits.dtype, device=logits.device).unsqueeze(1)


def apply_repetition_penalty(
    logits: torch.Tensor, token_ids: Sequence[Sequence[int]], penalties: Sequence[float]
) -> None:
    """CTRL / transformers: logits of tokens already seen are divided by the penalty when
    positive and multiplied by it when negative."""
    if all(p == 1.0 for p in penalties):
        return
    seen = _occurrences(logits, token_ids) > 0
    penalty = _per_row(penalties, logits)
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits.copy_(torch.where(seen, penalized, logits))


def apply_presence_frequency_penalties(
    logits: torch.Tensor,
    output_ids: Sequence[Sequence[int]],
    presence: Sequence[float],
    frequency: Sequence[float],
) -> None:
    """OpenAI: ``logit -= presence * (count > 0) + frequency * count`` over output tokens."""
    if all(p == 0.0 for p in presence) and all(f == 0.0 for f in frequency):
        return
    counts = _occurrences(logits, output_ids)
    logits -= _per_row(presence, logits) * (counts > 0) + _per_row(frequency, logits) * counts


def filter_for_sampling(
    logits: torch.Tensor,
    temperature: Sequence[float],
    top_k: Sequence[int],
    top_p: Sequence[float],
    min_p: Sequence[float],
) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p: the logits to draw from (-inf: excluded).

    ``top_k`` 0 or less disables top-k; ties with the k-th logit are kept.
    """
    logits = logits / _per_row(temperature, logits)
    vocab = logits.shape[-1]
    if any(0 < k < vocab for k in top_k):
        k = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=logits.device)
        kth = logits.topk(int(k.max()), dim=-1).values.gather(1, (k - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if any(p < 1.0 for p in top_p):
        ascending, order = logits.sort(dim=-1)
        tail_mass = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = tail_mass <= 1.0 - _per_row(top_p, logits)
        drop[:, -1] = False  # the most likely token always stays
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    if any(p > 0.0 for p in min_p):
        probs = logits.softmax(dim=-1)
        floor = _per_row(min_p, logits) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def sample(processed: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Each row's next token: the argmax for greedy rows, else a draw from its generator."""
    tokens = processed.argmax(dim=-1)
    drawn = [i for i, row in enumerate(rows) if not row.params.greedy]
    if not drawn:
        return tokens
    params = [rows[i].params for i in drawn]
    filtered = filter_for_sampling(
        processed[drawn],
        [p.temperature for p in params],
        [p.top_k for p in params],
        [p.top_p for p in params],
        [p.min_p for p in params],
    )
    probs = filtered.softmax(dim=-1)
    for position, row in enumerate(drawn):
        tokens[row] = torch.multinomial(probs[position], 1, generator=rows[row].generator)[0]
    return tokens


def token_logprobs(
    raw_logits: torch.Tensor, tokens: torch.Tensor, num_top: Sequence[int | None]
) -> list[TokenLogprob | None]:
    """Per row: None when ``num_top`` is None, else the chosen token's log-probability under
    the model's raw logits and the ``num_top`` most likely tokens."""
    wanted = [i for i, k in enumerate(num_top) if k is not None]
    result: list[TokenLogprob | None] = [None] * len(num_top)
    if not wanted:
        return result
    logprobs = raw_logits[wanted].log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens[wanted].unsqueeze(1)).squeeze(1).tolist()
    most = min(max(num_top[i] or 0 for i in wanted), logprobs.shape[-1])
    top_values, top_ids = (t.tolist() for t in logprobs.topk(most, dim=-1))
    for position, row in enumerate(wanted):
        k = num_top[row] or 0
        top = tuple(zip(top_ids[position][:k], top_values[position][:k], strict=True))
        result[row] = TokenLogprob(int(tokens[row]), chosen[position], top)
    return result


PROMPT_LOGPROB_CHUNK = 256
"""Prompt positions scored at once: a ``[chunk, vocab]`` log-softmax, not ``[prompt, vocab]``."""


def prompt_token_logprobs(
    logits: torch.Tensor, prompt_ids: Sequence[int], num_top: int
) -> list[TokenLogprob | None]:
    """Each prompt token's log-probability given the tokens before it, its rank, and the
    ``num_top`` most likely tokens there; ``logits[i]`` is the model's raw output at position
    ``i`` (which predicts token ``i + 1``). The first token has none: None."""
    result: list[TokenLogprob | None] = [None]
    targets = torch.tensor(prompt_ids[1:], dtype=torch.long, device=logits.device)
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
