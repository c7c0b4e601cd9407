"""The extensions vLLM's and TEI's clients send on /v1/embeddings and /v1/rerank: prompts,
truncation and normalisation, held to sentence-transformers and to the tokenizer, through the
openai SDK (its ``extra_body``)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from tests.harness import client_for
from tests.protocols.openai.test_encoder_routes import sdk
from tiny_models import CORPUS

TEXTS = ["The capital of France is Paris.", "food", " ".join(CORPUS[:6])]
LONG = " ".join(CORPUS[:6])


@pytest.fixture(scope="module", params=["huggingface", "onnx"])
def runtime(request) -> tuple[str, ...]:
    """The flags of each runtime the answers are held to sentence-transformers on."""
    return ("--backend", request.param)


@pytest.fixture(scope="module")
def short(encoder, sentence_models, runtime):
    """Mean pooling, a max_seq_length (16) under the tokenizer's (128), query/passage prompts."""
    return encoder(sentence_models["mean_norm_short", "st3"], *runtime, name="short")


@pytest.fixture(scope="module")
def short_st(reference, sentence_models):
    return reference("SentenceTransformer", sentence_models["mean_norm_short", "st3"])


async def embed(model, texts, **extra):
    response = await sdk(model).embeddings.create(
        model=model.name, input=texts, encoding_format="float", extra_body=extra
    )
    return np.array([d.embedding for d in response.data]), response.usage.prompt_tokens


def cosines(got, want):
    return (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)


@pytest.mark.parametrize("prompt_name", [None, "query", "passage"])
async def test_prompt_names_embed_as_sentence_transformers_does(short, short_st, prompt_name):
    extra = {} if prompt_name is None else {"prompt_name": prompt_name}
    got, tokens = await embed(short, TEXTS, **extra)
    want = short_st.encode(TEXTS, prompt_name=prompt_name)
    assert cosines(got, want).min() >= 0.9999
    # usage counts what was embedded: the prompt's tokens too, within max_seq_length
    prompt = short_st.prompts.get(prompt_name, "") if prompt_name else ""
    tokenizer = short_st.tokenizer
    counted = [min(len(tokenizer(prompt + text)["input_ids"]), 16) for text in TEXTS]
    assert tokens == sum(counted)


async def test_a_prompt_given_whole(short, short_st):
    got, _ = await embed(short, TEXTS, prompt="passage: ")
    want = short_st.encode(TEXTS, prompt="passage: ")
    assert cosines(got, want).min() >= 0.9999


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"prompt_name": "document"},
            r"prompt_name 'document' is not one of this model's "
            r"prompts \('query', 'passage'\)",
        ),  # fmt: skip
        ({"prompt_name": "query", "prompt": "q: "}, "give prompt or prompt_name, not both"),
        (
            {"truncate": False},
            r"input 2 has (at least )?\d+ tokens, more than the maximum of "
            "16; shorten it or send truncate: true",
        ),  # fmt: skip
        ({"truncation_direction": "middle"}, "truncation direction 'middle' is not one of"),
        ({"truncate_prompt_tokens": 17}, "truncate_prompt_tokens 17 exceeds the maximum of 16"),
        ({"truncate_prompt_tokens": 2}, "leaves no room for text beside the model's 2 special"),
        ({"truncation_direction": "left", "truncation_side": "right"}, "disagree"),
    ],
)
async def test_requests_that_cannot_be_served_are_400s(short, extra, message):
    async with client_for(short) as client:
        body = {"model": "short", "input": TEXTS, **extra}
        response = await client.post("/openai/v1/embeddings", json=body)
    assert response.status_code == 400, response.text
    assert re.search(message, response.json()["error"]["message"])


def embed_ids(model_st, ids):
    """sentence-transformers' vector of exactly these token ids (its own forward)."""
    features = {
        "input_ids": torch.tensor([ids]),
        "attention_mask": torch.ones(1, len(ids), dtype=torch.int64),
        "token_type_ids": torch.zeros(1, len(ids), dtype=torch.int64),
    }
    with torch.inference_mode():
        return model_st(features)["sentence_embedding"][0].numpy()


