"""A soak: both kinds of server under a steady mixed load for :data:`DURATION_S`, every answer
checked and each server's memory sampled every second (the driver is bench/soak.py, whose
10-minute run is ``python -m bench --only soak``). A server that runs for weeks must not grow:
over the second half of the run its RSS has to be flat."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path

import pytest

from bench import soak
from bench.server import family as process_family
from bench.server import family_rss_mb, status_kib
from bench.soak import RssSample, second_half_trend
from bench.soak_requests import ENCODER_KINDS, GENERATION_KINDS, Servers

from .harness import run_server, wait_ready

DURATION_S = 90.0
"""Long enough for 45 s of second half at a steady state; the suite stays within its budget."""
MIN_REQUESTS = 20
"""Of each kind: every route was exercised throughout, not only at the start."""


@pytest.fixture(scope="module")
def servers(tiny_models: dict[str, Path], tmp_path_factory) -> Iterator[Servers]:
    """The tiny BERT embedding model (V1, V2, gRPC, embeddings) and the tiny llama on the
    transformers backend, started side by side."""
    log_dir = tmp_path_factory.mktemp("soak")
    encoder = ["--model_dir", str(tiny_models["bert_embedding"]), "--model_name", "encoder"]
    llama = ["--model_dir", str(tiny_models["llama"]), "--model_name", "llm"]
    llama += ["--backend", "huggingface"]
    with ExitStack() as stack:
        started = [
            stack.enter_context(run_server(args, log_dir, ready=False, env=soak.ONE_THREAD))
            for args in (encoder, llama)
        ]
        for server in started:
            wait_ready(server)
        yield Servers(
            started[0].url,
            f"127.0.0.1:{started[0].grpc_port}",
            started[1].url,
            {"encoder": started[0].process.pid, "generation": started[1].process.pid},
        )


def test_family_rss_counts_the_descendants():
    """A child holding 64 MiB shows in its parent's family, and is gone from it once it exits."""
    before = family_rss_mb(os.getpid())
    holder = "import sys; b = bytearray(64 << 20); print('held', flush=True); sys.stdin.read()"
    with subprocess.Popen(
        [sys.executable, "-c", holder], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as child:
        assert child.stdout is not None and child.stdout.readline() == "held\n"
        during = family_rss_mb(os.getpid())
        assert child.pid in process_family(os.getpid())
        child.communicate("")
    assert during - before > 64
    assert family_rss_mb(os.getpid()) < during - 64


def samples(mib_at: Sequence[float], every_s: float = 1.0) -> list[RssSample]:
    return [RssSample(i * every_s, mib) for i, mib in enumerate(mib_at)]


def test_trend_fits_the_second_half_only():
    # 60 s that climb 30 MiB then stay flat with allocator-like noise: a warm-up, no leak
    climb = [500 + i for i in range(30)]
    noisy = [530 + (3 if i % 7 == 0 else 0) - (2 if i % 11 == 0 else 0) for i in range(31)]
    trend = second_half_trend(samples(climb + noisy))
    assert trend.samples == 31
    assert abs(trend.slope_mib_per_min) < 2 and abs(trend.growth_mib) < 2
    assert trend.flat()


def test_one_allocator_step_in_the_second_half_is_noise():
    # 90 s: a warm-up climb, then flat but for one 6 MiB step (an arena grown) mid-second-half
    rss = [500 + min(i, 40) + (6 if i >= 68 else 0) for i in range(91)]
    trend = second_half_trend(samples(rss))
    assert 0 < trend.slope_mib_per_min < trend.slope_limit
    assert trend.growth_mib == pytest.approx(6)
    assert trend.flat()


def test_trend_flags_a_leak_of_1_mb_per_100_requests():
    # 50 requests/s leaking 1 MB per 100 requests: 0.5 MB/s, 28.6 MiB/min, with noise
    leak = [400 + 0.5 * i * 1e6 / soak.MiB + (4 if i % 5 == 0 else 0) for i in range(91)]
    trend = second_half_trend(samples(leak))
    assert trend.slope_mib_per_min == pytest.approx(28.6, abs=1)
    run = soak.SoakResult(90.0, {"chat": soak.Tally("llm", requests=4500)}, {"llm": samples(leak)})
    assert run.leak_slope("llm") == pytest.approx(trend.slope_mib_per_min, abs=1)
    assert run.trend("llm") == trend
    assert trend.growth_mib > soak.GROWTH_LIMIT_MIB
    assert not trend.flat()


@pytest.mark.slow
def test_mixed_load_is_answered_and_memory_stays_flat(servers: Servers):
    result = soak.run(servers, DURATION_S)
    print("\n" + result.summary())
    assert result.errors == 0, "\n".join(result.problems())
    assert set(result.tallies) == {*ENCODER_KINDS, *GENERATION_KINDS}
    for kind, tally in result.tallies.items():
        assert tally.requests >= MIN_REQUESTS, (kind, tally.requests)
    for family, pid in servers.families.items():
        assert status_kib(pid, "VmRSS") > 0, f"the {family} server has exited"
        assert len(result.rss[family]) >= DURATION_S / 3  # the sampler kept up
        trend = result.trend(family)
        assert trend.slope_mib_per_min <= trend.slope_limit, (family, trend)
        assert trend.growth_mib <= soak.GROWTH_LIMIT_MIB, (family, trend)
