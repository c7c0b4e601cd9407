"""text-embeddings-inference's routes on the served encoder model: what each answers, in TEI's
response shapes, so that TEI's clients (``huggingface_hub``'s ``InferenceClient``,
``langchain-huggingface``) work against this server unchanged.

TEI serves one model; these routes serve the one this server loaded. Where TEI would refuse a
model (``/rerank`` on an embedding model), this server answers as its other routes do (the
embedding model's similarity, as on ``/openai/v1/rerank``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from ... import __version__
from ...backends.base import EncoderBackend
from ...encoder_tasks.params import EncodeParams, Output
from ...errors import BadRequest
from ...sentence.similarity import first_dimensions, unit
from ...tasks import Task
from ..kserve_model import EncoderModel
from ..limits import check_input_count
from ..openai.models import ServedModels
from ..relevance import relevance
from .requests import (
    DecodeRequest,
    EmbedAllRequest,
    EmbedRequest,
    EmbedSparseRequest,
    PredictRequest,
    RerankRequest,
    TokenizeRequest,
)


def served(models: ServedModels, route: str) -> tuple[EncoderModel, EncoderBackend]:
    """The one model this server serves, which must be an encoder for ``route``."""
    model = models.get(None)
    backend = models.backend(model.name, EncoderBackend, route)  # type: ignore[type-abstract]
    assert isinstance(model, EncoderModel)
    return model, backend


def needs(model: EncoderModel, route: str, *tasks: Task) -> None:
    if model.task not in tasks:
        names = " or ".join(task.value for task in tasks)
        raise BadRequest(f"{route} needs a {names} model; this is a {model.task.value} model")


async def embed(models: ServedModels, request: EmbedRequest) -> list[list[float]]:
    """Pooled embeddings; ``normalize`` (TEI's default) L2-normalises them, ``dimensions`` keeps
    the first values (normalised after)."""
    model, backend = served(models, "/embed")
    needs(model, "/embed", Task.text_embedding)
    inputs = request.texts()
    check_input_count(len(inputs), model.max_inputs_per_request)
    cut = request.dimensions is not None  # normalised after the cut, as TEI does
    output = Output.normalized if request.normalize and not cut else Output.unnormalized
    vectors, _ = await backend.infer_counted(inputs, request.encode_params(), output)
    if request.dimensions is None:
        return vectors
    kept = first_dimensions(vectors, request.dimensions)
    return (unit(kept) if request.normalize else kept).tolist()


async def embed_sparse(
    models: ServedModels, request: EmbedSparseRequest
) -> list[list[dict[str, Any]]]:
    """SPLADE term weights: per input, its non-zero ``{"index", "value"}`` terms."""
    model, backend = served(models, "/embed_sparse")
    needs(model, "/embed_sparse", Task.sparse_embedding)
    inputs = request.texts()
    check_input_count(len(inputs), model.max_inputs_per_request)
    vectors, _ = await backend.infer_counted(inputs, request.encode_params())
    return [
        [{"index": i, "value": v} for i, v in zip(vector["indices"], vector["values"], strict=True)]
        for vector in vectors
    ]


async def embed_all(models: ServedModels, request: EmbedAllRequest) -> list[list[list[float]]]:
    """Each token's final hidden state, unpooled."""
    model, backend = served(models, "/embed_all")
    needs(model, "/embed_all", Task.text_embedding)
    inputs = request.texts()
    check_input_count(len(inputs), model.max_inputs_per_request)
    states, _ = await backend.infer_counted(inputs, request.encode_params(), Output.tokens)
    return states


def softmax(logits: list[float]) -> list[float]:
    values = np.asarray(logits, dtype=np.float64)
    exp = np.exp(values - values.max())
    return (exp / exp.sum()).tolist()


async def predict(models: ServedModels, request: PredictRequest) -> list[Any]:
    """Sequence classification of texts and text pairs: per input every label with its score,
    best first. One label (a cross-encoder): the model's activation (sigmoid by default);
    more: a softmax; ``raw_scores``: the logits."""
    model, backend = served(models, "/predict")
    needs(model, "/predict", Task.sequence_classification)
    items, batch = request.instances()
    check_input_count(len(items), model.max_inputs_per_request)
    labels = backend.task.labels
    one_label = len(labels) == 1
    output = Output.scores if one_label and not request.raw_scores else Output.logits
    results, _ = await backend.infer_instances(items, request.encode_params(), output)
    predictions = []
    for result in results:
        scores = [result] if one_label and not request.raw_scores else result
        if not one_label and not request.raw_scores:
            scores = softmax(scores)
        ranked = sorted(range(len(scores)), key=lambda i: -scores[i])
        predictions.append([{"score": scores[i], "label": labels.get(i, str(i))} for i in ranked])
    return predictions if batch else predictions[0]


async def rerank(models: ServedModels, request: RerankRequest) -> list[dict[str, Any]]:
    """The texts by relevance to the query, best first: ``{"index", "score"}`` (and
    ``"text"`` with ``return_text``)."""
    model, backend = served(models, "/rerank")
    needs(model, "/rerank", Task.sequence_classification, Task.text_embedding)
    check_input_count(len(request.texts), model.max_inputs_per_request, "texts")
    scores, _ = await relevance(
        backend,
        model.task,
        request.query,
        request.texts,
        request.encode_params(),
        request.raw_scores,
    )
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    ranks: list[dict[str, Any]] = []
    for index in order:
        rank: dict[str, Any] = {"index": index, "score": scores[index]}
        if request.return_text:
            rank["text"] = request.texts[index]
        ranks.append(rank)
    return ranks


def byte_offsets(text: str) -> list[int]:
    """Where each character of ``text`` starts in its UTF-8 bytes (and the end): TEI's
    offsets count bytes, the tokenizer's Python side characters."""
    starts = [0]
    for character in text:
        starts.append(starts[-1] + len(character.encode("utf-8")))
    return starts


def tokens_of(backend: EncoderBackend, text: str, add_special_tokens: bool) -> list[dict[str, Any]]:
    """TEI's ``SimpleToken`` list for ``text``: special tokens by name, the others by the
    bytes of the text they cover."""
    tokenizer = backend.tokenizer
    encoded = tokenizer(
        text,
        add_special_tokens=add_special_tokens,
        return_offsets_mapping=True,
        return_special_tokens_mask=True,
    )
    ids = encoded["input_ids"]
    names = tokenizer.convert_ids_to_tokens(ids)
    starts = byte_offsets(text)
    data = text.encode("utf-8")
    tokens: list[dict[str, Any]] = []
    for token_id, name, special, (start, stop) in zip(
        ids, names, encoded["special_tokens_mask"], encoded["offset_mapping"], strict=True
    ):
        if special:
            tokens.append(
                {"id": token_id, "text": name, "special": True, "start": None, "stop": None}
            )
            continue
        first, last = starts[start], starts[stop]
        piece = data[first:last].decode("utf-8", errors="replace")
        tokens.append(
            {"id": token_id, "text": piece, "special": False, "start": first, "stop": last}
        )
    return tokens


async def tokenize(models: ServedModels, request: TokenizeRequest) -> list[list[dict[str, Any]]]:
    """Each input's tokens, the prompt before it if the request names one (TEI tokenizes whole,
    without truncation)."""
    model, backend = served(models, "/tokenize")
    texts = request.texts()
    check_input_count(len(texts), model.max_inputs_per_request)
    if not backend.tokenizer.is_fast:
        raise BadRequest("/tokenize needs a fast (Rust) tokenizer; this model's is not")
    prompt = ""
    if request.prompt_name is not None:
        prompt = backend.prompts.text(EncodeParams(prompt_name=request.prompt_name))

    def run() -> list[list[dict[str, Any]]]:
        return [tokens_of(backend, prompt + text, request.add_special_tokens) for text in texts]

    return await asyncio.to_thread(run)


async def decode(models: ServedModels, request: DecodeRequest) -> list[str]:
    """The text of each id list."""
    model, backend = served(models, "/decode")
    id_lists = request.id_lists()
    check_input_count(len(id_lists), model.max_inputs_per_request)
    tokenizer = backend.tokenizer
    size = len(tokenizer)
    for ids in id_lists:
        outside = next((i for i in ids if i >= size), None)
        if outside is not None:
            raise BadRequest(f"token id {outside} is not in the vocabulary (ids 0 to {size - 1})")

    def run() -> list[str]:
        return [
            str(tokenizer.decode(ids, skip_special_tokens=request.skip_special_tokens))
            for ids in id_lists
        ]

    return await asyncio.to_thread(run)


POOLING_NAMES = {"lasttoken": "last_token", "mean_sqrt_len_tokens": "mean_sqrt_len"}
"""sentence-transformers' pooling modes as TEI names them."""


def model_type(model: EncoderModel, backend: EncoderBackend) -> dict[str, Any]:
    """TEI's ``model_type``: an embedding model with its pooling (``+`` between the modes of
    one that concatenates several), a reranker (a one-label classifier) or a classifier, with
    its labels."""
    if model.task is Task.sparse_embedding:
        return {"embedding": {"pooling": "splade"}}
    if model.task is Task.text_embedding:
        modes = backend.info().pooling
        return {"embedding": {"pooling": "+".join(POOLING_NAMES.get(m, m) for m in modes)}}
    labels = {str(i): name for i, name in backend.task.labels.items()}
    classes = {"id2label": labels, "label2id": {name: int(i) for i, name in labels.items()}}
    kind = "reranker" if len(labels) == 1 else "classifier"
    return {kind: classes}


async def info(models: ServedModels) -> dict[str, Any]:
    """TEI's ``/info``."""
    model, backend = served(models, "/info")
    facts = backend.info()
    return {
        "model_id": facts.model,
        "model_sha": None,
        "model_dtype": facts.dtype,
        "served_model_name": model.name,
        "model_type": model_type(model, backend),
        "task": model.task.value,
        "max_concurrent_requests": facts.max_concurrent_requests,
        "max_input_length": facts.max_input_length,
        "max_batch_tokens": facts.max_batch_tokens,
        "max_batch_requests": facts.max_batch_size,
        "max_client_batch_size": model.max_inputs_per_request,
        "auto_truncate": facts.truncates,
        "tokenization_workers": 1,
        "version": __version__,
        "sha": None,
        "docker_label": None,
    }
