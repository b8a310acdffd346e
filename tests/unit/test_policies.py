"""Rebalancing policies (pure): table-driven."""
import datetime as dt
from dataclasses import replace

import pytest
import yaml

from pd_operator import policies
from pd_operator.api import parse_spec
from pd_operator.policies import DecoderLoad, PrefillLoad, Signals
from pd_operator.rebalance import decide_target, limits
from pd_operator.signals import Earlier
from pd_operator.switch import Book
from tests.conftest import REPO

BASE = yaml.safe_load((REPO / "examples" / "sim-small.yaml").read_text())["spec"]


def spec(policy: str, **rb):
    return parse_spec({**BASE, "prefill": {"replicas": 3}, "decoder": {"replicas": 3},
                       "rebalance": {"policy": policy, **rb}})


def sig(p_busy=0.5, p_queue=0, d_run=2, d_wait=0, batch=4, n=2, ttft=None, tbt=None, age=1.0):
    return Signals(prefills=[PrefillLoad(busy=p_busy, queue=p_queue)] * n,
                   decoders=[DecoderLoad(running=d_run, waiting=d_wait, max_batch=batch)] * n,
                   ttft_p90_ms=ttft, tbt_p90_ms=tbt, age_s=age)


LOAD = spec("Load")


def test_demand_counts_what_draining_engines_saw():
    from dataclasses import replace as dc_replace

    from pd_operator import demand
    s = measured(3.0, 300, 150)
    one_draining = dc_replace(s, prefills=s.prefills[1:], idle_prefills=s.prefills[:1],
                              decoders=s.decoders[1:], idle_decoders=s.decoders[:1])
    whole = demand.measure(s, None, 1000.0, 60).demand
    moving = demand.measure(one_draining, None, 1000.0, 60).demand
    assert whole is not None and moving is not None
    assert moving.requests_per_s == whole.requests_per_s and moving.output_tokens == whole.output_tokens


def test_demand_counts_each_request_once_over_one_window_across_switches():
    """Two prefills took 15 prompts each over the 10 s window; a third took the role 2 s ago and,
    filled first by routing, took 10 since; a decoder was a prefill until 3 s ago and took 12
    then. 52 prompts in 10 s: 5.2 requests/s, not 10/2 + 1.5 + 1.5 = 8 (each over its own window),
    nor 4.0 (without what the decoder saw)."""
    from pd_operator import demand
    s = measured(3.0, 300, 150)
    settled = replace(s.prefills[0], window_s=10.0, arrived=15, arrived_tokens=15 * 300)
    new = replace(settled, window_s=2.0, arrived=10, arrived_tokens=10 * 300)
    was = replace(s.decoders[0], earlier=Earlier(full_window_s=10.0, prompts=12, prompt_tokens=12 * 1000,
                                                 output_tokens=600, completed=3))
    d = demand.measure(replace(s, prefills=[settled, settled, new], decoders=[was, *s.decoders[1:]]),
                       None, 1000.0, 60).demand
    assert d is not None
    assert d.requests_per_s == pytest.approx(5.2)
    assert d.prompt_tokens == pytest.approx((40 * 300 + 12 * 1000) / 52)
    done = sum(x.completed for x in s.decoders) + 3
    assert d.output_tokens == pytest.approx((sum(x.output_tokens for x in s.decoders) + 600) / done)
    # every prefill new to the role: the sample was still measured over the 10 s the decoder's
    # earlier role and the decoders' own windows cover (what tells a sample straddling a change)
    m = demand.measure(replace(s, prefills=[new, new], decoders=[was, *s.decoders[1:]]), None, 1000.0, 60)
    assert m.window_s == 10.0


@pytest.mark.parametrize("case, signals, current, want, reason", [
    ("prefill pressed, decoders idle", sig(p_busy=0.95, d_run=1), 3, 4, "PrefillBound"),
    ("queue builds on prefills", sig(p_busy=0.5, p_queue=3, d_run=1), 3, 4, "PrefillBound"),
    ("decode pressed, prefills idle", sig(p_busy=0.1, d_run=4, d_wait=2), 3, 2, "DecodeBound"),
    ("both pressed", sig(p_busy=0.95, d_run=4, d_wait=1), 3, None, "CapacityExhausted"),
    ("in between (hysteresis band)", sig(p_busy=0.6, d_run=3), 3, None, "Balanced"),
    ("prefill pressed but decoders busy-ish", sig(p_busy=0.95, d_run=3), 3, None, "Balanced"),
    ("stale", sig(p_busy=0.95, d_run=1, age=31), 3, None, "SignalsStale"),
    ("no signals", Signals(), 3, None, "NoSignals"),
    ("min decoder keeps one", sig(p_busy=0.95, d_run=1), 5, 5, "PrefillBound"),
    ("min prefill keeps one", sig(p_busy=0.1, d_run=4, d_wait=3), 1, 1, "DecodeBound"),
])
def test_load(case, signals, current, want, reason):
    v = policies.evaluate(LOAD, signals, current, limits(LOAD, 0), 0)
    assert (v.target, v.reason) == (want, reason), (case, v)


SLO = spec("SLO", targets={"ttftP90Ms": 1000, "tbtP90Ms": 50})


