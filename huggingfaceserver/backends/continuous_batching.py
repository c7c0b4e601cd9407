"""Continuous batching: one decode loop, in one thread, shared by every generation request.

Requests wait in a queue. Between two decode steps the loop admits the waiting ones (first come,
first served, while the running rows stay within ``max_rows``): each one's prompt is run alone
(so its first token is exactly what it would be alone), then its rows join the running batch.
Every step then feeds all running rows at once; each row samples with its own settings and
generator, and each request receives its own rows' deltas. Finished rows and rows of requests
whose consumer left drop out after the step. A failing prefill fails its own request; a failing
step fails the requests of that batch; the loop goes on.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..errors import NotReady
from ..generation.params import ChoiceDelta
from ..generation.sequence import SequenceState, advance
from ..loop_calls import deferred
from .decode_batch import DecodeBatch

logger = logging.getLogger(__name__)

Emit = Callable[[list[ChoiceDelta] | BaseException | None], None]
"""Where a request's output goes: each step's deltas, then None, or the exception that ended
it."""


@dataclass(eq=False)
class Request:
    """One generation request: its ``n`` rows (sharing one prompt) and where its deltas go."""

    rows: list[SequenceState]
    emit: Emit
    cancelled: threading.Event = field(default_factory=threading.Event)
    """Set by the consumer when it leaves; its rows then stop at the next step."""

    @property
    def prompt_ids(self) -> list[int]:
        return self.rows[0].prompt_ids


@dataclass(eq=False)
class Running:
    """A decode batch and, for each of its rows, the row and the request it belongs to."""

    batch: DecodeBatch
    rows: list[SequenceState]
    owners: list[Request]


class ContinuousBatcher:
    """The shared decode loop; ``submit`` from any thread, ``close`` once at shutdown."""

    def __init__(self, new_batch: Callable[[], DecodeBatch], max_rows: int):
        self.new_batch = new_batch
        self.max_rows = max_rows
        self.waiting: deque[Request] = deque()
        self.running: list[Running] = []
        self.wake = threading.Condition()
        self.closed = False
        self.thread = threading.Thread(target=self._loop, name="decode", daemon=True)
        self.thread.start()

    def submit(self, request: Request) -> None:
        """Queue a request; it joins the running batch before the next decode step."""
        with self.wake:
            if self.closed:
                raise NotReady("the server is shutting down")
            self.waiting.append(request)
            self.wake.notify()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the loop; requests still waiting or running end with an error."""
        with self.wake:
            self.closed = True
            self.wake.notify()
        self.thread.join(timeout)

    @property
    def running_rows(self) -> int:
        return sum(len(group.rows) for group in self.running)

    def _loop(self) -> None:
        while True:
            with self.wake:
                while not (self.waiting or self.running or self.closed):
                    self.wake.wait()
                if self.closed:
                    break
                admitted = self._admit()
            with torch.inference_mode(), deferred():  # loops woken once per step
                for request in admitted:
                    self._start(request)
                for group in list(self.running):
                    self._step(group)
        stopped = NotReady("the server is shutting down")
        for request in {*self.waiting, *(o for g in self.running for o in g.owners)}:
            request.emit(stopped)

    def _admit(self) -> list[Request]:
        """Take the waiting requests whose rows fit (the first one always fits an idle loop)."""
        admitted: list[Request] = []
        rows = self.running_rows
        while self.waiting:
            head = self.waiting[0]
            if not head.cancelled.is_set():
                if rows and rows + len(head.rows) > self.max_rows:
                    break
                admitted.append(head)
                rows += len(head.rows)
            self.waiting.popleft()
        return admitted

    def _start(self, request: Request) -> None:
        """Run the request's prompt, emit its first tokens, merge its rows into a batch."""
        try:
            batch = self.new_batch()
            logits = batch.prefill(request.prompt_ids, len(request.rows))
            group = Running(batch, list(request.rows), [request] * len(request.rows))
            self._advance(group, logits)
        except Exception as exc:  # this request fails, not the loop
            request.emit(exc)
            return
        if not group.rows:
            return
        joined = self.running[0] if self.running else None
        if joined is not None and joined.batch.absorb(group.batch):
            joined.rows += group.rows
            joined.owners += group.owners
        else:
            self.running.append(group)

    def _step(self, group: Running) -> None:
        """One decode step of a batch; a failure ends the batch's requests."""
        try:
            logits = group.batch.step([row.output_ids[-1] for row in group.rows])
            self._advance(group, logits)
        except Exception as exc:
            for request in dict.fromkeys(group.owners):
                request.emit(exc)
            group.rows.clear()
        if not group.rows:
            self.running.remove(group)

    def _advance(self, group: Running, logits: torch.Tensor) -> None:
        """Choose the rows' next tokens, send each request its deltas, drop the rows that
        finished or whose request was cancelled."""
        deltas: dict[Request, list[ChoiceDelta]] = {}
        for owner, delta in zip(group.owners, advance(group.rows, logits), strict=True):
            deltas.setdefault(owner, []).append(delta)
        for owner, step in deltas.items():
            owner.emit(step)
        live = [
            i
            for i, (row, owner) in enumerate(zip(group.rows, group.owners, strict=True))
            if row.finish_reason is None and not row.aborted and not owner.cancelled.is_set()
        ]
        if len(live) == len(group.rows):
            return
        remaining = {group.owners[i] for i in live}
        for owner in deltas.keys() - remaining:
            if owner.cancelled.is_set():
                generated = max(len(row.output_ids) for row in owner.rows)
                logger.info("generation cancelled (client gone) after %d tokens", generated)
            owner.emit(None)
        if live:
            group.batch.keep(live)
        group.rows = [group.rows[i] for i in live]
        group.owners = [group.owners[i] for i in live]
