"""The CPU thread calibration stops as soon as its decision is clear, on a fake clock."""

from __future__ import annotations

import pytest

from huggingfaceserver.backends.pytorch.threads import (
    CALIBRATION_ROUNDS,
    MIN_CALIBRATION_ROUNDS,
    MIN_THREAD_SPEEDUP,
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
