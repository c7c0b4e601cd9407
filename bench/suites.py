"""Every workload the command line can select, by device: how to run it, and whether it can.

A workload's outcome gives its own targets and its own report section (:class:`Outcome`); the
classic encoder and generation workloads of :mod:`bench.workloads` are wrapped to fit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from .workloads import WORKLOADS, Settings, Workload

if TYPE_CHECKING:  # each of these imports torch: only once a workload runs
    from .gpu_models import GpuModels
    from .health import HealthProber
    from .models import BenchModels
    from .runner import WorkloadResult
    from .targets import Target


class Outcome(Protocol):
    """What a workload measured."""

    def targets(self) -> list[Target]: ...

    def section(self) -> list[str]: ...


@dataclass
class Context:
    """What every workload may need: models, settings, folders, options."""

    settings: Settings
    cache: Path
    baseline_ref: str
    rehearsal: bool = False
    """The GPU workloads on this machine's CPU, on models a few thousandths the size."""

    @property
    def log_dir(self) -> Path:
        return self.cache / "logs"

    @property
    def gpu_device(self) -> str:
        """Where the GPU workloads run: the GPU, or the CPU for a rehearsal."""
        return "cpu" if self.rehearsal else "cuda"

    @cached_property
    def models(self) -> BenchModels:
        from .models import build_models

        return build_models(self.cache)

    @cached_property
    def gpu_models(self) -> GpuModels:
        from .gpu_models import REAL, REHEARSAL, GpuModels

        return GpuModels(self.cache, REHEARSAL if self.rehearsal else REAL)

    @cached_property
    def prober(self) -> HealthProber:
        """The health prober of the classic workloads (a process; closed by :meth:`close`)."""
        from .health import HealthProber

        return HealthProber()

    def close(self) -> None:
        if "prober" in self.__dict__:
            self.prober.close()


@dataclass(frozen=True)
class Suite:
    """A selectable workload: its key, the device it runs on, and how to run it."""

    key: str
    device: str
    run: Callable[[Context], Outcome]
    unavailable: Callable[[Context], str | None] = lambda _: None
    """Why it cannot run on this machine (it is then skipped with that note), None if it can."""
    classic: bool = False
    """One of :data:`bench.workloads.WORKLOADS` (the report's header describes their method)."""


@dataclass
class ClassicOutcome:
    """A :class:`bench.runner.WorkloadResult` as an :class:`Outcome`."""

    result: WorkloadResult

    def targets(self) -> list[Target]:
        from .targets import evaluate

        return evaluate([self.result])

    def section(self) -> list[str]:
        from .report import workload_section

        return workload_section(self.result)


class Measured(Protocol):
    def targets(self) -> list[Target]: ...


M = TypeVar("M", bound=Measured)


@dataclass
class Reported(Generic[M]):
    """A workload's result with the function that writes its report section, where that
    function lives in a report module of its own (which imports the result's module, never the
    other way round)."""

    result: M
    write: Callable[[M], list[str]]

    def targets(self) -> list[Target]:
        return self.result.targets()

    def section(self) -> list[str]:
        return self.write(self.result)


def _classic(workload: Workload) -> Suite:
    def run(context: Context) -> Outcome:
        from .runner import measure_workload

        result = measure_workload(
            workload, context.models, context.settings, context.prober, context.log_dir
        )
        return ClassicOutcome(result)

    return Suite(workload.key, "cpu", run, classic=True)


def _overhead(context: Context) -> Outcome:
    from . import overhead, overhead_report

    model_dir = context.models.overhead
    result = overhead.measure(
        model_dir, context.settings, context.cache, context.log_dir, context.baseline_ref
    )
    return Reported(result, overhead_report.section)


def _cold_start(context: Context) -> Outcome:
    from . import cold_start

    return cold_start.measure(
        context.settings, context.cache, context.log_dir, context.baseline_ref
    )


def _vllm(context: Context) -> Outcome:
    from . import vllm_tier

    model_dir = context.models.llama
    return vllm_tier.measure(model_dir, context.settings, context.cache, context.log_dir)


def _structured(context: Context) -> Outcome:
    from . import structured

    return structured.measure(context.models.llama, context.settings, context.log_dir)


