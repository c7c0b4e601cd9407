"""The host-synchronisation counter: every way of reading a tensor's values is seen, and with
an accelerator as the device, the host's own tensors are not."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from huggingfaceserver.devices import to_device
from huggingfaceserver.observability.syncs import SyncCounter


def test_the_sync_counter_sees_every_kind_of_read() -> None:
    t = torch.arange(6.0)
    with SyncCounter() as counter:
        t.tolist(), t[0].item(), bool(t[1]), int(t[2]), t.numpy(), t.nonzero(), t[t > 1]
    assert counter.counts == {
        "tolist": 1,
        "item": 1,
        "__bool__": 1,
        "__int__": 1,
        "numpy": 1,
        "nonzero": 1,
        "index (boolean mask)": 1,
    }


def test_host_values_copied_onto_the_device_count_unless_staged() -> None:
    """``torch.tensor(values, device=...)`` copies from pageable memory (on a GPU: after every
    queued kernel); ``to_device`` stages them in pinned memory, and a tensor built on the host
    (no ``device``) is no copy."""
    with SyncCounter() as counter:
        torch.tensor([1, 2], device="cpu"), torch.as_tensor([1.0], device=torch.device("cpu"))
        torch.tensor([3]), to_device([4, 5], torch.device("cpu"), torch.long)
    assert counter.counts == {"tensor onto the device": 1, "as_tensor onto the device": 1}
    with SyncCounter("cuda") as counter:
        torch.tensor([1, 2], device="cpu")
    assert counter.total == 0  # onto the host: no wait


def test_indexing_with_host_values_counts() -> None:
    """A list, a NumPy array or (on an accelerator) a host tensor as an index is copied onto
    the indexed tensor's device first; slices, integers and the device's own tensors are not."""
    t = torch.zeros(4, 3)
    with SyncCounter() as counter:
        t[[0, 2]], t[np.array([1])], t[:, [0, 1]], t[(0, 2),]
        t[[0, 1]] = 1.0
        t[0], t[0, 1], t[:, 0], t[torch.tensor([0, 1])]
        t[0] = 2.0
        t[1:3] = torch.ones(3)
    assert counter.counts == {"__getitem__ with host values": 4, "__setitem__ with host values": 1}
    on_device = torch.zeros(4, 3, device="meta")  # an accelerator's tensors, without one
    with SyncCounter("meta") as counter:
        on_device[torch.tensor([0, 1])], on_device[torch.tensor(1)]
        on_device[torch.zeros(2, dtype=torch.long, device="meta")]
    assert counter.counts == {"__getitem__ with host values": 1}


def test_with_an_accelerator_only_its_tensors_count() -> None:
    t = torch.arange(6.0)
    with SyncCounter("cuda") as counter:
        t.tolist(), bool(t[1]), t.nonzero(), t.to("cpu")
    assert counter.total == 0


def test_scalar_reads_count_under_inference_mode_once() -> None:
    """The dispatcher shows no mode the scalar read behind ``bool`` under inference mode, and
    shows it besides the Python-level read otherwise: counted once either way."""
    for inference in (True, False):
        with torch.inference_mode(inference):
            t = torch.arange(3.0)
            with SyncCounter() as counter:
                bool(t[1]), t[2].item()
        assert counter.counts == {"__bool__": 1, "item": 1}, inference


def test_a_modules_own_waits_are_told_apart() -> None:
    class Reads(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2 if bool(x.sum() > 0) else x

    module, counter = Reads(), SyncCounter()
    with counter, counter.separating(module):
        module(torch.ones(2)).tolist()
    assert (counter.in_module, counter.outside_module) == (1, 1)


def test_the_hosts_own_tensors_do_not_count() -> None:
    """A batch collated on the host is read there whatever the device; what is computed from
    it is not the batch, and counts."""
    batch = torch.arange(6).reshape(2, 3)
    with SyncCounter(host=[batch]) as counter:
        batch.tolist(), batch.numpy()
    assert counter.total == 0
    with SyncCounter(host=[batch]) as counter:
        batch.sum(dim=1).tolist()
    assert counter.counts == {"tolist": 1}


def test_nonzero_as_a_tuple_counts_under_inference_mode() -> None:
    for inference in (True, False):
        with torch.inference_mode(inference):
            t = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
            with SyncCounter() as counter:
                t.nonzero(as_tuple=True)
        assert counter.total == 1, inference


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_host_values_reach_a_gpu_as_they_are() -> None:
    cuda = torch.device("cuda")
    with SyncCounter(cuda) as counter:
        index = to_device([3, 1, 2], cuda, torch.long)
        column = to_device(np.array([0.5, 2.0], dtype=np.float32), cuda, torch.float32)
        none = to_device([], cuda, torch.long)  # a batch whose rows all ended keeps none
    assert counter.total == 0 and none.shape == (0,) and none.device.type == "cuda"
    assert index.device.type == "cuda" and index.dtype == torch.long
    assert index.tolist() == [3, 1, 2] and column.tolist() == [0.5, 2.0]
