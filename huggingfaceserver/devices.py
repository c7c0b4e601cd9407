"""Host values onto the model's device, written once for the encoder tasks and the decode loop.

torch is imported where it is used: the lean fronts import modules that name this one, and
never load torch (the process that runs the model does)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def to_device(
    values: torch.Tensor | Any, device: torch.device, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """A host tensor (or host values: a sequence, a NumPy array, as ``dtype``) on ``device``,
    without the host waiting: torch's plain copy to a CUDA device (``torch.tensor(values,
    device=...)`` included) comes from pageable memory and waits until the work queued there
    (the model's forward) has run; a copy from pinned memory with ``non_blocking`` is queued
    after it, and torch's caching host allocator keeps the pinned source until it is done.
    Elsewhere (a CPU), a plain ``to``. :class:`~huggingfaceserver.observability.syncs.SyncCounter`
    counts the waiting kind on any machine."""
    import torch

    tensor = values if isinstance(values, torch.Tensor) else torch.as_tensor(values, dtype=dtype)
    if device.type == "cuda" and tensor.numel():  # nothing to copy: no pinned block either
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
