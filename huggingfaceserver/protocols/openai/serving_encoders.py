"""``/v1/embeddings`` and ``/v1/rerank``: encoder models on the OpenAI-style routes."""

from __future__ import annotations

import numpy as np

from ...backends.base import EncoderBackend
from ...errors import BadRequest
from ...sentence.similarity import first_dimensions, unit
from ...tasks import Task
from ..limits import check_input_count
from ..relevance import relevance
from .encoder_requests import EmbeddingRequest, RerankRequest
from .encoder_responses import (
    EmbeddingResponse,
    RerankResponse,
    embedding_response,
    rerank_response,
)
from .models import ServedModels


def shorten(
    vectors: list[list[float]], dimensions: int | None, normalize: bool | None = None
) -> list[list[float]] | np.ndarray:
    """OpenAI's ``dimensions``: keep the first ones, then re-normalise, unless the request
    said ``normalize: false`` (vLLM's, as TEI's ``/embed`` does)."""
    if dimensions is None:
        return vectors
    kept = first_dimensions(vectors, dimensions)
    return kept if normalize is False else unit(kept)


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
    params = request.encode_params()
    vectors, counts = await backend.infer_counted(inputs, params, request.output)
    shortened = shorten(vectors, request.dimensions, request.normalize)
    return embedding_response(model.name, shortened, sum(counts), as_base64=request.base64)


async def create_rerank(models: ServedModels, request: RerankRequest) -> RerankResponse:
    model = models.get(request.model)
    backend = models.backend(model.name, EncoderBackend, "/v1/rerank")  # type: ignore[type-abstract]
    check_input_count(len(request.documents), model.max_inputs_per_request, "documents")
    documents = request.texts()
    scores, tokens = await relevance(
        backend, model.task, request.query, documents, request.encode_params()
    )
    return rerank_response(
        model.name, scores, documents, tokens, request.top_n, request.return_documents
    )
