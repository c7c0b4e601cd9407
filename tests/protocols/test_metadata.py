"""V2 model metadata describes the inputs and outputs each task really returns."""

from __future__ import annotations

import pytest

from tests.harness import client_for

TEXT = "the capital of france is [MASK] ."


@pytest.mark.parametrize(
    ("model", "flags"),
    [
        ("bert_fill_mask", ()),
        ("bert_sequence_classification", ()),
        ("bert_sequence_classification", ("--return_labels",)),
        ("bert_token_classification", ()),
        ("bert_token_classification", ("--return_probabilities", "--return_offsets_mapping")),
        ("st_cls", ()),
    ],
)
async def test_metadata_matches_an_inference_response(encoder, tiny_models, model, flags):
    served = encoder(tiny_models[model], *flags, name="m")
    body = {"inputs": [{"name": "input-0", "datatype": "BYTES", "shape": [1], "data": [TEXT]}]}
    async with client_for(served) as client:
        metadata = (await client.get("/v2/models/m")).json()
        outputs = (await client.post("/v2/models/m/infer", json=body)).json()["outputs"]
    assert metadata["name"] == "m"
    assert metadata["inputs"] == [{"name": "input-0", "datatype": "BYTES", "shape": [-1]}]
    assert [(o["name"], o["datatype"]) for o in metadata["outputs"]] == [
        (o["name"], o["datatype"]) for o in outputs
    ]
    for declared, actual in zip(metadata["outputs"], outputs, strict=True):
        assert len(declared["shape"]) == len(actual["shape"])
        assert all(d in (-1, a) for d, a in zip(declared["shape"], actual["shape"], strict=True))
