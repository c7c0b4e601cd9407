"""vLLM's KV cache on a CPU, sized to the memory the server can have.

vLLM's CPU build reserves ``--gpu-memory-utilization`` (0.92) of its NUMA node's memory and
refuses to start when that much is not free, which on a busy node is most of the time. Unless the
user sized it (``VLLM_CPU_KVCACHE_SPACE``, ``--kv-cache-memory-bytes`` or
``--gpu-memory-utilization``), the server gives the engine an explicit KV cache instead: what is
available now (on the NUMA node vLLM binds to, and under the cgroup limit in a container), less
the weights and a headroom, and no more than every sequence at the full context can use.

Imports no vLLM, torch or transformers at module level: :func:`~..choose_backend` consults it
before vLLM is chosen.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ...model_facts import attention_shape
from ...pod import Memory, host_memory, human, meminfo, within_cgroup
from ...units import GiB

if TYPE_CHECKING:
    from ...cli import ServerConfig
    from ...loading import ModelSource

logger = logging.getLogger(__name__)

ENV = "VLLM_CPU_KVCACHE_SPACE"
USER_FLAGS = ("kv-cache-memory-bytes", "gpu-memory-utilization")
HINT = (
    "free memory, serve a shorter context (--max_model_len), or size the cache yourself "
    f"({ENV}=<GiB> or --kv-cache-memory-bytes)"
)

# vLLM's engine and worker processes and their warm-up (about 1.4 GiB on vLLM 0.28's CPU
# build), plus a tenth of what is free for requests in flight and the node's other tenants.
HEADROOM_BYTES = 2 * GiB
HEADROOM_SHARE = 0.1
BLOCK_TOKENS = 128  # vLLM's CPU block size
DEFAULT_MAX_NUM_SEQS = 128  # vLLM's default for its engine API
DEFAULT_CONTEXT = 2048  # vLLM's guess for a config that names no context length
DTYPE_BYTES = {"auto": 4, "float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}


@dataclass(frozen=True)
class ModelMemory:
    """What the engine needs: its weights, and KV cache by the token."""

    weights: int
    bytes_per_token: int
    context: int
    max_num_seqs: int


@dataclass(frozen=True)
class KvCachePlan:
    """The KV cache size in bytes (0: even one full-context sequence does not fit), and why."""

    size: int
    reason: str

    @property
    def fits(self) -> bool:
        return self.size > 0


def size_kv_cache(memory: Memory, model: ModelMemory) -> KvCachePlan:
    """The available memory less the weights and a headroom, in whole blocks, capped at what
    ``max_num_seqs`` sequences at the full context can use; 0 below one such sequence."""
    headroom = HEADROOM_BYTES + int(memory.available * HEADROOM_SHARE)
    budget = memory.available - model.weights - headroom
    block = model.bytes_per_token * BLOCK_TOKENS
    one = math.ceil(model.context / BLOCK_TOKENS) * block
    figures = (
        f"{human(memory.available)} available on {memory.where}, less {human(model.weights)} "
        f"of weights and {human(headroom)} of headroom"
    )
    if budget < one:
        return KvCachePlan(
            0,
            f"one {model.context}-token sequence needs {human(one)} of KV cache and "
            f"{human(max(budget, 0))} is left ({figures})",
        )
    size = min(budget // block * block, one * model.max_num_seqs)
    sequences = min(size // one, model.max_num_seqs)
    return KvCachePlan(
        size,
        f"KV cache {human(size)}, room for {sequences} of {model.max_num_seqs} sequences at "
        f"the full {model.context} tokens ({figures})",
    )


# --- the figures ----------------------------------------------------------------------------


def plan_kv_cache(
    source: ModelSource, config: ServerConfig, on_cpu: bool | None = None
) -> KvCachePlan | None:
    """Our KV cache size for vLLM, or None where vLLM's own sizing applies: the user sized it,
    vLLM runs on an accelerator (or is too old to take a size), or the model's config does not
    say its attention's shape. ``on_cpu``: whether vLLM runs on a CPU (None: ask vLLM)."""
    if os.environ.get(ENV) or any(flag in config.engine_flags for flag in USER_FLAGS):
        return None
    if not (vllm_sizes_on_cpu() if on_cpu is None else on_cpu):
        return None
    model = model_memory(source, config)
    if model is None:
        logger.warning("cannot tell the KV cache's size per token: vLLM sizes it")
        return None
    return size_kv_cache(read_memory(), model)


def vllm_sizes_on_cpu() -> bool:
    """Whether vLLM runs on a CPU and takes ``--kv-cache-memory-bytes`` (vLLM >= 0.11)."""
    from vllm.platforms import current_platform  # vLLM is installed and about to serve

    from .compat import engine_flag_names

    return bool(current_platform.is_cpu()) and USER_FLAGS[0] in engine_flag_names()


def model_memory(source: ModelSource, config: ServerConfig) -> ModelMemory | None:
    """The weights' size at the served dtype and the KV cache's bytes per token (keys and
    values of every layer), from the model's config and facts (:attr:`.ModelSource.facts`)."""
    shape = attention_shape(source.config.get_text_config())
    if shape is None:
        return None
    facts = source.facts
    dtype_bytes = DTYPE_BYTES.get(config.dtype, 4)
    stored = facts.dtype
    scale = dtype_bytes / DTYPE_BYTES[stored] if stored in DTYPE_BYTES else 1.0
    kv_dtype = (config.engine_flags.get("kv-cache-dtype") or ["auto"])[0]
    kv_bytes = 1 if kv_dtype.startswith("fp8") else DTYPE_BYTES.get(kv_dtype, dtype_bytes)
    return ModelMemory(
        weights=int(facts.weight_bytes * max(scale, 1.0)),
        bytes_per_token=shape.kv_bytes_per_token(kv_bytes),
        context=config.max_length or facts.context_length or DEFAULT_CONTEXT,
        max_num_seqs=flag_int(config, "max-num-seqs") or DEFAULT_MAX_NUM_SEQS,
    )


def flag_int(config: ServerConfig, name: str) -> int | None:
    """An engine flag's positive integer value (vLLM's parser reports a malformed one)."""
    values = config.engine_flags.get(name) or []
    try:
        return int(values[0]) if values and int(values[0]) > 0 else None
    except ValueError:
        return None


def read_memory(root: Path = Path("/")) -> Memory:
    """Memory available now where vLLM's CPU worker allocates (the NUMA node of the first CPU
    this process may run on, counted as vLLM counts it), within the cgroup's limit (as
    :func:`~huggingfaceserver.pod.cgroup_memory` reads it)."""
    return within_cgroup(node_memory(root) or host_memory(root), root)


def node_memory(root: Path) -> Memory | None:
    cpu = min(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    nodes = sorted((root / f"sys/devices/system/cpu/cpu{cpu}").glob("node[0-9]*"))
    node = nodes[0].name if nodes else "node0"
    path = root / "sys/devices/system/node" / node / "meminfo"
    if not path.is_file():
        return None
    info = meminfo(path)
    keys = ("MemFree", "Active(file)", "Inactive(file)", "SReclaimable")
    return Memory(sum(info.get(k, 0) for k in keys), f"NUMA node {node.removeprefix('node')}")
