"""The server's code at an earlier commit, to measure against in the same run.

``git archive REF huggingfaceserver`` is unpacked into the cache (once per commit); the server
then runs from there with this interpreter and its packages (see :func:`bench.server.start`).
"""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile
from pathlib import Path

PACKAGE = "huggingfaceserver"


class BaselineUnavailable(RuntimeError):
    """The baseline commit cannot be checked out (no git, unknown ref, shallow clone...)."""


def commit_of(ref: str) -> str:
    """The full commit id of ``ref`` in this repository."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"],
            capture_output=True,
            text=True,
        )
    except OSError as exc:
        raise BaselineUnavailable(f"git is not available: {exc}") from None
    if done.returncode != 0:
        raise BaselineUnavailable(f"{ref!r} is no commit of this repository")
    return done.stdout.strip()


def checkout(ref: str, cache: Path) -> Path:
    """A folder holding the ``huggingfaceserver`` package as it was at ``ref``."""
    commit = commit_of(ref)
    tree = cache / f"baseline-{commit[:12]}"
    if (tree / PACKAGE / "__main__.py").exists():
        return tree
    archive = subprocess.run(["git", "archive", commit, PACKAGE], capture_output=True)
    if archive.returncode != 0:
        raise BaselineUnavailable(f"git archive {ref}: {archive.stderr.decode(errors='replace')}")
    partial = tree.with_name(tree.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(partial, filter="data")
    partial.rename(tree)
    return tree
