"""Dynamic batching for encoder tasks: requests that arrive together share forward passes.

Each request is checked and tokenized on its own (a bad one fails alone, before it joins a
batch) into rows, one per instance (:mod:`.encoding`). A single worker thread drains the queue: when
free, it takes every row waiting, and while other requests are still being tokenized (they
announce themselves with :meth:`EncoderBatcher.expect`) it waits up to ``--batch_wait_ms`` for
them; a lone request never waits. It sorts the rows by length (less padding) and cuts them into
batches of at most ``--max_batch_size`` rows and ``--max_batch_tokens`` padded tokens, run one
after the other. Every request gets exactly its own rows' results back.

:meth:`EncoderBatcher.close` stops the worker after the forward pass it is running: the
requests it had not started, and any submitted later, fail with the error it was given.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from transformers import BatchEncoding

from ..cli import DEFAULT_MAX_BATCH_SIZE, ServerConfig
from ..errors import ServerError
from ..observability.metrics import EncoderBatchMetrics
from .loop_calls import LoopCalls, deferred
from .row_tokenizer import Row
from .worker_calls import WorkerCalls

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    import torch

T = TypeVar("T")
STOP_TIMEOUT_S = 60.0
"""How long :meth:`EncoderBatcher.close` waits for the forward pass under way."""
RunBatch = Callable[[BatchEncoding, list[str]], list[Any]]
"""Runs a merged batch on the batcher's thread, given each row's kind (see
:attr:`EncodeRequest.kind`); a result per row."""
Settle = Callable[[list[Any] | BaseException], None]
"""Receives a request's results (or the exception that failed it), on the batcher's thread."""


def collate(rows: list[Row], pad_values: dict[str, int]) -> BatchEncoding:
    """Right-pad rows into one batch (``pad_values`` per key; 0 where not given), with the
    attention mask that hides the padding."""
    import torch  # where the model runs: a front process sends its rows to the engine

    lengths = np.array([len(row["input_ids"]) for row in rows])
    width = int(lengths.max())
    columns: dict[str, torch.Tensor] = {}
    for key, first in rows[0].items():
        padded = np.full((len(rows), width, *first.shape[1:]), pad_values.get(key, 0), np.int64)
        for index, row in enumerate(rows):
            padded[index, : len(row[key])] = row[key]
        columns[key] = torch.from_numpy(padded)
    mask = np.arange(width)[None, :] < lengths[:, None]
    columns["attention_mask"] = torch.from_numpy(mask.astype(np.int64))
    return BatchEncoding(columns)


@dataclass(eq=False)
class EncodeRequest:
    rows: list[Row]
    settle: Settle
    """Called once, on the batcher's thread, with the results or the failure."""
    kind: str = "task"
    """What a row's result is: ``task`` (the task's prediction) or ``pair`` (a cross-encoder
    relevance score); rows of both kinds share forward passes."""
    cancelled: bool = False
    """Set when nobody waits for the results any more: the request is skipped if not started."""
    results: list[Any] = field(default_factory=list)
    done: int = 0
    queued_at: float = field(default_factory=time.perf_counter)
    started: bool = False
    """Set when its first row's forward pass starts."""
    ended: bool = False
    """Set once settled."""

    def __post_init__(self) -> None:
        self.results = [None] * len(self.rows)

    def end(self, outcome: list[Any] | BaseException) -> None:
        """Settle the request, once (a request whose batch failed is not settled again when
        the batcher closes)."""
        if not self.ended:
            self.ended = True
            self.settle(outcome)


def future_settle(future: asyncio.Future[list[Any]]) -> Settle:
    """A :data:`Settle` that resolves ``future`` on its event loop (from any thread)."""
    calls = LoopCalls.of(future.get_loop())

    def resolve(outcome: list[Any] | BaseException) -> None:
        if future.done():  # the client left
            return
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    def settle(outcome: list[Any] | BaseException) -> None:
        calls.call(resolve, outcome)

    return settle


@dataclass(frozen=True)
class BatchLimits:
    max_batch_tokens: int = ServerConfig.max_batch_tokens
    """Padded tokens per forward pass."""
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    """Rows per forward pass (1: no batching)."""
    wait_s: float = ServerConfig.batch_wait_ms / 1000
    """How long a batch waits for requests still being tokenized."""


def plan_batches(
    pending: list[tuple[EncodeRequest, int]], limits: BatchLimits
) -> list[list[tuple[EncodeRequest, int]]]:
    """Cut (request, row index) pairs, sorted by length, into batches within the limits."""
    ordered = sorted(pending, key=lambda item: len(item[0].rows[item[1]]["input_ids"]))
    batches: list[list[tuple[EncodeRequest, int]]] = []
    current: list[tuple[EncodeRequest, int]] = []
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


def end_all(requests: list[EncodeRequest], error: BaseException) -> None:
    """These requests fail with ``error`` (their event loops woken once)."""
    with deferred():
        for request in requests:
            request.end(error)


