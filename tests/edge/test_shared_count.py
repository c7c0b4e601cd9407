"""The counter the front processes share through a file."""

from __future__ import annotations

import multiprocessing

from huggingfaceserver.edge.shared_count import SharedCount


def _add(path: str, count: int, limit: int, results) -> None:
    shared = SharedCount(path)
    results.put(sum(shared.add(1, limit) for _ in range(count)))


def test_processes_adding_to_one_file_count_once_and_stop_at_the_limit(tmp_path):
    path = SharedCount.create(str(tmp_path / "count"))
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    workers = [context.Process(target=_add, args=(path, 4, 6, results)) for _ in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(30)
    assert sum(results.get(timeout=5) for _ in workers) == 6
    here = SharedCount(path)
    assert here.value() == 6
    assert not here.add(1, 6) and here.value() == 6
    assert here.add(-2, 6) and here.value() == 4
    assert here.add(5) and here.value() == 9  # no limit


def test_a_new_counter_starts_at_zero(tmp_path):
    path = SharedCount.create(str(tmp_path / "count"))
    assert SharedCount(path).value() == 0
