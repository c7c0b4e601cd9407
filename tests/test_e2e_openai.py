"""A generative model served as a user starts it (``python -m huggingfaceserver``), driven by
the official openai SDK and plain HTTP: completions, chat, streaming, concurrent requests, and
generation that stops when the client goes away; in both process layouts (``layout``)."""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx
import openai
import pytest
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
)

from huggingfaceserver.cli import OPENAI_PREFIX_ENV as PREFIX_ENV
from tests.harness import ServerProcess, run_server
from tests.openai_checks import Reference, check_streamed_chat_adds_up, middle_substring
from tests.prometheus import scrape

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Hello world"}]
CANCELLED = re.compile(r"generation cancelled \(client gone\) after (\d+) tokens")


@pytest.fixture(scope="module")
def llama_path(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def server(llama_path: Path, layout: list[str], tmp_path_factory):
    args = ["--model_dir", str(llama_path), "--model_name", "llama", "--backend", "huggingface"]
    with run_server([*args, *layout], tmp_path_factory.mktemp("e2e-openai")) as process:
        yield process


@pytest.fixture(scope="module")
def root_server(llama_path: Path, layout: list[str], tmp_path_factory):
    """The same model with ``KSERVE_OPENAI_ROUTE_PREFIX=""``: the OpenAI routes at the root.

    ``run_server`` passes this process's environment on, so the variable is set only while
    the subprocess starts.
    """
    args = ["--model_dir", str(llama_path), "--model_name", "llama", "--backend", "huggingface"]
    stack = ExitStack()
    with pytest.MonkeyPatch.context() as env:
        env.setenv(PREFIX_ENV, "")
        root = tmp_path_factory.mktemp("e2e-root")
        process = stack.enter_context(run_server([*args, *layout], root))
    with stack:
        yield process


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/openai/v1", api_key="x", timeout=60)


@pytest.fixture(scope="module")
def reference(llama_path: Path) -> Reference:
    model = AutoModelForCausalLM.from_pretrained(llama_path).eval()
    return Reference(model, AutoTokenizer.from_pretrained(llama_path))


def wait_for_cancellation(server: ServerProcess, since: int, timeout: float = 15.0) -> int:
    """The token count of the first "generation cancelled" log line after offset ``since``."""
    return int(server.wait_for_log(CANCELLED, since, timeout).group(1))


def test_completions(client, reference):
    response = client.completions.create(
        model="llama", prompt="Hello world", temperature=0, max_tokens=12
    )
    assert response.object == "text_completion"
    (choice,) = response.choices
    prompt_ids = reference.tokenizer("Hello world")["input_ids"]
    assert choice.text == reference.text(reference.greedy(prompt_ids, 12))
    assert response.usage is not None and response.usage.prompt_tokens == len(prompt_ids)


def test_generation_metrics_under_vllms_names(server, client, reference):
    """The decode loop's figures (in the engine process with two fronts), labelled as vLLM
    labels them, so that vLLM's dashboards and KEDA rules read them."""
    labels = {"model_name": "llama", "engine": "0"}
    before = scrape(server.url)
    response = client.completions.create(
        model="llama", prompt="Hello world", max_tokens=6, extra_body={"ignore_eos": True}
    )
    assert response.choices[0].finish_reason == "length"
    after = scrape(server.url)

    def moved(name: str, **more: str) -> float:
        return after.value(name, **labels, **more) - before.value(name, **labels, **more)

    assert moved("vllm:prompt_tokens_total") == len(reference.tokenizer("Hello world")["input_ids"])
    assert moved("vllm:generation_tokens_total") == 6
    assert moved("vllm:request_success_total", finished_reason="length") == 1
    assert moved("vllm:time_to_first_token_seconds_count") == 1
    assert moved("vllm:inter_token_latency_seconds_count") == 5
    assert moved("vllm:e2e_request_latency_seconds_count") == 1
    assert after.value("vllm:num_requests_waiting", **labels) == 0
    assert after.type_lines("vllm:num_requests_waiting") == 1


def test_chat(client, reference):
    response = client.chat.completions.create(
        model="llama", messages=MESSAGES, temperature=0, max_tokens=12
    )
    assert response.object == "chat.completion"
    prompt_ids = reference.chat_ids(MESSAGES)
    assert response.choices[0].message.content == reference.text(reference.greedy(prompt_ids, 12))
    assert response.usage is not None and response.usage.prompt_tokens == len(prompt_ids)


def test_n_greedy_choices_carry_the_models_logprobs(client, reference):
    """Each of two greedy choices: the reference's tokens, with the model's log-probabilities
    of the sampled token and of the top 2."""
    prompt_ids = reference.encode("Hello world")
    new = reference.greedy(prompt_ids, 6)
    expected = reference.log_softmax(prompt_ids, new)
    response = client.completions.create(
        model="llama", prompt="Hello world", temperature=0, max_tokens=6, n=2, logprobs=2
    )
    assert [choice.index for choice in response.choices] == [0, 1]
    decode = reference.tokenizer.decode
    for choice in response.choices:
        assert choice.text == reference.text(new)
        logprobs = choice.logprobs
        assert logprobs is not None and logprobs.tokens == [decode([token]) for token in new]
        assert logprobs.token_logprobs == pytest.approx(
            [float(expected[step, token]) for step, token in enumerate(new)], abs=1e-4
        )
        assert logprobs.top_logprobs is not None and len(logprobs.top_logprobs) == len(new)
        for step, top in enumerate(logprobs.top_logprobs):
            values, ids = expected[step].topk(2)
            tops = {decode([i]): v for i, v in zip(ids.tolist(), values.tolist(), strict=True)}
            assert top == pytest.approx(tops, abs=1e-4)


def test_a_stop_string_ends_every_choice(client, reference):
    new = reference.greedy(reference.encode("Hello world"), 12)
    text = reference.text(new)
    stop = middle_substring(text)
    response = client.completions.create(
        model="llama", prompt="Hello world", temperature=0, max_tokens=12, n=2, stop=[stop]
    )
    cut = text[: text.index(stop)]
    assert [(choice.text, choice.finish_reason) for choice in response.choices] == [
        (cut, "stop")
    ] * 2
    assert response.usage is not None and response.usage.completion_tokens < 2 * len(new)


def test_streaming_chat_equals_the_non_streamed_answer(client):
    check_streamed_chat_adds_up(client, "llama", MESSAGES)


def test_embeddings_are_not_served_by_a_generative_model(client):
    with pytest.raises(openai.BadRequestError, match="embeddings"):
        client.embeddings.create(model="llama", input="Hello world")


def test_concurrent_chat_requests_all_complete(client):
    conversations = [[{"role": "user", "content": f"Tell me about {n} cats"}] for n in range(4)]

    def chat(messages: list[dict[str, str]]) -> str:
        response = client.chat.completions.create(
            model="llama",
            messages=messages,
            temperature=0,
            max_tokens=40,
            extra_body={"ignore_eos": True},
        )
        assert response.choices[0].finish_reason == "length"
        return response.choices[0].message.content or ""

    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(chat, conversations))
    assert together == [chat(messages) for messages in conversations]


