"""/v1/embeddings, /v1/rerank and the model routes, through the official openai SDK."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from tests.encoder_tasks.test_embedding import reference_embeddings
from tests.harness import build_app, client_for

SENTENCES = ["A man is eating food.", "A man is eating a piece of bread."]
DOCS = ["A man is eating pasta.", "The girl is carrying a baby.", "A man eats a sandwich."]


def sdk(model, prefix: str = "/openai") -> openai.AsyncOpenAI:
    transport = httpx.ASGITransport(app=build_app(model, prefix))
    return openai.AsyncOpenAI(
        base_url=f"http://test{prefix}/v1",
        api_key="unused",
        http_client=httpx.AsyncClient(transport=transport, base_url="http://test"),
    )


@pytest.fixture(scope="module")
def minilm(encoder, minilm_path):
    return encoder(minilm_path, name="minilm")


@pytest.fixture(scope="module")
def cross_encoder_path(tiny_models, tmp_path_factory) -> Path:
    """The tiny BERT classifier with a single-logit head: a cross-encoder."""
    path = tmp_path_factory.mktemp("cross") / "model"
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(
        tiny_models["bert_sequence_classification"], num_labels=1, ignore_mismatched_sizes=True
    )
    model.config.id2label, model.config.label2id = {0: "LABEL_0"}, {"LABEL_0": 0}
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_models["bert_sequence_classification"] / name, path / name)
    return path


async def test_sdk_embeddings_match_transformers(minilm, minilm_path):
    response = await sdk(minilm).embeddings.create(model="minilm", input=SENTENCES)
    got = torch.tensor([d.embedding for d in response.data])
    assert [d.index for d in response.data] == [0, 1]
    assert torch.allclose(got, reference_embeddings(minilm_path, SENTENCES), atol=1e-5)
    assert float(got[0] @ got[1]) == pytest.approx(0.7553, abs=1e-3)
    tokenizer = AutoTokenizer.from_pretrained(minilm_path)
    tokens = sum(len(ids) for ids in tokenizer(SENTENCES)["input_ids"])
    assert response.usage.prompt_tokens == response.usage.total_tokens == tokens


async def test_float_format_token_ids_and_dimensions(minilm, minilm_path):
    ids = AutoTokenizer.from_pretrained(minilm_path)(SENTENCES[0])["input_ids"]
    async with client_for(minilm) as client:
        as_text = await client.post(
            "/openai/v1/embeddings",
            json={"model": "minilm", "input": SENTENCES[0], "encoding_format": "float"},
        )
        as_ids = await client.post("/openai/v1/embeddings", json={"model": "minilm", "input": ids})
        short = await client.post(
            "/openai/v1/embeddings",
            json={"model": "minilm", "input": SENTENCES[0], "dimensions": 8},
        )
        short_raw = await client.post(
            "/openai/v1/embeddings",
            json={"model": "minilm", "input": SENTENCES[0], "dimensions": 8, "normalize": False},
        )
        raw = await client.post(
            "/openai/v1/embeddings",
            json={"model": "minilm", "input": SENTENCES[0], "normalize": False},
        )
    body = as_text.json()
    assert body["object"] == "list" and body["data"][0]["object"] == "embedding"
    full = torch.tensor(body["data"][0]["embedding"])
    assert torch.allclose(torch.tensor(as_ids.json()["data"][0]["embedding"]), full, atol=1e-5)
    shortened = torch.tensor(short.json()["data"][0]["embedding"])
    assert shortened.shape == (8,)
    assert torch.allclose(shortened, full[:8] / full[:8].norm(), atol=1e-5)
    unnormalized = torch.tensor(raw.json()["data"][0]["embedding"])
    assert unnormalized.norm() > 1.5  # MiniLM's pooled vector before its Normalize module
    cut = torch.tensor(short_raw.json()["data"][0]["embedding"])
    assert torch.allclose(cut, unnormalized[:8], atol=1e-5)  # cut, not normalised again


async def test_rerank_with_an_embedding_model(minilm, minilm_path):
    async with client_for(minilm) as client:
        response = await client.post(
            "/openai/v1/rerank",
            json={"model": "minilm", "query": SENTENCES[0], "documents": DOCS, "top_n": 2},
        )
    assert response.status_code == 200, response.text
    body = response.json()
    vectors = reference_embeddings(minilm_path, [SENTENCES[0], *DOCS])
    cosines = (vectors[1:] @ vectors[0]).tolist()
    best = sorted(range(len(DOCS)), key=lambda i: -cosines[i])[:2]
    assert [r["index"] for r in body["results"]] == best
    for result in body["results"]:
        assert result["relevance_score"] == pytest.approx(cosines[result["index"]], abs=1e-5)
        assert result["document"]["text"] == DOCS[result["index"]]
    assert body["usage"]["total_tokens"] > 0


async def test_rerank_with_a_cross_encoder(encoder, cross_encoder_path):
    model = encoder(cross_encoder_path, name="ce")
    async with client_for(model) as client:
        response = await client.post(
            "/openai/v1/rerank",
            json={"model": "ce", "query": "paris", "documents": DOCS, "return_documents": False},
        )
    assert response.status_code == 200, response.text
    tokenizer = AutoTokenizer.from_pretrained(cross_encoder_path)
    reference = AutoModelForSequenceClassification.from_pretrained(cross_encoder_path).eval()
    with torch.no_grad():
        batch = tokenizer(["paris"] * len(DOCS), DOCS, padding=True, return_tensors="pt")
        scores = torch.sigmoid(reference(**batch).logits[:, 0]).tolist()
    results = response.json()["results"]
    assert [r["index"] for r in results] == sorted(range(len(DOCS)), key=lambda i: -scores[i])
    assert all(r["relevance_score"] == pytest.approx(scores[r["index"]], abs=1e-5) for r in results)
    assert all("document" not in r for r in results)


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/openai/v1/embeddings", {"model": "nope", "input": "x"}, 404, None),
        ("/openai/v1/embeddings", {"model": "minilm"}, 400, "input"),
        ("/openai/v1/embeddings", {"model": "minilm", "input": []}, 400, "input"),
        ("/openai/v1/embeddings", {"model": "minilm", "input": "x", "dimensions": 999}, 400, None),
        ("/openai/v1/rerank", {"model": "minilm", "query": "q", "documents": []}, 400, "documents"),
        ("/openai/v1/embeddings", b'{"model": "minilm", "input": ', 400, None),
    ],
)
async def test_errors_use_the_openai_shape(minilm, path, body, status, param):
    async with client_for(minilm) as client:
        if isinstance(body, bytes):
            response = await client.post(path, content=body)
        else:
            response = await client.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param


async def test_embeddings_on_a_classifier_is_a_400_naming_the_task(encoder, tiny_models):
    model = encoder(tiny_models["bert_fill_mask"], name="fm")
    with pytest.raises(openai.BadRequestError, match="fill_mask"):
        await sdk(model).embeddings.create(model="fm", input="x")


async def test_model_routes(minilm):
    client = sdk(minilm)
    assert [m.id for m in (await client.models.list()).data] == ["minilm"]
    assert (await client.models.retrieve("minilm")).id == "minilm"
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("nope")


async def test_empty_prefix_serves_kserve_and_openai_clients_on_v1_models(minilm):
    client = sdk(minilm, prefix="")
    assert [m.id for m in (await client.models.list()).data] == ["minilm"]
    embeddings = await client.embeddings.create(model="minilm", input="hello")
    assert len(embeddings.data[0].embedding) == 384
    async with client_for(minilm, openai_prefix="") as http:
        listing = (await http.get("/v1/models")).json()
        card = (await http.get("/v1/models/minilm")).json()
        predict = await http.post("/v1/models/minilm:predict", json={"instances": ["hello"]})
    assert listing["models"] == ["minilm"] and listing["data"][0]["id"] == "minilm"
    assert card["name"] == "minilm" and card["ready"] is True and card["id"] == "minilm"
    assert predict.status_code == 200
