"""Host values onto the device and device values back, without waiting where a GPU allows it:
the values are those given, and the waits are what :class:`SyncCounter` counts."""

from __future__ import annotations

import pytest
import torch

from huggingfaceserver.devices import HostCopy, to_device
from huggingfaceserver.observability.syncs import SyncCounter


def test_a_host_copy_reads_the_values_when_asked_for() -> None:
    """On a CPU the values are read when asked for (one read, counted): a tensor changed in
    between is read as it is then, as a GPU's queued work would have changed it first."""
    tensor = torch.tensor([1.0, 2.5, -3.0])
    with SyncCounter() as counter:
        copy = HostCopy(tensor)
        assert counter.total == 0
        tensor.add_(1)
        assert copy.values() == [2.0, 3.5, -2.0]
    assert counter.counts == {"tolist": 1}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_host_copy_from_a_gpu_waits_for_its_copy_alone() -> None:
    """The copy is queued after the work that makes the values (the host does not wait for
    it), into pinned memory; the values are read once it is in."""
    cuda = torch.device("cuda")
    values = to_device([3, 1, 2], cuda, torch.long) * 2
    with SyncCounter(cuda) as counter:
        copy = HostCopy(values)
        queued = counter.total
    assert copy.host.is_pinned() and copy.ready is not None
    assert copy.values() == [6, 2, 4]
    assert queued == 1  # the copy to the host: the step's one read, waited for in values()
