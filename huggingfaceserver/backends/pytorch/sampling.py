"""A decode batch's next tokens in a fixed number of device operations, whatever its rows.

:class:`SamplingBatch` holds every row's sampling settings as device tensors, made when the
batch's rows change (not every step): temperatures, top-k, top-p and min-p; logit bias and
the stop tokens ``min_tokens`` holds back, as (row, token) index pairs; the penalties' counts
(``[rows, vocab]``, kept up to date on the device from each step's tokens, never recounted);
which rows want logprobs. A step (:meth:`SamplingBatch.choose`) processes the logits of every
row at once in vLLM's order (bias, min_tokens, repetition penalty, presence and frequency
penalties, the grammar masks of constrained rows in one llguidance call), then takes the argmax
for greedy rows and draws for the others, and copies to the host **once**: the tokens, whether
each row's logits were usable, and the logprobs asked for. Nothing else waits for the device.

Drawing: by the inverse of each row's cumulative distribution (one uniform number per row; the token
is the first whose cumulative probability reaches it), which draws from ``probs`` exactly with a
fixed number of device operations and no wait for the device (unlike ``torch.multinomial``), and far
less than the exponential race (``argmax(probs / q)``, ``q ~ Exp(1)``, which draws a number per
token). A row with a seed draws its number from its own generator (one call per seeded row), so its
tokens depend on its seed and its logits alone, never on the other rows of the batch; the unseeded
rows draw theirs in one call from the process's sampling generator (seeded from the OS, never
torch's global RNG).

The failure domain is one row: a row whose settings, grammar or logits leave nothing to choose
from fails alone, and the other rows' tokens are those they would have had without it (every
operation is row-wise, and each seeded row draws from its own generator). A batch whose
processing raises is redone one row at a time, so that only the rows that raise fail.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ...devices import HostCopy, to_device
from ...errors import BadRequest
from ...generation.params import SamplingParams, TokenLogprob
from .logits import SamplingRow, filter_for_sampling, holds_back_stops, why_unusable
from .masks import mask_disallowed
from .penalties import (
    apply_presence_frequency_penalties,
    apply_repetition_penalty,
    wants_counts,
    wants_seen,
)

logger = logging.getLogger(__name__)

NEG_INF = float("-inf")
SMALLEST_UNIFORM = 2.0**-40
"""Uniform draws are at least this: a draw of exactly 0 would pick the first token even when
its probability is 0."""


class NextTokens(NamedTuple):
    """A step's outcome for each row of the batch."""

    tokens: list[int | None]
    """Each row's next token; None exactly for the rows in ``failures``."""
    logprobs: list[TokenLogprob | None]
    """Where the row asked for them (and did not fail)."""
    failures: dict[int, Exception]
    """Rows that cannot go on, by row index: a :class:`BadRequest` when the request is at
    fault (its settings exclude every token, its grammar failed), a
    :class:`~...errors.ServerError` when the model's own logits are unusable, anything
    unexpected as it was raised."""


@functools.cache
def sampling_generator(device: torch.device) -> torch.Generator:
    """The generator of the unseeded rows on ``device`` (one a process and device, seeded from
    the OS; only the decode loop's thread draws from it)."""
    generator = torch.Generator(device=device)
    generator.seed()
    return generator


