"""A KV cache reserved ahead: decode steps write into place instead of copying the cache.

transformers' :class:`~transformers.DynamicCache` concatenates every step's keys and values to
the cache (``torch.cat``): each step copies the whole cache, O(n²) memory traffic over an
answer, the larger part of a long answer's cost on a small model. :class:`ReservedCache` keeps
each layer's keys and values in buffers of ``rows x heads x columns x head_dim`` reserved ahead
(grown by half again when full: amortised O(1) per token) and hands the attention a view of the
columns in use. Every row shares the column axis: a row's tokens end at the last column, and
the columns before its first token are padding, hidden by :attr:`ReservedCache.mask` (the 2-D
attention mask the model takes), so rows of requests that started at different times step
together, each with its own positions.

Admitting a request writes its rows into free rows of the buffers (:meth:`ReservedCache.absorb`),
right-aligned to the last column: the running rows are not copied. Only a prompt longer than the
columns in use moves them (and a full buffer: the columns in use move to its front). They move
within the buffers wherever those have room; the buffers are replaced (by larger ones) only
where they have none. Rows that finish are dropped by moving the kept ones up
(:meth:`ReservedCache.select_rows`), once per finish, not per step; the leading columns that
then hold no row's token leave the columns in use (:meth:`ReservedCache.trim`) without the
host waiting for the device: where they start is copied to the host behind the work queued,
and taken at a later forward once it is in, unless rows joined or the columns moved since.
New prompts may also be fed in a decode step's own forward (:mod:`.ragged`): their rows are
opened empty (:meth:`ReservedCache.open_rows`) and, while the forward runs
(:meth:`ReservedCache.mixing`), each layer writes the decode rows' one token at the step's
column and each prompt's tokens into its own row, ending at that column; the next part of a
prompt fed in parts goes to that prompt's own one-row cache (:class:`PartColumns`), after the
parts before it.

A decode step's attention mask is handed to the model ready-made (:meth:`ReservedCache.step_mask`,
``[rows, 1, 1, columns]``, added to the attention scores): transformers then skips building one
from the 2-D mask, and with it a check of whether that mask is all ones, which waits for the
device every forward. A CUDA-graphed step (:mod:`.step_graphs`) runs the forward over the whole
buffers (:meth:`ReservedCache.writing_at`): the layers write at a column held in a device tensor
and attend over every column, the mask hiding those not in use, so that the same recorded
kernels serve every step until the buffers are replaced (:attr:`ReservedCache.layout`).

Through transformers' public cache API: a :class:`~transformers.cache_utils.Cache` of
:class:`ReservedLayer` (a :class:`~transformers.cache_utils.CacheLayerMixin`); the model calls
``update`` per layer as with any cache. The column geometry is the cache's: the batch
:meth:`~ReservedCache.reserve`\\ s the columns of a forward before running it and
:meth:`~ReservedCache.advance`\\ s past them after, so a forward that fails leaves the cache as
it was.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from ...devices import HostCopy, to_device
from ...heap import trim_heap

MIN_GROWTH = 256
"""Columns (and at least half again the columns in use) added when a buffer is full."""


def within(
    cells: int, rows: int, columns: int, row_capacity: int, column_capacity: int
) -> tuple[int, int]:
    """Buffer capacities of at least ``rows x columns``, their room ahead cut so that they
    hold ``cells`` at most where that many are enough: columns first (a capacity kept from
    wider rows that have ended included), then rows."""
    column_capacity = max(columns, min(column_capacity, cells // max(row_capacity, 1)))
    row_capacity = max(rows, min(row_capacity, cells // max(column_capacity, 1)))
    return row_capacity, column_capacity


@dataclass(frozen=True)
class PartColumns:
    """The next part of a prompt fed in parts, packed into another batch's forward: its
    ``tokens`` go to the prompt's own one-row cache, after the columns that cache holds."""

    cache: ReservedCache
    tokens: int

    def held(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s keys and values of the prompt so far, this part's included
        (``[1, heads, tokens held, head_dim]``, views)."""
        cache = self.cache
        columns = slice(cache.start, cache.end + self.tokens)
        own = cache.reserved_layers[layer]
        return own.key_buffer[:1, :, columns], own.value_buffer[:1, :, columns]


@dataclass(frozen=True)
class MixedColumns:
    """Where a forward of decode rows and new prompts, packed into one sequence, writes: the
    first ``decoding`` tokens are the decode rows' (rows ``0..decoding``, at column
    ``column``), then each prompt's tokens in order, prompt ``i`` in row ``decoding + i``,
    its last token at ``column``; then each of ``parts``' tokens, in its own cache."""

    decoding: int
    column: int
    lengths: tuple[int, ...]
    parts: tuple[PartColumns, ...] = ()


