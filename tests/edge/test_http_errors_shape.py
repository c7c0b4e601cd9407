"""An exception with no status of its own, raised while serving: a 500 in the route's own error
shape (OpenAI's on the OpenAI routes, KServe's ``{"error": ...}`` on V1/V2, ``INTERNAL`` over
gRPC) that names the request id and nothing of the exception, whose text and traceback go to
the server log under that id; a stream already under way ends with an error event and
``[DONE]``; the server goes on serving.

The failure is real: tiny models whose own code (``--trust_remote_code``, an ``auto_map`` in
``config.json`` naming a ``modeling_*.py`` in the model folder) raises from their forward pass
when the input holds one token, as a broken custom model would.

What happened before: KServe's handler answered ``{"error": "RuntimeError : secret internal
detail"}`` on every route (the OpenAI ones included, on a non-streamed completion), without the
``x-request-id`` header, and the traceback was logged twice (KServe's handler, then uvicorn's
"Exception in ASGI application").
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from transformers import AutoTokenizer

from huggingfaceserver.edge.http_errors import install_error_handlers
from tests.harness import REPO, ServerProcess, run_server
from tiny_models import build_encoder_architecture, build_llama

slow = pytest.mark.slow  # the tests that start servers

SECRET = "secret internal detail"
GRPC_CLIENT = REPO / "tests" / "grpc_client.py"
FAILING_MODEL = '''
import transformers


class Failing{base}(transformers.{base}):
    """{base}, whose forward pass fails on the token ``config.failing_token_id``."""

    def forward(self, input_ids=None, **kwargs):
        if input_ids is not None and bool((input_ids == self.config.failing_token_id).any()):
            raise RuntimeError("{secret}")
        return super().forward(input_ids=input_ids, **kwargs)
'''


def make_failing(folder: Path, base: str, auto_class: str, trigger: str) -> str:
    """Turn the saved ``base`` model in ``folder`` into one with custom code that fails on the
    last token of ``trigger``; returns a text that holds that token."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    token_id = tokenizer(trigger, add_special_tokens=False)["input_ids"][-1]
    assert token_id not in tokenizer("Hello world")["input_ids"]  # the warm-up passes
    (folder / "modeling_failing.py").write_text(FAILING_MODEL.format(base=base, secret=SECRET))
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = [f"Failing{base}"]
    config["auto_map"] = {auto_class: f"modeling_failing.Failing{base}"}
    config["failing_token_id"] = token_id
    (folder / "config.json").write_text(json.dumps(config))
    return trigger


def serve(
    folder: Path, log_dir: Path, env: dict[str, str], api_workers: str = "1"
) -> Iterator[ServerProcess]:
    args = ["--model_dir", str(folder), "--model_name", "m", "--backend", "huggingface"]
    args += ["--trust_remote_code", "--api_workers", api_workers]
    env = {"HF_MODULES_CACHE": str(log_dir / "modules"), **env}
    with run_server(args, log_dir, env=env) as server:
        yield server


@pytest.fixture(scope="module")
def encoder_server(tmp_path_factory) -> Iterator[ServerProcess]:
    """A one-label classifier (V1/V2 and OpenAI rerank), the OpenAI routes without a prefix:
    ``/v1/rerank`` is OpenAI's, ``/v1/models/m:predict`` KServe's."""
    folder = tmp_path_factory.mktemp("failing-classifier")
    build_encoder_architecture(folder, "bert", "sequence_classification", cross_encoder=True)
    make_failing(
        folder, "BertForSequenceClassification", "AutoModelForSequenceClassification", "fox"
    )
    yield from serve(folder, folder, {"KSERVE_OPENAI_ROUTE_PREFIX": ""})


@pytest.fixture(scope="module")
def generation_server(tmp_path_factory) -> Iterator[ServerProcess]:
    """A tiny Llama, the OpenAI routes under the default ``/openai`` prefix."""
    folder = tmp_path_factory.mktemp("failing-llama")
    build_llama(folder)
    make_failing(folder, "LlamaForCausalLM", "AutoModelForCausalLM", " fox")
    yield from serve(folder, folder, {})


def check_logged(server: ServerProcess, request_id: str, since: int) -> None:
    """The exception is in the log, under the request id, with its traceback; once."""
    failed = server.wait_for_log(rf"request {re.escape(request_id)} failed: RuntimeError: ", since)
    rest = server.log()[failed.start() :]
    assert SECRET in rest and "Traceback (most recent call last)" in rest
    assert "Exception in ASGI application" not in server.log()  # not logged a second time


