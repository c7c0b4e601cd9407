"""Builds the served model from a :class:`ServerConfig` and runs KServe's ModelServer."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from kserve import ModelServer
from kserve.constants.constants import INFERENCE_CONTENT_LENGTH_HEADER
from kserve.predictor_config import PredictorConfig
from kserve.protocol.dataplane import DataPlane
from kserve.protocol.infer_type import InferRequest
from kserve.protocol.rest.v2_datamodels import InferenceRequest
from pydantic import ValidationError

from ._kserve import model_server, sync_kserve_args
from .backends import BackendChoice, choose_backend
from .backends.base import EncoderBackend, GenerationBackend
from .backends.engine import EngineEncoder, EngineGenerator
from .backends.remote import RemoteEncoder
from .backends.transformers import TransformersEncoder
from .backends.transformers_generation import TransformersGenerator
from .cli import ServerConfig
from .engine.client import EngineClient
from .errors import (
    BadRequest,
    ServerError,
    StartupError,
    describe_validation_error,
    server_error_handler,
    validation_error_handler,
)
from .layout import choose_layout
from .listeners import http_socket, start_servers
from .loading import ModelSource, device, load_source, read_chat_template
from .logs import batch_access_log
from .protocols.kserve_model import BackendModel, EncoderModel, GenerationModel, RequestLogging
from .protocols.openai.models import ServedModels
from .protocols.openai.routes import mount_openai, route_prefix

logger = logging.getLogger(__name__)


class ModelAwareDataPlane(DataPlane):
    """KServe's data plane, with readiness that waits for the model and lenient V2 bodies."""

    async def ready(self) -> bool:
        """``/v2/health/ready`` and gRPC ServerReady: true only once every model is loaded."""
        models = list(self.model_registry.get_models().values())
        return bool(models) and all(m.ready for m in models) and await super().ready()

    def decode_inference_request(
        self, body: bytes | InferenceRequest, headers: dict, model_name: str
    ) -> InferRequest:
        """A V2 JSON body sent without ``content-type: application/json`` (curl's default) is
        still JSON; KServe alone would take it for binary tensor data and refuse it."""
        if isinstance(body, bytes) and INFERENCE_CONTENT_LENGTH_HEADER not in headers:
            try:
                body = InferenceRequest.model_validate_json(body)
            except ValidationError as exc:
                raise BadRequest(describe_validation_error(exc)) from None
        return super().decode_inference_request(body, headers, model_name)


def local_backend(
    source: ModelSource, config: ServerConfig, choice: BackendChoice
) -> EncoderBackend | GenerationBackend:
    """The backend that runs the model in this process (or on the remote predictor)."""
    if source.task.is_generative:
        if choice.name == "vllm":
            from .backends.vllm.generation import VLLMGenerator  # vLLM only when it serves

            return VLLMGenerator(source, config)
        return TransformersGenerator(source, config)
    if choice.name == "vllm":
        from .backends.vllm.embedding import VLLMEmbedder  # vLLM only when it serves

        return VLLMEmbedder(source, config)
    if config.server.get("predictor_host"):
        return RemoteEncoder(source, config)
    return TransformersEncoder(source, config)


def engine_local_backend(config: ServerConfig) -> EncoderBackend | GenerationBackend:
    """The engine process's backend: the model on transformers, in this process (the layout
    splits only transformers-served models, see :func:`~.layout.choose_layout`)."""
    source, choice = locate(config)
    return local_backend(source, config, choice)


def engine_backend(
    source: ModelSource, config: ServerConfig, client: EngineClient
) -> EncoderBackend | GenerationBackend:
    """A front process's backend: the model runs in the engine process."""
    if source.task.is_generative:
        return EngineGenerator(source, config, client)
    return EngineEncoder(source, config, client)


def locate(config: ServerConfig) -> tuple[ModelSource, BackendChoice]:
    """Locate the model, read its config, pick a backend (:class:`StartupError` for anything
    the user must fix, before serving starts)."""
    if config.server.get("workers", 1) > 1:
        raise StartupError(
            "--workers > 1 is not supported: one process holds the model; use --api_workers N "
            "for N front processes before one engine process"
        )
    source = load_source(config)
    choice = choose_backend(config.backend, source.task, source.config.architectures or [])
    logger.info("backend %s: %s", choice.name, choice.reason)
    return source, choice


def build_model(
    config: ServerConfig,
    located: tuple[ModelSource, BackendChoice] | None = None,
    client: EngineClient | None = None,
) -> BackendModel:
    """Everything short of loading weights: the model as KServe serves it, with its backend
    (the engine's client in a front process)."""
    source, choice = located or locate(config)
    if config.engine_flags and choice.name != "vllm":
        logger.warning(
            "ignored with the transformers backend (vLLM engine flags): %s",
            " ".join(f"--{name}" for name in config.engine_flags),
        )
    if client is None:
        backend = local_backend(source, config, choice)
    else:
        backend = engine_backend(source, config, client)
    if isinstance(backend, GenerationBackend):
        template = read_chat_template(config.chat_template)
        return GenerationModel(config.model_name, source.task, backend, template)
    if config.tensor_input_names and not config.server.get("predictor_host"):
        logger.warning("--tensor_input_names only applies with --predictor_host; ignored")
    logging_ = RequestLogging(not config.disable_log_requests, config.max_log_len)
    return EncoderModel(config.model_name, source.task, backend, logging_)


