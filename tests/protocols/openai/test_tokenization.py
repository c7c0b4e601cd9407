"""/v1/tokenize and /v1/detokenize against the tokenizer itself: a prompt's ids are
``tokenizer(prompt)``'s, a chat's are ``apply_chat_template``'s, the ids of a text far longer
than the context are refused, and detokenize is ``tokenizer.decode``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from huggingfaceserver.protocols.kserve_model import BackendModel
from tests.harness import client_for, load_model

TOKENIZE = "/openai/v1/tokenize"
DETOKENIZE = "/openai/v1/detokenize"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello world"},
]
TRUST = "--trust_request_chat_template"
OTHER_TEMPLATE = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}=>"


@pytest.fixture(scope="module")
def llama(tiny_models: dict[str, Path]) -> BackendModel:
    path = tiny_models["llama"]
    return load_model(
        ["--model_dir", str(path), "--model_name", "llama", "--backend", "huggingface"]
    )


@pytest.fixture(scope="module")
def tokenizer(tiny_models: dict[str, Path]):
    return AutoTokenizer.from_pretrained(tiny_models["llama"])


async def post(model: BackendModel, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with client_for(model) as client:
        response = await client.post(path, json=body)
    return response.status_code, response.json()


@pytest.mark.parametrize("special", [True, False])
async def test_a_prompt_is_tokenized_as_the_tokenizer_does(llama, tokenizer, special):
    text = "A man is eating a piece of bread."
    status, body = await post(
        llama, TOKENIZE, {"model": "llama", "prompt": text, "add_special_tokens": special}
    )
    expected = tokenizer(text, add_special_tokens=special)["input_ids"]
    assert status == 200, body
    assert body == {
        "count": len(expected),
        "max_model_len": 128,
        "tokens": expected,
        "token_strs": None,
    }


async def test_token_strings_on_request(llama, tokenizer):
    status, body = await post(llama, TOKENIZE, {"prompt": "Hello world", "return_token_strs": True})
    assert status == 200, body
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])


@pytest.mark.parametrize("generation_prompt", [True, False])
async def test_a_chat_is_tokenized_as_its_template_renders_it(llama, tokenizer, generation_prompt):
    request = {"messages": MESSAGES, "add_generation_prompt": generation_prompt}
    status, body = await post(llama, TOKENIZE, request)
    text = tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=generation_prompt
    )
    expected = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert status == 200, body
    assert body["tokens"] == expected and body["count"] == len(expected)
    assert expected.count(tokenizer.bos_token_id) == 1  # the template's, not added again


async def test_a_chat_template_in_the_request_needs_trust(llama, tiny_models, tokenizer):
    request = {"messages": MESSAGES, "chat_template": OTHER_TEMPLATE}
    status, body = await post(llama, TOKENIZE, request)
    assert status == 400 and "--trust_request_chat_template" in body["error"]["message"]
    path = tiny_models["llama"]
    trusting = load_model(
        ["--model_dir", str(path), "--model_name", "llama", "--backend", "huggingface", TRUST]
    )
    status, body = await post(trusting, TOKENIZE, request)
    expected = tokenizer("[You are terse.][Hello world]=>", add_special_tokens=False)
    assert status == 200, body
    assert body["tokens"] == expected["input_ids"]


async def test_a_text_far_longer_than_the_context_is_a_400(llama):
    status, body = await post(llama, TOKENIZE, {"prompt": "hello world " * 5000})
    assert status == 400, body
    assert body["error"]["code"] == "context_length_exceeded"
    assert body["error"]["param"] == "prompt"


async def test_detokenize_is_decode(llama, tokenizer):
    ids = tokenizer("Hello world, how are you?")["input_ids"]
    status, body = await post(llama, DETOKENIZE, {"model": "llama", "tokens": ids})
    assert status == 200, body
    assert body == {"prompt": tokenizer.decode(ids)}


@pytest.mark.parametrize(
    ("path", "request_body", "param", "in_message"),
    [
        (DETOKENIZE, {"tokens": [1, 10**6]}, "tokens", "not in the vocabulary"),
        (DETOKENIZE, {"tokens": [-1]}, None, "greater than or equal to 0"),
        (DETOKENIZE, {"tokens": [True]}, None, "integer"),
        (TOKENIZE, {}, None, "prompt"),
        (TOKENIZE, {"messages": []}, None, "messages"),
        (TOKENIZE, {"messages": MESSAGES, "tools": [{"type": "function"}]}, None, "tools"),
        (TOKENIZE, {"prompt": "x", "model": "nobody"}, None, "does not exist"),
        (
            TOKENIZE,
            {"messages": MESSAGES, "continue_final_message": True},
            None,
            "add_generation_prompt",
        ),
    ],
)
async def test_bad_requests_are_400s_in_the_openai_shape(
    llama, path, request_body, param, in_message
):
    status, body = await post(llama, path, request_body)
    expected = 404 if in_message == "does not exist" else 400
    assert status == expected, body
    assert in_message in body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param


async def test_an_encoder_model_has_no_tokenize_route(encoder, tiny_models):
    status, body = await post(encoder(tiny_models["st_cls"]), TOKENIZE, {"prompt": "x"})
    assert status == 400 and "text generation model" in body["error"]["message"]
