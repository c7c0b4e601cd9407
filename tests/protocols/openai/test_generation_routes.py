"""/v1/completions and /v1/chat/completions in-process, checked against transformers itself:
greedy text equals ``model.generate``, logprobs equal the model's log-softmax, chat prompts are
the chat template's; stop strings, EOS, seeds, ``n``, echo, prompt forms, SSE framing and the
OpenAI error shape."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
)

from huggingfaceserver.protocols.kserve_model import BackendModel
from tests.harness import build_app, client_for, load_model, sdk_for
from tests.openai_checks import MAX_TOKENS, Reference, middle_substring

COMPLETIONS = "/openai/v1/completions"
CHAT = "/openai/v1/chat/completions"
PROMPTS = [
    "Hello world",
    "A man is eating a piece of bread.",
    "Translate English to German: the house is wonderful.",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello world"},
]
# Renders "role: content" lines and a generation prompt; gpt2's tokenizer has no template.
PLAIN_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
OTHER_TEMPLATE = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}=>"
TRUST = "--trust_request_chat_template"
"""Templates in requests are refused without it (tests/protocols/openai/test_chat_template.py)."""
MODEL_CLASSES = {
    "gpt2": AutoModelForCausalLM,
    "llama": AutoModelForCausalLM,
    "t5": AutoModelForSeq2SeqLM,
}


@pytest.fixture(scope="module")
def model_dirs(tiny_models: dict[str, Path], tmp_path_factory) -> dict[str, Path]:
    """The tiny generative models; gpt2 and t5 copied with every weight matrix times 20, since
    the random originals repeat one token greedily (as tests/backends does, on disk here)."""
    dirs = {"llama": tiny_models["llama"], "bert_fill_mask": tiny_models["bert_fill_mask"]}
    for name, model_class in [("gpt2", AutoModelForCausalLM), ("t5", AutoModelForSeq2SeqLM)]:
        sharp = tmp_path_factory.mktemp("sharp") / name
        shutil.copytree(tiny_models[name], sharp)
        model = model_class.from_pretrained(sharp)
        with torch.no_grad():
            for weight in model.parameters():
                if weight.dim() > 1:
                    weight.mul_(20)
        model.save_pretrained(sharp)
        dirs[name] = sharp
    return dirs


@pytest.fixture(scope="module")
def served(model_dirs: dict[str, Path]) -> Callable[..., BackendModel]:
    """``served(name, *flags)``: the model loaded as the server loads it, once per flags."""
    cache: dict[tuple[str, ...], BackendModel] = {}

    def get(name: str, *flags: str) -> BackendModel:
        key = (name, *flags)
        if key not in cache:
            argv = ["--model_dir", str(model_dirs[name]), "--model_name", name]
            argv += ["--backend", "huggingface", *flags]
            cache[key] = load_model(argv)
        return cache[key]

    return get


@pytest.fixture(scope="module")
def reference(model_dirs: dict[str, Path]) -> Callable[[str], Reference]:
    cache: dict[str, Reference] = {}

    def get(name: str) -> Reference:
        if name not in cache:
            model = MODEL_CLASSES[name].from_pretrained(model_dirs[name]).eval()
            cache[name] = Reference(model, AutoTokenizer.from_pretrained(model_dirs[name]))
        return cache[name]

    return get


async def post(model: BackendModel, path: str, body: dict[str, Any] | bytes) -> httpx.Response:
    async with client_for(model) as client:
        if isinstance(body, bytes):
            return await client.post(path, content=body)
        return await client.post(path, json=body)


async def post_answered(model: BackendModel, path: str, body: dict[str, Any]) -> httpx.Response:
    """``post``, with an exception the app lets out answered as the server answers it (a 500)
    rather than raised in the test."""
    transport = httpx.ASGITransport(app=build_app(model), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.post(path, json=body)


async def ok(model: BackendModel, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = await post(model, path, body)
    assert response.status_code == 200, response.text
    return response.json()


def sse_chunks(response: httpx.Response) -> list[dict[str, Any]]:
    """The JSON chunks of an SSE body, after checking its framing: every event is one
    ``data: {json}`` line followed by a blank line, and the last is ``data: [DONE]``."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    body = response.text
    assert body.endswith("\n\n")
    events = body.removesuffix("\n\n").split("\n\n")
    assert all(event.startswith("data: ") and "\n" not in event for event in events), body
    payloads = [event.removeprefix("data: ") for event in events]
    assert payloads[-1] == "[DONE]" and "[DONE]" not in payloads[:-1]
    chunks = [json.loads(payload) for payload in payloads[:-1]]
    assert all(isinstance(chunk, dict) and "error" not in chunk for chunk in chunks), chunks
    return chunks


