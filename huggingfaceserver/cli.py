"""The command line: a pure function from argv to a typed :class:`ServerConfig`.

Nothing here reads a model, a file or the environment. KServe's ModelServer flags come from
``kserve.model_server.parser`` (a parent parser) and keep working unchanged. Both ``--foo_bar``
and ``--foo-bar`` spellings are accepted for every flag.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import StartupError
from .protocols.openai.tool_parsers import TOOL_PARSERS
from .tasks import Task

DTYPES = ("auto", "float16", "float32", "bfloat16", "float", "half")
BACKENDS = ("auto", "huggingface", "onnx", "openvino", "vllm")
QUANTIZATIONS = ("int8",)
LOG_FORMATS = ("text", "json")
MiB = 1024 * 1024
DEFAULT_MAX_BATCH_SIZE = 16
"""Rows per batch without ``--max_batch_size``, on torch (encoders and generation)."""

# `vllm serve` engine flags recognised even when vLLM is not installed, so that a manifest
# written for the vLLM image still starts on the transformers backend (with a warning).
# With vLLM installed the full list comes from vLLM's own AsyncEngineArgs.
KNOWN_VLLM_ENGINE_FLAGS = frozenset(
    """
    async-scheduling block-size calculate-kv-scales chat-template-content-format code-revision
    compilation-config config-format cpu-offload-gb data-parallel-size disable-custom-all-reduce
    disable-log-stats disable-sliding-window distributed-executor-backend download-dir
    enable-chunked-prefill enable-expert-parallel enable-lora
    enable-prefix-caching enable-prompt-embeds enforce-eager fully-sharded-loras
    generation-config gpu-memory-utilization guided-decoding-backend hf-config-path hf-overrides
    kv-cache-dtype kv-transfer-config limit-mm-per-prompt load-format logits-processor-pattern
    lora-dtype lora-extra-vocab-size lora-modules max-cpu-loras max-logprobs max-lora-rank
    max-loras max-num-batched-tokens max-num-partial-prefills max-num-seqs
    max-parallel-loading-workers
    max-seq-len-to-capture model-impl no-enable-chunked-prefill no-enable-prefix-caching
    num-gpu-blocks-override num-lookahead-slots num-scheduler-steps num-speculative-tokens
    override-generation-config override-neuron-config pipeline-parallel-size preemption-mode
    prefix-caching-hash-algo quantization reasoning-parser rope-scaling rope-theta scheduling-policy
    seed served-model-name skip-tokenizer-init speculative-config speculative-model swap-space
    tensor-parallel-size tokenizer tokenizer-mode tokenizer-pool-size
    use-v2-block-manager worker-cls
    """.split()
)


@dataclass(frozen=True)
class ServerConfig:
    """Every setting of the server, with its default, in one place."""

    model_name: str = "model"
    """Name on the endpoint paths and the OpenAI ``model`` field."""
    model_dir: str = "/mnt/models"
    """Local model folder (where KServe's storage initializer puts it)."""
    model_id: str | None = None
    """Hugging Face Hub id (or a local folder); wins over ``model_dir``."""
    model_revision: str | None = None
    """Hub revision for weights and config."""
    tokenizer_revision: str | None = None
    """Hub revision for the tokenizer."""
    dtype: str = "auto"
    """auto | float16 | float32 | bfloat16 | float | half."""
    task: Task | None = None
    """The task; inferred from the model's config when not given."""
    backend: str = "auto"
    """auto | huggingface | onnx | openvino | vllm: ``huggingface`` is transformers on torch,
    ``onnx`` and ``openvino`` the model's ONNX export on ONNX Runtime or OpenVINO (encoders)."""
    quantize: str | None = None
    """``int8``: the ONNX backend runs a dynamically quantised export (faster, less exact)."""
    max_length: int | None = None
    """Maximum sequence length: tokenizer truncation for encoders, context for generation."""
    disable_lower_case: bool = False
    """Do not lower-case in the tokenizer."""
    disable_special_tokens: bool = False
    """Encode without special tokens."""
    trust_remote_code: bool = False
    """Allow custom model and tokenizer code."""
    tensor_input_names: tuple[str, ...] | None = None
    """Tokenizer outputs sent to a remote predictor (transformer mode)."""
    return_token_type_ids: bool = False
    """Include token type ids in the model inputs."""
    return_probabilities: bool = False
    """Softmax probabilities for classification and fill-mask."""
    return_raw_logits: bool = False
    """Raw logits for classification and fill-mask."""
    return_offsets_mapping: bool = False
    """Token classification: add character offsets."""
    return_labels: bool = False
    """Classification: the model's id2label names instead of class indices."""
    max_batch_tokens: int = 16384
    """Encoder tasks: padded tokens per forward pass."""
    max_batch_size: int | None = None
    """Sequences per forward pass: encoder batches, and the rows the transformers generation
    backend decodes together (1 turns batching off). None: the backend's own (torch: 16; an
    encoder on its ONNX export: 8, where padding a batch costs more than batching gains)."""
    batch_wait_ms: float = 2.0
    """Encoder tasks: how long a request waits for others to share its forward pass."""
    chat_template: str | None = None
    """A chat template (Jinja text, or the path of a file holding one) for chat requests."""
    disable_log_requests: bool = False
    """Do not log requests."""
    api_workers: int | None = None
    """Front processes (HTTP, gRPC, tokenization, rendering) in front of one engine process
    that owns the model; None (``auto``): one per two cores on a CUDA device (at most 8),
    else one: the whole server in one process, with no IPC (see :mod:`.layout`)."""
    max_log_len: int = 512
    """Characters of a request's inputs its log line shows, then their whole length (0: none;
    the log line only, never the data). 512 identifies a request and keeps the line under 1 KiB,
    one record for any log collector, whatever the body's size."""
    log_format: str = "text"
    """text | json: one JSON object per log line, for log collectors."""
    enable_model_repository: bool = False
    """Serve KServe's model repository routes (REST and gRPC load/unload/index); off, since this
    server serves the one model it loaded at start and an unload would take it down."""
    max_concurrent_requests: int = 128
    """Requests in flight plus queued, for the whole server; beyond it an immediate 429 with
    ``Retry-After``. Bounds memory under any offered load."""
    max_request_bytes: int = 16 * MiB
    """Largest request body; beyond it a 413 before the body is parsed."""
    max_inputs_per_request: int = 1024
    """Texts (V1 instances, V2 elements, embedding inputs, rerank documents, prompts) per
    request; beyond it a 400 naming the limit."""
    no_truncation: bool = False
    """Encoders: refuse an input longer than the model's maximum (400 with both lengths)
    instead of truncating it."""
    trust_request_chat_template: bool = False
    """Accept ``chat_template`` in chat requests (vLLM's flag); refused (400) otherwise. Request
    templates render in a sandbox, off the event loop, with time and output limits."""
    enable_auto_tool_choice: bool = False
    """Chat with ``tools`` and ``tool_choice: auto``: the model's output is parsed into
    ``tool_calls`` by ``tool_call_parser`` (vLLM's flags, on both backends)."""
    tool_call_parser: str | None = None
    """How the model writes tool calls: ``hermes``, ``llama3_json``, ``mistral``."""
    request_timeout_seconds: float | None = None
    """A request still running after this long gets a 504 and its work is freed (off: None)."""
    max_concurrent_predictor_calls: int = 16
    """Transformer mode (``--predictor_host``): predictor calls in flight at once; each ends
    by ``--predictor_request_timeout_seconds`` (504 past it)."""
    request_read_timeout_seconds: float = 30.0
    """How long a client may take to send a request's body; past it a 408 and the connection
    is closed. A request takes its admission slot only once its body is in, so clients that
    stall mid-upload hold no slot meanwhile."""
    shutdown_grace_seconds: float = 25.0
    """On SIGTERM, how long requests in flight (streams included) may take to finish."""
    api_key: str | None = None
    """Bearer token every model route then needs (401 otherwise); health and metrics stay
    open. The server also reads it from ``HUGGINGFACESERVER_API_KEY``."""
    allowed_origins: tuple[str, ...] = ()
    """Origins allowed by CORS (``*`` for any); empty: no CORS headers."""
    server: dict[str, Any] = field(default_factory=dict)
    """KServe ModelServer flags (http_port, grpc_port, workers, predictor_host, ...)."""
    engine_flags: dict[str, list[str]] = field(default_factory=dict)
    """vLLM engine flags, dashed name -> values: passed to vLLM, ignored by transformers."""

    @property
    def encode_lower_case(self) -> bool | None:
        """``do_lower_case`` for the tokenizer: False when disabled, else the tokenizer's own."""
        return False if self.disable_lower_case else None


_OWN_FIELDS = {
    name for name in ServerConfig.__dataclass_fields__ if name not in ("server", "engine_flags")
}


def _spellings(name: str) -> list[str]:
    """``--foo_bar`` and ``--foo-bar`` for a flag name."""
    underscored, dashed = name.replace("-", "_"), name.replace("_", "-")
    return list(dict.fromkeys([f"--{underscored}", f"--{dashed}"]))


def _kserve_parser() -> argparse.ArgumentParser:
    from ._kserve import model_server

    return model_server.parser


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
    return tuple(i.strip() for i in text.split(",") if i.strip())


def _task(value: str) -> Task:
    try:
        return Task.parse(value)
    except StartupError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    """The full parser: KServe's flags plus ours, each in both spellings."""
    parent = _kserve_parser()
    parser = argparse.ArgumentParser(
        prog="huggingfaceserver",
        description="Serve a Hugging Face model over KServe V1/V2 and OpenAI-compatible APIs.",
        parents=[parent],
        allow_abbrev=False,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.set_defaults(model_name="model")

    def add(name: str, **kwargs: Any) -> None:
        parser.add_argument(*_spellings(name), dest=name, **kwargs)

    def add_flag(name: str, help: str) -> None:
        add(name, action="store_true", default=False, help=help)

    add("model_dir", default="/mnt/models", help="local folder of the model")
    add("model_id", default=None, help="Hugging Face Hub id; wins over --model_dir")
    add("model_revision", default=None, help="Hub revision for weights and config")
    add("tokenizer_revision", default=None, help="Hub revision for the tokenizer")
    add("dtype", default="auto", choices=DTYPES, help="weights dtype (auto: fp16 GPU, fp32 CPU)")
    add("task", default=None, type=_task, help=f"one of {', '.join(t.value for t in Task)}")
    add("backend", default="auto", choices=BACKENDS, help="inference backend")
    add(
        "quantize",
        default=None,
        choices=QUANTIZATIONS,
        help="onnx backend: dynamic int8 quantisation of the export",
    )
    parser.add_argument(
        *_spellings("max_length"),
        *_spellings("max_model_len"),
        dest="max_length",
        type=int,
        default=None,
        help="maximum sequence length (encoder truncation, generation context)",
    )
    add_flag("disable_lower_case", "do not lower-case in the tokenizer")
    add_flag("disable_special_tokens", "encode without special tokens")
    add_flag("trust_remote_code", "allow custom model/tokenizer code")
    add("tensor_input_names", default=None, help="comma list of tokenizer outputs to send")
    add_flag("return_token_type_ids", "include token type ids")
    scores = parser.add_mutually_exclusive_group()
    scores.add_argument(
        *_spellings("return_probabilities"),
        dest="return_probabilities",
        action="store_true",
        default=False,
        help="softmax probabilities for classification and fill-mask",
    )
    scores.add_argument(
        *_spellings("return_raw_logits"),
        dest="return_raw_logits",
        action="store_true",
        default=False,
        help="raw logits for classification and fill-mask",
    )
    add_flag("return_offsets_mapping", "token classification: add character offsets")
    add_flag("return_labels", "classification: id2label names instead of class indices")
    add("max_batch_tokens", type=int, default=16384, help="encoders: padded tokens per forward")
    add(
        "max_batch_size",
        type=int,
        default=None,
        help="sequences per forward (1: off; default: 16, or 8 on an ONNX export)",
    )
    add("batch_wait_ms", type=float, default=2.0, help="encoders: wait to fill a batch (ms)")
    add("chat_template", default=None, help="chat template: Jinja text or a file path")
    add_flag("disable_log_requests", "do not log requests")
    add(
        "api_workers",
        default=None,
        type=_api_workers,
        metavar="auto|N",
        help="front processes before one engine process (auto: by device; 1: in-process)",
    )
    add("max_log_len", type=int, default=512, help="characters of the inputs logged (0: none)")
    add("log_format", default="text", choices=LOG_FORMATS, help="log lines as text or JSON")
    add_flag("enable_model_repository", "serve the model repository load/unload routes")
    add(
        "max_concurrent_requests",
        type=int,
        default=128,
        help="requests in flight plus queued; beyond it 429",
    )
    add("max_request_bytes", type=int, default=16 * MiB, help="largest body; beyond it 413")
    add("max_inputs_per_request", type=int, default=1024, help="texts or prompts per request")
    add_flag("no_truncation", "encoders: refuse over-long inputs (400) instead of truncating")
    add_flag("trust_request_chat_template", "accept chat_template in chat requests")
    add_flag("enable_auto_tool_choice", "parse tool calls out of chat output (tool_choice auto)")
    add(
        "tool_call_parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="the model's tool call format (tool_choice auto)",
    )
    add(
        "request_timeout_seconds",
        type=float,
        default=None,
        help="504 for a request still running after this long (default: no limit)",
    )
    add(
        "max_concurrent_predictor_calls",
        type=int,
        default=16,
        help="transformer mode: predictor calls in flight at once",
    )
    add(
        "request_read_timeout_seconds",
        type=float,
        default=30.0,
        help="408 for a request whose body is not in after this long",
    )
    add("shutdown_grace_seconds", type=float, default=25.0, help="SIGTERM: time to drain")
    add("api_key", default=None, help="bearer token for model routes (or env var)")
    add("allowed_origins", type=_origins, default=(), help="CORS origins, comma list or JSON")
    return parser


def _normalise_spelling(argv: Sequence[str], parser: argparse.ArgumentParser) -> list[str]:
    """Rewrite KServe's own flags to the spelling its parser knows (``--event_loop``...)."""
    known = set(parser._option_string_actions)  # noqa: SLF001 - argparse has no public view
    out = []
    for token in argv:
        if token.startswith("--") and token != "--":
            name, sep, value = token.partition("=")
            if name not in known:
                for alternative in _spellings(name[2:]):
                    if alternative in known:
                        name = alternative
                        break
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


def parse_args(
    argv: Sequence[str],
    engine_flag_names: frozenset[str] = KNOWN_VLLM_ENGINE_FLAGS,
    more_engine_flag_names: Callable[[], frozenset[str]] | None = None,
) -> ServerConfig:
    """Parse argv into a :class:`ServerConfig`; exits with status 2 on a flag nobody knows.

    ``engine_flag_names`` (dashed, without ``--``) are the vLLM engine flags: they are kept in
    :attr:`ServerConfig.engine_flags` for the backend to use or report as ignored. When a flag
    is in neither, ``more_engine_flag_names`` (the installed vLLM's own list) is asked.
    """
    parser = build_parser()
    namespace, rest = parser.parse_known_args(_normalise_spelling(argv, parser))
    flags, typed, strays = _group_flags(rest)
    unknown = [typed[name] for name in flags if name not in engine_flag_names]
    if unknown and more_engine_flag_names is not None:
        more = more_engine_flag_names()
        unknown = [typed[name] for name in flags if name not in engine_flag_names | more]
    if unknown or strays:
        parser.error("unrecognized arguments: " + " ".join(unknown + strays))
    values = vars(namespace)
    own = {name: values.pop(name) for name in _OWN_FIELDS}
    if own["tensor_input_names"]:
        own["tensor_input_names"] = tuple(
            n.strip() for n in own["tensor_input_names"].split(",") if n.strip()
        )
    if own["max_length"] is not None and own["max_length"] <= 0:
        parser.error("--max_length must be a positive integer")
    for name in ("max_batch_tokens", "max_batch_size"):
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
    return ServerConfig(**own, server=values, engine_flags=flags)
