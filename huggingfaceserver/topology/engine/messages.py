"""What the fronts and the engine say to each other: msgpack messages, decoded by type.

Every zmq message carries a list of messages (those queued in one event-loop turn travel
together). Request ids are chosen by the front; the engine keys requests by (front, id).
No pickle: msgspec decodes into these types only, so a malformed message is an error, never
code.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import numpy as np

from ...backends.row_tokenizer import Row
from ...backends.tokenizing import EncoderFacts
from ...errors import BadRequest, NotReady, ServerError
from ...generation.params import ChoiceDelta, SamplingParams

logger = logging.getLogger(__name__)


class Hello(msgspec.Struct, tag="hello", array_like=True):
    """A front is up (its ports are listening) and wants the engine's state."""

    front: int


class ModelFacts(msgspec.Struct, array_like=True):
    """What a front needs to know of a generative model that only the engine loads."""

    max_model_len: int
    vocab_size: int
    is_encoder_decoder: bool
    kv_cache_tokens: int | None = None
    """The KV cache budget a request's ``n`` choices must fit in (None: no bound)."""


class EngineState(msgspec.Struct, tag="state", array_like=True):
    """Sent to every front when a front says hello and when the model is loaded."""

    loaded: bool
    fronts: int
    """How many fronts have said hello."""
    facts: ModelFacts | None = None
    """A generative model's limits, once loaded."""
    encoder: EncoderFacts | None = None
    """An encoder's facts from its config, once loaded."""
    tokenizer_class: str | None = None
    """The class ``AutoTokenizer`` chose for the model, by its name in transformers (None: not
    one transformers exports; the front then asks ``AutoTokenizer`` itself)."""


class Encode(msgspec.Struct, tag="encode", array_like=True):
    """A request's tokenized rows: per tensor name, every row's int64 values concatenated."""

    id: int
    kind: str
    """``task`` or ``pair`` (see :attr:`~..backends.batching.EncodeRequest.kind`)."""
    lengths: list[int]
    columns: dict[str, bytes]
    widths: dict[str, int]
    """Values per token of each column (2 for offset mappings, 1 for the rest)."""


def pack_rows(request_id: int, rows: list[Row], kind: str) -> Encode:
    """A request's rows as one :class:`Encode` message."""
    columns, widths = {}, {}
    for key, first in rows[0].items():
        columns[key] = np.concatenate([row[key] for row in rows]).tobytes()
        widths[key] = int(np.prod(first.shape[1:], dtype=np.int64))
    return Encode(request_id, kind, [len(row["input_ids"]) for row in rows], columns, widths)


def unpack_rows(message: Encode) -> list[Row]:
    """The rows of an :class:`Encode` message, as the batcher takes them (read-only views of
    the message's buffers)."""
    ends = np.cumsum(message.lengths)[:-1]
    parts = {}
    for key, data in message.columns.items():
        values: np.ndarray = np.frombuffer(data, dtype=np.int64)
        width = message.widths.get(key, 1)
        if width > 1:
            values = values.reshape(-1, width)
        parts[key] = np.split(values, ends)
    return [{key: split[i] for key, split in parts.items()} for i in range(len(message.lengths))]


class Results(msgspec.Struct, tag="results", array_like=True):
    """An encoder request's results, one per row, as the task shapes them."""

    id: int
    results: list[Any]


class Generate(msgspec.Struct, tag="generate", array_like=True):
    id: int
    prompt_ids: list[int]
    params: SamplingParams
    adapter: str | None = None


class Deltas(msgspec.Struct, tag="deltas", array_like=True):
    """A decode step's tokens for a request's choices (text is made by the front)."""

    id: int
    deltas: list[ChoiceDelta]


class Finished(msgspec.Struct, tag="finished", array_like=True):
    """Every choice of a generation request has ended."""

    id: int


class Failed(msgspec.Struct, tag="failed", array_like=True):
    """A request failed in the engine, with the HTTP status it should be answered with."""

    id: int
    status: int
    message: str
    unexpected: bool = False
    """Not one of our errors: the message is generic, the details are in the engine's log."""


class Abort(msgspec.Struct, tag="abort", array_like=True):
    """Nobody waits for a request any more (``choices`` None), or for some of its choices."""

    id: int
    choices: list[int] | None = None


Message = Hello | EngineState | Encode | Results | Generate | Deltas | Finished | Failed | Abort

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(list[Message])


def encode(messages: list[Message]) -> bytes:
    return _encoder.encode(messages)


def decode(payload: bytes) -> list[Message]:
    return _decoder.decode(payload)


class EngineError(ServerError):
    """An engine failure that carries no client fault (500)."""


class EngineFault(Exception):
    """An unexpected exception in the engine, told to the front without its details (those
    stay in the engine's log): the front answers it as any unexpected error, a generic 500."""


def failure(request_id: int, exc: BaseException) -> Failed:
    """An exception raised in the engine, as the message that reports it. One of ours keeps its
    status and message; any other is logged here, traceback and all, and reported generically."""
    if isinstance(exc, ServerError):
        return Failed(request_id, int(exc.status_code), exc.message)
    logger.error("engine: request %d failed: %s: %s", request_id, type(exc).__name__, exc,
                 exc_info=exc)  # fmt: skip
    message = f"the engine failed on request {request_id}; its log has the details"
    return Failed(request_id, 500, message, unexpected=True)


def failure_error(failed: Failed) -> Exception:
    """What the engine reported, as the error class of its status."""
    if failed.unexpected:
        return EngineFault(failed.message)
    if failed.status == 400:
        return BadRequest(failed.message)
    if failed.status == 503:
        return NotReady(failed.message)
    error = EngineError(failed.message)
    error.status_code = failed.status
    return error
