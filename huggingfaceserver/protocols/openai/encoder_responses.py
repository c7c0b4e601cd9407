"""``/v1/embeddings`` and ``/v1/rerank`` responses, without the ``openai`` SDK.

The embedding models declare the fields of the SDK's ``CreateEmbeddingResponse`` and
``Embedding``, in the same order, so that their JSON is the SDK types' byte for byte (a test
checks it) while an encoder server never imports the SDK. With ``encoding_format: "base64"``
(which the SDK asks for unless its user chose a format) an embedding is a string
(:class:`Base64Embedding`). Rerank has no OpenAI type: its models follow the Cohere / Jina
response. Serialize with :func:`~.bodies.to_json` (only the fields a builder set).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Literal

import numpy as np
from pydantic import BaseModel

from .bodies import new_id

Vectors = Sequence[Sequence[float]] | np.ndarray


class Embedding(BaseModel):
    """One input's vector (the SDK's ``Embedding``)."""

    embedding: list[float]
    index: int
    object: Literal["embedding"]


class Base64Embedding(BaseModel):
    """An embedding sent as base64 of its little-endian float32 bytes."""

    embedding: str
    index: int
    object: Literal["embedding"]


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    """``/v1/embeddings`` response (the SDK's ``CreateEmbeddingResponse``) whose vectors are
    float lists or base64 strings."""

    data: list[Base64Embedding | Embedding]
    model: str
    object: Literal["list"]
    usage: EmbeddingUsage


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
