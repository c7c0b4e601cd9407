"""The generation routes' request limits, in-process: request chat templates (refused unless
trusted; bounded and off the event loop when trusted), prompts far beyond the context, caps on
prompts, choices, stop strings and logprobs, and messages that say what was wrong."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from huggingfaceserver.protocols.kserve_model import BackendModel
from huggingfaceserver.protocols.openai import prompts
from tests.harness import client_for, loader

COMPLETIONS = "/openai/v1/completions"
CHAT = "/openai/v1/chat/completions"
USER = [{"role": "user", "content": "Hello world"}]
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
MAX_INPUTS = 4
FIVE_MB = "The capital of France is Paris. " * 160_000


@pytest.fixture(scope="module")
def served(tiny_models: dict[str, Path]) -> Callable[..., BackendModel]:
    """``served(*flags)``: the tiny llama loaded as the server loads it, once per flags."""
    return loader(tiny_models["llama"], "llama")


@pytest.fixture
def trusting(served) -> BackendModel:
    return served("--trust_request_chat_template", "--max_inputs_per_request", str(MAX_INPUTS))


async def post(model: BackendModel, path: str, body: dict[str, Any] | bytes) -> httpx.Response:
    async with client_for(model) as client:
        if isinstance(body, bytes):
            return await client.post(path, content=body)
        return await client.post(path, json=body)


def error(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    body = response.json()["error"]
    assert body["type"] == "invalid_request_error"
    return body


# --- request chat templates -------------------------------------------------------------------


async def test_a_request_template_is_refused_without_the_flag(served):
    body = {"messages": USER, "chat_template": TEMPLATE, "max_tokens": 2}
    refused = error(await post(served(), CHAT, body))
    assert refused["param"] == "chat_template"
    assert "--trust_request_chat_template" in refused["message"]


async def test_a_trusted_request_template_makes_the_prompt(trusting, tiny_models):
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["llama"])
    text = tokenizer.apply_chat_template(USER, chat_template=TEMPLATE, tokenize=False)
    expected = tokenizer(text, add_special_tokens=False)["input_ids"]
    body = {"messages": USER, "chat_template": TEMPLATE, "max_tokens": 2}
    response = await post(trusting, CHAT, body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == len(expected)


HOSTILE = {
    "loops": "{% for i in range(12000) %}{% for j in range(12000) %}x{% endfor %}{% endfor %}",
    "repetition": "{{ ('x'*1200000000)|length }}",
}


@pytest.mark.parametrize("template", HOSTILE.values(), ids=list(HOSTILE))
async def test_a_hostile_template_is_a_400_and_the_server_answers_meanwhile(trusting, template):
    async with client_for(trusting) as client:
        started = time.monotonic()
        body = {"messages": USER, "chat_template": template, "max_tokens": 2}
        chat = asyncio.ensure_future(client.post(CHAT, json=body))
        probes: list[float] = []  # other requests answered while the template renders
        while not chat.done():
            await asyncio.sleep(0.02)  # let the chat run (an in-process GET never suspends)
            sent = time.monotonic()
            assert (await client.get("/openai/v1/models")).status_code == 200
            if not chat.done():
                probes.append(time.monotonic() - sent)
        refused = error(await chat)
    elapsed = time.monotonic() - started
    assert refused["param"] == "chat_template" and "limit" in refused["message"]
    assert elapsed < 3
    if template == HOSTILE["loops"]:  # a second of rendering: the loop answered all along
        assert len(probes) >= 3 and max(probes) < 0.5, probes


async def test_a_template_that_fails_is_a_400(trusting):
    body = {"messages": USER, "chat_template": "{{ raise_exception('no') }}", "max_tokens": 2}
    assert "chat template failed" in error(await post(trusting, CHAT, body))["message"]


# --- prompts far beyond the context -----------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (COMPLETIONS, {"prompt": FIVE_MB, "max_tokens": 1}, "prompt"),
        (CHAT, {"messages": [{"role": "user", "content": FIVE_MB}], "max_tokens": 1}, "messages"),
    ],
    ids=["completion", "chat"],
)
async def test_a_5_mb_prompt_is_refused_quickly(served, path, body, param):
    started = time.monotonic()
    refused = error(await post(served(), path, body))
    assert time.monotonic() - started < 2
    assert refused["param"] == param and refused["code"] == "context_length_exceeded"
    assert "maximum context length is 128 tokens" in refused["message"]


async def test_prompts_within_the_context_are_the_tokenizers_ids(served, tiny_models):
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["llama"])
    prompt = "The capital of France is Paris. " * 3
    body = {"prompt": prompt, "max_tokens": 1, "echo": True}
    response = await post(served(), COMPLETIONS, body)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] == len(tokenizer(prompt)["input_ids"])
    assert response.json()["choices"][0]["text"].startswith(prompt)


# --- caps ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "fields", "param", "says"),
    [
        (COMPLETIONS, {"prompt": ["a"] * (MAX_INPUTS + 1)}, "prompt", "--max_inputs_per_request 4"),
        (COMPLETIONS, {"prompt": [[5, 6]] * 5}, "prompt", "--max_inputs_per_request 4"),
        (COMPLETIONS, {"prompt": ["a", "b"], "n": 3}, "n", "--max_inputs_per_request 4"),
        (COMPLETIONS, {"prompt": "a", "n": 129}, "n", "128"),
        (COMPLETIONS, {"prompt": "a", "stop": ["x"] * 17}, "stop", "16"),
        (COMPLETIONS, {"prompt": "a", "logprobs": 21}, "logprobs", "20"),
        (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "20"),
        (COMPLETIONS, {"prompt": "a", "max_tokens": 0}, "max_tokens", "1"),
        (CHAT, {"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens", "1"),
        (COMPLETIONS, {"prompt": "a", "max_tokens": 1000}, "prompt", "128"),
        (CHAT, {"messages": USER, "min_tokens": 500}, "min_tokens", "500"),
    ],
    ids=[
        "prompts",
        "token prompts",
        "choices",
        "n",
        "stop",
        "logprobs",
        "top_logprobs",
        "max_tokens",
        "max_completion_tokens",
        "max_tokens over the context",
        "min_tokens over the context",
    ],
)
async def test_each_cap_is_a_400_that_names_its_limit(trusting, path, fields, param, says):
    refused = error(await post(trusting, path, fields))
    assert refused["param"] == param
    assert says in refused["message"]


async def test_requests_at_the_caps_are_served(trusting):
    body = {"prompt": ["a", "b"], "n": 2, "max_tokens": 1, "logprobs": 20, "stop": ["x"] * 16}
    response = await post(trusting, COMPLETIONS, body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == MAX_INPUTS


# --- messages that say what was wrong ------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "param", "says"),
    [
        (b'{"prompt": "a", "temperature": NaN}', "temperature", "must be a number, got NaN"),
        (b'{"prompt": "a", "top_p": "nan"}', "top_p", "must be a number, got NaN"),
        (b'{"prompt": "a", "presence_penalty": Infinity}', "presence_penalty", "got Infinity"),
        (b'{"prompt": "a", "frequency_penalty": -1e999}', "frequency_penalty", "got -Infinity"),
        (b'{"prompt": "a", "logit_bias": {"5": NaN}}', "logit_bias.5", "got NaN"),
    ],
    ids=["NaN", "nan string", "Infinity", "overflow", "logit_bias"],
)
async def test_not_a_number_is_said_so(served, raw, param, says):
    refused = error(await post(served(), COMPLETIONS, raw))
    assert refused["param"] == param
    assert says in refused["message"] and "<=" not in refused["message"]


async def test_rendering_and_tokenizing_run_off_the_event_loop(trusting, monkeypatch):
    threads: dict[str, set[int]] = {"render": set(), "tokenize": set()}

    def recorded(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            threads[name].add(threading.get_ident())
            return function(*args, **kwargs)

        return call

    for name, attribute in [
        ("render", "render_server_template"),
        ("render", "render_request_template"),
        ("tokenize", "tokenize"),
    ]:
        monkeypatch.setattr(prompts, attribute, recorded(name, getattr(prompts, attribute)))
    for body in [
        {"messages": USER, "max_tokens": 1},
        {"messages": USER, "max_tokens": 1, "chat_template": TEMPLATE},
    ]:
        assert (await post(trusting, CHAT, body)).status_code == 200
    assert (
        await post(trusting, COMPLETIONS, {"prompt": ["a", "b"], "max_tokens": 1})
    ).status_code == 200
    assert threads["render"] and threads["tokenize"]
    assert threading.get_ident() not in threads["render"] | threads["tokenize"]
