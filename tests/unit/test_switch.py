"""The switch state machine and the choice of pod (pure)."""
from dataclasses import replace

import pytest

from pd_operator.switch import (
    ABORT,
    RETARGETED,
    Book,
    Candidate,
    Intent,
    Limits,
    Switch,
    View,
    advance,
    choose,
    clamp_target,
    planning_role,
    retarget,
)

T0 = 1_800_000_000.0


def sw(frm="decoder", to="prefill", step="Drain", t=T0) -> Switch:
    return Switch(pod="d1", uid="u1", from_=frm, to=to, step=step, started=T0, step_started=t, reason="test")


def v(**kw) -> View:
    base = dict(exists=True, uid="u1", label="decoder", assigned="decoder", agent_ok=True, engine_role="decoder",
                draining=False)
    return View(**{**base, **kw})


def kinds(intents: list[Intent]) -> list[tuple[str, str | None]]:
    return [(i.kind, i.role) for i in intents]


def test_decoder_to_prefill_walks_every_step_on_what_is_observed():
    s, its, out = advance(sw(), v(in_flight=2, links_out=2), T0 + 0.1, 30)
    assert s.step == "Drain" and out is None
    assert kinds(its) == [("label", "switching"), ("drain", None)]
    # drained, but two decodes still running: stay, hold
    s, its, _ = advance(s, v(label="switching", draining=True, in_flight=2, links_out=2), T0 + 0.2, 30)
    assert s.step == "Drain" and its == []
    # in-flight work finished: Unlink, and the decoder's own links go
    s, its, _ = advance(s, v(label="switching", draining=True, links_out=2), T0 + 0.5, 30)
    assert s.step == "Unlink" and kinds(its) == [("unlink_all", None)]
    assert dict(s.durations)["Drain"] == 500.0
    # unlinked: SwitchRole annotates first (a restart from here comes back a prefill), then switches
    s, its, _ = advance(s, v(label="switching", draining=True), T0 + 0.6, 30)
    assert s.step == "SwitchRole" and kinds(its) == [("annotate", "prefill"), ("switch_role", "prefill")]
    obs = dict(label="switching", draining=True, assigned="prefill", engine_role="prefill")
    s, its, _ = advance(s, v(**obs), T0 + 0.7, 30)
    assert s.step == "Relink" and its == []       # the planner links it; the switch holds the drain
    s, its, _ = advance(s, v(**obs, relinked=True), T0 + 0.8, 30)
    assert s.step == "Verify" and kinds(its) == [("verify", None)]
    s, its, _ = advance(s, v(**obs, relinked=True, verified=True), T0 + 0.9, 30)
    assert s.step == "Undrain" and kinds(its) == [("undrain", None), ("label", "prefill")]
    s2, its, out = advance(s, v(**{**obs, "label": "prefill", "draining": False}), T0 + 1.0, 30)
    assert s2 is None and its == [] and out.result == "Completed"
    rec = out.record()
    assert rec["drainMs"] == 500 and rec["totalMs"] == 1000 and rec["switchMs"] == 200 and rec["relinkMs"] == 200
    assert rec["from"] == "decoder" and rec["to"] == "prefill" and rec["result"] == "Completed"


def test_prefill_to_decoder_waits_for_pending_caches_and_for_the_decoders_to_unlink_it():
    base = dict(label="switching", draining=True, engine_role="prefill", assigned="prefill")
    s = sw("prefill", "decoder")
    s, its, _ = advance(s, v(**base, pending_kv=1, links_in=2), T0 + 0.1, 30)
    assert s.step == "Drain"   # a cache waits to be pulled: links stay, it stays a prefill
    s, its, _ = advance(s, v(**base, links_in=2), T0 + 0.2, 30)
    assert s.step == "Unlink" and its == []   # decoders unlink it (the planner), never the prefill itself
    s, its, _ = advance(s, v(**base), T0 + 0.3, 30)
    assert s.step == "SwitchRole" and kinds(its) == [("annotate", "decoder"), ("switch_role", "decoder")]


def test_switch_role_waits_while_any_link_remains():
    s = sw("prefill", "decoder", step="SwitchRole")
    _, its, _ = advance(s, v(label="switching", draining=True, engine_role="prefill", assigned="prefill",
                             links_in=1), T0, 30)
    assert ("switch_role", "decoder") not in kinds(its)


def test_drain_timeout_aborts_and_puts_the_pod_back():
    s, its, _ = advance(sw(), v(label="switching", draining=True, in_flight=3), T0 + 31, 30)
    assert s.step == ABORT and "3 requests in flight" in s.message
    assert kinds(its) == [("undrain", None), ("label", "decoder")]
    s2, _, out = advance(s, v(draining=False), T0 + 31.2, 30)
    assert s2 is None and out.result == "Aborted" and "drain timed out" in out.message
    assert "switchMs" not in out.record()


