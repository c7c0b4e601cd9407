"""fill_mask: predictions at the mask positions over V1 and V2, checked against transformers."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForMaskedLM, AutoTokenizer

from tests.harness import client_for

MODEL = "bert_fill_mask"
TEXTS = [
    "The capital of France is [MASK] .",
    "John lives in New [MASK] with his wife Mary .",
    "[MASK] is the capital and the largest [MASK] of France .",
]
UPPER_CASE = "The capital of FRANCE is [MASK] ."
# 13 tokens with [CLS]/[SEP]: --max_length 8 keeps the first mask and drops the second
LONG = "[MASK] is the capital and the largest [MASK] of France ."
# --max_length 8 cuts the only mask off
MASK_AT_END = "The capital of France is Paris and the largest city of France is [MASK] ."


def reference_mask_logits(path, texts, tokenizer_kwargs=None, **encode_kwargs):
    """Per text, the logits ``[masks, vocab]`` at its mask positions, computed with transformers."""
    tokenizer = AutoTokenizer.from_pretrained(path, **(tokenizer_kwargs or {}))
    model = AutoModelForMaskedLM.from_pretrained(path).eval()
    batch = tokenizer(texts, padding=True, return_tensors="pt", **encode_kwargs)
    with torch.no_grad():
        logits = model(**batch).logits
    is_mask = batch["input_ids"] == tokenizer.mask_token_id
    return [row[mask] for row, mask in zip(logits, is_mask, strict=True)]


def reference_predictions(path, texts, tokenizer_kwargs=None, **encode_kwargs):
    """Per text, the decoded argmax tokens at its masks (what V1 returns by default)."""
    tokenizer = AutoTokenizer.from_pretrained(path, **(tokenizer_kwargs or {}))
    logits = reference_mask_logits(path, texts, tokenizer_kwargs, **encode_kwargs)
    return [tokenizer.decode(masks.argmax(dim=-1).tolist()) for masks in logits]


def probabilities(logits):
    return torch.softmax(logits, dim=-1)


def raw_logits(logits):
    return logits


def score_dicts(masks):
    """One ``{"<token id>": value}`` dict per mask."""
    return [{str(i): v for i, v in enumerate(row.tolist())} for row in masks]


def v2_body(texts):
    return {
        "inputs": [{"name": "input-0", "datatype": "BYTES", "shape": [len(texts)], "data": texts}]
    }


async def predict_v1(model, texts):
    async with client_for(model) as client:
        response = await client.post(f"/v1/models/{model.name}:predict", json={"instances": texts})
    assert response.status_code == 200, response.text
    return response.json()["predictions"]


async def infer_v2(model, texts):
    async with client_for(model) as client:
        response = await client.post(f"/v2/models/{model.name}/infer", json=v2_body(texts))
    assert response.status_code == 200, response.text
    outputs = response.json()["outputs"]
    assert [o["name"] for o in outputs] == ["output-0"]
    return outputs[0]


def assert_scores_close(got, want_logits, transform, tol):
    """``got``: per instance a list (one per mask) of score dicts over the whole vocabulary."""
    assert len(got) == len(want_logits)
    for instance, masks in zip(got, want_logits, strict=True):
        want = score_dicts(transform(masks))
        assert len(instance) == len(want)
        for got_dict, want_dict in zip(instance, want, strict=True):
            assert got_dict == pytest.approx(want_dict, abs=tol)


async def test_default_decodes_the_argmax_at_every_mask(encoder, tiny_models):
    path = tiny_models[MODEL]
    model = encoder(path)
    want = reference_predictions(path, TEXTS)
    assert len(want[2].split()) == 2  # two masks, two decoded tokens

    assert await predict_v1(model, TEXTS) == want
    output = await infer_v2(model, TEXTS)
    assert (output["datatype"], output["shape"], output["data"]) == ("BYTES", [3], want)


@pytest.mark.parametrize(
    ("flag", "transform", "tol"),
    [("--return_probabilities", probabilities, 1e-4), ("--return_raw_logits", raw_logits, 1e-5)],
)
async def test_scores_cover_the_vocabulary_at_every_mask(
    encoder, tiny_models, flag, transform, tol
):
    path = tiny_models[MODEL]
    model = encoder(path, flag)
    want = reference_mask_logits(path, TEXTS)
    assert [len(masks) for masks in want] == [1, 1, 2]

    v1 = await predict_v1(model, TEXTS)
    assert_scores_close(v1, want, transform, tol)
    output = await infer_v2(model, TEXTS)
    assert (output["datatype"], output["shape"]) == ("BYTES", [3])
    assert_scores_close([json.loads(text) for text in output["data"]], want, transform, tol)


async def test_probabilities_are_rounded_to_four_decimals(encoder, tiny_models):
    model = encoder(tiny_models[MODEL], "--return_probabilities")
    [[scores]] = await predict_v1(model, TEXTS[:1])
    assert all(round(p, 4) == p for p in scores.values())
    assert sum(scores.values()) == pytest.approx(1.0, abs=len(scores) * 5e-5)


async def test_disable_special_tokens_encodes_without_cls_and_sep(encoder, tiny_models):
    path = tiny_models[MODEL]
    want = reference_predictions(path, TEXTS, add_special_tokens=False)
    assert want != reference_predictions(path, TEXTS)  # else the test could not fail

    model = encoder(path, "--disable_special_tokens")
    assert await predict_v1(model, TEXTS) == want
    logits_model = encoder(path, "--disable_special_tokens", "--return_raw_logits")
    want_logits = reference_mask_logits(path, TEXTS, add_special_tokens=False)
    assert_scores_close(await predict_v1(logits_model, TEXTS), want_logits, raw_logits, 1e-5)


async def test_disable_lower_case_keeps_upper_case_tokens(encoder, tiny_models):
    path = tiny_models[MODEL]
    cased = AutoTokenizer.from_pretrained(path, do_lower_case=False)
    uncased = AutoTokenizer.from_pretrained(path)
    assert cased.tokenize("FRANCE") != ["france"]  # the reference really keeps the case
    assert cased(UPPER_CASE)["input_ids"] != uncased(UPPER_CASE)["input_ids"]

    no_lower = {"do_lower_case": False}
    model = encoder(path, "--disable_lower_case")
    assert await predict_v1(model, [UPPER_CASE]) == reference_predictions(
        path, [UPPER_CASE], no_lower
    )
    # the decoded token can coincide; the logits cannot
    want_logits = reference_mask_logits(path, [UPPER_CASE], no_lower)
    assert not torch.allclose(want_logits[0], reference_mask_logits(path, [UPPER_CASE])[0])
    logits_model = encoder(path, "--disable_lower_case", "--return_raw_logits")
    got = await predict_v1(logits_model, [UPPER_CASE])
    assert_scores_close(got, want_logits, raw_logits, 1e-5)


async def test_max_length_truncates_the_input(encoder, tiny_models):
    path = tiny_models[MODEL]
    want = reference_predictions(path, [LONG], truncation=True, max_length=8)
    assert want != reference_predictions(path, [LONG])  # the second mask is cut off

    assert await predict_v1(encoder(path, "--max_length", "8"), [LONG]) == want
    logits_model = encoder(path, "--max_length", "8", "--return_raw_logits")
    want_logits = reference_mask_logits(path, [LONG], truncation=True, max_length=8)
    assert_scores_close(await predict_v1(logits_model, [LONG]), want_logits, raw_logits, 1e-5)


@pytest.mark.parametrize("protocol", ["v1", "v2"])
async def test_mask_cut_off_by_truncation_is_a_client_error(encoder, tiny_models, protocol):
    model = encoder(tiny_models[MODEL], "--max_length", "8")
    texts = [TEXTS[0], MASK_AT_END]
    async with client_for(model) as client:
        if protocol == "v1":
            url, body = f"/v1/models/{model.name}:predict", {"instances": texts}
        else:
            url, body = f"/v2/models/{model.name}/infer", v2_body(texts)
        response = await client.post(url, json=body)
    assert response.status_code == 400, response.text
    assert "truncat" in response.json()["error"]
