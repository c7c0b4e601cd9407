"""text-embeddings-inference's routes, their bodies and answers in TEI's shapes, held to
sentence-transformers and transformers: /embed, /embed_sparse, /embed_all, /predict, /rerank,
/tokenize, /decode, /info, /health and POST /."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

from tests.harness import client_for
from tiny_models import CORPUS

TEXTS = ["The capital of France is Paris.", "food", " ".join(CORPUS[:6])]


@pytest.fixture(scope="module", params=["huggingface", "onnx"])
def runtime(request) -> tuple[str, ...]:
    """The flags of each runtime the answers are held to sentence-transformers on."""
    return ("--backend", request.param)


async def post(model, path, body, status=200):
    async with client_for(model) as client:
        response = await client.post(path, json=body)
    assert response.status_code == status, response.text
    return response.json()


def cosines(got, want):
    got, want = np.asarray(got), np.asarray(want)
    return (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)


@pytest.fixture(scope="module")
def dense(encoder, sentence_models, reference, runtime):
    """CLS pooling, a Dense layer, Normalize; prompts, "query" by default."""
    path = sentence_models["cls_dense_tanh", "st6"]
    return encoder(path, *runtime), reference("SentenceTransformer", path)


async def test_embed(dense):
    model, st = dense
    got = await post(model, "/embed", {"inputs": TEXTS})
    np.testing.assert_allclose(got, st.encode(TEXTS), atol=1e-5)  # its default prompt: query
    one = await post(model, "/embed", {"inputs": "food", "prompt_name": "document"})
    np.testing.assert_allclose(one, st.encode(["food"], prompt_name="document"), atol=1e-5)


async def test_embed_normalize_and_dimensions(dense, encoder, sentence_models, reference, runtime):
    model, st = dense
    raw = np.array(await post(model, "/embed", {"inputs": TEXTS, "normalize": False}))
    unit = st.encode(TEXTS)
    assert cosines(raw, unit).min() >= 0.9999 and not np.allclose(np.linalg.norm(raw, axis=1), 1)
    cut = np.array(await post(model, "/embed", {"inputs": TEXTS, "dimensions": 4}))
    want = raw[:, :4] / np.linalg.norm(raw[:, :4], axis=1, keepdims=True)  # TEI: cut, then norm
    np.testing.assert_allclose(cut, want, atol=1e-5)
    dot_path = sentence_models["dot_gelu", "st3"]  # no Normalize module: TEI normalises anyway
    dot = await post(encoder(dot_path, *runtime), "/embed", {"inputs": TEXTS})
    want = reference("SentenceTransformer", dot_path).encode(TEXTS, normalize_embeddings=True)
    np.testing.assert_allclose(dot, want, atol=1e-5)


async def test_embed_token_ids_and_truncation(dense):
    model, st = dense
    ids = st.tokenizer(TEXTS[0])["input_ids"]
    by_ids = await post(model, "/embed", {"inputs": [ids]})
    prompt_free = st.encode(TEXTS[:1], prompt="")
    np.testing.assert_allclose(by_ids, prompt_free, atol=1e-5)  # ids are used as they are
    long = " ".join(CORPUS)
    error = await post(model, "/embed", {"inputs": long, "truncate": False}, status=400)
    assert error["error_type"] == "Validation"
    assert "more than the maximum of 64; shorten it or send truncate: true" in error["error"]
    left = await post(model, "/embed", {"inputs": long, "truncation_direction": "Left"})
    right = await post(model, "/embed", {"inputs": long, "truncation_direction": "Right"})
    np.testing.assert_allclose(right, st.encode([long]), atol=1e-5)
    assert cosines(left, right)[0] < 0.999


async def test_embed_sparse(encoder, sentence_models, reference, runtime):
    path = sentence_models["splade_sum_log1p", "st3"]
    got = await post(encoder(path, *runtime), "/embed_sparse", {"inputs": TEXTS})
    want = reference("SparseEncoder", path).encode(TEXTS, convert_to_tensor=True).to_dense()
    for terms, expected in zip(got, want, strict=True):
        indices = expected.nonzero().flatten().tolist()
        assert [term["index"] for term in terms] == indices
        np.testing.assert_allclose(
            [term["value"] for term in terms], expected[indices].numpy(), atol=1e-4
        )
    [root] = await post(encoder(path, *runtime), "/", {"inputs": TEXTS[1]})  # its own route
    assert [term["index"] for term in root] == [term["index"] for term in got[1]]
    np.testing.assert_allclose(
        [term["value"] for term in root], [term["value"] for term in got[1]], atol=1e-5
    )


async def test_embed_all_is_each_tokens_state(encoder, sentence_models, runtime):
    path = sentence_models["mean_norm_short", "st6"]
    got = await post(encoder(path, *runtime), "/embed_all", {"inputs": TEXTS[:2]})
    tokenizer = AutoTokenizer.from_pretrained(path)
    bert = AutoModel.from_pretrained(path).eval()
    for states, text in zip(got, TEXTS[:2], strict=True):
        with torch.inference_mode():
            want = bert(**tokenizer(text, return_tensors="pt")).last_hidden_state[0]
        np.testing.assert_allclose(states, want.numpy(), atol=1e-5)


@pytest.fixture(scope="module")
def nli(encoder, sentence_models, runtime):
    """Three labels (a cross-encoder for NLI)."""
    path = sentence_models["ce_three_labels", "st6"]
    return encoder(path, *runtime), path


def logits_of(path, *texts):
    tokenizer = AutoTokenizer.from_pretrained(path)
    classifier = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.inference_mode():
        return classifier(**tokenizer(*texts, return_tensors="pt")).logits[0]


async def test_predict_texts_pairs_and_batches(nli):
    model, path = nli
    labels = model.backend.task.labels
    single = await post(model, "/predict", {"inputs": "Paris"})
    pair = await post(model, "/predict", {"inputs": ["Paris", "a city"]})
    batch = await post(model, "/predict", {"inputs": [["Paris"], ["Paris", "a city"]]})
    for got, want in zip(batch, [single, pair], strict=True):  # a batch answers as each alone
        assert [item["label"] for item in got] == [item["label"] for item in want]
        np.testing.assert_allclose([i["score"] for i in got], [i["score"] for i in want], atol=1e-5)
    for got, texts in [(single, ["Paris"]), (pair, ["Paris", "a city"])]:
        probabilities = logits_of(path, *texts).softmax(-1)
        want = sorted(
            ({"label": labels[i], "score": float(p)} for i, p in enumerate(probabilities)),
            key=lambda item: -item["score"],
        )
        assert [item["label"] for item in got] == [item["label"] for item in want]
        np.testing.assert_allclose([i["score"] for i in got], [i["score"] for i in want], atol=1e-5)
    raw = await post(model, "/predict", {"inputs": "Paris", "raw_scores": True})
    np.testing.assert_allclose(
        sorted(i["score"] for i in raw), sorted(logits_of(path, "Paris").tolist()), atol=1e-4
    )


@pytest.mark.parametrize("layout", ["st6", "st4", "st3"])
async def test_rerank_with_a_cross_encoder(encoder, sentence_models, reference, layout, runtime):
    path = sentence_models["ce_tanh", layout]
    model = encoder(path, *runtime)
    query = "Where is Paris?"
    ranks = await post(model, "/rerank", {"query": query, "texts": TEXTS, "return_text": True})
    want = reference("CrossEncoder", path).predict([(query, text) for text in TEXTS])
    assert [rank["index"] for rank in ranks] == np.argsort(-want).tolist()
    for rank in ranks:
        assert rank["score"] == pytest.approx(float(want[rank["index"]]), abs=1e-4)
        assert rank["text"] == TEXTS[rank["index"]]
    raw = await post(model, "/rerank", {"query": query, "texts": TEXTS, "raw_scores": True})
    assert set(raw[0]) == {"index", "score"}
    logits = [float(logits_of(path, query, text)[0]) for text in TEXTS]
    for rank in raw:
        assert rank["score"] == pytest.approx(logits[rank["index"]], abs=1e-4)
    root = await post(model, "/", {"query": query, "texts": TEXTS})  # POST /: a reranker's
    assert [rank["index"] for rank in root] == [rank["index"] for rank in ranks]


async def test_tokenize_counts_bytes_and_decode(dense):
    model, st = dense
    [tokens] = await post(model, "/tokenize", {"inputs": "héllo wörld"})
    assert tokens[0] == {"id": 2, "text": "[CLS]", "special": True, "start": None, "stop": None}
    words = [token for token in tokens if not token["special"]]
    assert [(t["text"], t["start"], t["stop"]) for t in words][:1] == [("héllo", 0, 6)]
    assert words[-1]["stop"] == len("héllo wörld".encode())
    [prompted] = await post(model, "/tokenize", {"inputs": "food", "prompt_name": "query"})
    assert [t["id"] for t in prompted] == st.tokenizer("query: food")["input_ids"]
    ids = [t["id"] for t in tokens]
    decoded = await post(model, "/decode", {"ids": [ids, ids[:2]]})
    assert decoded == [st.tokenizer.decode(ids, skip_special_tokens=True), "hello"]
    kept = await post(model, "/decode", {"ids": ids[:2], "skip_special_tokens": False})
    assert kept == ["[CLS] hello"]
    outside = await post(model, "/decode", {"ids": [10**6]}, status=400)
    assert "not in the vocabulary" in outside["error"]


async def test_info_and_health(dense, nli):
    model, _ = dense
    async with client_for(model) as client:
        info = (await client.get("/info")).json()
        health = await client.get("/health")
    assert health.status_code == 200
    assert info["model_type"] == {"embedding": {"pooling": "cls"}}
    assert (info["max_input_length"], info["auto_truncate"], info["model_dtype"]) == (
        64,
        True,
        "float32",
    )
    assert info["max_client_batch_size"] == 1024 and info["max_concurrent_requests"] == 512
    async with client_for(nli[0]) as client:
        classifier = (await client.get("/info")).json()["model_type"]
    assert set(classifier) == {"classifier"}
    assert classifier["classifier"]["label2id"] == {
        name: int(i) for i, name in classifier["classifier"]["id2label"].items()
    }


@pytest.mark.parametrize(
    ("path", "body", "says"),
    [
        ("/embed", {"inputs": []}, "inputs"),
        ("/embed", {"inputs": ["a", [1, 2]]}, "not a mix"),
        ("/embed", {"inputs": "a", "prompt_name": "nope"}, "prompt_name 'nope'"),
        ("/embed_sparse", {"inputs": "a"}, "/embed_sparse needs a sparse_embedding model"),
        ("/predict", {"inputs": "a"}, "/predict needs a sequence_classification model"),
        ("/rerank", {"query": "q", "texts": []}, "texts"),
        ("/tokenize", {"inputs": []}, "inputs"),
        ("/decode", {"ids": []}, "ids"),
        ("/embed", {"inputs": "a", "truncate": "yes"}, "truncate"),
    ],
)
async def test_errors_in_teis_shape(dense, path, body, says):
    error = await post(dense[0], path, body, status=400)
    assert set(error) == {"error", "error_type"} and error["error_type"] == "Validation"
    assert says in error["error"]
