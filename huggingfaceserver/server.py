"""Builds the served model from a :class:`ServerConfig` and serves it (:mod:`.listeners`)."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import time
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from kserve import logging as kserve_logging
from kserve.constants.constants import (
    DEFAULT_HTTP_PORT,
    DEFAULT_HTTPS_PORT,
    INFERENCE_CONTENT_LENGTH_HEADER,
)
from kserve.context import set_predictor_config
from kserve.model_repository import ModelRepository
from kserve.predictor_config import PredictorConfig
from kserve.protocol.dataplane import DataPlane
from kserve.protocol.infer_type import InferRequest
from kserve.protocol.model_repository_extension import ModelRepositoryExtension
from kserve.protocol.rest.v2_datamodels import InferenceRequest
from pydantic import ValidationError

from . import metrics
from .admission import Admission, SharedSlots
from .backends import BackendChoice, choose_backend, vllm_installed
from .backends.base import EncoderBackend, GenerationBackend
from .cli import ServerConfig
from .errors import BadRequest, ServerError, StartupError, describe_validation_error
from .gateway import Gateway, GatewayPolicy, ReadyFronts, ServerState
from .layout import choose_layout, engine_bytes
from .listeners import (
    Listeners,
    Rules,
    ServingOptions,
    build_app,
    http_socket,
    install_access_log,
    run_servers,
)
from .loading import ModelSource, device, load_source, read_chat_template
from .logs import format_every_handler, quiet_access_log
from .pod import read_pod_limits
from .protocols.kserve_model import BackendModel, EncoderModel, GenerationModel, RequestLogging
from .protocols.openai.routes import route_prefix
from .repository import SingleModelRepository
from .startup import STARTUP

if TYPE_CHECKING:
    from .engine.client import EngineClient

logger = logging.getLogger(__name__)

API_KEY_ENV = "HUGGINGFACESERVER_API_KEY"


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

            return VLLMGenerator(source, config, choice.kv_cache_bytes)
        from .backends.transformers_generation import TransformersGenerator

        return TransformersGenerator(source, config)
    if choice.name == "vllm":
        from .backends.vllm.embedding import VLLMEmbedder  # vLLM only when it serves

        return VLLMEmbedder(source, config, choice.kv_cache_bytes)
    if config.server.get("predictor_host"):
        from .backends.remote import RemoteEncoder

        return RemoteEncoder(source, config)
    if choice.name in ("onnx", "openvino"):
        from .backends.onnx.encoder import OnnxEncoder

        return OnnxEncoder(source, config, fallback=choice.fallback, backend=choice.name)
    from .backends.transformers import TransformersEncoder  # each backend only when it serves

    return TransformersEncoder(source, config)


def engine_local_backend(config: ServerConfig) -> EncoderBackend | GenerationBackend:
    """The engine process's backend: the model in this process (the layout splits only models
    that run in-process, see :func:`~.layout.choose_layout`): never vLLM, so that a backend
    choice that depends on the memory free now cannot differ from the supervisor's."""
    source, choice = locate(config, vllm=False)
    return local_backend(source, config, choice)


def engine_backend(
    source: ModelSource, config: ServerConfig, client: EngineClient
) -> EncoderBackend | GenerationBackend:
    """A front process's backend: the model runs in the engine process."""
    from .backends.engine import EngineEncoder, EngineGenerator

    if source.task.is_generative:
        return EngineGenerator(source, config, client)
    return EngineEncoder(source, config, client)


def locate(
    config: ServerConfig, vllm: bool = True, read_config: bool = True
) -> tuple[ModelSource, BackendChoice]:
    """Locate the model, read its config, pick a backend (:class:`StartupError` for anything
    the user must fix, before serving starts); ``vllm=False``: as if vLLM were not
    installed; ``read_config=False``: transformers' config only if the choice needs it (the
    supervisor of fronts and an engine never loads the model, and imports no torch)."""
    if config.server.get("workers", 1) > 1:
        raise StartupError(
            "--workers > 1 is not supported: one process holds the model; use --api_workers N "
            "for N front processes before one engine process"
        )
    source = load_source(config, read_config)
    from .backends.vllm.kv_cache import plan_kv_cache  # no vLLM import: asked only for vLLM

    choice = choose_backend(
        config.backend,
        source.task,
        source.architectures,
        installed=vllm_installed if vllm else lambda: False,
        kv_cache=lambda: plan_kv_cache(source, config),
    )
    logger.info("backend %s: %s", choice.name, choice.reason)
    return source, choice