def _lora(context: Context) -> Outcome:
    from . import lora

    return lora.measure(context.models.llama, context.settings, context.cache, context.log_dir)


def _torch_compile(context: Context) -> Outcome:
    from . import torch_compile

    return torch_compile.measure(context.models.llama, context.settings, context.log_dir)


def _vllm_unavailable(_: Context) -> str | None:
    from .vllm_tier import unavailable

    return unavailable()


def _peers(context: Context) -> Outcome:
    from . import peers

    model_dir = context.models.minilm
    return peers.measure(model_dir, context.settings, context.cache, context.log_dir)


def _peers_unavailable(_: Context) -> str | None:
    from .peers import unavailable

    return unavailable()


def _runtimes(context: Context) -> Outcome:
    from . import runtimes

    return runtimes.measure(context.models, context.settings, context.cache)


def _variants(context: Context) -> Outcome:
    from . import variants

    return variants.measure(context.models.minilm, context.settings, context.log_dir)


def _long_output(context: Context) -> Outcome:
    from . import long_output, long_output_report

    result = long_output.measure(context.models.long_llama, context.settings, context.log_dir)
    return Reported(result, long_output_report.section)


def _kv_budget(context: Context) -> Outcome:
    from . import kv_budget

    return kv_budget.measure(context.models.long_llama, context.settings, context.log_dir)


def _host_cost(context: Context) -> Outcome:
    from . import host_cost

    return host_cost.measure(context.models, context.settings, context.log_dir)


def _resilience(context: Context) -> Outcome:
    from . import resilience

    return resilience.measure(context.models.classifier, context.settings, context.log_dir)


def _soak(context: Context) -> Outcome:
    from . import soak

    return soak.measure(context.models, context.settings, context.log_dir)


def _gpu_encoder(context: Context) -> Outcome:
    from .gpu import measure_encoder
    from .gpu_report import encoder_section

    result = measure_encoder(
        context.gpu_models, context.settings, context.log_dir, context.gpu_device
    )
    return Reported(result, encoder_section)


def _gpu_generation(context: Context) -> Outcome:
    from .gpu import measure_generation
    from .gpu_report import generation_section

    result = measure_generation(
        context.gpu_models, context.settings, context.log_dir, context.gpu_device
    )
    return Reported(result, generation_section)


def _gpu_lora(context: Context) -> Outcome:
    from . import lora
    from .gpu import GENERATION_MODEL
    from .gpu_models import REHEARSAL
    from .gpu_report import rehearsal_note

    return lora.measure(
        context.gpu_models.tinyllama,
        context.settings,
        context.cache,
        context.log_dir,
        model=GENERATION_MODEL + rehearsal_note(context.gpu_device, REHEARSAL.llama),
    )


def _no_cuda(context: Context) -> str | None:
    import torch

    if context.rehearsal or torch.cuda.is_available():
        return None
    return "no CUDA device here (--rehearse runs it on this CPU)"


SUITES = (
    *(_classic(workload) for workload in WORKLOADS),
    Suite("overhead", "cpu", _overhead),
    Suite("coldstart", "cpu", _cold_start),
    Suite("vllm", "cpu", _vllm, _vllm_unavailable),
    Suite("structured", "cpu", _structured),
    Suite("lora", "cpu", _lora),
    Suite("torch_compile", "cpu", _torch_compile),
    Suite("peers", "cpu", _peers, _peers_unavailable),
    Suite("runtimes", "cpu", _runtimes),
    Suite("variants", "cpu", _variants),
    Suite("long_output", "cpu", _long_output),
    Suite("kv_budget", "cpu", _kv_budget),
    Suite("host_cost", "cpu", _host_cost),
    Suite("resilience", "cpu", _resilience),
    Suite("soak", "cpu", _soak),
    Suite("encoder", "cuda", _gpu_encoder, _no_cuda),
    Suite("generation", "cuda", _gpu_generation, _no_cuda),
    Suite("lora", "cuda", _gpu_lora, _no_cuda),
)


def for_device(device: str) -> list[Suite]:
    """The workloads of ``device`` (``cpu`` or ``cuda``), in their usual order."""
    return [suite for suite in SUITES if suite.device == device]