@dataclass(frozen=True)
class WholeBuffers:
    """A forward over the first ``rows`` rows of the whole buffers."""

    column: torch.Tensor
    """``[1]``: the column each row's new keys and values go to, on the device."""
    rows: int


def full_attention_layers(config: PretrainedConfig) -> int:
    """The layers of the model's cache when every one is plain full attention (what
    transformers' own cache for it would hold), the layout :class:`ReservedCache` implements;
    0 otherwise: sliding-window, linear-attention and KV-sharing layers keep transformers' own
    cache."""
    layers = DynamicCache(config=config).layers
    return len(layers) if all(type(layer) is DynamicLayer for layer in layers) else 0


class ReservedLayer(CacheLayerMixin):
    """One layer's keys and values, in buffers whose rows and columns are the cache's."""

    is_sliding = False
    is_croppable = False

    def __init__(self, cache: ReservedCache, index: int):
        super().__init__()
        self.index = index
        """The layer's place in its cache (the model's layer index)."""
        self.owner = weakref.ref(cache)
        """Weak: a cache and its layers in a reference cycle would outlive their batch until
        the cyclic garbage collector's next full pass, their buffers with them (the generation
        server's memory rose and fell by hundreds of MiB under a steady load)."""
        self.key_buffer = torch.empty(0)
        self.value_buffer = torch.empty(0)

    @property
    def cache(self) -> ReservedCache:
        cache = self.owner()
        if cache is None:
            raise RuntimeError("a layer of a KV cache that is gone")
        return cache

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        shape = self.cache.buffer_shape(key_states)
        self.key_buffer = key_states.new_zeros(shape)
        self.value_buffer = value_states.new_zeros(self.cache.buffer_shape(value_states))
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the forward's keys and values at the reserved columns; the columns in use up
        to them (a view, not a copy)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        cache = self.cache
        mixed = cache.mixed
        if mixed is not None:  # one packed sequence: scattered to the rows' columns
            self._write_mixed(mixed, key_states, value_states)
            self.keys, self.values = self.key_buffer, self.value_buffer
            return self.keys, self.values
        whole = cache.whole
        if whole is not None:  # the same kernels whatever the step's column
            keys, values = self.key_buffer[: whole.rows], self.value_buffer[: whole.rows]
            keys.index_copy_(2, whole.column, key_states)
            values.index_copy_(2, whole.column, value_states)
            self.keys, self.values = keys, values
            return keys, values
        rows, end = cache.rows, cache.end
        if key_states.shape[0] != rows or end + key_states.shape[-2] > cache.column_capacity:
            raise ValueError(
                f"{key_states.shape[0]} rows x {key_states.shape[-2]} tokens do not fit the "
                f"reserved {rows} rows x {cache.column_capacity - end} columns"
            )
        stop = end + key_states.shape[-2]
        self.key_buffer[:rows, :, end:stop] = key_states
        self.value_buffer[:rows, :, end:stop] = value_states
        self.keys = self.key_buffer[:rows, :, cache.start : stop]
        self.values = self.value_buffer[:rows, :, cache.start : stop]
        return self.keys, self.values

    def _write_mixed(
        self, mixed: MixedColumns, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> None:
        """A packed forward's keys and values (``[1, heads, tokens, head_dim]``) into their
        rows: the decode rows' at the step's column, each prompt's ending there, each part's
        after the columns its own cache holds."""
        column, rows = mixed.column, mixed.decoding
        for buffer, states in ((self.key_buffer, key_states), (self.value_buffer, value_states)):
            buffer[:rows, :, column] = states[0, :, :rows].transpose(0, 1)
            offset = rows
            for row, length in enumerate(mixed.lengths, start=rows):
                prompt = states[0, :, offset : offset + length]
                buffer[row, :, column + 1 - length : column + 1] = prompt
                offset += length
        for part in mixed.parts:
            own = part.cache.reserved_layers[self.index]
            stop = offset + part.tokens
            keys, values = key_states[:, :, offset:stop], value_states[:, :, offset:stop]
            if not own.is_initialized:
                own.lazy_initialization(keys, values)
            columns = slice(part.cache.end, part.cache.end + part.tokens)
            own.key_buffer[:1, :, columns] = keys
            own.value_buffer[:1, :, columns] = values
            offset = stop

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.end - self.cache.start + query_length, 0

    def get_seq_length(self) -> int:
        return self.cache.end - self.cache.start

    def get_max_length(self) -> int:
        return -1

    def relayout(self, rows: int, offset: int) -> None:
        """Move the first ``rows`` rows' columns in use into buffers of the cache's current
        capacity, starting at column ``offset``; the other cells are zero."""
        if not self.is_initialized:
            return
        cache = self.cache
        span = cache.end - cache.start
        moved = []
        for old in self.buffers():
            new = old.new_zeros(
                (cache.row_capacity, old.shape[1], cache.column_capacity, old.shape[3])
            )
            new[:rows, :, offset : offset + span] = old[:rows, :, cache.start : cache.end]
            moved.append(new)
        self.key_buffer, self.value_buffer = moved
        self.keys = self.values = None  # views of the old buffers, set again by `update`

    def shift(self, rows: int, offset: int) -> None:
        """Move the first ``rows`` rows' columns in use to start at column ``offset``, in
        these buffers (their addresses kept); the cells they leave are zero."""
        if not self.is_initialized:
            return
        cache = self.cache
        span = cache.end - cache.start
        for buffer in self.buffers():
            held = buffer[:rows, :, cache.start : cache.end].clone()
            buffer[:rows, :, cache.start : cache.end] = 0
            buffer[:rows, :, offset : offset + span] = held
        self.keys = self.values = None  # views of the old columns, set again by `update`

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.key_buffer, self.value_buffer


@dataclass(frozen=True)
class PendingTrim:
    """A :meth:`ReservedCache.trim` on its way: the first column any row held, counted from
    ``start`` (the cache's then), when the cache's :attr:`~ReservedCache.moves` was ``moves``."""

    first: HostCopy
    start: int
    moves: int


class ReservedCache(Cache):
    """The KV cache of a batch of rows, reserved ahead (see the module's docstring).

    Columns ``start:end`` are in use; :attr:`mask` says which of them hold each row's tokens.
    """

    def __init__(
        self,
        num_layers: int,
        max_rows: int,
        device: torch.device,
        max_tokens: int | None = None,
    ):
        self.max_rows = max_rows
        self.device = device
        self.max_tokens = max_tokens
        """The KV cache budget (:mod:`.kv_budget`) in token cells, rows times columns: buffers
        grown ahead (rows doubled, columns by half again) are cut to it where the rows and
        columns needed fit in it; None: no bound."""
        self.rows = 0
        self.start = 0
        self.end = 0
        self.row_capacity = 0
        self.column_capacity = 0
        self.mask_buffer = torch.zeros(0, 0, dtype=torch.long, device=device)
        self.layout = 0
        """Counts the times the buffers were replaced (grown): what was recorded over the old
        ones (a CUDA graph) no longer applies."""
        self.whole: WholeBuffers | None = None
        """Set while a forward runs over the whole buffers (:meth:`writing_at`)."""
        self.mixed: MixedColumns | None = None
        """Set while a packed forward of decode rows and prompts runs (:meth:`mixing`)."""
        self.moves = 0
        """Counts the changes that may put a row's tokens left of where a :meth:`trim` found
        the first held column: the columns in use moved, or rows joined."""
        self.trimming: PendingTrim | None = None
        """A :meth:`trim` whose first held column is on its way to the host."""
        self.reserved_layers = [ReservedLayer(self, index) for index in range(num_layers)]
        """:attr:`layers`, typed as what they are."""
        super().__init__(layers=list(self.reserved_layers))

    def buffer_shape(self, states: torch.Tensor) -> tuple[int, int, int, int]:
        return (self.row_capacity, states.shape[1], self.column_capacity, states.shape[3])

    @property
    def mask(self) -> torch.Tensor:
        """``[rows, columns in use]``: 1 where a row holds a token, 0 for its left padding."""
        return self.mask_buffer[: self.rows, self.start : self.end]

    def reserve(self, tokens: int, rows: int | None = None) -> torch.Tensor:
        """Room for a forward of ``tokens`` new tokens per row (of ``rows`` rows, for the first
        forward); the attention mask it takes (the columns in use and the new ones, which hold
        tokens in every row)."""
        self._take_trim()
        if rows is None:
            self._fit(self.rows, self.end + tokens)
        elif self.end > self.start:
            raise ValueError("rows are set by the first forward only")
        else:  # nothing held yet: no rows to carry
            self._fit(rows, self.end + tokens)
            self.rows = rows
            self.moves += 1
        self.mask_buffer[: self.rows, self.end : self.end + tokens] = 1
        return self.mask_buffer[: self.rows, self.start : self.end + tokens]

    def step_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """After :meth:`reserve` of one column: the decode step's attention mask, ready for the
        model, ``[rows, 1, 1, columns in use]``, 0 where a row holds a token and the dtype's
        lowest value on its padding (added to the attention scores, eager or SDPA alike)."""
        held = self.mask_buffer[: self.rows, self.start : self.end + 1]
        return (1 - held).to(dtype)[:, None, None, :] * torch.finfo(dtype).min

    def whole_step_mask(self, out: torch.Tensor) -> None:
        """After :meth:`reserve` of one column: :meth:`step_mask` over every column of the
        buffers, written into ``out`` (``[bucket rows, 1, 1, column capacity]``); the rows past
        :attr:`rows` (padding a batch up to a recorded size) attend to every column, so that
        their (unused) outputs stay finite."""
        lowest = torch.finfo(out.dtype).min
        out[: self.rows].fill_(lowest)
        out[self.rows :].zero_()
        held = self.mask_buffer[: self.rows, self.start : self.end + 1]
        out[: self.rows, 0, 0, self.start : self.end + 1] = (1 - held).to(out.dtype) * lowest

    def fit_step(self, rows: int) -> bool:
        """Buffers of at least ``rows`` rows (a batch padded up to a recorded size) and room for
        a decode step's column, so that the step's :meth:`reserve` changes neither; False
        (nothing changed) where that many rows at the columns in use would not fit in
        :attr:`max_tokens`: the padding rows count, and the buffers must not be cut below
        them once fitted."""
        self._take_trim()
        if self.max_tokens is not None and rows * (self.end - self.start + 1) > self.max_tokens:
            return False
        self._fit(rows, self.end + 1)
        return True

    @contextmanager
    def writing_at(self, column: torch.Tensor, rows: int) -> Iterator[None]:
        """While in the block, forwards write their one new token per row at ``column`` (a
        ``[1]`` device tensor) and attend over every column of the buffers' first ``rows`` rows:
        the mask (:meth:`whole_step_mask`) hides the columns not in use. The same kernels then
        serve every step (as a CUDA graph records them). Call :meth:`advance` after, as for
        any forward."""
        self.whole = WholeBuffers(column, rows)
        try:
            yield
        finally:
            self.whole = None

    def take(self, other: ReservedCache) -> None:
        """Hold ``other``'s rows and nothing else, from column 0, in these buffers where they
        fit (keeping :attr:`layout`: what was recorded over them, a CUDA graph of a decode
        step, still applies), in larger ones where not. The rows and columns held before are
        dropped; their keys and values stay in the cells until overwritten: finite numbers
        (:meth:`clear_rows`), hidden by the mask like any padding."""
        self.rows = self.start = self.end = 0
        self.moves += 1
        self.mask_buffer.zero_()
        width = other.end - other.start
        self._fit(other.rows, width)
        for mine, theirs in zip(self.reserved_layers, other.reserved_layers, strict=True):
            if not theirs.is_initialized:
                continue
            if not mine.is_initialized:
                mine.lazy_initialization(theirs.key_buffer, theirs.value_buffer)
            for buffer, source in zip(mine.buffers(), theirs.buffers(), strict=True):
                buffer[: other.rows, :, :width] = source[: other.rows, :, other.start : other.end]
        self.mask_buffer[: other.rows, :width] = other.mask
        self.rows, self.start, self.end = other.rows, 0, width

    def open_rows(self, lengths: Sequence[int]) -> int:
        """Before a decode step's :meth:`reserve` of its column: a row more per prompt (of
        ``lengths`` tokens), to be written by the step's own forward (:meth:`mixing`), each
        prompt's tokens ending at the step's column; the rows before it are padding. The
        columns in use move left (or the running rows move) only for a prompt wider than
        them. Returns the rows there were (:meth:`close_rows` takes the new ones back)."""
        before = self.rows
        if self.end <= self.start:
            raise ValueError("rows are opened beside rows that hold tokens")
        self.moves += 1
        rows = before + len(lengths)
        self._widen(rows, max(lengths) - 1)  # the widest prompt's columns before the step's
        self._fit(rows, self.end)
        self._clear(slice(before, rows), slice(self.start, self.end))
        for row, length in enumerate(lengths, start=before):
            self.mask_buffer[row, self.end + 1 - length : self.end] = 1
        self.rows = rows
        return before

    def close_rows(self, rows: int) -> None:
        """Back to the first ``rows`` rows, after a packed forward that failed."""
        self.rows = rows

    @contextmanager
    def mixing(self, columns: MixedColumns) -> Iterator[None]:
        """While in the block, a forward's keys and values are one packed sequence of decode
        rows' tokens and prompts' (laid out as ``columns`` says), each written to its row.
        Call :meth:`advance` (one column) after, as for any decode step."""
        self.mixed = columns
        try:
            yield
        finally:
            self.mixed = None

    def advance(self, tokens: int) -> None:
        """The reserved columns now hold the forward's keys and values."""
        self.end += tokens

    def _fit(self, rows: int, stop: int, move_to: int | None = None) -> None:
        """Buffers of at least ``rows`` rows and columns up to ``stop``; with ``move_to``, the
        columns in use move to start at that column. Full buffers move the columns in use to
        the front; only where that leaves no room are they replaced by larger ones (by half
        again at least). Columns moved within the buffers keep them (and :attr:`layout`): what
        was recorded over them still applies."""
        if move_to is None and rows <= self.row_capacity and stop <= self.column_capacity:
            return
        capacity = self.row_capacity, self.column_capacity
        if rows > self.row_capacity:
            self.row_capacity = max(rows, min(2 * self.row_capacity, self.max_rows))
        width = self.end - self.start
        if move_to is None:
            move_to, stop = 0, stop - self.start
        stop = max(stop, move_to + width)
        if stop > self.column_capacity:
            self.column_capacity = stop + max(stop // 2, MIN_GROWTH)
        if self.max_tokens is not None and (self.row_capacity, self.column_capacity) != capacity:
            self.row_capacity, self.column_capacity = within(
                self.max_tokens, rows, stop, self.row_capacity, self.column_capacity
            )
        held = self.mask_buffer[: self.rows, self.start : self.end].clone()
        self.moves += 1
        if (self.row_capacity, self.column_capacity) == capacity:
            if move_to != self.start:
                for layer in self.reserved_layers:
                    layer.shift(self.rows, move_to)
                self.mask_buffer[: self.rows, self.start : self.end] = 0
        else:
            for layer in self.reserved_layers:
                layer.relayout(self.rows, move_to)
            self.layout += 1
            self.mask_buffer = torch.zeros(
                self.row_capacity, self.column_capacity, dtype=torch.long, device=self.device
            )
            if self.device.type == "cpu":  # the old buffers' pages, which glibc would keep
                trim_heap()
        self.mask_buffer[: self.rows, move_to : move_to + width] = held
        self.start, self.end = move_to, move_to + width

    def _widen(self, rows: int, width: int) -> None:
        """At least ``width`` columns in use, ending where they end (for ``rows`` rows): the
        new ones to the left of the current ones, padding (zero) in the rows there are; the
        rows move right only where the buffers have no room to their left."""
        held = self.end - self.start
        if width <= held:
            return
        self.moves += 1
        if self.start >= width - held:
            self._clear(slice(0, self.rows), slice(self.end - width, self.start))
            self.start = self.end - width
        else:  # moved right: the columns left of them are padding, zeroed
            self._fit(rows, width, move_to=width - held)
            self._clear(slice(0, self.rows), slice(0, self.start))
            self.start = 0

    def select_rows(self, indices: Sequence[int]) -> None:
        """Keep these rows (by position, maybe repeated), in this order, as rows ``0..``."""
        if list(indices) == list(range(len(indices))):
            self.rows = len(indices)
            return
        self._fit(len(indices), self.end)
        index = to_device(list(indices), self.device, torch.long)
        columns = slice(self.start, self.end)
        for layer in self.reserved_layers:
            if layer.is_initialized:
                for buffer in layer.buffers():
                    buffer[: len(indices), :, columns] = buffer[index, :, columns]
        self.mask_buffer[: len(indices), columns] = self.mask_buffer[index, columns]
        self.rows = len(indices)

    def trim(self) -> None:
        """Stop using the leading columns that are padding in every row (no copy), without
        waiting for the device: at once where the first held column is read without a wait (a
        CPU), else at the first forward after its copy is in (:meth:`_take_trim`)."""
        if not self.rows:  # nothing to read
            return
        held = self.mask.any(dim=0)
        if held.numel():
            first = HostCopy(held.int().argmax().view(1))
            self.trimming = PendingTrim(first, self.start, self.moves)
            self._take_trim()

    def _take_trim(self) -> None:
        """The columns a :meth:`trim` found to be padding leave the columns in use, once their
        count is on the host, unless rows joined or the columns moved since (the trim is then
        dropped: the next finish trims again)."""
        trimming = self.trimming
        if trimming is None or not trimming.first.done():
            return
        self.trimming = None
        if trimming.moves == self.moves:
            (first,) = trimming.first.values()
            self.start = max(self.start, min(trimming.start + first, self.end))

    def absorb(self, other: ReservedCache) -> None:
        """Take ``other``'s rows after this cache's own, their tokens ending at the same last
        column; only a prompt wider than the columns in use (or full buffers) moves the rows
        already here."""
        theirs = other.end - other.start
        rows = self.rows + other.rows
        self.moves += 1
        self._widen(rows, theirs)
        self._fit(rows, self.end)
        new_rows = slice(self.rows, rows)
        self._clear(new_rows, slice(self.start, self.end - theirs))
        columns = slice(self.end - theirs, self.end)
        for mine, their in zip(self.reserved_layers, other.reserved_layers, strict=True):
            if not (mine.is_initialized and their.is_initialized):
                raise ValueError("caches merge only after their first forward")
            for buffer, source in zip(mine.buffers(), their.buffers(), strict=True):
                buffer[new_rows, :, columns] = source[: other.rows, :, other.start : other.end]
        self.mask_buffer[new_rows, columns] = other.mask
        self.rows = rows

    def clear_rows(self, indices: Sequence[int]) -> None:
        """Zero every cell of these rows, about to be dropped (:meth:`select_rows`): a forward
        over the whole buffers (:meth:`writing_at`) reads every column of its rows, those past
        the columns in use too, and a dropped row may have held NaN (a request that broke the
        model); masked, it would still reach the output of the row put there next (``NaN`` plus
        the mask's lowest value is NaN)."""
        if not indices:
            return
        index = to_device(list(indices), self.device, torch.long)
        for layer in self.reserved_layers:
            if layer.is_initialized:
                for buffer in layer.buffers():
                    buffer.index_fill_(0, index, 0)
        self.mask_buffer.index_fill_(0, index, 0)

    def _clear(self, rows: slice, columns: slice) -> None:
        """Zero these cells: a row's padding must hold finite numbers (a masked NaN would still
        reach the attention's output through ``0 * NaN``)."""
        if columns.start >= columns.stop:
            return
        for layer in self.reserved_layers:
            if layer.is_initialized:
                for buffer in layer.buffers():
                    buffer[rows, :, columns] = 0
        self.mask_buffer[rows, columns] = 0

    def take_rows(self, indices: Sequence[int]) -> ReservedCache:
        """A new cache holding copies of these rows (the others stay here untouched)."""
        taken = ReservedCache(len(self.layers), self.max_rows, self.device, self.max_tokens)
        width = self.end - self.start
        taken.row_capacity, taken.column_capacity = len(indices), width + MIN_GROWTH
        taken.rows, taken.end = len(indices), width
        index = to_device(list(indices), self.device, torch.long)
        columns = slice(self.start, self.end)
        taken.mask_buffer = self.mask_buffer.new_zeros(taken.row_capacity, taken.column_capacity)
        taken.mask_buffer[:, :width] = self.mask_buffer[index, columns]
        for mine, theirs in zip(self.reserved_layers, taken.reserved_layers, strict=True):
            if mine.is_initialized:
                keys, values = (buffer[index, :, columns] for buffer in mine.buffers())
                theirs.lazy_initialization(keys, values)
                theirs.key_buffer[:, :, :width] = keys
                theirs.value_buffer[:, :, :width] = values
        return taken
