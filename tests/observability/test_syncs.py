"""The host-synchronisation counter: every way of reading a tensor's values is seen, and with
an accelerator as the device, the host's own tensors are not."""

from __future__ import annotations

import torch

from huggingfaceserver.observability.syncs import SyncCounter


def test_the_sync_counter_sees_every_kind_of_read() -> None:
    t = torch.arange(6.0)
    with SyncCounter() as counter:
        t.tolist(), t[0].item(), bool(t[1]), int(t[2]), t.numpy(), t.nonzero(), t[t > 1]
    assert counter.counts == {
        "tolist": 1,
        "_local_scalar_dense": 3,
        "numpy": 1,
        "nonzero": 1,
        "index (boolean mask)": 1,
    }


def test_with_an_accelerator_only_its_tensors_count() -> None:
    t = torch.arange(6.0)
    with SyncCounter("cuda") as counter:
        t.tolist(), bool(t[1]), t.nonzero(), t.to("cpu")
    assert counter.total == 0