def by_choice(chunks: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """Each choice's streamed deltas in order; every chunk carries at most one choice."""
    choices: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for chunk in chunks:
        assert len(chunk["choices"]) <= 1
        for choice in chunk["choices"]:
            choices[choice["index"]].append(choice)
    return choices


def check_finish_reasons(deltas: list[dict[str, Any]]) -> str:
    """``finish_reason`` is null in every delta of a choice but its last; that last one."""
    assert [d["finish_reason"] for d in deltas[:-1]] == [None] * (len(deltas) - 1)
    assert deltas[-1]["finish_reason"] in ("stop", "length")
    return deltas[-1]["finish_reason"]


# --- greedy decoding against model.generate -------------------------------------------------


@pytest.mark.parametrize("name", ["gpt2", "llama", "t5"])
@pytest.mark.parametrize("prompt", PROMPTS)
async def test_greedy_completion_equals_model_generate(served, reference, name, prompt):
    ref = reference(name)
    prompt_ids = ref.encode(prompt)
    expected = ref.greedy(prompt_ids)
    assert len(set(expected)) > 1  # not one token repeated: the comparison means something
    body = await ok(
        served(name),
        COMPLETIONS,
        {"model": name, "prompt": prompt, "temperature": 0, "max_tokens": MAX_TOKENS},
    )
    assert body["object"] == "text_completion" and body["model"] == name
    (choice,) = body["choices"]
    assert choice["index"] == 0
    assert choice["text"] == ref.text(expected)
    assert choice["finish_reason"] == ref.finish_reason(expected)
    assert body["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(expected),
        "total_tokens": len(prompt_ids) + len(expected),
    }


async def test_greedy_chat_is_generate_on_the_chat_template(served, reference):
    ref = reference("llama")
    prompt_ids = ref.chat_ids(MESSAGES)
    assert prompt_ids.count(ref.tokenizer.bos_token_id) == 1  # the template's <s>, once
    expected = ref.greedy(prompt_ids)
    response = await sdk_for(served("llama")).chat.completions.create(
        model="llama", messages=MESSAGES, temperature=0, max_tokens=MAX_TOKENS
    )
    assert response.object == "chat.completion"
    (choice,) = response.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == ref.text(expected)
    assert choice.finish_reason == ref.finish_reason(expected)
    assert response.usage is not None
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert response.usage.completion_tokens == len(expected)


async def test_max_completion_tokens_wins_over_max_tokens(served, reference):
    ref = reference("llama")
    expected = ref.greedy(ref.chat_ids(MESSAGES), 3)
    body = await ok(
        served("llama"),
        CHAT,
        {"messages": MESSAGES, "temperature": 0, "max_tokens": 9, "max_completion_tokens": 3},
    )
    assert body["choices"][0]["message"]["content"] == ref.text(expected)
    assert body["usage"]["completion_tokens"] == 3


# --- chat templates ---------------------------------------------------------------------------


async def test_chat_without_a_template_is_a_400(served):
    response = await post(served("gpt2"), CHAT, {"messages": MESSAGES})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert "no chat template" in error["message"]


async def test_chat_template_in_the_request(served, reference):
    ref = reference("gpt2")
    prompt_ids = ref.chat_ids(MESSAGES, PLAIN_TEMPLATE)
    expected = ref.greedy(prompt_ids)
    body = await ok(
        served("gpt2", TRUST),
        CHAT,
        {"messages": MESSAGES, "chat_template": PLAIN_TEMPLATE, "temperature": 0, "max_tokens": 12},
    )
    assert body["choices"][0]["message"]["content"] == ref.text(expected)
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)


@pytest.mark.parametrize("form", ["file", "literal"])
async def test_chat_template_at_startup(served, reference, tmp_path, form):
    if form == "file":
        path = tmp_path / "template.jinja"
        path.write_text(PLAIN_TEMPLATE)
        flag = str(path)
    else:
        flag = PLAIN_TEMPLATE
    model = served("gpt2", "--chat_template", flag, TRUST)
    ref = reference("gpt2")
    prompt_ids = ref.chat_ids(MESSAGES, PLAIN_TEMPLATE)
    expected = ref.greedy(prompt_ids)
    request = {"messages": MESSAGES, "temperature": 0, "max_tokens": MAX_TOKENS}
    body = await ok(model, CHAT, request)
    assert body["choices"][0]["message"]["content"] == ref.text(expected)
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    # A template in the request wins over the server's.
    body = await ok(model, CHAT, {**request, "chat_template": OTHER_TEMPLATE})
    assert body["usage"]["prompt_tokens"] == len(ref.chat_ids(MESSAGES, OTHER_TEMPLATE))


# --- logprobs --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt2", "llama", "t5"])
async def test_completion_logprobs_are_the_models(served, reference, name):
    ref = reference(name)
    prompt_ids = ref.encode(PROMPTS[0])
    new = ref.greedy(prompt_ids, 6)
    expected = ref.log_softmax(prompt_ids, new)
    body = await ok(
        served(name),
        COMPLETIONS,
        {"prompt": PROMPTS[0], "temperature": 0, "max_tokens": 6, "logprobs": 2},
    )
    logprobs = body["choices"][0]["logprobs"]
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert logprobs["tokens"] == [token_text(ref.tokenizer, token) for token in new]
    for step, token in enumerate(new):
        assert logprobs["token_logprobs"][step] == pytest.approx(
            float(expected[step, token]), abs=1e-4
        )
        values, ids = expected[step].topk(2)
        top = {
            token_text(ref.tokenizer, i): v
            for i, v in zip(ids.tolist(), values.tolist(), strict=True)
        }
        assert logprobs["top_logprobs"][step] == pytest.approx(top, abs=1e-4)
    lengths = [len(token) for token in logprobs["tokens"]]
    assert logprobs["text_offset"] == [sum(lengths[:i]) for i in range(len(lengths))]


