"""``python -m huggingfaceserver``'s entry (the server's own behaviour is tested through real
processes elsewhere: a killed child's server still ends with our one error line)."""

from __future__ import annotations

import os
import subprocess
import sys

from huggingfaceserver.__main__ import (
    INDUCTOR_CACHE_ENV,
    QUIET_RESOURCE_TRACKER,
    keep_compiled_kernels,
    quiet_resource_tracker,
)


def test_the_trackers_filter_is_added_once_beside_the_users():
    environ = {"PYTHONWARNINGS": "error::DeprecationWarning"}
    quiet_resource_tracker(environ)
    quiet_resource_tracker(environ)
    assert environ["PYTHONWARNINGS"] == f"error::DeprecationWarning,{QUIET_RESOURCE_TRACKER}"
    empty: dict[str, str] = {}
    quiet_resource_tracker(empty)
    assert empty == {"PYTHONWARNINGS": QUIET_RESOURCE_TRACKER}


LEAK = """
import multiprocessing, os, signal
from huggingfaceserver.__main__ import quiet_resource_tracker
if {quiet}:
    quiet_resource_tracker()

def leak(ready):
    lock = multiprocessing.get_context("spawn").Lock()  # a named semaphore, tracked
    ready.set()
    signal.pause()

if __name__ == "__main__":
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    child = context.Process(target=leak, args=(ready,))
    child.start()
    ready.wait(60)
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    print("our last line", flush=True)
"""


def run_leak(tmp_path, quiet: bool) -> str:
    script = tmp_path / f"leak_{quiet}.py"
    script.write_text(LEAK.format(quiet=quiet))
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_a_killed_childs_leak_is_cleaned_without_a_warning(tmp_path):
    """The tracker still runs (it removes what the killed child left), and says nothing."""
    assert "leaked semaphore" in run_leak(tmp_path, quiet=False)  # what the filter hides
    assert "leaked semaphore" not in run_leak(tmp_path, quiet=True)


def test_compiled_kernels_are_kept_in_the_servers_cache(tmp_path):
    environ: dict[str, str] = {}
    assert keep_compiled_kernels(True, tmp_path, environ) == tmp_path / "torch-compile"
    assert environ == {INDUCTOR_CACHE_ENV: str(tmp_path / "torch-compile")}
    chosen = {INDUCTOR_CACHE_ENV: "/volume/inductor"}  # the user's choice stands
    assert keep_compiled_kernels(True, tmp_path, chosen) is None
    assert chosen == {INDUCTOR_CACHE_ENV: "/volume/inductor"}
    for compiles, cache in ((False, tmp_path), (True, None)):  # no flag; no cache: torch's
        assert keep_compiled_kernels(compiles, cache, environ := {}) is None and not environ


def test_the_kernel_cache_is_set_before_torch_sets_its_own(tmp_path):
    """Importing the torch backend imports inductor, which sets the variable to its default:
    set before, as ``main`` does, it stands (a child process, as the engine is, inherits it)."""
    script = (
        "import os, pathlib\n"
        "from huggingfaceserver.__main__ import keep_compiled_kernels\n"
        f"keep_compiled_kernels(True, pathlib.Path({str(tmp_path)!r}))\n"
        "import huggingfaceserver.backends.pytorch.generator\n"
        "import torch._inductor.config\n"
        f"print(os.environ[{INDUCTOR_CACHE_ENV!r}])\n"
    )
    environ = {k: v for k, v in os.environ.items() if k != INDUCTOR_CACHE_ENV}  # torch set it
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=environ
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / "torch-compile")
