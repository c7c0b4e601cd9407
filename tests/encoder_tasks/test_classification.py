"""sequence_classification and token_classification over V1 and V2, checked against transformers."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    pipeline,
)

from tests.harness import client_for
from tiny_models import build_encoder_architecture

SEQUENCE_MODELS = ["bert_sequence_classification", "distilbert_sequence_classification"]
TOKEN_MODEL = "bert_token_classification"
# different lengths, so a batch is padded
SENTENCES = [
    "I love this movie! It was wonderful and the acting was great.",
    "This film was terrible; I hated every minute of it.",
    "okay",
]
NER_TEXTS = [
    "John lives in New York with his wife Mary.",
    "My name is Sarah and I live in London.",
    "Paris",
]


def reference_logits(path, texts, head):
    """Per text, encoded alone (no padding): logits ``[classes]`` or ``[tokens, classes]``."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = head.from_pretrained(path).eval()
    with torch.no_grad():
        return [model(**tokenizer(text, return_tensors="pt")).logits[0] for text in texts]


def sequence_logits(path, texts=SENTENCES):
    return reference_logits(path, texts, AutoModelForSequenceClassification)


def token_logits(path, texts=NER_TEXTS):
    return reference_logits(path, texts, AutoModelForTokenClassification)


def label_names(path):
    return AutoConfig.from_pretrained(path).id2label


def probabilities(logits):
    return torch.softmax(logits, dim=-1)


def raw_logits(logits):
    return logits


SCORE_FLAGS = pytest.mark.parametrize(
    ("flag", "transform", "tol"),
    [("--return_probabilities", probabilities, 1e-4), ("--return_raw_logits", raw_logits, 1e-5)],
)


def score_dict(scores, keys=None):
    """``{"<class index>": score}``, or keyed by ``keys[index]``."""
    return {(keys[i] if keys else str(i)): v for i, v in enumerate(scores.tolist())}


def pad(rows, fill):
    width = max(len(row) for row in rows)
    return [list(row) + [fill] * (width - len(row)) for row in rows]


def flatten(rows):
    return [value for row in rows for value in row]


def v2_body(texts):
    return {
        "inputs": [{"name": "input-0", "datatype": "BYTES", "shape": [len(texts)], "data": texts}]
    }


async def predict_v1(model, texts):
    """The whole V1 response body."""
    async with client_for(model) as client:
        response = await client.post(f"/v1/models/{model.name}:predict", json={"instances": texts})
    assert response.status_code == 200, response.text
    return response.json()


async def infer_v2(model, texts):
    """The V2 ``outputs``, by name."""
    async with client_for(model) as client:
        response = await client.post(f"/v2/models/{model.name}/infer", json=v2_body(texts))
    assert response.status_code == 200, response.text
    return {output["name"]: output for output in response.json()["outputs"]}


async def predictions_v1(model, texts):
    return (await predict_v1(model, texts))["predictions"]


async def output_v2(model, texts):
    """The only V2 output, ``output-0``."""
    outputs = await infer_v2(model, texts)
    assert list(outputs) == ["output-0"]
    return outputs["output-0"]


def assert_tensor(output, datatype, shape, data):
    assert (output["datatype"], output["shape"]) == (datatype, shape)
    assert output["data"] == data


def assert_dicts_close(got, want, tol):
    assert len(got) == len(want)
    for got_dict, want_dict in zip(got, want, strict=True):
        assert got_dict == pytest.approx(want_dict, abs=tol)


# sequence_classification


@pytest.mark.parametrize("name", SEQUENCE_MODELS)
async def test_sequence_default_is_the_argmax_class(encoder, tiny_models, name):
    path = tiny_models[name]
    model = encoder(path)
    want = [int(logits.argmax()) for logits in sequence_logits(path)]

    assert await predictions_v1(model, SENTENCES) == want
    assert_tensor(await output_v2(model, SENTENCES), "INT64", [3], want)


