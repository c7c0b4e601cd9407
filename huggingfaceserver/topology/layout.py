"""How many processes serve: one, or an engine process behind N front processes.

A pure function of the flags, the pod's limits and the model's size, so that it is tested
without any of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..cli import VLLM_RUNS_ITS_OWN_ENGINE
from ..errors import StartupError
from ..model_facts import weight_bytes
from ..pod import PodLimits, gib
from ..units import MiB

MAX_AUTO_API_WORKERS = 8
"""``--api_workers auto`` on a CUDA device: one front per two cores, at most this many."""

# The memory each process takes, for what fits in the pod's memory limit: estimates with headroom
# over what each process was measured to take (BENCHMARKS.md, "Process memory estimates").
FRONT_BYTES = 256 * MiB
"""One front process."""
SUPERVISOR_BYTES = 256 * MiB
"""The process started by the user, which watches the engine and the fronts (and the fork
server the fronts come from)."""
ENGINE_RUNTIME_BYTES = 1024 * MiB
"""The engine besides the model's weights: torch, the tokenizer, the batcher (a CUDA context
takes host memory besides)."""


def engine_bytes(model_dir: Path) -> int:
    """The memory the engine needs for the model in ``model_dir``: the weights it loads
    (:func:`.model_facts.weight_bytes`) and :data:`ENGINE_RUNTIME_BYTES`."""
    return weight_bytes(model_dir) + ENGINE_RUNTIME_BYTES


def memory_needed(fronts: int, engine: int) -> int:
    """The memory of a layout with ``fronts`` fronts (1: a single process)."""
    if fronts == 1:
        return engine
    return SUPERVISOR_BYTES + fronts * FRONT_BYTES + engine


@dataclass(frozen=True)
class Layout:
    api_workers: int
    """Front processes; 1: the whole server in one process, without IPC."""
    reason: str
    fits_memory: bool = True
    """False: the layout is estimated to need more than the pod's memory limit (the reason
    says how much)."""

    @property
    def split(self) -> bool:
        """Whether the model runs in an engine process of its own."""
        return self.api_workers > 1


def choose_layout(
    requested: int | None,
    backend: str,
    remote: bool,
    cuda: bool,
    pod: PodLimits,
    engine: int,
) -> Layout:
    """The layout for ``--api_workers`` (None: auto), the backend that serves the model
    (``huggingface`` or ``vllm``), transformer mode (``remote``), the machine, the pod's limits
    and the engine's estimated memory (``engine`` bytes, see :func:`engine_bytes`).

    ``backend`` is the one chosen for the model and ``remote`` holds for encoders only, so
    these checks need the model: parsing has refused ``--backend vllm`` with an explicit
    ``--api_workers`` N > 1 already."""
    several = requested is not None and requested > 1
    if backend == "vllm":
        if several:
            raise StartupError(VLLM_RUNS_ITS_OWN_ENGINE)
        return Layout(1, "vLLM runs its engine in a process of its own")
    if remote:
        if several:
            raise StartupError(
                "--api_workers > 1 is not supported with --predictor_host (the model runs on "
                "the predictor): use --api_workers 1"
            )
        return Layout(1, "transformer mode: the model runs on the predictor")
    limit = pod.memory_bytes
    if requested is not None:
        need = memory_needed(requested, engine)
        if limit is not None and need > limit:
            return Layout(
                requested,
                f"--api_workers; warning: {processes(requested)} need about {gib(need)}, "
                f"more than the memory limit of {gib(limit)} (pod: {pod.describe()}): the "
                "server may be killed for memory",
                fits_memory=False,
            )
        return Layout(requested, "--api_workers")
    if not cuda:
        return auto_layout(1, f"auto: no CUDA device (pod: {pod.describe()})", limit, engine)
    wanted = max(1, min(MAX_AUTO_API_WORKERS, pod.cores // 2))
    fronts = wanted
    while fronts > 1 and limit is not None and memory_needed(fronts, engine) > limit:
        fronts -= 1
    if fronts == wanted:
        return auto_layout(fronts, f"auto: a CUDA device (pod: {pod.describe()})", limit, engine)
    return auto_layout(
        fronts,
        f"auto: {processes(fronts)} rather than {wanted} fronts (memory limit "
        f"{gib(limit or 0)}: {wanted} fronts and the engine need about "
        f"{gib(memory_needed(wanted, engine))}; pod: {pod.describe()})",
        limit,
        engine,
    )


def processes(fronts: int) -> str:
    return "one process" if fronts == 1 else f"{fronts} fronts"


def auto_layout(fronts: int, reason: str, limit: int | None, engine: int) -> Layout:
    """``fronts`` as auto chose them; when even those do not fit, they stay (a smaller server
    cannot be had) and the reason says so."""
    need = memory_needed(fronts, engine)
    if limit is None or need <= limit:
        return Layout(fronts, reason)
    return Layout(
        fronts,
        f"{reason}; warning: even {processes(fronts)} needs about {gib(need)}, more than the "
        f"memory limit of {gib(limit)}: the server may be killed for memory",
        fits_memory=False,
    )
