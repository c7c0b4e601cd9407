"""Continuous batching: one decode loop, in one thread, shared by every generation request.

Requests wait in a queue. Between two decode steps the loop admits the waiting ones (first come,
first served, while the running rows stay within ``max_rows`` and their KV cache within its
budget: :mod:`.kv_budget`): the prompts of the requests
admitted together run as one left-padded forward where the model allows it (grouped by length,
so that padding stays bounded; requests that score their prompts apart from the others, in
groups of a bounded size), then their rows join the running batch. Where the running
batch's model allows it (:mod:`.ragged`), the prompts of requests admitted while it runs
(not scored, at most ``part_tokens`` prompt tokens a step; with LoRA adapters, each token
with its own adapter where they allow it) are fed in its next decode step's own forward
instead, their rows joining it there:
admitting them costs the running rows no forward of their own. A prompt longer than
``part_tokens`` (``--prefill_chunk_tokens``) is fed in parts instead, at most that many
prompt tokens a turn, into a batch of its own until it is all in (chunked prefill, as
vLLM's): each part in the running rows' decode step where that batch's model allows it
(a scored prompt's parts too, every position's logits kept),
else in a forward of its own between their steps. A long prompt delays the others' next
tokens by one part's forward, not by its whole prompt's.
Every step then feeds all running rows at once (each row's last token, kept on the device);
the rows' :class:`~.sampling.SamplingBatch` (made when the rows change)
chooses every row's next token with its own settings in one pass, copying to the host once,
and each request receives its own rows' deltas. Finished rows and rows of requests
whose consumer left drop out after the step.

On a GPU the next step is queued ahead (``step_ahead``, as vLLM's asynchronous scheduling):
once a step's tokens are chosen on the device, the next step is queued on them before the host
reads them, so that the device runs it while the host makes the text, finds the stops and
sends the deltas. A row that ends has then fed one step more, whose logits go with it. The
step that feeds new prompts and parts of prompts is queued the same way, in the shadow of the
step queued before it, and its rows join the batch even when that step ended every row before
them. A turn that prefills a prompt in a forward of its own or runs a call first reads the step
queued ahead; a step feeding a prompt's part queues nothing ahead (the last part's rows join
the batch after it), nor does a second running batch.

The failure domain is one request. A failing prefill fails its own request (a group's prompts
are then run one at a time). A step whose forward fails is retried with each request's rows in
a batch of their own (where the batch splits), so that only the request that breaks the model
fails. What goes wrong in one row after the forward (its sampling settings, logits, grammar,
text, stop strings) fails that row's request alone: the other rows produce exactly what they
would have produced without it. The loop goes on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

import torch

from ...cli import ServerConfig
from ...devices import to_device
from ...errors import NotReady, ServerError
from ...generation.params import ChoiceDelta, TokenLogprob
from ...observability.metrics import DecodeLoopMetrics, Timeline
from ..loop_calls import deferred
from ..worker_calls import WorkerCalls
from .decode_batch import DecodeBatch, PromptPart
from .kv_budget import UNBOUNDED, KvBudget
from .logits import prompt_token_logprobs
from .sampling import SamplingBatch
from .sequence import SequenceState, advance
from .threads import LoopThreads, decode_bucket, prefill_bucket

T = TypeVar("T")

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0
"""How long :meth:`ContinuousBatcher.close` waits for the decode step under way."""
PADDING_LIMIT = 1.5
"""Prompts prefill together while their padded batch holds at most this many times their
tokens."""
SCORED_GROUP_TOKENS = 512
"""Prompts scored together hold at most this many tokens with their padding: their forward
keeps the logits of every position (``[tokens, vocabulary]``). A longer prompt is scored alone
(in parts where it is longer than ``part_tokens``); a forward of this many tokens already
reads the weights once for many."""

Scored = dict["DecodeRequest", list[TokenLogprob | None]]
"""The prompt logprobs of the requests that score their prompts, by request."""
Emit = Callable[[list[ChoiceDelta] | BaseException | None], None]
"""Where a request's output goes: each step's deltas, then None, or the exception that ended
it."""


@dataclass(eq=False)
class DecodeRequest:
    """One generation request: its ``n`` rows (sharing one prompt) and where its deltas go."""

    rows: list[SequenceState]
    emit: Emit
    adapter: str | None = None
    """The LoRA adapter its rows decode with (None: the base model)."""
    cancelled: threading.Event = field(default_factory=threading.Event)
    """Set by the consumer when it leaves; its rows then stop at the next step."""
    timeline: Timeline = field(default_factory=Timeline)
    ended: bool = False
    """Set once its last word (None or a failure) has been emitted."""
    resumed: bool = False
    """Set when it left the running rows for the KV cache's budget (preempted): it is fed
    again from its prompt and the tokens it generated so far."""
    running: bool = False
    """Whether it is counted as running (``vllm:num_requests_running``): admitted, and not
    preempted or ended since."""

    @property
    def prompt_ids(self) -> list[int]:
        """What is fed before its next token: the prompt, and once :attr:`resumed` the tokens
        its (one) row generated so far."""
        row = self.rows[0]
        return [*row.prompt_ids, *row.output_ids] if self.resumed else row.prompt_ids

    @property
    def prompt_logprobs(self) -> int | None:
        """How many top tokens each prompt token's logprob comes with (None: not scored, or
        scored before it was preempted)."""
        return None if self.resumed else self.rows[0].params.prompt_logprobs

    @property
    def length(self) -> int:
        """The tokens its longest row holds once its latest token is fed."""
        return len(self.rows[0].prompt_ids) + max(len(row.output_ids) for row in self.rows)

    @property
    def preemptible(self) -> bool:
        """Whether it can leave the running rows and go on later (:attr:`resumed`): one row
        (``n`` rows would each need their own tokens fed again)."""
        return len(self.rows) == 1

    @property
    def reach(self) -> int:
        """The tokens its rows may reach: the prompt and its ``max_tokens``."""
        return len(self.rows[0].prompt_ids) + self.rows[0].budget


@dataclass(eq=False)
class Prefilling:
    """An admitted request whose prompt is fed in parts, and how many of its tokens are in."""

    request: DecodeRequest
    batch: DecodeBatch
    fed: int = 0
    scores: list[TokenLogprob | None] = field(default_factory=list)
    """The prompt logprobs of the tokens fed so far, when the request scores its prompt."""


FedPart = tuple[Prefilling, int]
"""A prompt fed in parts, and how many of its tokens this turn feeds."""


@dataclass(eq=False)
class Running:
    """A decode batch and, for each of its rows, the row and the request it belongs to."""

    batch: DecodeBatch
    rows: list[SequenceState]
    owners: list[DecodeRequest]
    sampler: SamplingBatch | None = None
    """The sampling side of the rows, remade when they change (see :meth:`sampling`)."""
    ahead: torch.Tensor | None = None
    """The logits of the rows' next decode step, queued before the host read this step's
    tokens (:meth:`ContinuousBatcher._step_ahead`); the rows that ended since are dropped."""
    ahead_error: Exception | None = None
    """What queueing that step raised: the next turn's step fails with it."""
    joined_ahead: int = 0
    """Rows that the step queued ahead adds to the batch after :attr:`rows` (the requests whose
    prompts it feeds, :meth:`ContinuousBatcher._feed_ahead`), until it is read."""
    parts_ahead: bool = False
    """Whether the step queued ahead feeds parts of prompts fed in parts: its logits are read
    for them even where every row of the batch ends before."""

    @property
    def pending(self) -> bool:
        """Whether a step queued ahead waits to be read."""
        return self.ahead is not None or self.ahead_error is not None

    def take_ahead(self) -> tuple[torch.Tensor | None, Exception | None]:
        """The step queued ahead (its logits, or what queueing it raised), no longer pending."""
        taken = self.ahead, self.ahead_error
        self.ahead = self.ahead_error = None
        self.joined_ahead = 0
        self.parts_ahead = False
        return taken

    def sampling(self, logits: torch.Tensor) -> SamplingBatch:
        """The rows' sampling batch: the one of the last step while the rows are the same."""
        self.sampler = SamplingBatch.for_rows(self.rows, logits, self.sampler)
        return self.sampler

    def inputs(self) -> torch.Tensor | list[int]:
        """Each row's latest token: on the device where the last step left them for these
        rows, else from the rows."""
        tokens = self.device_tokens()
        return tokens if tokens is not None else [row.output_ids[-1] for row in self.rows]

    def device_tokens(self) -> torch.Tensor | None:
        """The rows' latest tokens on the device, where the last step left them for these
        rows (None: the rows changed since, or the choice was redone row by row and the
        device lags)."""
        sampler = self.sampler
        return sampler.tokens if sampler is not None and sampler.serves(self.rows) else None