def serve(config: ServerConfig) -> None:
    """Serve until stopped, in one process or as an engine behind front processes.
    Startup problems raise :class:`StartupError`."""
    source, choice = locate(config)
    layout = choose_layout(
        config.api_workers,
        choice.name,
        remote=bool(config.server.get("predictor_host")) and not source.task.is_generative,
        cuda=device().type == "cuda",
        cores=os.cpu_count() or 1,
    )
    if layout.split:
        logger.info(
            "%d front processes before one engine process (%s)", layout.api_workers, layout.reason
        )
        from .supervisor import run_processes

        run_processes(config, layout.api_workers)
        return
    logger.info("one process (%s)", layout.reason)
    serve_model(build_model(config, (source, choice)), config)


def adapter_names(model: BackendModel) -> list[str]:
    """LoRA adapters served as models of their own (vLLM's ``--lora-modules``)."""
    return list(getattr(model.backend, "adapters", {}))


def install_error_handlers(app: FastAPI) -> None:
    """Our exceptions with their status, and 400 (not 422) for bodies that do not validate."""
    app.add_exception_handler(ServerError, server_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)


class ModelLoader:
    """Loads the model in the background, then watches its backend.

    A load failure or a dead backend is kept in ``failures`` and shuts the server down the
    normal way (SIGTERM), so the process exits non-zero with our one-line error, not with the
    torn-down servers' tracebacks; Kubernetes then restarts it.
    """

    def __init__(self, model: BackendModel):
        self.model = model
        self.failures: list[StartupError] = []
        self.watcher: asyncio.Task[None] | None = None

    def fail(self, exc: StartupError) -> None:
        self.model.ready = False
        self.failures.append(exc)
        signal.raise_signal(signal.SIGTERM)

    async def load(self) -> None:
        """Load off the event loop while the server already answers health probes."""
        try:
            await self.model.backend.connect()
            await asyncio.to_thread(self.model.load_backend)
        except StartupError as exc:
            self.fail(exc)
            return
        logger.info("model %s is ready", self.model.name)
        self.watcher = asyncio.create_task(self.watch())

    async def watch(self) -> None:
        try:
            await self.model.backend.watch()
        except StartupError as exc:
            logger.error("%s", exc)
            self.fail(exc)


def _model_server(config: ServerConfig) -> ModelServer:
    s: dict[str, Any] = config.server
    predictor = PredictorConfig(
        predictor_host=s["predictor_host"],
        predictor_protocol=s["predictor_protocol"],
        predictor_use_ssl=s["predictor_use_ssl"],
        predictor_request_timeout_seconds=s["predictor_request_timeout_seconds"],
        predictor_request_retries=s["predictor_request_retries"],
        predictor_health_check=s["enable_predictor_health_check"],
    )
    server = ModelServer(
        http_port=s["http_port"],
        grpc_port=s["grpc_port"],
        workers=s["workers"],
        max_threads=s["max_threads"],
        max_asyncio_workers=s["max_asyncio_workers"],
        enable_grpc=s["enable_grpc"],
        enable_docs_url=s["enable_docs_url"],
        enable_latency_logging=s["enable_latency_logging"],
        access_log_format=s["access_log_format"],
        event_loop=s["event_loop"],
        timeout_keep_alive=s["timeout_keep_alive"],
        predictor_config=predictor,
        ssl_certfile=s["ssl_certfile"],
        ssl_keyfile=s["ssl_keyfile"],
    )
    server.dataplane = ModelAwareDataPlane(model_registry=server.registered_models)
    return server


def serve_model(model: BackendModel, config: ServerConfig, shared_port: bool = False) -> None:
    """Serve ``model`` over HTTP and gRPC until stopped: the whole server, or one front
    process (``shared_port``: its HTTP port is shared with the other fronts)."""
    sync_kserve_args(config.server)
    server = _model_server(config)
    batch_access_log()  # KServe has configured logging by now
    server.register_model(model)
    for adapter in adapter_names(model):
        server.register_model(model, name=adapter)
    install_error_handlers(model_server.app)
    mount_openai(model_server.app, ServedModels(server.registered_models), route_prefix())
    sock = http_socket(server.http_port, shared=shared_port)
    loader = ModelLoader(model)
    server.servers.append(loader.load())
    start_servers(server, sock)
    if loader.failures:
        raise loader.failures[0]
