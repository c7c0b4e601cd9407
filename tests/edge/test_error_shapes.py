"""One decision of the error shape, by route (``edge.http_errors.ErrorShapes``): for each route
family (KServe's, OpenAI's, TEI's), every error path answers in that family's shape: a refusal
from the gateway, an error a handler raises (with its headers), a body that does not validate,
an unexpected exception, an exception and a deadline in a stream under way, and the chat and
completion streams' own error event. And ``errors.py`` imports no framework."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from huggingfaceserver.edge.admission import Admission
from huggingfaceserver.edge.gateway import Gateway, GatewayPolicy, ServerState
from huggingfaceserver.edge.http_errors import (
    KSERVE,
    OPENAI,
    TEI,
    ErrorShapes,
    install_error_handlers,
)
from huggingfaceserver.errors import (
    EngineDied,
    NotFound,
    ServerError,
    TooManyRequests,
    internal_error_message,
)
from huggingfaceserver.generation.params import ChoiceDelta, SamplingParams
from huggingfaceserver.protocols.error_routes import OwnBodyRoute
from huggingfaceserver.protocols.openai.serving_completions import completion_events
from huggingfaceserver.protocols.openai.serving_generation import GenerationRun, Job
from tests.harness import REPO

KEY = "sesame"
AUTH = {"authorization": f"Bearer {KEY}"}
DEADLINE_S = 0.5


def test_errors_imports_no_framework():
    """The bottom of the package: exceptions and their statuses, nothing of a framework."""
    code = (
        "import sys, huggingfaceserver.errors; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'fastapi', 'pydantic', 'starlette', 'kserve', 'grpc'}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]", result.stdout


@pytest.mark.parametrize(
    ("prefix", "method", "path", "shape"),
    [
        ("/openai", "POST", "/openai/v1/chat/completions", OPENAI),
        ("/openai", "GET", "/openai/v1/models/m", OPENAI),
        ("/openai", "POST", "/v1/models/m:predict", KSERVE),
        ("/openai", "POST", "/v2/models/m/infer", KSERVE),
        ("", "POST", "/v1/embeddings", OPENAI),
        ("", "GET", "/v1/models/m", KSERVE),  # the merged model routes stay KServe's
        ("", "POST", "/v1/models/m:predict", KSERVE),
        ("/openai", "POST", "/embed", TEI),
        ("/openai", "GET", "/info", TEI),
        ("/openai", "POST", "/", TEI),  # TEI's POST /
        ("/openai", "GET", "/", KSERVE),  # KServe's liveness
        ("/openai", "GET", "/nowhere", KSERVE),
    ],
)
def test_the_shape_is_chosen_by_route(prefix, method, path, shape):
    assert ErrorShapes(prefix).shape_for(path, method) is shape


# --- every error path, on one app of each family's routes behind the gateway ------------------


class Item(BaseModel):
    text: str


class Boom(Exception):
    pass


async def events_then(failure: str) -> AsyncIterator[str]:
    yield "data: {}\n\n"
    if failure == "stream":
        raise Boom("secret")
    await asyncio.sleep(DEADLINE_S * 10)  # past the gateway's deadline


async def fail(request: Request) -> Response:
    """Fails as the ``x-fail`` header asks."""
    failure = request.headers["x-fail"]
    if failure == "handler":
        raise TooManyRequests("busy", headers={"retry-after": "7"})
    if failure == "invalid":
        Item.model_validate_json(await request.body())
    if failure == "boom":
        raise Boom("secret")
    if failure in ("stream", "deadline"):
        return StreamingResponse(events_then(failure), media_type="text/event-stream")
    raise NotFound("no such thing")


FAMILIES = {
    "kserve": ("POST", "/v2/models/m/infer"),
    "openai": ("POST", "/openai/v1/embeddings"),
    "tei": ("POST", "/embed"),
    "tei-root": ("POST", "/"),
}


def served() -> Gateway:
    app = FastAPI()
    router = APIRouter(route_class=OwnBodyRoute)
    for method, path in FAMILIES.values():
        router.add_api_route(path, fail, methods=[method])
    app.include_router(router)
    install_error_handlers(app, "/openai")
    policy = GatewayPolicy(
        api_key=KEY, max_request_bytes=64, request_timeout_s=DEADLINE_S, openai_prefix="/openai"
    )
    return Gateway(app, policy, Admission(4), ServerState(), routes=lambda: app.router.routes)


def message_in(family: str, body: dict[str, Any]) -> str:
    """The message, after checking that ``body`` has exactly ``family``'s shape."""
    if family == "openai":
        assert list(body) == ["error"], body
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}, body
        return str(error["message"])
    if family.startswith("tei"):
        assert set(body) == {"error", "error_type"}, body
        return str(body["error"])
    assert list(body) == ["error"] and isinstance(body["error"], str), body
    return str(body["error"])