def check_kserve_500(response: httpx.Response, request_id: str) -> None:
    assert response.status_code == 500, response.text
    assert SECRET not in response.text and "RuntimeError" not in response.text
    body = response.json()
    assert list(body) == ["error"] and isinstance(body["error"], str)
    assert request_id in body["error"]
    assert response.headers["x-request-id"] == request_id


def check_openai_500(response: httpx.Response, request_id: str) -> None:
    assert response.status_code == 500, response.text
    assert SECRET not in response.text and "RuntimeError" not in response.text
    error = response.json()["error"]
    assert error["type"] == "server_error" and set(error) == {"message", "type", "param", "code"}
    assert request_id in error["message"]
    assert response.headers["x-request-id"] == request_id


V2_BODY = {"inputs": [{"name": "input-0", "datatype": "BYTES", "shape": [1], "data": ["a fox"]}]}


@slow
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/models/m:predict", {"instances": ["the quick brown fox"]}),
        ("/v2/models/m/infer", V2_BODY),
    ],
    ids=["v1", "v2"],
)
def test_kserve_routes_answer_a_generic_500_in_their_shape(encoder_server, path, body):
    since = len(encoder_server.log())
    request_id = f"failing-{path.split('/')[1]}"
    response = httpx.post(
        encoder_server.url + path, json=body, headers={"x-request-id": request_id}, timeout=60
    )
    check_kserve_500(response, request_id)
    check_logged(encoder_server, request_id, since)
    encoder_server.wait_for_log(rf'request {request_id} "POST {re.escape(path)}" 500 ', since)
    normal = httpx.post(
        encoder_server.url + "/v1/models/m:predict", json={"instances": ["a dog"]}, timeout=60
    )
    assert normal.status_code == 200, normal.text
    [score] = normal.json()["predictions"]  # a one-label model's (a cross-encoder's) score
    assert 0 < score < 1


@slow
def test_the_id_named_is_the_one_sent_back_when_the_client_sent_none(encoder_server):
    since = len(encoder_server.log())
    response = httpx.post(
        encoder_server.url + "/v1/models/m:predict", json={"instances": ["fox"]}, timeout=60
    )
    request_id = response.headers["x-request-id"]
    check_kserve_500(response, request_id)
    check_logged(encoder_server, request_id, since)


@slow
def test_unprefixed_openai_route_answers_in_openai_shape(encoder_server):
    since = len(encoder_server.log())
    body = {"model": "m", "query": "which animal?", "documents": ["a dog", "the fox"]}
    response = httpx.post(
        encoder_server.url + "/v1/rerank", json=body, headers={"x-request-id": "rr-1"}, timeout=60
    )
    check_openai_500(response, "rr-1")
    check_logged(encoder_server, "rr-1", since)
    body["documents"] = ["a dog", "a cat"]
    assert httpx.post(encoder_server.url + "/v1/rerank", json=body, timeout=60).status_code == 200


@slow
def test_grpc_answers_internal_without_the_exception_text(encoder_server):
    def infer(text: str) -> dict:
        done = subprocess.run(
            [sys.executable, str(GRPC_CLIENT), f"127.0.0.1:{encoder_server.grpc_port}", "m"]
            + ["status", text],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])

    since = len(encoder_server.log())
    failed = infer("the fox")
    assert failed["status"] == "StatusCode.INTERNAL" and SECRET not in failed["message"]
    encoder_server.wait_for_log(r"grpc \S+ ModelInfer INTERNAL ", since)
    assert SECRET in encoder_server.log()[since:]
    assert infer("a dog")["status"] == "OK"


@slow
def test_completion_answers_a_generic_500_in_openai_shape(generation_server):
    since = len(generation_server.log())
    url = generation_server.url + "/openai/v1/completions"
    body = {"model": "m", "prompt": "the quick brown fox", "max_tokens": 1}
    response = httpx.post(url, json=body, headers={"x-request-id": "cmpl-fail"}, timeout=60)
    check_openai_500(response, "cmpl-fail")
    check_logged(generation_server, "cmpl-fail", since)
    body["prompt"] = "Hello"
    normal = httpx.post(url, json=body, timeout=60)
    assert normal.status_code == 200 and normal.json()["usage"]["completion_tokens"] == 1


@slow
@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_a_stream_under_way_ends_with_an_error_event_then_done(generation_server, route):
    since = len(generation_server.log())
    request_id = f"stream-{route.replace('/', '-')}"
    body: dict = {"model": "m", "max_tokens": 1, "stream": True}
    if route == "completions":
        body["prompt"] = "the quick brown fox"
    else:
        body["messages"] = [{"role": "user", "content": "the quick brown fox"}]
    url = f"{generation_server.url}/openai/v1/{route}"
    with httpx.stream(
        "POST", url, json=body, headers={"x-request-id": request_id}, timeout=60
    ) as response:
        assert response.status_code == 200  # the stream had started
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["type"] == "server_error" and request_id in error["message"]
    assert all(SECRET not in event for event in events)
    check_logged(generation_server, request_id, since)