async def test_chat_logprobs_are_the_models(served, reference):
    ref = reference("llama")
    prompt_ids = ref.chat_ids(MESSAGES)
    new = ref.greedy(prompt_ids, 6)
    expected = ref.log_softmax(prompt_ids, new)
    body = await ok(
        served("llama"),
        CHAT,
        {
            "messages": MESSAGES,
            "temperature": 0,
            "max_tokens": 6,
            "logprobs": True,
            "top_logprobs": 2,
        },
    )
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == len(new)
    for step, (token, entry) in enumerate(zip(new, content, strict=True)):
        text = ref.tokenizer.decode([token])
        assert entry["token"] == text and entry["bytes"] == list(text.encode())
        assert entry["logprob"] == pytest.approx(float(expected[step, token]), abs=1e-4)
        values, ids = expected[step].topk(2)
        assert [alt["token"] for alt in entry["top_logprobs"]] == [
            ref.tokenizer.decode([i]) for i in ids.tolist()
        ]
        assert [alt["logprob"] for alt in entry["top_logprobs"]] == pytest.approx(
            values.tolist(), abs=1e-4
        )


async def test_no_logprobs_unless_asked(served):
    body = await ok(served("llama"), COMPLETIONS, {"prompt": "Hello", "max_tokens": 3})
    assert body["choices"][0]["logprobs"] is None
    body = await ok(served("llama"), CHAT, {"messages": MESSAGES, "max_tokens": 3})
    assert body["choices"][0]["logprobs"] is None


# --- sampling, n and usage ---------------------------------------------------------------------


async def test_seeded_sampling_is_reproducible(served):
    async def sample(seed: int) -> str:
        body = await ok(
            served("llama"),
            COMPLETIONS,
            {
                "prompt": PROMPTS[0],
                "temperature": 1,
                "seed": seed,
                "max_tokens": 16,
                "ignore_eos": True,
            },
        )
        return body["choices"][0]["text"]

    first = await sample(7)
    assert await sample(7) == first
    assert await sample(8) != first


async def test_n_choices_and_their_usage(served, reference):
    prompt_ids = reference("llama").encode(PROMPTS[1])
    body = await ok(
        served("llama"),
        COMPLETIONS,
        {"prompt": PROMPTS[1], "n": 3, "seed": 0, "max_tokens": 10, "logprobs": 0},
    )
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert len({c["text"] for c in choices}) == 3  # choice i samples with seed + i
    generated = [len(c["logprobs"]["tokens"]) for c in choices]
    assert body["usage"] == {
        "prompt_tokens": len(prompt_ids),  # the prompt once, not once per choice
        "completion_tokens": sum(generated),
        "total_tokens": len(prompt_ids) + sum(generated),
    }


