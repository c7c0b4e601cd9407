"""A Dockerfile's stages replayed on this machine, without a container engine: each stage's
file system is a directory, its COPY and pip steps run there, and the steps only a container
build can take (system packages, users, ownership, clean-up) are recognised and skipped."""

from __future__ import annotations

import glob
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.deploy.images import REPO, Stage, in_context, split_run

CONTAINER_ONLY = {
    "apt-get": "system packages: the host has its own",
    "useradd": "the image's user",
    "chown": "the image's user",
    "mkdir": "the image's directories (HF_HOME and HUGGINGFACESERVER_CACHE are the test's own)",
    "rm": "clean-up of apt's lists and the copied wheel",
}
"""The commands a replay skips, and why: what they do only matters inside a container."""
CLEANED_UP = ("/var/lib/apt/lists/", "/tmp/")
"""What an ``rm`` may remove for the replay to skip it (any other would change the install)."""

INSTRUCTIONS = {"ARG", "ENV", "WORKDIR", "COPY", "RUN", "USER", "EXPOSE", "ENTRYPOINT"}


@dataclass
class StageReplay:
    """One stage replayed under ``root``, the directory that stands for its ``/``."""

    stage: Stage
    root: Path
    args: dict[str, str]
    builders: dict[str, StageReplay] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    skipped: list[list[str]] = field(default_factory=list)
    timings: list[tuple[str, float]] = field(default_factory=list)

    def host(self, path: str) -> Path:
        """Where the stage's absolute ``path`` lives on this machine."""
        return self.root / path.lstrip("/")

    def run(self) -> StageReplay:
        for instruction, value in self.stage.instructions:
            assert instruction in INSTRUCTIONS, f"the replay does not know {instruction}"
            if instruction == "ENV":
                self.env |= dict(w.partition("=")[::2] for w in shlex.split(value))
            elif instruction == "WORKDIR":
                self.workdir = value
                self.host(value).mkdir(parents=True, exist_ok=True)
            elif instruction == "COPY":
                self.copy(shlex.split(value))
            elif instruction == "RUN":
                values = {name: self.args.get(name, v) for name, v in self.stage.args.items()}
                for command in split_run(value, values):
                    self.execute(command)
        return self

    def copy(self, words: list[str]) -> None:
        """COPY from the build context (what .dockerignore leaves of the repository) or, with
        ``--from=STAGE``, from a stage replayed before."""
        options = [w for w in words if w.startswith("--")]
        *sources, destination = [w for w in words if not w.startswith("--")]
        target = self.host(str(Path(self.workdir) / destination))
        for source in sources:
            if options:
                (option,) = options
                builder = self.builders[option.removeprefix("--from=")]
                shutil.copytree(builder.host(source), target, dirs_exist_ok=True)
                continue
            path = REPO / source
            assert in_context(source), f"the build context lacks {source}"
            if path.is_file():
                target.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target / path.name if destination.endswith("/") else target)
            else:
                for file in path.rglob("*"):
                    relative = file.relative_to(REPO)
                    if file.is_file() and in_context(str(relative)):
                        copied = target / file.relative_to(path)
                        copied.parent.mkdir(parents=True, exist_ok=True)
                        shutil.copy2(file, copied)

    def path_dirs(self) -> list[str]:
        """The stage's PATH with its own directories moved here, then this machine's."""
        own = self.env.get("PATH", "$PATH").split(":")
        return [str(self.host(d)) for d in own if d.startswith("/")] + [os.environ["PATH"]]

    def container_env(self) -> dict[str, str]:
        """This process's environment with the stage's ENV on top, its paths moved here: what
        a container of the stage would run with. LD_PRELOAD stays only where this machine has
        the library (the apt-get step that installs it in the image is skipped here)."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        for name, value in self.env.items():
            if name == "PATH":
                env[name] = os.pathsep.join(self.path_dirs())
            elif name in ("HF_HOME", "HUGGINGFACESERVER_CACHE"):
                env[name] = str(self.host(value))
                self.host(value).mkdir(parents=True, exist_ok=True)
            elif name != "LD_PRELOAD" or Path(value).exists():
                env[name] = value
        return env

    def executable(self, name: str) -> list[str]:
        """``name`` as the stage's PATH finds it; this Python where the stage has none yet."""
        found = shutil.which(name, path=os.pathsep.join(self.path_dirs()[:-1]))
        if found:
            return [found]
        fallback = {"python": [sys.executable], "pip": [sys.executable, "-m", "pip"]}
        assert name in fallback, f"the replay cannot run {name}"
        return fallback[name]

    def execute(self, command: list[str]) -> None:
        if command[0] in CONTAINER_ONLY:
            if command[0] == "rm":
                paths = [word for word in command[1:] if not word.startswith("-")]
                assert all(p.startswith(CLEANED_UP) for p in paths), f"cannot skip {command}"
            self.skipped.append(command)
            return
        assert command[0] in ("python", "pip"), f"the replay does not know {command}"
        assert not any(w in (";", "|", "||", "&", ">", "<") for w in command), command
        words = self.arguments(command[1:])
        if command[:2] == ["pip", "install"]:
            words.insert(1, "--no-compile")  # bytecode is then written as modules are imported
        argv = [*self.executable(command[0]), *words]
        started = time.monotonic()
        done = subprocess.run(
            argv,
            cwd=self.host(self.workdir),
            env=self.container_env(),
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, f"{shlex.join(argv)}:\n{done.stdout}\n{done.stderr}"
        self.timings.append((shlex.join(command), time.monotonic() - started))

    def arguments(self, words: list[str]) -> list[str]:
        """The words of a command with the stage's paths moved here and its globs expanded,
        without ``--no-cache-dir``: a replay may use pip's cache."""
        out = []
        for word in words:
            if word == "--no-cache-dir":
                continue
            if not word.startswith("/"):
                out.append(word)
                continue
            moved = str(self.host(word))
            matches = sorted(glob.glob(moved)) if glob.has_magic(moved) else [moved]
            assert matches, f"{word} matches nothing"
            out.extend(matches)
        return out


def replay(stages: list[Stage], root: Path, args: dict[str, str]) -> list[StageReplay]:
    """Replay ``stages`` in order, each in its own directory under ``root``, with the build
    args ``args``; a stage's ``AS`` name lets later stages copy from it."""
    done: dict[str, StageReplay] = {}
    replays = []
    for i, stage in enumerate(stages):
        replayed = StageReplay(stage, root / f"stage-{i}", args, builders=dict(done)).run()
        replays.append(replayed)
        if stage.name:
            done[stage.name] = replayed
    return replays