def build_model(
    config: ServerConfig,
    located: tuple[ModelSource, BackendChoice] | None = None,
    client: EngineClient | None = None,
) -> BackendModel:
    """Everything short of loading weights: the model as KServe serves it, with its backend
    (the engine's client in a front process, which neither reads the model's config nor
    imports torch: the engine does both)."""
    backend: EncoderBackend | GenerationBackend
    if client is not None:
        source = load_source(config, read_config=False)
        backend = engine_backend(source, config, client)
    else:
        if located is None:
            located = locate(config)
            check_choice(config, located[1])
        source, choice = located
        backend = local_backend(source, config, choice)
    if isinstance(backend, GenerationBackend):
        template = read_chat_template(config.chat_template)
        return GenerationModel(
            config.model_name,
            source.task,
            backend,
            template,
            trust_request_chat_template=config.trust_request_chat_template,
            max_inputs_per_request=config.max_inputs_per_request,
            auto_tool_parser=config.tool_call_parser if config.enable_auto_tool_choice else None,
        )
    if config.tensor_input_names and not config.server.get("predictor_host"):
        logger.warning("--tensor_input_names only applies with --predictor_host; ignored")
    logging_ = RequestLogging(not config.disable_log_requests, config.max_log_len)
    return EncoderModel(
        config.model_name,
        source.task,
        backend,
        logging_,
        max_inputs_per_request=config.max_inputs_per_request,
    )


def check_choice(config: ServerConfig, choice: BackendChoice) -> None:
    """Flags that the chosen backend ignores (a warning) or cannot honour (a
    :class:`StartupError`)."""
    if config.engine_flags and choice.name != "vllm":
        logger.warning(
            "ignored with the transformers backend (vLLM engine flags): %s",
            " ".join(f"--{name}" for name in config.engine_flags),
        )
    if config.quantize and choice.name != "onnx":
        raise StartupError(
            f"--quantize {config.quantize} quantises the ONNX Runtime backend's export; the "
            f"model runs on {choice.name} ({choice.reason}): use --backend onnx or auto"
        )


def serve(config: ServerConfig) -> None:
    """Serve until stopped, in one process or as an engine behind front processes.
    Startup problems raise :class:`StartupError`."""
    source, choice = locate(config, read_config=False)
    check_choice(config, choice)
    layout = choose_layout(
        config.api_workers,
        choice.name,
        remote=bool(config.server.get("predictor_host")) and not source.task.is_generative,
        # only auto asks (torch tells, and a supervisor of fronts does without it otherwise)
        cuda=config.api_workers is None and device().type == "cuda",
        pod=read_pod_limits(),
        engine=engine_bytes(source.path),
    )
    if not layout.fits_memory:
        logger.warning("the layout may not fit in the pod's memory: %s", layout.reason)
    if layout.split and config.enable_model_repository:
        raise StartupError(
            "--enable_model_repository needs the single-process layout: the engine process "
            "owns the model; run with --api_workers 1"
        )
    if layout.split:
        logger.info(
            "%d front processes before one engine process (%s)", layout.api_workers, layout.reason
        )
        from .supervisor import run_processes

        run_processes(config, layout.api_workers)
        return
    logger.info("one process (%s)", layout.reason)
    source.read_config()
    serve_model(build_model(config, (source, choice)), config)


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
        self.failures: list[StartupError] = []
        self.watchers: dict[int, asyncio.Task[None]] = {}

    def fail(self, model: BackendModel, exc: StartupError) -> None:
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
        except StartupError as exc:
            logger.error("%s", exc)
            self.fail(model, exc)