async def test_sdk_parses_completions_with_n_and_logprobs(served):
    response = await sdk_for(served("llama")).completions.create(
        model="llama",
        prompt=PROMPTS[0],
        n=2,
        seed=3,
        max_tokens=4,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert response.object == "text_completion"
    assert [c.index for c in response.choices] == [0, 1]
    for choice in response.choices:
        assert choice.finish_reason == "length"
        assert choice.logprobs is not None and len(choice.logprobs.tokens or []) == 4
    assert response.usage is not None and response.usage.completion_tokens == 8


async def test_chat_n_choices(served, reference):
    prompt_ids = reference("llama").chat_ids(MESSAGES)
    body = await ok(
        served("llama"),
        CHAT,
        {"messages": MESSAGES, "n": 2, "seed": 1, "max_tokens": 8, "ignore_eos": True},
    )
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert all(c["finish_reason"] == "length" for c in body["choices"])
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    assert body["usage"]["completion_tokens"] == 16


# --- stopping --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def greedy_llama(reference) -> tuple[list[int], str]:
    """llama's greedy tokens and text for PROMPTS[0], which run to max_tokens (no EOS)."""
    ref = reference("llama")
    new = ref.greedy(ref.encode(PROMPTS[0]))
    assert ref.finish_reason(new) == "length"
    return new, ref.text(new)


async def test_a_stop_string_cuts_the_text_before_it(served, greedy_llama):
    new, text = greedy_llama
    stop = middle_substring(text)
    request = {"prompt": PROMPTS[0], "temperature": 0, "max_tokens": MAX_TOKENS}
    plain = await ok(served("llama"), COMPLETIONS, request)
    assert plain["choices"][0]["text"] == text
    assert plain["choices"][0]["finish_reason"] == "length"
    stopped = await ok(served("llama"), COMPLETIONS, {**request, "stop": [stop, "never seen"]})
    (choice,) = stopped["choices"]
    assert choice["text"] == text[: text.index(stop)]
    assert choice["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] < len(new)
    kept = await ok(
        served("llama"),
        COMPLETIONS,
        {**request, "stop": stop, "include_stop_str_in_output": True},
    )
    assert kept["choices"][0]["text"] == text[: text.index(stop) + len(stop)]
    assert kept["choices"][0]["finish_reason"] == "stop"


async def test_eos_gives_stop(served, reference, greedy_llama):
    eos = reference("llama").tokenizer.eos_token_id
    request = {
        "prompt": PROMPTS[0],
        "temperature": 0,
        "max_tokens": 10,
        "logit_bias": {str(eos): 100},
    }
    body = await ok(served("llama"), COMPLETIONS, request)
    assert body["choices"][0] == {
        "index": 0,
        "text": "",
        "logprobs": None,
        "finish_reason": "stop",
    }
    assert body["usage"]["completion_tokens"] == 1
    # With EOS held back for 3 tokens: the greedy text of those 3, then EOS.
    body = await ok(served("llama"), COMPLETIONS, {**request, "min_tokens": 3})
    assert body["choices"][0]["text"] == reference("llama").text(greedy_llama[0][:3])
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize(
    ("path", "field", "value"), [(COMPLETIONS, "prompt", PROMPTS[0]), (CHAT, "messages", MESSAGES)]
)
async def test_eos_gives_stop_when_streamed(served, reference, path, field, value):
    eos = reference("llama").tokenizer.eos_token_id
    request = {field: value, "temperature": 0, "logit_bias": {str(eos): 100}, "stream": True}
    chunks = sse_chunks(await post(served("llama"), path, request))
    (deltas,) = by_choice(chunks).values()
    assert check_finish_reasons(deltas) == "stop"


@pytest.mark.parametrize(
    ("path", "field", "value"), [(COMPLETIONS, "prompt", PROMPTS[0]), (CHAT, "messages", MESSAGES)]
)
async def test_a_token_without_text_still_makes_a_chunk(served, reference, path, field, value):
    """A special token left out of the text (BOS, forced by logit_bias) is a token generated:
    each makes a chunk with empty text, as vLLM's server streams without a parser, so a client
    sees the first token when it comes and each after it, not one chunk at the end."""
    bos = reference("llama").tokenizer.bos_token_id
    assert bos is not None
    request = {
        field: value,
        "temperature": 0,
        "max_tokens": 4,
        "ignore_eos": True,
        "logit_bias": {str(bos): 100},
        "stream": True,
    }
    chunks = sse_chunks(await post(served("llama"), path, request))
    (deltas,) = by_choice(chunks).values()
    if path == COMPLETIONS:
        texts = [d["text"] for d in deltas]
    else:
        texts = [d["delta"]["content"] for d in deltas]
        assert deltas[0]["delta"]["role"] == "assistant"
    assert texts == [""] * 4
    assert check_finish_reasons(deltas) == "length"


# --- prompt forms ------------------------------------------------------------------------------


async def test_echo_puts_the_prompt_first(served, greedy_llama):
    body = await ok(
        served("llama"),
        COMPLETIONS,
        {"prompt": PROMPTS[0], "echo": True, "temperature": 0, "max_tokens": MAX_TOKENS},
    )
    text = body["choices"][0]["text"]
    assert text.startswith(PROMPTS[0])
    assert text == PROMPTS[0] + greedy_llama[1]


async def test_prompt_as_token_ids(served, reference, greedy_llama):
    prompt_ids = reference("llama").encode(PROMPTS[0])
    request = {"temperature": 0, "max_tokens": MAX_TOKENS}
    for prompt in (prompt_ids, [prompt_ids]):
        body = await ok(served("llama"), COMPLETIONS, {**request, "prompt": prompt})
        assert [c["text"] for c in body["choices"]] == [greedy_llama[1]]
        assert body["usage"]["prompt_tokens"] == len(prompt_ids)


async def test_several_prompts_times_n(served, reference):
    ref = reference("llama")
    prompts = PROMPTS[:2]
    ids = [ref.encode(p) for p in prompts]
    new = [ref.greedy(i, 6) for i in ids]
    body = await ok(
        served("llama"),
        COMPLETIONS,
        {"prompt": prompts, "n": 2, "temperature": 0, "max_tokens": 6},
    )
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    texts = [c["text"] for c in body["choices"]]
    assert texts == [ref.text(new[0])] * 2 + [ref.text(new[1])] * 2
    assert body["usage"]["prompt_tokens"] == len(ids[0]) + len(ids[1])
    assert body["usage"]["completion_tokens"] == 2 * (len(new[0]) + len(new[1]))


# --- streaming ---------------------------------------------------------------------------------


async def test_streamed_completion_equals_the_non_streamed_one(served, reference):
    name, request = "gpt2", {"prompt": PROMPTS[1], "temperature": 0, "max_tokens": MAX_TOKENS}
    whole = await ok(served(name), COMPLETIONS, request)
    chunks = sse_chunks(await post(served(name), COMPLETIONS, {**request, "stream": True}))
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    (deltas,) = by_choice(chunks).values()
    assert "".join(d["text"] for d in deltas) == whole["choices"][0]["text"]
    assert check_finish_reasons(deltas) == whole["choices"][0]["finish_reason"]


async def test_streamed_chat_framing_role_and_finish_reason(served):
    request = {"messages": MESSAGES, "temperature": 0, "max_tokens": MAX_TOKENS, "n": 2}
    whole = await ok(served("llama"), CHAT, request)
    chunks = sse_chunks(await post(served("llama"), CHAT, {**request, "stream": True}))
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    choices = by_choice(chunks)
    assert sorted(choices) == [0, 1]
    for index, deltas in choices.items():
        assert deltas[0]["delta"]["role"] == "assistant"
        assert all("role" not in d["delta"] for d in deltas[1:])
        content = "".join(d["delta"].get("content") or "" for d in deltas)
        assert content == whole["choices"][index]["message"]["content"]
        assert check_finish_reasons(deltas) == whole["choices"][index]["finish_reason"]


async def test_streamed_stop_string_and_echo(served, greedy_llama):
    text = greedy_llama[1]
    stop = middle_substring(text)
    request = {
        "prompt": PROMPTS[0],
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "stop": stop,
        "echo": True,
        "stream": True,
    }
    chunks = sse_chunks(await post(served("llama"), COMPLETIONS, request))
    (deltas,) = by_choice(chunks).values()
    assert all(stop not in d["text"] for d in deltas)
    assert "".join(d["text"] for d in deltas) == PROMPTS[0] + text[: text.index(stop)]
    assert check_finish_reasons(deltas) == "stop"


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
async def test_stream_options_include_usage(served, reference, path):
    request: dict[str, Any] = {"temperature": 0, "max_tokens": 5, "n": 2, "ignore_eos": True}
    if path == CHAT:
        request["messages"] = MESSAGES
        prompt_ids = reference("llama").chat_ids(MESSAGES)
    else:
        request["prompt"] = PROMPTS[0]
        prompt_ids = reference("llama").encode(PROMPTS[0])
    body = {**request, "stream": True, "stream_options": {"include_usage": True}}
    chunks = sse_chunks(await post(served("llama"), path, body))
    *deltas, last = chunks
    assert last["choices"] == []
    assert last["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": 10,
        "total_tokens": len(prompt_ids) + 10,
    }
    assert all(len(c["choices"]) == 1 and c["usage"] is None for c in deltas)


async def test_sdk_streaming_chat(served, reference):
    ref = reference("llama")
    prompt_ids = ref.chat_ids(MESSAGES)
    expected = ref.greedy(prompt_ids)
    stream = await sdk_for(served("llama")).chat.completions.create(
        model="llama",
        messages=MESSAGES,
        temperature=0,
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    *deltas, last = chunks
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == ref.text(expected)
    assert deltas[-1].choices[0].finish_reason == ref.finish_reason(expected)
    assert last.choices == [] and last.usage is not None
    assert last.usage.prompt_tokens == len(prompt_ids)
    assert last.usage.completion_tokens == len(expected)


# --- errors ------------------------------------------------------------------------------------

USER = [{"role": "user", "content": "Hello"}]
IMAGE = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}},
        ],
    }
]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "in_message"),
    [
        (COMPLETIONS, {"model": "nope", "prompt": "x"}, 404, None, "nope"),
        (CHAT, {"model": "nope", "messages": USER}, 404, None, "nope"),
        (COMPLETIONS, {"model": "llama"}, 400, "prompt", "prompt"),
        (CHAT, {"model": "llama"}, 400, "messages", "messages"),
        (CHAT, {"messages": []}, 400, "messages", "messages"),
        (COMPLETIONS, {"prompt": "x", "temperature": 3}, 400, "temperature", "temperature"),
        (CHAT, {"messages": USER, "temperature": 3}, 400, "temperature", "temperature"),
        (COMPLETIONS, {"prompt": "x", "n": 0}, 400, "n", "n"),
        (CHAT, {"messages": USER, "n": 0}, 400, "n", "n"),
        (CHAT, {"messages": IMAGE}, 400, None, "image_url"),
        (CHAT, {"messages": USER, "tools": TOOLS}, 400, "tool_choice", "--enable-auto-tool-choice"),
        (COMPLETIONS, {"prompt": "x", "logit_bias": {"x": 1}}, 400, "logit_bias", "x"),
        (
            COMPLETIONS,
            {"prompt": "x", "stream_options": {"include_usage": True}},
            400,
            None,
            "stream",
        ),
        (CHAT, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs", "logprobs"),
        (COMPLETIONS, {"prompt": [1, 2, 10**6]}, 400, None, "vocabulary"),
        (COMPLETIONS, b'{"prompt": "x", ', 400, None, "JSON"),
        (CHAT, b"not json", 400, None, "JSON"),
        ("/openai/v1/embeddings", {"model": "llama", "input": "x"}, 400, None, "embeddings"),
    ],
)
async def test_errors_use_the_openai_shape(served, path, body, status, param, in_message):
    response = await post(served("llama"), path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert in_message in error["message"]
    if param is not None:
        assert error["param"] == param
    if status == 404:
        assert error["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [(COMPLETIONS, "prompt", PROMPTS[0]), (CHAT, "messages", USER)],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_prompt_plus_max_tokens_over_the_context(
    served, reference, path, field, value, stream
):
    ref = reference("llama")
    prompt_tokens = len(ref.chat_ids(USER) if path == CHAT else ref.encode(PROMPTS[0]))
    body = {field: value, "max_tokens": 200, "stream": stream}
    response = await post(served("llama"), path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"].startswith(
        "This model's maximum context length is 128 tokens. However, you requested "
        f"{prompt_tokens + 200} tokens ({prompt_tokens} in the messages, 200 in the completion)."
    )
    assert error["code"] == "context_length_exceeded"
    assert error["type"] == "invalid_request_error"
    assert error["param"] == field


async def test_a_prompt_that_fills_the_context_is_a_400(served, reference):
    prompt_ids = (reference("llama").encode(PROMPTS[1]) * 20)[:128]
    response = await post(served("llama"), COMPLETIONS, {"prompt": prompt_ids})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "context_length_exceeded"
    response = await post(
        served("llama"), CHAT, {"messages": [{"role": "user", "content": "a " * 130}]}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
async def test_generation_on_an_encoder_model_is_a_400(served, path):
    body = {"model": "bert_fill_mask", "prompt": "x", "messages": USER}
    response = await post(served("bert_fill_mask"), path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "fill_mask" in error["message"]


async def test_sdk_raises_typed_errors(served):
    client = sdk_for(served("llama"))
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError, match="context length"):
        await client.completions.create(model="llama", prompt="x", max_tokens=500)
    with pytest.raises(openai.BadRequestError):
        await client.embeddings.create(model="llama", input="x")


async def test_kserve_v1_predict_on_a_generative_model_is_a_400(served):
    response = await post(served("llama"), "/v1/models/llama:predict", {"instances": ["x"]})
    assert response.status_code == 400, response.text
    body = response.json()
    assert set(body) == {"error"} and isinstance(body["error"], str)
    assert "/v1/completions" in body["error"]


@pytest.mark.parametrize(
    "template",
    [
        "{{ raise_exception('no system messages') }}",
        "{% for %}",
        "{{ undefined_name.attribute }}",
        "{{ 1 / 0 }}",
    ],
)
async def test_a_request_chat_template_that_fails_is_a_400(served, template):
    body = {"messages": USER, "chat_template": template, "max_tokens": 3}
    response = await post_answered(served("llama", TRUST), CHAT, body)
    assert response.status_code == 400, response.text
    assert "chat template failed" in response.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("field", [{"logit_bias": {"99999": 1}}, {"stop_token_ids": [99999]}])
async def test_token_ids_outside_the_vocabulary_are_a_400(served, field, stream):
    body = {"prompt": PROMPTS[0], "max_tokens": 3, "stream": stream, **field}
    response = await post_answered(served("llama"), COMPLETIONS, body)
    assert response.status_code == 400, response.text
    assert "99999" in response.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_the_largest_seed_with_several_choices(served, stream):
    body = {
        "prompt": PROMPTS[0],
        "max_tokens": 3,
        "n": 2,
        "temperature": 1,
        "seed": 2**64 - 1,  # the top of the range the request accepts
        "stream": stream,
    }
    response = await post_answered(served("llama"), COMPLETIONS, body)
    if stream:
        assert sorted(by_choice(sse_chunks(response))) == [0, 1]
    else:
        assert response.status_code == 200, response.text
        assert [c["index"] for c in response.json()["choices"]] == [0, 1]


def token_text(tokenizer, token: int) -> str:
    """A token as vLLM's logprobs show it: decoded alone, with the space its SentencePiece
    ``▁`` stands for (which decoding one token drops: T5's ``▁the`` is ``the``) put back."""
    text = tokenizer.decode([token])
    marked = tokenizer.convert_ids_to_tokens(token).startswith("\u2581")
    return " " + text if marked and not text.startswith(" ") else text


def prompt_log_softmax(ref: Reference, prompt_ids: list[int]) -> torch.Tensor:
    """The model's log-softmax at each prompt position but the last: ``[len - 1, vocab]``."""
    with torch.no_grad():
        logits = ref.model(input_ids=torch.tensor([prompt_ids])).logits[0, :-1]
    return logits.float().log_softmax(dim=-1)


def check_prompt_logprobs(ref: Reference, prompt_ids: list[int], sent: list, top: int) -> None:
    """vLLM's ``prompt_logprobs`` shape, with the model's own values, ranks and alternatives."""
    expected = prompt_log_softmax(ref, prompt_ids)
    assert len(sent) == len(prompt_ids) and sent[0] is None
    for position, token in enumerate(prompt_ids[1:]):
        row = expected[position]
        entries = {int(token_id): entry for token_id, entry in sent[position + 1].items()}
        assert entries[token]["logprob"] == pytest.approx(float(row[token]), abs=1e-4)
        assert entries[token]["rank"] == int((row > row[token]).sum()) + 1
        assert entries[token]["decoded_token"] == ref.tokenizer.decode([token])
        alternatives = row.topk(top).indices.tolist()
        for rank, token_id in enumerate(alternatives, 1):
            assert entries[token_id]["rank"] == rank
        assert set(entries) == {token, *alternatives}


@pytest.mark.parametrize("name", ["gpt2", "llama"])
async def test_prompt_logprobs_are_the_models(served, reference, name):
    ref = reference(name)
    body = await ok(
        served(name),
        COMPLETIONS,
        {"prompt": PROMPTS[1], "max_tokens": 2, "temperature": 0, "prompt_logprobs": 3, "n": 2},
    )
    for choice in body["choices"]:
        check_prompt_logprobs(ref, ref.encode(PROMPTS[1]), choice["prompt_logprobs"], 3)
    plain = await ok(served(name), COMPLETIONS, {"prompt": "x"})
    assert "prompt_logprobs" not in plain["choices"][0]


async def test_chat_prompt_logprobs_are_the_models(served, reference):
    ref = reference("llama")
    body = await ok(
        served("llama"), CHAT, {"messages": MESSAGES, "max_tokens": 2, "prompt_logprobs": 0}
    )
    check_prompt_logprobs(ref, ref.chat_ids(MESSAGES), body["prompt_logprobs"], 0)


async def test_echo_with_logprobs_scores_the_prompt_too(served, reference, greedy_llama):
    ref = reference("llama")
    prompt_ids = ref.encode(PROMPTS[0])
    new = greedy_llama[0]
    body = await ok(
        served("llama"),
        COMPLETIONS,
        {"prompt": PROMPTS[0], "echo": True, "logprobs": 1, "temperature": 0, "max_tokens": 4},
    )
    (choice,) = body["choices"]
    logprobs = choice["logprobs"]
    scored = [*prompt_ids, *new[:4]]
    assert logprobs["tokens"] == [ref.tokenizer.decode([token]) for token in scored]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    expected = prompt_log_softmax(ref, scored + [0])
    for position, token in enumerate(scored[1:], 1):
        assert logprobs["token_logprobs"][position] == pytest.approx(
            float(expected[position - 1, token]), abs=1e-4
        )
        top = logprobs["top_logprobs"][position]  # the token itself and the top one
        assert logprobs["tokens"][position] in top and 1 <= len(top) <= 2
    assert choice["text"].startswith(PROMPTS[0])
    assert "prompt_logprobs" not in choice


@pytest.mark.parametrize(
    ("name", "body", "in_message"),
    [
        ("t5", {"prompt": PROMPTS[0], "prompt_logprobs": 1}, "decoder-only"),
        ("llama", {"prompt": PROMPTS[0], "prompt_logprobs": 1, "stream": True}, "stream"),
        ("llama", {"prompt": "x", "echo": True, "logprobs": 1, "stream": True}, "stream"),
        ("llama", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ],
)
async def test_prompt_logprobs_that_cannot_be_given_are_400s(served, name, body, in_message):
    response = await post(served(name), COMPLETIONS, body)
    assert response.status_code == 400, response.text
    assert in_message in response.json()["error"]["message"]


ANSWER_SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "ok": {"type": "boolean"},
    },
    "required": ["answer", "n", "ok"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize(
    "structured",
    [
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": ANSWER_SCHEMA},
            }
        },
        {"guided_json": ANSWER_SCHEMA},
        {"structured_outputs": {"json": ANSWER_SCHEMA}},
    ],
    ids=["response_format", "guided_json", "structured_outputs"],
)
async def test_json_schema_output_validates(served, name, structured):
    body = {"prompt": PROMPTS[0], "max_tokens": 64, "n": 3, "temperature": 1.0, "seed": 1}
    response = await ok(served(name), COMPLETIONS, {**body, **structured})
    for choice in response["choices"]:
        jsonschema.validate(json.loads(choice["text"]), ANSWER_SCHEMA)
        assert choice["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("structured", "matches"),
    [
        (
            {"guided_regex": "[0-9]{3}-[a-z]{2}"},
            lambda text: re.fullmatch("[0-9]{3}-[a-z]{2}", text),
        ),
        ({"guided_choice": ["alpha", "beta"]}, lambda text: text in ("alpha", "beta")),
        (
            {"guided_grammar": 'root ::= "(" ("a" | "b")+ ")"'},
            lambda text: re.fullmatch(r"\([ab]+\)", text),
        ),
        (
            {"response_format": {"type": "json_object"}},
            lambda text: isinstance(json.loads(text), dict),
        ),
    ],
)
async def test_regex_choice_grammar_and_json_object(served, structured, matches):
    # the random tiny model's JSON object closes within 48 tokens for this seed (for about two
    # seeds in three: a string it opens can run on)
    body = {"messages": MESSAGES, "max_tokens": 48, "n": 2, "seed": 0, **structured}
    response = await ok(served("llama"), CHAT, body)
    for choice in response["choices"]:
        assert matches(choice["message"]["content"]), choice["message"]["content"]


async def test_constrained_and_unconstrained_requests_batched_together(served, reference):
    """Unconstrained rows decoded beside constrained ones are exactly what they are alone."""
    model = served("llama")
    alone = await ok(model, COMPLETIONS, {"prompt": PROMPTS, "max_tokens": 12, "temperature": 0})
    constrained = {"prompt": PROMPTS[1], "max_tokens": 64, "guided_json": ANSWER_SCHEMA}
    async with client_for(model) as client:
        mixed = await asyncio.gather(
            client.post(COMPLETIONS, json=constrained),
            client.post(COMPLETIONS, json={"prompt": PROMPTS, "max_tokens": 12, "temperature": 0}),
            client.post(COMPLETIONS, json={**constrained, "n": 2, "seed": 5, "temperature": 1}),
        )
    assert [r.status_code for r in mixed] == [200, 200, 200]
    assert [c["text"] for c in mixed[1].json()["choices"]] == [c["text"] for c in alone["choices"]]
    for response in (mixed[0], mixed[2]):
        for choice in response.json()["choices"]:
            jsonschema.validate(json.loads(choice["text"]), ANSWER_SCHEMA)


async def test_sdk_parses_a_pydantic_model(served):
    class Answer(pydantic.BaseModel):
        answer: Literal["yes", "no"]
        n: int = pydantic.Field(ge=0, le=9)
        ok: bool

    client = sdk_for(served("llama"))
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    parsed = await parse(model="llama", messages=MESSAGES, response_format=Answer, max_tokens=64)
    assert isinstance(parsed.choices[0].message.parsed, Answer)


async def test_a_tokenizer_llguidance_cannot_read_is_a_400(served):
    response = await post(served("t5"), COMPLETIONS, {"prompt": "x", "guided_regex": "a+"})
    assert response.status_code == 400, response.text
    assert "not available for this model's tokenizer" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("structured", "param", "in_message"),
    [
        ({"guided_regex": "[0-9"}, None, "invalid regex"),
        (
            {"guided_json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}},
            None,
            "invalid JSON schema",
        ),
        ({"guided_grammar": "root ::= ("}, None, "invalid grammar"),
        ({"guided_choice": "yes"}, "guided_choice", "list"),
        ({"guided_regex": "a", "guided_json": {}}, "guided_regex", "only one"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_bad_constraints_are_400s(served, structured, param, in_message, stream):
    response = await post(
        served("llama"), COMPLETIONS, {"prompt": "x", "stream": stream, **structured}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert in_message in error["message"]
    if param is not None:
        assert error["param"] == param


async def test_streamed_constrained_output_adds_up_to_the_whole(served):
    request = {"prompt": PROMPTS[1], "max_tokens": 64, "guided_json": ANSWER_SCHEMA, "n": 2}
    whole = await ok(served("llama"), COMPLETIONS, {**request, "seed": 9, "temperature": 1})
    streamed = {**request, "seed": 9, "temperature": 1, "stream": True}
    chunks = sse_chunks(await post(served("llama"), COMPLETIONS, streamed))
    texts = {i: "".join(d["text"] for d in deltas) for i, deltas in by_choice(chunks).items()}
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    for text in texts.values():
        jsonschema.validate(json.loads(text), ANSWER_SCHEMA)


WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["celsius", "kelvin"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMETERS = {
    "type": "object",
    "properties": {"tz": {"enum": ["CET", "UTC"]}},
    "required": ["tz"],
    "additionalProperties": False,
}
WEATHER_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMETERS}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMETERS}},
]
SCHEMAS = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}
AUTO = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
FORCED_HERMES = (
    r'Ok\.\n<tool_call>\{"name": "get_time", "arguments": \{"tz": "(CET|UTC)"\}\}</tool_call>'
)


async def test_a_named_tool_choice_yields_a_call_whose_arguments_validate(served):
    response = await sdk_for(served("llama")).chat.completions.create(
        model="llama",
        messages=MESSAGES,
        tools=WEATHER_TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=64,
        n=2,
        seed=4,
    )
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)


