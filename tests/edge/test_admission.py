"""Admission: the local count, and the count shared by front processes through a file."""

from __future__ import annotations

import multiprocessing

from huggingfaceserver.edge.admission import Admission, FileSlots


def test_a_local_admission_counts_to_its_limit():
    admission = Admission(2)
    assert admission.try_enter() and admission.try_enter()
    assert not admission.try_enter()
    admission.leave()
    assert admission.try_enter()
    assert admission.held == 2


def _take(path: str, limit: int, count: int, results) -> None:
    slots = FileSlots(path, limit)
    results.put(sum(slots.acquire(block=False) for _ in range(count)))


def test_processes_sharing_a_file_count_once(tmp_path):
    path = FileSlots.create(str(tmp_path / "admission"))
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    workers = [context.Process(target=_take, args=(path, 5, 4, results)) for _ in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(30)
    assert sorted(results.get(timeout=5) for _ in workers) in ([1, 4], [2, 3])
    here = Admission(5, FileSlots(path, 5))
    assert here.shared.taken() == 5 and not here.try_enter()
    here.shared.release()
    assert here.try_enter() and here.held == 1
