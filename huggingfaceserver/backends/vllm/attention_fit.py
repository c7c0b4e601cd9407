"""Whether vLLM's attention on this machine takes the model's heads.

vLLM's CPU build has attention kernels for a fixed set of head sizes (32, 64, 80, ... in 0.28).
It starts its engine on a model with any other, then its engine core dies at the first forward
(``Unsupported CPU attention configuration: head_dim=16``), some 20 seconds in. The backend
choice asks first (:func:`attention_refusal`), from the model's config and vLLM's own list, so
that ``--backend auto`` serves such a model on transformers and ``--backend vllm`` says why it
cannot, before anything starts. Other platforms' attention takes the sizes models have.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...model_facts import head_size
from . import compat

if TYPE_CHECKING:
    from ...loading import ModelSource


def attention_refusal(source: ModelSource, on_cpu: bool | None = None) -> str | None:
    """Why vLLM's attention here cannot run the model (None: it can, or the config does not
    say its head size). ``on_cpu``: whether vLLM runs on a CPU (None: ask vLLM)."""
    if on_cpu is None:
        from vllm.platforms import current_platform

        on_cpu = bool(current_platform.is_cpu())
    if not on_cpu:
        return None
    backend = compat.cpu_attention_backend()
    if backend is None:
        return None
    size = head_size(source.config.get_text_config())
    if size is None or backend.supports_head_size(size):
        return None
    sizes = ", ".join(map(str, backend.get_supported_head_sizes()))
    model = ", ".join(source.architectures) or "the model"
    return f"vLLM's CPU attention does not take {model}'s head size {size} (only {sizes})"
