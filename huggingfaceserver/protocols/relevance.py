"""How relevant documents are to a query, whichever model serves: a cross-encoder scores each
(query, document) pair; an embedding model compares vectors as sentence-transformers does.
Shared by the OpenAI-style ``/v1/rerank`` and TEI's ``/rerank``."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from ..backends.base import EncoderBackend
from ..backends.long_inputs import InputTooLong
from ..encoder_tasks.params import EncodeParams
from ..sentence.similarity import similarities
from ..tasks import Task

QUERY_PROMPT = "query"
DOCUMENT_PROMPT = "document"
"""The prompts sentence-transformers' ``encode_query`` and ``encode_document`` use (an empty
one when the model has none of that name)."""


async def named(
    call: Awaitable[tuple[list[Any], list[int]]], name: Callable[[int], str]
) -> tuple[list[Any], list[int]]:
    """``call``'s results; an input it refuses as too long renamed by its index."""
    try:
        return await call
    except InputTooLong as exc:
        raise exc.named(name(exc.index)) from None


async def embedding_relevance(
    backend: EncoderBackend, query: str, documents: list[str], params: EncodeParams
) -> tuple[list[float], int]:
    """An embedding model's similarity of each document to the query, as sentence-transformers
    compares ``encode_query(query)`` with ``encode_document(documents)``: each with its
    prompt, by the model's similarity function."""
    prompts = backend.prompts.prompts

    def asked(prompt_name: str) -> EncodeParams:
        return EncodeParams(
            prompt=prompts.get(prompt_name, ""),
            truncate=params.truncate,
            truncation_side=params.truncation_side,
        )

    (query_vectors, query_counts), (vectors, counts) = await asyncio.gather(
        named(backend.infer_counted([query], asked(QUERY_PROMPT)), lambda _: "the query"),
        named(backend.infer_counted(documents, asked(DOCUMENT_PROMPT)), "document {}".format),
    )
    scores = similarities(backend.similarity, query_vectors[0], vectors)
    return scores, sum(query_counts) + sum(counts)


async def relevance(
    backend: EncoderBackend,
    task: Task,
    query: str,
    documents: list[str],
    params: EncodeParams,
    raw: bool = False,
) -> tuple[list[float], int]:
    """Cross-encoders score (query, document) pairs (``raw``: their logits); embedding models
    compare vectors. Each document's score, and the tokens used."""
    if task is Task.text_embedding:
        return await embedding_relevance(backend, query, documents, params)
    return await backend.score_pairs(query, documents, params, raw)
