"""KServe's routes behind our handlers
(:func:`~huggingfaceserver.edge.http_errors.install_error_handlers`), in process on the app the
server builds:

- a request naming a model version is a 404 that says versions are not served, answered before
  KServe's route (which would answer 501, "Model versioning not supported yet.");
- KServe's client-side exceptions (unknown model, input it cannot read, a model or server not
  ready) are answered as KServe answers them, without the error and traceback KServe's handlers
  log for each (readiness probes every few seconds while the model loads buried the log);
- any other ``NotImplementedError`` stays a logged 501.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI
from kserve.errors import InvalidInput, ModelNotFound, ModelNotReady, ServerNotReady

from huggingfaceserver.assembly import build_model
from huggingfaceserver.cli import parse_args
from huggingfaceserver.edge.http_errors import VERSIONS_NOT_SERVED, install_error_handlers
from tests.harness import build_app, client_for

NAME = "fm"
TEXT = "the capital of france is [MASK] ."
V2_BODY = {"inputs": [{"name": "input-0", "datatype": "BYTES", "shape": [1], "data": [TEXT]}]}


@pytest.fixture
async def client(encoder, tiny_models) -> AsyncIterator[httpx.AsyncClient]:
    """The app around a loaded, ready fill-mask model."""
    async with client_for(encoder(tiny_models["bert_fill_mask"], name=NAME)) as client:
        yield client


@pytest.fixture
async def loading_client(tiny_models) -> AsyncIterator[httpx.AsyncClient]:
    """The app around a model not loaded yet (as while the server loads it)."""
    argv = ["--model_dir", str(tiny_models["bert_fill_mask"]), "--model_name", "loading"]
    transport = httpx.ASGITransport(app=build_app(build_model(parse_args(argv))))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client


def logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Every warning or error logged (KServe's handlers log an error per answer)."""
    return [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", f"/v2/models/{NAME}/versions/2"),
        ("GET", f"/v2/models/{NAME}/versions/2/ready"),
        ("POST", f"/v2/models/{NAME}/versions/2/infer"),
        ("POST", "/v2/models/nope/versions/1/infer"),  # the version is refused first, as before
        # KServe's V2 routes take the version as a query parameter too (in /openapi.json)
        ("GET", f"/v2/models/{NAME}?model_version=2"),
        ("GET", f"/v2/models/{NAME}/ready?model_version=2"),
        ("POST", f"/v2/models/{NAME}/infer?model_version=2"),
        ("POST", f"/v2/models/{NAME}/infer?model%5Fversion=2"),  # as FastAPI decodes it
        ("POST", f"/v2/models/{NAME}/infer?model_version=&model_version=2"),  # the last one
    ],
)
async def test_a_model_version_is_a_404_that_says_versions_are_not_served(
    client, caplog, method, path
):
    response = await client.request(method, path, json=V2_BODY)
    assert response.status_code == 404
    assert response.json() == {"error": VERSIONS_NOT_SERVED}
    assert logged(caplog) == []


async def test_without_a_version_the_routes_serve_and_other_methods_stay_405(client):
    """An empty version is none (KServe serves it); FastAPI reads the last of several."""
    for query in ("", "?model_version=", "?model_version=2&model_version=", "?other=1"):
        served = await client.post(f"/v2/models/{NAME}/infer{query}", json=V2_BODY)
        assert served.status_code == 200, (query, served.text)
    # a route that takes no version ignores the parameter, as before
    v1 = await client.post(f"/v1/models/{NAME}:predict?model_version=2", json={"instances": [TEXT]})
    assert v1.status_code == 200, v1.text
    # a path that holds "/versions/" but names no version goes to its own route
    unknown = await client.get("/v2/models/versions/ready")
    assert unknown.status_code == 404
    assert unknown.json() == {"error": str(ModelNotFound("versions"))}
    # the route matches the path, not the method: the router's 405, as before
    wrong_method = await client.get(f"/v2/models/{NAME}/versions/2/infer")
    assert wrong_method.status_code == 405


@pytest.mark.parametrize(
    ("method", "path", "content", "status", "error"),
    [
        ("GET", "/v2/models/nope/ready", None, 404, str(ModelNotFound("nope"))),
        ("POST", "/v1/models/nope:predict", b'{"instances": []}', 404, str(ModelNotFound("nope"))),
        ("POST", f"/v1/models/{NAME}:predict", b'{"instances": [', 400, None),
    ],
)
async def test_kserve_client_faults_are_answered_as_before_without_a_log(
    client, caplog, method, path, content, status, error
):
    response = await client.request(method, path, content=content)
    assert response.status_code == status, response.text
    assert list(response.json()) == ["error"]
    if error is not None:
        assert response.json()["error"] == error
    assert logged(caplog) == []


async def test_not_ready_answers_are_503s_without_a_log(loading_client, caplog):
    server = await loading_client.get("/v2/health/ready")
    model = await loading_client.get("/v2/models/loading/ready")
    infer = await loading_client.post("/v2/models/loading/infer", json=V2_BODY)
    assert (server.status_code, server.json()) == (503, {"error": str(ServerNotReady())})
    for response in (model, infer):
        assert response.status_code == 503
        assert response.json() == {"error": str(ModelNotReady("loading"))}
    assert logged(caplog) == []


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (InvalidInput("unreadable"), 400),
        (ModelNotFound("gone"), 404),
        (ModelNotReady("m"), 503),
        (ServerNotReady("loading"), 503),
        (NotImplementedError("no such thing"), 501),
    ],
)
async def test_each_exception_answers_its_status(caplog, exc, status):
    app = FastAPI()
    install_error_handlers(app, "/openai")

    @app.get("/raise")
    async def raising() -> None:
        raise exc

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        response = await client.get("/raise")
    assert (response.status_code, response.json()) == (status, {"error": str(exc)})
    if status == 501:  # not a client fault: logged, with its traceback
        (record,) = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert record.exc_info is not None and record.exc_info[1] is exc
    else:
        assert logged(caplog) == []
