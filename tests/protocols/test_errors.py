"""KServe routes: client faults are a 4xx ``{"error": message}``, and the model keeps serving."""

from __future__ import annotations

import json
import re

import pytest
from kserve.protocol.grpc.grpc_predict_v2_pb2 import ModelInferRequest
from kserve.protocol.infer_type import InferRequest

from huggingfaceserver.errors import BadRequest
from huggingfaceserver.protocols.kserve_inputs import instances_from_v2
from tests.harness import client_for

NAME = "fm"
V1 = f"/v1/models/{NAME}:predict"
V2 = f"/v2/models/{NAME}/infer"
GOOD_TEXT = "the capital of france is [MASK] ."
JSON = {"content-type": "application/json"}
FORM = {"content-type": "application/x-www-form-urlencoded"}  # what `curl -d` sends


def v2_input(**fields):
    tensor = {"name": "input-0", "datatype": "BYTES", "shape": [1], "data": [GOOD_TEXT]}
    return {**tensor, **fields}


def v2_body(*inputs):
    return {"inputs": list(inputs) or [v2_input()]}


@pytest.fixture
def fill_mask(encoder, tiny_models):
    return encoder(tiny_models["bert_fill_mask"], name=NAME)


def assert_error(response, status: int, says: str | None = None) -> str:
    """``status`` with exactly ``{"error": "<non-empty message>"}``; returns the message."""
    assert response.status_code == status, response.text
    body = response.json()
    assert list(body) == ["error"], body
    message = body["error"]
    assert isinstance(message, str) and message.strip(), body
    if says is not None:
        assert re.search(says, message, re.IGNORECASE), f"{message!r} does not say {says!r}"
    return message


async def assert_still_serving(client) -> None:
    response = await client.post(V1, json={"instances": [GOOD_TEXT]})
    assert response.status_code == 200, response.text
    assert len(response.json()["predictions"]) == 1
    response = await client.post(V2, json=v2_body())
    assert response.status_code == 200, response.text


def fault(case_id, method, path, status, says, **request_args):
    """One client-fault case: ``says`` is a regex the error message must match."""
    return pytest.param(method, path, request_args, status, says, id=case_id)


NOT_JSON = b'{"instances": ['
LENGTH = "Inference-Header-Content-Length"


def binary_v2(raw: bytes, header: dict | None = None, length: str | None = None) -> dict:
    """A request in V2's binary tensor extension (what tritonclient sends): the JSON header,
    then ``raw``, the input's bytes (BYTES: each string's 4-byte little-endian length, then
    the string)."""
    tensor = {"name": "input-0", "datatype": "BYTES", "shape": [1]}
    tensor["parameters"] = {"binary_data_size": len(raw)}
    header = {"inputs": [tensor]} if header is None else header
    encoded = json.dumps(header).encode()
    length = str(len(encoded)) if length is None else length
    return {"content": encoded + raw, "headers": {LENGTH: length}}


def length_prefixed(text: str) -> bytes:
    encoded = text.encode()
    return len(encoded).to_bytes(4, "little") + encoded