def _index(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return to_device(list(values), device, torch.long)


def _column(values: Sequence[float], device: torch.device) -> torch.Tensor:
    """A ``[rows, 1]`` column of per-row values, to broadcast over the vocabulary."""
    return to_device(list(values), device, torch.float32).unsqueeze(1)


@dataclass
class Filters:
    """The sampled rows' temperature, top-k, top-p and min-p (None: no sampled row uses it)."""

    temperature: torch.Tensor
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    max_top_k: int

    @classmethod
    def of(cls, params: Sequence[SamplingParams], vocab: int, device: torch.device) -> Filters:
        enabled = [0 < p.top_k < vocab for p in params]
        max_top_k = max((p.top_k for p, on in zip(params, enabled, strict=True) if on), default=0)
        top_k = None
        if max_top_k:
            top_k = _index(
                [p.top_k if on else 0 for p, on in zip(params, enabled, strict=True)], device
            )
        return cls(
            _column([p.temperature for p in params], device),
            top_k,
            _column([p.top_p for p in params], device)
            if any(p.top_p < 1 for p in params)
            else None,
            _column([p.min_p for p in params], device)
            if any(p.min_p > 0 for p in params)
            else None,
            max_top_k,
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return filter_for_sampling(
            logits, self.temperature, self.top_k, self.top_p, self.min_p, self.max_top_k
        )


class SamplingBatch:
    """The sampling side of a decode batch's rows (see the module's docstring): made for a
    list of rows by :meth:`for_rows`, which keeps the penalties' counts of the rows that were
    already in the ``previous`` batch."""

    def __init__(
        self,
        rows: Sequence[SamplingRow],
        vocab: int,
        device: torch.device,
        previous: SamplingBatch | None = None,
    ):
        self.rows = list(rows)
        self.vocab = vocab
        self.device = device
        self.broken = False
        """Set when a step was redone row by row: the device state lags, rebuild from rows."""
        self.tokens: torch.Tensor | None = None
        """The last step's tokens ``[rows]`` on the device: the next step's input."""
        params = [row.params for row in self.rows]
        self.sampled = [i for i, p in enumerate(params) if not p.greedy]
        self.all_sampled = bool(self.sampled) and len(self.sampled) == len(self.rows)
        self.sampled_index = _index(self.sampled, device)
        self.filters = Filters.of([params[i] for i in self.sampled], vocab, device)
        self.seeded = [
            (k, generator)
            for k, i in enumerate(self.sampled)
            if (generator := self.rows[i].generator) is not None
        ]
        self.unseeded = len(self.seeded) < len(self.sampled)
        bias = [(i, t, v) for i, p in enumerate(params) for t, v in p.logit_bias.items()]
        self.bias = None
        if bias:
            rows_, tokens, values = zip(*bias, strict=True)
            self.bias = (_index(rows_, device), _index(tokens, device))
            self.bias_values = to_device(values, device, torch.float32)
        self._stops(params)
        self._penalties(params, previous)
        self.constrained = [
            (i, row.matcher) for i, row in enumerate(self.rows) if row.matcher is not None
        ]
        wanted = [(i, p.logprobs) for i, p in enumerate(params) if p.logprobs is not None]
        self.logprob_rows = [i for i, _ in wanted]
        self.logprob_top = [k for _, k in wanted]
        self.logprob_index = _index(self.logprob_rows, device)
        self.most_top = min(max(self.logprob_top, default=0), vocab)

    @classmethod
    def for_rows(
        cls, rows: Sequence[SamplingRow], logits: torch.Tensor, previous: SamplingBatch | None
    ) -> SamplingBatch:
        """``previous`` when it still serves exactly these rows, else a new batch for them
        (made once per change of the rows, not every step)."""
        if previous is not None and previous.serves(rows):
            return previous
        return cls(rows, logits.shape[-1], logits.device, previous)

    def serves(self, rows: Sequence[SamplingRow]) -> bool:
        """Whether this batch's state is that of these rows, in this order."""
        return (
            not self.broken
            and len(rows) == len(self.rows)
            and all(a is b for a, b in zip(rows, self.rows, strict=True))
        )

    def _stops(self, params: Sequence[SamplingParams]) -> None:
        """The (row, token) pairs that ``min_tokens`` may hold back, and each row's count of
        generated tokens (kept on the device, one more each step)."""
        pairs = [
            (i, token, row.params.min_tokens)
            for i, row in enumerate(self.rows)
            if holds_back_stops(row)
            for token in sorted(row.stop_ids)
        ]
        self.stops = None
        if pairs:
            rows, tokens, floors = zip(*pairs, strict=True)
            self.stops = (_index(rows, self.device), _index(tokens, self.device))
            self.stop_floors = _index(floors, self.device)
            self.generated = _index([len(row.output_ids) for row in self.rows], self.device)

    def _penalties(self, params: Sequence[SamplingParams], previous: SamplingBatch | None) -> None:
        """The counts of the rows that ask for a penalty: ``seen`` (prompt and output, for the
        repetition penalty) and ``counts`` (output, for presence and frequency), carried over
        from ``previous`` for its rows, else counted once from the row's tokens."""
        self.seen_rows = [i for i, p in enumerate(params) if wants_seen(p)]
        self.count_rows = [i for i, p in enumerate(params) if wants_counts(p)]
        self.seen = self.counts = None
        if previous is not None and previous.broken:
            previous = None  # its counts lag its rows' tokens
        if self.seen_rows:
            self.seen_index = _index(self.seen_rows, self.device)
            self.repetition = _column(
                [params[i].repetition_penalty for i in self.seen_rows], self.device
            )
            old = None if previous is None else previous.seen_table()
            self.seen = self._carried(
                self.seen_rows, old, torch.bool, lambda row: [*row.prompt_ids, *row.output_ids]
            )
        if self.count_rows:
            self.count_index = _index(self.count_rows, self.device)
            self.presence = _column(
                [params[i].presence_penalty for i in self.count_rows], self.device
            )
            self.frequency = _column(
                [params[i].frequency_penalty for i in self.count_rows], self.device
            )
            old = None if previous is None else previous.counts_table()
            self.counts = self._carried(
                self.count_rows, old, torch.float32, lambda row: row.output_ids
            )

    def _carried(
        self,
        positions: list[int],
        old: tuple[list[SamplingRow], torch.Tensor] | None,
        dtype: torch.dtype,
        tokens_of: Callable[[SamplingRow], Sequence[int]],
    ) -> torch.Tensor:
        """``[len(positions), vocab]``: the table row of each of these rows, carried over from
        the previous batch's (``old``: the rows of its table, and the table) where the row was
        there, else counted once from ``tokens_of(row)``."""
        table = torch.zeros(len(positions), self.vocab, dtype=dtype, device=self.device)
        was: dict[int, int] = {}
        if old is not None:
            old_rows, old_table = old
            previous_rows = {id(row): k for k, row in enumerate(old_rows)}
            was = {
                k: previous_rows[id(self.rows[i])]
                for k, i in enumerate(positions)
                if id(self.rows[i]) in previous_rows
            }
            if was:
                new_index = _index(list(was), self.device)
                table[new_index] = old_table[_index(list(was.values()), self.device)]
        pairs = [
            (k, token)
            for k, i in enumerate(positions)
            if k not in was
            for token in tokens_of(self.rows[i])
        ]
        if pairs:
            rows, tokens = zip(*pairs, strict=True)
            index = (_index(rows, self.device), _index(tokens, self.device))
            ones = torch.ones(len(pairs), dtype=dtype, device=self.device)
            table.index_put_(index, ones, accumulate=dtype != torch.bool)
        return table

    def seen_table(self) -> tuple[list[SamplingRow], torch.Tensor] | None:
        """The repetition penalty's table and the rows of its table rows (None: no such row)."""
        return None if self.seen is None else ([self.rows[i] for i in self.seen_rows], self.seen)

    def counts_table(self) -> tuple[list[SamplingRow], torch.Tensor] | None:
        """The presence and frequency penalties' table and the rows of its table rows."""
        if self.counts is None:
            return None
        return [self.rows[i] for i in self.count_rows], self.counts

    def choose(self, logits: torch.Tensor) -> NextTokens:
        """Each row's next token, and its logprobs where the row asked for them (one copy to
        the host); the device state (counts, generated tokens, :attr:`tokens`) takes them in.
        A row-level problem fails its row and is returned, never raised."""
        return self.begin(logits).result()

    def begin(self, logits: torch.Tensor, volatile: bool = False) -> Chosen:
        """:meth:`choose` up to the copy to the host, which is under way when this returns:
        the tokens are chosen on the device, the device state has taken them in (:attr:`tokens`
        is the next step's input), and :meth:`Chosen.result` reads them. ``volatile``: the
        device may overwrite ``logits`` before then (a recorded step's output, with the next
        step queued in between), so a failed row's logits are kept apart for its error."""
        if logits.shape[0] != len(self.rows):
            raise ValueError(f"{logits.shape[0]} rows of logits for {len(self.rows)} rows")
        raw = logits.float()
        if volatile and raw.data_ptr() == logits.data_ptr():
            raw = raw.clone()
        try:
            return self._begin(raw)
        except Exception:
            logger.warning(
                "choosing %d rows' tokens failed; row by row", len(self.rows), exc_info=True
            )
        return Chosen(self, raw, done=self.row_by_row(raw))

    def row_by_row(self, raw: torch.Tensor) -> NextTokens:
        """Each row's outcome with the row in a batch of its own, after the batch's own choice
        failed as a whole: only the rows that raise fail. The device state lags from here on
        (:attr:`broken`)."""
        self.broken = True
        tokens: list[int | None] = []
        logprobs: list[TokenLogprob | None] = []
        failures: dict[int, Exception] = {}
        for i, row in enumerate(self.rows):
            try:
                one = SamplingBatch([row], self.vocab, self.device)
                alone = one._begin(raw[i : i + 1]).result(redo=False)
            except Exception as exc:
                alone = NextTokens([None], [None], {0: exc})
            tokens += alone.tokens
            logprobs += alone.logprobs
            if 0 in alone.failures:
                failures[i] = alone.failures[0]
        return NextTokens(tokens, logprobs, failures)

    def process(self, raw: torch.Tensor) -> tuple[torch.Tensor, dict[int, Exception]]:
        """Bias, min_tokens, penalties (in vLLM's order), then the grammar masks of the
        constrained rows, on a copy of ``raw``; and the rows whose grammar cannot go on."""
        processed = raw.clone()
        if self.bias is not None:
            processed.index_put_(self.bias, self.bias_values, accumulate=True)
        if self.stops is not None:
            held = self.generated.index_select(0, self.stops[0]) < self.stop_floors
            current = processed[self.stops]
            processed.index_put_(self.stops, current.masked_fill(held, NEG_INF))
        if self.seen is not None:
            seen, repetition = self.seen, self.repetition
            self._on_rows(
                processed,
                self.seen_index,
                lambda part: apply_repetition_penalty(part, seen, repetition),
            )
        if self.counts is not None:
            counts, presence, frequency = self.counts, self.presence, self.frequency
            self._on_rows(
                processed,
                self.count_index,
                lambda part: apply_presence_frequency_penalties(part, counts, presence, frequency),
            )
        failures: dict[int, Exception] = {}
        if self.constrained:
            failures.update(mask_disallowed(processed, self.constrained))
        return processed, failures

    def _on_rows(
        self, logits: torch.Tensor, index: torch.Tensor, apply: Callable[[torch.Tensor], None]
    ) -> None:
        """``apply`` (in place) to the rows ``index`` of ``logits`` alone."""
        if index.numel() == logits.shape[0]:
            apply(logits)
            return
        part = logits.index_select(0, index)
        apply(part)
        logits.index_copy_(0, index, part)

    def _begin(self, raw: torch.Tensor) -> Chosen:
        processed, failures = self.process(raw)
        usable = processed.amax(dim=-1).isfinite()
        if self.all_sampled:  # no row takes the argmax
            tokens, drawable = self._sample(processed)
        else:
            tokens = processed.argmax(dim=-1)
            drawable = torch.ones_like(usable)
            if self.sampled:
                drawn, finite = self._sample(processed.index_select(0, self.sampled_index))
                tokens = tokens.index_copy(0, self.sampled_index, drawn)
                drawable = drawable.index_copy(0, self.sampled_index, finite)
        parts = [tokens.double(), usable.double(), drawable.double()]
        if self.logprob_rows:
            logprobs = raw.index_select(0, self.logprob_index).log_softmax(dim=-1)
            chosen = logprobs.gather(1, tokens.index_select(0, self.logprob_index).unsqueeze(1))
            top = logprobs.topk(self.most_top, dim=-1)
            parts += [
                chosen.flatten().double(),
                top.values.flatten().double(),
                top.indices.flatten().double(),
            ]
        self._take_in(tokens)
        return Chosen(self, raw, processed, failures, HostCopy(torch.cat(parts)))

    def _sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampled rows' tokens from their processed ``logits``, and whether each row's
        filtered logits leave anything to draw."""
        filtered = self.filters.apply(logits)
        return self._draw(filtered.softmax(dim=-1)), filtered.amax(dim=-1).isfinite()

    def _draw(self, probs: torch.Tensor) -> torch.Tensor:
        """One token per row of ``probs`` (the sampled rows'), by the inverse of its cumulative
        distribution: the first token whose cumulative probability reaches the row's uniform
        number (scaled to the row's total, which rounding leaves a little off 1)."""
        uniform = torch.empty(probs.shape[0], 1, device=probs.device)
        if self.unseeded:
            uniform.uniform_(generator=sampling_generator(probs.device))
        for k, generator in self.seeded:
            uniform[k].uniform_(generator=generator)
        cumulative = probs.cumsum(dim=-1)
        target = uniform.clamp_(min=SMALLEST_UNIFORM) * cumulative[:, -1:]
        return (cumulative < target).sum(dim=-1)

    def _take_in(self, tokens: torch.Tensor) -> None:
        """The device state after the rows take ``tokens``."""
        self.tokens = tokens
        if self.stops is not None:
            self.generated += 1
        if self.seen is not None:
            new = tokens.index_select(0, self.seen_index)
            rows = torch.arange(len(self.seen_rows), device=self.device)
            self.seen.index_put_((rows, new), torch.ones_like(new, dtype=torch.bool))
        if self.counts is not None:
            new = tokens.index_select(0, self.count_index)
            rows = torch.arange(len(self.count_rows), device=self.device)
            self.counts.index_put_(
                (rows, new), torch.ones_like(new, dtype=torch.float32), accumulate=True
            )

    def unpack(
        self,
        host: list[float],
        raw: torch.Tensor,
        processed: torch.Tensor,
        failures: dict[int, Exception],
    ) -> NextTokens:
        """The host's copy (tokens, usable, drawable, then the logprobs asked for) as each row's
        outcome; the reasons of the failed rows (looked into only when a row failed)."""
        count = len(self.rows)
        chosen = [int(t) for t in host[:count]]
        usable = host[count : 2 * count]
        drawable = host[2 * count : 3 * count]
        for i, row in enumerate(self.rows):
            if i in failures:
                continue
            if not usable[i]:
                failures[i] = why_unusable(raw[i], processed[i], row)
            elif not drawable[i]:
                p = row.params
                failures[i] = BadRequest(
                    f"nothing to sample from with temperature={p.temperature}, top_k={p.top_k}, "
                    f"top_p={p.top_p}, min_p={p.min_p}: the scaled logits are not finite"
                )
        logprobs: list[TokenLogprob | None] = [None] * count
        wanted, most = len(self.logprob_rows), self.most_top
        at = 3 * count
        values = host[at + wanted : at + wanted + wanted * most]
        ids = host[at + wanted + wanted * most :]
        for position, (i, k) in enumerate(zip(self.logprob_rows, self.logprob_top, strict=True)):
            if i in failures:
                continue
            start = position * most
            top = tuple((int(ids[start + j]), values[start + j]) for j in range(min(k, most)))
            logprobs[i] = TokenLogprob(chosen[i], host[at + position], top)
        tokens: list[int | None] = [None if i in failures else t for i, t in enumerate(chosen)]
        return NextTokens(tokens, logprobs, failures)


@dataclass(eq=False)
class Chosen:
    """A step's tokens chosen on the device, their copy to the host under way
    (:meth:`SamplingBatch.begin`); :meth:`result` reads them."""

    batch: SamplingBatch
    raw: torch.Tensor
    """The rows' logits, as floats: a failed row's error looks into them."""
    processed: torch.Tensor | None = None
    failures: dict[int, Exception] = field(default_factory=dict)
    """The rows failed before the copy (their grammar)."""
    copy: HostCopy | None = None
    """The tokens, whether each row's logits were usable and drawable, the logprobs asked for."""
    done: NextTokens | None = None
    """The outcome already made (row by row, after the batch failed as a whole)."""

    def result(self, redo: bool = True) -> NextTokens:
        """Each row's outcome, once the copy is in: the step's one wait for the device.
        ``redo``: whether a failure to read it is redone row by row (not once a step was fed
        these tokens: the rows' tokens would be drawn again)."""
        if self.done is not None:
            return self.done
        assert self.copy is not None and self.processed is not None
        try:
            return self.batch.unpack(self.copy.values(), self.raw, self.processed, self.failures)
        except Exception:
            if not redo:
                raise
            rows = len(self.batch.rows)
            logger.warning("reading %d rows' tokens failed; row by row", rows, exc_info=True)
        return self.batch.row_by_row(self.raw)
