"""The vLLM tier: the vLLM backend on vLLM's CPU build, as a user starts the server.

Every module here is marked ``vllm`` and skips when vLLM is not installed; the ones that start
servers are also ``slow``. A vLLM engine start costs about 20 s on a CPU, so each module shares
one server per configuration. Nothing here imports vLLM.
"""

from __future__ import annotations

from pathlib import Path

# Small and quick on a CPU: no torch.compile, a 128-token context, 8 sequences at once.
VLLM_FLAGS = ["--enforce-eager", "--max-model-len", "128", "--max-num-seqs", "8"]


def vllm_env(root: Path, kv_cache_gib: int | None = None) -> dict[str, str]:
    """Environment for a vLLM server with ``root`` from ``tmp_path_factory.mktemp``: IPC sockets
    under ``root``; caches beside it, shared by the session's servers (vLLM caches what it
    learns of a model class there, in a subprocess that costs seconds per start); the KV cache
    sized by the server (the few MiB these tiny models can use), or ``kv_cache_gib`` as a user
    sets it with ``VLLM_CPU_KVCACHE_SPACE``."""
    rpc = root / "rpc"
    rpc.mkdir(parents=True, exist_ok=True)
    env = {
        "VLLM_CACHE_ROOT": str(root.parent / "vllm-cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(root.parent / "inductor-cache"),
        "VLLM_RPC_BASE_PATH": str(rpc),
    }
    if kv_cache_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
    return env
