"""A ZeroMQ socket on an asyncio loop: messages out from any thread, in to a callback.

Messages sent during one event-loop turn travel together, one zmq message per peer, so a
batch that settles many requests costs one send. High-water marks are off: a ROUTER socket
drops what it cannot queue, and nothing may be lost.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from ...backends.loop_calls import LoopCalls
from .messages import Failed, Message, decode, encode

logger = logging.getLogger(__name__)

Receive = Callable[[bytes | None, Message], None]
"""Called on the loop with the peer (a ROUTER's: the sender's identity; else None) and a
message."""


def new_socket(context: zmq.asyncio.Context, kind: int) -> zmq.asyncio.Socket:
    socket = context.socket(kind)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    return socket


class Channel:
    """Sends and receives :mod:`.messages` on one socket (ROUTER: per peer; DEALER: to its
    one peer)."""

    def __init__(
        self, socket: zmq.asyncio.Socket, receive: Receive, loop: asyncio.AbstractEventLoop
    ):
        self.socket = socket
        self.receive = receive
        self.loop = loop
        self.router = socket.type == zmq.ROUTER
        self.lock = threading.Lock()
        self.pending: list[tuple[bytes | None, Message]] = []
        self.scheduled = False
        self.calls = LoopCalls.of(loop)

    def send(self, message: Message, peer: bytes | None = None) -> None:
        """Queue ``message`` (from any thread); it leaves in the loop's next turn (after the
        end of a :func:`~..loop_calls.deferred` block)."""
        with self.lock:
            self.pending.append((peer, message))
            if self.scheduled:
                return
            self.scheduled = True
        self.calls.call(self._flush)

    def _flush(self) -> None:
        with self.lock:
            pending, self.pending = self.pending, []
            self.scheduled = False
        by_peer: dict[bytes | None, list[Message]] = {}
        for peer, message in pending:
            by_peer.setdefault(peer, []).append(message)
        for peer, messages in by_peer.items():
            payload = _encode_all(messages)
            frames = [peer, payload] if self.router and peer is not None else [payload]
            self.socket.send_multipart(frames)

    async def run(self) -> None:
        """Receive until the socket closes."""
        while True:
            try:
                frames = await self.socket.recv_multipart()
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            peer = frames[0] if self.router else None
            try:
                messages = decode(frames[-1])
            except msgspec.DecodeError as exc:
                logger.error("dropped a malformed message: %s", exc)
                continue
            for message in messages:
                try:
                    self.receive(peer, message)
                except Exception:  # one bad message, not the end of all receiving
                    logger.exception("a %s message failed", type(message).__name__)


UNENCODABLE = (TypeError, ValueError, OverflowError, msgspec.EncodeError)
"""What msgspec raises for a message it cannot encode (an integer past 64 bits: OverflowError)."""


def _encode_all(messages: list[Message]) -> bytes:
    """The messages in one payload; one that cannot be encoded becomes the failure of its
    request rather than losing the others."""
    try:
        return encode(messages)
    except UNENCODABLE:
        safe: list[Message] = []
        for message in messages:
            try:
                encode([message])
            except UNENCODABLE as exc:
                request_id = getattr(message, "id", -1)
                logger.error("cannot send the answer to request %s: %s", request_id, exc)
                message = Failed(request_id, 500, f"the engine's answer could not be sent: {exc}")
            safe.append(message)
        return encode(safe)