def predictor_config(config: ServerConfig) -> PredictorConfig:
    """Where KServe's model base class sends requests in transformer mode (``--predictor_*``)."""
    s: dict[str, Any] = config.server
    return PredictorConfig(
        predictor_host=s["predictor_host"],
        predictor_protocol=s["predictor_protocol"],
        predictor_use_ssl=s["predictor_use_ssl"],
        predictor_request_timeout_seconds=s["predictor_request_timeout_seconds"],
        predictor_request_retries=s["predictor_request_retries"],
        predictor_health_check=s["enable_predictor_health_check"],
    )


def configure_kserve_logging(config: ServerConfig) -> None:
    """KServe's and uvicorn's loggers, as KServe's ModelServer configures them
    (``--configure_logging``, ``--log_config_file``) unless they have handlers already."""
    if config.server["configure_logging"] and not kserve_logging.logger.handlers:
        kserve_logging.configure_logging(config.server["log_config_file"])


def http_port(config: ServerConfig) -> int:
    """``--http_port``; KServe's HTTPS port instead of its default HTTP port with TLS."""
    s = config.server
    if s["ssl_certfile"] and s["ssl_keyfile"] and s["http_port"] == DEFAULT_HTTP_PORT:
        logger.info("SSL enabled, switching listen port to %d", DEFAULT_HTTPS_PORT)
        return DEFAULT_HTTPS_PORT
    port: int = s["http_port"]
    return port


def api_key(config: ServerConfig, environ: dict[str, str] | None = None) -> str | None:
    """``--api_key``, else ``$HUGGINGFACESERVER_API_KEY`` (kept out of the pod's args)."""
    if config.api_key:
        return config.api_key
    value = (environ if environ is not None else os.environ).get(API_KEY_ENV, "").strip()
    return value or None


def install_gateway(app: FastAPI, config: ServerConfig, rules: Rules) -> None:
    """The request rules around every route (:mod:`.gateway`), and CORS outside them."""
    policy = GatewayPolicy(
        api_key=rules.api_key,
        max_request_bytes=config.max_request_bytes,
        request_timeout_s=config.request_timeout_seconds,
        read_timeout_s=config.request_read_timeout_seconds,
        log_requests=not config.disable_log_requests,
        openai_prefix=route_prefix(),
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
    shared_port: bool = False,
    admission_slots: SharedSlots | None = None,
    ready_fronts: ReadyFronts | None = None,
) -> None:
    """Serve ``model`` over HTTP and gRPC until stopped: the whole server, or one front
    process (``shared_port``: its HTTP port is shared with the other fronts,
    ``admission_slots`` the server-wide admission count and ``ready_fronts`` the count of
    fronts ready)."""
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
        api_key(config),
        config.enable_model_repository,
        not config.disable_log_requests,
    )
    repository = (
        repository_for(registry, model, config, loader)
        if config.enable_model_repository
        else ModelRepositoryExtension(model_registry=registry)
    )
    app = build_app(
        dataplane,
        repository,
        route_prefix(),
        enable_repository=config.enable_model_repository,
        enable_docs_url=config.server["enable_docs_url"],
    )
    install_gateway(app, config, rules)
    options = ServingOptions.from_flags(
        config.server, grace_period=max(1, math.ceil(config.shutdown_grace_seconds))
    )
    install_access_log(app, options.access_log_format)
    sock = http_socket(http_port(config), shared=shared_port)
    run_servers(Listeners(app, sock, options, dataplane, repository, rules), loader.load())
    if loader.failures:
        raise loader.failures[0]


def repository_for(
    registry: ModelRepository, model: BackendModel, config: ServerConfig, loader: ModelLoader
) -> SingleModelRepository:
    """Load and unload of the served model (``--enable_model_repository``)."""
    return SingleModelRepository(
        registry,
        model.name,
        build=lambda: build_model(config),
        start=loader.load,
        forget=loader.forget,
    )
