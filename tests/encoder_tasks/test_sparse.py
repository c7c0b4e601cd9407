"""sparse_embedding: SPLADE vectors kept sparse, on V1 (indices and values per instance) and V2
(``indices`` and ``values`` tensors, padded), and batches whose vocabulary-wide logits fit."""

from __future__ import annotations

import numpy as np

from huggingfaceserver.encoder_tasks.sparse import VOCABULARY_LOGITS_BYTES, SparseEmbedding
from huggingfaceserver.tasks import Task
from tests.harness import client_for

TEXTS = ["The capital of France is Paris.", "food"]


async def test_v1_and_v2_answers(encoder, sentence_models, reference):
    path = sentence_models["splade_max", "st6"]
    model = encoder(path)
    assert model.task is Task.sparse_embedding  # from the folder: modules.json says so
    want = reference("SparseEncoder", path).encode(TEXTS, convert_to_tensor=True).to_dense()
    body = {"inputs": [{"name": "t", "datatype": "BYTES", "shape": [2], "data": TEXTS}]}
    async with client_for(model) as client:
        v1 = (await client.post("/v1/models/model:predict", json={"instances": TEXTS})).json()
        v2 = (await client.post("/v2/models/model/infer", json=body)).json()
        metadata = (await client.get("/v2/models/model")).json()
    outputs = {output["name"]: output for output in v2["outputs"]}
    width = max(len(vector["indices"]) for vector in v1["predictions"])
    assert outputs["indices"]["shape"] == outputs["values"]["shape"] == [2, width]
    indices = np.array(outputs["indices"]["data"]).reshape(2, width)
    values = np.array(outputs["values"]["data"]).reshape(2, width)
    for row, vector, expected in zip(range(2), v1["predictions"], want, strict=True):
        terms = expected.nonzero().flatten().tolist()
        assert vector["indices"] == terms
        np.testing.assert_allclose(vector["values"], expected[terms].numpy(), atol=1e-4)
        count = len(terms)
        assert indices[row, :count].tolist() == terms and (indices[row, count:] == -1).all()
        np.testing.assert_allclose(values[row, :count], vector["values"], atol=1e-6)
        assert (values[row, count:] == 0).all()
    assert [o["name"] for o in metadata["outputs"]] == ["indices", "values"]


def test_batches_keep_their_logits_within_bounds():
    vocabulary = 30_522  # BERT's: SPLADE models on BERT read 122 KiB of logits per token
    tokens = SparseEmbedding.max_batch_tokens(vocabulary)
    assert tokens * vocabulary * 4 <= VOCABULARY_LOGITS_BYTES < (tokens + 1) * vocabulary * 4
