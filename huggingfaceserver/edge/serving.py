"""Serves a model over HTTP and gRPC (:mod:`.listeners`): KServe's data plane and repository
around it, the gateway's rules, its background load and the watch on its backend."""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import struct
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from kserve import logging as kserve_logging
from kserve.constants.constants import INFERENCE_CONTENT_LENGTH_HEADER
from kserve.context import set_predictor_config
from kserve.model_repository import ModelRepository
from kserve.predictor_config import PredictorConfig
from kserve.protocol.dataplane import DataPlane
from kserve.protocol.infer_type import InferRequest
from kserve.protocol.model_repository_extension import ModelRepositoryExtension
from kserve.protocol.rest.v2_datamodels import InferenceRequest
from pydantic import ValidationError

from ..cli import ServerConfig
from ..errors import BadRequest, EngineDied, ServerError, StartupError
from ..observability import metrics
from ..observability.logs import format_every_handler, quiet_access_log
from ..observability.startup import STARTUP
from ..protocols.error_routes import describe_validation_error
from ..protocols.kserve_model import BackendModel
from .admission import Admission, SharedSlots
from .gateway import Gateway, GatewayPolicy, ReadyFronts, ServerState
from .listeners import (
    Listeners,
    Rules,
    ServingOptions,
    build_app,
    http_port,
    http_socket,
    install_access_log,
    run_servers,
)
from .repository import SingleModelRepository

logger = logging.getLogger(__name__)


class ModelAwareDataPlane(DataPlane):
    """KServe's data plane, with readiness that waits for the model and lenient V2 bodies."""

    def __init__(self, *args: Any, state: ServerState | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.state = state or ServerState()

    async def ready(self) -> bool:
        """``/v2/health/ready`` and gRPC ServerReady: true only once every model is loaded and
        warmed up, and false again from the moment the server starts draining."""
        if self.state.draining:
            return False
        models = list(self.model_registry.get_models().values())
        return (
            bool(models)
            and all(m.ready for m in models)
            and self.state.fronts_ready()
            and await super().ready()
        )

    def decode_inference_request(
        self, body: bytes | InferenceRequest, headers: dict, model_name: str
    ) -> InferRequest:
        """A V2 JSON body sent without ``content-type: application/json`` (curl's default) is
        still JSON; KServe alone would take it for binary tensor data and refuse it. A body
        in the binary tensor extension (JSON of ``Inference-Header-Content-Length`` bytes,
        then the tensors' bytes) that KServe cannot read is a 400 naming what is wrong, not a
        500."""
        if not isinstance(body, bytes):
            return super().decode_inference_request(body, headers, model_name)
        if INFERENCE_CONTENT_LENGTH_HEADER not in headers:
            try:
                body = InferenceRequest.model_validate_json(body)
            except ValidationError as exc:
                raise BadRequest(describe_validation_error(exc)) from None
            return super().decode_inference_request(body, headers, model_name)
        length = headers[INFERENCE_CONTENT_LENGTH_HEADER]
        if not (length.isdecimal() and int(length) <= len(body)):
            raise BadRequest(
                f"header {INFERENCE_CONTENT_LENGTH_HEADER}: {length!r} is not the length of "
                f"the JSON at the start of the body ({len(body)} bytes)"
            )
        try:
            return super().decode_inference_request(body, headers, model_name)
        except struct.error as exc:  # BYTES whose length prefixes overrun the data
            raise BadRequest(
                f"binary tensor request: its BYTES are not length-prefixed strings ({exc})"
            ) from None
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise BadRequest(f"binary tensor request: cannot read it ({exc!r})") from None


def adapter_names(model: BackendModel) -> list[str]:
    """LoRA adapters served as models of their own (vLLM's ``--lora-modules``)."""
    return list(getattr(model.backend, "adapters", {}))


class ModelLoader:
    """Loads the model in the background, warms it up, then watches its backend.

    A load failure or a dead backend is kept in ``failures`` and shuts the server down the
    normal way (SIGTERM), so the process exits non-zero with our one-line error, not with the
    torn-down servers' tracebacks; Kubernetes then restarts it.
    """

    def __init__(self, model: BackendModel, state: ServerState):
        self.model: BackendModel | None = model
        """The model served from the start, until it is unloaded (:meth:`forget`)."""
        self.state = state
        self.failures: list[StartupError | EngineDied] = []
        self.watchers: dict[int, asyncio.Task[None]] = {}

    def fail(self, model: BackendModel, exc: StartupError | EngineDied) -> None:
        model.ready = False
        self.failures.append(exc)
        signal.raise_signal(signal.SIGTERM)

    async def load(self, model: BackendModel | None = None) -> None:
        """Load off the event loop while the server already answers health probes; ready
        after one warm-up inference."""
        model = model or self.model
        assert model is not None, "a model to load"
        start = time.monotonic()
        try:
            await model.backend.connect()
            await asyncio.to_thread(model.load_backend)
            with STARTUP.phase("warm-up"):
                await model.warm_up()
        except StartupError as exc:
            self.fail(model, exc)
            return
        except ServerError as exc:  # the warm-up request itself was refused: a model problem
            self.fail(model, StartupError(f"the warm-up inference failed: {exc}"))
            return
        model.ready = True
        self.state.front_ready()
        metrics.model_loaded(model.name, time.monotonic() - start)
        logger.info("model %s is ready", model.name)
        STARTUP.log_ready()
        self.watchers[id(model)] = asyncio.create_task(self.watch(model))

    def forget(self, model: BackendModel) -> None:
        """Stop watching ``model`` and let go of it (unloaded on request: its backend's end is
        no failure, and its memory is to be returned)."""
        watcher = self.watchers.pop(id(model), None)
        if watcher is not None:
            watcher.cancel()
        if self.model is model:
            self.model = None

    async def watch(self, model: BackendModel) -> None:
        try:
            await model.backend.watch()
        except EngineDied as exc:
            logger.error("%s", exc)
            self.fail(model, exc)


def predictor_config(config: ServerConfig) -> PredictorConfig:
    """Where KServe's model base class sends requests in transformer mode (``--predictor_*``)."""
    flags = config.server
    return PredictorConfig(
        predictor_host=flags.predictor_host,
        predictor_protocol=flags.predictor_protocol,
        predictor_use_ssl=flags.predictor_use_ssl,
        predictor_request_timeout_seconds=flags.predictor_request_timeout_seconds,
        predictor_request_retries=flags.predictor_request_retries,
        predictor_health_check=flags.enable_predictor_health_check,
    )


def configure_kserve_logging(config: ServerConfig) -> None:
    """KServe's and uvicorn's loggers, as KServe's ModelServer configures them
    (``--configure_logging``, ``--log_config_file``) unless they have handlers already."""
    if config.server.configure_logging and not kserve_logging.logger.handlers:
        kserve_logging.configure_logging(config.server.log_config_file)


def install_gateway(app: FastAPI, config: ServerConfig, rules: Rules) -> None:
    """The request rules around every route (:mod:`.gateway`), and CORS outside them."""
    policy = GatewayPolicy(
        api_key=rules.api_key,
        max_request_bytes=config.max_request_bytes,
        request_timeout_s=config.request_timeout_seconds,
        read_timeout_s=config.request_read_timeout_seconds,
        log_requests=not config.disable_log_requests,
        openai_prefix=config.openai_route_prefix,
        model_name=config.model_name,
    )
    app.add_middleware(
        Gateway,
        policy=policy,
        admission=rules.admission,
        state=rules.state,
        routes=lambda: app.router.routes,
    )
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["x-request-id"],
        )


