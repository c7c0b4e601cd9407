"""Assembles the served model from a :class:`ServerConfig`: where the model is and what it is,
which backend runs it, and the KServe model around that backend."""

from __future__ import annotations

import logging

from .backends import BackendChoice, choose_backend, vllm_installed
from .backends.base import EncoderBackend, GenerationBackend
from .cli import ServerConfig
from .errors import StartupError
from .generation.defaults import sampling_defaults
from .generation.reasoning import REASONING_PARSERS
from .loading import ModelSource, load_source, read_chat_template
from .protocols.kserve_model import BackendModel, EncoderModel, GenerationModel, RequestLogging

logger = logging.getLogger(__name__)

TRANSFORMERS_ENGINE_FLAGS = frozenset(
    {
        "enable-lora",
        "lora-modules",
        "async-scheduling",
        "no-async-scheduling",
        "kv-cache-memory-bytes",
        "generation-config",
        "override-generation-config",
    }
)
"""vLLM engine flags that the transformers backend honours too (LoRA adapters with PEFT;
decode steps queued ahead; its KV cache's size)."""


def local_backend(
    source: ModelSource, config: ServerConfig, choice: BackendChoice
) -> EncoderBackend | GenerationBackend:
    """The backend that runs the model in this process (or on the remote predictor)."""
    if source.task.is_generative:
        if choice.name == "vllm":
            from .backends.vllm.generation import VLLMGenerator  # vLLM only when it serves

            return VLLMGenerator(source, config, choice.kv_cache_bytes)
        from .backends.pytorch.generator import TransformersGenerator

        return TransformersGenerator(source, config)
    if choice.name == "vllm":
        from .backends.vllm.embedding import VLLMEmbedder  # vLLM only when it serves

        return VLLMEmbedder(source, config, choice.kv_cache_bytes)
    if config.server.predictor_host:
        from .backends.remote import RemoteEncoder

        return RemoteEncoder(source, config)
    if choice.name in ("onnx", "openvino"):
        from .backends.onnx.encoder import OnnxEncoder

        return OnnxEncoder(source, config, fallback=choice.fallback, backend=choice.name)
    from .backends.pytorch.encoder import TransformersEncoder  # each backend only when it serves

    return TransformersEncoder(source, config)


def engine_local_backend(config: ServerConfig) -> EncoderBackend | GenerationBackend:
    """The engine process's backend: the model in this process (the layout splits only models
    that run in-process, see :func:`~.topology.layout.choose_layout`): never vLLM, so that a backend
    choice that depends on the memory free now cannot differ from the supervisor's."""
    source, choice = locate(config, vllm=False)
    return local_backend(source, config, choice)


def locate(
    config: ServerConfig, vllm: bool = True, read_config: bool = True
) -> tuple[ModelSource, BackendChoice]:
    """Locate the model, read its config, pick a backend (:class:`StartupError` for anything
    the user must fix, before serving starts); ``vllm=False``: as if vLLM were not
    installed; ``read_config=False``: transformers' config only if the choice needs it (the
    supervisor of fronts and an engine never loads the model, and imports no torch)."""
    source = load_source(config, read_config)
    from .backends.vllm.cache_sizing import plan_kv_cache  # no vLLM import: asked only for vLLM

    def refuses() -> str | None:
        from .backends.vllm.attention_fit import attention_refusal  # vLLM is installed

        return attention_refusal(source)

    choice = choose_backend(
        config.backend,
        source.task,
        source.architectures,
        installed=vllm_installed if vllm else lambda: False,
        kv_cache=lambda: plan_kv_cache(source, config),
        refuses=refuses,
    )
    logger.info("backend %s: %s", choice.name, choice.reason)
    return source, choice


def build_model(
    config: ServerConfig, located: tuple[ModelSource, BackendChoice] | None = None
) -> BackendModel:
    """Everything short of loading weights: the model as KServe serves it, with the backend
    that runs it in this process (or on the remote predictor)."""
    if located is None:
        located = locate(config)
        check_choice(config, located[1])
    source, choice = located
    return model_around(config, source, local_backend(source, config, choice))


def model_around(
    config: ServerConfig, source: ModelSource, backend: EncoderBackend | GenerationBackend
) -> BackendModel:
    """The model as KServe serves it (its protocol handling, request limits and logging) around
    ``backend``: a local one, or a front process's client of the engine."""
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
            reasoning=REASONING_PARSERS[config.reasoning_parser]
            if config.reasoning_parser
            else None,
            sampling_defaults=sampling_defaults(source.path, *generation_flags(config)),
        )
    # here, not in parsing: it takes the task (only an encoder's model runs on the predictor;
    # a generative model runs here whatever --predictor_host says)
    if config.tensor_input_names and not config.server.predictor_host:
        logger.warning("--tensor_input_names only applies with --predictor_host; ignored")
    logging_ = RequestLogging(not config.disable_log_requests, config.max_log_len)
    return EncoderModel(
        config.model_name,
        source.task,
        backend,
        logging_,
        max_inputs_per_request=config.max_inputs_per_request,
    )


GENERATION_FLAGS = (("generation-config", "auto"), ("override-generation-config", "{}"))
"""vLLM's flags of the model's sampling defaults, and their defaults."""


def generation_flags(config: ServerConfig) -> tuple[str, str]:
    """``--generation-config`` and ``--override-generation-config`` as given (the last of
    each), or their defaults."""
    source, overrides = (config.engine_flags.get(name, [d])[-1] for name, d in GENERATION_FLAGS)
    return source, overrides


def check_choice(config: ServerConfig, choice: BackendChoice) -> None:
    """Flags that the chosen backend ignores (a warning) or cannot honour (a
    :class:`StartupError`). Not in parsing: ``--backend auto`` chooses by the model's task
    and architecture, and the error names the backend chosen and why."""
    ignored = [name for name in config.engine_flags if name not in TRANSFORMERS_ENGINE_FLAGS]
    if ignored and choice.name != "vllm":
        logger.warning(
            "ignored with the transformers backend (vLLM engine flags): %s",
            " ".join(f"--{name}" for name in ignored),
        )
    if config.torch_compile and choice.name != "huggingface":
        logger.warning(
            "--torch_compile compiles the transformers backend's decode steps; ignored on %s "
            "(%s)%s",
            choice.name,
            choice.reason,
            ", which compiles its own model" if choice.name == "vllm" else "",
        )
    if config.quantize and choice.name != "onnx":
        raise StartupError(
            f"--quantize {config.quantize} quantises the ONNX Runtime backend's export; the "
            f"model runs on {choice.name} ({choice.reason}): use --backend onnx or auto"
        )