@SCORE_FLAGS
@pytest.mark.parametrize("name", SEQUENCE_MODELS)
async def test_sequence_scores_per_class(encoder, tiny_models, name, flag, transform, tol):
    path = tiny_models[name]
    model = encoder(path, flag)
    want = [score_dict(transform(logits)) for logits in sequence_logits(path)]
    assert len(want[0]) == len(label_names(path))

    assert_dicts_close(await predictions_v1(model, SENTENCES), want, tol)
    output = await output_v2(model, SENTENCES)
    assert (output["datatype"], output["shape"]) == ("BYTES", [3])
    assert_dicts_close([json.loads(text) for text in output["data"]], want, tol)


@pytest.mark.parametrize("name", SEQUENCE_MODELS)
async def test_sequence_return_labels_names_the_class(encoder, tiny_models, name):
    path = tiny_models[name]
    model = encoder(path, "--return_labels")
    labels = label_names(path)
    want = [labels[int(logits.argmax())] for logits in sequence_logits(path)]

    assert await predictions_v1(model, SENTENCES) == want
    assert_tensor(await output_v2(model, SENTENCES), "BYTES", [3], want)


@pytest.mark.parametrize("name", SEQUENCE_MODELS)
async def test_sequence_labels_key_the_probabilities(encoder, tiny_models, name):
    path = tiny_models[name]
    model = encoder(path, "--return_labels", "--return_probabilities")
    labels = label_names(path)
    want = [score_dict(probabilities(logits), labels) for logits in sequence_logits(path)]

    assert_dicts_close(await predictions_v1(model, SENTENCES), want, 1e-4)
    output = await output_v2(model, SENTENCES)
    assert_dicts_close([json.loads(text) for text in output["data"]], want, 1e-4)


@pytest.mark.parametrize("case", ["multi_label", "one_label"])
async def test_probabilities_are_the_pipelines_beyond_a_softmax(
    encoder, tiny_models, tmp_path, case
):
    """``--return_probabilities`` applies what transformers' text-classification pipeline
    does: a sigmoid per class for a multi-label model, the score of a one-label model (a
    softmax over one logit is 1.0 for every text)."""
    if case == "multi_label":
        path = tmp_path / "multi_label"
        shutil.copytree(tiny_models["bert_sequence_classification"], path)
        config = json.loads((path / "config.json").read_text())
        config["problem_type"] = "multi_label_classification"
        (path / "config.json").write_text(json.dumps(config))
    else:
        path = build_encoder_architecture(
            tmp_path / "one_label", "bert", "sequence_classification", cross_encoder=True
        )
    classify = pipeline("text-classification", model=str(path), top_k=None)
    model = encoder(path, "--return_labels", "--return_probabilities")
    got = await predictions_v1(model, SENTENCES)
    for text, scores in zip(SENTENCES, got, strict=True):
        want = {result["label"]: result["score"] for result in classify([text])[0]}
        assert scores == pytest.approx(want, abs=1e-4)
        assert sum(scores.values()) != pytest.approx(1.0, abs=0.01)  # not a softmax


async def test_a_text_of_no_tokens_is_a_400_naming_it(encoder, tiny_models):
    """An empty text has no tokens where the model adds no special ones: nothing to classify
    (its row had no position: a 500 for the batch). With [CLS] and [SEP] it is served."""
    path = tiny_models["bert_sequence_classification"]
    bare = encoder(path, "--disable_special_tokens")
    async with client_for(bare) as client:
        route = f"/v1/models/{bare.name}:predict"
        response = await client.post(route, json={"instances": ["okay", ""]})
        assert response.status_code == 400, response.text
        assert "input 1 has no tokens" in response.json()["error"]
        assert (await client.post(route, json={"instances": ["okay"]})).status_code == 200
    assert len(await predictions_v1(encoder(path), ["okay", ""])) == 2


