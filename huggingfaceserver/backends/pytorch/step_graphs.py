"""Decode steps replayed as CUDA graphs: one recorded forward per batch-size bucket.

A decode step of a model that fits one GPU launches hundreds of small kernels, and on a GPU the
host takes longer to launch them than the device takes to run them. A CUDA graph records a
step's kernels once and replays them with one call. As in vLLM, a graph is recorded per bucket
of rows (1, 2, 4, 8, 16, ... up to ``--max_batch_size``); a batch runs in the smallest bucket
that holds it, its rows padded up to it (their outputs unused).

A graph replays the same kernels on the same memory, so the recorded forward reads its inputs
from tensors kept here (each row's token, position and attention mask, and the column its keys
and values go to) and runs over the whole buffers of the batch's
:class:`~.kv_cache.ReservedCache` (:meth:`~.kv_cache.ReservedCache.writing_at`). When the cache
replaces its buffers (it grew; another batch took over) the graphs are recorded again, lazily,
per bucket. A batch whose rows have all ended leaves its cache to the next one (an idle spell
between two waves of requests), so that the graphs recorded over it keep serving. Where
recording fails (an operation that waits for the device, a model whose forward depends on the
step) the steps run eagerly from then on, the reason logged once.

Off on a CPU, where launching a kernel costs no more than running it. The recording is a
function given to :class:`StepGraphs`: :func:`cuda_graph` on a GPU, :func:`eager` in the tests,
which then run the same padded, whole-buffer forward step by step on any machine.

With ``--torch_compile`` each bucket's forward goes through ``torch.compile`` first
(:func:`torch_compiled`) and the compiled forward is what is recorded, as vLLM records its
compiled model: the graph then replays inductor's fused kernels instead of the eager ones. The
compiler runs at the forward's first call, made before the recording (a compile is not a
kernel a graph can hold); its cache is the forward's code, so a bucket or a cache seen before
is compiled again only where its guards fail (the first other bucket size turns the sizes that
differ symbolic: a handful of compiles in all, made at start-up by
:meth:`~.generator.TransformersGenerator.tune`). Where compiling fails the forwards are recorded
uncompiled from then on, the reason logged once. On a CPU it runs the compiled forward over the
whole buffers (no graph).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from .kv_cache import ReservedCache

logger = logging.getLogger(__name__)

Forward = Callable[[], torch.Tensor]
"""A decode step's forward over the inputs kept in :class:`StepInputs`: its logits."""
Record = Callable[[Forward], Forward]
"""Makes a forward replayable: the replay runs it again on the inputs' current values. It may
run the forward while recording (its writes are the step's own: replaying repeats them)."""
Compile = Callable[[Forward], Forward]
"""Compiles a forward (:func:`torch_compiled`): the compiled one computes the same, lazily
compiled at its first call."""


def bucket_sizes(max_rows: int) -> tuple[int, ...]:
    """The rows a graph is recorded for: powers of two below ``max_rows``, then ``max_rows``."""
    sizes = []
    size = 1
    while size < max_rows:
        sizes.append(size)
        size *= 2
    return (*sizes, max_rows)


