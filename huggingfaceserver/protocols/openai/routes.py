"""The OpenAI-compatible routes, mounted on KServe's application under a prefix.

Every failure on these routes is answered in the OpenAI error shape (:mod:`.errors`), which
the edge chooses for the paths under the prefix (:mod:`huggingfaceserver.edge.http_errors`), so
KServe's own routes keep theirs. With an empty prefix, ``GET /v1/models`` and
``/v1/models/{name}`` would collide with KServe's V1 routes: they then answer one body that
carries both shapes (KServe's ``models`` / ``name``+``ready`` and OpenAI's ``data`` /
``id``+``object``), so both kinds of client read what they expect.
"""

from __future__ import annotations

import asyncio
import importlib
import sys
from types import ModuleType
from typing import TypeVar

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from ...backends.base import GenerationBackend
from ..error_routes import OwnBodyRoute
from ..openapi import publish_request_bodies
from .bodies import JSONBody, to_json
from .encoder_requests import EmbeddingRequest, RerankRequest
from .models import ServedModels
from .requests import ChatCompletionRequest, CompletionRequest
from .responses_api import ResponsesRequest
from .serving_encoders import create_embeddings, create_rerank
from .serving_lora import (
    LoadLoraAdapterRequest,
    UnloadLoraAdapterRequest,
    load_lora_adapter,
    unload_lora_adapter,
)
from .tokenization import DetokenizeRequest, TokenizeRequest, create_detokenize, create_tokenize

R = TypeVar("R", bound=BaseModel)
SERVING_CHAT = f"{__package__}.serving_chat"
SERVING_COMPLETIONS = f"{__package__}.serving_completions"
SERVING_RESPONSES = f"{__package__}.serving_responses"
BODIES: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/v1/rerank": RerankRequest,
    "/v1/tokenize": TokenizeRequest,
    "/v1/detokenize": DetokenizeRequest,
    "/v1/load_lora_adapter": LoadLoraAdapterRequest,
    "/v1/unload_lora_adapter": UnloadLoraAdapterRequest,
}
"""The body each POST route parses itself, as /openapi.json documents it."""


async def parse(request: Request, model: type[R]) -> R:
    """The body as ``model``; malformed JSON and schema violations are 400s."""
    return model.model_validate_json(await request.body())


def json(response: BaseModel) -> Response:
    return JSONBody(to_json(response))


async def serving(name: str = SERVING_CHAT) -> ModuleType:
    """The completion, chat and responses handlers, imported on first use and off the event
    loop: an encoder server never needs them (a generation server imports them in
    :func:`mount_openai`)."""
    module = sys.modules.get(name)
    if module is None:
        module = await asyncio.to_thread(importlib.import_module, name)
    return module


def openai_router(models: ServedModels, kserve_compatible: bool) -> APIRouter:
    """The routes; ``kserve_compatible`` merges the model routes with KServe's V1 shapes."""
    router = APIRouter(route_class=OwnBodyRoute)

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await parse(request, CompletionRequest)
        return await (await serving(SERVING_COMPLETIONS)).create_completion(models, body, request)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await parse(request, ChatCompletionRequest)
        return await (await serving()).create_chat_completion(models, body, request)

    @router.post("/v1/responses")
    async def responses(request: Request) -> Response:
        body = await parse(request, ResponsesRequest)
        return await (await serving(SERVING_RESPONSES)).create_response(models, body, request)

    @router.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return json(await create_embeddings(models, await parse(request, EmbeddingRequest)))

    @router.post("/v1/rerank")
    async def rerank(request: Request) -> Response:
        return json(await create_rerank(models, await parse(request, RerankRequest)))

    @router.post("/v1/tokenize")
    async def tokenize(request: Request) -> Response:
        return json(await create_tokenize(models, await parse(request, TokenizeRequest)))

    @router.post("/v1/detokenize")
    async def detokenize(request: Request) -> Response:
        return json(await create_detokenize(models, await parse(request, DetokenizeRequest)))

    @router.post("/v1/load_lora_adapter")
    async def load_lora(request: Request) -> Response:
        return await load_lora_adapter(models, await parse(request, LoadLoraAdapterRequest))

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora(request: Request) -> Response:
        return await unload_lora_adapter(models, await parse(request, UnloadLoraAdapterRequest))

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
    """Add the routes to ``app``; call before KServe adds its own so ours match first, and
    after the models are registered: a generation model's handlers are imported now, not by
    its first request."""
    served = models.registry.get_models().values()
    if any(isinstance(getattr(m, "backend", None), GenerationBackend) for m in served):
        for name in (SERVING_COMPLETIONS, SERVING_CHAT, SERVING_RESPONSES):
            importlib.import_module(name)
    app.include_router(openai_router(models, kserve_compatible=prefix == ""), prefix=prefix)
    publish_request_bodies(app, {prefix + path: body for path, body in BODIES.items()}, "OpenAI")