def let_go(batch: DecodeBatch) -> None:
    """Keep nothing of a batch the loop is done with."""


class ContinuousBatcher:
    """The shared decode loop; ``submit`` from any thread, ``close`` once at shutdown."""

    def __init__(
        self,
        new_batch: Callable[[], DecodeBatch],
        max_rows: int,
        model_name: str = ServerConfig.model_name,
        part_tokens: int = ServerConfig.prefill_chunk_tokens,
        retire: Callable[[DecodeBatch], None] = let_go,
        settle: Callable[[DecodeBatch], None] = let_go,
        step_ahead: bool = False,
        kv_budget: KvBudget = UNBOUNDED,
    ):
        self.new_batch = new_batch
        self.kv_budget = kv_budget
        """What the running rows' KV cache may hold: a request waits while its rows with the
        running ones, times the longest of them, would exceed it."""
        self.step_ahead = step_ahead
        """Whether a batch's next decode step is queued before the host reads its tokens
        (:meth:`_step_ahead`): on a GPU, where the step then runs while the host makes the
        text; on a CPU the forward runs as it is queued, and there is nothing to overlap."""
        self.stepped_ahead = 0
        """Decode steps queued ahead so far."""
        self.retire = retire
        """Called with each batch whose rows have all ended (not one whose forward failed):
        the batch's maker may keep its KV cache for the next one."""
        self.settle = settle
        """Called with each batch whose prompts ran and whose rows then run on their own (no
        running batch absorbed them): the batch's maker may move them into the cache it
        kept."""
        self.max_rows = max_rows
        self.part_tokens = part_tokens
        """Prompt tokens fed in parts per turn of the loop (``--prefill_chunk_tokens``)."""
        self.prefilling: deque[Prefilling] = deque()
        self.metrics = DecodeLoopMetrics(model_name)
        self.waiting: deque[DecodeRequest] = deque()
        self.running: list[Running] = []
        self.calls = WorkerCalls()
        self.threads = LoopThreads()
        """torch's threads for each forward (:meth:`TransformersGenerator.tune` sets them)."""
        self.wake = threading.Condition()
        self.closed = False
        self.stopped: ServerError = NotReady("the server is shutting down")
        """What requests fail with once closed (:meth:`close`)."""
        self.thread = threading.Thread(target=self._loop, name="decode", daemon=True)
        self.thread.start()

    def submit(self, request: DecodeRequest) -> None:
        """Queue a request; it joins the running batch before the next decode step."""
        with self.wake:
            if self.closed:
                raise self.stopped
            self.waiting.append(request)
            self.metrics.queue_length(len(self.waiting), 1)
            self.wake.notify()

    def withdraw(self, request: DecodeRequest) -> None:
        """A request whose client left (:attr:`DecodeRequest.cancelled` set): where it waits in
        the queue, it leaves it now, not once it reaches the head (the queue's gauge with it,
        which autoscalers read; one preempted before ends there, its end counted). Running
        rows stop at their next step, as before."""
        with self.wake:
            if request.running or request.ended:
                return
            try:
                self.waiting.remove(request)
            except ValueError:  # not queued yet, or being preempted: the head drops it
                return
            self.metrics.queue_length(len(self.waiting), -1)
            if request.resumed:
                self._end(request, None)

    def run_on_loop(self, function: Callable[[], T]) -> T:
        """``function()`` on the decode thread, waited for: torch's CPU threads must be set on
        the thread that runs the forward passes (OpenMP keeps a team per calling thread)."""
        with self.wake:
            if self.closed:
                raise self.stopped
            done = self.calls.add(function)
            self.wake.notify()
        return done.result()

    def close(self, error: ServerError | None = None, timeout: float = STOP_TIMEOUT_S) -> bool:
        """Stop the loop after the step under way; requests still waiting or running end with
        ``error`` (by default: the server is shutting down), and so do later ones. Idempotent.
        Returns whether the loop has stopped (False: its step outlasted ``timeout``)."""
        with self.wake:
            if not self.closed and error is not None:
                self.stopped = error
            self.closed = True
            self.wake.notify()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout)
        return not self.thread.is_alive()

    @property
    def running_rows(self) -> int:
        """The rows admitted: decoding, or whose prompt is being fed in parts."""
        decoding = sum(len(group.rows) for group in self.running)
        return decoding + sum(len(part.request.rows) for part in self.prefilling)

    def _loop(self) -> None:
        while True:
            with self.wake:
                while not (
                    self.waiting or self.running or self.prefilling or self.closed or self.calls
                ):
                    self.wake.wait()
                if self.closed:
                    break
                admitted = self._admit()
                calls = bool(self.calls)
            try:
                self._turn(admitted, calls)
            except Exception as exc:  # a bug: what is in flight fails, the loop goes on
                logger.exception("a turn of the decode loop failed: its requests end")
                self._fail_turn(admitted, exc)
        self._stop()

    def _turn(self, admitted: list[DecodeRequest], calls: bool) -> None:
        """One turn of the loop: the calls, then the admitted requests' prompts and the
        prompts' parts fed, then a decode step of every running batch."""
        if calls:  # a call may change the model: it runs with nothing queued over it
            with torch.inference_mode(), deferred():
                self._catch_up()
        self.calls.run()
        with torch.inference_mode(), deferred():  # loops woken once per step
            whole = self._begin_in_parts(admitted)
            joining, whole = self._mixable(whole)
            if whole:  # their rows join the running batch: after the step queued ahead
                self._catch_up()
            for requests in prefill_groups(whole):
                self._start(requests)
            packed, alone = self._packable(self._parts())
            if alone:  # a prompt whose last part runs alone joins the running batch too
                self._catch_up()
            self._feed_alone(alone)
            if joining and not self.running:  # the rows they were to join ended meanwhile
                for requests in prefill_groups(joining):
                    self._start(requests)
                joining = []
            first = self.running[0] if self.running else None
            for group in list(self.running):
                if group is first:
                    self._step(group, joining, packed)
                else:
                    self._step(group)

    def _fail_turn(self, admitted: list[DecodeRequest], exc: Exception) -> None:
        """After a turn raised what no step caught (a bug, not a request's failure): every
        request it admitted, running or fed in parts ends with a 500 naming it, and their
        batches are let go, so that no request waits for ever and later ones are served."""
        with deferred():
            self._end_in_flight(ServerError(f"the decode loop failed: {exc!r}"), admitted)

    def _end_in_flight(
        self, error: ServerError, admitted: list[DecodeRequest] | None = None
    ) -> None:
        """Every running request, every one fed in parts and the ``admitted`` ones end with
        ``error``; their batches (their KV caches) are let go."""
        requests = [
            *(admitted or []),
            *(owner for group in self.running for owner in group.owners),
            *(part.request for part in self.prefilling),
        ]
        self.running.clear()
        self.prefilling.clear()
        for request in dict.fromkeys(requests):
            self._end(request, error)

    def _catch_up(self) -> None:
        """Read the steps queued ahead, queueing nothing after them."""
        for group in list(self.running):
            if group.pending:
                self._step(group, ahead=False)

    def _stop(self) -> None:
        """On the loop's thread as it ends: every request and pending call fails, and the
        running batches (their KV caches) are let go."""
        with self.wake:
            waiting, self.waiting = list(self.waiting), deque()
        self.metrics.queue_length(0, -len(waiting))
        with deferred():
            for request in waiting:
                request.emit(self.stopped)
            self._end_in_flight(self.stopped)
        self.calls.fail(self.stopped)

    def _admit(self) -> list[DecodeRequest]:
        """Take the waiting requests whose rows fit, in number and in the KV cache budget (the
        first one always fits an idle loop)."""
        admitted: list[DecodeRequest] = []
        rows = self.running_rows
        bounded = bool(self.waiting) and self.kv_budget.tokens is not None
        # admitted rows are counted as joining the first batch, sharing its columns, as the
        # prompts fed in parts will once their last part is in
        first = self.running[0] if self.running else None
        parts = [part.request for part in self.prefilling]
        joined = (len(first.rows) if first else 0) + sum(len(r.rows) for r in parts)
        widths = (len(request.prompt_ids) + 1 for request in parts)  # and its first token
        columns = max([first.batch.columns if first else 0, *widths])
        others = self._cells(but=first, parts=False) if bounded else 0
        queued = len(self.waiting)
        now = time.perf_counter()
        while self.waiting:
            head = self.waiting[0]
            if head.ended:  # its turn failed after it was preempted: nothing left to feed
                pass
            elif not head.cancelled.is_set():
                after = rows + len(head.rows)
                wide = max(columns, len(head.prompt_ids) + 1)
                room = wide  # rows that cannot leave get room for all they may reach
                if bounded and not head.preemptible:
                    room = max(wide, head.reach, self._reserved(admitted))
                grown = others + (joined + len(head.rows)) * room
                if rows and (
                    after > self.max_rows or (bounded and not self.kv_budget.admits(grown))
                ):
                    break
                admitted.append(head)
                head.running = True
                self.metrics.admitted(head.timeline, now, again=head.resumed)
                rows, joined, columns = after, joined + len(head.rows), wide
            elif head.resumed:  # admitted before: its end is counted
                self._end(head, None)
            self.waiting.popleft()
        if queued != len(self.waiting):
            self.metrics.queue_length(len(self.waiting), len(self.waiting) - queued)
        return admitted

    def _reserved(self, admitted: list[DecodeRequest]) -> int:
        """The most tokens an admitted request that cannot leave the rows may reach (running,
        fed in parts, or just ``admitted``)."""
        requests = [*admitted, *(part.request for part in self.prefilling)]
        requests += [owner for group in self.running for owner in group.owners]
        return max((r.reach for r in dict.fromkeys(requests) if not r.preemptible), default=0)

    def _cells(self, grow: int = 0, but: Running | None = None, parts: bool = True) -> int:
        """The token cells the admitted rows' KV caches hold (each batch's rows times its
        columns, each grown by ``grow`` more; with ``parts``, a prompt fed in parts counted
        whole), but those of batch ``but``."""
        cells = sum(
            len(group.rows) * (group.batch.columns + grow)
            for group in self.running
            if group is not but
        )
        if not parts:
            return cells
        return cells + sum(len(p.request.rows) * len(p.request.prompt_ids) for p in self.prefilling)

    def _over_budget(self, group: Running, live: list[int]) -> list[DecodeRequest]:
        """The requests of this batch that leave it (preempted: the latest to arrive first,
        those of one row, :attr:`DecodeRequest.preemptible`) while the admitted rows (``live``
        of this batch's), grown by their next step (two with one queued ahead), exceed the KV
        cache budget; none while they fit, and the last row stays."""
        grow = 2 if self.step_ahead else 1
        outside = self._cells(grow, but=group)
        if self.kv_budget.holds(outside + len(live) * (group.batch.columns + grow)):
            return []
        mine = dict.fromkeys(group.owners[i] for i in live)
        lengths = {request: request.length for request in mine}
        leaving: list[DecodeRequest] = []
        for request in sorted(mine, key=lambda r: r.timeline.arrived, reverse=True):
            staying = sum(len(r.rows) for r in mine)
            # the columns the rows that stay will hold: as wide as now where they do not narrow
            widest = max(lengths[r] for r in mine) if group.batch.narrows else group.batch.columns
            longest = widest + grow
            if self.kv_budget.holds(outside + staying * longest) or staying <= 1:
                break
            if request.preemptible:
                del mine[request]
                leaving.append(request)
        return leaving

    def _preempt(self, requests: list[DecodeRequest]) -> None:
        """Back to the head of the queue, in their order of arrival, to be fed again once
        there is room (their rows have left the batch)."""
        for request in requests:
            request.resumed, request.running = True, False
            self.metrics.preempted()
            logger.info(
                "a request left the running rows for the KV cache budget after %d tokens; it "
                "goes on once there is room",
                len(request.rows[0].output_ids),
            )
        with self.wake:
            self.waiting.extendleft(sorted(requests, key=lambda r: r.timeline.arrived)[::-1])
            self.metrics.queue_length(len(self.waiting), len(requests))

    def _start(self, requests: list[DecodeRequest]) -> None:
        """Run the requests' prompts (together, where the model allows it), emit their first
        tokens, merge their rows into the running batch."""
        batch = self.new_batch()
        if len(requests) > 1 and not batch.prefills_together:
            for request in requests:
                self._start([request])
            return
        try:
            scored: Scored | None = None
            if len(requests) == 1:
                [request] = requests
                num_top = request.prompt_logprobs
                logits, prompt_logits = self.threads.run(
                    prefill_bucket(len(request.prompt_ids)),
                    lambda: batch.prefill(
                        request.prompt_ids,
                        len(request.rows),
                        score_prompt=num_top is not None,
                        adapter=request.adapter,
                    ),
                )
                if prompt_logits is not None and num_top is not None:
                    top = prompt_token_logprobs(prompt_logits, request.prompt_ids, num_top)
                    scored = {request: top}
            else:
                prompts = [request.prompt_ids for request in requests]
                args = (
                    prompts,
                    [len(request.rows) for request in requests],
                    [request.adapter for request in requests],
                )
                bucket = prefill_bucket(len(prompts) * max(map(len, prompts)))  # padded
                if requests[0].prompt_logprobs is None:
                    logits = self.threads.run(bucket, lambda: batch.prefill_together(*args))
                else:  # a group of requests that score their prompts (prefill_groups)
                    logits, every = self.threads.run(
                        bucket, lambda: batch.prefill_scoring_together(*args)
                    )
                    scored = {}
                    for request, prompt_logits in zip(requests, every, strict=True):
                        num_top = request.prompt_logprobs
                        assert num_top is not None  # prefill_groups keeps the kinds apart
                        top = prompt_token_logprobs(prompt_logits, request.prompt_ids, num_top)
                        scored[request] = top
        except Exception as exc:  # its request fails, not the loop
            if len(requests) == 1:
                self._end(requests[0], exc)
            else:  # one at a time: a prompt that breaks the model fails only its request
                for request in requests:
                    self._start([request])
            return
        self._join(requests, batch, logits, scored)

    def _join(
        self,
        requests: list[DecodeRequest],
        batch: DecodeBatch,
        logits: torch.Tensor,
        scored: Scored | None = None,
    ) -> None:
        """After the requests' prompts ran: their first tokens (with the prompt logprobs of
        those that score their prompts: ``scored``), then their rows join the running batch."""
        rows = [row for request in requests for row in request.rows]
        owners = [request for request in requests for _ in request.rows]
        group = Running(batch, rows, owners)
        try:
            self._advance(group, logits, first=True, prompt_logprobs=scored)
        except Exception as exc:
            for request in requests:
                self._end(request, exc)
            return
        if not group.rows:
            self.retire(batch)
            return
        joined = self.running[0] if self.running else None
        if joined is not None and joined.batch.absorb(group.batch):
            joined.rows += group.rows
            joined.owners += group.owners
        else:
            self.settle(group.batch)
            self.running.append(group)

    def _begin_in_parts(self, admitted: list[DecodeRequest]) -> list[DecodeRequest]:
        """Set aside the admitted requests whose prompt is fed in parts, on a model that
        allows it: a prompt longer than a part, and a scored prompt that the running rows'
        decode step can feed (as one part: its forward keeps every position's logits, which
        a prompt joining the rows' own cache does not); the others, whose prompts run
        whole."""
        whole = []
        running = self.running[0].batch if self.running else None
        for request in admitted:
            scored_beside = (
                request.prompt_logprobs is not None
                and running is not None
                and running.mixes_for(request.adapter)
            )
            if len(request.prompt_ids) > self.part_tokens or scored_beside:
                batch = self.new_batch()
                if batch.prefills_in_parts:
                    self.prefilling.append(Prefilling(request, batch))
                    continue
            whole.append(request)
        return whole

    def _mixable(
        self, requests: list[DecodeRequest]
    ) -> tuple[list[DecodeRequest], list[DecodeRequest]]:
        """The admitted requests whose prompts the first running batch's next decode step
        feeds (its model and their LoRA adapters allow it; not scored; at most
        :attr:`part_tokens` prompt tokens in all, first come first served), and the others."""
        if not self.running:
            return [], requests
        batch = self.running[0].batch
        joining, others = [], []
        budget = self.part_tokens
        for request in requests:
            length = len(request.prompt_ids)
            if (
                batch.mixes_for(request.adapter)
                and request.prompt_logprobs is None
                and length <= budget
            ):
                joining.append(request)
                budget -= length
            else:
                others.append(request)
        return joining, others

    def _parts(self) -> list[FedPart]:
        """This turn's parts of the prompts fed in parts: at most :attr:`part_tokens` prompt
        tokens, first come first served (a request whose consumer left ends here)."""
        budget = self.part_tokens
        parts: list[FedPart] = []
        for part in list(self.prefilling):
            if not budget:
                break
            request = part.request
            if request.cancelled.is_set():
                self.prefilling.remove(part)
                self._end(request, None)
                continue
            take = min(budget, len(request.prompt_ids) - part.fed)
            parts.append((part, take))
            budget -= take
        return parts

    def _packable(self, parts: list[FedPart]) -> tuple[list[FedPart], list[FedPart]]:
        """The parts the first running batch's next decode step feeds (its model and their
        LoRA adapters allow it), and the others."""
        if not self.running:
            return [], parts
        batch = self.running[0].batch
        packed: list[FedPart] = []
        alone: list[FedPart] = []
        for fed in parts:
            (packed if batch.mixes_for(fed[0].request.adapter) else alone).append(fed)
        return packed, alone

    def _feed_alone(self, parts: list[FedPart]) -> None:
        """Feed these parts, each in a forward of its own (nothing running takes them)."""
        for part, take in parts:
            try:
                logits = self._feed_part(part, take)
            except Exception as exc:  # its request fails, not the loop
                self.prefilling.remove(part)
                self._end(part.request, exc)
                continue
            self._fed(part, take, logits)

    def _feed_part(self, part: Prefilling, take: int) -> torch.Tensor:
        """Feed the next ``take`` tokens of a prompt fed in parts, in a forward of its own:
        the logits after the part's last token ``[V]``, or after every one of them
        ``[take, V]`` when the request scores its prompt."""
        request, start = part.request, part.fed
        ids = request.prompt_ids[start : start + take]
        feed = part.batch.prefill_part if request.prompt_logprobs is None else part.batch.score_part
        return self.threads.run(prefill_bucket(take), partial(feed, ids, start, request.adapter))

    def _fed(self, part: Prefilling, take: int, logits: torch.Tensor) -> None:
        """After the forward that fed a part (its logits as :meth:`_feed_part` returns them):
        the logprobs of its prompt tokens go to :attr:`Prefilling.scores` when the request
        scores its prompt; a request whose prompt is all in joins the running batch. What
        fails here fails the request alone."""
        request, start = part.request, part.fed
        prompt = request.prompt_ids
        last = start + take == len(prompt)
        try:
            num_top = request.prompt_logprobs
            if num_top is not None:
                # position i predicts token i + 1: up to the next part's first, or the end
                targets = prompt[start : start + take + (0 if last else 1)]
                scores = prompt_token_logprobs(logits[:-1] if last else logits, targets, num_top)
                part.scores += scores if start == 0 else scores[1:]  # [0]: None, the first
                logits = logits[-1]
            part.fed += take
            if last:
                part.batch.finish_prefill(len(prompt), len(request.rows))
        except Exception as exc:  # its request fails, not the loop
            self.prefilling.remove(part)
            self._end(request, exc)
            return
        if last:
            self.prefilling.remove(part)
            scored = {request: part.scores} if part.scores else None
            self._join([request], part.batch, logits.expand(len(request.rows), -1), scored)

    def _step(
        self,
        group: Running,
        joining: list[DecodeRequest] | None = None,
        parts: list[FedPart] | None = None,
        ahead: bool | Callable[[], bool] = True,
    ) -> None:
        """One decode step of a batch (the one queued ahead at the last step where there is
        one; ``ahead``: whether this one may queue the next, or what queues it), feeding the
        prompts of the ``joining`` requests and the next ``parts`` of prompts fed in parts in
        the same forward
        (:meth:`~.decode_batch.DecodeBatch.step_mixing`): the joining requests' rows then join
        the batch, as do those of a prompt whose last part it was. A forward that fails is
        retried with each request's rows apart (:meth:`_retry_apart`), after the joining
        requests' prompts and the parts ran on their own (:meth:`_start`,
        :meth:`_feed_alone`); anything else that fails ends the batch's requests."""
        joining, parts = joining or [], parts or []
        fed = [
            PromptPart(
                part.batch,
                part.request.prompt_ids[part.fed : part.fed + take],
                part.fed,
                every_position=part.request.prompt_logprobs is not None,
                adapter=part.request.adapter,
            )
            for part, take in parts
        ]
        if group.pending and (joining or parts) and not group.joined_ahead:
            # the step queued ahead is read first, the one that feeds them queued in its shadow
            queued: list[bool] = []

            def feeding() -> bool:
                queued.append(self._feed_ahead(group, joining, parts, fed))
                return queued[-1]

            self._step(group, ahead=feeding)
            if group not in self.running:
                self._unfed(joining, parts, fed_in_vain=any(queued))
                return
        try:
            if group.pending:
                logits, error = group.take_ahead()
                if error is not None:
                    raise error
                assert logits is not None
            elif joining or parts:
                logits = self._feed(group, group.inputs(), joining, parts, fed)
            else:  # only the first batch replays the recorded steps (one cache for them)
                inputs = group.inputs()
                graphed = group is self.running[0]
                logits = self.threads.run(
                    decode_bucket(len(group.rows)), lambda: group.batch.step(inputs, graphed)
                )
        except Exception as exc:
            if joining or parts:  # as before prompts joined decode steps: each apart
                logger.warning(
                    "a decode step feeding %d prompts failed (%r): running them apart",
                    len(joining) + len(parts),
                    exc,
                )
                self._apart(joining, parts)
                if group.rows:
                    self._step(group)
                else:  # the step read before it ended them all
                    self.running.remove(group)
                    self.retire(group.batch)
            else:
                self._retry_apart(group, exc)
            return
        stepping = len(group.rows) + sum(len(request.rows) for request in joining)
        logits, of_parts = logits[:stepping], logits[stepping:]
        group.rows += [row for request in joining for row in request.rows]
        group.owners += [request for request in joining for _ in request.rows]
        try:
            if stepping:  # none where the step read before ended every row: parts only
                self._advance(group, logits, joining=joining, ahead=ahead)
        except Exception as exc:
            logger.exception("a decode step failed for %d requests", len(set(group.owners)))
            for request in dict.fromkeys(group.owners):
                self._end(request, exc)
            group.rows.clear()
            group.take_ahead()
            self.running.remove(group)
        else:
            if not group.rows and not group.joined_ahead and not group.parts_ahead:
                group.take_ahead()  # the ended rows' next step
                self.running.remove(group)
                self.retire(group.batch)
        for (part, take), feed in zip(parts, fed, strict=True):  # as _feed_part returns them
            own, of_parts = of_parts[: feed.kept], of_parts[feed.kept :]
            self._fed(part, take, own if feed.every_position else own[0])

    def _unfed(self, joining: list[DecodeRequest], parts: list[FedPart], fed_in_vain: bool) -> None:
        """The running batch that was to feed these prompts and parts is gone: its requests
        failed or ended before they joined it. They run apart; but where the step that fed
        them was queued (``fed_in_vain``), the batch failed as a whole while it ran, and they
        fail with it (a part fed again would be in its cache twice)."""
        if not fed_in_vain:
            self._apart(joining, parts)
            return
        error = ServerError("the decode step that fed this prompt failed")
        for request in joining:
            self._end(request, error)
        for part, _ in parts:
            self.prefilling.remove(part)
            self._end(part.request, error)

    def _apart(self, joining: list[DecodeRequest], parts: list[FedPart]) -> None:
        """The prompts and parts a decode step did not feed, each in a forward of its own."""
        for request in joining:
            self._start([request])
        self._feed_alone(parts)

    def _feed(
        self,
        group: Running,
        tokens: torch.Tensor | list[int],
        joining: list[DecodeRequest],
        parts: list[FedPart],
        fed: list[PromptPart],
    ) -> torch.Tensor:
        """The forward of a decode step on ``tokens`` that also feeds the ``joining``
        requests' prompts and the ``parts`` (``fed``: as :class:`PromptPart`), each with its
        LoRA adapter (:meth:`_mixable`, :meth:`_packable`): its logits, as
        :meth:`~.decode_batch.DecodeBatch.step_mixing` returns them."""
        prompts = [request.prompt_ids for request in joining]
        copies = [len(request.rows) for request in joining]
        adapters = [request.adapter for request in joining]
        width = len(group.rows) + sum(map(len, prompts)) + sum(take for _, take in parts)
        return self.threads.run(
            prefill_bucket(width),
            lambda: group.batch.step_mixing(tokens, prompts, copies, adapters, fed),
        )

    def _retry_apart(self, group: Running, exc: Exception) -> None:
        """After a failed forward: each request's rows in a batch of their own, stepped again,
        so that only a request whose rows break the model fails (with its own error)."""
        owners = list(dict.fromkeys(group.owners))
        if len(owners) == 1 or not group.batch.splits:
            logger.warning("a decode step failed for %d requests: %r", len(owners), exc)
            for request in owners:
                self._end(request, exc)
            self.running.remove(group)
            return
        logger.warning(
            "a decode step failed for %d requests (%r): retrying each apart", len(owners), exc
        )
        parts = [group]
        for owner in owners[1:]:
            positions = [i for i, o in enumerate(group.owners) if o is owner]
            moved = group.batch.split(positions)
            parts.append(
                Running(
                    moved,
                    [group.rows[i] for i in positions],
                    [owner] * len(positions),
                    group.sampler,
                )
            )
            kept = [i for i, o in enumerate(group.owners) if o is not owner]
            group.rows = [group.rows[i] for i in kept]
            group.owners = [group.owners[i] for i in kept]
        where = self.running.index(group) + 1
        self.running[where:where] = parts[1:]
        for part in parts:
            self._step(part)

    def _advance(
        self,
        group: Running,
        logits: torch.Tensor,
        first: bool = False,
        prompt_logprobs: Scored | None = None,
        joining: list[DecodeRequest] | None = None,
        ahead: bool | Callable[[], bool] = False,
    ) -> None:
        """Choose the rows' next tokens, send each request its deltas (the first ones with
        the prompt's logprobs, when scored), drop the rows that finished or whose request was
        cancelled. ``first``: every row's first token; ``joining``: the requests whose first
        tokens these are, the others' rows stepping; ``ahead``: the next step may be queued on
        the tokens before they are read (:meth:`_step_ahead`), or what queues it."""
        deltas: dict[DecodeRequest, list[ChoiceDelta]] = {}
        failed: dict[DecodeRequest, Exception] = {}
        then = None
        if ahead and not first and self.step_ahead:  # else the logits need no copy (begin)
            then = ahead if callable(ahead) else partial(self._step_ahead, group)
        outcomes = advance(group.rows, logits, group.sampling(logits), then)
        for owner, outcome in zip(group.owners, outcomes, strict=True):
            if isinstance(outcome, Exception):
                failed.setdefault(owner, outcome)
                continue
            outcome.prompt_logprobs = (
                None if prompt_logprobs is None else prompt_logprobs.get(owner)
            )
            deltas.setdefault(owner, []).append(outcome)
        for owner, error in failed.items():
            deltas.pop(owner, None)
            log_row_failure(error)
            self._end(owner, error)
        starting = deltas.keys() if first else [r for r in joining or [] if r in deltas]
        for request in starting:
            if request.resumed:  # its first token came before it was preempted
                self.metrics.step([request.timeline], len(request.rows))
            else:
                self.metrics.first_tokens(
                    request.timeline, len(request.prompt_ids), len(request.rows)
                )
        if not first:
            stepped = len(group.rows) - sum(len(request.rows) for request in joining or [])
            self.metrics.step((o.timeline for o in deltas if o not in starting), stepped)
        for owner, step in deltas.items():
            owner.emit(step)
        live = [
            i
            for i, (row, owner) in enumerate(zip(group.rows, group.owners, strict=True))
            if row.finish_reason is None
            and not row.aborted
            and not owner.cancelled.is_set()
            and owner not in failed
        ]
        leaving = self._over_budget(group, live) if self.kv_budget.tokens else []
        if leaving:
            live = [i for i in live if group.owners[i] not in leaving]
        if len(live) == len(group.rows):
            return
        remaining = {group.owners[i] for i in live}
        for owner in deltas.keys() - remaining - set(leaving):
            if owner.cancelled.is_set():
                generated = max(len(row.output_ids) for row in owner.rows)
                logger.info("generation cancelled (client gone) after %d tokens", generated)
            self._end(owner, None)
        joined = range(len(group.rows), len(group.rows) + group.joined_ahead)
        group.batch.keep(live + list(joined))  # none: a batch left empty may be kept (retire)
        if group.ahead is not None:  # the ended rows' next logits go, the joined rows' stay
            kept = live + list(range(len(group.rows), group.ahead.shape[0]))
            index = to_device(kept, group.ahead.device, torch.long)
            group.ahead = group.ahead.index_select(0, index)
        group.rows = [group.rows[i] for i in live]
        group.owners = [group.owners[i] for i in live]
        if leaving:
            self._preempt(leaving)

    def _step_ahead(self, group: Running) -> bool:
        """Queue the group's next decode step on the tokens just chosen (on the device),
        before the host reads them: on a GPU that step runs while the host makes this one's
        text and finds its stops (vLLM's asynchronous scheduling). Whether it did: only for the
        one running batch (which replays the recorded steps), with no prompt fed in parts (the
        last part's rows join the batch after this step) and no call to run. A row that ends
        with this step has fed the next one a token more; its logits are dropped with it
        (:meth:`_advance`), its output unchanged. A constrained row's next logits are masked
        when its token is chosen, after the host read this one."""
        tokens = group.device_tokens()
        if not (
            self.step_ahead
            and self.running == [group]
            and not (self.prefilling or self.calls)
            and tokens is not None
        ):
            return False
        try:
            group.ahead = self.threads.run(
                decode_bucket(len(group.rows)), lambda: group.batch.step(tokens, True)
            )
        except Exception as exc:  # the next turn's step fails with it (retried apart)
            group.ahead_error = exc
        self.stepped_ahead += 1
        return True

    def _feed_ahead(
        self,
        group: Running,
        joining: list[DecodeRequest],
        parts: list[FedPart],
        fed: list[PromptPart],
    ) -> bool:
        """Queue the step that feeds the ``joining`` requests' prompts and the ``parts`` (as
        :meth:`_step` would) on the tokens just chosen, before the host reads them; its rows
        join the batch (:attr:`Running.joined_ahead`). Whether it did: a forward that raises
        leaves the batches as they were, and the next read fails with it (they then run
        apart)."""
        tokens = group.device_tokens()
        if not self.step_ahead or tokens is None:
            return False
        try:
            group.ahead = self._feed(group, tokens, joining, parts, fed)
        except Exception as exc:  # the batches as they were: nothing was fed these tokens
            group.ahead_error = exc
            return False
        group.joined_ahead = sum(len(request.rows) for request in joining)
        group.parts_ahead = bool(parts)
        self.stepped_ahead += 1
        return True

    def _end(self, request: DecodeRequest, outcome: BaseException | None) -> None:
        """The last word to an admitted request: None when it is done, or what failed it."""
        if request.ended:  # a step that failed after some of its requests were done
            return
        request.ended = True
        request.emit(outcome)
        self.metrics.finished(
            request.timeline,
            (finished_reason(row, outcome) for row in request.rows),
            max(len(row.output_ids) for row in request.rows),
            request.running,
        )
        request.running = False