@pytest.mark.parametrize("ttft, tbt, current, want, reason", [
    (1500, 30, 3, 4, "TTFTOverTarget"),
    (500, 70, 3, 2, "TBTOverTarget"),
    (1500, 70, 3, None, "CapacityExhausted"),
    (1500, 45, 3, None, "WithinTargets"),     # TBT has no headroom (> 80% of target): hold
    (900, 40, 3, None, "WithinTargets"),
    (None, 40, 3, None, "NoSignals"),
])
def test_slo(ttft, tbt, current, want, reason):
    v = policies.evaluate(SLO, sig(ttft=ttft, tbt=tbt, p_busy=0.9, d_run=1), current, limits(SLO, 0), 0)
    assert (v.target, v.reason) == (want, reason), v
    if reason == "CapacityExhausted":
        assert "add replicas" in v.message and v.numbers["ttftP90Ms"] == 1500


@pytest.mark.parametrize("case, load, want, reason", [
    ("decoders full with a queue, prefills idle: TTFT is the decode wait",
     dict(p_busy=0.3, d_run=4, d_wait=3), 2, "DecodeQueueing"),
    ("decoders full but no queue: the prefills are the wait", dict(p_busy=0.9, d_run=4, d_wait=0), 4,
     "TTFTOverTarget"),
    ("both queue: prefills pressed too", dict(p_busy=0.95, d_run=4, d_wait=3), 4, "TTFTOverTarget"),
    ("prefill queue long", dict(p_busy=0.5, p_queue=3, d_run=4, d_wait=3), 4, "TTFTOverTarget"),
    ("neither queues now: the percentiles are from before the last switch", dict(p_busy=0.2, d_run=2), None,
     "Settling"),
])
def test_slo_attributes_ttft_to_the_decode_queue(case, load, want, reason):
    v = policies.evaluate(SLO, sig(ttft=1500, tbt=30, **load), 3, limits(SLO, 0), 0)
    assert (v.target, v.reason) == (want, reason), (case, v)
    if reason == "DecodeQueueing":
        assert "wait for a decode slot" in v.message


def ts(s: str, tz: str = "UTC") -> float:
    return dt.datetime.fromisoformat(s).replace(tzinfo=__import__("zoneinfo").ZoneInfo(tz)).timestamp()


SCHED = spec("Schedule", timeZone="Asia/Shanghai",
             schedule=[{"cron": "0 1 * * *", "prefill": 4}, {"cron": "0 9 * * *", "prefill": 2}])


@pytest.mark.parametrize("local, want", [
    ("2026-12-02 00:59:59", 2),   # before 01:00 the 09:00 entry of the day before holds
    ("2026-12-02 00:59:59.5", 2),  # half a second before is still before
    ("2026-12-02 01:00:00.2", 4),
    ("2026-12-02 01:00:00", 4),   # at its minute
    ("2026-12-02 08:59:00", 4),
    ("2026-12-02 09:00:00", 2),
])
def test_schedule_boundaries_in_the_time_zone(local, want):
    v = policies.evaluate(SCHED, Signals(), 3, limits(SCHED, 0), ts(local, "Asia/Shanghai"))
    assert v.target == want and v.reason == "Schedule", v
    # the same wall-clock time in UTC is 8 hours later in Shanghai: 01:00 UTC is 09:00 there
    in_utc = policies.evaluate(SCHED, Signals(), 3, limits(SCHED, 0), ts(local, "UTC")).target
    assert in_utc == {"2026-12-02 00:59:59": 4, "2026-12-02 00:59:59.5": 4, "2026-12-02 01:00:00": 2,
                      "2026-12-02 01:00:00.2": 2, "2026-12-02 08:59:00": 2, "2026-12-02 09:00:00": 2}[local]


def test_schedule_that_does_not_parse_freezes_with_a_reason():
    bad = spec("Schedule", schedule=[{"cron": "0 1 * * *", "prefill": 2}, {"cron": "61 * * * *", "prefill": 3}])
    v = policies.evaluate(bad, Signals(), 3, limits(bad, 0), ts("2026-12-02 10:00:00"))
    assert v.target is None and v.reason == "InvalidSchedule" and "schedule[1]" in v.message
    tz = spec("Schedule", timeZone="Mars/Olympus", schedule=[{"cron": "0 1 * * *", "prefill": 2}])
    assert policies.evaluate(tz, Signals(), 3, limits(tz, 0), 0).reason == "InvalidSchedule"


def test_periodic_policies_decide_on_their_interval_and_keep_the_target_between():
    book = Book()
    v, changed, book = decide_target(LOAD, book, Signals(), 3, 900.0)
    assert v.reason == "NoSignals" and book.target is None and not changed, "no guess before signals"
    before = book
    v, changed, book = decide_target(LOAD, book, sig(p_busy=0.95, d_run=1), 3, 1000.0)
    assert v.target == 4 and changed and book.target == 4 and book.decision["reason"] == "PrefillBound"
    assert before.target is None and before.decision["reason"] == "NoSignals", "the book given is not changed"
    v, changed, book = decide_target(LOAD, book, sig(p_busy=0.1, d_run=4, d_wait=3), 4, 1010.0)
    assert v is None and not changed and book.target == 4, "not due before evaluationIntervalSeconds"
    v, changed, book = decide_target(LOAD, book, sig(p_busy=0.6, d_run=3), 4, 1015.0)
    assert v.reason == "Balanced" and book.target == 4 and not changed
    v, _, book = decide_target(LOAD, book, sig(age=99), 4, 1030.0)
    assert v.reason == "SignalsStale" and book.target == 4, "a stale signal freezes the ratio"


