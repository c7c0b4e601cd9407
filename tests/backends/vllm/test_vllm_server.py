"""One vLLM server on the tiny Llama (hidden size 64), started as a user starts it: readiness
while the engine starts, greedy text and logprobs equal to the transformers backend's (the same
protocol layer, loaded in-process), streaming, ``n``, stop strings, errors in the OpenAI shape,
and generation that stops when the client goes away. Started without ``VLLM_CPU_KVCACHE_SPACE``:
the server sizes vLLM's KV cache to the memory it can have."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from huggingfaceserver.protocols.kserve_model import BackendModel
from tests.backends.vllm import VLLM_FLAGS, vllm_env
from tests.harness import (
    ServerProcess,
    client_for,
    leave_stream_after,
    load_model,
    run_server,
    status,
    wait_until,
)
from tests.openai_checks import check_streamed_chat_adds_up
from tests.prometheus import scrape

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = ["Hello world", "The capital of France is", "A man is eating"]
MESSAGES = [{"role": "user", "content": "Hello world"}]
BRIEF = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paris?"}]
CANCELLED = re.compile(r"generation cancelled \(client gone\) after (\d+) tokens")
GENERATED = re.compile(r"^vllm:generation_tokens_total\{[^}]*\} (\S+)$", re.M)


@pytest.fixture(scope="module")
def llama_path(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama64"]


@dataclass(frozen=True)
class Probe:
    """Statuses seen at one moment of the start: liveness, readiness, the V1 model card."""

    live: int | None
    ready: int | None
    card: int | None


def watch_startup(server: ServerProcess, timeout: float = 180.0) -> list[Probe]:
    """Probe the health routes until the model is ready; every probe, in order."""
    probes: list[Probe] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"server exited with {server.process.returncode}:\n{server.log()}")
        probe = Probe(
            status(server.url + "/v2/health/live"),
            status(server.url + "/v2/health/ready"),
            status(server.url + "/v1/models/llm"),
        )
        probes.append(probe)
        if probe.ready == probe.card == 200:
            return probes
        time.sleep(0.1)
    raise TimeoutError(f"not ready after {timeout}s:\n{server.log()}")


@pytest.fixture(scope="module")
def started(llama_path: Path, tmp_path_factory) -> Iterator[tuple[ServerProcess, list[Probe]]]:
    """The server (auto backend: vLLM, its KV cache sized by the server) and what its health
    routes said while it started."""
    root = tmp_path_factory.mktemp("vllm-server")
    args = ["--model_dir", str(llama_path), "--model_name", "llm", *VLLM_FLAGS]
    with contextlib.ExitStack() as stack:
        with pytest.MonkeyPatch.context() as unset:
            unset.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # read as the server starts
            server = stack.enter_context(run_server(args, root, ready=False, env=vllm_env(root)))
        yield server, watch_startup(server)


@pytest.fixture(scope="module")
def server(started) -> ServerProcess:
    return started[0]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/openai/v1", api_key="x", timeout=60)


@pytest.fixture(scope="module")
def reference(llama_path: Path) -> BackendModel:
    """The same model on the transformers backend, in-process: the oracle."""
    return load_model(
        ["--model_dir", str(llama_path), "--model_name", "llm", "--backend", "huggingface"]
    )


def post(server: ServerProcess, route: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{server.url}/openai/v1/{route}", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


async def post_reference(model: BackendModel, route: str, body: dict[str, Any]) -> dict[str, Any]:
    async with client_for(model) as client:
        response = await client.post(f"/openai/v1/{route}", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def sse_events(server: ServerProcess, route: str, body: dict[str, Any]) -> list[str]:
    """The ``data:`` payloads of a streamed response, ``[DONE]`` included."""
    with httpx.stream("POST", f"{server.url}/openai/v1/{route}", json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = list(response.iter_lines())
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


# --- startup --------------------------------------------------------------------------------


def test_the_auto_backend_is_vllm(server):
    assert "backend vllm: vLLM supports LlamaForCausalLM" in server.log()


def test_the_kv_cache_is_sized_to_the_memory_the_server_can_have(server):
    # 8 sequences (--max-num-seqs) of one 128-token block at 1 KiB a token (2 layers, keys and
    # values of 2 heads of 32, float32): the most this engine can use, on any machine
    line = "backend vllm: vLLM supports LlamaForCausalLM; KV cache 1 MiB, room for 8 of 8 "
    assert line + "sequences at the full 128 tokens (" in server.log()
    engine_config = {"kv_cache_memory_bytes": str(8 * 128 * 1024)}  # what vLLM was given
    assert scrape(server.url).has("vllm:cache_config_info", **engine_config)


def test_readiness_waits_for_the_engine(started):
    _, probes = started
    answered = [p for p in probes if p.live is not None]
    assert answered, "the server never answered while the engine started"
    assert all(p.live == 200 for p in answered)
    loading = [p for p in answered if p.ready == 503 and p.card == 503]
    assert loading, f"never seen loading: {probes}"
    first_ready = next(i for i, p in enumerate(probes) if p.ready == 200)
    assert probes.index(loading[0]) < first_ready
    assert all(p.ready == 200 for p in probes[first_ready:])
    assert probes[-1] == Probe(200, 200, 200)


# --- the transformers backend as the oracle -------------------------------------------------


async def test_greedy_completions_equal_the_transformers_backends(server, reference):
    body = {"model": "llm", "prompt": PROMPTS, "max_tokens": 12, "temperature": 0}
    got = post(server, "completions", body)
    expected = await post_reference(reference, "completions", body)
    assert [c["index"] for c in got["choices"]] == [0, 1, 2]
    assert [c["text"] for c in got["choices"]] == [c["text"] for c in expected["choices"]]
    assert [c["finish_reason"] for c in got["choices"]] == [
        c["finish_reason"] for c in expected["choices"]
    ]
    assert got["usage"] == expected["usage"]


async def test_greedy_chat_equals_the_transformers_backends(server, reference):
    body = {"model": "llm", "messages": BRIEF, "max_tokens": 12, "temperature": 0}
    got = post(server, "chat/completions", body)
    expected = await post_reference(reference, "chat/completions", body)
    assert got["choices"][0]["message"] == expected["choices"][0]["message"]
    assert got["choices"][0]["finish_reason"] == expected["choices"][0]["finish_reason"]
    assert got["usage"] == expected["usage"]


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("tokenize", {"prompt": "Hello world", "return_token_strs": True}),
        ("tokenize", {"messages": BRIEF}),
        ("detokenize", {"tokens": [1, 20, 30, 40, 50]}),
    ],
)
async def test_tokenize_and_detokenize_equal_the_transformers_backends(
    server, reference, route, body
):
    got = post(server, route, {"model": "llm", **body})
    assert got == await post_reference(reference, route, {"model": "llm", **body})


async def test_a_text_ending_in_an_incomplete_character_equals_the_transformers_backends(
    server, reference
):
    # Greedy "Hello world" chat on this model ends, at max_tokens, with bytes of an unfinished
    # UTF-8 character: the same tokens on both backends (see the logprobs test).
    body = {"model": "llm", "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    got = post(server, "chat/completions", body)
    expected = await post_reference(reference, "chat/completions", body)
    assert expected["choices"][0]["message"]["content"].endswith("\ufffd")
    assert got["usage"] == expected["usage"]
    assert got["choices"][0]["message"] == expected["choices"][0]["message"]


async def test_completion_logprobs_equal_the_transformers_backends(server, reference):
    body = {"model": "llm", "prompt": PROMPTS, "max_tokens": 12, "temperature": 0, "logprobs": 2}
    got = post(server, "completions", body)
    expected = await post_reference(reference, "completions", body)
    for choice, oracle in zip(got["choices"], expected["choices"], strict=True):
        ours, theirs = choice["logprobs"], oracle["logprobs"]
        assert ours["tokens"] == theirs["tokens"]
        assert ours["text_offset"] == theirs["text_offset"]
        assert ours["token_logprobs"] == pytest.approx(theirs["token_logprobs"], abs=1e-3)
        for top, top_oracle in zip(ours["top_logprobs"], theirs["top_logprobs"], strict=True):
            assert top.keys() == top_oracle.keys()
            assert top == pytest.approx(top_oracle, abs=1e-3)


def same_prompt_logprobs(ours: list, theirs: list) -> None:
    assert len(ours) == len(theirs) and ours[0] is theirs[0] is None
    for position, oracle in zip(ours[1:], theirs[1:], strict=True):
        assert position.keys() == oracle.keys()
        for token_id, entry in position.items():
            assert entry["rank"] == oracle[token_id]["rank"]
            assert entry["decoded_token"] == oracle[token_id]["decoded_token"]
            assert entry["logprob"] == pytest.approx(oracle[token_id]["logprob"], abs=1e-3)


async def test_prompt_logprobs_and_echo_equal_the_transformers_backends(server, reference):
    body = {"model": "llm", "prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0}
    scored = {**body, "prompt_logprobs": 2}
    got = post(server, "completions", scored)["choices"][0]
    expected = (await post_reference(reference, "completions", scored))["choices"][0]
    same_prompt_logprobs(got["prompt_logprobs"], expected["prompt_logprobs"])
    chat = {"model": "llm", "messages": BRIEF, "max_tokens": 2, "prompt_logprobs": 1}
    got_chat = post(server, "chat/completions", chat)
    expected_chat = await post_reference(reference, "chat/completions", chat)
    same_prompt_logprobs(got_chat["prompt_logprobs"], expected_chat["prompt_logprobs"])
    echoed = {**body, "echo": True, "logprobs": 1}
    ours = post(server, "completions", echoed)["choices"][0]
    theirs = (await post_reference(reference, "completions", echoed))["choices"][0]
    assert ours["text"] == theirs["text"]
    assert ours["logprobs"]["tokens"] == theirs["logprobs"]["tokens"]
    assert ours["logprobs"]["token_logprobs"][0] is None
    assert ours["logprobs"]["token_logprobs"][1:] == pytest.approx(
        theirs["logprobs"]["token_logprobs"][1:], abs=1e-3
    )


ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "ok": {"type": "boolean"}},
    "required": ["answer", "ok"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("structured", "valid"),
    [
        (
            {"guided_json": ANSWER_SCHEMA},
            lambda t: jsonschema.validate(json.loads(t), ANSWER_SCHEMA),
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": ANSWER_SCHEMA}}},
            lambda t: jsonschema.validate(json.loads(t), ANSWER_SCHEMA),
        ),
        ({"guided_regex": "[0-9]{3}"}, lambda t: re.fullmatch("[0-9]{3}", t).group()),
        ({"guided_choice": ["alpha", "beta"]}, lambda t: ["alpha", "beta"].index(t)),
    ],
)
def test_structured_output_holds_on_vllm(server, structured, valid):
    body = {"model": "llm", "messages": MESSAGES, "max_tokens": 48, "n": 2, "seed": 1}
    for choice in post(server, "chat/completions", {**body, **structured})["choices"]:
        valid(choice["message"]["content"])


def test_tool_choice_required_and_named_hold_on_vllm(client):
    tools = [{"type": "function", "function": {"name": "answer", "parameters": ANSWER_SCHEMA}}]
    named = {"type": "function", "function": {"name": "answer"}}
    for choice in ("required", named):
        response = client.chat.completions.create(
            model="llm", messages=MESSAGES, tools=tools, tool_choice=choice, max_tokens=64,
            parallel_tool_calls=False, seed=1,
        )  # fmt: skip
        (answer,) = response.choices
        assert answer.finish_reason == "tool_calls"
        (call,) = answer.message.tool_calls
        assert call.function.name == "answer"
        jsonschema.validate(json.loads(call.function.arguments), ANSWER_SCHEMA)


def test_an_invalid_regex_is_a_400_on_vllm(server):
    response = httpx.post(
        f"{server.url}/openai/v1/completions",
        json={"model": "llm", "prompt": "x", "guided_regex": "[0-9"},
        timeout=60,
    )
    assert response.status_code == 400, response.text


async def test_chat_logprobs_equal_the_transformers_backends(server, reference):
    body = {
        "model": "llm",
        "messages": MESSAGES,
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    got = post(server, "chat/completions", body)["choices"][0]["logprobs"]["content"]
    expected = (await post_reference(reference, "chat/completions", body))["choices"][0]
    expected = expected["logprobs"]["content"]
    assert [t["bytes"] for t in got] == [t["bytes"] for t in expected]
    assert [t["logprob"] for t in got] == pytest.approx([t["logprob"] for t in expected], abs=1e-3)
    for ours, theirs in zip(got, expected, strict=True):
        assert [t["bytes"] for t in ours["top_logprobs"]] == [
            t["bytes"] for t in theirs["top_logprobs"]
        ]
        assert [t["logprob"] for t in ours["top_logprobs"]] == pytest.approx(
            [t["logprob"] for t in theirs["top_logprobs"]], abs=1e-3
        )


# --- streaming ------------------------------------------------------------------------------


def test_streamed_completions_add_up_to_the_whole_answer(server):
    body = {"model": "llm", "prompt": PROMPTS[:2], "max_tokens": 16, "temperature": 0}
    whole = post(server, "completions", body)
    events = sse_events(
        server, "completions", {**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    *deltas, usage = chunks
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    for choice in whole["choices"]:
        mine = [c["choices"][0] for c in deltas if c["choices"][0]["index"] == choice["index"]]
        assert "".join(d["text"] for d in mine) == choice["text"]
        assert [d["finish_reason"] for d in mine[:-1]] == [None] * (len(mine) - 1)
        assert mine[-1]["finish_reason"] == choice["finish_reason"]
    assert all(c["object"] == "text_completion" and c["model"] == "llm" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1


def test_streamed_chat_adds_up_to_the_whole_answer(client):
    check_streamed_chat_adds_up(client, "llm", MESSAGES)


# --- the Responses API ----------------------------------------------------------------------


async def test_greedy_responses_equal_the_transformers_backends(server, reference):
    body = {"model": "llm", "instructions": "Be brief.", "input": "Paris?", "temperature": 0}
    body["max_output_tokens"] = 12
    got = post(server, "responses", body)
    expected = await post_reference(reference, "responses", body)
    assert got["output"][0]["content"] == expected["output"][0]["content"]
    assert (got["status"], got["usage"]) == (expected["status"], expected["usage"])


def test_streamed_responses_add_up_on_vllm(client):
    body = {"model": "llm", "input": "Hello world", "max_output_tokens": 12, "temperature": 0}
    whole = client.responses.create(**body)
    events = list(client.responses.create(stream=True, **body))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == f"response.{whole.status}"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text


def test_a_named_function_tool_is_a_function_call_on_vllm(client):
    tool = {"type": "function", "name": "answer", "parameters": ANSWER_SCHEMA}
    response = client.responses.create(
        model="llm", input="Hello world", tools=[tool], max_output_tokens=64,
        tool_choice={"type": "function", "name": "answer"},
    )  # fmt: skip
    (call,) = response.output
    assert call.type == "function_call" and call.name == "answer"
    jsonschema.validate(json.loads(call.arguments), ANSWER_SCHEMA)


# --- n, seeds -------------------------------------------------------------------------------


def test_greedy_n_gives_identical_choices(client):
    response = client.completions.create(
        model="llm", prompt=PROMPTS[0], max_tokens=10, temperature=0, n=3
    )
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert len({c.text for c in response.choices}) == 1
    assert response.usage is not None and response.usage.completion_tokens == 30


def test_seeded_sampling_is_reproducible(client):
    def sample() -> list[str]:
        response = client.completions.create(
            model="llm", prompt=PROMPTS[0], max_tokens=10, temperature=1.0, n=2, seed=1234
        )
        assert [c.index for c in response.choices] == [0, 1]
        return [c.text for c in response.choices]

    assert sample() == sample()


# --- stop, length, usage --------------------------------------------------------------------


def stop_string_in(text: str) -> tuple[str, int]:
    """A two-letter stop string from inside ``text`` and where it first occurs."""
    for start in range(1, len(text) - 1):
        candidate = text[start : start + 2]
        if candidate.isascii() and candidate.isalnum() and text.find(candidate) == start:
            return candidate, start
    raise AssertionError(f"no usable stop string in {text!r}")


def test_a_stop_string_cuts_the_text(client):
    request = {"model": "llm", "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0}
    whole = client.completions.create(**request)
    stop, at = stop_string_in(whole.choices[0].text)
    cut = client.completions.create(**request, stop=[stop])
    assert cut.choices[0].text == whole.choices[0].text[:at]
    assert cut.choices[0].finish_reason == "stop"
    assert cut.usage is not None and cut.usage.completion_tokens < 12


def test_max_tokens_is_length_and_usage_counts_tokens(client, reference):
    response = client.completions.create(
        model="llm", prompt=PROMPTS[1], max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    assert response.choices[0].finish_reason == "length"
    prompt_tokens = len(reference.backend.tokenizer(PROMPTS[1])["input_ids"])
    assert response.usage is not None
    assert response.usage.prompt_tokens == prompt_tokens
    assert response.usage.completion_tokens == 7
    assert response.usage.total_tokens == prompt_tokens + 7


# --- errors in the OpenAI shape -------------------------------------------------------------


def error_of(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert {"message", "type", "param", "code"} <= error.keys()
    return error


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_prompt_plus_max_tokens_over_the_context_is_400(server, route):
    body: dict[str, Any] = {"model": "llm", "max_tokens": 125}
    body.update({"prompt": PROMPTS[0]} if route == "completions" else {"messages": MESSAGES})
    error = error_of(httpx.post(f"{server.url}/openai/v1/{route}", json=body, timeout=30))
    assert error["message"].startswith("This model's maximum context length is 128 tokens.")
    assert "in the completion" in error["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_logit_bias_outside_the_vocabulary_is_400(server, stream):
    body = {
        "model": "llm",
        "prompt": PROMPTS[0],
        "max_tokens": 4,
        "logit_bias": {"100000": 5},
        "stream": stream,
    }
    error = error_of(httpx.post(f"{server.url}/openai/v1/completions", json=body, timeout=30))
    assert "100000" in error["message"]


# --- a client that leaves -------------------------------------------------------------------


def generated_tokens(server: ServerProcess) -> float:
    """vLLM's count of generated tokens, from the server's /metrics."""
    match = GENERATED.search(httpx.get(f"{server.url}/metrics", timeout=5).text)
    assert match, "vllm:generation_tokens_total is not on /metrics"
    return float(match.group(1))


def test_a_client_that_leaves_a_stream_aborts_the_engine_request(server, client):
    since = len(server.log())
    before = generated_tokens(server)
    body = {"model": "llm", "prompt": "Hi", "max_tokens": 100, "ignore_eos": True, "stream": True}
    received = leave_stream_after(f"{server.url}/openai/v1/completions", body)
    assert all(chunk["choices"][0]["finish_reason"] is None for chunk in received)

    def cancelled() -> re.Match[str] | None:
        return CANCELLED.search(server.log()[since:])

    assert wait_until(lambda: cancelled() is not None, timeout=15), server.log()[since:]
    assert int(cancelled().group(1)) < 100  # type: ignore[union-attr]

    # The engine stops too: its token count settles well short of the 100 asked for.
    counts = [generated_tokens(server)]

    def settled() -> bool:
        counts.append(generated_tokens(server))
        return counts[-1] == counts[-2]

    assert wait_until(settled, timeout=10, interval=0.3), counts
    assert counts[-1] - before < 100
    started = time.monotonic()
    response = client.completions.create(model="llm", prompt="Hi", max_tokens=4)
    assert response.choices[0].text is not None
    assert time.monotonic() - started < 10
    assert status(f"{server.url}/v2/health/ready") == 200


def engine_requests(server: ServerProcess) -> tuple[float, float]:
    """vLLM's running and waiting request counts, from the server's /metrics."""
    metrics = scrape(server.url)
    assert metrics.has("vllm:num_requests_running") and metrics.has("vllm:num_requests_waiting")
    return metrics.value("vllm:num_requests_running"), metrics.value("vllm:num_requests_waiting")


def post_and_leave(server: ServerProcess, route: str, body: dict[str, Any]) -> None:
    """POST without reading the answer; hang up once the engine runs the request."""
    payload = json.dumps(body).encode()
    head = (
        f"POST /openai/v1/{route} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as sock:
        sock.sendall(head.encode() + payload)
        assert wait_until(lambda: engine_requests(server)[0] > 0, timeout=30, interval=0.05)


def test_a_client_that_leaves_before_the_answer_aborts_the_engine_request(server, client):
    since = len(server.log())
    before = generated_tokens(server)
    # 64 choices of 120 tokens, 8 at a time (--max-num-seqs 8): seconds of work
    body = {"prompt": "Hi", "max_tokens": 120, "n": 64, "temperature": 1.0, "ignore_eos": True}
    post_and_leave(server, "completions", {"model": "llm", **body})
    server.wait_for_log(CANCELLED, since, timeout=15)

    # The engine drops it, queued choices included, well short of the 7,680 tokens asked for.
    assert wait_until(lambda: engine_requests(server) == (0, 0), timeout=10), engine_requests(
        server
    )
    assert generated_tokens(server) - before < 64 * 120 / 2
    response = client.completions.create(model="llm", prompt="Hi", max_tokens=4)
    assert response.usage is not None and response.usage.completion_tokens == 4


# --- metrics ----------------------------------------------------------------------------------


def test_vllms_own_metrics_are_served_once(server, client):
    """vLLM's stat logger registers the ``vllm:`` names (this server registers its own under
    them only when transformers generates), next to KServe's figures."""
    labels = {"model_name": "llm", "engine": "0"}
    before = scrape(server.url)
    body = {"ignore_eos": True}
    response = client.completions.create(model="llm", prompt="Hi", max_tokens=4, extra_body=body)
    assert response.usage is not None and response.usage.completion_tokens == 4

    def moved(name: str, **more: str) -> float:
        after = scrape(server.url)
        return after.value(name, **labels, **more) - before.value(name, **labels, **more)

    # vLLM records a step's figures right after it hands its outputs on: poll
    assert wait_until(lambda: moved("vllm:generation_tokens_total") == 4, timeout=10)
    assert moved("vllm:request_success_total", finished_reason="length") == 1
    assert moved("vllm:time_to_first_token_seconds_count") == 1
    after = scrape(server.url)
    for family in ("vllm:num_requests_waiting", "vllm:e2e_request_latency_seconds"):
        assert after.type_lines(family) == 1, family
    assert after.has("vllm:num_requests_waiting", **labels)
    assert after.type_lines("request_predict_seconds") == 1  # KServe's
