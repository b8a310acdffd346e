"""The discrete-event fleet model of bench-policy-sim (pure): its timings follow the timing
models the simulated serving uses, and it drives the operator's own policy functions."""
import sys

import pytest

from pd_agent.timing import TimingModel
from pd_operator.api import PDDeploymentSpec
from tests.conftest import REPO

sys.path.insert(0, str(REPO / "bench"))

import fleetsim  # noqa: E402
import scenarios  # noqa: E402

T = TimingModel()


def spec(prefill=1, decoder=1, rebalance=None):
    run = scenarios.Run("x", prefill, prefill + decoder, rebalance)
    return PDDeploymentSpec.model_validate(scenarios.pddeployment(run, "x", "ns")["spec"])


def test_one_request_costs_prefill_pull_and_its_decode_steps():
    sim = fleetsim.FleetSim(spec(), [(0.5, 1000, 5)], T, 4, 64, 10)
    r = sim.run().requests[0]
    prefill = T.prefill_ms([1000]) / 1000
    pull = T.kv_transfer_ms(1000 * 64) / 1000
    steps = [T.decode_step_ms([1000 + i]) / 1000 for i in range(5)]
    assert r.first - 0.5 == pytest.approx(prefill + pull + steps[0], rel=1e-6)
    assert r.last - r.first == pytest.approx(sum(steps[1:]), rel=1e-6)


def test_requests_queued_behind_a_batch_share_the_next_batch_and_decode_steps():
    rows = [(0.0, 4000, 1), (0.1, 500, 3), (0.1, 500, 3), (0.1, 500, 3)]
    res = fleetsim.FleetSim(spec(), rows, T, 4, 64, 10).run()
    first, *three = res.requests
    assert len({round(r.first, 9) for r in three}) == 1, "one batch, one step: the same first token time"
    busy_until = T.prefill_ms([4000]) / 1000
    assert three[0].first == pytest.approx(busy_until + T.prefill_ms([500] * 3) / 1000
                                           + T.kv_transfer_ms(500 * 64) / 1000 + T.decode_step_ms([500] * 3) / 1000,
                                           rel=1e-6)


def test_a_late_request_joins_the_running_batch_at_a_step_boundary():
    rows = [(0.0, 100, 400), (3.0, 100, 2)]
    res = fleetsim.FleetSim(spec(), rows, T, 4, 64, 20).run()
    long, short = res.requests
    assert long.last is not None and short.last is not None
    # the second one finished long before the first: it did not wait for the batch to empty
    assert short.last < long.last
    # and its first token came within two steps of its cache arriving (the one in progress, its own)
    arrive = 3.0 + T.prefill_ms([100]) / 1000 + T.kv_transfer_ms(100 * 64) / 1000
    assert 0 < short.first - arrive <= 2 * T.decode_step_ms([100, 500]) / 1000


def test_manual_policy_switches_a_decoder_after_it_drains():
    rb = {"policy": "Manual", "manual": {"prefill": 2}, "cooldownSeconds": 0}
    rows = [(0.0, 200, 50)]
    res = fleetsim.FleetSim(spec(1, 3, rb), rows, T, 4, 64, 30, switch_s=0.5).run()
    assert res.switches == 1
    assert res.timeline[-1]["prefill"] == 2
    assert all(r.last is not None for r in res.requests)


def test_every_request_of_a_trace_finishes_under_a_policy():
    rows = [(i * 0.05, 800, 40) for i in range(400)]
    rb = {"policy": "Load", "evaluationIntervalSeconds": 2, "cooldownSeconds": 2}
    res = fleetsim.FleetSim(spec(2, 2, rb), rows, T, 4, 64, 20).run()
    assert all(r.last is not None for r in res.requests)
    s = fleetsim.summarize(res, 3000, 60)
    assert s["failed"] == 0 and s["requests"] == 400


@pytest.mark.parametrize("routers", [1, 2])
def test_requests_of_one_second_spread_over_the_prefills_as_the_gateway_sends_them(routers):
    # ten prompts in the same second, both prefills idle at the refresh: the router counts what it
    # sent each since, so both compute (herding would queue all ten on one)
    rows = [(0.5 + i * 0.01, 1000, 1) for i in range(10)]
    sim = fleetsim.FleetSim(spec(2, 1), rows, T, 4, 64, 10, routers=routers)
    res = sim.run()
    assert all(r.last is not None for r in res.requests)
    prefills = [e for e in sim.engines if e.role == "prefill"]
    assert all(len(e.busy) >= 2 for e in prefills), [e.busy for e in prefills]
