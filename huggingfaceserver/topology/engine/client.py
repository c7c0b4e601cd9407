"""A front's connection to the engine: requests out, their answers routed back by id.

The engine's death shows as the socket's disconnection (ZeroMQ's monitor): every waiting
request then fails with :class:`~huggingfaceserver.errors.EngineDied` (a 503) and
:meth:`EngineClient.wait_lost` returns, so the front stops rather than serving half.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from ...backends.row_tokenizer import Row
from ...errors import BadRequest, EngineDied, StartupError
from ...generation.params import ChoiceDelta, SamplingParams
from .channel import UNENCODABLE, Channel, new_socket
from .messages import (
    Abort,
    Deltas,
    EngineState,
    Failed,
    Finished,
    Generate,
    Hello,
    Message,
    Results,
    encode,
    failure_error,
    pack_rows,
)

logger = logging.getLogger(__name__)

ENGINE_STOPPED = "the engine process stopped"

DeltaQueue = asyncio.Queue[list[ChoiceDelta] | BaseException | None]
"""A generation's token deltas, step by step; None once every choice ended."""


class EngineClient:
    """One per front process; every method but :meth:`wait_ready` runs on its event loop."""

    def __init__(self, address: str, front: int, fronts: int):
        self.address = address
        self.front = front
        self.fronts = fronts
        self.state: EngineState | None = None
        self.serving = threading.Event()
        """Set once the engine has loaded the model and every front is up (or it is lost)."""
        self.lost = False
        self.ids = itertools.count(1)
        self.waiting: dict[int, asyncio.Future[list[Any]] | DeltaQueue] = {}
        self.handlers: dict[type, Callable[[Any], None]] = {
            EngineState: self._on_state,
            Results: self._on_results,
            Deltas: self._on_deltas,
            Finished: self._on_finished,
            Failed: self._on_failed,
        }
        self._lost_event: asyncio.Event | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Connect and say hello (the engine answers with its state)."""
        loop = asyncio.get_running_loop()
        self._lost_event = asyncio.Event()
        self.context = zmq.asyncio.Context()
        self.socket = new_socket(self.context, zmq.DEALER)
        monitor = self.socket.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self.socket.connect(self.address)
        self.channel = Channel(self.socket, self._receive, loop)
        self._tasks = [
            asyncio.create_task(self.channel.run()),
            asyncio.create_task(self._watch(monitor)),
        ]
        self.channel.send(Hello(self.front))

    def wait_ready(self, timeout: float | None = None) -> EngineState:
        """Block (off the loop) until the model is loaded and every front is up."""
        if not self.serving.wait(timeout):
            raise StartupError(f"the engine was not ready within {timeout} s")
        if self.lost or self.state is None:
            raise StartupError("the engine process stopped before the model was loaded")
        return self.state

    async def wait_lost(self) -> None:
        assert self._lost_event is not None, "start() first"
        await self._lost_event.wait()

    async def encode(self, rows: list[Row], kind: str) -> list[Any]:
        """The engine's results for a request's rows; cancelling aborts it there."""
        self._check_alive()
        request_id = next(self.ids)
        future: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        self.waiting[request_id] = future
        self.channel.send(pack_rows(request_id, rows, kind))
        try:
            return await future
        except asyncio.CancelledError:
            if self.waiting.pop(request_id, None) is not None:
                self.channel.send(Abort(request_id))
            raise

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, adapter: str | None
    ) -> tuple[int, DeltaQueue]:
        """Start a generation: its id (for :meth:`abort`) and the queue of its deltas."""
        self._check_alive()
        request_id = next(self.ids)
        message = Generate(request_id, prompt_ids, params, adapter)
        try:  # here, not with the other messages leaving in the loop's next turn
            encode([message])
        except UNENCODABLE as exc:  # a client's integer past 64 bits (a top_k, a token id)
            raise BadRequest(f"a number in the request is out of range: {exc}") from None
        queue: DeltaQueue = asyncio.Queue()
        self.waiting[request_id] = queue
        self.channel.send(message)
        return request_id, queue

    def abort(self, request_id: int, choices: list[int] | None = None) -> None:
        """Stop some choices of a generation, or (``choices`` None) the whole request, which
        is then forgotten here."""
        if choices is None and self.waiting.pop(request_id, None) is None:
            return  # finished, failed or aborted already
        if not self.lost:
            self.channel.send(Abort(request_id, choices))

    def close(self) -> None:
        """Stop receiving and close the sockets (the monitor's too: ``term`` would wait for
        it forever)."""
        for task in self._tasks:
            task.cancel()
        if hasattr(self, "context"):
            self.context.destroy(linger=0)

    def _check_alive(self) -> None:
        if self.lost:
            raise EngineDied(ENGINE_STOPPED)

    def _receive(self, _peer: bytes | None, message: Message) -> None:
        handler = self.handlers.get(type(message))
        if handler is None:
            logger.error("unexpected message from the engine: %s", type(message).__name__)
        else:
            handler(message)

    def _on_state(self, state: EngineState) -> None:
        self.state = state
        if state.loaded and state.fronts >= self.fronts:
            self.serving.set()

    def _on_results(self, message: Results) -> None:
        future = self.waiting.pop(message.id, None)
        if isinstance(future, asyncio.Future) and not future.done():
            future.set_result(message.results)

    def _on_deltas(self, message: Deltas) -> None:
        queue = self.waiting.get(message.id)
        if isinstance(queue, asyncio.Queue):
            queue.put_nowait(message.deltas)

    def _on_finished(self, message: Finished) -> None:
        queue = self.waiting.pop(message.id, None)
        if isinstance(queue, asyncio.Queue):
            queue.put_nowait(None)

    def _on_failed(self, message: Failed) -> None:
        self._fail(self.waiting.pop(message.id, None), failure_error(message))

    @staticmethod
    def _fail(waiter: asyncio.Future[list[Any]] | DeltaQueue | None, error: Exception) -> None:
        if isinstance(waiter, asyncio.Future):
            if not waiter.done():
                waiter.set_exception(error)
        elif waiter is not None:
            waiter.put_nowait(error)

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        """Mark the engine lost when its connection drops after it was up."""
        connected = False
        while True:
            try:
                event = parse_monitor_message(await monitor.recv_multipart())
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            if event["event"] == zmq.EVENT_CONNECTED:
                connected = True
            elif event["event"] == zmq.EVENT_DISCONNECTED and connected:
                self._engine_lost()
                return

    def _engine_lost(self) -> None:
        logger.error(ENGINE_STOPPED)
        self.lost = True
        error = EngineDied(ENGINE_STOPPED)
        waiting, self.waiting = self.waiting, {}
        for waiter in waiting.values():
            self._fail(waiter, error)
        self.serving.set()
        if self._lost_event is not None:
            self._lost_event.set()
