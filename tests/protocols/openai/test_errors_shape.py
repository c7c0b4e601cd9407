"""OpenAI routes answer every failure as ``{"error": {"message", "type", "param", "code"}}``: the
server's own error handlers (:func:`~huggingfaceserver.edge.http_errors.install_error_handlers`),
on routes of an app that serves the OpenAI routes without a prefix."""

from __future__ import annotations

from http import HTTPStatus

import httpx
import openai
import pytest
from fastapi import FastAPI
from pydantic import ValidationError

from huggingfaceserver.edge.http_errors import install_error_handlers
from huggingfaceserver.errors import BadRequest, ServerError
from huggingfaceserver.protocols.openai.errors import (
    InvalidParameter,
    OpenAIErrorResponse,
    context_length_error,
    error_type,
    openai_error_response,
    validation_error_body,
)
from huggingfaceserver.protocols.openai.requests import ChatCompletionRequest, CompletionRequest

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def failing_with(status: int) -> ServerError:
    error_class = type(f"Error{status}", (ServerError,), {"status_code": status})
    return error_class(f"failed with {status}")


def build_app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app, openai_prefix="")

    @app.post("/v1/chat/completions")
    async def chat(request: ChatCompletionRequest) -> dict:
        if request.model == "missing":
            raise failing_with(HTTPStatus.NOT_FOUND)
        if request.model == "long":
            raise context_length_error(2048, 2000, 100)
        return {"ok": True}

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest) -> dict:
        return {"ok": True}

    @app.get("/v1/fail/{status}")
    async def fail(status: int) -> dict:
        raise failing_with(status)

    return app


@pytest.fixture(scope="module")
def app() -> FastAPI:
    return build_app()


@pytest.fixture
async def client(app):
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client


def error_of(response: httpx.Response, status: int) -> dict:
    """The ``error`` object, after checking the status and the exact shape."""
    assert response.status_code == status, response.text
    body = response.json()
    assert list(body) == ["error"], body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"].strip()
    return error


@pytest.mark.parametrize(
    ("status", "expected_type", "code"),
    [
        (400, "invalid_request_error", None),
        (401, "authentication_error", None),
        (403, "permission_error", None),
        (404, "invalid_request_error", "model_not_found"),
        (413, "invalid_request_error", None),
        (429, "rate_limit_error", None),
        (500, "server_error", None),
        (502, "server_error", None),
        (503, "server_error", None),
    ],
)
async def test_error_shape_per_status(client, status, expected_type, code):
    error = error_of(await client.get(f"/v1/fail/{status}"), status)
    assert error == {
        "message": f"failed with {status}",
        "type": expected_type,
        "param": None,
        "code": code,
    }
    assert error_type(status) == expected_type


def test_bad_request_keeps_its_status():
    response = openai_error_response(BadRequest("no"))
    assert response.status_code == 400


def test_invalid_parameter_carries_param_and_code():
    exc = InvalidParameter("n must be 1", param="n", code="unsupported_value")
    assert isinstance(exc, BadRequest) and exc.status_code == 400
    body = OpenAIErrorResponse.build(exc.message, exc.status_code, exc.param, exc.code)
    assert body.model_dump() == {
        "error": {
            "message": "n must be 1",
            "type": "invalid_request_error",
            "param": "n",
            "code": "unsupported_value",
        }
    }


@pytest.mark.parametrize("param", ["messages", "prompt"])
def test_context_length_wording(param):
    exc = context_length_error(4096, 4000, 200, param=param)
    assert isinstance(exc, BadRequest) and exc.status_code == 400
    assert exc.message == (
        "This model's maximum context length is 4096 tokens. However, you requested 4200 tokens "
        "(4000 in the messages, 200 in the completion). Please reduce the length of the messages "
        "or completion."
    )
    assert (exc.param, exc.code) == (param, "context_length_exceeded")


async def test_context_length_error_on_the_wire(client):
    error = error_of(await client.post(CHAT, json={"model": "long", "messages": USER}), 400)
    assert error["message"].startswith("This model's maximum context length is 2048 tokens.")
    assert (error["param"], error["code"]) == ("messages", "context_length_exceeded")


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"model": "m", "messages": USER, "temperature": 3}, "temperature", "temperature"),
        ({"model": "m"}, "messages", "Field required"),
        (
            {"model": "m", "messages": USER, "tools": [{"type": "function"}]},
            "tools.0.function",
            "Field required",
        ),
        ({"model": "m", "messages": USER, "logit_bias": {"x": 1}}, "logit_bias", "'x'"),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages.0.content",
            "image_url",
        ),
    ],
)
async def test_schema_violations_are_400_naming_the_field(client, body, param, says):
    error = error_of(await client.post(CHAT, json=body), 400)
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{param}: ")
    assert says in error["message"]
    assert "Value error" not in error["message"]


async def test_bad_prompt_is_one_readable_error(client):
    error = error_of(await client.post("/v1/completions", json={"prompt": 5}), 400)
    assert error["param"] == "prompt"
    assert error["message"].count("prompt") == 1


@pytest.mark.parametrize("content", [b'{"model": "m", "messages": [', b"not json"])
async def test_invalid_json_is_400(client, content):
    headers = {"content-type": "application/json"}
    error = error_of(await client.post(CHAT, content=content, headers=headers), 400)
    assert "JSON" in error["message"]
    assert error["param"] is None


async def test_missing_body_is_400(client):
    error = error_of(await client.post(CHAT), 400)
    assert error["param"] is None
    assert "request body" in error["message"]


async def test_unknown_model_is_404(client):
    error = error_of(await client.post(CHAT, json={"model": "missing", "messages": USER}), 404)
    assert error["code"] == "model_not_found"


def test_plain_pydantic_validation_errors_too():
    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest.model_validate({"messages": USER, "n": 0})
    error = validation_error_body(caught.value).error
    assert (error.param, error.type) == ("n", "invalid_request_error")
    assert error.message.startswith("n: ")


async def test_the_sdk_reads_our_errors(app):
    transport = httpx.ASGITransport(app=app)
    sdk = openai.AsyncOpenAI(
        api_key="unused",
        base_url="http://test/v1",
        http_client=httpx.AsyncClient(transport=transport),
        max_retries=0,
    )
    with pytest.raises(openai.BadRequestError) as bad:
        await sdk.chat.completions.create(model="m", messages=USER, temperature=3)
    assert bad.value.param == "temperature"
    assert bad.value.type == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as missing:
        await sdk.chat.completions.create(model="missing", messages=USER)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as long:
        await sdk.chat.completions.create(model="long", messages=USER)
    assert long.value.code == "context_length_exceeded"
