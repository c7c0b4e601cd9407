"""The CPU thread calibration stops as soon as its decision is clear, and the decode loop's
steps keep or let go of threads as timings while serving say, on a fake clock."""

from __future__ import annotations

import logging

import pytest
import torch

from huggingfaceserver.backends.pytorch.threads import (
    CALIBRATION_ROUNDS,
    MIN_CALIBRATION_ROUNDS,
    MIN_THREAD_SPEEDUP,
    RETIME_AFTER_S,
    TIMED_PAIRS,
    LoopThreads,
    ThreadDecision,
    TunedLoopThreads,
    calibrate_cpu_threads,
    decode_bucket,
    prefill_bucket,
    time_thread_counts,
)


class FakeForward:
    """A forward pass whose duration depends on the thread count set, on a fake clock."""

    def __init__(self, seconds_on: dict[int, list[float]]):
        self.seconds_on = {threads: list(times) for threads, times in seconds_on.items()}
        self.now = 0.0
        self.threads = 0
        self.ran_on: list[int] = []

    def set_threads(self, threads: int) -> None:
        self.threads = threads

    def __call__(self) -> None:
        self.ran_on.append(self.threads)
        self.now += self.seconds_on[self.threads].pop(0)

    def clock(self) -> float:
        return self.now


def calibrate(fake: FakeForward):
    return time_thread_counts(fake, 2, set_threads=fake.set_threads, clock=fake.clock)


@pytest.mark.parametrize("one_thread_s", [0.2, 0.1])  # 2x faster on 2 threads; no faster
def test_calibration_stops_after_two_rounds_when_the_answer_is_clear(one_thread_s):
    fake = FakeForward({2: [0.5, 0.1, 0.1, 0.1], 1: [one_thread_s] * 3})
    timings = calibrate(fake)
    assert MIN_CALIBRATION_ROUNDS == 2
    assert fake.ran_on == [2, 2, 1, 2, 1]  # warm-up, then two rounds
    assert (timings.many, timings.one) == pytest.approx((0.1, one_thread_s))


def test_calibration_runs_every_round_near_the_threshold_and_keeps_the_fastest():
    many = [0.5, 0.11, 0.1, 0.12]  # the warm-up's 0.5 s is not counted
    one = [MIN_THREAD_SPEEDUP * 0.1 + 0.01, MIN_THREAD_SPEEDUP * 0.1, 0.2]
    fake = FakeForward({2: many, 1: one})
    timings = calibrate(fake)
    assert fake.ran_on == [2] + [2, 1] * CALIBRATION_ROUNDS
    assert timings.many == pytest.approx(0.1)
    assert timings.one == pytest.approx(MIN_THREAD_SPEEDUP * 0.1)
    assert timings.speedup == pytest.approx(MIN_THREAD_SPEEDUP)


def test_one_disturbed_timing_does_not_decide():
    """Seen in a benchmark: a forward on 2 threads slowed by other work (103 ms for 50-65 ms)
    made the first round say that threads do not pay; the second round, undisturbed, says
    they do."""
    fake = FakeForward({2: [0.5, 0.103, 0.055, 0.06], 1: [0.086, 0.09, 0.09]})
    timings = calibrate(fake)
    assert fake.ran_on == [2, 2, 1, 2, 1]
    assert timings.speedup == pytest.approx(0.086 / 0.055)
    assert timings.speedup >= MIN_THREAD_SPEEDUP


class FakeSteps:
    """Decode steps whose duration depends on the thread count set and on a load that the
    test changes, on a fake clock."""

    def __init__(self, seconds_on: dict[int, float]):
        self.seconds_on = dict(seconds_on)
        self.now = 0.0
        self.threads = 1
        self.ran_on: list[int] = []
        self.switches = 0

    def set_threads(self, threads: int) -> None:
        self.threads = threads
        self.switches += 1

    def clock(self) -> float:
        return self.now

    def step(self) -> int:
        self.ran_on.append(self.threads)
        self.now += self.seconds_on[self.threads]
        return len(self.ran_on)


