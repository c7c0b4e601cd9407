"""The command line: a pure function from argv and the environment to a typed
:class:`ServerConfig`.

Nothing here reads a model or a file, and the environment only through the mapping given to
:func:`parse_args`, once: the rest of the package reads the config. Every flag of ours is
generated from a :class:`ServerConfig` field, as vLLM's ``FrontendArgs`` does: the field's name
is the flag, and its default, value type and help are written once, on the field. KServe's
ModelServer flags come from ``kserve.model_server.parser`` (a parent parser) and keep working
unchanged, with their help; their values land in :class:`KServeFlags`, whose fields hold their
defaults. Both ``--foo_bar`` and ``--foo-bar`` spellings are accepted for every flag. Flag
combinations the server cannot run are refused here, before anything is loaded.
"""

from __future__ import annotations

import argparse
import os
import sys
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import Any

from .errors import StartupError
from .generation.reasoning import REASONING_PARSERS
from .generation.tool_parsers import TOOL_PARSERS
from .tasks import Task
from .units import MiB, parse_bytes

DTYPES = ("auto", "float16", "float32", "bfloat16", "float", "half")
BACKENDS = ("auto", "huggingface", "onnx", "openvino", "vllm")
QUANTIZATIONS = ("int8",)
LOG_FORMATS = ("text", "json")
API_KEY_ENV = "HUGGINGFACESERVER_API_KEY"
"""The API key when ``--api_key`` is not given (which keeps it out of the pod's args)."""
OPENAI_PREFIX_ENV = "KSERVE_OPENAI_ROUTE_PREFIX"
"""Where the OpenAI routes are (KServe's variable)."""
DEFAULT_OPENAI_PREFIX = "/openai"
CACHE_ENV = "HUGGINGFACESERVER_CACHE"
"""The server's cache directory (ONNX exports are kept there between starts)."""
KSERVE_TLS_CERT_FILE_ENV = "KSERVE_TLS_CERT_FILE"
"""``--ssl_certfile`` when not given (KServe's variable, read here as KServe reads it)."""
KSERVE_TLS_KEY_FILE_ENV = "KSERVE_TLS_KEY_FILE"
"""``--ssl_keyfile`` when not given."""
# Flag combinations no layout can serve. Parsing refuses those it can tell from the flags alone
# (--backend vllm, an explicit --api_workers N; cli.parse_args); what --backend auto and
# --api_workers auto choose is known only in topology.layout and server.serve.
VLLM_RUNS_ITS_OWN_ENGINE = (
    "--api_workers > 1 is not supported with the vLLM backend (vLLM already runs its engine in "
    "a process of its own): use --api_workers 1, or --backend huggingface"
)
REPOSITORY_NEEDS_ONE_PROCESS = (
    "--enable_model_repository needs the single-process layout: the engine process owns the "
    "model; run with --api_workers 1"
)


DEFAULT_MAX_BATCH_SIZE = 16
"""Rows per batch without ``--max_batch_size``, on torch (encoders and generation)."""
EXPORT_MAX_BATCH_SIZE = 8
"""Rows per forward pass on an ONNX export without ``--max_batch_size``: on ONNX Runtime a batch
padded to its longest row costs more than batching saves (plain ONNX Runtime is fastest at batch
1 on MiniLM), and the server is faster with 8 than with torch's 16 (BENCHMARKS.md, Server
runtime flags)."""

# `vllm serve` engine flags recognised even when vLLM is not installed, so that a manifest
# written for the vLLM image still starts on the transformers backend (with a warning).
# With vLLM installed the full list comes from vLLM's own AsyncEngineArgs.
KNOWN_VLLM_ENGINE_FLAGS = frozenset(
    """
    async-scheduling block-size calculate-kv-scales chat-template-content-format code-revision
    compilation-config config-format cpu-offload-gb data-parallel-size disable-custom-all-reduce
    disable-log-stats disable-sliding-window distributed-executor-backend download-dir
    enable-chunked-prefill enable-expert-parallel enable-lora
    enable-prefix-caching enable-prompt-embeds fully-sharded-loras
    generation-config gpu-memory-utilization guided-decoding-backend hf-config-path hf-overrides
    kv-cache-dtype kv-cache-memory-bytes kv-transfer-config limit-mm-per-prompt load-format
    logits-processor-pattern
    lora-dtype lora-extra-vocab-size lora-modules max-cpu-loras max-logprobs max-lora-rank
    max-loras max-num-batched-tokens max-num-partial-prefills max-num-seqs
    max-parallel-loading-workers
    max-seq-len-to-capture model-impl no-async-scheduling no-enable-chunked-prefill
    no-enable-prefix-caching
    num-gpu-blocks-override num-lookahead-slots num-scheduler-steps num-speculative-tokens
    override-generation-config override-neuron-config pipeline-parallel-size preemption-mode
    prefix-caching-hash-algo quantization rope-scaling rope-theta scheduling-policy
    seed served-model-name skip-tokenizer-init speculative-config speculative-model swap-space
    tensor-parallel-size tokenizer tokenizer-mode tokenizer-pool-size
    use-v2-block-manager worker-cls
    """.split()
)


