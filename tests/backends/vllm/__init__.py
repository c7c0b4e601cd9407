"""The vLLM tier: the vLLM backend on vLLM's CPU build, as a user starts the server.

Every module here is marked ``vllm`` and skips when vLLM is not installed; the ones that start
servers are also ``slow``. A vLLM engine start costs about 20 s on a CPU, so each module shares
one server per configuration. Nothing here imports vLLM.
"""

from __future__ import annotations

from pathlib import Path

# Small and quick on a CPU: no torch.compile, a 128-token context, 8 sequences at once.
VLLM_FLAGS = ["--enforce-eager", "--max-model-len", "128", "--max-num-seqs", "8"]


def vllm_env(root: Path) -> dict[str, str]:
    """Environment for a vLLM server: a 1 GiB KV cache, caches and IPC sockets under ``root``."""
    rpc = root / "rpc"
    rpc.mkdir(parents=True, exist_ok=True)
    return {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CACHE_ROOT": str(root / "vllm-cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor-cache"),
        "VLLM_RPC_BASE_PATH": str(rpc),
    }