CLIENT_FAULTS = [
    # unknown model
    fault("v1-predict-unknown-model", "POST", "/v1/models/nope:predict", 404, "nope",
          json={"instances": [GOOD_TEXT]}),
    fault("v1-ready-unknown-model", "GET", "/v1/models/nope", 404, "nope"),
    fault("v2-infer-unknown-model", "POST", "/v2/models/nope/infer", 404, "nope",
          json=v2_body()),
    fault("v2-ready-unknown-model", "GET", "/v2/models/nope/ready", 404, "nope"),
    fault("v2-metadata-unknown-model", "GET", "/v2/models/nope", 404, "nope"),
    # bodies that are not JSON
    fault("v1-malformed-json", "POST", V1, 400, "json|request format",
          content=NOT_JSON, headers=JSON),
    fault("v1-malformed-json-form-encoded", "POST", V1, 400, "json|request format",
          content=NOT_JSON, headers=FORM),
    fault("v1-malformed-json-no-content-type", "POST", V1, 400, "json|request format",
          content=NOT_JSON),
    fault("v2-malformed-json", "POST", V2, 400, "json", content=NOT_JSON, headers=JSON),
    # V1 bodies of the wrong shape
    fault("v1-no-instances", "POST", V1, 400, "instances", json={"texts": [GOOD_TEXT]}),
    fault("v1-empty-object", "POST", V1, 400, "instances", json={}),
    fault("v1-empty-instances", "POST", V1, 400, "empty", json={"instances": []}),
    fault("v1-instances-int", "POST", V1, 400, "list", json={"instances": 5}),
    fault("v1-int-instance", "POST", V1, 400, "string.*int", json={"instances": [1]}),
    fault("v1-dict-instance", "POST", V1, 400, "string.*dict",
          json={"instances": [{"text": GOOD_TEXT}]}),
    fault("v1-null-instance", "POST", V1, 400, "string.*none", json={"instances": [None]}),
    fault("v1-nested-list-instance", "POST", V1, 400, "string.*list",
          json={"instances": [[GOOD_TEXT]]}),
    fault("v1-second-instance-bad", "POST", V1, 400, r"\[1\]",
          json={"instances": [GOOD_TEXT, 2]}),
    fault("v1-array-body", "POST", V1, 400, "object", json=[GOOD_TEXT]),
    fault("v1-string-body", "POST", V1, 400, "object", json="just a string"),
    # the task's own check
    fault("v1-fill-mask-without-mask", "POST", V1, 400, re.escape("[MASK]"),
          json={"instances": ["no mask token here"]}),
    fault("v2-fill-mask-without-mask", "POST", V2, 400, re.escape("[MASK]"),
          json=v2_body(v2_input(data=["no mask token here"]))),
    # V2 tensors that are not one BYTES tensor of texts
    fault("v2-int64", "POST", V2, 400, "BYTES.*INT64",
          json=v2_body(v2_input(datatype="INT64", data=[1]))),
    fault("v2-fp32", "POST", V2, 400, "BYTES.*FP32",
          json=v2_body(v2_input(datatype="FP32", data=[1.5]))),
    fault("v2-shape-2-with-1-element", "POST", V2, 400, "shape",
          json=v2_body(v2_input(shape=[2]))),
    fault("v2-shape-1x2", "POST", V2, 400, "shape",
          json=v2_body(v2_input(shape=[1, 2], data=[GOOD_TEXT] * 2))),
    fault("v2-two-inputs", "POST", V2, 400, "one input.*2",
          json=v2_body(v2_input(), v2_input(name="input-1"))),
    fault("v2-no-inputs", "POST", V2, 400, "one input.*0", json={"inputs": []}),
    fault("v2-int-in-bytes-tensor", "POST", V2, 400, "string.*int",
          json=v2_body(v2_input(data=[1]))),
    # FastAPI validation of the V2 body: 400 in our shape, not 422 {"detail": ...}
    fault("v2-inputs-missing", "POST", V2, 400, "inputs", json={}),
    fault("v2-inputs-not-a-list", "POST", V2, 400, "inputs", json={"inputs": "input-0"}),
    fault("v2-input-missing-fields", "POST", V2, 400, "datatype|shape|data",
          json={"inputs": [{"name": "input-0"}]}),
    fault("v2-array-body", "POST", V2, 400, None, json=[v2_input()]),
    # the binary tensor extension: a header, JSON or tensor bytes it cannot read
    fault("v2-binary-length-not-a-number", "POST", V2, 400, LENGTH,
          **binary_v2(length_prefixed(GOOD_TEXT), length="abc")),
    fault("v2-binary-length-past-the-body", "POST", V2, 400, LENGTH,
          **binary_v2(length_prefixed(GOOD_TEXT), length="100000")),
    fault("v2-binary-no-inputs", "POST", V2, 400, "inputs",
          **binary_v2(length_prefixed(GOOD_TEXT), header={"outputs": []})),
    fault("v2-binary-input-without-name", "POST", V2, 400, "name",
          **binary_v2(b"", header={"inputs": [{"datatype": "BYTES", "shape": [1]}]})),
    fault("v2-binary-bytes-overrun", "POST", V2, 400, "length-prefixed",
          **binary_v2(b"\x10\x00\x00\x00abc")),
]  # fmt: skip


