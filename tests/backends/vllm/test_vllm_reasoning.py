"""Reasoning output on the vLLM backend: one server on the scripted thinking model
(:mod:`tests.thinking_model`) with ``--reasoning-parser deepseek_v3`` (thinking when the
request's ``chat_template_kwargs`` say so, as DeepSeek-V3.1), started as a user starts it. The
split is the protocol layer's, as on the transformers backend (the message and the stream
equal that backend's, loaded in-process); what differs is who starts a structured output's
grammar once the reasoning ends: vLLM's engine, given the flag, and told per request whether
the model thinks (the parser made with the request's template kwargs, as vLLM's server
does)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from huggingfaceserver.protocols.kserve_model import BackendModel
from tests.backends.vllm import VLLM_FLAGS, vllm_env
from tests.harness import ServerProcess, client_for, load_model, run_server
from tests.thinking_model import ANSWER, REASONING, build_thinking_llama

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PARSER = ["--reasoning-parser", "deepseek_v3"]
BODY: dict[str, Any] = {
    "model": "thinker",
    "messages": [{"role": "user", "content": "Where is Paris?"}],
    "max_tokens": 32,
    "chat_template_kwargs": {"thinking": True},
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_thinking_llama(tmp_path_factory.mktemp("thinker"))


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("vllm-reasoning")
    args = ["--model_dir", str(model_dir), "--model_name", "thinker", "--backend", "vllm"]
    with contextlib.ExitStack() as stack:
        yield stack.enter_context(
            run_server([*args, *PARSER, *VLLM_FLAGS], root, env=vllm_env(root))
        )


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> BackendModel:
    """The same model and parser on the transformers backend, in-process."""
    argv = ["--model_dir", str(model_dir), "--model_name", "thinker", "--backend", "huggingface"]
    return load_model([*argv, *PARSER])


def post(server: ServerProcess, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}/openai/v1/chat/completions", json=body, timeout=60)


async def post_reference(model: BackendModel, body: dict[str, Any]) -> httpx.Response:
    async with client_for(model) as client:
        return await client.post("/openai/v1/chat/completions", json=body)


def streamed(response_text: str) -> tuple[str, str, dict[str, Any]]:
    """The reasoning and content a stream adds up to, and its usage."""
    events = [e.removeprefix("data: ") for e in response_text.strip().split("\n\n")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    deltas = [choice["delta"] for chunk in chunks for choice in chunk["choices"]]
    reasoning = "".join(delta.get("reasoning") or "" for delta in deltas)
    content = "".join(delta.get("content") or "" for delta in deltas)
    return reasoning, content, chunks[-1]["usage"]


async def test_the_split_is_the_transformers_backends(server, reference):
    response = post(server, BODY)
    assert response.status_code == 200, response.text
    ours = response.json()
    message = ours["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == (REASONING, ANSWER)
    theirs = (await post_reference(reference, BODY)).json()
    assert message == theirs["choices"][0]["message"]
    assert ours["usage"] == theirs["usage"]


def test_streamed_deltas_add_up(server):
    body = {**BODY, "stream": True, "stream_options": {"include_usage": True}}
    reasoning, content, usage = streamed(post(server, body).text)
    assert (reasoning, content) == (REASONING, ANSWER)
    assert usage["completion_tokens_details"]["reasoning_tokens"] > 0


async def test_structured_output_starts_after_the_reasoning_where_the_model_thinks(
    server, reference
):
    """Thinking: the grammar starts after ``</think>`` (the engine's parser, made without the
    request's kwargs, took the model for one that does not think: the choice came first and
    was filed as reasoning). Not thinking: the grammar starts at the first token. The
    reasoning is the transformers backend's (the choice after it is the random model's)."""
    for thinking in (True, False):
        body = {**BODY, "guided_choice": ["yes", "no"]}
        body["chat_template_kwargs"] = {"thinking": thinking}
        response = post(server, body)
        assert response.status_code == 200, response.text
        message = response.json()["choices"][0]["message"]
        assert message.get("reasoning") == (REASONING if thinking else None)
        assert message["content"] in ("yes", "no")
        theirs = (await post_reference(reference, body)).json()["choices"][0]["message"]
        assert theirs.get("reasoning") == message.get("reasoning")  # the choice: a coin toss
        assert theirs["content"] in ("yes", "no")