async def test_a_named_call_cut_by_max_tokens_finishes_for_length(served):
    """Its arguments end mid-value: ``length`` says so (not ``tool_calls``), streamed or not."""
    body = {
        "model": "llama",
        "messages": MESSAGES,
        "tools": WEATHER_TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 3,
    }
    client = sdk_for(served("llama"))
    whole = (await client.chat.completions.create(**body)).choices[0]
    assert whole.finish_reason == "length"
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather"
    with pytest.raises(ValueError):
        json.loads(call.function.arguments)
    reasons = [
        choice.finish_reason
        async for chunk in await client.chat.completions.create(stream=True, **body)
        for choice in chunk.choices
        if choice.finish_reason
    ]
    assert reasons == ["length"]


async def test_required_calls_parse_against_each_functions_schema(served):
    body = {"messages": MESSAGES, "tools": WEATHER_TOOLS, "tool_choice": "required"}
    body["parallel_tool_calls"] = False  # one call: it fits in what the tiny context leaves
    response = await ok(served("llama"), CHAT, {**body, "max_tokens": 80, "n": 3, "seed": 2})
    for choice in response["choices"]:
        assert choice["finish_reason"] == "tool_calls"
        calls = choice["message"]["tool_calls"]
        assert calls
        for call in calls:
            function = call["function"]
            jsonschema.validate(json.loads(function["arguments"]), SCHEMAS[function["name"]])