class EncoderBatcher:
    """One worker thread, one queue of requests, one future per request.

    The worker forms the next batch the moment it is free, from every row that arrived
    meanwhile, so forward passes follow each other without waiting on the event loop.
    """

    def __init__(
        self,
        run_batch: RunBatch,
        pad_values: dict[str, int],
        limits: BatchLimits,
        model_name: str = ServerConfig.model_name,
    ):
        self.run_batch = run_batch
        self.pad_values = pad_values
        self.limits = limits
        self.metrics = EncoderBatchMetrics(model_name, limits.max_batch_size)
        self.waiting: deque[EncodeRequest] = deque()
        self.wake = threading.Condition()
        self.expected = 0
        """Requests being prepared that will be submitted soon."""
        self.thread: threading.Thread | None = None
        self.calls = WorkerCalls()
        self.closed: ServerError | None = None
        """Set by :meth:`close`: what requests not run fail with."""

    def run_on_worker(self, function: Callable[[], T]) -> T:
        """``function()`` on the batcher's thread, waited for: what sets torch's CPU threads
        must run on the thread that runs the forward passes. OpenMP keeps a team of threads
        per calling thread, and a second team (say, the loader thread's) makes libgomp cut
        its workers' spin-waits short, which slowed every small forward pass down by half."""
        with self.wake:
            self._refuse_if_closed()
            self._start()
            done = self.calls.add(function)
            self.wake.notify()
        return done.result()

    def _refuse_if_closed(self) -> None:
        if self.closed is not None:
            raise self.closed

    def _start(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._work, name="batch", daemon=True)
            self.thread.start()

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

    def put(self, rows: list[Row], kind: str = "task") -> asyncio.Future[list[Any]]:
        """Queue a request's rows; the future of their results, in order. Cancelling the
        future takes the request out of the queue if its batch has not started. Once closed:
        raises the error :meth:`close` was given."""
        self._refuse_if_closed()
        future: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        request = EncodeRequest(rows, future_settle(future), kind)
        future.add_done_callback(lambda f: setattr(request, "cancelled", f.cancelled()))
        self.submit(request)
        return future

    def submit(self, request: EncodeRequest) -> None:
        """Queue a request (from any thread); its ``settle`` gets the outcome."""
        with self.wake:
            self._refuse_if_closed()
            self._start()
            self.waiting.append(request)
            self.metrics.submitted()
            self.wake.notify()

    def close(self, error: ServerError, timeout: float = STOP_TIMEOUT_S) -> bool:
        """Stop the worker once the forward pass it is running ends: every request not yet
        run fails with ``error``, and so does any submitted from now on. Idempotent. Returns
        whether the worker has stopped (False: its forward pass outlasted ``timeout``)."""
        with self.wake:
            if self.closed is None:
                self.closed = error
            self.wake.notify_all()
        if self.thread is None:
            return True
        if self.thread is not threading.current_thread():
            self.thread.join(timeout)
        return not self.thread.is_alive()

    def _fail_waiting(self) -> None:
        """On the worker, as it stops: the queue and the pending calls fail with the error
        :meth:`close` was given."""
        error = self.closed
        assert error is not None, "called once closed"
        with self.wake:
            requests, self.waiting = list(self.waiting), deque()
            self.metrics.taken(len(requests))
            self.metrics.idle()
        end_all(requests, error)
        self.calls.fail(error)

    def _gather(self) -> list[EncodeRequest]:
        """Every waiting request, after waiting (bounded) for those still being prepared;
        none once closed."""
        with self.wake:
            if not self.waiting:
                self.metrics.idle()
            while not self.waiting and not self.calls and self.closed is None:
                self.wake.wait()
            if self.closed is not None:
                return []
            deadline = time.monotonic() + self.limits.wait_s
            while (
                self.expected
                and self._waiting_rows() < self.limits.max_batch_size
                and self.closed is None
            ):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self.wake.wait(remaining)
            requests = list(self.waiting)
            self.waiting.clear()
            self.metrics.taken(len(requests))
        return [r for r in requests if not r.cancelled]  # a client that left is skipped

    def _waiting_rows(self) -> int:
        return sum(len(request.rows) for request in self.waiting)

    def _work(self) -> None:
        while self.closed is None:
            self.calls.run()
            requests = self._gather()
            try:
                self._round(requests)
            except Exception as exc:  # a bug: this round's requests fail, the worker goes on
                logger.exception("a round of the encoder batcher failed: its requests end")
                end_all(requests, ServerError(f"the encoder batcher failed: {exc!r}"))
        self._fail_waiting()

    def _round(self, requests: list[EncodeRequest]) -> None:
        """The gathered requests' rows, in the batches :func:`plan_batches` makes."""
        pending = [(request, i) for request in requests for i in range(len(request.rows))]
        for batch in plan_batches(pending, self.limits):
            if self.closed is not None:  # the rest of the plan fails below
                break
            with deferred():  # the event loops are woken once per batch
                self._run(batch)
        if self.closed is not None:
            end_all(requests, self.closed)

    def _run(self, batch: list[tuple[EncodeRequest, int]]) -> None:
        self._count(batch)
        try:
            encoded = collate([request.rows[i] for request, i in batch], self.pad_values)
            results = self.run_batch(encoded, [request.kind for request, _ in batch])
        except Exception as exc:  # this batch's requests fail; the worker goes on
            for request in dict.fromkeys(request for request, _ in batch):
                request.end(exc)
            return
        for (request, i), result in zip(batch, results, strict=True):
            request.results[i] = result
            request.done += 1
            if request.done == len(request.rows):
                request.end(request.results)

    def _count(self, batch: list[tuple[EncodeRequest, int]]) -> None:
        """The batch's size, and the queue time of the requests it starts."""
        self.metrics.batch_started(len(batch))
        now = time.perf_counter()
        for request, _ in batch:
            if not request.started:
                request.started = True
                self.metrics.first_forward(request.queued_at, now)