def test_manual_decision_is_recorded_once():
    m = spec("Manual", manual={"prefill": 2})
    _, _, book = decide_target(m, Book(), Signals(), 3, 1.0)
    first = dict(book.decision)
    _, _, book = decide_target(m, book, Signals(), 3, 2.0)
    assert book.decision == first and book.target == 2


def test_next_fire_wakes_the_operator_at_the_minute():
    assert policies.next_fire(SCHED, ts("2026-12-02 00:59:30", "Asia/Shanghai")) == pytest.approx(30)
    assert policies.next_fire(LOAD, 0) is None


@pytest.mark.parametrize("p, d, total, want", [
    (2, 2, None, (2, 2)), (2, 2, 6, (3, 3)), (2, 2, 4, (2, 2)), (1, 3, 8, (2, 6)), (3, 1, 2, (1, 1)),
    (0, 4, 6, (1, 5)), (0, 4, 4, (0, 4)),
])
def test_scale_spreads_the_total_over_the_groups(p, d, total, want):
    s = parse_spec({**BASE, "prefill": {"replicas": p}, "decoder": {"replicas": d},
                    **({"replicas": total} if total else {})})
    assert (s.group_sizes()["prefill"], s.group_sizes()["decoder"]) == want and s.total == sum(want)


def test_replace_grows_then_shrinks_within_min_counts():
    from pd_operator import replace
    from pd_operator.switch import Limits
    lim = Limits()
    new, d = replace.plan({"prefill": 2, "decoder": 2}, 3, lim, 100.0, None, "Manual", 4)
    assert new == {"prefill": 3, "decoder": 2, "growing": "prefill", "moving": 1} and d.reason == "Replacing"
    keep, d = replace.plan(new, 3, lim, 101.0, "pods not ready: x-prefill-2", "Manual", 4)
    assert keep is None and "starting" in d.message
    done, d = replace.plan(new, 3, lim, 102.0, None, "Manual", 4)
    assert done == {"prefill": 3, "decoder": 1} and "removing 1 decoder" in d.message
    assert replace.plan(done, 3, lim, 103.0, None, "m", 4)[1].reason == "AtTarget"
    assert replace.plan(done, 4, lim, 103.0, None, "m", 4)[1].reason == "MinCount"
    assert replace.plan(done, 2, Limits(cooldown_until=200), 103.0, None, "m", 4)[1].reason == "Cooldown"
    back, _ = replace.plan(done, 2, lim, 300.0, None, "m", 4)
    assert back == {"prefill": 3, "decoder": 2, "growing": "decoder", "moving": 1}


def test_replace_moves_whole_up_to_max_in_flight():
    from pd_operator import replace
    from pd_operator.switch import Limits
    new, d = replace.plan({"prefill": 16, "decoder": 16}, 24, Limits(max_in_flight=8), 0.0, None, "m", 32)
    assert new == {"prefill": 24, "decoder": 16, "growing": "prefill", "moving": 8}
    assert "8 new prefill pods" in d.message
    done, d = replace.plan(new, 24, Limits(max_in_flight=8), 1.0, None, "m", 32)
    assert done == {"prefill": 24, "decoder": 8} and "removing 8 decoder" in d.message
    capped, _ = replace.plan({"prefill": 16, "decoder": 16}, 30, Limits(max_in_flight=64, min_decoder=4), 0.0,
                             None, "m", 32)
    assert capped == {"prefill": 28, "decoder": 16, "growing": "prefill", "moving": 12}, "the min count caps the move"


def test_replace_never_shrinks_a_group_below_its_floor():
    from pd_operator import replace
    from pd_operator.switch import Limits
    # a record that claims a move larger than the shrinking group can give
    done, _ = replace.plan({"prefill": 3, "decoder": 2, "growing": "prefill", "moving": 5}, 3, Limits(), 0.0, None,
                           "m", 3)
    assert done == {"prefill": 3, "decoder": 1}


def test_replace_sizes_are_a_function_of_spec_and_record():
    s = spec("Manual", manual={"prefill": 2}, method="Replace")
    assert s.group_sizes({"prefill": 4, "decoder": 2}) == {"prefill": 4, "decoder": 2}
    assert s.group_sizes({"prefill": 4, "decoder": 3, "growing": "prefill"}) == {"prefill": 4, "decoder": 3}
    assert s.group_sizes({"prefill": 5, "decoder": 3}) == {"prefill": 3, "decoder": 3}, "a stale record is dropped"
    assert s.group_sizes({"prefill": 6, "decoder": 3, "growing": "prefill", "moving": 3}) == \
        {"prefill": 6, "decoder": 3}
    # the spec scaled from 4 to 3 in the middle of a move of one (2P2D -> 3P): that record is not this total's
    scaled = parse_spec({**BASE, "prefill": {"replicas": 2}, "decoder": {"replicas": 2}, "replicas": 3,
                         "rebalance": {"policy": "Manual", "manual": {"prefill": 2}, "method": "Replace"}})
    assert scaled.group_sizes({"prefill": 3, "decoder": 2, "growing": "prefill", "moving": 1}) == \
        scaled.group_sizes(), "a stale record is dropped"
    assert spec("Manual", manual={"prefill": 2}).group_sizes({"prefill": 4, "decoder": 2}) == \
        {"prefill": 3, "decoder": 3}, "method Switch ignores it"


