"""Dynamic batching for encoder tasks: requests that arrive together share forward passes.

Each request is checked and tokenized on its own (a bad one fails alone, before it joins a
batch), then split into rows, one per instance. A single worker drains the queue: it waits up
to ``--batch_wait_ms`` for a batch to fill, sorts the waiting rows by length (less padding), and
cuts them into batches of at most ``--max_batch_size`` rows and ``--max_batch_tokens`` padded
tokens, run one after the other. Every request gets exactly its own rows' results back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import BatchEncoding

logger = logging.getLogger(__name__)

Row = dict[str, torch.Tensor]
"""One instance's tensors (input_ids, attention_mask, ...), without padding."""
RunBatch = Callable[[BatchEncoding], Awaitable[list[Any]]]


def split_rows(batch: BatchEncoding) -> list[Row]:
    """A padded request batch as one unpadded row per instance."""
    sizes = batch["attention_mask"].sum(dim=1).tolist()
    return [{key: value[i, :size] for key, value in batch.items()} for i, size in enumerate(sizes)]


def collate(rows: list[Row], pad_values: dict[str, int]) -> BatchEncoding:
    """Right-pad rows into one batch (``pad_values`` per key; 0 where not given)."""
    width = max(len(row["input_ids"]) for row in rows)
    columns: dict[str, torch.Tensor] = {}
    for key in rows[0]:
        padded = []
        for row in rows:
            value = row[key]
            fill = torch.full(
                (width - len(value), *value.shape[1:]), pad_values.get(key, 0), dtype=value.dtype
            )
            padded.append(torch.cat([value, fill]))
        columns[key] = torch.stack(padded)
    return BatchEncoding(columns)


@dataclass
class Request:
    rows: list[Row]
    future: asyncio.Future[list[Any]]
    results: list[Any] = field(default_factory=list)
    done: int = 0

    def __post_init__(self) -> None:
        self.results = [None] * len(self.rows)


@dataclass(frozen=True)
class BatchLimits:
    max_batch_tokens: int = 16384
    """Padded tokens per forward pass."""
    max_batch_size: int = 32
    """Rows per forward pass (1: no batching)."""
    wait_s: float = 0.002
    """How long the first waiting row waits for others."""


def plan_batches(
    pending: list[tuple[Request, int]], limits: BatchLimits
) -> list[list[tuple[Request, int]]]:
    """Cut (request, row index) pairs, sorted by length, into batches within the limits."""
    ordered = sorted(pending, key=lambda item: len(item[0].rows[item[1]]["input_ids"]))
    batches: list[list[tuple[Request, int]]] = []
    current: list[tuple[Request, int]] = []
    for item in ordered:
        length = len(item[0].rows[item[1]]["input_ids"])
        too_many = len(current) + 1 > limits.max_batch_size
        too_long = (len(current) + 1) * length > limits.max_batch_tokens
        if current and (too_many or too_long):
            batches.append(current)
            current = []
        current.append(item)
    if current:
        batches.append(current)
    return batches


class EncoderBatcher:
    """One queue, one worker task, one future per request."""

    def __init__(self, run_batch: RunBatch, pad_values: dict[str, int], limits: BatchLimits):
        self.run_batch = run_batch
        self.pad_values = pad_values
        self.limits = limits
        self.queue: asyncio.Queue[Request] = asyncio.Queue()
        self.worker: asyncio.Task[None] | None = None

    async def submit(self, rows: list[Row]) -> list[Any]:
        """The results of a request's rows, in order, once the batches holding them ran."""
        if self.worker is None or self.worker.done():
            self.worker = asyncio.create_task(self._work())
        request = Request(rows, asyncio.get_running_loop().create_future())
        self.queue.put_nowait(request)
        return await request.future

    async def _gather(self) -> list[Request]:
        requests = [await self.queue.get()]
        deadline = asyncio.get_running_loop().time() + self.limits.wait_s
        while sum(len(r.rows) for r in requests) < self.limits.max_batch_size:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                break
            try:
                requests.append(await asyncio.wait_for(self.queue.get(), remaining))
            except asyncio.TimeoutError:
                break
        while not self.queue.empty():  # whatever else is already waiting joins too
            requests.append(self.queue.get_nowait())
        return [r for r in requests if not r.future.done()]  # a cancelled client is skipped

    async def _work(self) -> None:
        while True:
            requests = await self._gather()
            pending = [(request, i) for request in requests for i in range(len(request.rows))]
            for batch in plan_batches(pending, self.limits):
                await self._run(batch)

    async def _run(self, batch: list[tuple[Request, int]]) -> None:
        try:
            encoded = collate([request.rows[i] for request, i in batch], self.pad_values)
            results = await self.run_batch(encoded)
        except Exception as exc:  # this batch's requests fail; the worker goes on
            for request, _ in batch:
                if not request.future.done():
                    request.future.set_exception(exc)
            return
        for (request, i), result in zip(batch, results, strict=True):
            request.results[i] = result
            request.done += 1
            if request.done == len(request.rows) and not request.future.done():
                request.future.set_result(request.results)