def bucket_for(rows: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds ``rows`` rows; None past the largest."""
    return next((size for size in sizes if size >= rows), None)


def eager(forward: Forward) -> Forward:
    """No recording: every replay runs the forward (the tests' stand-in for a CUDA graph)."""
    return forward


def cuda_graph(forward: Forward) -> Forward:
    """Record the forward as a CUDA graph, after a warm-up run on a side stream (lazy
    initialisations and kernel choices happen outside the recording, as torch's docs ask);
    the replay returns the recorded output tensor, refreshed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = forward()

    def replay() -> torch.Tensor:
        graph.replay()
        return output

    return replay


def torch_compiled(backend: str | Callable[..., object] = "inductor") -> Compile:
    """``torch.compile`` with ``backend`` (inductor; the tests give a backend of their own, which
    sees every graph compiled). Shapes go symbolic only once they change (torch's default)."""

    def compile(forward: Forward) -> Forward:
        compiled: Forward = torch.compile(forward, backend=backend)
        return compiled

    return compile


@dataclass
class StepInputs:
    """What a bucket's recorded forward reads, kept at fixed addresses."""

    ids: torch.Tensor
    """``[bucket, 1]``: each row's latest token."""
    positions: torch.Tensor
    """``[bucket, 1]``: each row's next position."""
    mask: torch.Tensor
    """``[bucket, 1, 1, column capacity]``: added to the attention scores."""
    column: torch.Tensor
    """``[1]``: the column the step's keys and values go to."""
    adapters: torch.Tensor
    """``[LoRA adapters, bucket, 1]``: 1 where a row runs that adapter
    (:meth:`~.adapters.LoraAdapters.forward_masked`); no adapters: ``[0, bucket, 1]``."""

    @classmethod
    def allocate(
        cls, rows: int, columns: int, dtype: torch.dtype, device: torch.device, adapters: int
    ):
        def longs(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.long, device=device)

        mask = torch.zeros(rows, 1, 1, columns, dtype=dtype, device=device)
        masks = torch.zeros(adapters, rows, 1, dtype=dtype, device=device)
        return cls(longs(rows, 1), longs(rows, 1), mask, longs(1), masks)


class GraphedBatch(Protocol):
    """What a recorded step needs of its batch
    (:class:`~.decode_batch.ReservedCausalLMBatch`)."""

    cache: ReservedCache
    positions: torch.Tensor
    """``[rows]``: each row's next position."""

    @property
    def dtype(self) -> torch.dtype: ...

    def adapter_masks(self) -> tuple[tuple[str, ...], torch.Tensor | None]:
        """The LoRA adapters a step computes and ``[adapters, rows, 1]``: 1 where a row runs
        that adapter (``()`` and None without adapters)."""
        ...

    def forward_whole(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        adapters: dict[str, torch.Tensor],
    ) -> torch.Tensor: ...


class StepGraphs:
    """The recorded decode steps of one model's reserved batches (used on the decode thread)."""

    def __init__(self, max_rows: int, record: Record, compile: Compile | None = None):
        self.sizes = bucket_sizes(max_rows)
        self.record = record
        self.compile = compile
        """Where given, each bucket's forward is compiled before it is recorded."""
        self.least_rows = self.sizes[min(1, len(self.sizes) - 1)] if compile else 1
        """The fewest rows the buffers of a recorded step have: a compiled step never sees
        buffers one row deep (torch compiles a size of one apart, and a lone request would
        otherwise start one while serving)."""
        self.uncompiled: str | None = None
        """Why compiling failed: the forwards are recorded uncompiled."""
        self.replays: dict[int, Forward] = {}
        self.inputs: dict[int, StepInputs] = {}
        self.over: tuple[ReservedCache, int, tuple[str, ...]] | None = None
        """The cache (and its :attr:`~.kv_cache.ReservedCache.layout`) the graphs were recorded
        over, and the LoRA adapters they compute (loading or unloading one records them
        again); the cache held, so that its buffers outlive the graphs that write them."""
        self.broken: str | None = None
        """Why recording failed: the steps run eagerly."""
        self.recordings = 0
        """Graphs recorded so far."""
        self.replayed = 0
        """Decode steps run from a recorded graph so far."""

    def forget(self) -> None:
        """Let the recorded steps go: the LoRA adapters they compute changed (one loaded or
        unloaded, perhaps under a name used before, whose weights a recorded step would still
        read where they were); the next step records anew."""
        self.over = None
        self.replays.clear()
        self.inputs.clear()

    def records_over(self, cache: ReservedCache, adapters: tuple[str, ...] | None = None) -> bool:
        """Whether the graphs recorded so far write into this cache's buffers as they are
        (and compute these LoRA adapters, where given)."""
        over = self.over
        if over is None or over[0] is not cache or over[1] != cache.layout:
            return False
        return adapters is None or over[2] == adapters

    def bucket(self, cache: ReservedCache) -> int | None:
        """The rows of the graph that serves the cache's batch (None: none does, run it
        eagerly), the cache's buffers fitted to them and to the step's column. Before the
        step's :meth:`~.kv_cache.ReservedCache.reserve` (fitting may move the buffers). Where
        the padded rows would not fit in the KV cache budget (the batch's own rows do: the
        decode loop keeps to it), the step runs eagerly."""
        size = bucket_for(cache.rows, self.sizes)
        if self.broken is not None or size is None:
            return None
        if not cache.fit_step(max(size, self.least_rows)):
            return None
        return size

    def step(self, batch: GraphedBatch, tokens: torch.Tensor, size: int) -> torch.Tensor | None:
        """Run a decode step from the graph of bucket ``size`` (what :meth:`bucket` chose),
        after the cache's :meth:`~.kv_cache.ReservedCache.reserve` of its column: the logits
        ``[rows, V]`` (valid until the next step), or None where recording failed: run it
        eagerly."""
        cache = batch.cache
        names, masks = batch.adapter_masks()
        if not self.records_over(cache, names):
            self.replays.clear()
            self.inputs.clear()
            self.over = (cache, cache.layout, names)
        inputs = self.inputs.get(size)
        if inputs is None:
            columns, dtype, device = cache.column_capacity, batch.dtype, cache.device
            inputs = StepInputs.allocate(size, columns, dtype, device, len(names))
            self.inputs[size] = inputs
        rows = cache.rows
        inputs.ids[:rows, 0].copy_(tokens.view(-1))
        inputs.positions[:rows, 0].copy_(batch.positions)
        if masks is not None and names:
            inputs.adapters[:, :rows].copy_(masks)
            inputs.adapters[:, rows:].zero_()  # padding rows: the base model
        cache.whole_step_mask(inputs.mask)
        inputs.column.fill_(cache.end)
        replay = self.replays.get(size)
        if replay is None:
            replay = self._record(batch, size, inputs)
            if replay is None:
                return None
        self.replayed += 1
        return replay()[:rows, -1]

    def _record(self, batch: GraphedBatch, size: int, inputs: StepInputs) -> Forward | None:
        cache = batch.cache

        assert self.over is not None
        adapters = dict(zip(self.over[2], inputs.adapters.unbind(0), strict=True))

        def forward() -> torch.Tensor:
            with cache.writing_at(inputs.column, size):
                return batch.forward_whole(inputs.ids, inputs.positions, inputs.mask, adapters)

        try:
            replay = self.record(self._compiled(forward))
        except Exception as exc:  # noqa: BLE001 - any failure to record means: run eagerly
            self.broken = f"{type(exc).__name__}: {exc}"
            self.replays.clear()
            logger.warning("decode steps run eagerly: recording one as a graph failed: %s", exc)
            return None
        self.recordings += 1
        self.replays[size] = replay
        return replay

    def _compiled(self, forward: Forward) -> Forward:
        """The forward compiled (where :attr:`compile` is given), the compiler run by one call
        of it here, before any recording (its writes are the step's own); else itself."""
        if self.compile is None or self.uncompiled is not None:
            return forward
        try:
            compiled = self.compile(forward)
            compiled()
        except Exception as exc:  # noqa: BLE001 - any failure to compile means: record it as is
            self.uncompiled = f"{type(exc).__name__}: {exc}"
            logger.warning("decode steps run uncompiled: torch.compile failed: %s", exc)
            return forward
        return compiled
