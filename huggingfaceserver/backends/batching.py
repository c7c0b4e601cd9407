"""Dynamic batching for encoder tasks: requests that arrive together share forward passes.

Each request is checked and tokenized on its own (a bad one fails alone, before it joins a
batch), then split into rows, one per instance. A single worker thread drains the queue: when
free, it takes every row waiting, and while other requests are still being tokenized (they
announce themselves with :meth:`EncoderBatcher.expect`) it waits up to ``--batch_wait_ms`` for
them; a lone request never waits. It sorts the rows by length (less padding) and cuts them into
batches of at most ``--max_batch_size`` rows and ``--max_batch_tokens`` padded tokens, run one
after the other. Every request gets exactly its own rows' results back.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import BatchEncoding

Row = dict[str, torch.Tensor]
"""One instance's tensors (input_ids, attention_mask, ...), without padding."""
RunBatch = Callable[[BatchEncoding, asyncio.AbstractEventLoop], list[Any]]
"""Runs a merged batch on the batcher's thread (the loop: for backends that need it); a
result per row."""


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


@dataclass(eq=False)
class Request:
    rows: list[Row]
    future: asyncio.Future[list[Any]]
    loop: asyncio.AbstractEventLoop
    results: list[Any] = field(default_factory=list)
    done: int = 0

    def __post_init__(self) -> None:
        self.results = [None] * len(self.rows)

    def settle(self, outcome: list[Any] | BaseException) -> None:
        """Resolve the future with ``outcome`` (from any thread; once)."""

        def resolve() -> None:
            if self.future.done():  # the client left
                return
            if isinstance(outcome, BaseException):
                self.future.set_exception(outcome)
            else:
                self.future.set_result(outcome)

        with suppress(RuntimeError):  # the event loop is gone
            self.loop.call_soon_threadsafe(resolve)


@dataclass(frozen=True)
class BatchLimits:
    max_batch_tokens: int = 16384
    """Padded tokens per forward pass."""
    max_batch_size: int = 16
    """Rows per forward pass (1: no batching)."""
    wait_s: float = 0.002
    """How long a batch waits for requests still being tokenized."""


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
    """One worker thread, one queue of requests, one future per request.

    The worker forms the next batch the moment it is free, from every row that arrived
    meanwhile, so forward passes follow each other without waiting on the event loop.
    """

    def __init__(self, run_batch: RunBatch, pad_values: dict[str, int], limits: BatchLimits):
        self.run_batch = run_batch
        self.pad_values = pad_values
        self.limits = limits
        self.waiting: deque[Request] = deque()
        self.wake = threading.Condition()
        self.expected = 0
        """Requests being prepared that will be submitted soon."""
        self.thread: threading.Thread | None = None

    @contextmanager
    def expect(self) -> Iterator[None]:
        """Around a request's preparation and ``put``: a batch about to run may wait for it."""
        with self.wake:
            self.expected += 1
        try:
            yield
        finally:
            with self.wake:
                self.expected -= 1
                self.wake.notify()

    def put(self, rows: list[Row]) -> asyncio.Future[list[Any]]:
        """Queue a request's rows; the future of their results, in order."""
        loop = asyncio.get_running_loop()
        request = Request(rows, loop.create_future(), loop)
        with self.wake:
            if self.thread is None:
                self.thread = threading.Thread(target=self._work, name="batch", daemon=True)
                self.thread.start()
            self.waiting.append(request)
            self.wake.notify()
        return request.future

    def _gather(self) -> list[Request]:
        """Every waiting request, after waiting (bounded) for those still being prepared."""
        with self.wake:
            while not self.waiting:
                self.wake.wait()
            deadline = time.monotonic() + self.limits.wait_s
            while self.expected and self._waiting_rows() < self.limits.max_batch_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self.wake.wait(remaining)
            requests = list(self.waiting)
            self.waiting.clear()
        return [r for r in requests if not r.future.done()]  # a client that left is skipped

    def _waiting_rows(self) -> int:
        return sum(len(request.rows) for request in self.waiting)

    def _work(self) -> None:
        while True:
            requests = self._gather()
            pending = [(request, i) for request in requests for i in range(len(request.rows))]
            for batch in plan_batches(pending, self.limits):
                self._run(batch)

    def _run(self, batch: list[tuple[Request, int]]) -> None:
        try:
            encoded = collate([request.rows[i] for request, i in batch], self.pad_values)
            results = self.run_batch(encoded, batch[0][0].loop)
        except Exception as exc:  # this batch's requests fail; the worker goes on
            for request in dict.fromkeys(request for request, _ in batch):
                request.settle(exc)
            return
        for (request, i), result in zip(batch, results, strict=True):
            request.results[i] = result
            request.done += 1
            if request.done == len(request.rows):
                request.settle(request.results)
