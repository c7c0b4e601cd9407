"""text_embedding: pooling per the sentence-transformers config, checked against transformers."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoTokenizer

from tests.harness import client_for

SENTENCES = ["A man is eating food.", "A man is eating a piece of bread."]


def reference_embeddings(path, texts, mode="mean", normalize=True):
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    batch = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    if mode == "cls":
        pooled = hidden[:, 0]
    elif mode == "lasttoken":
        last = batch["attention_mask"].sum(1) - 1
        pooled = hidden[torch.arange(len(texts)), last]
    else:
        pooled = (hidden * mask).sum(1) / mask.sum(1)
    return F.normalize(pooled, dim=1) if normalize else pooled


async def predict(model, texts):
    async with client_for(model) as client:
        response = await client.post(f"/v1/models/{model.name}:predict", json={"instances": texts})
    assert response.status_code == 200, response.text
    return torch.tensor(response.json()["predictions"])


async def test_minilm_similarity_matches_known_value(encoder, minilm_path):
    got = await predict(encoder(minilm_path), SENTENCES)
    assert got.shape == (2, 384)
    assert torch.allclose(got.norm(dim=1), torch.ones(2), atol=1e-5)
    assert float(got[0] @ got[1]) == pytest.approx(0.7553, abs=1e-3)
    assert torch.allclose(got, reference_embeddings(minilm_path, SENTENCES), atol=1e-5)


@pytest.mark.parametrize(
    ("name", "mode", "normalize"),
    [
        ("bert_embedding", "mean", True),
        ("st_cls", "cls", True),
        ("st_mean_nonorm", "mean", False),
        ("st_lasttoken", "lasttoken", True),
    ],
)
async def test_pooling_follows_sentence_transformers_config(
    encoder, tiny_models, name, mode, normalize
):
    texts = ["the capital of france is paris .", "john lives in new york", "food"]
    got = await predict(encoder(tiny_models[name]), texts)
    want = reference_embeddings(tiny_models[name], texts, mode, normalize)
    assert torch.allclose(got, want, atol=1e-5)
    if not normalize:
        assert not math.isclose(float(got[0].norm()), 1.0, abs_tol=1e-3)
