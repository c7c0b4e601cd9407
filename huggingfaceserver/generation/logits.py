"""From a decode step's logits to the next token of each row, and the logprobs to report.

Pure torch over a batch of rows ``[rows, vocab]``; each row brings its own
:class:`~.params.SamplingParams`, so one call can serve rows of different requests. The order
follows vLLM: logit bias, min_tokens, repetition penalty, presence/frequency penalties, then the
grammar masks of constrained rows; then greedy argmax, or temperature, top-k, top-p, min-p and
a draw from the row's own generator (never the global RNG). Reported logprobs are the model's
own: ``log_softmax`` of the raw logits, before any of the above.

The failure domain is one row: a row whose settings, grammar or logits leave nothing to choose
from fails alone (see :class:`NextTokens`), and it is found before any row draws, so that the
other rows draw exactly what they would have drawn without it.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from typing import NamedTuple, Protocol

import torch

from ..errors import BadRequest, ServerError
from .constraints import GrammarMatcher
from .masks import mask_disallowed
from .params import SamplingParams, TokenLogprob
from .penalties import PenalizedRow, PenaltyCounts, apply_penalties, per_row

logger = logging.getLogger(__name__)


class SamplingRow(PenalizedRow, Protocol):
    """What choosing a row's next token needs to know about the row (what penalizing it
    needs, and more)."""

    @property
    def stop_ids(self) -> Collection[int]:
        """Tokens that end the row (EOS unless ignore_eos, stop_token_ids): held back by
        ``min_tokens``."""

    @property
    def generator(self) -> torch.Generator | None:
        """The row's own random generator; None for greedy rows."""

    @property
    def matcher(self) -> GrammarMatcher | None:
        """The row's structured-output matcher; None for unconstrained rows."""


class NextTokens(NamedTuple):
    """A step's outcome for each row of the batch."""

    tokens: list[int | None]
    """Each row's next token; None exactly for the rows in ``failures``."""
    logprobs: list[TokenLogprob | None]
    """Where the row asked for them (and did not fail)."""
    failures: dict[int, Exception]
    """Rows that cannot go on, by row index: a :class:`BadRequest` when the request is at
    fault (its settings exclude every token, its grammar failed), a :class:`ServerError` when
    the model's own logits are unusable, anything unexpected as it was raised."""


def choose_next_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> NextTokens:
    """The next token of each row, and its logprobs where the row asked for them.

    A row-level problem fails its row and is returned, never raised: processing that raises
    for the batch is redone row by row, and rows whose processed logits or sampling
    distribution are unusable are found before any row draws.
    """
    if logits.shape[0] != len(rows):
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(rows)} rows")
    raw = logits.float()
    failures: dict[int, Exception] = {}
    processed = processed_logits(raw, rows, failures)
    failures.update(unusable_rows(raw, processed, rows, skip=failures))
    chosen, failed = sample(processed, rows, skip=failures)
    failures.update(failed)
    logprobs = chosen_logprobs(raw, chosen, rows, failures)
    tokens = [None if i in failures else token for i, token in enumerate(chosen.tolist())]
    return NextTokens(tokens, logprobs, failures)


def processed_logits(
    raw: torch.Tensor, rows: Sequence[SamplingRow], failures: dict[int, Exception]
) -> torch.Tensor:
    """A copy of ``raw`` through :func:`process_logits`. When that raises for the batch, each
    row is processed alone, so that only the rows that raise fail; failed rows are added to
    ``failures``."""
    processed = raw.clone()
    try:
        failures.update(process_logits(processed, rows))
        return processed
    except Exception:
        logger.warning("processing %d rows' logits failed; row by row", len(rows), exc_info=True)
    for i, row in enumerate(rows):
        part = raw[i : i + 1].clone()
        try:
            failed = process_logits(part, [row])
        except Exception as exc:
            failures[i] = exc
            continue
        processed[i] = part[0]
        if failed:
            failures[i] = failed[0]
    return processed


def process_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> dict[int, Exception]:
    """Bias, min_tokens, penalties (in vLLM's order), then the grammar masks of constrained
    rows, in place. Returns the rows whose grammar cannot go on, by row index (see
    :func:`~.masks.mask_disallowed`)."""
    apply_logit_bias(logits, [row.params.logit_bias for row in rows])
    suppress_tokens(logits, [row.stop_ids if holds_back_stops(row) else () for row in rows])
    apply_penalties(logits, rows)
    failures: dict[int, Exception] = {}
    constrained = [(i, row.matcher) for i, row in enumerate(rows) if row.matcher is not None]
    if constrained:
        failures.update(mask_disallowed(logits, constrained))
    return failures


def holds_back_stops(row: SamplingRow) -> bool:
    """Whether ``min_tokens`` still forbids the row's stop tokens."""
    return len(row.output_ids) < row.params.min_tokens and bool(row.stop_ids)


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


