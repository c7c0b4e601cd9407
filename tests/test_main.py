"""``python -m huggingfaceserver``'s entry (the server's own behaviour is tested through real
processes elsewhere: a killed child's server still ends with our one error line)."""

from __future__ import annotations

import subprocess
import sys

from huggingfaceserver.__main__ import QUIET_RESOURCE_TRACKER, quiet_resource_tracker


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