@pytest.mark.parametrize("direction", ["right", "left", "Left"])
@pytest.mark.parametrize("limit", [None, 10])
async def test_truncation_on_either_side_to_any_length(short, short_st, direction, limit):
    extra = {"truncation_direction": direction}
    if limit is not None:
        extra["truncate_prompt_tokens"] = limit
    [got], tokens = await embed(short, [LONG], **extra)
    tokenizer = AutoTokenizer.from_pretrained(short_st[0].model.name_or_path)
    tokenizer.truncation_side = direction.lower()
    ids = tokenizer(LONG, truncation=True, max_length=limit or 16)["input_ids"]
    assert tokens == len(ids)
    want = embed_ids(short_st, ids)
    assert cosines(got[None], want[None])[0] >= 0.9999


@pytest.mark.parametrize("direction", ["right", "left"])
async def test_token_ids_are_cut_by_the_requests_truncation(short, short_st, direction):
    """Token ids (no special tokens added) are cut as the request's texts would be: to
    ``truncate_prompt_tokens`` on its side, over the maximum (16) included."""
    tokenizer = AutoTokenizer.from_pretrained(short_st[0].model.name_or_path)
    ids = tokenizer(LONG)["input_ids"]
    assert len(ids) > 16
    extra = {"truncation_direction": direction, "truncate_prompt_tokens": 10}
    [got], tokens = await embed(short, [ids], **extra)
    kept = ids[:10] if direction == "right" else ids[-10:]
    assert tokens == 10
    assert cosines(got[None], embed_ids(short_st, kept)[None])[0] >= 0.9999


async def test_normalize(encoder, sentence_models, reference, runtime):
    """vLLM's ``normalize``: false leaves out the model's Normalize module, true normalises a
    model that does not."""
    path = sentence_models["cls_dense_tanh", "st6"]
    st = reference("SentenceTransformer", path)
    model = encoder(path, *runtime, name="dense")
    raw, _ = await embed(model, TEXTS, normalize=False)
    without_normalize = st.encode(TEXTS, prompt_name="query", normalize_embeddings=False)
    unnormalized = torch.nn.Sequential(*list(st)[:-1])  # every module but Normalize
    features = st.preprocess(TEXTS, prompt=st.prompts["query"])
    with torch.inference_mode():
        want = unnormalized(features)["sentence_embedding"].numpy()
    np.testing.assert_allclose(raw, want, rtol=1e-4, atol=1e-5)
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0)
    unit, _ = await embed(model, TEXTS, normalize=True)
    np.testing.assert_allclose(unit, without_normalize, atol=1e-5)  # already normalised
    dot = encoder(sentence_models["dot_gelu", "st3"], *runtime, name="dot")
    forced, _ = await embed(dot, TEXTS, normalize=True)
    np.testing.assert_allclose(np.linalg.norm(forced, axis=1), 1.0, rtol=1e-6)


async def rerank(model, query, documents, **extra):
    async with client_for(model) as client:
        body = {"model": model.name, "query": query, "documents": documents, **extra}
        response = await client.post("/openai/v1/rerank", json=body)
    assert response.status_code == 200, response.text
    return {r["index"]: r["relevance_score"] for r in response.json()["results"]}


@pytest.mark.parametrize("name", ["ce_tanh", "ce_default", "ce_identity"])
async def test_rerank_scores_are_the_cross_encoders(
    encoder, sentence_models, reference, name, runtime
):
    path = sentence_models[name, "st6"]
    got = await rerank(encoder(path, *runtime), "Where is Paris?", TEXTS)
    want = reference("CrossEncoder", path).predict([("Where is Paris?", t) for t in TEXTS])
    np.testing.assert_allclose([got[i] for i in range(len(TEXTS))], want, atol=1e-4)


@pytest.mark.parametrize(("name", "layout"), [("dot_gelu", "st3"), ("cls_dense_tanh", "st6")])
async def test_rerank_with_an_embedding_model_compares_as_sentence_transformers(
    encoder, sentence_models, reference, name, layout, runtime
):
    """``encode_query`` and ``encode_document`` (their prompts), by the model's similarity
    function (dot product for dot_gelu, cosine for the other)."""
    path = sentence_models[name, layout]
    st = reference("SentenceTransformer", path)
    got = await rerank(encoder(path, *runtime), "Where is Paris?", TEXTS)
    want = st.similarity(st.encode_query(["Where is Paris?"]), st.encode_document(TEXTS))[0]
    np.testing.assert_allclose([got[i] for i in range(len(TEXTS))], want.numpy(), rtol=1e-4)
