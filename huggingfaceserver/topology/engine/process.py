"""The engine process: owns the model and its batching, serves every front over one socket.

Encoder rows from all fronts join the one encoder batcher; generation requests join the one
decode loop (rows without text: the fronts make it). Results and token deltas go back to the
front that asked, coalesced per event-loop turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from ...backends.base import EncoderBackend, GenerationBackend
from ...backends.batching import EncodeRequest
from ...backends.pytorch.decode_loop import DecodeRequest
from ...backends.pytorch.generator import TransformersGenerator
from ...backends.pytorch.sequence import SequenceState
from ...backends.tokenizing import TokenizingEncoder
from ...cli import ServerConfig
from ...encoder_tasks.base import unsupported_output
from ...encoder_tasks.params import Output
from ...errors import BadRequest, NotReady, ServerError
from ...generation.params import ChoiceDelta
from ...loading import freeze_loaded_heap, tokenizer_class_name
from ...observability.metrics import model_loaded
from . import STOP_SIGNAL
from .channel import Channel, new_socket
from .messages import (
    Abort,
    Deltas,
    Encode,
    EngineState,
    Finished,
    Generate,
    Hello,
    Message,
    ModelFacts,
    Results,
    failure,
    unpack_rows,
)

logger = logging.getLogger(__name__)

KINDS = frozenset(output.value for output in Output)
"""The results an encoder row may ask for (:class:`Output`)."""

FRONTS_WAIT_S = 120.0
"""How long a loaded engine waits for the fronts before it times its forward pass anyway."""
Key = tuple[bytes, int]
"""A request in the engine: the front's identity and the front's id for it."""


class Engine:
    """Serves one loaded backend to the fronts that connect to ``address``."""

    def __init__(
        self,
        backend: EncoderBackend | GenerationBackend,
        address: str,
        fronts: int,
        model_name: str = ServerConfig.model_name,
    ):
        self.backend = backend
        self.address = address
        self.expected_fronts = fronts
        self.model_name = model_name
        self.loaded = False
        self.fronts: dict[bytes, int] = {}
        self.all_fronts = asyncio.Event()
        self.live: dict[Key, EncodeRequest | DecodeRequest] = {}
        self.compiling: dict[Key, asyncio.Task[None]] = {}
        """Generations whose grammar is being compiled, in a worker thread."""
        self.handlers: dict[type, Callable[[bytes, Any], None]] = {
            Hello: self.hello,
            Encode: self.encode,
            Generate: self.generate,
            Abort: self.abort,
        }

    async def run(self) -> None:
        """Serve until :data:`STOP_SIGNAL`; a model that cannot load raises
        :class:`StartupError`."""
        loop = asyncio.get_running_loop()
        context = zmq.asyncio.Context()
        socket = new_socket(context, zmq.ROUTER)
        socket.bind(self.address)
        self.channel = Channel(socket, self.receive, loop)
        stopped = asyncio.Event()
        loop.add_signal_handler(STOP_SIGNAL, stopped.set)
        receiving = asyncio.create_task(self.channel.run())
        loading = asyncio.create_task(self.load())
        try:
            done, _ = await asyncio.wait(
                {loading, asyncio.create_task(stopped.wait())}, return_when=asyncio.FIRST_COMPLETED
            )
            if loading in done:
                loading.result()  # raises StartupError when the model cannot load
                await stopped.wait()
            logger.info("engine stopping")
        finally:
            self.backend.shutdown()
            receiving.cancel()
            context.destroy(linger=0)

    async def load(self) -> None:
        started = time.perf_counter()
        await asyncio.to_thread(self.backend.load)
        # timings are only worth taking once the fronts have started (they import and load
        # tokenizers meanwhile, on the same cores) and wait for the engine
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.all_fronts.wait(), FRONTS_WAIT_S)
        await asyncio.to_thread(self.backend.tune)
        freeze_loaded_heap()
        self.loaded = True
        model_loaded(self.model_name, time.perf_counter() - started)
        logger.info("engine: model loaded; %d front(s) connected", len(self.fronts))
        self.broadcast()

    def state(self) -> EngineState:
        if not self.loaded:
            return EngineState(False, len(self.fronts))
        facts, encoder = None, None
        backend = self.backend
        if isinstance(backend, GenerationBackend):
            facts = ModelFacts(
                backend.max_model_len,
                int(getattr(backend, "vocab_size", 0)),
                backend.is_encoder_decoder,
                backend.kv_cache_tokens,
            )
        if isinstance(backend, TokenizingEncoder):
            encoder = backend.facts
        tokenizer = getattr(backend, "tokenizer", None)
        name = None if tokenizer is None else tokenizer_class_name(tokenizer)
        return EngineState(True, len(self.fronts), facts, encoder, name)

    def broadcast(self) -> None:
        state = self.state()
        for peer in self.fronts:
            self.channel.send(state, peer)

    def receive(self, peer: bytes | None, message: Message) -> None:
        handler = self.handlers.get(type(message))
        if handler is None or peer is None:
            logger.error("unexpected message from a front: %s", type(message).__name__)
            return
        handler(peer, message)

    def hello(self, peer: bytes, message: Hello) -> None:
        self.fronts[peer] = message.front
        if len(self.fronts) >= self.expected_fronts:
            self.all_fronts.set()
        logger.info("engine: front %d connected", message.front)
        self.broadcast()

    def encode(self, peer: bytes, message: Encode) -> None:
        backend = self.backend
        if not self.loaded or not isinstance(backend, TokenizingEncoder):
            self.channel.send(failure(message.id, NotReady("the model is not loaded")), peer)
            return
        if message.kind not in KINDS or not backend.task.supports(Output(message.kind)):
            refusal = BadRequest(unsupported_output(message.kind, backend.task.task))
            self.channel.send(failure(message.id, refusal), peer)
            return
        key = (peer, message.id)

        def settle(outcome: list[Any] | BaseException) -> None:
            if self.live.pop(key, None) is None:
                return  # aborted
            if isinstance(outcome, BaseException):
                self.channel.send(failure(message.id, outcome), peer)
            else:
                self.channel.send(Results(message.id, outcome), peer)

        request = EncodeRequest(unpack_rows(message), settle, message.kind)
        self.live[key] = request
        backend.batcher.submit(request)

    def generate(self, peer: bytes, message: Generate) -> None:
        if message.params.constraint is None:
            try:
                rows = self.new_rows(message)
            except ServerError as exc:
                self.channel.send(failure(message.id, exc), peer)
                return
            self.start_generation(peer, message, rows)
        else:  # a grammar is compiled and checked: not on the event loop
            key = (peer, message.id)
            self.compiling[key] = asyncio.create_task(self.generate_constrained(peer, message))

    async def generate_constrained(self, peer: bytes, message: Generate) -> None:
        """:meth:`generate` for a request whose rows compile a grammar (in a worker thread); an
        abort meanwhile cancels it."""
        try:
            rows = await asyncio.to_thread(self.new_rows, message)
        except ServerError as exc:
            self.channel.send(failure(message.id, exc), peer)
            return
        except Exception as exc:  # the front waits for an answer: a 500 that names it
            logger.exception("preparing a constrained generation failed")
            self.channel.send(failure(message.id, exc), peer)
            return
        finally:
            self.compiling.pop((peer, message.id), None)
        self.start_generation(peer, message, rows)

    def new_rows(self, message: Generate) -> list[SequenceState]:
        """The request's rows, checked (token ids only: the front makes the text)."""
        backend = self.backend
        if not self.loaded or not isinstance(backend, TransformersGenerator):
            raise NotReady("the model is not loaded")
        backend.check_request(message.prompt_ids, message.params, message.adapter)
        return backend.new_sequences(message.prompt_ids, message.params, with_text=False)

    def start_generation(self, peer: bytes, message: Generate, rows: list[SequenceState]) -> None:
        backend = self.backend
        assert isinstance(backend, TransformersGenerator)  # new_rows checked it
        key = (peer, message.id)

        def emit(item: list[ChoiceDelta] | BaseException | None) -> None:
            if item is None or isinstance(item, BaseException):
                if self.live.pop(key, None) is None:
                    return  # aborted
                ending = Finished(message.id) if item is None else failure(message.id, item)
                self.channel.send(ending, peer)
            elif key in self.live:
                self.channel.send(Deltas(message.id, item), peer)

        request = DecodeRequest(rows, emit, message.adapter)
        self.live[key] = request
        try:
            backend.batcher.submit(request)
        except NotReady as exc:
            emit(exc)

    def abort(self, peer: bytes, message: Abort) -> None:
        key = (peer, message.id)
        if key in self.compiling:  # no rows yet: some choices cannot have ended
            if message.choices is None:
                self.compiling.pop(key).cancel()
            return
        request = self.live.get(key)
        if isinstance(request, DecodeRequest) and message.choices is not None:
            for index in message.choices:
                request.rows[index].aborted = True
            return
        self.live.pop(key, None)
        if isinstance(request, DecodeRequest):
            request.cancelled.set()
            if isinstance(self.backend, TransformersGenerator):
                self.backend.batcher.withdraw(request)
        elif request is not None:
            request.cancelled = True


def serve_engine(
    backend: EncoderBackend | GenerationBackend, address: str, fronts: int, model_name: str
) -> None:
    """Run the engine in this process until :data:`STOP_SIGNAL` (see :class:`Engine`)."""
    for ignored in (signal.SIGTERM, signal.SIGINT):
        signal.signal(ignored, signal.SIG_IGN)
    asyncio.run(Engine(backend, address, fronts, model_name).run())
