"""OpenAI responses, built from the ``openai`` package's own types so that the SDK parses them.

Two SDK types are narrower than what the API sends, and are widened by a subclass here: a
streamed completion choice has ``finish_reason: null`` until its last chunk
(:class:`CompletionStreamChoice`), and with ``encoding_format: "base64"`` (which the SDK itself
asks for unless its user chose a format) an embedding is a string (:class:`Base64Embedding`).
Rerank has no OpenAI type: its models follow the Cohere / Jina response.

Serialize with :func:`to_json`: the builders set exactly the fields that belong in the JSON
(``exclude_unset``), so a chat delta carries ``role`` only when asked to, stream chunks carry
``usage`` only when the client asked for usage, and a rerank result has ``document`` only when
documents are returned.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
from openai.types import (
    Completion,
    CompletionChoice,
    CompletionUsage,
    CreateEmbeddingResponse,
    Embedding,
)
from openai.types.chat import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionMessage,
    chat_completion,
    chat_completion_chunk,
)
from openai.types.completion_choice import Logprobs
from openai.types.create_embedding_response import Usage as EmbeddingUsage
from pydantic import BaseModel
from starlette.responses import Response

from .logprobs import ChatLogprobs

CompletionFinishReason = Literal["stop", "length"]
ChatFinishReason = Literal["stop", "length", "tool_calls"]


def new_id(prefix: str) -> str:
    """A response id as OpenAI writes them: ``cmpl-...``, ``chatcmpl-...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """The ``created`` timestamp: Unix seconds."""
    return int(time.time())


def to_json(response: BaseModel) -> str:
    """The response as JSON text, with the fields its builder set and no others, serialized
    by pydantic-core (Rust) in one pass: an embedding's floats through ``model_dump`` and
    ``json.dumps`` cost several times more."""
    return response.model_dump_json(exclude_unset=True)


def to_json_dict(response: BaseModel) -> dict[str, Any]:
    """What :func:`to_json` sends, as data."""
    data: dict[str, Any] = json.loads(to_json(response))
    return data


class JSONBody(Response):
    """A response whose JSON text is already made (see :func:`to_json`)."""

    media_type = "application/json"


def completion_usage(prompt_tokens: int, completion_tokens: int) -> CompletionUsage:
    """Token counts for completions and chat (no padding, ever)."""
    return CompletionUsage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


# --- completions ---------------------------------------------------------------------------


class CompletionStreamChoice(CompletionChoice):
    """A streamed completion choice: ``finish_reason`` stays null until the choice's last chunk."""

    finish_reason: Literal["stop", "length", "content_filter"] | None = None  # type: ignore[assignment]


class CompletionChunk(Completion):
    """One streamed completion chunk: a completion whose choices may be unfinished."""

    choices: list[CompletionStreamChoice]  # type: ignore[assignment]


def completion_choice(
    index: int,
    text: str,
    finish_reason: CompletionFinishReason,
    logprobs: Logprobs | None = None,
) -> CompletionChoice:
    """One finished choice of a completion."""
    return CompletionChoice(index=index, text=text, finish_reason=finish_reason, logprobs=logprobs)


def completion_response(
    request_id: str,
    model: str,
    choices: Sequence[CompletionChoice],
    prompt_tokens: int,
    completion_tokens: int,
    created: int | None = None,
) -> Completion:
    """The whole ``/v1/completions`` response."""
    return Completion(
        id=request_id,
        object="text_completion",
        created=now() if created is None else created,
        model=model,
        choices=list(choices),
        usage=completion_usage(prompt_tokens, completion_tokens),
    )


def completion_stream_choice(
    index: int,
    text: str,
    finish_reason: CompletionFinishReason | None = None,
    logprobs: Logprobs | None = None,
) -> CompletionStreamChoice:
    """One choice's delta in a completion stream."""
    return CompletionStreamChoice(
        index=index, text=text, finish_reason=finish_reason, logprobs=logprobs
    )


def completion_chunk(
    request_id: str,
    model: str,
    created: int,
    choice: CompletionStreamChoice | None = None,
    *,
    include_usage: bool = False,
    usage: CompletionUsage | None = None,
) -> CompletionChunk:
    """A streamed completion chunk: one choice's delta, or (no ``choice``) the usage chunk.

    With ``include_usage`` the chunk has a ``usage`` field (null unless ``usage`` is given).
    """
    return CompletionChunk(
        id=request_id,
        object="text_completion",
        created=created,
        model=model,
        choices=[] if choice is None else [choice],
        **_usage_field(include_usage, usage),
    )


# --- chat ----------------------------------------------------------------------------------


def chat_choice(
    index: int,
    text: str,
    finish_reason: ChatFinishReason,
    logprobs: ChatLogprobs | None = None,
) -> chat_completion.Choice:
    """One finished choice of a chat completion: an assistant message.

    ``logprobs`` (from :func:`chat_logprobs`) is None when the client did not ask for them.
    """
    return chat_completion.Choice(
        index=index,
        message=ChatCompletionMessage(role="assistant", content=text),
        finish_reason=finish_reason,
        logprobs=None if logprobs is None else chat_completion.ChoiceLogprobs(content=logprobs),
    )


