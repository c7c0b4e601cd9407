"""The container images' recipes as tests read them: Dockerfile stages, their ARGs, ENV and RUN
commands, the build context `.dockerignore` leaves, and the Makefile's variables."""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import subprocess
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from string import Template

from dockerfile_parse import DockerfileParser

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = {"cpu": REPO / "Dockerfile", "gpu": REPO / "Dockerfile.gpu"}
BUILD_ARGS = {  # each Dockerfile's ARG -> the Makefile variable `make image(-gpu)` passes it
    "cpu": {
        "TORCH_SPEC": "TORCH_SPEC",
        "TORCH_INDEX": "IMAGE_TORCH_INDEX",
        "VLLM_VERSION": "VLLM_VERSION",
    },
    "gpu": {"VLLM_VERSION": "VLLM_GPU_VERSION", "RAY_VERSION": "RAY_VERSION"},
}


@dataclass
class Stage:
    """One build stage: its base, its name (``AS name``) and its instructions in order."""

    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def values(self, instruction: str) -> list[str]:
        return [value for kind, value in self.instructions if kind == instruction]

    @property
    def args(self) -> dict[str, str]:
        """``ARG NAME=default`` of this stage (an ARG without a default maps to "")."""
        return dict(_assignment(word) for value in self.values("ARG") for word in _words(value))

    @property
    def env(self) -> dict[str, str]:
        """``ENV`` of this stage as written (``$PATH`` left unexpanded)."""
        return dict(_assignment(word) for value in self.values("ENV") for word in _words(value))

    @property
    def user(self) -> str | None:
        users = self.values("USER")
        return users[-1] if users else None

    @property
    def entrypoint(self) -> list[str]:
        (entrypoint,) = self.values("ENTRYPOINT")
        return json.loads(entrypoint)

    def commands(self, args: dict[str, str] | None = None) -> list[list[str]]:
        """Every command of the stage's RUN lines, in order (see :func:`split_run`), with the
        ARGs ``args`` (else the defaults) substituted."""
        values = self.args | (args or {})
        return [command for run in self.values("RUN") for command in split_run(run, values)]


def split_run(script: str, args: dict[str, str]) -> list[list[str]]:
    """A RUN line's ``&&`` chain as argv lists, after ``args`` are substituted as the shell
    would (``${NAME}`` and ``$NAME``; other variables stay as written). Any other shell operator
    (``;``, ``|``, redirections) stays in its argv as a token."""
    lexer = shlex.shlex(Template(script).safe_substitute(args), posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token == "&&":
            commands.append([])
        else:
            commands[-1].append(token)
    return commands


def stages(dockerfile: Path) -> list[Stage]:
    """The stages of ``dockerfile``, in order (the last is the image)."""
    parsed: list[Stage] = []
    for item in DockerfileParser(
        fileobj=io.BytesIO(dockerfile.read_bytes()), env_replace=False
    ).structure:
        kind, value = item["instruction"], item["value"]
        if kind == "FROM":
            base, _, name = value.partition(" AS ")
            parsed.append(Stage(base.strip(), name.strip() or None))
        elif kind != "COMMENT":
            parsed[-1].instructions.append((kind, value))
    return parsed


def _words(value: str) -> list[str]:
    return shlex.split(value)


def _assignment(word: str) -> tuple[str, str]:
    name, _, value = word.partition("=")
    return name, value


# --- the Makefile ----------------------------------------------------------------------------


def make(*args: str) -> str:
    """``make ARGS`` in the repository as a user starts it: none of this process's make
    variables (``make test VLLM_VERSION=...`` passes them down in MAKEFLAGS) or environment."""
    env = {name: os.environ[name] for name in ("PATH", "HOME") if name in os.environ}
    done = subprocess.run(
        ["make", "--no-print-directory", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout


@cache
def make_var(name: str) -> str:
    """The Makefile's value of variable ``name`` (its ``print-%`` target)."""
    return make("-s", f"print-{name}").rstrip("\n")


def make_commands(*args: str) -> list[list[str]]:
    """The commands ``make -n ARGS`` would run, as argv lists."""
    return [shlex.split(line) for line in make("-n", *args).replace("\\\n", "").splitlines()]


# --- the build context -----------------------------------------------------------------------


def dockerignore_patterns() -> list[tuple[bool, re.Pattern[str]]]:
    """(``!``-negated, regex) per line of ``.dockerignore``, for the patterns it uses: ``*``
    and ``?`` within a path segment, ``**`` across them, a trailing ``/`` ignored."""
    patterns = []
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        glob = line.lstrip("!").strip("/")
        regex = "".join(
            ".*"
            if part == "**"
            else "[^/]*"
            if part == "*"
            else "[^/]"
            if part == "?"
            else re.escape(part)
            for part in re.split(r"(\*\*|\*|\?)", glob)
        )
        patterns.append((negated, re.compile(regex.replace(".*/", "(.*/)?"))))
    return patterns


def in_context(path: str) -> bool:
    """Whether the build context holds ``path`` (relative to the repository), as Docker
    decides: the last pattern that matches the path or one of its parent directories wins."""
    parts = Path(path).parts
    included = True
    for negated, pattern in dockerignore_patterns():
        for depth in range(1, len(parts) + 1):
            if pattern.fullmatch("/".join(parts[:depth])):
                included = negated
                break
    return included