def serve_model(
    model: BackendModel,
    config: ServerConfig,
    rebuild: Callable[[], BackendModel] | None = None,
    shared_port: bool = False,
    admission_slots: SharedSlots | None = None,
    ready_fronts: ReadyFronts | None = None,
) -> None:
    """Serve ``model`` over HTTP and gRPC until stopped: the whole server, or one front
    process (``shared_port``: its HTTP port is shared with the other fronts,
    ``admission_slots`` the server-wide admission count and ``ready_fronts`` the count of
    fronts ready). ``rebuild`` makes the model anew for the model repository's load
    (``--enable_model_repository``)."""
    set_predictor_config(predictor_config(config))
    configure_kserve_logging(config)
    quiet_access_log()  # the gateway logs one line per request
    format_every_handler(config.log_format)
    state = ServerState(ready_fronts)
    registry = ModelRepository()
    for name in [model.name, *adapter_names(model)]:
        registry.update(model, name)
        logger.info("registered model %s", name)
    dataplane = ModelAwareDataPlane(model_registry=registry, state=state)
    loader = ModelLoader(model, state)
    rules = Rules(
        Admission(config.max_concurrent_requests, admission_slots),
        state,
        config.api_key,
        config.enable_model_repository,
        not config.disable_log_requests,
        config.request_timeout_seconds,
    )
    repository = (
        repository_for(registry, model, rebuild, loader)
        if config.enable_model_repository and rebuild is not None
        else ModelRepositoryExtension(model_registry=registry)
    )
    app = build_app(
        dataplane,
        repository,
        config.openai_route_prefix,
        enable_repository=config.enable_model_repository,
        enable_docs_url=config.server.enable_docs_url,
    )
    install_gateway(app, config, rules)
    options = ServingOptions.from_flags(
        config.server,
        grace_period=max(1, math.ceil(config.shutdown_grace_seconds)),
        header_timeout_s=config.request_read_timeout_seconds,
    )
    install_access_log(app, options.access_log_format)
    sock = http_socket(http_port(config.server), shared=shared_port)
    run_servers(Listeners(app, sock, options, dataplane, repository, rules), loader.load())
    if loader.failures:
        raise loader.failures[0]


def repository_for(
    registry: ModelRepository,
    model: BackendModel,
    rebuild: Callable[[], BackendModel],
    loader: ModelLoader,
) -> SingleModelRepository:
    """Load and unload of the served model (``--enable_model_repository``)."""
    return SingleModelRepository(
        registry,
        model.name,
        build=rebuild,
        start=loader.load,
        forget=loader.forget,
    )