def chat_response(
    request_id: str,
    model: str,
    choices: Sequence[chat_completion.Choice],
    prompt_tokens: int,
    completion_tokens: int,
    created: int | None = None,
) -> ChatCompletion:
    """The whole ``/v1/chat/completions`` response."""
    return ChatCompletion(
        id=request_id,
        object="chat.completion",
        created=now() if created is None else created,
        model=model,
        choices=list(choices),
        usage=completion_usage(prompt_tokens, completion_tokens),
    )


def chat_stream_choice(
    index: int,
    text: str | None = None,
    finish_reason: ChatFinishReason | None = None,
    logprobs: ChatLogprobs | None = None,
    *,
    first: bool = False,
) -> chat_completion_chunk.Choice:
    """One choice's delta in a chat stream.

    ``first`` puts ``role: "assistant"`` in the delta (the first delta of each choice only);
    ``text=None`` leaves ``content`` out (the final delta that only carries ``finish_reason``).
    """
    delta: dict[str, Any] = {"role": "assistant"} if first else {}
    if text is not None:
        delta["content"] = text
    return chat_completion_chunk.Choice(
        index=index,
        delta=chat_completion_chunk.ChoiceDelta(**delta),
        finish_reason=finish_reason,
        logprobs=(
            None if logprobs is None else chat_completion_chunk.ChoiceLogprobs(content=logprobs)
        ),
    )


def chat_chunk(
    request_id: str,
    model: str,
    created: int,
    choice: chat_completion_chunk.Choice | None = None,
    *,
    include_usage: bool = False,
    usage: CompletionUsage | None = None,
) -> ChatCompletionChunk:
    """A streamed chat chunk: one choice's delta, or (no ``choice``) the usage chunk.

    With ``include_usage`` the chunk has a ``usage`` field (null unless ``usage`` is given).
    """
    return ChatCompletionChunk(
        id=request_id,
        object="chat.completion.chunk",
        created=created,
        model=model,
        choices=[] if choice is None else [choice],
        **_usage_field(include_usage, usage),
    )


def _usage_field(include_usage: bool, usage: CompletionUsage | None) -> dict[str, Any]:
    # OpenAI: with include_usage, every chunk has "usage" (null but in the last one); else none.
    return {"usage": usage} if include_usage or usage is not None else {}


# --- embeddings and rerank ---------------------------------------------------------------

Vectors = Sequence[Sequence[float]] | np.ndarray


class Base64Embedding(Embedding):
    """An embedding sent as base64 of its little-endian float32 bytes."""

    embedding: str  # type: ignore[assignment]


class EmbeddingResponse(CreateEmbeddingResponse):
    """``/v1/embeddings`` response whose vectors are float lists or base64 strings."""

    data: list[Base64Embedding | Embedding]  # type: ignore[assignment]


def embedding_to_base64(vector: Sequence[float] | np.ndarray) -> str:
    """``vector`` as base64 of its little-endian float32 bytes (what the SDK decodes)."""
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


def embedding_response(
    model: str, vectors: Vectors, prompt_tokens: int, as_base64: bool = False
) -> EmbeddingResponse:
    """The whole ``/v1/embeddings`` response: one entry per input, in input order."""
    data: list[Base64Embedding | Embedding] = []
    for index, vector in enumerate(vectors):
        if as_base64:
            encoded = embedding_to_base64(vector)
            data.append(Base64Embedding(object="embedding", index=index, embedding=encoded))
        else:
            values = np.asarray(vector, dtype=np.float64).tolist()
            data.append(Embedding(object="embedding", index=index, embedding=values))
    return EmbeddingResponse(
        object="list",
        data=data,
        model=model,
        usage=EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens),
    )


class RerankDocumentText(BaseModel):
    text: str


class RerankResult(BaseModel):
    """One document's score; ``index`` is its position in the request."""

    index: int
    relevance_score: float
    document: RerankDocumentText | None = None


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    """``/v1/rerank`` response (Cohere / Jina shape): results by descending score."""

    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


def rerank_response(
    model: str,
    scores: Sequence[float],
    documents: Sequence[str],
    total_tokens: int,
    top_n: int | None = None,
    return_documents: bool = True,
    request_id: str | None = None,
) -> RerankResponse:
    """Rank ``documents`` by ``scores`` (ties keep request order), keeping the ``top_n`` best.

    Without ``return_documents`` the results leave ``document`` out.
    """
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:top_n]
    results = [
        _rerank_result(i, float(scores[i]), documents[i] if return_documents else None)
        for i in order
    ]
    return RerankResponse(
        id=request_id or new_id("rerank"),
        model=model,
        usage=RerankUsage(total_tokens=total_tokens),
        results=results,
    )


def _rerank_result(index: int, score: float, text: str | None) -> RerankResult:
    if text is None:  # left unset, so that the JSON has no "document" at all
        return RerankResult(index=index, relevance_score=score)
    return RerankResult(index=index, relevance_score=score, document=RerankDocumentText(text=text))
