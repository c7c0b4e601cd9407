"""The OpenAI-compatible routes, mounted on KServe's application under a prefix.

Every failure on these routes is answered in the OpenAI error shape (a route class does it,
so KServe's own routes keep theirs). With an empty prefix, ``GET /v1/models`` and
``/v1/models/{name}`` would collide with KServe's V1 routes: they then answer one body that
carries both shapes (KServe's ``models`` / ``name``+``ready`` and OpenAI's ``data`` /
``id``+``object``), so both kinds of client read what they expect.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError

from ...errors import ServerError
from .encoder_requests import EmbeddingRequest, RerankRequest
from .errors import openai_error_response, validation_error_body
from .models import ServedModels
from .requests import ChatCompletionRequest, CompletionRequest
from .responses import JSONBody, to_json
from .serving_chat import create_chat_completion, create_completion
from .serving_encoders import create_embeddings, create_rerank

PREFIX_ENV = "KSERVE_OPENAI_ROUTE_PREFIX"
DEFAULT_PREFIX = "/openai"
R = TypeVar("R", bound=BaseModel)


def route_prefix(environ: dict[str, str] | None = None) -> str:
    """The prefix from ``KSERVE_OPENAI_ROUTE_PREFIX`` (default ``/openai``; may be empty)."""
    value = (environ if environ is not None else os.environ).get(PREFIX_ENV, DEFAULT_PREFIX)
    value = value.strip().rstrip("/")
    return f"/{value.lstrip('/')}" if value else ""


class OpenAIRoute(APIRoute):
    """Renders our errors and validation failures in the OpenAI shape, with their status."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except ServerError as exc:
                return openai_error_response(exc)
            except (ValidationError, RequestValidationError) as exc:
                body = validation_error_body(exc)
                return JSONResponse(status_code=400, content=body.model_dump())

        return route


async def parse(request: Request, model: type[R]) -> R:
    """The body as ``model``; malformed JSON and schema violations are 400s."""
    return model.model_validate_json(await request.body())


def json(response: BaseModel) -> Response:
    return JSONBody(to_json(response))


def openai_router(models: ServedModels, kserve_compatible: bool) -> APIRouter:
    """The routes; ``kserve_compatible`` merges the model routes with KServe's V1 shapes."""
    router = APIRouter(route_class=OpenAIRoute)

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await parse(request, CompletionRequest)
        return await create_completion(models, body, request)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await parse(request, ChatCompletionRequest)
        return await create_chat_completion(models, body, request)

    @router.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return json(await create_embeddings(models, await parse(request, EmbeddingRequest)))

    @router.post("/v1/rerank")
    async def rerank(request: Request) -> Response:
        return json(await create_rerank(models, await parse(request, RerankRequest)))

    @router.get("/v1/models")
    async def list_models() -> Response:
        listing = models.listing()
        if kserve_compatible:
            listing["models"] = [card["id"] for card in listing["data"]]
        return JSONResponse(listing)

    @router.get("/v1/models/{model_id}")
    async def model_card(model_id: str) -> Response:
        model = models.get(model_id)
        card = models.card(model_id)
        if kserve_compatible:
            card.update(name=model_id, ready=model.ready)
        return JSONResponse(card)

    return router


def mount_openai(app: FastAPI, models: ServedModels, prefix: str) -> None:
    """Add the routes to ``app``; call before KServe adds its own so ours match first."""
    app.include_router(openai_router(models, kserve_compatible=prefix == ""), prefix=prefix)