async def test_auto_parses_the_calls_the_model_writes_streamed_or_not(served):
    # The tiny model writes a Hermes call because a regex makes it; the parser finds it.
    model = served("llama", *AUTO)
    body = {"messages": MESSAGES, "tools": WEATHER_TOOLS, "max_tokens": 80, "seed": 1}
    body["guided_regex"] = FORCED_HERMES
    whole = (await ok(model, CHAT, body))["choices"][0]
    assert whole["finish_reason"] == "tool_calls"
    assert whole["message"]["content"] == "Ok.\n"  # as vLLM's hermes gives it
    (call,) = whole["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time"
    jsonschema.validate(json.loads(call["function"]["arguments"]), TIME_PARAMETERS)

    extra = {"guided_regex": body.pop("guided_regex")}
    stream = await sdk_for(model).chat.completions.create(
        model="llama", stream=True, extra_body=extra, **body
    )
    content, calls, reasons = "", [], []
    async for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            calls += choice.delta.tool_calls or []
            reasons.append(choice.finish_reason)
    assert content == "Ok.\n" and reasons[-1] == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (call["function"]["name"], call["function"]["arguments"])
    ]


async def test_auto_without_a_call_is_content(served):
    model = served("llama", *AUTO)
    body = {"messages": MESSAGES, "tools": WEATHER_TOOLS, "max_tokens": 8, "temperature": 0}
    (choice,) = (await ok(model, CHAT, body))["choices"]
    assert "tool_calls" not in choice["message"] or not choice["message"]["tool_calls"]
    assert choice["finish_reason"] != "tool_calls"