CASES = {
    # case: (request headers, body, status, a word of the message)
    "refused-no-key": ({}, b"{}", 401, "API key"),
    "refused-too-large": (AUTH, b"x" * 65, 413, "--max_request_bytes"),
    "handler-error": ({**AUTH, "x-fail": "handler"}, b"{}", 429, "busy"),
    "not-found": ({**AUTH, "x-fail": "missing"}, b"{}", 404, "no such thing"),
    "invalid-body": ({**AUTH, "x-fail": "invalid"}, b'{"text": 1}', 400, "text"),
    "unexpected": ({**AUTH, "x-fail": "boom", "x-request-id": "r-1"}, b"{}", 500, "r-1"),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("family", FAMILIES)
async def test_every_error_path_answers_in_the_routes_shape(family, case):
    headers, body, status, says = CASES[case]
    method, path = FAMILIES[family]
    transport = httpx.ASGITransport(app=served())
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        response = await http.request(method, path, content=body, headers=headers)
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    assert says in message_in(family, response.json())
    assert "secret" not in response.text
    if case == "refused-no-key":
        assert response.headers["www-authenticate"] == "Bearer"
    if case == "handler-error":  # the headers an error carries go out with it
        assert response.headers["retry-after"] == "7"


@pytest.mark.parametrize(("case", "says"), [("stream", "r-2"), ("deadline", "--request_timeout")])
@pytest.mark.parametrize("family", FAMILIES)
async def test_a_stream_under_way_ends_with_an_error_event_in_the_routes_shape(family, case, says):
    method, path = FAMILIES[family]
    headers = {**AUTH, "x-fail": case, "x-request-id": "r-2"}
    transport = httpx.ASGITransport(app=served())
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        response = await http.request(method, path, content=b"{}", headers=headers)
    assert response.status_code == 200  # the stream had started
    events = [line for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[0] == "data: {}" and events[-1] == "data: [DONE]", events
    assert says in message_in(family, json.loads(events[-2].removeprefix("data: ")))


# --- the completion and chat streams' own error event -----------------------------------------


class FailingGenerator:
    """A generation backend whose one generation sends a token, then fails with ``error``."""

    def __init__(self, error: Exception):
        self.error = error

    async def generate(self, *_: Any) -> AsyncIterator[list[ChoiceDelta]]:
        yield [ChoiceDelta(0, "a", [5])]
        raise self.error


@pytest.mark.parametrize(
    "error",
    [EngineDied("the engine process stopped"), NotFound("gone"), Boom("secret")],
    ids=["engine-died", "not-found", "unexpected"],
)
async def test_a_generation_that_fails_mid_stream_ends_with_the_routes_body(error):
    job = Job([1, 2], "hi", SamplingParams(), 0)
    backend: Any = FailingGenerator(error)
    run = GenerationRun("cmpl-1", "m", 0, backend, [job], False, False, "r-3")
    events = [event async for event in completion_events(run, echo=False)]
    assert events[-1] == "data: [DONE]\n\n"
    sent = json.loads(events[-2].removeprefix("data: "))
    shape = ErrorShapes("/openai").shape_for("/openai/v1/completions", "POST")
    if not isinstance(error, ServerError):  # told as the request id, nothing of the cause
        error = ServerError(internal_error_message("r-3"))
    assert sent == shape.content(error)  # the body the route answers the error with
    assert "secret" not in events[-2]
