"""Counting the points where the host waits for the device: what a decode step costs a GPU in
round trips, counted on any machine.

On a GPU, reading a tensor's values into Python (``.item()``, ``int()``, ``bool()``,
``.tolist()``, ``.numpy()``), copying it to the host, ops whose output size depends on the
values (``nonzero``, boolean indexing, ``masked_select``), and copying host values onto the
device from pageable memory (``torch.tensor(values, device=...)``, and indexing a device's
tensor with host values, ``t[[0, 2]]`` or ``t[rows] = 0`` with ``rows`` a list, a NumPy array
or a host tensor: torch copies the index onto the device first) make the host wait until the
device has caught up. :class:`SyncCounter` counts them while it is active, with torch's public
:class:`~torch.overrides.TorchFunctionMode` (the Python-level reads: ``tolist`` never reaches
the dispatcher, and under ``torch.inference_mode`` neither does the scalar read behind
``item`` or ``bool``) and :class:`~torch.utils._python_dispatch.TorchDispatchMode` (the ops,
and scalar reads made inside other ops).

With ``device`` a CPU, every read of values counts, since the same code reads the device's
tensors on a GPU; with an accelerator, only reads and copies of tensors on it. Tensors that stay
on the host whatever the device (``host``: a batch's inputs as the tokenizer made them) never
count: reading them waits for nothing on a GPU either.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

READS = frozenset({"tolist", "numpy", "__array__"})
"""Tensor methods that read every value into Python or NumPy (without the dispatcher)."""
SCALAR_READS = frozenset({"item", "__bool__", "__int__", "__float__", "__index__"})
"""Tensor methods that read one value into Python (through ``_local_scalar_dense``, which the
dispatcher does not show a mode under ``torch.inference_mode``: they are counted here)."""
TRANSFERS = frozenset({"cpu", "to", "copy_"})
"""Tensor methods that may copy to the host."""
FACTORIES = frozenset({"tensor", "as_tensor"})
"""Factories that copy host values onto a device when given one (``device=``): from pageable
memory, which on a GPU waits for every kernel already queued
(:func:`~huggingfaceserver.devices.to_device` copies without waiting)."""
INDEX_METHODS = frozenset({"__getitem__", "__setitem__"})
"""Indexing from Python, whose index may be host values that torch copies onto the indexed
tensor's device from pageable memory."""
aten = torch.ops.aten
VALUE_SIZED = frozenset(
    {
        aten.nonzero.default,
        aten.nonzero_numpy.default,
        aten.masked_select.default,
        aten.unique_dim.default,
    }
)
"""Ops whose output's size depends on the values: the host waits to learn it
(``nonzero(as_tuple=True)`` reaches the dispatcher as ``nonzero_numpy`` under inference mode,
as ``nonzero`` otherwise)."""
INDEXING = frozenset({aten.index.Tensor, aten.index_put_.default, aten.index_put.default})
"""Indexing, which waits (through ``nonzero``) when an index is a boolean mask."""


class SyncCounter:
    """Counts host synchronisations on ``device`` while entered (``with counter: ...``); the
    counts by cause are in :attr:`counts`, their sum in :attr:`total`."""

    def __init__(self, device: torch.device | str = "cpu", host: Iterable[torch.Tensor] = ()):
        self.device = torch.device(device)
        self.host = list(host)
        """Tensors kept on the host: their reads are not counted (the tensors themselves, not
        what is computed from them)."""
        self._host_ids = {id(tensor) for tensor in self.host}
        self.counts: Counter[str] = Counter()
        self._modes: list[Any] = []
        self.reading = False
        """Inside a Python-level read, whose ``_local_scalar_dense`` is not counted again."""
        self.in_module = 0
        """Of :attr:`total`, the counts made inside a module's forward (:meth:`separating`)."""

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def outside_module(self) -> int:
        """The counts made outside the module's forward (:meth:`separating`)."""
        return self.total - self.in_module

    def reset(self) -> None:
        self.counts.clear()
        self.in_module = 0

    @contextmanager
    def separating(self, module: torch.nn.Module) -> Iterator[None]:
        """While in the block, the counts made inside ``module``'s forward calls are also
        added to :attr:`in_module`: a model's own waits, apart from the code around it."""
        started: list[int] = []

        def before(*_: Any) -> None:
            started.append(self.total)

        def after(*_: Any) -> None:
            self.in_module += self.total - started.pop()

        handles = [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def watched(self, tensor: Any) -> bool:
        """Whether reading ``tensor`` waits for the device."""
        if not isinstance(tensor, torch.Tensor) or id(tensor) in self._host_ids:
            return False
        return self.device.type == "cpu" or tensor.device.type == self.device.type

    def onto(self, device: Any, data: Any) -> bool:
        """Whether a factory given ``device`` copies host ``data`` onto the watched device
        (with a CPU watched, any ``device=`` given: the same call copies onto a GPU there)."""
        if device is None or isinstance(data, torch.Tensor):
            return False
        return torch.device(device).type == self.device.type

    def host_values(self, value: Any) -> bool:
        """Whether an index is host values that indexing a watched tensor copies onto the
        device: a list, a NumPy array, a host tensor of one dimension or more (with a CPU watched,
        none: the same tensor is on the device there); a tuple is one index per dimension."""
        if isinstance(value, tuple):
            return any(isinstance(v, tuple) or self.host_values(v) for v in value)
        if isinstance(value, list | np.ndarray):
            return True
        return (
            isinstance(value, torch.Tensor)
            and self.device.type != "cpu"
            and value.device.type == "cpu"
            and value.dim() > 0
        )

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
        if name in SCALAR_READS and self.counter.watched(source):
            self.counter.counts[name] += 1
            self.counter.reading = True
            try:
                return func(*args, **kwargs)
            finally:
                self.counter.reading = False
        if name in READS and self.counter.watched(source):
            self.counter.counts[name] += 1
        elif name in FACTORIES and self.counter.onto(kwargs.get("device"), source):
            self.counter.counts[f"{name} onto the device"] += 1
        elif (
            name in INDEX_METHODS
            and self.counter.watched(source)
            and len(args) > 1
            and self.counter.host_values(args[1])
        ):
            self.counter.counts[f"{name} with host values"] += 1
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
            scalar = func is aten._local_scalar_dense.default and not self.counter.reading
            if scalar or func in VALUE_SIZED:
                self.counter.counts[func.overloadpacket.__name__] += 1
            elif func in INDEXING and _boolean_index(args):
                self.counter.counts[f"{func.overloadpacket.__name__} (boolean mask)"] += 1
        return func(*args, **kwargs)


def _boolean_index(args: tuple[Any, ...]) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ()
    )
