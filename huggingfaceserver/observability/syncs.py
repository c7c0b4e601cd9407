"""Counting the points where the host waits for the device: what a decode step costs a GPU in
round trips, counted on any machine.

On a GPU, reading a tensor's values into Python (``.item()``, ``int()``, ``bool()``,
``.tolist()``, ``.numpy()``), copying it to the host, and ops whose output size depends on the
values (``nonzero``, boolean indexing, ``masked_select``) make the host wait until the device
has caught up. :class:`SyncCounter` counts them while it is active, with torch's public
:class:`~torch.overrides.TorchFunctionMode` (the Python-level reads, which never reach the
dispatcher) and :class:`~torch.utils._python_dispatch.TorchDispatchMode` (the ops).

With ``device`` a CPU, every read of values counts, since the same code reads the device's
tensors on a GPU; with an accelerator, only reads and copies of tensors on it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

READS = frozenset({"tolist", "numpy", "__array__"})
"""Tensor methods that read every value into Python or NumPy (without the dispatcher)."""
TRANSFERS = frozenset({"cpu", "to", "copy_"})
"""Tensor methods that may copy to the host."""
aten = torch.ops.aten
VALUE_SIZED = frozenset({aten.nonzero.default, aten.masked_select.default, aten.unique_dim.default})
"""Ops whose output's size depends on the values: the host waits to learn it."""
INDEXING = frozenset({aten.index.Tensor, aten.index_put_.default, aten.index_put.default})
"""Indexing, which waits (through ``nonzero``) when an index is a boolean mask."""


class SyncCounter:
    """Counts host synchronisations on ``device`` while entered (``with counter: ...``); the
    counts by cause are in :attr:`counts`, their sum in :attr:`total`."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.counts: Counter[str] = Counter()
        self._modes: list[Any] = []

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def reset(self) -> None:
        self.counts.clear()

    def watched(self, tensor: Any) -> bool:
        """Whether reading ``tensor`` waits for the device."""
        if not isinstance(tensor, torch.Tensor):
            return False
        return self.device.type == "cpu" or tensor.device.type == self.device.type

    def __enter__(self) -> SyncCounter:
        self._modes = [_Reads(self), _Ops(self)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = []


def _to_host(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a ``to``/``cpu``/``copy_`` call copies a tensor onto the host."""
    name = getattr(func, "__name__", "")
    if name == "cpu":
        return True
    if name == "copy_":
        return len(args) > 1 and isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu"
    targets = [*args[1:], kwargs.get("device")]
    return any(
        (isinstance(t, str) and t.startswith("cpu"))
        or (isinstance(t, torch.device) and t.type == "cpu")
        for t in targets
    )


class _Reads(TorchFunctionMode):
    def __init__(self, counter: SyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        source = args[1] if name == "copy_" and len(args) > 1 else args[0] if args else None
        if name in READS and self.counter.watched(source):
            self.counter.counts[name] += 1
        elif (
            name in TRANSFERS
            and self.counter.device.type != "cpu"
            and self.counter.watched(source)
            and _to_host(func, args, kwargs)
        ):
            self.counter.counts[f"{name} to host"] += 1
        return func(*args, **kwargs)


class _Ops(TorchDispatchMode):
    def __init__(self, counter: SyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if args and self.counter.watched(args[0]):
            if func is aten._local_scalar_dense.default or func in VALUE_SIZED:
                self.counter.counts[func.overloadpacket.__name__] += 1
            elif func in INDEXING and _boolean_index(args):
                self.counter.counts[f"{func.overloadpacket.__name__} (boolean mask)"] += 1
        return func(*args, **kwargs)


def _boolean_index(args: tuple[Any, ...]) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ()
    )
