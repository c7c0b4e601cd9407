"""KServe V1/V2 requests to sentence-transformers models: ``parameters`` choose a prompt and a
truncation (V1's unknown ones are 400s, V2's are left to the clients that add them), a
cross-encoder reads text pairs (V1 ``["query", "document"]``, V2 BYTES ``[N, 2]``) and answers
its scores, and the model's ``max_seq_length`` and ``--default_prompt_name`` apply."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kserve.protocol.grpc.grpc_predict_v2_pb2 import InferParameter, ModelInferRequest
from kserve.protocol.infer_type import InferRequest
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from huggingfaceserver.encoder_tasks.params import EncodeParams
from huggingfaceserver.errors import StartupError
from huggingfaceserver.protocols.kserve_inputs import instances_from_v2
from tests.harness import client_for, load_model
from tiny_models import CORPUS

TEXTS = ["The capital of France is Paris.", "food", " ".join(CORPUS[:6])]
PAIRS = [["Where is Paris?", "Paris is in France."], ["Where is Paris?", "A red ball."]]


def v2_body(data, shape, parameters=None):
    body = {"inputs": [{"name": "input-0", "datatype": "BYTES", "shape": shape, "data": data}]}
    if parameters is not None:
        body["parameters"] = parameters
    return body


async def post(model, path, body):
    async with client_for(model) as client:
        return await client.post(path.format(name=model.name), json=body)


def cosines(got, want):
    got, want = np.asarray(got), np.asarray(want)
    return (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)


async def test_v1_parameters_choose_the_prompt(encoder, sentence_models, reference):
    path = sentence_models["cls_dense_tanh", "st3"]
    model, st = encoder(path), reference("SentenceTransformer", path)
    for parameters, prompt in [({}, "query: "), ({"prompt_name": "document"}, "")]:
        body = {"instances": TEXTS, "parameters": parameters}
        response = await post(model, "/v1/models/{name}:predict", body)
        assert response.status_code == 200, response.text
        want = st.encode(TEXTS, prompt=prompt)  # the model's default prompt is "query"
        assert cosines(response.json()["predictions"], want).min() >= 0.9999


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"prompt_nmae": "query"}, "prompt_nmae: Extra inputs are not permitted"),
        ({"truncate": "yes"}, "truncate: Input should be a valid boolean"),
        ({"prompt_name": "nope"}, "prompt_name 'nope' is not one of this model's prompts"),
        ("query", '"parameters" must be an object'),
    ],
)
async def test_v1_parameters_it_cannot_read_are_400s(encoder, sentence_models, parameters, message):
    model = encoder(sentence_models["cls_dense_tanh", "st3"])
    response = await post(
        model, "/v1/models/{name}:predict", {"instances": TEXTS, "parameters": parameters}
    )
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]


async def test_v2_parameters_beside_a_clients_own(encoder, sentence_models, reference):
    path = sentence_models["mean_norm_short", "st6"]
    model, st = encoder(path), reference("SentenceTransformer", path)
    parameters = {"prompt_name": "passage", "binary_data_output": False}
    response = await post(model, "/v2/models/{name}/infer", v2_body(TEXTS, [3], parameters))
    assert response.status_code == 200, response.text
    [output] = response.json()["outputs"]
    got = np.array(output["data"]).reshape(output["shape"])
    assert cosines(got, st.encode(TEXTS, prompt_name="passage")).min() >= 0.9999


def test_v2_parameters_over_grpc_are_read_as_well():
    request = ModelInferRequest(model_name="m")
    tensor = request.inputs.add(name="input-0", datatype="BYTES", shape=[1])
    tensor.contents.bytes_contents.append(b"a text")
    request.parameters["prompt_name"].CopyFrom(InferParameter(string_param="query"))
    request.parameters["truncate"].CopyFrom(InferParameter(bool_param=False))
    instances = instances_from_v2(InferRequest.from_grpc(request), 10)
    assert instances.items == ["a text"]
    assert instances.params == EncodeParams(prompt_name="query", truncate=False)


@pytest.mark.parametrize("layout", ["st6", "st3"])
async def test_a_cross_encoder_scores_pairs_on_v1_and_v2(
    encoder, sentence_models, reference, layout
):
    path = sentence_models["ce_tanh", layout]
    model = encoder(path)
    want = reference("CrossEncoder", path).predict([tuple(pair) for pair in PAIRS])
    v1 = await post(model, "/v1/models/{name}:predict", {"instances": PAIRS})
    assert v1.status_code == 200, v1.text
    np.testing.assert_allclose(v1.json()["predictions"], want, atol=1e-4)
    flat = [text for pair in PAIRS for text in pair]
    v2 = await post(model, "/v2/models/{name}/infer", v2_body(flat, [2, 2]))
    assert v2.status_code == 200, v2.text
    [output] = v2.json()["outputs"]
    assert (output["datatype"], output["shape"]) == ("FP32", [2])
    np.testing.assert_allclose(output["data"], want, atol=1e-4)
    mixed = await post(model, "/v1/models/{name}:predict", {"instances": [PAIRS[0], "Paris"]})
    assert mixed.status_code == 200, mixed.text
    tokenizer = AutoTokenizer.from_pretrained(path)
    classifier = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.inference_mode():  # a text alone: the model's logit, its activation (tanh)
        alone = classifier(**tokenizer(["Paris"], return_tensors="pt")).logits.tanh()[0, 0]
    np.testing.assert_allclose(mixed.json()["predictions"], [want[0], float(alone)], atol=1e-4)


async def test_pairs_only_where_a_classifier_reads_them(encoder, sentence_models):
    model = encoder(sentence_models["mean_norm_short", "st6"])
    response = await post(model, "/v1/models/{name}:predict", {"instances": PAIRS})
    assert response.status_code == 400
    assert "instances[0] must be a string" in response.json()["error"]
    v2 = await post(model, "/v2/models/{name}/infer", v2_body(["a", "b"], [1, 2]))
    assert v2.status_code == 400 and "must have shape [N] or [N, 1]" in v2.json()["error"]


async def test_minilm_truncates_at_its_max_seq_length(encoder, minilm_path, reference):
    """all-MiniLM-L6-v2 says 256 in sentence_bert_config.json, 512 in its tokenizer."""
    model = encoder(minilm_path, name="minilm")
    assert model.backend.max_length == 256
    text = " ".join(CORPUS) * 2  # some 800 tokens
    response = await post(model, "/v1/models/{name}:predict", {"instances": [text, "food"]})
    want = reference("SentenceTransformer", minilm_path).encode([text, "food"])
    assert cosines(response.json()["predictions"], want).min() >= 0.9999


def test_default_prompt_flags(sentence_models):
    path = str(sentence_models["mean_norm_short", "st6"])
    model = load_model(["--model_dir", path, "--default_prompt_name", "passage"])
    assert model.backend.prompts.default == "passage: "
    model = load_model(["--model_dir", path, "--default_prompt", "search: "])
    assert model.backend.prompts.default == "search: "
    with pytest.raises(StartupError, match="--default_prompt_name 'missing' is not one of"):
        load_model(["--model_dir", path, "--default_prompt_name", "missing"])
