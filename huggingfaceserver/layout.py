"""How many processes serve: one, or an engine process behind N front processes.

A pure function of the flags and the machine, so that it is tested without one.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import StartupError

MAX_AUTO_API_WORKERS = 8
"""``--api_workers auto`` on a CUDA device: one front per two cores, at most this many."""


@dataclass(frozen=True)
class Layout:
    api_workers: int
    """Front processes; 1: the whole server in one process, without IPC."""
    reason: str

    @property
    def split(self) -> bool:
        """Whether the model runs in an engine process of its own."""
        return self.api_workers > 1


def choose_layout(
    requested: int | None, backend: str, remote: bool, cuda: bool, cores: int
) -> Layout:
    """The layout for ``--api_workers`` (None: auto), the backend that serves the model
    (``huggingface`` or ``vllm``), transformer mode (``remote``) and the machine."""
    several = requested is not None and requested > 1
    if backend == "vllm":
        if several:
            raise StartupError(
                "--api_workers > 1 is not supported with the vLLM backend (vLLM already runs "
                "its engine in a process of its own): use --api_workers 1, or --backend "
                "huggingface"
            )
        return Layout(1, "vLLM runs its engine in a process of its own")
    if remote:
        if several:
            raise StartupError(
                "--api_workers > 1 is not supported with --predictor_host (the model runs on "
                "the predictor): use --api_workers 1"
            )
        return Layout(1, "transformer mode: the model runs on the predictor")
    if requested is not None:
        return Layout(requested, "--api_workers")
    if cuda:
        count = max(1, min(MAX_AUTO_API_WORKERS, cores // 2))
        return Layout(count, f"auto: a CUDA device and {cores} cores")
    return Layout(1, "auto: no CUDA device")