def tuned(fake: FakeSteps, threads: int = 1, most: int = 2, **kwargs) -> TunedLoopThreads:
    decision = ThreadDecision(threads, most, True, "calibrated")
    fake.threads = threads  # where the calibration left the loop's thread
    return TunedLoopThreads(decision, set_threads=fake.set_threads, clock=fake.clock, **kwargs)


def run_steps(steps: TunedLoopThreads, fake: FakeSteps, count: int, rows: int = 16) -> None:
    for _ in range(count):
        assert steps.run(decode_bucket(rows), fake.step) == len(fake.ran_on)  # its own result


def test_a_bucket_alternates_its_first_steps_then_keeps_the_faster_count(caplog) -> None:
    fake = FakeSteps({1: 0.020, 2: 0.010})  # two threads 2x faster: kept
    steps = tuned(fake, pairs=TIMED_PAIRS)
    with caplog.at_level(logging.INFO):
        run_steps(steps, fake, 2 * TIMED_PAIRS + 5)
    assert fake.ran_on == [1, 2] * TIMED_PAIRS + [2] * 5
    assert "decode steps of 16-31 rows: 2 (20.0 ms on 1 thread, 10.0 ms on 2)" in caplog.text


def test_threads_that_do_not_pay_are_let_go() -> None:
    fake = FakeSteps({1: 0.020, 2: 0.020 / MIN_THREAD_SPEEDUP * 1.05})  # under the bar
    steps = tuned(fake, threads=2)
    run_steps(steps, fake, 2 * TIMED_PAIRS + 5)
    assert fake.ran_on[-5:] == [1] * 5
    assert fake.threads == 1
    # every timed step switches (it starts on 1, from the calibration's 2), then back to 1 for good
    assert fake.switches == 2 * TIMED_PAIRS + 1


def test_the_choice_is_timed_again_and_follows_the_machine() -> None:
    """A core that was free when the bucket was timed is taken by other work: the next
    timing, after RETIME_AFTER_S, goes back to one thread."""
    fake = FakeSteps({1: 0.020, 2: 0.010})
    steps = tuned(fake, retime_after_s=RETIME_AFTER_S)
    run_steps(steps, fake, 2 * TIMED_PAIRS)
    assert fake.threads == 2
    fake.seconds_on[2] = 0.030  # the second core is busy elsewhere now
    decided = fake.now
    while fake.now < decided + RETIME_AFTER_S:  # the choice stands until then
        run_steps(steps, fake, 1)
    assert set(fake.ran_on[2 * TIMED_PAIRS :]) == {2}
    run_steps(steps, fake, 2 * TIMED_PAIRS + 3)
    assert fake.ran_on[-3:] == [1] * 3


def test_buckets_choose_apart() -> None:
    """A step of one row is not sped up where one of 16 is, nor a decode step where a prefill
    of as many tokens is: each keeps its own count."""
    fake = FakeSteps({1: 0.020, 2: 0.010})
    steps = tuned(fake)
    run_steps(steps, fake, 2 * TIMED_PAIRS, rows=16)
    fake.seconds_on = {1: 0.005, 2: 0.005}
    run_steps(steps, fake, 2 * TIMED_PAIRS, rows=1)
    for _ in range(2 * TIMED_PAIRS):
        steps.run(prefill_bucket(16), fake.step)
    fake.ran_on.clear()
    run_steps(steps, fake, 2, rows=1)
    run_steps(steps, fake, 2, rows=20)  # same bucket as 16
    steps.run(prefill_bucket(20), fake.step)
    assert fake.ran_on == [1, 1, 2, 2, 1]
    assert [decode_bucket(rows).scale for rows in (1, 2, 3, 4, 16, 31, 32)] == [1, 2, 2, 3, 5, 5, 6]
    assert str(decode_bucket(20)) == "decode steps of 16-31 rows"
    assert str(prefill_bucket(100)) == "prefills of 64-127 prompt tokens"


def test_a_fixed_count_runs_the_step_as_it_is() -> None:
    assert LoopThreads().run(decode_bucket(8), lambda: "logits") == "logits"


def test_the_calibration_decides_only_where_torch_may_choose(monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    decision = calibrate_cpu_threads(lambda: None)
    assert not decision.tuned
    assert decision.threads == decision.most == torch.get_num_threads()
