"""Every Python version pyproject.toml claims is tested: the whole suite on this interpreter
(``make test``), a smoke on each other one (``make smoke-versions``, ``SMOKE_PYTHONS``), and
both in CI's ``.ci/run``; the linters target the lowest claimed version."""

from __future__ import annotations

import argparse
import importlib.util
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

from tests.deploy.images import make_commands, make_var

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def claimed_minors() -> list[int]:
    """The 3.x minors of ``requires-python``, which reads ``>=3.A,<3.B``."""
    spec = PYPROJECT["project"]["requires-python"].replace(" ", "")
    low = re.fullmatch(r".*>=3\.(\d+).*", spec)
    high = re.fullmatch(r".*<3\.(\d+).*", spec)
    assert low and high, f"requires-python {spec!r} is not >=3.A,<3.B"
    return list(range(int(low[1]), int(high[1])))


def interpreter_minor(path: str) -> int:
    """The 3.x minor of an interpreter: asked of it, else read from its path (versions/3.12.1/)."""
    if Path(path).is_file():
        out = subprocess.run(
            [path, "-c", "import sys; print(sys.version_info[1])"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return int(out.stdout)
    found = re.search(r"(?:versions/|python)3\.(\d+)", path)
    assert found, f"SMOKE_PYTHONS names {path}, which is not there and names no version"
    return int(found[1])


def test_every_claimed_version_runs_the_suite_or_the_smoke() -> None:
    smoked = [interpreter_minor(path) for path in make_var("SMOKE_PYTHONS").split()]
    suite = sys.version_info[1]  # make test runs the suite on the interpreter running this
    assert sorted([suite, *smoked]) == claimed_minors(), (
        f"claimed 3.{claimed_minors()}, suite on 3.{suite}, smoke on 3.{smoked}: "
        "SMOKE_PYTHONS must name one interpreter per other claimed version"
    )


def test_the_linters_target_the_lowest_claimed_version() -> None:
    lowest = claimed_minors()[0]
    assert PYPROJECT["tool"]["ruff"]["target-version"] == f"py3{lowest}"
    assert PYPROJECT["tool"]["mypy"]["python_version"] == f"3.{lowest}"


def test_the_readme_claims_the_same_versions() -> None:
    minors = claimed_minors()
    assert f"Python 3.{minors[0]}–3.{minors[-1]}" in (REPO / "README.md").read_text()


def test_ci_runs_the_suite_then_the_smoke() -> None:
    commands = [
        shlex.split(line)
        for line in (REPO / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert ["make", "test"] in commands and ["make", "smoke-versions"] in commands, commands
    assert commands.index(["make", "test"]) < commands.index(["make", "smoke-versions"])


def test_the_smoke_takes_the_makefile_interpreters_and_torch() -> None:
    (argv,) = make_commands("smoke-versions")
    assert argv[1] == ".ci/version_smoke.py", argv
    options = dict(zip(argv[2::2], argv[3::2], strict=True))
    assert options["--pythons"] == make_var("SMOKE_PYTHONS")
    assert options["--torch-spec"] == make_var("TORCH_SPEC")
    assert options["--torch-index"] == make_var("TORCH_INDEX")


def python_roots() -> set[str]:
    """The repository's top-level folders and files that hold tracked Python."""
    tracked = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    return {path.split("/")[0] for path in tracked}


def test_the_linters_cover_every_python_root() -> None:
    """ruff checks and format-checks every tracked Python file; mypy all but the tests."""

    def tool(argv: list[str]) -> str:
        name = Path(argv[0]).name
        return f"{name} {argv[1]}" if name == "ruff" else name

    tools = {tool(a): a for a in make_commands("lint") if Path(a[0]).name in ("ruff", "mypy")}
    assert set(tools) == {"ruff check", "ruff format", "mypy"}, tools
    for tool, argv in tools.items():
        covered = {arg.split("/")[0] for arg in argv[1:] if not arg.startswith("-")}
        wanted = python_roots() - ({"tests"} if tool == "mypy" else set())
        assert wanted <= covered, f"make lint's {tool} misses {sorted(wanted - covered)}"


def load_smoke() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "version_smoke", REPO / ".ci" / "version_smoke.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def smoke_args(**overrides: object) -> argparse.Namespace:
    defaults = {"torch_spec": "torch==2.13.0", "torch_index": "", "reuse": False, "keep": False}
    return argparse.Namespace(**{**defaults, **overrides})


def test_the_smoke_stops_before_installing_where_the_disk_is_short(tmp_path: Path) -> None:
    smoke_module = load_smoke()
    free_gib = shutil.disk_usage(tmp_path).free / smoke_module.GiB
    smoke = smoke_module.Smoke(sys.executable, smoke_args(min_free_gib=free_gib + 1000))
    with pytest.raises(smoke_module.SmokeError, match=r"GiB free under .* takes up to"):
        smoke.install(tmp_path / "venv", tmp_path / "src")
    assert not (tmp_path / "venv").exists()


def test_the_smoke_installs_without_pips_cache(tmp_path: Path) -> None:
    """Each version's CUDA torch (3 GB of wheels) would stay in pip's cache after its
    environment is removed: every install the smoke runs keeps out of it."""
    smoke_module = load_smoke()
    smoke = smoke_module.Smoke(sys.executable, smoke_args(min_free_gib=0.0))
    commands: list[list[str]] = []

    def record(cmd: list[str], cwd: Path = REPO, label: str = "") -> str:
        commands.append(cmd)
        if cmd[1:3] == ["-m", "venv"]:
            Path(cmd[3]).mkdir()
        return ""

    smoke.run = record
    smoke.install(tmp_path / "venv", tmp_path / "src")
    installs = [cmd for cmd in commands if cmd[1:4] == ["-m", "pip", "install"]]
    assert len(installs) == 4, commands
    assert all("--no-cache-dir" in cmd for cmd in installs), installs