def _api_workers(value: str) -> int | None:
    if value == "auto":
        return None
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"expected auto or a positive integer, got {value!r}")
    return count


def _names(value: str) -> tuple[str, ...]:
    """A comma list: ``input_ids, attention_mask,``."""
    return tuple(name.strip() for name in value.split(",") if name.strip())


def _origins(value: str) -> tuple[str, ...]:
    """A comma list, or vLLM's JSON list (``'["https://a", "https://b"]'``)."""
    text = value.strip()
    if text.startswith("["):
        import json

        try:
            items = json.loads(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a JSON list: {value!r}") from None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise argparse.ArgumentTypeError(f"expected a list of strings, got {value!r}")
        return tuple(i.strip() for i in items if i.strip())
    return _names(text)


def _task(value: str) -> Task:
    try:
        return Task.parse(value)
    except StartupError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def option(
    default: Any,
    help: str,
    *,
    aliases: tuple[str, ...] = (),
    exclusive: str | None = None,
    **argparse_kwargs: Any,
) -> Any:
    """A :class:`ServerConfig` field with its flag, ``--<field name>``: the default, the help
    that ``--help`` shows, other names of the flag, the mutually exclusive group it is in, and
    what argparse needs beyond the field's annotation (``choices``, a ``type`` converter where
    the annotation's type does not parse the text, a ``metavar``)."""
    return field(
        default=default,
        metadata={"help": help, "aliases": aliases, "exclusive": exclusive, **argparse_kwargs},
    )


def kserve_option(default: Any, env: str | None = None) -> Any:
    """A field whose flag KServe's parser defines (with its help and value type): only the
    default is ours, given to KServe's flag; ``env``: the environment variable that, when set,
    is the default instead (as KServe's parser has it)."""
    return field(default=default, metadata={"kserve": True, "env": env})


def _kserve_defaults(cls: type, environ: Mapping[str, str]) -> dict[str, Any]:
    """The defaults of ``cls``'s fields that are KServe's flags, by field name."""
    defaults = {}
    for kserve_field in fields(cls):
        if kserve_field.metadata.get("kserve"):
            env = kserve_field.metadata["env"]
            default = kserve_field.default
            defaults[kserve_field.name] = environ.get(env, default) if env else default
    return defaults


@dataclass(frozen=True)
class KServeFlags:
    """KServe's ModelServer flags (``kserve.model_server.parser``: their spelling, value type
    and help are KServe's), a field per flag, with its default. ``--model_name`` is
    :attr:`ServerConfig.model_name`."""

    http_port: int = kserve_option(8080)
    """HTTP (and the REST routes); with TLS at this default, KServe's HTTPS port instead
    (:func:`~.edge.listeners.http_port`)."""
    grpc_port: int = kserve_option(8081)
    workers: int = kserve_option(1)
    """uvicorn workers: above 1 refused (one process holds the model; ``--api_workers``)."""
    max_threads: int = kserve_option(4)
    """Threads of the gRPC server."""
    max_asyncio_workers: int | None = kserve_option(None)
    """Threads of the event loop's default executor; None: asyncio's default."""
    enable_grpc: bool = kserve_option(True)
    enable_docs_url: bool = kserve_option(False)
    """Swagger UI at ``/docs``."""
    enable_latency_logging: bool = kserve_option(True)
    """Accepted, no effect: the gateway logs one line per request, with its latency."""
    configure_logging: bool = kserve_option(True)
    """Configure KServe's and uvicorn's loggers (unless they have handlers)."""
    log_config_file: str | None = kserve_option(None)
    """uvicorn's log config (yaml or json) for KServe's logging configuration."""
    access_log_format: str | None = kserve_option(None)
    """asgi-logger's access line format; None: no access lines."""
    event_loop: str = kserve_option("auto")
    """uvicorn's ``loop`` setting."""
    timeout_keep_alive: int = kserve_option(65)
    """Seconds an idle keep-alive connection stays open."""
    predictor_host: str | None = kserve_option(None)
    """Transformer mode: an encoder's model runs on this predictor; we tokenize."""
    protocol: str = kserve_option("v1")
    """Accepted, no effect (KServe's deprecated spelling of ``--predictor_protocol``)."""
    predictor_protocol: str = kserve_option("v1")
    """How the predictor is called (``v2`` or ``grpc-v2`` in transformer mode)."""
    predictor_use_ssl: bool = kserve_option(False)
    predictor_request_timeout_seconds: int = kserve_option(600)
    grpc_max_send_message_length: int = kserve_option(8 * MiB)
    grpc_max_receive_message_length: int = kserve_option(8 * MiB)
    predictor_request_retries: int = kserve_option(0)
    enable_predictor_health_check: bool = kserve_option(False)
    """Readiness also asks the predictor."""
    ssl_certfile: str | None = kserve_option(None, env=KSERVE_TLS_CERT_FILE_ENV)
    """HTTPS with ``ssl_keyfile``."""
    ssl_keyfile: str | None = kserve_option(None, env=KSERVE_TLS_KEY_FILE_ENV)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
        """Our defaults for KServe's flags in ``parser`` (which has KServe's as a parent)."""
        parser.set_defaults(**_kserve_defaults(cls, environ))


@dataclass(frozen=True)
class ServerConfig:
    """Every setting of the server, with its default, in one place: a field per flag."""

    model_name: str = kserve_option("model")
    """Name on the endpoint paths and the OpenAI ``model`` field."""
    model_dir: str = option("/mnt/models", "local folder of the model")
    """Where KServe's storage initializer puts the model."""
    model_id: str | None = option(None, "Hugging Face Hub id; wins over --model_dir")
    """A Hub id or a local folder."""
    model_revision: str | None = option(None, "Hub revision for weights and config")
    tokenizer_revision: str | None = option(None, "Hub revision for the tokenizer")
    dtype: str = option(
        "auto",
        "weights dtype (auto: fp32 on CPU and for encoders; generation on GPU: bf16 for a "
        "bf16 checkpoint, else fp16)",
        choices=DTYPES,
    )
    task: Task | None = option(None, f"one of {', '.join(t.value for t in Task)}", type=_task)
    """Inferred from the model's config when not given."""
    backend: str = option("auto", "inference backend", choices=BACKENDS)
    """``huggingface`` is transformers on torch, ``onnx`` and ``openvino`` the model's ONNX
    export on ONNX Runtime or OpenVINO (encoders)."""
    quantize: str | None = option(
        None, "onnx backend: dynamic int8 quantisation of the export", choices=QUANTIZATIONS
    )
    """The ONNX backend runs a dynamically quantised export (faster, less exact)."""
    max_length: int | None = option(
        None,
        "maximum sequence length (encoder truncation, generation context)",
        aliases=("max_model_len",),
    )
    disable_lower_case: bool = option(False, "do not lower-case in the tokenizer")
    disable_special_tokens: bool = option(False, "encode without special tokens")
    trust_remote_code: bool = option(False, "allow custom model/tokenizer code")
    tensor_input_names: tuple[str, ...] | None = option(
        None, "comma list of tokenizer outputs to send", type=_names
    )
    """Tokenizer outputs sent to a remote predictor (transformer mode); None: all of them."""
    return_token_type_ids: bool = option(False, "include token type ids")
    """In the model inputs."""
    return_probabilities: bool = option(
        False, "softmax probabilities for classification and fill-mask", exclusive="scores"
    )
    return_raw_logits: bool = option(
        False, "raw logits for classification and fill-mask", exclusive="scores"
    )
    return_offsets_mapping: bool = option(False, "token classification: add character offsets")
    return_labels: bool = option(False, "classification: id2label names instead of class indices")
    max_batch_tokens: int = option(16384, "encoders: padded tokens per forward")
    max_batch_size: int | None = option(
        None,
        f"sequences per forward (1: off; default: {DEFAULT_MAX_BATCH_SIZE} on a CPU, or "
        f"{EXPORT_MAX_BATCH_SIZE} on an ONNX export; on a GPU up to 256, see the README)",
    )
    """Encoder batches, and the rows the transformers generation backend decodes together.
    None: the backend's own (:data:`DEFAULT_MAX_BATCH_SIZE` on torch on a CPU,
    :data:`EXPORT_MAX_BATCH_SIZE` for an encoder on its ONNX export; on a GPU
    :mod:`.backends.pytorch.batch_rows` sizes it)."""
    batch_wait_ms: float = option(2.0, "encoders: wait to fill a batch (ms)")
    """How long a request waits for others to share its forward pass."""
    prefill_chunk_tokens: int = option(
        512, "generation on torch: prompt tokens a longer prompt feeds per decode step"
    )
    """Chunked prefill on the transformers backend: a prompt longer than this is fed in parts of
    this many tokens, one part per turn of the decode loop, so that the rows already decoding
    keep stepping between the parts instead of waiting for the whole prompt."""
    enforce_eager: bool = option(
        False,
        "generation on a GPU: run decode steps eagerly, not as CUDA graphs",
        exclusive="steps",
    )
    """The transformers backend on a GPU replays decode steps as CUDA graphs recorded per
    batch-size bucket (:mod:`.backends.pytorch.step_graphs`), as vLLM does; this runs them
    eagerly, on both backends (vLLM gets its ``--enforce-eager``). No effect on a CPU."""
    torch_compile: bool = option(
        False,
        "generation on the transformers backend: decode steps compiled with torch.compile "
        "(inside the CUDA graphs on a GPU), compiled at start-up",
        exclusive="steps",
    )
    """Each batch-size bucket's decode step goes through ``torch.compile`` (inductor) before
    it is recorded as a CUDA graph (:mod:`.backends.pytorch.step_graphs`), as vLLM compiles its
    model; on a CPU the compiled step runs over the whole KV cache buffers. Off by default: on
    a CPU it does not pay (BENCHMARKS.md), and the compiles add to the start-up (inductor's
    kernels are kept in the server's cache: :func:`~.__main__.keep_compiled_kernels`). vLLM
    compiles its own model unless ``--enforce_eager``; with it, this is refused."""
    enable_runtime_lora: bool = option(
        False, "LoRA adapters loaded and unloaded at run time (with --lora_adapter_dir)"
    )
    """``POST /openai/v1/load_lora_adapter`` and ``unload_lora_adapter`` (vLLM's routes, which
    vLLM turns on with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``); off: both are a 404."""
    lora_adapter_dir: str | None = option(
        None, "the folder that adapters loaded at run time must be in"
    )
    """A run-time load reads only adapters inside it (symlinks resolved): a request cannot make
    the server read any other file."""
    chat_template: str | None = option(None, "chat template: Jinja text or a file path")
    """For chat requests."""
    disable_log_requests: bool = option(False, "do not log requests")
    api_workers: int | None = option(
        None,
        "front processes before one engine process (auto: by device; 1: in-process)",
        type=_api_workers,
        metavar="auto|N",
    )
    """Front processes (HTTP, gRPC, tokenization, rendering) in front of one engine process
    that owns the model; None (``auto``): one per two cores on a CUDA device (at most 8),
    else one: the whole server in one process, with no IPC (see :mod:`.topology.layout`)."""
    max_log_len: int = option(512, "characters of the inputs logged (0: none)")
    """Characters of a request's inputs its log line shows, then their whole length (the log
    line only, never the data). 512 identifies a request and keeps the line under 1 KiB, one
    record for any log collector, whatever the body's size."""
    log_format: str = option("text", "log lines as text or JSON", choices=LOG_FORMATS)
    """json: one JSON object per log line, for log collectors."""
    enable_model_repository: bool = option(False, "serve the model repository load/unload routes")
    """KServe's model repository routes (REST and gRPC load/unload/index); off, since this
    server serves the one model it loaded at start and an unload would take it down."""
    max_concurrent_requests: int = option(512, "requests in flight plus queued; beyond it 429")
    """For the whole server; beyond it an immediate 429 with ``Retry-After``. Bounds memory
    under any offered load. 512 as text-embeddings-inference's default: 128 refused half of
    256 closed-loop clients of a GPU encoder batching 256 (BENCHMARKS.md, GPU figures)."""
    max_request_bytes: int = option(16 * MiB, "largest body; beyond it 413")
    """The 413 comes before the body is parsed."""
    max_inputs_per_request: int = option(1024, "texts or prompts per request")
    """Texts (V1 instances, V2 elements, embedding inputs, rerank documents, prompts) per
    request; beyond it a 400 naming the limit."""
    no_truncation: bool = option(
        False, "encoders: refuse over-long inputs (400) instead of truncating"
    )
    """The 400 names both lengths."""
    default_prompt_name: str | None = option(
        None, "embeddings: the model's prompt for requests that name none"
    )
    """One of the model's sentence-transformers prompts (text-embeddings-inference's flag);
    None: the model's own ``default_prompt_name``."""
    default_prompt: str | None = option(
        None, "embeddings: a prompt text for requests that name none"
    )
    """Put before every text of a request that gives no prompt (text-embeddings-inference's
    flag); exclusive with ``default_prompt_name``."""
    trust_request_chat_template: bool = option(False, "accept chat_template in chat requests")
    """vLLM's flag; refused (400) otherwise. Request templates render in a sandbox, off the
    event loop, with time and output limits."""
    enable_auto_tool_choice: bool = option(
        False, "parse tool calls out of chat output (tool_choice auto)"
    )
    """Chat with ``tools`` and ``tool_choice: auto``: the model's output is parsed into
    ``tool_calls`` by ``tool_call_parser`` (vLLM's flags, on both backends)."""
    tool_call_parser: str | None = option(
        None, "the model's tool call format (tool_choice auto)", choices=sorted(TOOL_PARSERS)
    )
    reasoning_parser: str | None = option(
        None,
        "chat: split a thinking model's reasoning out of the content",
        choices=sorted(REASONING_PARSERS),
    )
    """vLLM's flag and names (:mod:`.generation.reasoning`), on both backends: chat messages
    carry ``reasoning`` (and ``reasoning_content``) apart from ``content``; vLLM also gets it,
    so that its structured output starts after the reasoning."""
    request_timeout_seconds: float | None = option(
        None, "504 for a request still running after this long (default: no limit)"
    )
    """Its work is freed too."""
    max_concurrent_predictor_calls: int = option(
        16, "transformer mode: predictor calls in flight at once"
    )
    """``--predictor_host``: each call ends by ``--predictor_request_timeout_seconds`` (504
    past it)."""
    request_read_timeout_seconds: float = option(
        30.0, "408 for a request whose headers, or then its body, are not in after this long"
    )
    """The connection is closed too. The headers are timed from the connection's start (or the
    request's first byte after the previous response), the body from the end of the headers.
    A request takes its admission slot only once its body is in, so clients that stall
    mid-upload hold no slot meanwhile."""
    shutdown_grace_seconds: float = option(25.0, "SIGTERM: time to drain")
    """How long requests in flight (streams included) may take to finish."""
    api_key: str | None = option(None, "bearer token for model routes (or env var)")
    """Every model route then needs it (401 otherwise); health and metrics stay open. Without
    the flag, parsing takes it from ``$HUGGINGFACESERVER_API_KEY`` (blank: no key)."""
    allowed_origins: tuple[str, ...] = option((), "CORS origins, comma list or JSON", type=_origins)
    """``*`` for any; empty: no CORS headers."""
    server: KServeFlags = field(default_factory=KServeFlags)
    """KServe's ModelServer flags (http_port, grpc_port, predictor_host, ...)."""
    engine_flags: dict[str, list[str]] = field(default_factory=dict)
    """vLLM engine flags, dashed name -> values: passed to vLLM; the transformers backend
    honours the LoRA ones and :attr:`async_scheduling`, and ignores the others."""
    openai_route_prefix: str = DEFAULT_OPENAI_PREFIX
    """Where the OpenAI routes are: ``$KSERVE_OPENAI_ROUTE_PREFIX`` (default ``/openai``; may
    be empty: the routes at the root), as ``/prefix`` without a trailing slash."""
    cache_dir: Path | None = None
    """The server's cache directory (ONNX exports in its ``onnx/`` folder): see
    :func:`cache_dir`; None: nowhere to keep anything, every start exports anew."""

    @property
    def async_scheduling(self) -> bool | None:
        """vLLM's ``--async-scheduling`` (True) or ``--no-async-scheduling`` (False), honoured
        by the transformers backend too: whether a decode step is queued before the host reads
        the step before it; None: neither given (on a GPU only, where it overlaps)."""
        if "no-async-scheduling" in self.engine_flags:
            return False
        return True if "async-scheduling" in self.engine_flags else None

    @property
    def kv_cache_memory_bytes(self) -> int | None:
        """vLLM's ``--kv-cache-memory-bytes``, honoured by the transformers backend too: the
        memory its decode loop's KV cache may take; None: not given (each backend sizes it)."""
        values = self.engine_flags.get(KV_CACHE_MEMORY_FLAG)
        return parse_bytes(values[0]) if values else None

    @property
    def encode_lower_case(self) -> bool | None:
        """``do_lower_case`` for the tokenizer: False when disabled, else the tokenizer's own."""
        return False if self.disable_lower_case else None

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
        """Add a flag per field to ``parser`` (each in both spellings, with its aliases) and
        our default for each KServe flag we hold; returns the added actions, by field name."""
        hints = typing.get_type_hints(cls)
        exclusive: dict[str, Callable[..., argparse.Action]] = {}
        actions = {}
        parser.set_defaults(**_kserve_defaults(cls, {}))
        for config_field in fields(cls):
            meta = dict(config_field.metadata)
            if "help" not in meta:
                continue
            aliases, group = meta.pop("aliases"), meta.pop("exclusive")
            add = parser.add_argument
            if group is not None:
                if group not in exclusive:
                    exclusive[group] = parser.add_mutually_exclusive_group().add_argument
                add = exclusive[group]
            actions[config_field.name] = add(
                *(s for name in (config_field.name, *aliases) for s in _spellings(name)),
                dest=config_field.name,
                default=config_field.default,
                **_value_kwargs(config_field, hints[config_field.name]),
                **meta,
            )
        return actions


def _value_kwargs(config_field: Field[Any], annotation: Any) -> dict[str, Any]:
    """How argparse reads a field's value: a switch for a bool, else the annotation's type
    (``int`` for ``int | None``) unless the field names its own ``type`` converter."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
    if annotation is bool:
        if config_field.default is not False:
            raise TypeError(f"{config_field.name}: a switch must default to False")
        return {"action": "store_true"}
    if "type" in config_field.metadata:
        return {}
    if annotation not in (str, int, float):
        raise TypeError(f"{config_field.name}: give option() a type converter for {annotation}")
    return {"type": annotation}


def flag_fields() -> tuple[str, ...]:
    """The :class:`ServerConfig` fields parsed from flags (ours, and KServe's we hold)."""
    return tuple(f.name for f in fields(ServerConfig) if f.metadata)


def _spellings(name: str) -> list[str]:
    """``--foo_bar`` and ``--foo-bar`` for a flag name."""
    underscored, dashed = name.replace("-", "_"), name.replace("_", "-")
    return list(dict.fromkeys([f"--{underscored}", f"--{dashed}"]))


def _kserve_parser() -> argparse.ArgumentParser:
    """KServe's own parser, whose flags we take as they are. ``import kserve`` imports
    ``kserve.model_server``, which parses ``sys.argv`` into module globals when imported (and
    exits on a value it cannot read): the first import here is given an empty command line, so
    that parsing stays a pure function of the argv given to :func:`parse_args`. Our entry point
    (:mod:`.__main__`) parses before anything else imports KServe; a spawned child process, which
    gets the argv this parser accepted, has KServe parse that argv harmlessly."""
    saved = sys.argv
    if "kserve.model_server" not in sys.modules:
        sys.argv = sys.argv[:1]
    try:
        from kserve import model_server
    finally:
        sys.argv = saved
    return model_server.parser


def build_parser(environ: Mapping[str, str] = os.environ) -> argparse.ArgumentParser:
    """The full parser: KServe's flags plus ours, each in both spellings; ``environ`` holds
    the variables that KServe takes flag defaults from."""
    parser = argparse.ArgumentParser(
        prog="huggingfaceserver",
        description="Serve a Hugging Face model over KServe V1/V2 and OpenAI-compatible APIs.",
        parents=[_kserve_parser()],
        allow_abbrev=False,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    KServeFlags.add_cli_args(parser, environ)
    ServerConfig.add_cli_args(parser)
    return parser


def _known_options(parser: argparse.ArgumentParser, options: Iterable[str]) -> set[str]:
    """Those of ``options`` that ``parser`` takes. argparse has no public list of its option
    strings, but refuses (``ArgumentError``) to add one it already has: a copy is asked."""
    probe = argparse.ArgumentParser(parents=[parser], add_help=False)
    known = set()
    for option_string in set(options):
        if not option_string.strip("-"):
            continue  # "--", "---": not a flag argparse could add
        try:
            probe.add_argument(option_string)
        except argparse.ArgumentError:
            known.add(option_string)
    return known


def _normalise_spelling(argv: Sequence[str], parser: argparse.ArgumentParser) -> list[str]:
    """Rewrite KServe's own flags to the spelling its parser knows (``--event_loop``...)."""
    names = [t.partition("=")[0] for t in argv if t.startswith("--") and t != "--"]
    known = _known_options(parser, names + [s for name in names for s in _spellings(name[2:])])
    out = []
    for token in argv:
        if token.startswith("--") and token != "--":
            name, sep, value = token.partition("=")
            if name not in known:
                name = next((s for s in _spellings(name[2:]) if s in known), name)
            token = name + sep + value
        out.append(token)
    return out


def _group_flags(
    tokens: Sequence[str],
) -> tuple[dict[str, list[str]], dict[str, str], list[str]]:
    """Group ``--flag v1 v2`` runs into {dashed flag name: values}.

    Also returns each dashed name's spelling as typed, and the tokens that follow no flag.
    """
    flags: dict[str, list[str]] = {}
    typed: dict[str, str] = {}
    strays: list[str] = []
    current: str | None = None
    for token in tokens:
        if token.startswith("--") and len(token) > 2:
            name, sep, value = token.partition("=")
            current = name[2:].replace("_", "-")
            typed[current] = name
            flags[current] = [value] if sep else []
        elif current is not None:
            flags[current].append(token)
        else:
            strays.append(token)
    return flags, typed, strays


def openai_route_prefix(environ: Mapping[str, str]) -> str:
    """``$KSERVE_OPENAI_ROUTE_PREFIX`` (default ``/openai``; may be empty) as ``/prefix``."""
    value = environ.get(OPENAI_PREFIX_ENV, DEFAULT_OPENAI_PREFIX).strip().rstrip("/")
    return f"/{value.lstrip('/')}" if value else ""


def cache_dir(environ: Mapping[str, str] = os.environ) -> Path | None:
    """The server's cache directory: ``$HUGGINGFACESERVER_CACHE``, else
    ``$XDG_CACHE_HOME/huggingfaceserver``, else ``~/.cache/huggingfaceserver`` (``$HOME``, else
    the user's home directory); None where there is nowhere to keep it (no home directory, as
    for a container user without one and without ``HOME``)."""
    if environ.get(CACHE_ENV):
        return Path(environ[CACHE_ENV])
    if environ.get("XDG_CACHE_HOME"):
        return Path(environ["XDG_CACHE_HOME"]) / "huggingfaceserver"
    home = environ.get("HOME") or os.path.expanduser("~")
    if home.startswith("~"):
        return None
    return Path(home) / ".cache" / "huggingfaceserver"


def parse_args(
    argv: Sequence[str],
    engine_flag_names: frozenset[str] = KNOWN_VLLM_ENGINE_FLAGS,
    more_engine_flag_names: Callable[[], frozenset[str]] | None = None,
    environ: Mapping[str, str] = os.environ,
) -> ServerConfig:
    """Parse argv into a :class:`ServerConfig`, a pure function of ``argv`` and ``environ``
    (the environment variables the server reads, read here once); exits with status 2 on a
    flag nobody knows or a value a flag does not take (argparse's usage and error), and with
    status 1 and one line on flags that cannot go together (as for any startup error).

    ``engine_flag_names`` (dashed, without ``--``) are the vLLM engine flags: they are kept in
    :attr:`ServerConfig.engine_flags` for the backend to use or report as ignored. When a flag
    is in neither, ``more_engine_flag_names`` (the installed vLLM's own list) is asked.
    """
    parser = build_parser(environ)
    namespace, rest = parser.parse_known_args(_normalise_spelling(argv, parser))
    flags, typed, strays = _group_flags(rest)
    unknown = [typed[name] for name in flags if name not in engine_flag_names]
    if unknown and more_engine_flag_names is not None:
        more = more_engine_flag_names()
        unknown = [typed[name] for name in flags if name not in engine_flag_names | more]
    if unknown or strays:
        parser.error("unrecognized arguments: " + " ".join(unknown + strays))
    _check_switches(parser, flags, typed)
    _check_size(parser, flags, typed)
    values = vars(namespace)
    own = {name: values.pop(name) for name in flag_fields()}
    server = KServeFlags(**{f.name: values.pop(f.name) for f in fields(KServeFlags)})
    _check_values(parser, own)
    _check_combinations(parser, own, server)
    own["api_key"] = own["api_key"] or environ.get(API_KEY_ENV, "").strip() or None
    return ServerConfig(
        **own,
        server=server,
        engine_flags=flags,
        openai_route_prefix=openai_route_prefix(environ),
        cache_dir=cache_dir(environ),
    )


def _check_values(parser: argparse.ArgumentParser, own: dict[str, Any]) -> None:
    """Values out of a flag's range, and flags that need or exclude another one: argparse's
    error (usage, status 2)."""
    if own["max_length"] is not None and own["max_length"] <= 0:
        parser.error("--max_length must be a positive integer")
    for name in ("max_batch_tokens", "max_batch_size", "prefill_chunk_tokens"):
        if own[name] is not None and own[name] <= 0:
            parser.error(f"--{name} must be a positive integer")
    if own["batch_wait_ms"] < 0:
        parser.error("--batch_wait_ms must not be negative")
    for name in (
        "max_concurrent_requests",
        "max_request_bytes",
        "max_inputs_per_request",
        "max_concurrent_predictor_calls",
    ):
        if own[name] <= 0:
            parser.error(f"--{name} must be a positive integer")
    for name in (
        "request_timeout_seconds",
        "request_read_timeout_seconds",
        "shutdown_grace_seconds",
    ):
        value = own[name]
        if value is not None and not value > 0:  # NaN too
            parser.error(f"--{name} must be a positive number of seconds")
    if own["enable_auto_tool_choice"] and own["tool_call_parser"] is None:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser")
    if own["api_key"] is not None and not own["api_key"].strip():
        parser.error("--api_key must not be empty")
    if own["default_prompt"] is not None and own["default_prompt_name"] is not None:
        parser.error("give --default_prompt or --default_prompt_name, not both")


KV_CACHE_MEMORY_FLAG = "kv-cache-memory-bytes"
"""vLLM's engine flag for its KV cache's size; the transformers backend honours it too."""
ENGINE_SWITCHES = (("async-scheduling", "no-async-scheduling"),)
"""vLLM engine flags that take no value, each with its negation."""


def _check_switches(
    parser: argparse.ArgumentParser, flags: dict[str, list[str]], typed: dict[str, str]
) -> None:
    """An engine switch given a value, or given with its negation, is a usage error."""
    for switch in ENGINE_SWITCHES:
        for name in switch:
            if flags.get(name):
                parser.error(f"{typed[name]} takes no value (got {' '.join(flags[name])})")
        if all(name in flags for name in switch):
            parser.error(" and ".join(typed[name] for name in switch) + ": give one")


def _check_size(
    parser: argparse.ArgumentParser, flags: dict[str, list[str]], typed: dict[str, str]
) -> None:
    """``--kv-cache-memory-bytes`` takes one positive size (vLLM's parser checks it again
    where vLLM serves; the transformers backend reads it too)."""
    if KV_CACHE_MEMORY_FLAG not in flags:
        return
    values = flags[KV_CACHE_MEMORY_FLAG]
    name = typed[KV_CACHE_MEMORY_FLAG]
    if len(values) != 1:
        parser.error(f"{name} takes one size (2G, 2147483648), got {len(values)} values")
    try:
        size = parse_bytes(values[0])
    except ValueError as exc:
        parser.error(f"{name}: {exc}")
    if size <= 0:
        parser.error(f"{name} must be more than 0 bytes")


def _check_combinations(
    parser: argparse.ArgumentParser, own: dict[str, Any], server: KServeFlags
) -> None:
    """Flags that each parse but that the server cannot run together: status 1 and the
    one-line error of any startup problem, before anything is loaded. Those that depend on
    the model or the machine are checked where those are known: ``--quantize`` against the
    backend chosen (:func:`~.assembly.check_choice`), ``--api_workers`` against vLLM chosen by
    ``--backend auto`` and against transformer mode, which only encoders have
    (:func:`~.topology.layout.choose_layout`), ``--enable_model_repository`` against the
    fronts ``--api_workers auto`` starts on a CUDA device (:func:`~.server.serve`)."""
    if server.workers > 1:
        _refuse(
            parser,
            "--workers > 1 is not supported: one process holds the model; use --api_workers N "
            "for N front processes before one engine process",
        )
    several_fronts = own["api_workers"] is not None and own["api_workers"] > 1
    if several_fronts and own["backend"] == "vllm":
        _refuse(parser, VLLM_RUNS_ITS_OWN_ENGINE)
    if several_fronts and own["enable_model_repository"]:
        _refuse(parser, REPOSITORY_NEEDS_ONE_PROCESS)


def _refuse(parser: argparse.ArgumentParser, message: str) -> typing.NoReturn:
    """Exit 1 with ``huggingfaceserver: error: MESSAGE``, the line a startup error ends with."""
    parser.exit(1, f"{parser.prog}: error: {message}\n")
