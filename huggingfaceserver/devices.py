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


class HostCopy:
    """A device tensor's values on their way to the host. On CUDA they are copied into pinned
    memory without waiting, the copy queued after the work that makes them, and :meth:`values`
    waits for that copy alone: what the host queues on the device in between (the next decode
    step) runs while it waits. Elsewhere (a CPU) the values are read when asked for."""

    def __init__(self, tensor: torch.Tensor):
        import torch

        self.ready: torch.cuda.Event | None = None
        self.host = tensor
        if tensor.device.type == "cuda":
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.host.copy_(tensor, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()

    def done(self) -> bool:
        """Whether the copy is in (always on a CPU): :meth:`values` would not wait."""
        return self.ready is None or bool(self.ready.query())

    def values(self) -> list[Any]:
        """The values as Python numbers (``tolist``), once the copy is in."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()
