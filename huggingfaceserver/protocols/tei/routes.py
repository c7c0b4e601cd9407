"""text-embeddings-inference's routes, at the server's root beside KServe's and the OpenAI
ones: ``/embed``, ``/embed_sparse``, ``/embed_all``, ``/predict``, ``/rerank``, ``/tokenize``,
``/decode``, ``/info``, ``/health``, and ``POST /``, which answers as the model's own route
(``/embed``, ``/embed_sparse``, ``/rerank`` or ``/predict``), as TEI's does.

Every failure on these routes is answered in TEI's error shape, ``{"error": message,
"error_type": ...}`` with the server's status: :func:`error_content` renders it, the edge
answers with it on the routes :func:`is_tei_route` names
(:mod:`huggingfaceserver.edge.http_errors`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from http import HTTPStatus
from typing import Any

import orjson
from fastapi import APIRouter, FastAPI, Request, Response
from pydantic import BaseModel

from ...backends.base import EncoderBackend
from ...errors import NotReady, ServerError
from ...tasks import Task
from ..error_routes import OwnBodyRoute
from ..openai.models import ServedModels
from ..openapi import publish_request_bodies
from . import serving
from .requests import (
    BODIES,
    EmbedRequest,
    EmbedSparseRequest,
    PredictRequest,
    RerankRequest,
    RootRequest,
)

PATHS = frozenset({*BODIES, "/info", "/health"})
"""The paths of TEI's routes (and ``POST /``)."""
ROOT = "/"


def error_type(status: int) -> str:
    """TEI's ``error_type`` for an HTTP status."""
    if status == HTTPStatus.TOO_MANY_REQUESTS:
        return "Overloaded"
    if status == HTTPStatus.SERVICE_UNAVAILABLE:
        return "Unhealthy"
    if status >= 500:
        return "Backend"
    return "Validation"


def error_content(exc: ServerError) -> dict[str, Any]:
    """``exc`` in TEI's shape, as JSON content."""
    return {"error": exc.message, "error_type": error_type(exc.status_code)}


def is_tei_route(path: str, method: str | None = None) -> bool:
    """TEI's routes (``POST /`` among them; ``GET /`` is KServe's liveness)."""
    return path in PATHS or (path == ROOT and method == "POST")


def json_response(content: Any) -> Response:
    return Response(orjson.dumps(content), media_type="application/json")


async def parse(request: Request, model: type[BaseModel]) -> Any:
    return model.model_validate_json(await request.body())


Serve = Callable[[ServedModels, Any], Awaitable[Any]]
ROOT_ROUTES: dict[Task, tuple[type[BaseModel], Serve]] = {
    Task.text_embedding: (EmbedRequest, serving.embed),
    Task.sparse_embedding: (EmbedSparseRequest, serving.embed_sparse),
    Task.sequence_classification: (PredictRequest, serving.predict),
}
"""What ``POST /`` answers, by the model's task (a one-label classifier: ``/rerank``)."""


def tei_router(models: ServedModels, ready: Callable[[], Awaitable[bool]]) -> APIRouter:
    """The routes; ``ready``: the server's readiness (``/health`` as ``/v2/health/ready``)."""
    router = APIRouter(route_class=OwnBodyRoute)
    handlers: dict[str, Serve] = {
        "/embed": serving.embed,
        "/embed_sparse": serving.embed_sparse,
        "/embed_all": serving.embed_all,
        "/predict": serving.predict,
        "/rerank": serving.rerank,
        "/tokenize": serving.tokenize,
        "/decode": serving.decode,
    }
    for path, handle in handlers.items():
        router.add_api_route(path, endpoint(models, BODIES[path], handle), methods=["POST"])

    @router.post(ROOT)
    async def root(request: Request) -> Response:
        model, backend = serving.served(models, ROOT)
        body, handle = ROOT_ROUTES.get(model.task, (PredictRequest, serving.predict))
        if model.task is Task.sequence_classification and len(backend.task.labels) == 1:
            body, handle = RerankRequest, serving.rerank
        return json_response(await handle(models, await parse(request, body)))

    @router.get("/info")
    async def info() -> Response:
        return json_response(await serving.info(models))

    @router.get("/health")
    async def health() -> Response:
        if not await ready():
            raise NotReady("unhealthy")
        return Response(status_code=HTTPStatus.OK)

    return router


def endpoint(
    models: ServedModels, body: type[BaseModel], handle: Serve
) -> Callable[[Request], Coroutine[Any, Any, Response]]:
    async def route(request: Request) -> Response:
        return json_response(await handle(models, await parse(request, body)))

    return route


def mount_tei(app: FastAPI, models: ServedModels, ready: Callable[[], Awaitable[bool]]) -> None:
    """Add the routes to ``app`` when it serves an encoder model (call once the models are
    registered), their bodies documented in /openapi.json."""
    served = models.registry.get_models().values()
    if not any(isinstance(getattr(m, "backend", None), EncoderBackend) for m in served):
        return
    app.include_router(tei_router(models, ready))
    publish_request_bodies(app, {**BODIES, ROOT: RootRequest}, "TEI")
