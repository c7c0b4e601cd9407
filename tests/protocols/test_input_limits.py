"""Request limits on every encoder route: texts per request (``--max_inputs_per_request``)
and inputs over the maximum length with ``--no_truncation``."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tests.harness import client_for
from tiny_models import CORPUS

NAME = "emb"
LIMIT = 3
CAP = f"at most {LIMIT} inputs per request (--max_inputs_per_request)"
MAX_LENGTH = 128  # the tiny models' maximum
LONG = " ".join(CORPUS[:14])  # 159 tokens, in 672 characters: counted whole
REFUSED = (
    f"more than the maximum of {MAX_LENGTH} (--max_length); "
    "shorten it or run without --no_truncation"
)


@pytest.fixture
def model(encoder, tiny_models):
    flags = ("--max_inputs_per_request", str(LIMIT), "--no_truncation")
    return encoder(tiny_models["st_cls"], *flags, name=NAME)


@pytest.fixture
def tokens(tiny_models):
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["st_cls"])
    return lambda text: len(tokenizer(text)["input_ids"])


def v2(texts, shape=None):
    tensor = {"name": "input-0", "datatype": "BYTES", "data": texts}
    return {"inputs": [{**tensor, "shape": shape or [len(texts)]}]}


def error(response, status=400) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    return body["error"] if isinstance(body["error"], str) else body["error"]["message"]


async def test_more_texts_than_the_limit_are_a_400_naming_it_on_every_route(model):
    texts = ["hello world"] * LIMIT
    over = [*texts, 1]  # not even a text: counted before anything is read
    async with client_for(model) as client:
        ok = [
            await client.post(f"/v1/models/{NAME}:predict", json={"instances": texts}),
            await client.post(f"/v2/models/{NAME}/infer", json=v2(texts)),
            await client.post("/openai/v1/embeddings", json={"input": texts}),
            await client.post("/openai/v1/rerank", json={"query": "q", "documents": texts}),
        ]
        refused = [
            await client.post(f"/v1/models/{NAME}:predict", json={"instances": over}),
            await client.post(f"/v2/models/{NAME}/infer", json=v2(texts + ["x"])),
            await client.post(f"/v2/models/{NAME}/infer", json=v2(texts + ["x"], shape=[1])),
            await client.post("/openai/v1/embeddings", json={"input": texts + ["x"]}),
            await client.post("/openai/v1/rerank", json={"query": "q", "documents": texts + ["x"]}),
        ]
    assert [response.status_code for response in ok] == [200] * 4
    messages = [error(response) for response in refused]
    assert all(message.endswith(f"{LIMIT + 1}; {CAP}") for message in messages), messages
    assert messages[0].startswith("too many instances:")
    assert messages[-1].startswith("too many documents:")


async def test_without_truncation_an_input_over_the_maximum_is_a_400_with_both_lengths(
    model, tokens
):
    count = tokens(LONG)
    assert count > MAX_LENGTH
    async with client_for(model) as client:
        v1 = await client.post(f"/v1/models/{NAME}:predict", json={"instances": ["hi", LONG]})
        v2_response = await client.post(f"/v2/models/{NAME}/infer", json=v2([LONG]))
        embeddings = await client.post("/openai/v1/embeddings", json={"input": [LONG]})
        rerank = await client.post(
            "/openai/v1/rerank", json={"query": "q", "documents": ["a", LONG]}
        )
        huge = await client.post(f"/v1/models/{NAME}:predict", json={"instances": [LONG * 500]})
        fits = await client.post(f"/v1/models/{NAME}:predict", json={"instances": ["hi"]})
    assert error(v1) == f"input 1 has {count} tokens, {REFUSED}"
    assert error(v2_response) == f"input 0 has {count} tokens, {REFUSED}"
    assert error(embeddings) == f"input 0 has {count} tokens, {REFUSED}"
    assert error(rerank) == f"document 1 has {count} tokens, {REFUSED}"
    assert error(huge).startswith("input 0 has at least ") and error(huge).endswith(REFUSED)
    assert fits.status_code == 200