def unusable_rows(
    raw: torch.Tensor,
    processed: torch.Tensor,
    rows: Sequence[SamplingRow],
    skip: Collection[int] = (),
) -> dict[int, Exception]:
    """Rows (but ``skip``) whose processed logits leave nothing to choose from: any NaN, any
    +inf, or every token -inf, with why. One reduction over the batch: such a row's max is
    not finite (``amax`` keeps NaN)."""
    bad = (~processed.amax(dim=-1).isfinite()).nonzero().flatten().tolist()
    return {i: why_unusable(raw[i], processed[i], rows[i]) for i in bad if i not in skip}


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
            ("the penalties", PenaltyCounts.wanted(params)),
        )
        if present
    ]
    excluded_by = " and ".join(causes or ["the sampling settings"])
    return BadRequest(f"no token is allowed: every token is excluded by {excluded_by}")


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
    logits = logits / per_row(temperature, logits)
    vocab = logits.shape[-1]
    if any(0 < k < vocab for k in top_k):
        k = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=logits.device)
        kth = logits.topk(int(k.max()), dim=-1).values.gather(1, (k - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if any(p < 1.0 for p in top_p):
        ascending, order = logits.sort(dim=-1)
        tail_mass = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = tail_mass <= 1.0 - per_row(top_p, logits)
        drop[:, -1] = False  # the most likely token always stays
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    if any(p > 0.0 for p in min_p):
        probs = logits.softmax(dim=-1)
        floor = per_row(min_p, logits) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def sample(
    processed: torch.Tensor, rows: Sequence[SamplingRow], skip: Collection[int] = ()
) -> tuple[torch.Tensor, dict[int, Exception]]:
    """Each row's next token: the argmax for greedy rows, else a draw from its generator; and
    the rows that failed. Rows in ``skip`` draw nothing (their token is meaningless); a row
    whose distribution is unusable (a temperature so small that its logits overflow) fails
    before any row draws."""
    tokens = processed.argmax(dim=-1)
    failures: dict[int, Exception] = {}
    drawn = [i for i, row in enumerate(rows) if not row.params.greedy and i not in skip]
    if not drawn:
        return tokens, failures
    try:
        probs, usable = distributions(processed[drawn], [rows[i].params for i in drawn])
        found = {i: (probs[k], usable[k]) for k, i in enumerate(drawn)}
    except Exception:
        logger.warning(
            "filtering %d rows for sampling failed; row by row", len(drawn), exc_info=True
        )
        found = {}
        for i in drawn:
            try:
                probs, usable = distributions(processed[i : i + 1], [rows[i].params])
            except Exception as exc:
                failures[i] = exc
            else:
                found[i] = (probs[0], usable[0])
    for i, (_, usable_row) in found.items():
        if not usable_row:
            p = rows[i].params
            failures[i] = BadRequest(
                f"nothing to sample from with temperature={p.temperature}, top_k={p.top_k}, "
                f"top_p={p.top_p}, min_p={p.min_p}: the scaled logits are not finite"
            )
    for i, (row_probs, _) in found.items():
        if i not in failures:
            try:
                tokens[i] = torch.multinomial(row_probs, 1, generator=rows[i].generator)[0]
            except Exception as exc:
                failures[i] = exc
    return tokens, failures


def distributions(
    logits: torch.Tensor, params: Sequence[SamplingParams]
) -> tuple[torch.Tensor, list[bool]]:
    """The probabilities to draw each row's token from, and whether each row's are usable."""
    filtered = filter_for_sampling(
        logits,
        [p.temperature for p in params],
        [p.top_k for p in params],
        [p.top_p for p in params],
        [p.min_p for p in params],
    )
    usable = filtered.amax(dim=-1).isfinite().tolist()
    return filtered.softmax(dim=-1), usable


def chosen_logprobs(
    raw: torch.Tensor,
    tokens: torch.Tensor,
    rows: Sequence[SamplingRow],
    failures: dict[int, Exception],
) -> list[TokenLogprob | None]:
    """:func:`token_logprobs` for the rows that asked (and have not failed); when that raises,
    row by row, and the rows that raise are added to ``failures``."""
    num_top = [None if i in failures else row.params.logprobs for i, row in enumerate(rows)]
    try:
        return token_logprobs(raw, tokens, num_top)
    except Exception:
        logger.warning("the logprobs of %d rows failed; row by row", len(rows), exc_info=True)
    result: list[TokenLogprob | None] = [None] * len(rows)
    for i, k in enumerate(num_top):
        if k is not None:
            try:
                [result[i]] = token_logprobs(raw[i : i + 1], tokens[i : i + 1], [k])
            except Exception as exc:
                failures[i] = exc
    return result


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
