"""Timing model and load-generator arithmetic."""
from __future__ import annotations

import random

import pytest

from pd_agent.loadgen import Result, arrival_times, percentile, rate_at, sample_length, summarize
from pd_agent.timing import TimingModel


def test_prefill_model_matches_the_fit():
    t = TimingModel()
    assert t.prefill_ms([512]) == pytest.approx(0.0948 * 512 + 4.03e-6 * 512 ** 2 + 18.9)
    assert 67 < t.prefill_ms([512]) < 70  # "512 tokens about 68 ms"
    assert t.prefill_ms([256, 256]) < t.prefill_ms([512])  # quadratic term
    assert t.prefill_ms([]) == 0


def test_decode_model_matches_the_fit():
    t = TimingModel()
    assert t.decode_step_ms([512] * 8) == pytest.approx(6.1e-4 * 4096 + 0.068 * 8 + 19.9)
    assert 22 < t.decode_step_ms([512] * 8) < 23.5
    assert t.decode_step_ms([512] * 16) > t.decode_step_ms([512] * 8)


def test_kv_transfer_and_scale():
    t = TimingModel()
    assert t.kv_transfer_ms(25 * 10 ** 9) == pytest.approx(1000.5)
    fast = TimingModel.from_env({"PD_SIM_TIME_SCALE": "0.1", "PD_SIM_PREFILL_C": "10"})
    assert fast.prefill_c == 10 and fast.prefill_ms([100]) == pytest.approx(
        (0.0948 * 100 + 4.03e-6 * 100 ** 2 + 10) * 0.1)


def test_arrivals():
    rng = random.Random(3)
    poisson = arrival_times("poisson", 200, rng, rate=10)
    assert 1800 < len(poisson) < 2200 and poisson == sorted(poisson)
    sine = arrival_times("sine", 150, random.Random(3), rate_min=5, rate_max=20, period=150)
    first_half = sum(1 for t in sine if t < 75)
    second_half = len(sine) - first_half
    assert first_half > second_half * 1.5  # sin is positive over the first half-period
    assert rate_at(37.5, "sine", 0, 5, 20, 150) == pytest.approx(20)


def test_lengths_follow_means():
    rng = random.Random(1)
    xs = [sample_length(1155, rng, 100000) for _ in range(20000)]
    assert 1050 < sum(xs) / len(xs) < 1260
    assert max(sample_length(1155, rng, 2048) for _ in range(1000)) <= 2048


def test_summary_goodput():
    rs = [Result(True, 100, 20), Result(True, 2000, 20), Result(True, 100, 200), Result(False, reason="X")]
    s = summarize(rs, 2.0, slo_ttft_ms=1500, slo_tbt_ms=80)
    assert s.completed == 3 and s.failed == 1 and s.failed_by_reason == {"X": 1}
    assert s.goodput_rps == 0.5 and s.slo_attainment == 0.25
    assert percentile([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 90) == 9


def test_summary_counts_refusals_apart_from_failures():
    rs = [Result(True, 100, 20, refusals={"DRAINING": 1}), Result(True, 100, 20),
          Result(False, reason="NoLinkedPair", refusals={"NoLinkedPair": 3}),
          Result(False, reason="LLM_NOT_YET_LINK")]
    s = summarize(rs, 1.0, slo_ttft_ms=1500, slo_tbt_ms=80)
    assert s.completed == 2 and s.failed == 2 and s.retried == 2
    assert s.refused_by_reason == {"DRAINING": 1, "NoLinkedPair": 3}
    assert s.failed_by_reason == {"NoLinkedPair": 1, "LLM_NOT_YET_LINK": 1}


def test_only_refusals_before_any_token_are_retried():
    from pd_router.routing import RETRYABLE
    retryable = RETRYABLE.__contains__
    assert retryable("DRAINING") and retryable("ConnectError") and retryable("NoLinkedPair")
    assert retryable("ROLE_CHANGED")
    # a data-path error after admission is a failure, never hidden by a retry
    for code in ("LLM_NOT_YET_LINK", "LLM_WAIT_PROCESS_TIMEOUT", "LLM_KV_CACHE_NOT_EXIST", "ReadTimeout"):
        assert not retryable(code)


@pytest.mark.parametrize("text, want", [("0/1", (0, 1)), ("3/4", (3, 4)), ("4/4", None), ("-1/2", None),
                                        ("1", None), ("a/b", None)])
def test_a_shard_is_k_of_n(text, want):
    import argparse

    from pd_agent.loadgen import parse_shard
    if want is None:
        with pytest.raises(argparse.ArgumentTypeError):
            parse_shard(text)
    else:
        assert parse_shard(text) == want


async def test_the_loop_lag_is_how_late_a_timer_fires():
    import asyncio
    import time

    from pd_agent.loadgen import LoopLag
    lag = LoopLag(every=0.01)
    task = asyncio.create_task(lag.run())
    await asyncio.sleep(0.05)
    time.sleep(0.2)   # the loop held up: the next timer fires about 200 ms late
    await asyncio.sleep(0.05)
    task.cancel()
    assert lag.summary()["max"] >= 150 and min(lag.lags) < 50