BIG = parse_spec({**BASE, "prefill": {"replicas": 16}, "decoder": {"replicas": 16},
                  "rebalance": {"policy": "Load", "minPrefill": 1, "minDecoder": 1}})


@pytest.mark.parametrize("case, signals, current, want", [
    # 16 prefills 10% busy, 16 decoders with 2 waiting each: demand is almost all decode;
    # the step is capped at an eighth of the fleet (4)
    ("large fleet, decode-bound: moves up to an eighth", sig(p_busy=0.1, d_run=4, d_wait=2, n=16), 16, 12),
    ("large fleet, prefill-bound: towards its demand share (25), an eighth at a time",
     sig(p_busy=0.95, d_run=1, n=16), 16, 20),
])
def test_load_moves_a_large_fleet_by_its_demand(case, signals, current, want):
    v = policies.evaluate(BIG, signals, current, limits(BIG, 0), 0)
    assert v.target == want, (case, v)


@pytest.mark.parametrize("value, total, want", [
    (1, 4, 1), (8, 256, 8), ("25%", 4, 1), ("25%", 32, 8), ("25%", 256, 64), ("10%", 4, 1), ("100%", 6, 6),
    ("33%", 10, 3),
])
def test_max_concurrent_switches_is_a_number_or_a_percentage_of_the_fleet(value, total, want):
    s = parse_spec({**BASE, "prefill": {"replicas": total // 2}, "decoder": {"replicas": total - total // 2},
                    "rebalance": {"policy": "Load", "maxConcurrentSwitches": value}})
    assert limits(s, 0).max_in_flight == want


@pytest.mark.parametrize("value", [0, "0%", "101%", "25", "1.5%", "x%", 2000])
def test_max_concurrent_switches_refuses_what_is_neither(value):
    with pytest.raises(ValueError):
        parse_spec({**BASE, "rebalance": {"policy": "Load", "maxConcurrentSwitches": value}})


def test_the_cooldown_runs_between_decisions_that_change_the_target():
    s = spec("Load", evaluationIntervalSeconds=10, cooldownSeconds=30)
    up, down = sig(p_busy=0.95, d_run=1), sig(p_busy=0.1, d_run=4, d_wait=3)
    v, changed, book = decide_target(s, Book(), up, 3, 1000.0)
    assert changed and book.target == 4 and book.cooldown_until == 1030.0
    v, changed, book = decide_target(s, book, down, 4, 1010.0)
    assert not changed and book.target == 4 and "held at 4 until" in book.decision["message"]
    assert v.reason == "DecodeBound", "the verdict is reported, the target held"
    v, changed, book = decide_target(s, book, up, 4, 1020.0)
    assert not changed and book.cooldown_until == 1030.0, "a verdict that keeps the target starts no cooldown"
    v, changed, book = decide_target(s, book, down, 4, 1030.0)
    assert changed and book.target == 3 and book.cooldown_until == 1060.0
    m = spec("Manual", manual={"prefill": 2}, cooldownSeconds=600)
    _, _, mb = decide_target(m, Book(target=4, cooldown_until=2000.0), Signals(), 4, 1000.0)
    assert mb.target == 2, "Manual and Schedule apply at once"


GOODPUT = spec("Goodput", targets={"ttftP90Ms": 3000, "tbtP90Ms": 60}, evaluationIntervalSeconds=10,
               cooldownSeconds=20)


def measured(rps, prompt, output, n_p=3, n_d=3, queued=0, waiting=0, steps=True, window=10.0):
    """Signals as agents report them for `rps` requests/s of a mix, timed by the timing models."""
    from pd_agent.timing import TimingModel
    t = TimingModel()
    n = round(rps * window / n_p)      # prompts each prefill took on; one at a time under a light load
    batch = 1 if n * t.prefill_ms([prompt]) / 1000 < window / 2 else 4
    busy = min(window, n / batch * t.prefill_ms([prompt] * batch) / 1000)
    pre = [PrefillLoad(busy=busy / window, queue=queued // max(1, prompt), queued_tokens=queued // n_p,
                       window_s=window, arrived=n, arrived_tokens=n * prompt, computed_tokens=n * prompt,
                       busy_s=busy)] * n_p
    ctx = prompt + output // 2
    st = tuple((b, b * ctx, t.decode_step_ms([ctx] * b)) for b in (1, 2, 3, 4) for _ in range(4)) if steps else ()
    dec = [DecoderLoad(running=2, waiting=waiting // n_d, max_batch=4, window_s=window,
                       output_tokens=round(rps * window / n_d) * output, completed=round(rps * window / n_d),
                       context_tokens=2 * ctx, steps=st)] * n_d
    return Signals(prefills=pre, decoders=dec, age_s=1.0)


@pytest.mark.parametrize("case, signals, current, want, reason", [
    ("decode-heavy on 3P3D: fewer prefills", measured(3.0, 300, 150), 3, 1, "GoodputGain"),
    ("prompt-heavy on 1P5D: more prefills", measured(4.0, 3000, 20, 1, 5), 1, (3, 4), "GoodputGain"),
    ("light load: any split does", measured(0.2, 300, 150), 3, None, "AtBest"),
    ("no decode step measured yet", measured(3.0, 300, 150, steps=False), 3, None, "Measuring"),
    ("agents without the window fields", Signals(prefills=[PrefillLoad(busy=0.5)] * 3,
                                                 decoders=[DecoderLoad(running=2, max_batch=4)] * 3), 3, None,
     "Measuring"),
    ("stale", replace(measured(3.0, 300, 150), age_s=99), 3, None, "SignalsStale"),
    ("no signals", Signals(), 3, None, "NoSignals"),
])
def test_goodput(case, signals, current, want, reason):
    v = policies.evaluate(GOODPUT, signals, current, limits(GOODPUT, 0), 1000.0)
    assert v.reason == reason, (case, v.message)
    if want is not None:
        assert v.target in (want if isinstance(want, tuple) else (want,)), (case, v)
    else:
        assert v.target is None


def test_goodput_decision_carries_its_numbers_and_learns():
    v, changed, book = decide_target(GOODPUT, Book(), measured(3.0, 300, 150), 3, 1000.0)
    assert changed and book.target == 1
    n = book.decision["numbers"]
    for key in ("requestsPerS", "promptTokensPerS", "outputTokensPerS", "decodeConcurrency", "prefillTokensPerBusyS",
                "decodeStepMs", "predictor", "forecastRequestsPerS", "moveS", "goodputNow", "goodputAtBest",
                "bestPrefill", "gain", "cost"):
        assert key in n, key
    assert float(n["goodputAtBest"]) > float(n["goodputNow"])
    assert book.learned.capacity.step is not None and len(book.learned.history) == 1
    # the capacity it measured carries an evaluation whose prefills were idle
    idle = replace(measured(3.0, 300, 150), prefills=[replace(p, busy_s=0.0, computed_tokens=0)
                                                      for p in measured(3.0, 300, 150).prefills])
    v, _, book = decide_target(GOODPUT, book, idle, 1, 1010.0)
    assert v.reason != "Measuring" and len(book.learned.history) == 2


def test_goodput_without_targets_freezes_rather_than_fails():
    # admission refuses it (test_admission); a spec stored before the rule existed is not a crash
    s = spec("Goodput")
    v = policies.evaluate(s, measured(3.0, 300, 150), 3, limits(s, 0), 1000.0)
    assert v.target is None and v.reason == "NoTargets" and "spec.rebalance.targets" in v.message


def test_goodput_weighs_a_move_over_a_horizon_that_covers_the_whole_move(monkeypatch):
    """A partial move that pays (5 s) must not size the horizon: the whole move (20 s) does."""
    real, horizons = policies.gp.choose, []

    def choose(*args, **kw):
        horizons.append(args[8])
        c = real(*args, **kw)
        return replace(c, move_s=5.0, whole_s=20.0)
    monkeypatch.setattr(policies.gp, "choose", choose)
    rs = spec("Goodput", targets={"ttftP90Ms": 3000, "tbtP90Ms": 60}, cooldownSeconds=1,
              evaluationIntervalSeconds=5)
    v = policies.evaluate(rs, measured(4.0, 3000, 20, 1, 5), 1, limits(rs, 0), 1000.0)
    assert horizons[1:] == [40.0] and v.numbers["horizonS"] == 40 and v.numbers["wholeMoveS"] == 20, \
        (horizons, v.numbers)


def test_goodput_sizes_replace_from_the_same_model():
    rs = spec("Goodput", targets={"ttftP90Ms": 3000, "tbtP90Ms": 60}, method="Replace",
              goodput={"replaceSeconds": 90})
    v = policies.evaluate(rs, measured(3.0, 300, 150), 3, limits(rs, 0), 1000.0)
    assert v.reason == "GoodputGain" and v.target == 1
    assert v.numbers["moveS"] == 180 and v.numbers["cost"] == 0 and v.numbers["horizonS"] == 360, \
        "a replacement drains nothing before its new engines serve; two of one at a time take two starts"
    both = spec("Goodput", targets={"ttftP90Ms": 3000, "tbtP90Ms": 60}, method="Replace",
                goodput={"replaceSeconds": 90}, maxConcurrentSwitches=2)
    v = policies.evaluate(both, measured(3.0, 300, 150), 3, limits(both, 0), 1000.0)
    assert v.target == 1 and v.numbers["moveS"] == 90, "two at once: one start"


def test_the_goodput_example_parses():
    s = parse_spec(yaml.safe_load((REPO / "examples" / "sim-goodput.yaml").read_text())["spec"])
    assert s.rebalance.policy == "Goodput" and s.rebalance.max_in_flight(s.total) == 4


def test_goodput_holds_through_noise_at_the_best_split():
    import random
    rng = random.Random(3)
    book, reasons = Book(target=1), []
    for i in range(30):
        rps = 3.0 * (1 + rng.uniform(-0.15, 0.15))
        _, changed, book = decide_target(GOODPUT, book, measured(rps, 300, 150, 1, 5), 1, 1000.0 + 10 * i)
        reasons.append(book.decision["reason"])
        assert not changed and book.target == 1, (i, book.decision["message"])
    assert set(reasons) <= {"AtBest", "MoveDoesNotPay"}, reasons


def history(rps, prompt, output, noise=0.0, start=900.0, n=9, every=10.0, seed=1):
    """Goodput's memory of n evaluations of a demand, each value off by up to `noise` (relative)."""
    import random
    rng = random.Random(seed)
    at = lambda v, t: v(t) if callable(v) else v * (1 + rng.uniform(-noise, noise))  # noqa: E731
    return tuple((start + every * i, *(at(v, start + every * i) for v in (rps, prompt, output))) for i in range(n))


def remembered(hist, moved_at=None, moved_dir=0, signals=None, current=3):
    """Goodput's memory: that history, the capacity one evaluation of `signals` measured, the last move."""
    v = policies.evaluate(GOODPUT, signals or measured(3.5, 600, 120), current, limits(GOODPUT, 0), 890.0)
    return policies.Memory(hist, v.learned.capacity, moved_at, moved_dir)


def test_goodput_moves_only_when_the_gain_outlasts_the_forecasts_own_error(monkeypatch):
    """The same demand now: after a steady history the move pays; after a history the forecast
    followed badly (its measured error large), the gain at that error does not, so it holds."""
    monkeypatch.setattr(policies, "QUEUE_FLOOR", 1e9)   # the gate alone: waits as the model has them
    now = measured(3.5, 600, 120)
    steady = policies.evaluate(GOODPUT, now, 3, limits(GOODPUT, 0), 990.0,
                               remembered(history(3.5, 600, 120, noise=0.02)))
    assert steady.reason == "GoodputGain" and steady.target == 1, steady.message
    noisy = policies.evaluate(GOODPUT, now, 3, limits(GOODPUT, 0), 990.0,
                              remembered(history(3.5, 600, 120, noise=0.3)))
    assert noisy.reason == "ForecastUnsure" and noisy.target is None, noisy.message
    n, q = noisy.numbers, steady.numbers
    assert float(n["margin"]) > 0 and float(n["robustGain"]) <= float(n["cost"]) < float(n["gain"])
    err = lambda x: [float(e) for e in x["forecastError"].split("/")]  # noqa: E731
    assert min(err(n)) > max(err(q)), "the noisy history's forecast error is the larger"


def test_goodput_goes_part_of_the_way_when_only_that_is_sure(monkeypatch):
    """16 engines, 4 of them prefills, serving about 1 of 17.6 requests/s of a decode-heavy mix,
    after a history the forecast followed badly: the whole way (one prefill) does not pay under
    every demand its error allows, one prefill fewer does; it moves that far, and says so."""
    monkeypatch.setattr(policies, "QUEUE_FLOOR", 1e9)   # the gate alone: waits as the model has them
    g = parse_spec({**BASE, "prefill": {"replicas": 8}, "decoder": {"replicas": 8},
                    "rebalance": {"policy": "Goodput", "targets": {"ttftP90Ms": 3000, "tbtP90Ms": 60},
                                  "evaluationIntervalSeconds": 10, "cooldownSeconds": 20}})
    now = measured(17.6, 300, 150, n_p=4, n_d=12)
    cap = policies.evaluate(g, now, 4, limits(g, 0), 890.0).learned.capacity
    v = policies.evaluate(g, now, 4, limits(g, 0), 990.0,
                          policies.Memory(history(17.6, 300, 150, noise=0.35), cap))
    n = v.numbers
    assert v.reason == "GoodputGain" and v.target == 3 and n["bestPrefill"] == 1, v.message
    assert float(n["robustGain"]) > float(n["cost"]) and "part of the way" in v.message, v.message
    # weighed the whole way only, it holds
    monkeypatch.setattr(policies, "_part_way", lambda s, c, robust, targets, k: (c, robust))
    w = policies.evaluate(g, now, 4, limits(g, 0), 990.0, policies.Memory(history(17.6, 300, 150, noise=0.35), cap))
    assert w.reason == "ForecastUnsure" and w.target is None, w.message


def test_goodput_does_not_reverse_a_move_within_its_dwell_unless_the_demand_changed(monkeypatch):
    monkeypatch.setattr(policies, "QUEUE_FLOOR", 1e9)   # the gate alone: waits as the model has them
    now = measured(3.5, 600, 120)
    quiet = history(3.5, 600, 120, noise=0.02)
    v = policies.evaluate(GOODPUT, now, 3, limits(GOODPUT, 0), 990.0, remembered(quiet, 980.0, +1))
    assert v.reason == "Dwell" and v.target is None, v.message
    assert v.learned.moved_at == 980.0, "holding keeps the last move's time"
    # the same way as the last move is no reversal; a reversal after the dwell is weighed again
    same = policies.evaluate(GOODPUT, now, 3, limits(GOODPUT, 0), 990.0, remembered(quiet, 980.0, -1))
    assert same.reason == "GoodputGain" and same.target == 1 and same.learned.moved_at == 990.0
    later = policies.evaluate(GOODPUT, now, 3, limits(GOODPUT, 0), 990.0, remembered(quiet, 900.0, +1))
    assert later.reason != "Dwell" and later.numbers["marginK"] == policies.MARGIN_K * policies.REVERSE_K, \
        "a reversal needs the wider margin (hysteresis)"
    # the mix turned decode-heavy after the move: the move is undone at once
    turned = history(3.5, lambda t: 3000.0 if t < 950 else 600.0, lambda t: 20.0 if t < 950 else 120.0)
    v = policies.evaluate(GOODPUT, now, 3, limits(GOODPUT, 0), 990.0, remembered(turned, 945.0, +1))
    assert v.reason == "GoodputGain" and v.target == 1, v.message


@pytest.mark.parametrize("case, values, want", [
    ("flat with noise", [1.0 + (0.05 if i % 2 else -0.05) for i in range(10)], 0),
    ("a step three samples ago", [1.0 + (0.02 if i % 2 else -0.02) + (i >= 7) for i in range(10)], 7),
    ("a step, then another", [1.0 + (i >= 3) + (i >= 8) for i in range(10)], 8),
    ("too short to tell", [1.0, 5.0], 0),
])
def test_change_detection_finds_the_last_change(case, values, want):
    assert policies._change_point([(10.0 * i, v) for i, v in enumerate(values)]) == want, case


def test_the_forecast_catches_a_turn_a_line_through_the_window_lags():
    """The rate ramped up for a minute and turned flat two evaluations ago: the line through the
    window still climbs; the forecast since the change does not."""
    from pd_operator import forecast as fc
    series = [(10.0 * i, 1.0 + 0.5 * min(i, 6)) for i in range(9)]   # 1.0 .. 4.0, flat from the 7th
    assert fc.trend(series, 100.0, 120.0) > 4.5
    assert policies._forecast("Trend", series, 100.0, 120.0, 0.0) == pytest.approx(4.0, abs=0.01)


def test_the_mix_is_forecast_at_its_latest_sample_until_its_errors_since_a_change_are_measured():
    """Outputs of 150 tokens, then a jump: the windows since say 80, 46 and (now) 43 as they hold
    less and less of the old mix. A line through those three would go on down (below 40); the
    forecast is the latest, until enough samples since the change measure a predictor's error."""
    from pd_operator import forecast as fc
    out = lambda t: 150.0 if t < 960 else (80.0 if t < 970 else 46.0)  # noqa: E731
    hist = history(3.5, 600, out, start=900.0, n=8)
    assert fc.trend([(t, o) for t, _, _, o in hist[-2:]] + [(980.0, 43.0)], 985.0) < 40
    v = policies.evaluate(GOODPUT, measured(3.5, 600, 43), 3, limits(GOODPUT, 0), 980.0, remembered(hist))
    assert v.numbers["forecastBy"].split("/")[2] == "Latest", v.numbers
    assert v.numbers["forecastOutputTokens"] == 43
    assert float(v.numbers["forecastError"].split("/")[2]) >= policies.UNMEASURED
    # with MIN_ERRORS one-step errors since the change (this evaluation's sample the last), a
    # predictor is chosen by its error again; one sample fewer, still the latest. The samples are
    # 10 s windows 10 s apart: the first at the new mix may still hold some of the old one, so the
    # samples measured wholly since the change start at the second
    for since, want in ((policies.MIN_ERRORS + 2, False), (policies.MIN_ERRORS + 1, True)):
        step = 980.0 - 10 * (since - 1)
        hist = history(3.5, 600, lambda t: 150.0 if t < step else 43.0, start=980.0 - 10 * 12, n=12)
        v = policies.evaluate(GOODPUT, measured(3.5, 600, 43), 3, limits(GOODPUT, 0), 980.0, remembered(hist))
        assert (v.numbers["forecastBy"].split("/")[2] == policies.LATEST) is want, (since, v.numbers)


def test_samples_whose_window_straddles_a_change_count_neither_in_the_forecast_nor_its_error():
    """Outputs of 150 tokens, a jump to 44: sampled every 5 s over 10 s windows, the two samples
    after it (118, 65) still hold some of the old mix. Counted as the new demand, they make the
    forecasts since the change look wrong (an error near 0.2, which keeps a move unsure for a
    minute); the samples from the first whose window starts at or after the change point's sample
    measure it as it is."""
    vals = [150.0] * 6 + [118.0, 65.0] + [44.0, 44.5, 43.5, 44.0, 44.2, 43.8]
    series = [(5.0 * i, v) for i, v in enumerate(vals)]
    # the change point falls on the first sample at the new level (t=40); the first window that
    # starts at or after it is the one of t=50, the first that cannot hold any of the old mix
    assert policies._change_point(series, 0.01) == 8 and policies._settled(series, 0.01, 10.0) == 10
    # a 12 s window: t=55 (t=50's began at 38, before the change point's sample at 40)
    assert policies._settled(series, 0.01, 12.0) == 11
    straddled = policies._error("Trend", series, 60.0, 0.0, 0.01, 0.0)
    settled = policies._error("Trend", series, 60.0, 0.0, 0.01, 10.0)
    assert straddled > 0.15 and settled < 0.03, (straddled, settled)
    assert policies._forecast("Trend", series, 80.0, 60.0, 0.0, 0.01, 10.0) == pytest.approx(44.0, abs=1.0)
    # too few samples measured wholly since: the latest is the forecast
    assert policies._unmeasured(series[:12], 0.01, 10.0) and not policies._unmeasured(series[:12], 0.01, 0.0)
    assert policies._settled([(5.0 * i, 1.0) for i in range(6)], 0.01, 10.0) == 0, "no change: every sample"


def test_a_decoders_absurd_report_window_does_not_stop_goodput(monkeypatch):
    """A decoder reporting a window of 1e12 s or NaN: the samples since a change are counted over
    at most the forecast's own window, and the policy decides as with an honest report."""
    seen = []
    real = policies._forecast_demand

    def spy(*args):
        seen.append(args[-1])
        return real(*args)
    honest, mem = measured(3.5, 600, 120), remembered(history(3.5, 600, 120))
    monkeypatch.setattr(policies, "_forecast_demand", spy)
    base = policies.evaluate(GOODPUT, honest, 3, limits(GOODPUT, 0), 990.0, mem)
    for bad in (1e12, float("nan")):
        sig = replace(honest, decoders=[replace(honest.decoders[0], window_s=bad), *honest.decoders[1:]])
        v = policies.evaluate(GOODPUT, sig, 3, limits(GOODPUT, 0), 990.0, mem)
        assert (v.reason, v.target) == (base.reason, base.target), v.message
    assert seen[:2] == [10.0, GOODPUT.rebalance.goodput.window_seconds] and seen[2] <= seen[1], seen


def test_a_report_window_of_nan_or_infinity_counts_as_none():
    """A prefill reporting its window, or its window over a role it left, as NaN or infinity: the
    fleet's rate is measured over the others' windows (NaN made it NaN and the evaluation raise;
    infinity made it 0, so the policy held as if nothing arrived)."""
    honest, mem = measured(3.5, 600, 120), remembered(history(3.5, 600, 120))
    base = policies.evaluate(GOODPUT, honest, 3, limits(GOODPUT, 0), 990.0, mem)
    first = honest.prefills[0]
    for bad in (float("nan"), float("inf")):
        for p0 in (replace(first, window_s=bad), replace(first, earlier=Earlier(full_window_s=bad))):
            v = policies.evaluate(GOODPUT, replace(honest, prefills=[p0, *honest.prefills[1:]]), 3,
                                  limits(GOODPUT, 0), 990.0, mem)
            assert (v.reason, v.target, v.numbers["requestsPerS"]) == \
                (base.reason, base.target, base.numbers["requestsPerS"]), v.message


def test_goodput_scales_each_roles_waits_by_how_long_its_queues_ran():
    """Decoders that keep reporting decodes waiting where the model has almost none: the decode
    waits grow over the evaluations (bounded), the prefills' stay; the numbers say so."""
    sig = measured(3.0, 600, 120, waiting=3 * 6)
    mem, scales = None, []
    for i in range(40):
        v = policies.evaluate(GOODPUT, sig, 3, limits(GOODPUT, 0), 1000.0 + 10 * i, mem)
        mem = replace(v.learned, moved_at=None, moved_dir=0)
        p, d = (float(x) for x in v.numbers["waitScale"].split("/"))
        scales.append(d)
        assert p == pytest.approx(1.0, abs=0.2), v.numbers
    assert scales[0] > 1.0 and scales[-1] > scales[0] and scales[-1] <= policies.MAX_WAIT_SCALE
    assert scales[-1] == pytest.approx(scales[-2], rel=0.05), "it settles"


def test_goodput_compares_no_queue_while_a_move_is_under_way_or_just_after():
    sig = measured(3.0, 600, 120, waiting=3 * 6)
    first = policies.evaluate(GOODPUT, sig, 3, limits(GOODPUT, 0), 1000.0)
    assert first.learned.queued_evals == (1.0, 1.0)
    moving = replace(sig, idle_decoders=[sig.decoders[0]])
    v = policies.evaluate(GOODPUT, moving, 3, limits(GOODPUT, 0), 1010.0, first.learned)
    assert v.learned.queued_evals == pytest.approx((0.9, 0.9)), "a switch in flight: nothing compared"
    just = replace(first.learned, moved_at=1000.0, moved_dir=-1)
    v = policies.evaluate(GOODPUT, sig, 3, limits(GOODPUT, 0), 1000.0 + policies.SETTLE_S / 2, just)
    assert v.learned.queued_evals == pytest.approx((0.9, 0.9)), "within SETTLE_S of a move: nothing compared"
    v = policies.evaluate(GOODPUT, sig, 3, limits(GOODPUT, 0), 1000.0 + policies.SETTLE_S, just)
    assert v.learned.queued_evals == pytest.approx((1.9, 1.9))


def test_goodput_functions_are_short():
    """Every function of the policies and the goodput model fits a screen (60 lines)."""
    import ast
    for path in ("operator/pd_operator/policies.py", "operator/pd_operator/goodput.py"):
        tree = ast.parse((REPO / path).read_text())
        long = [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(tree)
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 60]
        assert not long, (path, long)