def prefill_groups(requests: list[DecodeRequest]) -> list[list[DecodeRequest]]:
    """The admitted requests in groups whose prompts may run as one forward, by prompt length,
    each group's padded batch at most :data:`PADDING_LIMIT` times its tokens. Requests that
    score their prompts are grouped apart from the others (their forward keeps the logits of
    every position), at most :data:`SCORED_GROUP_TOKENS` padded tokens a group."""
    scoring = [r for r in requests if r.prompt_logprobs is not None]
    others = [r for r in requests if r.prompt_logprobs is None]
    return _by_length(scoring, SCORED_GROUP_TOKENS) + _by_length(others, None)


def _by_length(requests: list[DecodeRequest], most_tokens: int | None) -> list[list[DecodeRequest]]:
    """:func:`prefill_groups` for requests of one kind; ``most_tokens``: a bound on a group's
    padded tokens (a longer prompt makes a group alone)."""
    groups: list[list[DecodeRequest]] = []
    group: list[DecodeRequest] = []
    tokens = 0
    for request in sorted(requests, key=lambda r: len(r.prompt_ids)):
        length = len(request.prompt_ids)  # the longest so far: the group's padded length
        padded = (len(group) + 1) * length
        too_many = most_tokens is not None and padded > most_tokens
        if group and (padded > PADDING_LIMIT * (tokens + length) or too_many):
            groups.append(group)
            group, tokens = [], 0
        group.append(request)
        tokens += length
    if group:
        groups.append(group)
    return groups


def log_row_failure(error: Exception) -> None:
    """A request's own rows failed it: the request's fault (a 4xx) is noted, anything else is
    logged with its traceback."""
    if getattr(error, "status_code", 500) < 500:
        logger.info("generation request failed: %s", error)
    else:
        logger.error("generation request failed", exc_info=error)


def finished_reason(row: SequenceState, outcome: BaseException | None) -> str:
    """vLLM's ``finished_reason`` for a choice of a request that ended: a request that failed
    is an error, one whose client left an abort."""
    if row.finish_reason is not None:
        return row.finish_reason
    if row.aborted:  # a stop string, found where the text is made
        return "stop"
    return "error" if outcome is not None else "abort"
