"""The Goodput policy's pure parts, table-driven: the capacity fit, the forecasts, the goodput
model and its gain-versus-cost gate."""
import math
import random
from dataclasses import replace

import pytest

from pd_agent.timing import TimingModel
from pd_operator import forecast as fc
from pd_operator.capacity import Capacity, StepFit, fit_steps, measure, prefill_rate
from pd_operator.goodput import Demand, Targets, choose, drain_seconds, predict, queues

T = TimingModel()
TRUE = StepFit(T.decode_a, T.decode_b, T.decode_c)


def steps(n, seed=1, noise=0.0, outliers=0.0, batches=(1, 2, 3, 4)):
    """(batch, context tokens, ms) of n decode steps timed by the timing model, with noise."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        b = rng.choice(batches)
        ctx = sum(rng.randint(200, 3500) for _ in range(b))
        ms = T.decode_step_ms([ctx // b] * b) * (1 + rng.gauss(0, noise))
        if rng.random() < outliers:
            ms *= 5      # a step slowed by something else (a pause, a pull landing)
        out.append((b, ctx, ms))
    return out


def close(fit: StepFit, b: int, ctx: int, rel: float) -> bool:
    return abs(fit.ms(b, ctx) - TRUE.ms(b, ctx)) <= rel * TRUE.ms(b, ctx)


@pytest.mark.parametrize("case, samples, previous, rel", [
    ("exact steps", steps(64), None, 0.001),
    ("noisy steps (5%)", steps(300, noise=0.05), None, 0.03),
    ("a tenth of the steps five times slower", steps(300, noise=0.02, outliers=0.1), None, 0.05),
    ("one decoder's 32 steps", steps(32, seed=7, noise=0.03), None, 0.05),
    ("every step at batch 4: the previous fit keeps what the steps cannot tell",
     steps(40, batches=(4,)), TRUE, 0.01),
])
def test_the_step_fit_predicts_the_step_time(case, samples, previous, rel):
    fit = fit_steps(samples, previous)
    for b, ctx in ((1, 500), (4, 4 * 1575), (4, 4 * 3500)):
        assert close(fit, b, ctx, rel), (case, fit, b, ctx)
    assert fit.a >= 0 and fit.b >= 0 and fit.c >= 0


def test_no_steps_keeps_the_previous_fit_or_none():
    assert fit_steps([], TRUE) is TRUE and fit_steps([], None) is None
    assert fit_steps([(0, 0, 5.0)], None) is None, "an idle engine's empty step says nothing"


def prefill_busy(prompt, batch, busy_s):
    """(tokens computed, busy seconds) of a prefill that ran `busy_s` of batches of `batch` prompts."""
    per = T.prefill_ms([prompt] * batch) / 1000
    n = int(busy_s / per)
    return (n * batch * prompt, n * per)


@pytest.mark.parametrize("case, busy, previous, want", [
    ("one prefill", [prefill_busy(1500, 4, 6)], None, 1500 * 4 / (T.prefill_ms([1500] * 4) / 1000)),
    ("idle prefills are not measured", [prefill_busy(1500, 4, 6), (0, 0.0), (100, 0.1)], None,
     1500 * 4 / (T.prefill_ms([1500] * 4) / 1000)),
    ("the median ignores one slowed engine", [prefill_busy(1500, 4, 6)] * 2 + [(1000, 5.0)], None,
     1500 * 4 / (T.prefill_ms([1500] * 4) / 1000)),
    ("none busy: the previous estimate", [(0, 0.0), (0, 0.0)], 9000.0, 9000.0),
    ("none busy, never measured", [(0, 0.0)], None, None),
])
def test_the_prefill_rate_is_tokens_per_busy_second(case, busy, previous, want):
    rate, _ = prefill_rate(busy, previous)
    assert (rate is None and want is None) or rate == pytest.approx(want, rel=0.01), case


def test_measure_falls_back_per_role():
    prev = Capacity(9000.0, TRUE)
    c = measure([(0, 0.0)], [], prev)
    assert c.prefill_tokens_per_s == 9000.0 and c.step is TRUE and c.prefills_measured == 0


def ramp(slope, n=30, dt=10.0, level=10.0, noise=0.0, seed=1):
    rng = random.Random(seed)
    return [(i * dt, level + slope * i * dt + rng.gauss(0, noise)) for i in range(n)]


@pytest.mark.parametrize("predictor, history, ahead, want, tol", [
    ("Trend", ramp(0.1), 10, 10 + 0.1 * 300, 0.01),
    ("Trend", ramp(0.0, noise=1.0), 10, 10.0, 1.0),
    ("Trend", [(0, 5.0)], 10, 5.0, 1e-9),
    ("Kalman", ramp(0.1), 10, 10 + 0.1 * 300, 0.5),
    ("Kalman", ramp(0.0, noise=1.0), 10, 10.0, 1.0),
    ("Kalman", ramp(0.0, n=2), 10, 10.0, 1e-9),
    ("Seasonal", [(t, 10 + 5 * math.sin(2 * math.pi * t / 240)) for t in range(0, 600, 10)], 20,
     10 + 5 * math.sin(2 * math.pi * 610 / 240), 0.3),
    ("Seasonal", ramp(0.1, n=5), 10, 10 + 0.1 * 50, 0.01),   # shorter than a period: Trend
    ("Trend", ramp(-1.0), 100, 0.0, 1e-9),                    # never negative
])
def test_forecasts(predictor, history, ahead, want, tol):
    got = fc.forecast(predictor, history, history[-1][0] + ahead, window=120, period=240)
    assert got == pytest.approx(want, abs=tol), (predictor, got)


def test_a_forecast_reaches_no_further_than_its_history():
    h = [(0.0, 1.0), (10.0, 2.0), (20.0, 3.0)]
    assert fc.forecast("Trend", h, 1000.0) == pytest.approx(5.0)


CAP = Capacity(prefill_tokens_per_s=9600.0, step=TRUE)
TARGETS = Targets(ttft_ms=3000, tbt_ms=60)


@pytest.mark.parametrize("case, demand, total, want", [
    # the prefill count that carries the mix best, as the timing models' capacities say
    ("prompt-heavy, 4 engines", Demand(3.4, 3000, 20), 4, 3),
    ("decode-heavy, 4 engines", Demand(3.4, 300, 150), 4, 1),
    ("balanced, 256 engines", Demand(120.0, 1500, 150), 256, range(35, 45)),
    ("prompt-heavy, 32 engines", Demand(30.0, 3000, 20), 32, range(21, 25)),
])
def test_the_best_split_carries_the_mix(case, demand, total, want):
    c = choose(total, total // 2, 1, total - 1, demand, CAP, 4, TARGETS, 30, 4)
    assert c.best.prefill in (want if isinstance(want, range) else [want]), (case, c.best)
    assert c.best.decode_use < 1 and c.best.prefill_use < 1


def test_a_split_that_overloads_a_role_predicts_less():
    d = Demand(30.0, 300, 150)
    fine, over = predict(4, 28, d, CAP, 4, TARGETS, 30), predict(20, 12, d, CAP, 4, TARGETS, 30)
    assert over.decode_use > 1 and over.goodput < 0.2 * fine.goodput


def test_a_backlog_counts_against_the_split_that_has_it():
    d, backlog = Demand(3.0, 3000, 20), Demand(3.0, 3000, 20, prompt_backlog=60000)
    assert predict(3, 1, backlog, CAP, 4, TARGETS, 30).goodput < predict(3, 1, d, CAP, 4, TARGETS, 30).goodput


def test_a_move_takes_a_round_per_max_in_flight_engines_each_the_way_it_goes():
    d = Demand(3.0, 300, 150)
    rounds = {"prefill": 5.0, "decoder": 3.0}
    whole = choose(4, 3, 1, 3, d, CAP, 4, TARGETS, 60, 5, max_in_flight=2, round_s=rounds)
    one_by_one = choose(4, 3, 1, 3, d, CAP, 4, TARGETS, 60, 5, max_in_flight=1, round_s=rounds)
    assert whole.best.prefill == 1 and whole.move_s == 3.0 and one_by_one.move_s == 6.0
    assert one_by_one.gain < whole.gain


def test_a_move_goes_as_far_as_its_rounds_pay_within_the_horizon():
    d = Demand(3.0, 300, 150)
    # one engine a round, 5 s each: a second round done at the horizon's end gains nothing
    short = choose(4, 3, 1, 3, d, CAP, 4, TARGETS, 10, 5, max_in_flight=1)
    assert short.best.prefill == 1 and short.target == 2 and short.reason == "Move" and short.move_s == 5
    assert short.whole_s == 10, "the whole move's time, which the caller's horizon must cover"
    # a longer horizon: the whole way, the first round's split serving while the second is made
    long = choose(4, 3, 1, 3, d, CAP, 4, TARGETS, 60, 5, max_in_flight=1)
    assert long.target == 1 and long.move_s == 10
    first = predict(2, 2, d, CAP, 4, TARGETS, 60).goodput
    assert long.gain == pytest.approx((first - long.now.goodput) * 5 + (long.best.goodput - long.now.goodput) * 50)


@pytest.mark.parametrize("case, demand, current, horizon, move_s, reason", [
    ("wrong split, cheap move: it pays", Demand(3.0, 300, 150), 3, 30, 4, "Move"),
    ("the best split already", Demand(3.0, 300, 150), 1, 30, 4, "AtBest"),
    ("light load: any split meets the targets", Demand(0.3, 1500, 150), 2, 30, 4, "AtBest"),
    ("a move that takes longer than the horizon gains nothing", Demand(3.0, 300, 150), 3, 30, 40, "NoGain"),
    ("a gain within the noise (under 1%)", Demand(0.8, 1500, 150), 2, 30, 4, "NoGain"),
])
def test_the_gain_versus_cost_gate(case, demand, current, horizon, move_s, reason):
    c = choose(4, current, 1, 3, demand, CAP, 4, TARGETS, horizon, move_s)
    assert c.reason == reason, (case, c)
    assert (c.target != current) == (reason == "Move")
    if reason == "Move":
        assert c.gain > c.cost
    if reason == "NoGain":
        assert c.best.goodput > c.now.goodput
        assert c.gain <= c.cost or c.best.goodput - c.now.goodput < 0.01 * c.now.goodput


def test_drain_time_by_direction():
    d = Demand(3.0, 300, 150)
    to_prefill = drain_seconds("prefill", d, CAP, 2, 2, 4)
    assert to_prefill == pytest.approx(150 * TRUE.ms(4, 4 * 375) / 1000)
    assert drain_seconds("decoder", d, CAP, 2, 2, 4) < to_prefill, "a prefill's queue drains in a batch or two"


def test_the_model_queues_are_littles_law_of_its_waits():
    """goodput.queues: a prefill's mean queue is M/M/1's (arrivals times the mean wait), whatever
    wait scale the capacity carries (it is what the reported queues are compared with)."""
    d = Demand(requests_per_s=20.0, prompt_tokens=2000, output_tokens=20)
    s = 2000 / CAP.prefill_tokens_per_s
    lam = 20.0 / 6
    rho = lam * s
    q = queues(6, 26, d, replace(CAP, prefill_wait_scale=3.0, decode_wait_scale=0.5), 4)
    assert q is not None and q[0] == pytest.approx(lam * rho * s / (1 - rho)) and q[2] == pytest.approx(rho)
    assert q == queues(6, 26, d, CAP, 4)
    assert queues(6, 26, d, Capacity(None, TRUE), 4) is None


def test_a_wait_scale_moves_the_best_split_towards_the_role_whose_queues_ran_longer():
    """Waits a role's queues showed longer than the model's make a split that loads it predict
    less, so the best split gives that role more engines; shorter, fewer."""
    d = Demand(requests_per_s=40.0, prompt_tokens=2000, output_tokens=25)
    best = lambda cap: max(range(1, 32), key=lambda p: predict(p, 32 - p, d, cap, 4, TARGETS, 30).goodput)  # noqa: E731
    plain = best(CAP)
    assert best(replace(CAP, prefill_wait_scale=0.4)) < plain < best(replace(CAP, prefill_wait_scale=3.0))
    assert best(replace(CAP, decode_wait_scale=5.0)) <= plain
    loaded = predict(plain - 1, 33 - plain, d, CAP, 4, TARGETS, 30)
    assert predict(plain - 1, 33 - plain, d, replace(CAP, prefill_wait_scale=2.0), 4, TARGETS, 30).ttft_ok < \
        loaded.ttft_ok