def test_abort_after_annotate_reverts_the_assigned_role():
    s = sw(step="SwitchRole")
    obs = v(label="switching", draining=True, assigned="prefill", refused="LLM_FEATURE_NOT_ENABLED")
    s, its, _ = advance(s, obs, T0 + 1, 30)
    assert s.step == ABORT and ("annotate", "decoder") in kinds(its)


def test_a_restarted_container_is_drained_again_and_the_switch_resumes():
    # the pod came back (same pod, new process) in its new role, not draining
    s = sw(step="Relink")
    _, its, _ = advance(s, v(label="switching", draining=False, engine_role="prefill", assigned="prefill"), T0, 30)
    assert kinds(its) == [("drain", None)]


def test_pod_replaced_or_deleted_interrupts():
    _, _, out = advance(sw(step="Unlink"), v(uid="u2"), T0, 30)
    assert out.result == "Interrupted"
    _, _, out = advance(sw(step="Unlink"), View(exists=False), T0, 30)
    assert out.result == "Interrupted"


def test_an_operator_restart_resumes_from_status():
    s = sw(step="Verify", t=T0 + 2)
    s = replace(s, durations=(("Drain", 100.0), ("Unlink", 5.0)), attempts=1)
    back = Switch.from_status(s.to_status())
    assert back == s
    book = Book.from_status({"switches": [s.to_status()], "rebalance": {"cooldownUntil": "2027-01-15T08:00:05.000Z"}})
    assert book.switches == [s] and book.cooldown_until == T0 + 5


def test_planning_role_follows_engine_and_step():
    assert planning_role(sw(step="Drain"), "decoder", True, False) == ("decoder", True)
    assert planning_role(sw(step="Relink"), "prefill", True, False) == ("prefill", False)
    assert planning_role(sw(step="Relink"), "prefill", True, True) == ("prefill", True)
    assert planning_role(sw(step="SwitchRole"), None, True, False) == ("switching", True)


def c(pod, group, role, in_flight=0, available=True, switchable=True):
    return Candidate(pod=pod, uid=pod, group=group, role=role, available=available, switchable=switchable,
                     in_flight=in_flight)


FLEET = [c("p0", "prefill", "prefill"), c("p1", "prefill", "prefill"),
         c("d0", "decoder", "decoder", 3), c("d1", "decoder", "decoder", 1)]


def test_choose_the_fewest_in_flight_and_home_first():
    d = choose(FLEET, [], 3, Limits(), T0, "Manual")
    assert d.reason == "Switching" and d.start.pod == "d1" and (d.start.from_, d.start.to) == ("decoder", "prefill")
    # a prefill-group pod serving as decoder goes home first, even if busier
    fleet = FLEET + [c("p2", "prefill", "decoder", 9)]
    assert choose(fleet, [], 3, Limits(), T0, "Manual").start.pod == "p2"
    assert choose(FLEET, [], 1, Limits(), T0, "Manual").start.pod == "p0"


def test_choose_respects_target_limits_cooldown_and_readiness():
    assert choose(FLEET, [], 2, Limits(), T0, "m").reason == "AtTarget"
    assert choose(FLEET, [], None, Limits(), T0, "m").reason == "NoPolicy"
    assert choose(FLEET, [], 3, Limits(cooldown_until=T0 + 5), T0, "m").reason == "Cooldown"
    assert choose(FLEET, [sw()], 4, Limits(), T0, "m").reason == "SwitchInFlight"
    assert choose(FLEET, [], 3, Limits(), T0, "m", unsettled="pods not ready: d0").reason == "WaitingForFleet"
    # min counts: a switching or unready pod is unavailable
    one_up = [FLEET[0], FLEET[1], FLEET[2], replace(FLEET[3], available=False)]
    assert choose(one_up, [], 3, Limits(), T0, "m").reason == "MinCount"
    assert choose(FLEET, [], 3, Limits(min_decoder=2), T0, "m").reason == "MinCount"
    unswitchable = [*FLEET[:2], replace(FLEET[2], switchable=False), replace(FLEET[3], switchable=False)]
    assert choose(unswitchable, [], 3, Limits(), T0, "m").reason == "NoCandidate"


def test_clamp_target_keeps_one_of_each():
    assert clamp_target(4, 4, Limits()) == 3
    assert clamp_target(0, 4, Limits(min_prefill=0)) == 1
    assert clamp_target(2, 6, Limits(min_prefill=3)) == 3


def test_fault_point_fires_at_or_past_its_step():
    from pd_operator.faultpoint import reached
    s = sw("prefill", "decoder")
    assert not reached("prefill-to-decoder:Unlink", [s])
    # Drain and Unlink over in one pass (the decoders let go while it drained): recorded at SwitchRole
    s2 = s.at("Unlink", T0 + 1).at("SwitchRole", T0 + 1)
    assert reached("prefill-to-decoder:Unlink", [s2]) and reached("prefill-to-decoder:SwitchRole", [s2])
    assert not reached("decoder-to-prefill:Unlink", [s2]) and not reached("prefill-to-decoder:Relink", [s2])