TOOL_TEMPLATE = (
    "{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}"
    "(call {{ c.function.name }} {{ c.function.arguments | tojson }}){% endfor %}"
    "{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %}{% endfor %}<assistant>"
)


async def test_tools_and_tool_results_go_through_the_template(served, reference):
    ref = reference("llama")
    arguments = {"city": "Paris", "unit": "celsius"}
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": json.dumps(arguments)}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
    ]  # fmt: skip
    body = {"messages": messages, "tools": WEATHER_TOOLS, "chat_template": TOOL_TEMPLATE}
    got = await ok(served("llama", TRUST), "/openai/v1/tokenize", body)
    expected_messages = [dict(m) for m in messages]
    expected_messages[2] = {**messages[2], "content": ""}
    expected_messages[2]["tool_calls"] = [
        {
            **messages[2]["tool_calls"][0],
            "function": {"name": "get_weather", "arguments": arguments},
        }
    ]
    text = ref.tokenizer.apply_chat_template(
        expected_messages, tools=WEATHER_TOOLS, chat_template=TOOL_TEMPLATE, tokenize=False
    )
    assert '(call get_weather {"city": "Paris", "unit": "celsius"})' in text
    assert "<tool>18 degrees#call_1" in text and "[tool get_time]" in text
    assert got["tokens"] == ref.tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(
    ("body", "param", "in_message"),
    [
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not in tools",
        ),
        ({"tool_choice": "required", "guided_json": {}}, "tool_choice", "constrains the output"),
        ({"tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, None, "pattern"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "nonsense"}},
                    }
                ],
                "tool_choice": "required",
            },
            None,
            "invalid JSON schema",
        ),
    ],
)
async def test_bad_tool_requests_are_400s(served, body, param, in_message):
    request = {"messages": MESSAGES, "tools": WEATHER_TOOLS, **body}
    response = await post(served("llama"), CHAT, request)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert in_message in error["message"]
    if param is not None:
        assert error["param"] == param