# --- in-process: the handlers alone, on a bare app ------------------------------------------


class Boom(Exception):
    pass


def failing_app() -> FastAPI:
    app = FastAPI()
    # the server installs them twice (before and after KServe's)
    install_error_handlers(app, "/openai")
    install_error_handlers(app, "/openai")

    @app.post("/v2/models/m/infer")
    async def kserve_route() -> None:
        raise Boom(SECRET)

    @app.post("/openai/v1/embeddings")
    async def openai_route() -> None:
        raise Boom(SECRET)

    @app.post("/openai/v1/completions")
    async def stream() -> StreamingResponse:
        async def events() -> AsyncIterator[str]:
            yield "data: {}\n\n"
            raise Boom(SECRET)

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


async def post(path: str) -> httpx.Response:
    transport = httpx.ASGITransport(app=failing_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        return await client.post(path, headers={"x-request-id": "in-process"})


def logged_once(caplog: pytest.LogCaptureFixture) -> None:
    (record,) = [r for r in caplog.records if r.getMessage().startswith("request in-process")]
    assert record.exc_info is not None and record.exc_info[0] is Boom
    assert getattr(record, "request_id", None) == "in-process"


@pytest.mark.parametrize("path", ["/v2/models/m/infer", "/openai/v1/embeddings"])
async def test_handlers_alone_answer_in_the_route_shape(path, caplog):
    response = await post(path)
    assert response.status_code == 500 and SECRET not in response.text
    error = response.json()["error"]
    message = error["message"] if path.startswith("/openai") else error
    assert "in-process" in message
    logged_once(caplog)


async def test_a_stream_that_raises_ends_with_an_error_event_then_done(caplog):
    response = await post("/openai/v1/completions")
    assert response.status_code == 200  # the stream had started
    events = [line for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[0] == "data: {}" and events[-1] == "data: [DONE]"
    error = json.loads(events[1].removeprefix("data: "))["error"]
    assert error["type"] == "server_error" and "in-process" in error["message"]
    assert SECRET not in response.text
    logged_once(caplog)


async def test_an_exception_raised_by_a_middleware_is_answered_with_its_id(caplog):
    """Outside the routes (a middleware added around the app, as the gateway is), KServe's
    handler answered the exception's text: ours answers the same 500, with its id header."""
    app = failing_app()

    class Failing:
        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            raise Boom(SECRET)

    app.add_middleware(Failing)
    # Starlette re-raises after answering (for the server's log): keep it out of the client
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        response = await client.post("/openai/v1/embeddings", headers={"x-request-id": "outer"})
    assert response.status_code == 500 and SECRET not in response.text
    assert response.headers["x-request-id"] == "outer"
    assert "outer" in response.json()["error"]["message"]
    assert any(r.getMessage().startswith("request outer failed: Boom: ") for r in caplog.records)


@pytest.fixture(scope="module")
def two_front_server(tmp_path_factory) -> Iterator[ServerProcess]:
    """The failing classifier with its model in an engine process behind two fronts."""
    folder = tmp_path_factory.mktemp("failing-classifier-fronts")
    build_encoder_architecture(folder, "bert", "sequence_classification", cross_encoder=True)
    make_failing(
        folder, "BertForSequenceClassification", "AutoModelForSequenceClassification", "fox"
    )
    yield from serve(folder, folder, {}, api_workers="2")


@slow
def test_behind_fronts_the_engine_keeps_the_details_in_its_log(two_front_server):
    """The exception is raised in the engine process: the front answers a generic 500 and the
    engine logs the exception with its traceback."""
    since = len(two_front_server.log())
    response = httpx.post(
        two_front_server.url + "/v1/models/m:predict",
        json={"instances": ["the quick brown fox"]},
        headers={"x-request-id": "fronts-1"},
        timeout=60,
    )
    check_kserve_500(response, "fronts-1")
    logged = two_front_server.wait_for_log(r"engine: request \d+ failed: RuntimeError: ", since)
    rest = two_front_server.log()[logged.start() :]
    assert SECRET in rest and "Traceback (most recent call last)" in rest
    normal = httpx.post(
        two_front_server.url + "/v1/models/m:predict", json={"instances": ["a dog"]}, timeout=60
    )
    assert normal.status_code == 200, normal.text
    [score] = normal.json()["predictions"]  # a one-label model's (a cross-encoder's) score
    assert 0 < score < 1
