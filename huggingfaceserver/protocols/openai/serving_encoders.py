"""``/v1/embeddings`` and ``/v1/rerank``: encoder models on the OpenAI-style routes."""

from __future__ import annotations

import math

from ...backends.base import EncoderBackend
from ...backends.long_inputs import InputTooLong
from ...errors import BadRequest
from ...tasks import Task
from ..limits import check_input_count
from .encoder_requests import EmbeddingRequest, RerankRequest
from .encoder_responses import (
    EmbeddingResponse,
    RerankResponse,
    embedding_response,
    rerank_response,
)
from .models import ServedModels


def _normalise(vector: list[float]) -> list[float]:
    norm = math.sqrt(sum(v * v for v in vector)) or 1.0
    return [v / norm for v in vector]


def _shorten(vector: list[float], dimensions: int | None) -> list[float]:
    """OpenAI's ``dimensions``: keep the first ones, then re-normalise."""
    if dimensions is None:
        return vector
    if dimensions > len(vector):
        raise BadRequest(f"dimensions {dimensions} exceeds the model's {len(vector)} dimensions")
    return _normalise(vector[:dimensions])


async def create_embeddings(models: ServedModels, request: EmbeddingRequest) -> EmbeddingResponse:
    model = models.get(request.model)
    backend = models.backend(model.name, EncoderBackend, "/v1/embeddings")  # type: ignore[type-abstract]
    if model.task is not Task.text_embedding:
        raise BadRequest(
            f"/v1/embeddings needs a text_embedding model; `{model.name}` is a "
            f"{model.task.value} model"
        )
    inputs = request.inputs()
    check_input_count(len(inputs), model.max_inputs_per_request)
    vectors, counts = await backend.infer_counted(inputs)
    vectors = [_shorten(v, request.dimensions) for v in vectors]
    return embedding_response(model.name, vectors, sum(counts), as_base64=request.base64)


async def _relevance(
    backend: EncoderBackend, task: Task, query: str, documents: list[str]
) -> tuple[list[float], int]:
    """Cross-encoders score (query, document) pairs; embedding models use cosine similarity."""
    if task is Task.text_embedding:
        try:
            vectors, counts = await backend.infer_counted([query, *documents])
        except InputTooLong as exc:  # inputs 1.. are the documents
            raise exc.named(f"document {exc.index - 1}" if exc.index else "the query") from None
        q = _normalise(vectors[0])
        scores = [sum(a * b for a, b in zip(q, _normalise(d), strict=True)) for d in vectors[1:]]
        return scores, sum(counts)
    return await backend.score_pairs(query, documents)


async def create_rerank(models: ServedModels, request: RerankRequest) -> RerankResponse:
    model = models.get(request.model)
    backend = models.backend(model.name, EncoderBackend, "/v1/rerank")  # type: ignore[type-abstract]
    check_input_count(len(request.documents), model.max_inputs_per_request, "documents")
    documents = request.texts()
    scores, tokens = await _relevance(backend, model.task, request.query, documents)
    return rerank_response(
        model.name, scores, documents, tokens, request.top_n, request.return_documents
    )