def stream_events(url: str, body: dict, started: threading.Event | None = None) -> list[dict]:
    """Every event of a streamed completion; ``started`` is set once the first one arrived."""
    events = []
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line.removeprefix("data: ")))
                if started is not None:
                    started.set()
    return events


def streamed_text(events: list[dict]) -> str:
    assert all("error" not in event for event in events)
    return "".join(event["choices"][0]["text"] for event in events if event["choices"])


def test_a_request_that_fails_in_a_shared_batch_fails_alone(server):
    """A sampled request whose grammar is complete before its ``min_tokens`` (no token is
    allowed next) fails with an error event, while three greedy streams decoded in the same
    batch go on and produce what each produces alone."""
    url = f"{server.url}/openai/v1/completions"
    prompts = ["Hello world", "The capital of France", "Once upon"]  # + 120 tokens: 128 at most
    bodies = [
        {"model": "llama", "prompt": p, "temperature": 0, "max_tokens": 120, "ignore_eos": True}
        for p in prompts
    ]
    alone = [streamed_text(stream_events(url, body)) for body in bodies]
    poisoned = {
        "model": "llama",
        "prompt": "Answer:",
        "temperature": 1.0,
        "seed": 7,
        "min_tokens": 12,
        "max_tokens": 20,
        "structured_outputs": {"choice": ["yes"]},
    }
    # alone first, a few times: each front (two in one layout) builds its grammar support and
    # compiles the grammar once, not while the streams below decode
    failed = [stream_events(url, poisoned) for _ in range(4)][-1]
    assert "error" in failed[-1], failed
    assert failed[-1]["error"]["type"] == "invalid_request_error"
    assert "min_tokens" in failed[-1]["error"]["message"]
    since = len(server.log())
    started = [threading.Event() for _ in bodies]
    with ThreadPoolExecutor(len(bodies) + 1) as pool:
        streams = [
            pool.submit(stream_events, url, b, s) for b, s in zip(bodies, started, strict=True)
        ]
        assert all(event.wait(30) for event in started)
        assert stream_events(url, poisoned)[-1] == failed[-1]
        # the others had 110-odd tokens to go when it failed: it was decoded with them
        assert not all(stream.done() for stream in streams)
        together = [streamed_text(stream.result()) for stream in streams]
    assert together == alone
    assert "retrying each apart" not in server.log()[since:]  # not the forward: its own row
    assert httpx.get(f"{server.url}/v2/health/ready", timeout=5).status_code == 200


