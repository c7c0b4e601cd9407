"""``--api_workers``: how many front processes serve, decided from the flags and the machine."""

from __future__ import annotations

import pytest

from huggingfaceserver.errors import StartupError
from huggingfaceserver.layout import MAX_AUTO_API_WORKERS, choose_layout


def layout(requested: int | None, backend="huggingface", remote=False, cuda=False, cores=2):
    return choose_layout(requested, backend, remote=remote, cuda=cuda, cores=cores)


@pytest.mark.parametrize("cores", [1, 2, 64])
def test_auto_is_one_process_without_cuda(cores):
    chosen = layout(None, cores=cores)
    assert (chosen.api_workers, chosen.split) == (1, False)
    assert "no CUDA" in chosen.reason


@pytest.mark.parametrize(
    ("cores", "fronts"),
    [(1, 1), (2, 1), (3, 1), (4, 2), (9, 4), (16, 8), (17, 8), (96, MAX_AUTO_API_WORKERS)],
)
def test_auto_on_cuda_is_one_front_per_two_cores_up_to_the_cap(cores, fronts):
    chosen = layout(None, cuda=True, cores=cores)
    assert chosen.api_workers == fronts
    assert chosen.split == (fronts > 1)
    assert f"{cores} cores" in chosen.reason


@pytest.mark.parametrize("cuda", [False, True])
@pytest.mark.parametrize("requested", [1, 2, 3, 12])
def test_an_explicit_count_is_kept(requested, cuda):
    chosen = layout(requested, cuda=cuda, cores=4)
    assert (chosen.api_workers, chosen.split) == (requested, requested > 1)


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