BIG = [c(f"p{i}", "prefill", "prefill", in_flight=i) for i in range(8)] + \
    [c(f"d{i}", "decoder", "decoder", in_flight=i) for i in range(8)]


def test_choose_starts_a_whole_move_up_to_max_in_flight():
    d = choose(BIG, [], 13, Limits(max_in_flight=8), T0, "Goodput")
    assert d.reason == "Switching" and [s.pod for s in d.starts] == ["d0", "d1", "d2", "d3", "d4"]
    assert all((s.from_, s.to, s.step) == ("decoder", "prefill", "Drain") for s in d.starts)
    assert "5 decoders -> prefill" in d.message
    # the room left by the switches in flight, and the min count, cap the move
    assert len(choose(BIG, [sw()] * 6, 13, Limits(max_in_flight=8), T0, "m").starts) == 2
    assert len(choose(BIG, [], 15, Limits(max_in_flight=16, min_decoder=3), T0, "m").starts) == 5
    assert choose(BIG, [], 13, Limits(max_in_flight=8), T0, "m").start.pod == "d0"


def moving(pod, frm, to, step="Drain"):
    return Switch(pod=pod, uid=pod, from_=frm, to=to, step=step, started=T0, step_started=T0, reason="m")


@pytest.mark.parametrize("case, switching, target, aborted", [
    ("still wanted: nothing stops", [("d0", "Drain"), ("d1", "Drain")], 10, []),
    ("wanted and more", [("d0", "Drain")], 12, []),
    ("target lowered by one: the busiest drain stops", [("d0", "Drain"), ("d1", "Drain"), ("d3", "Drain")], 10,
     ["d3"]),
    ("target back where it was: every drain stops", [("d0", "Drain"), ("d1", "Drain")], 8, ["d0", "d1"]),
    ("past Drain they complete", [("d0", "Relink"), ("d1", "Drain")], 8, ["d1"]),
    ("turned around: every drain towards prefill stops", [("d0", "Drain")], 6, ["d0"]),
    ("no target", [("d0", "Drain")], None, []),
])
def test_retarget_stops_only_drains_that_overshoot(case, switching, target, aborted):
    sws = [moving(p, "decoder", "prefill", step) for p, step in switching]
    by = {p for p, _ in switching}
    members = [replace(m, role="prefill", available=False) if m.pod in by else m for m in BIG]
    out = retarget(sws, members, target, T0 + 1)
    assert [s.pod for s in out if s.step == ABORT] == aborted, case
    assert all(s.message.startswith(RETARGETED) for s in out if s.step == ABORT)
    assert [s.pod for s in out] == [s.pod for s in sws], "the order and the others are kept"


def test_retarget_a_move_down():
    sws = [moving("p5", "prefill", "decoder"), moving("p6", "prefill", "decoder")]
    members = [replace(m, role="decoder", available=False) if m.pod in ("p5", "p6") else m for m in BIG]
    assert [s.pod for s in retarget(sws, members, 7, T0) if s.step == ABORT] == ["p6"]


def test_a_whole_move_is_counted_not_listed_in_the_rebalancing_condition():
    from pd_operator.status import Observed, rebalancing
    sws = [moving(f"d{i}", "decoder", "prefill") for i in range(40)] + \
        [moving(f"e{i}", "decoder", "prefill", step="Relink") for i in range(24)]
    obs = Observed(generation=1, pods=[], engines=[], problems=[], switches=sws)
    ok, reason, message = rebalancing(obs)
    assert (ok, reason) == (True, "Switching")
    assert message == "64 switches: 40 decoder -> prefill at Drain; 24 decoder -> prefill at Relink"
    _, _, few = rebalancing(Observed(generation=1, pods=[], engines=[], problems=[], switches=sws[:2]))
    assert few.startswith("d0: decoder -> prefill, step Drain")


def test_an_unschedulable_pod_is_named_with_the_schedulers_reason_and_its_requests():
    from pd_operator.status import Observed, pods_ready
    ready = {"metadata": {"name": "x-prefill-0"}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    waiting = {"metadata": {"name": "x-prefill-1"},
               "spec": {"containers": [{"resources": {"requests": {"huawei.com/Ascend910": "8", "cpu": "1"}}}]},
               "status": {"phase": "Pending", "conditions": [{
                   "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                   "message": "0/3 nodes are available: 3 Insufficient huawei.com/Ascend910."}]}}
    ok, reason, message = pods_ready(Observed(generation=1, pods=[ready, waiting], engines=[], problems=[]), 2)
    assert (ok, reason) == (False, "Unschedulable")
    assert message == ("1/2 pods ready; x-prefill-1 cannot be scheduled: 0/3 nodes are available: 3 Insufficient "
                       "huawei.com/Ascend910. It requests cpu=1, huawei.com/Ascend910=8."), message