def test_a_client_that_leaves_a_stream_stops_generation(server):
    since = len(server.log())
    body = {"prompt": "Hi", "max_tokens": 100, "ignore_eos": True, "stream": True}
    received = []
    url = f"{server.url}/openai/v1/completions"
    with httpx.stream("POST", url, json=body, timeout=30) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                received.append(json.loads(line.removeprefix("data: ")))
            if len(received) == 2:
                break
    assert all(chunk["choices"][0]["finish_reason"] is None for chunk in received)
    assert wait_for_cancellation(server, since) < 60
    assert httpx.get(f"{server.url}/v2/health/ready", timeout=5).status_code == 200


def test_a_client_that_times_out_stops_generation(server):
    since = len(server.log())
    # 128 choices of 120 tokens with logprobs: seconds of work on a CPU, well over the timeout.
    body = {"prompt": "Hi", "max_tokens": 120, "n": 128, "logprobs": 20, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.url}/openai/v1/completions", json=body, timeout=0.3)
    assert wait_for_cancellation(server, since) < 120
    assert httpx.get(f"{server.url}/v2/health/ready", timeout=5).status_code == 200


def test_empty_prefix_serves_openai_at_the_root(root_server):
    url = root_server.url
    response = httpx.post(
        f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=30
    )
    assert response.status_code == 200, response.text
    assert response.json()["object"] == "text_completion"
    listing = httpx.get(f"{url}/v1/models", timeout=5).json()
    assert listing["models"] == ["llama"]
    assert [model["id"] for model in listing["data"]] == ["llama"]
    sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="x", timeout=60)
    assert [model.id for model in sdk.models.list()] == ["llama"]
    chat = sdk.chat.completions.create(model="llama", messages=MESSAGES, max_tokens=4)
    assert chat.choices[0].message.role == "assistant"
    predict = httpx.post(f"{url}/v1/models/llama:predict", json={"instances": ["x"]}, timeout=5)
    assert predict.status_code == 400 and isinstance(predict.json()["error"], str)


ANSWER = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "ok": {"type": "boolean"}},
    "required": ["answer", "ok"],
    "additionalProperties": False,
}


def test_structured_output_tools_and_prompt_logprobs(server, client, reference):
    """What issue 13 added, through this layout: a schema holds, a named tool's arguments
    parse, prompt logprobs come, and a bad regex is a 400 before a stream starts."""
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}}
    chat = client.chat.completions.create(
        model="llama", messages=MESSAGES, max_tokens=48, n=2, seed=3, response_format=schema
    )
    for choice in chat.choices:
        assert set(json.loads(choice.message.content)) == {"answer", "ok"}
    tools = [{"type": "function", "function": {"name": "answer", "parameters": ANSWER}}]
    named = {"type": "function", "function": {"name": "answer"}}
    called = client.chat.completions.create(
        model="llama", messages=MESSAGES, max_tokens=48, tools=tools, tool_choice=named
    )
    (call,) = called.choices[0].message.tool_calls
    assert set(json.loads(call.function.arguments)) == {"answer", "ok"}
    scored = httpx.post(
        f"{server.url}/openai/v1/completions",
        json={"prompt": "Hello world", "max_tokens": 2, "prompt_logprobs": 1},
        timeout=60,
    ).json()["choices"][0]["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(reference.encode("Hello world"))
    bad = httpx.post(
        f"{server.url}/openai/v1/completions",
        json={"prompt": "x", "stream": True, "guided_regex": "[0-9"},
        timeout=60,
    )
    assert bad.status_code == 400 and "invalid regex" in bad.json()["error"]["message"]
