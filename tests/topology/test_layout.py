"""``--api_workers``: how many front processes serve, decided from the flags, the pod's limits
and the model's size."""

from __future__ import annotations

from pathlib import Path

import pytest

from huggingfaceserver.errors import StartupError
from huggingfaceserver.pod import GiB, PodLimits
from huggingfaceserver.topology.layout import (
    ENGINE_RUNTIME_BYTES,
    FRONT_BYTES,
    MAX_AUTO_API_WORKERS,
    choose_layout,
    engine_bytes,
    memory_needed,
)

ENGINE = 2 * GiB


def layout(
    requested: int | None,
    backend="huggingface",
    remote=False,
    cuda=False,
    cores=2,
    memory: int | None = None,
    engine: int = ENGINE,
):
    pod = PodLimits(cores, memory, "CPU affinity", "cgroup v2" if memory else "")
    return choose_layout(requested, backend, remote=remote, cuda=cuda, pod=pod, engine=engine)


@pytest.mark.parametrize("cores", [1, 2, 64])
def test_auto_is_one_process_without_cuda(cores):
    chosen = layout(None, cores=cores)
    assert (chosen.api_workers, chosen.split, chosen.fits_memory) == (1, False, True)
    assert "no CUDA" in chosen.reason
    assert f"pod: {cores} core" in chosen.reason


@pytest.mark.parametrize(
    ("cores", "fronts"),
    [(1, 1), (2, 1), (3, 1), (4, 2), (9, 4), (16, 8), (17, 8), (96, MAX_AUTO_API_WORKERS)],
)
def test_auto_on_cuda_is_one_front_per_two_cores_up_to_the_cap(cores, fronts):
    chosen = layout(None, cuda=True, cores=cores)
    assert chosen.api_workers == fronts
    assert chosen.split == (fronts > 1)
    assert f"{cores} core" in chosen.reason


def test_auto_counts_the_cores_the_pod_allows_not_the_node():
    """A 64-core node, a pod limited to one core: one process, not eight fronts."""
    pod = PodLimits(1, 2 * GiB, "cgroup v1 cpu quota (1.0 CPUs)", "cgroup v1")
    chosen = choose_layout(None, "huggingface", remote=False, cuda=True, pod=pod, engine=GiB)
    assert (chosen.api_workers, chosen.split) == (1, False)
    assert "1 core from cgroup v1 cpu quota" in chosen.reason


def test_auto_starts_fewer_fronts_when_eight_do_not_fit_in_memory():
    """16 cores ask for 8 fronts; memory for the engine and 3 of them (not 4) gives 3."""
    limit = memory_needed(3, ENGINE) + FRONT_BYTES // 2
    assert memory_needed(8, ENGINE) > limit
    chosen = layout(None, cuda=True, cores=16, memory=limit)
    assert (chosen.api_workers, chosen.fits_memory) == (3, True)
    assert chosen.reason.startswith("auto: 3 fronts rather than 8 fronts (memory limit")
    assert f"memory limit {limit / GiB:.1f} GiB" in chosen.reason


def test_auto_with_room_for_every_front_keeps_them_all():
    chosen = layout(None, cuda=True, cores=16, memory=memory_needed(8, ENGINE))
    assert (chosen.api_workers, chosen.fits_memory) == (8, True)
    assert "rather than" not in chosen.reason


def test_auto_without_room_for_two_fronts_is_one_process():
    chosen = layout(None, cuda=True, cores=16, memory=memory_needed(2, ENGINE) - 1)
    assert (chosen.api_workers, chosen.split, chosen.fits_memory) == (1, False, True)
    assert "one process rather than 8 fronts" in chosen.reason


@pytest.mark.parametrize("cuda", [False, True])
def test_auto_starts_anyway_when_even_one_process_does_not_fit(cuda):
    """Refusing to start helps no one: one process, and a reason that warns."""
    chosen = layout(None, cuda=cuda, cores=16, memory=ENGINE // 2)
    assert (chosen.api_workers, chosen.fits_memory) == (1, False)
    assert "warning: even one process needs about 2.0 GiB" in chosen.reason
    assert "memory limit of 1.0 GiB" in chosen.reason


@pytest.mark.parametrize("cuda", [False, True])
@pytest.mark.parametrize("requested", [1, 2, 3, 12])
def test_an_explicit_count_is_kept(requested, cuda):
    chosen = layout(requested, cuda=cuda, cores=4)
    assert (chosen.api_workers, chosen.split, chosen.fits_memory) == (
        requested,
        requested > 1,
        True,
    )


@pytest.mark.parametrize("requested", [1, 8])
def test_an_explicit_count_that_does_not_fit_is_kept_with_a_warning(requested):
    limit = memory_needed(requested, ENGINE) - 1
    chosen = layout(requested, cuda=True, cores=1, memory=limit)
    assert (chosen.api_workers, chosen.fits_memory) == (requested, False)
    assert chosen.reason.startswith("--api_workers; warning:")
    assert f"more than the memory limit of {limit / GiB:.1f} GiB" in chosen.reason
    fitting = layout(requested, cuda=True, cores=1, memory=limit + 1)
    assert (fitting.api_workers, fitting.fits_memory) == (requested, True)


@pytest.mark.parametrize(
    ("options", "flag"),
    [({"backend": "vllm"}, "vLLM"), ({"remote": True}, "--predictor_host")],
    ids=["vllm", "remote"],
)
@pytest.mark.parametrize("cuda", [False, True])
def test_vllm_and_transformer_mode_keep_one_front(options, flag, cuda):
    for requested in (None, 1):
        chosen = layout(requested, cuda=cuda, cores=32, **options)
        assert (chosen.api_workers, chosen.split) == (1, False)
    with pytest.raises(StartupError, match="--api_workers") as error:
        layout(2, cuda=cuda, cores=32, **options)
    assert flag in str(error.value)


def test_engine_bytes_are_the_weights_and_the_runtime(tmp_path: Path):
    assert engine_bytes(tmp_path) == ENGINE_RUNTIME_BYTES
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0" * 700)
    assert engine_bytes(tmp_path) == 700 + ENGINE_RUNTIME_BYTES
    # the same weights as safetensors too: transformers loads those, not both
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 300)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"\0" * 200)
    (tmp_path / "config.json").write_text("{}")
    assert engine_bytes(tmp_path) == 500 + ENGINE_RUNTIME_BYTES


def test_engine_bytes_count_pytorch_pickles_of_any_suffix(tmp_path: Path):
    """The weight size is model_facts.weight_bytes, as vLLM sizing counts it: .pt and .pth
    besides .bin (the layout knew .bin only)."""
    (tmp_path / "model.pt").write_bytes(b"\0" * 400)
    assert engine_bytes(tmp_path) == 400 + ENGINE_RUNTIME_BYTES
