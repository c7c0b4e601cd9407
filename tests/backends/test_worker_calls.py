"""The one queue of calls that the encoder batcher's worker and the decode loop run for other
threads."""

from __future__ import annotations

import threading

import pytest

from huggingfaceserver.backends.worker_calls import WorkerCalls
from huggingfaceserver.errors import NotReady


def test_calls_run_in_order_on_the_running_thread_and_hand_back_results_or_errors() -> None:
    calls = WorkerCalls()
    ran: list[str] = []
    first = calls.add(lambda: ran.append("first") or threading.current_thread().name)
    failing = calls.add(lambda: 1 / 0)
    last = calls.add(lambda: ran.append("last") or 42)
    assert calls
    worker = threading.Thread(target=calls.run, name="worker")
    worker.start()
    worker.join()
    assert not calls
    assert (first.result(), last.result(), ran) == ("worker", 42, ["first", "last"])
    with pytest.raises(ZeroDivisionError):
        failing.result()


def test_calls_left_when_the_worker_stops_fail_with_its_error() -> None:
    calls = WorkerCalls()
    pending = [calls.add(lambda: 1), calls.add(lambda: 2)]
    calls.fail(NotReady("the server is shutting down"))
    assert not calls
    for done in pending:
        with pytest.raises(NotReady, match="shutting down"):
            done.result()