@pytest.mark.parametrize(("method", "path", "request_args", "status", "says"), CLIENT_FAULTS)
async def test_client_fault_is_a_4xx_error_and_the_model_keeps_serving(
    fill_mask, method, path, request_args, status, says
):
    async with client_for(fill_mask) as client:
        response = await client.request(method, path, **request_args)
        assert_error(response, status, says)
        await assert_still_serving(client)


async def test_a_v2_request_in_the_binary_tensor_extension_is_served(fill_mask):
    async with client_for(fill_mask) as client:
        binary = await client.post(V2, **binary_v2(length_prefixed(GOOD_TEXT)))
        plain = await client.post(V2, json=v2_body())
    assert binary.status_code == 200, binary.text
    assert binary.json()["outputs"] == plain.json()["outputs"]


def test_raw_grpc_bytes_whose_lengths_overrun_the_data_are_a_bad_request():
    request = ModelInferRequest(model_name=NAME, raw_input_contents=[b"\x10\x00\x00\x00abc"])
    request.inputs.add(name="input-0", datatype="BYTES", shape=[1])
    with pytest.raises(BadRequest, match="length-prefixed"):
        instances_from_v2(InferRequest.from_grpc(request), 10)


async def test_a_bare_string_is_one_instance(fill_mask):
    async with client_for(fill_mask) as client:
        response = await client.post(V1, json={"instances": GOOD_TEXT})
        assert response.status_code == 200, response.text
        assert len(response.json()["predictions"]) == 1
        listed = await client.post(V1, json={"instances": [GOOD_TEXT]})
        assert response.json() == listed.json()
        # and it is checked like any other instance
        response = await client.post(V1, json={"instances": "no mask token here"})
        assert_error(response, 400, re.escape("[MASK]"))


async def test_v1_json_sent_form_encoded_is_accepted(fill_mask):
    """``curl -d '{"instances": [...]}'`` without ``-H content-type`` (form-encoded)."""
    body = json.dumps({"instances": [GOOD_TEXT]}).encode()
    async with client_for(fill_mask) as client:
        for headers in (FORM, {}):
            response = await client.post(V1, content=body, headers=headers)
            assert response.status_code == 200, response.text
            assert len(response.json()["predictions"]) == 1


@pytest.mark.parametrize("headers", [FORM, {}], ids=["form-encoded", "no-content-type"])
async def test_v2_json_sent_without_json_content_type_is_accepted(fill_mask, headers):
    async with client_for(fill_mask) as client:
        response = await client.post(V2, content=json.dumps(v2_body()).encode(), headers=headers)
        assert response.status_code == 200, response.text
        assert response.json()["outputs"][0]["shape"] == [1]
        malformed = await client.post(V2, content=b'{"inputs": [', headers=headers)
        assert_error(malformed, 400, "json")


async def test_health_and_model_routes(fill_mask):
    async with client_for(fill_mask) as client:
        assert (await client.get("/")).json() == {"status": "alive"}
        live = await client.get("/v2/health/live")
        assert (live.status_code, live.json()) == (200, {"live": True})
        ready = await client.get("/v2/health/ready")
        assert (ready.status_code, ready.json()) == (200, {"ready": True})
        models = await client.get("/v1/models")
        assert (models.status_code, models.json()) == (200, {"models": [NAME]})
        model = await client.get(f"/v1/models/{NAME}")
        assert (model.status_code, model.json()) == (200, {"name": NAME, "ready": True})
        model = await client.get(f"/v2/models/{NAME}/ready")
        assert model.status_code == 200
        assert model.json()["ready"] is True
        metadata = await client.get(f"/v2/models/{NAME}")
        assert metadata.status_code == 200
        assert metadata.json()["name"] == NAME


async def test_metrics_has_predict_latency_per_model(fill_mask):
    async with client_for(fill_mask) as client:
        response = await client.post(V1, json={"instances": [GOOD_TEXT]})
        assert response.status_code == 200
        metrics = await client.get("/metrics")
    assert metrics.status_code == 200
    assert "request_predict_seconds" in metrics.text
    count = re.search(
        rf'^request_predict_seconds_count{{[^}}]*model_name="{NAME}"[^}}]*}} (\S+)$',
        metrics.text,
        re.MULTILINE,
    )
    assert count, metrics.text
    assert float(count.group(1)) >= 1