@pytest.mark.parametrize("name", SEQUENCE_MODELS)
async def test_sequence_batch_gives_what_each_text_gives_alone(encoder, tiny_models, name):
    model = encoder(tiny_models[name], "--return_raw_logits")
    batch = await predictions_v1(model, SENTENCES)
    for text, in_batch in zip(SENTENCES, batch, strict=True):
        [alone] = await predictions_v1(model, [text])
        assert in_batch == pytest.approx(alone, abs=1e-5)


@pytest.mark.parametrize("name", SEQUENCE_MODELS)
async def test_return_token_type_ids_serves_models_without_them(encoder, tiny_models, name):
    path = tiny_models[name]
    model = encoder(path, "--return_token_type_ids", "--return_raw_logits")
    want = [score_dict(logits) for logits in sequence_logits(path)]

    assert_dicts_close(await predictions_v1(model, SENTENCES), want, 1e-5)


# token_classification


async def test_token_default_is_the_argmax_label_per_token(encoder, tiny_models):
    path = tiny_models[TOKEN_MODEL]
    model = encoder(path)
    want = [logits.argmax(dim=-1).tolist() for logits in token_logits(path)]
    width = max(len(row) for row in want)

    assert await predictions_v1(model, NER_TEXTS) == [[row] for row in want]
    output = await output_v2(model, NER_TEXTS)
    assert_tensor(output, "INT64", [3, 1, width], flatten(pad(want, -1)))


@SCORE_FLAGS
async def test_token_scores_per_token(encoder, tiny_models, flag, transform, tol):
    path = tiny_models[TOKEN_MODEL]
    model = encoder(path, flag)
    want = [[score_dict(transform(token)) for token in logits] for logits in token_logits(path)]
    width = max(len(row) for row in want)

    got = await predictions_v1(model, NER_TEXTS)
    assert [len(row) for row in got] == [len(row) for row in want]
    for got_row, want_row in zip(got, want, strict=True):
        assert_dicts_close(got_row, want_row, tol)

    output = await output_v2(model, NER_TEXTS)
    assert (output["datatype"], output["shape"]) == ("BYTES", [3, width])
    assert_dicts_close([json.loads(text) for text in output["data"]], flatten(pad(want, {})), tol)


async def test_token_return_labels_names_each_token(encoder, tiny_models):
    path = tiny_models[TOKEN_MODEL]
    model = encoder(path, "--return_labels")
    labels = label_names(path)
    want = [[labels[i] for i in logits.argmax(dim=-1).tolist()] for logits in token_logits(path)]
    width = max(len(row) for row in want)

    assert await predictions_v1(model, NER_TEXTS) == [[row] for row in want]
    output = await output_v2(model, NER_TEXTS)
    assert_tensor(output, "BYTES", [3, 1, width], flatten(pad(want, "")))


async def test_token_offsets_mapping_is_an_extra_output(encoder, tiny_models):
    path = tiny_models[TOKEN_MODEL]
    model = encoder(path, "--return_offsets_mapping")
    tokenizer = AutoTokenizer.from_pretrained(path)
    offsets = [tokenizer(text, return_offsets_mapping=True)["offset_mapping"] for text in NER_TEXTS]
    width = max(len(row) for row in offsets)
    want_offsets = {
        "name": "offset_mapping",
        "datatype": "INT64",
        "shape": [3, width, 2],
        "data": flatten(flatten(pad([[list(o) for o in row] for row in offsets], [0, 0]))),
    }
    want_labels = [logits.argmax(dim=-1).tolist() for logits in token_logits(path)]

    v1 = await predict_v1(model, NER_TEXTS)
    assert v1["predictions"] == [[row] for row in want_labels]
    assert v1["outputs"] == [want_offsets]

    v2 = await infer_v2(model, NER_TEXTS)
    assert list(v2) == ["output-0", "offset_mapping"]
    assert_tensor(v2["output-0"], "INT64", [3, 1, width], flatten(pad(want_labels, -1)))
    assert_tensor(v2["offset_mapping"], "INT64", want_offsets["shape"], want_offsets["data"])
