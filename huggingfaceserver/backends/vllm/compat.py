"""Everything that differs between vLLM releases, in one place.

The vLLM backend reaches vLLM only through its engine-level API (``AsyncEngineArgs``, the async
engine, ``SamplingParams``, ``PoolingParams``, ``LoRARequest``, the model registry); nothing
from ``vllm.entrypoints``. Where an import path or an attribute moved between releases, the
alternatives are tried here, newest first, so the rest of the backend reads one API.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

import vllm
from vllm import AsyncEngineArgs, ModelRegistry, PoolingParams
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

try:  # vLLM >= 0.11
    from vllm.v1.engine.async_llm import AsyncLLM as AsyncEngine
except ImportError:  # older releases
    from vllm.engine.async_llm_engine import AsyncLLMEngine as AsyncEngine  # type: ignore

try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except ImportError:  # before the utils split
    from vllm.utils import FlexibleArgumentParser  # type: ignore

try:
    from vllm.inputs import TokensPrompt
except ImportError:  # pragma: no cover - very old releases
    from vllm.inputs.data import TokensPrompt  # type: ignore

from vllm.lora.request import LoRARequest

try:  # vLLM's own error for a sampling parameter it refuses
    from vllm.exceptions import VLLMValidationError as ParamsError
except ImportError:  # older releases raise ValueError
    ParamsError = ValueError  # type: ignore[misc, assignment]

try:  # what a request gets once vLLM's engine core has died
    from vllm.v1.engine.exceptions import EngineDeadError
except ImportError:  # older releases: a class nothing raises

    class EngineDeadError(Exception):  # type: ignore[no-redef]
        pass


VERSION: str = vllm.__version__
DELTA = RequestOutputKind.DELTA

# `vllm serve` front-end flags that are not engine arguments: translated here.
FRONTEND_FLAGS = frozenset({"lora-modules", "speculative-model", "num-speculative-tokens"})

__all__ = [
    "DELTA",
    "VERSION",
    "AsyncEngine",
    "EngineDeadError",
    "FlexibleArgumentParser",
    "LoRARequest",
    "ParamsError",
    "StructuredOutputsParams",
    "TokensPrompt",
    "cpu_attention_backend",
    "embed_params",
    "engine_flag_names",
    "engine_parser",
    "flags_to_argv",
    "max_model_len",
    "pooling_runner_flags",
    "supported_architectures",
    "translate_speculative_flags",
]


def engine_parser() -> argparse.ArgumentParser:
    """vLLM's own parser of engine arguments (so new vLLM flags work without code changes)."""
    parser = FlexibleArgumentParser(add_help=False)
    AsyncEngineArgs.add_cli_args(parser)
    return parser


def engine_options() -> frozenset[str]:
    """Every long option of vLLM's engine parser (``--max-model-len``), as its usage line
    writes them: argparse lists its options publicly only there."""
    usage = engine_parser().format_usage()
    return frozenset(re.findall(r"(?<![\w-])--[A-Za-z0-9][\w-]*", usage))


def engine_flag_names() -> frozenset[str]:
    """Every engine flag of the installed vLLM, dashed, without ``--``; plus the front-end
    flags we translate."""
    names = {option[2:].replace("_", "-") for option in engine_options()}
    return frozenset(names | FRONTEND_FLAGS)


def cpu_attention_backend() -> Any:
    """The attention backend of vLLM's CPU build (its kernels take a fixed set of head sizes:
    ``supports_head_size``, ``get_supported_head_sizes``); None in a release where it moved.
    Imported when asked, on a CPU only: it brings in vLLM's model layers."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except ImportError:
        return None
    return CPUAttentionBackend


def supported_architectures() -> set[str]:
    return set(ModelRegistry.get_supported_archs())


def translate_speculative_flags(flags: dict[str, list[str]]) -> dict[str, list[str]]:
    """The older ``--speculative-model X --num-speculative-tokens N`` as ``--speculative-config``.

    An explicit ``--speculative-config`` wins; its JSON is completed with the older flags.
    """
    flags = dict(flags)
    model = flags.pop("speculative-model", None)
    tokens = flags.pop("num-speculative-tokens", None)
    if model is None and tokens is None:
        return flags
    config: dict[str, Any] = {}
    if "speculative-config" in flags:
        config = json.loads(" ".join(flags["speculative-config"]))
    if model:
        config.setdefault("model", model[0])
    if tokens:
        config.setdefault("num_speculative_tokens", int(tokens[0]))
    flags["speculative-config"] = [json.dumps(config)]
    return flags


def pooling_runner_flags() -> list[str]:
    """Engine flags that make vLLM run a model as an embedding (pooling) model."""
    return ["--runner", "pooling"] if "--runner" in engine_options() else ["--task", "embed"]


def embed_params() -> PoolingParams:
    """Pooling parameters for sentence embeddings (the model's own pooling and normalisation)."""
    try:
        return PoolingParams(task="embed")
    except TypeError:  # releases whose PoolingParams take no task
        return PoolingParams()


def max_model_len(engine: Any) -> int:
    """The engine's context length (the attribute moved between releases)."""
    for owner in (engine, getattr(engine, "vllm_config", None)):
        model_config = getattr(owner, "model_config", None)
        if model_config is not None:
            return int(model_config.max_model_len)
    raise RuntimeError("cannot find the vLLM engine's model config")


def flags_to_argv(flags: dict[str, list[str]]) -> list[str]:
    """``{"max-num-seqs": ["8"], "enforce-eager": []}`` -> ``--max-num-seqs 8 --enforce-eager``."""
    argv: list[str] = []
    for name, values in flags.items():
        argv.append(f"--{name}")
        argv.extend(values)
    return argv
