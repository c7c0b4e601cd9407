"""Our flags and the pass-through vLLM flags, as vLLM's ``AsyncEngineArgs``."""

from __future__ import annotations

import logging

import torch
from vllm import AsyncEngineArgs

from ...cli import ServerConfig
from ...errors import StartupError
from ...loading import ModelSource, served_dtype
from .compat import (
    VERSION,
    engine_flag_names,
    engine_parser,
    flags_to_argv,
    pooling_runner_flags,
    translate_speculative_flags,
)

logger = logging.getLogger(__name__)

# vLLM flags that would replace what we tell the engine (and leave our tokenizer behind).
RESERVED_FLAGS = frozenset({"model", "tokenizer", "served-model-name"})

DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


STRUCTURED_OUTPUTS_FLAG = "structured-outputs-config"
STRUCTURED_OUTPUTS_DEFAULT = '{"backend": "guidance", "disable_any_whitespace": true}'
"""Structured output as the transformers backend does it: llguidance, compact JSON (a user's
``--structured-outputs-config``, after ours, wins)."""


def engine_argv(
    source: ModelSource, config: ServerConfig, kv_cache_bytes: int | None = None
) -> list[str]:
    """The argv vLLM's parser reads: our settings first, the user's engine flags after them
    (so an explicit vLLM flag such as ``--dtype`` or ``--tensor-parallel-size`` wins).
    ``kv_cache_bytes``: the KV cache as :mod:`.cache_sizing` sized it."""
    dtype = served_dtype(config, source, torch.cuda.is_available())
    argv = [
        "--model", str(source.path),
        "--tokenizer", str(source.tokenizer_path),
        "--served-model-name", config.model_name,
        "--dtype", DTYPE_NAMES[dtype],
    ]  # fmt: skip
    if config.max_length is not None:
        argv += ["--max-model-len", str(config.max_length)]
    if config.trust_remote_code:
        argv.append("--trust-remote-code")
    if config.enforce_eager:  # one flag, one meaning on both backends: no CUDA graphs
        argv.append("--enforce-eager")
    if config.reasoning_parser is not None:  # the engine starts a grammar after the reasoning
        argv += ["--reasoning-parser", config.reasoning_parser]
    if kv_cache_bytes is not None:
        argv += ["--kv-cache-memory-bytes", str(kv_cache_bytes)]
    if not source.task.is_generative:
        argv += pooling_runner_flags()
    flags = translate_speculative_flags(config.engine_flags)
    known = engine_flag_names()
    if source.task.is_generative and STRUCTURED_OUTPUTS_FLAG in known:
        argv += [f"--{STRUCTURED_OUTPUTS_FLAG}", STRUCTURED_OUTPUTS_DEFAULT]
    flags.pop("lora-modules", None)
    reserved = sorted(f"--{name}" for name in flags if name in RESERVED_FLAGS)
    if reserved:
        raise StartupError(
            f"{' '.join(reserved)}: the model comes from --model_id / --model_dir and its name "
            "from --model_name"
        )
    ignored = sorted(f"--{name}" for name in flags if name not in known)
    if ignored:
        logger.warning("not engine flags of vLLM %s, ignored: %s", VERSION, " ".join(ignored))
    return argv + flags_to_argv({k: v for k, v in flags.items() if k in known})


def build_engine_args(
    source: ModelSource, config: ServerConfig, kv_cache_bytes: int | None = None
) -> AsyncEngineArgs:
    """Parsed by vLLM's own parser: its defaults, its validation, its error messages (exit 2)."""
    namespace = engine_parser().parse_args(engine_argv(source, config, kv_cache_bytes))
    return AsyncEngineArgs.from_cli_args(namespace)
