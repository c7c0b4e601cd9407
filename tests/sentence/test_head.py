"""The server's answers for sentence-transformers models, held to sentence-transformers' own:
every layout (saved by 6.2, and as 2.x-3.x saved), on torch and on ONNX Runtime, through the
KServe V1 route (request parameters for the prompt); texts in a batch of mixed lengths and one
per request, with and without each of the model's prompts, texts over ``max_seq_length``
included."""

from __future__ import annotations

import numpy as np
import pytest

from tests.harness import client_for
from tests.sentence_models import CROSS_ENCODER_LAYOUTS, CROSS_ENCODERS, EMBEDDERS, LAYOUTS, SPARSE
from tiny_models import CORPUS

BACKENDS = ["huggingface", "onnx"]
TEXTS = [
    "Paris",
    "The capital of France is Paris.",
    "Hello World! How are YOU today?",
    " ".join(CORPUS[:7]),  # over every model's max_seq_length, under the tokenizer's 128
    " ".join(CORPUS),  # over everything
]
PAIRS = [
    ("What is the capital of France?", "Paris is the capital and the largest city of France."),
    ("What is the capital of France?", "The cat sat on the mat."),
    ("Who wrote this book?", " ".join(CORPUS)),
    ("the cat", "The cat sat on the mat, and the dog slept by the door."),
]
MIN_COSINE = 0.9999


def flags(backend: str) -> tuple[str, ...]:
    return ("--backend", backend)


async def predict(model, instances, parameters=None):
    body = {"instances": instances}
    if parameters is not None:
        body["parameters"] = parameters
    async with client_for(model) as client:
        response = await client.post(f"/v1/models/{model.name}:predict", json=body)
    assert response.status_code == 200, response.text
    return response.json()["predictions"]


def assert_same_vectors(got, want) -> None:
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape
    cosine = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cosine.min() >= MIN_COSINE, cosine
    norms = np.linalg.norm(want, axis=1)  # the scale too, where the model does not normalise
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), norms, rtol=1e-4)


def served_runtime(model, backend: str) -> None:
    """The runtime asked for served the model (no fall back to torch hid a difference)."""
    assert model.backend.name == backend


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", list(EMBEDDERS))
async def test_embeddings_equal_sentence_transformers(
    encoder, sentence_models, reference, name, layout, backend
):
    path = sentence_models[name, layout]
    model = encoder(path, *flags(backend))
    served_runtime(model, backend)
    st = reference("SentenceTransformer", path)
    prompt_names = [None, *(name for name, text in st.prompts.items() if text)]
    for prompt_name in prompt_names:
        parameters = None if prompt_name is None else {"prompt_name": prompt_name}
        want = st.encode(TEXTS, prompt_name=prompt_name)
        assert_same_vectors(await predict(model, TEXTS, parameters), want)
        alone = [(await predict(model, [text], parameters))[0] for text in TEXTS]
        assert_same_vectors(alone, want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
async def test_a_prompt_given_whole(encoder, sentence_models, reference, layout, backend):
    path = sentence_models["instructor", layout]  # pooling leaves the prompt out
    model = encoder(path, *flags(backend))
    prompt = "Represent this sentence for clustering: "
    want = reference("SentenceTransformer", path).encode(TEXTS, prompt=prompt)
    assert_same_vectors(await predict(model, TEXTS, {"prompt": prompt}), want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", list(SPARSE))
async def test_sparse_embeddings_equal_sentence_transformers(
    encoder, sentence_models, reference, name, layout, backend
):
    path = sentence_models[name, layout]
    model = encoder(path, *flags(backend))
    served_runtime(model, backend)
    want = reference("SparseEncoder", path).encode(TEXTS, convert_to_tensor=True).to_dense()
    batched = await predict(model, TEXTS)
    alone = [(await predict(model, [text]))[0] for text in TEXTS]
    for got in (batched, alone):
        for vector, expected in zip(got, want, strict=True):
            indices = expected.nonzero().flatten().tolist()
            assert vector["indices"] == indices
            np.testing.assert_allclose(vector["values"], expected[indices].numpy(), atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", CROSS_ENCODER_LAYOUTS)
@pytest.mark.parametrize("name", list(CROSS_ENCODERS))
async def test_cross_encoder_scores_equal_sentence_transformers(
    encoder, sentence_models, reference, name, layout, backend
):
    path = sentence_models[name, layout]
    model = encoder(path, *flags(backend))
    served_runtime(model, backend)
    want = reference("CrossEncoder", path).predict(PAIRS)
    pairs = [list(pair) for pair in PAIRS]
    if want.ndim == 1:  # a one-label model's V1 prediction is its score
        np.testing.assert_allclose(await predict(model, pairs), want, atol=1e-4)
        alone = [(await predict(model, [pair]))[0] for pair in pairs]
        np.testing.assert_allclose(alone, want, atol=1e-4)
    scores, _ = await model.backend.infer_pairs(PAIRS)
    if want.ndim == 1:
        np.testing.assert_allclose(scores, want, atol=1e-4)
    else:  # more labels: the V1 prediction is the best class
        assert scores == want.argmax(axis=1).tolist()
