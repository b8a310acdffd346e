"""Controller scenarios: the real Controller's passes against a fake API server and fake
agents (controller_fakes.py), with the order of every call recorded. Each runs in
milliseconds, so an ordering bug (acting before recording, a lost switch step after a
restart, a requeue that never comes) shows here before it costs a cluster run."""
from __future__ import annotations

import copy
import time
from pathlib import Path

import pytest
import yaml

from pd_operator import reconcile as rc
from pd_operator.decide import SETTLED_POLL_S
from pd_operator.reconcile import ACTED_DELAY_S, Controller, TerminalError, error_policy
from pd_operator.state import LINK_BACKOFF
from pd_operator.switch import STEPS
from tests.unit.controller_fakes import Agent, FakeAgents, FakeKube, Log, pod

REPO = Path(__file__).resolve().parents[2]
SPEC = yaml.safe_load((REPO / "examples" / "sim-small.yaml").read_text())["spec"]
KEY = ("ns", "x")
MANUAL = {"policy": "Manual", "manual": {"prefill": 2}, "cooldownSeconds": 0, "drainTimeoutSeconds": 30}


class Clock:
    """The controller's clock: real time plus what a test skips ahead (`advance`)."""

    def __init__(self) -> None:
        self.skipped = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.skipped

    def time(self) -> float:
        return time.time() + self.skipped

    def advance(self, seconds: float) -> None:
        self.skipped += seconds


class World:
    """One PDDeployment `ns/x`, the fake API server, the fake agents and a Controller."""

    def __init__(self, spec: dict | None = None, status: dict | None = None):
        self.clock = Clock()
        self.log = Log()
        self.kube = FakeKube(self.log)
        self.agents = FakeAgents(self.log)
        self.body = {"apiVersion": "pdoperator.io/v1alpha1", "kind": "PDDeployment",
                     "metadata": {"name": "x", "namespace": "ns", "uid": "uid-x", "generation": 1},
                     "spec": spec or copy.deepcopy(SPEC), **({"status": status} if status else {})}
        self.kube.objects[("PDDeployment", "ns", "x")] = self.body
        self.ctl = self.controller()

    def controller(self, **kw) -> Controller:
        """A fresh Controller (as after an operator restart) that sees the stored objects."""
        # no worker tasks: the test runs the passes
        ctl = Controller(self.kube, self.agents, self.agents.metrics, clock=self.clock, workers=False, **kw)
        self.kube.controller = ctl
        ctl.on_deployment("ADDED", copy.deepcopy(self.kube.objects[("PDDeployment", "ns", "x")]))
        for (kind, _, _), obj in list(self.kube.objects.items()):
            if kind == "Pod":
                ctl.on_pod("ADDED", copy.deepcopy(obj))
        self.ctl = ctl
        return ctl

    def add_pods(self, prefill: int = 2, decoder: int = 2, initialized: bool = True) -> None:
        for group, n, base, role in (("prefill", prefill, 0, "prompt"), ("decoder", decoder, 1000, "decoder")):
            if ("StatefulSet", "ns", f"x-{group}") not in self.kube.objects:   # pods come from their StatefulSet
                self.kube.feed(self.kube.store({
                    "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {
                        "name": f"x-{group}", "namespace": "ns", "labels": {"pdoperator.io/deployment": "x"},
                        "ownerReferences": [{"kind": "PDDeployment", "name": "x", "uid": "uid-x",
                                             "controller": True}]}}))
            for i in range(n):
                name = f"x-{group}-{i}"
                ip = f"127.9.{base // 1000}.{i + 1}"
                p = pod(name, group, i, ip)
                self.kube.objects[("Pod", "ns", name)] = p
                self.agents.agents[f"http://{ip}:8080"] = Agent(name, role, base + i, ip, initialized=initialized)
                self.ctl.on_pod("ADDED", copy.deepcopy(p))

    def agent(self, pod_name: str) -> Agent:
        return next(a for a in self.agents.agents.values() if a.pod == pod_name)

    @property
    def status(self) -> dict:
        return self.kube.objects[("PDDeployment", "ns", "x")].get("status", {})

    def condition(self, ctype: str) -> dict:
        return next((c for c in self.status.get("conditions", []) if c["type"] == ctype), {})

    async def step(self) -> float | None:
        return await self.ctl.reconcile(KEY)

    async def settle(self, passes: int = 30) -> float | None:
        """Passes until one does not act (it asks for a later look, not an immediate one)."""
        for _ in range(passes):
            delay = await self.step()
            if delay != ACTED_DELAY_S and not self.status.get("switches"):
                return delay
        raise AssertionError(f"not settled in {passes} passes; last calls {[c[:2] for c in self.log[-12:]]}")

    def patch_spec(self, **rebalance) -> None:
        obj = self.kube.objects[("PDDeployment", "ns", "x")]
        obj["spec"]["rebalance"] = {**obj["spec"].get("rebalance", {}), **rebalance}
        obj["metadata"]["generation"] += 1
        self.ctl.on_deployment("MODIFIED", copy.deepcopy(obj))


async def ready_world(spec: dict | None = None) -> World:
    w = World(spec)
    w.add_pods()
    await w.settle()
    assert w.status["phase"] == "Ready", w.status
    return w


# ---- a fresh deployment ------------------------------------------------------------------------

async def test_first_pass_applies_children_creates_tokens_and_records_pending():
    w = World()
    delay = await w.step()
    assert delay == ACTED_DELAY_S
    applied = [c[1] for c in w.log if c[0] == "apply"]
    assert applied[:5] == ["ConfigMap", "Service", "Service", "Service", "Service"]
    assert applied.count("StatefulSet") == 2 and "NetworkPolicy" in applied
    assert ("create", "Secret", "x-agent-token") in w.log and ("create", "Secret", "x-agent-data-token") in w.log
    # the status is recorded before anything is applied
    assert w.log.kinds()[0] == "status" and w.status["phase"] == "Pending"
    assert any(c[0] == "event" and c[1] == "Created" for c in w.log)


async def test_first_links_of_a_fresh_deployment_then_verified_ready():
    w = World()
    w.add_pods()
    await w.settle()
    links = [c for c in w.log if c[0] == "agent.link"]
    assert sorted(c[1] for c in links) == ["x-decoder-0", "x-decoder-1"], "each decoder links once, to both"
    assert not any(c[0] == "agent.link" and c[1].startswith("x-prefill") for c in w.log), "prefills never dial"
    assert set(w.agent("x-decoder-0").links) == {0, 1} and set(w.agent("x-decoder-1").links) == {0, 1}
    assert w.log.count("agent.verify") >= 2
    assert w.status["linksSummary"] == "4/4" and w.condition("KVPathVerified")["status"] == "True"
    assert w.status["observedGeneration"] == 1


async def test_an_uninitialised_engine_is_initialised_before_it_is_linked():
    w = World()
    w.add_pods(initialized=False)
    await w.settle()
    assert w.log.count("agent.init") == 4
    first_link = next(i for i, c in enumerate(w.log) if c[0] == "agent.link")
    assert all(i < first_link for i, c in enumerate(w.log) if c[0] == "agent.init")
    assert w.status["phase"] == "Ready"


# ---- steady state: quiet, and requeues ---------------------------------------------------------

async def test_a_settled_pass_writes_nothing_and_requeues_later():
    w = await ready_world()
    before = len(w.log)
    delay = await w.step()
    assert [c for c in w.log[before:] if c[0] in ("status", "apply", "agent.link", "event")] == []
    assert 0.5 <= delay <= rc.RESYNC_S


async def test_requeue_delays_follow_what_the_pass_did():
    w = World()
    assert await w.step() == ACTED_DELAY_S                  # applied children: look again at once
    delay = await w.settle()                                 # no pods yet: Pending, look again soon
    assert w.status["phase"] == "Pending" and delay <= rc.NOT_READY_RESYNC_S
    assert error_policy(TerminalError("X", "y"), 1) is None  # terminal: wait for a spec change
    assert [error_policy(RuntimeError(), n) for n in (1, 2, 3, 10)] == [0.5, 1.0, 2.0, 30.0]


# ---- repair -----------------------------------------------------------------------------------

async def test_a_broken_link_is_dropped_by_force_and_made_again():
    w = await ready_world()
    d0 = w.agent("x-decoder-0")
    d0.links[1] = {**d0.links[1], "code": "LLM_WAIT_PROCESS_TIMEOUT", "healthy": False}
    w.clock.advance(SETTLED_POLL_S)   # a settled member is asked again this often
    before = len(w.log)
    await w.settle()
    calls = [c for c in w.log[before:] if c[0].startswith("agent.") and c[1] == "x-decoder-0"]
    assert ("agent.force_unlink", "x-decoder-0") in calls and ("agent.link", "x-decoder-0") in calls
    assert calls.index(("agent.force_unlink", "x-decoder-0")) < calls.index(("agent.link", "x-decoder-0"))
    assert d0.links[1]["healthy"] and w.status["linksSummary"] == "4/4"


async def test_drift_is_repaired_with_an_event():
    w = await ready_world()
    sts = w.kube.objects[("StatefulSet", "ns", "x-prefill")]
    sts["spec"]["replicas"] = 7     # changed outside the operator
    stored = w.kube.store(sts)
    w.ctl.on_child("MODIFIED", copy.deepcopy(stored))
    before = len(w.log)
    await w.settle()
    assert ("apply", "StatefulSet", "x-prefill") in w.log[before:]
    assert w.kube.objects[("StatefulSet", "ns", "x-prefill")]["spec"]["replicas"] == 2
    assert any(c[0] == "event" and c[1] == "DriftRepaired" for c in w.log[before:])


async def test_a_failed_link_is_reported_retried_after_backoff_and_recovers():
    w = World()
    w.add_pods()
    w.agents.link_codes[(1000, 1)] = "LLM_LINK_FAILED"
    await w.settle()
    assert w.status["phase"] == "Degraded" and w.condition("LinksReady")["reason"] == "EndpointUnreachable"
    assert "x-prefill-1" in w.condition("LinksReady")["message"]
    assert any(c[0] == "event" and c[1] == "EndpointUnreachable" for c in w.log)
    tries = sum(1 for c in w.log if c == ("agent.link", "x-decoder-0"))
    await w.step()
    assert sum(1 for c in w.log if c == ("agent.link", "x-decoder-0")) == tries, "not retried hot"
    del w.agents.link_codes[(1000, 1)]
    w.clock.advance(LINK_BACKOFF[1])   # its backoff is over
    await w.settle()
    assert w.status["phase"] == "Ready" and w.status["linksSummary"] == "4/4"


# ---- agents that do not answer as they should --------------------------------------------------

@pytest.mark.parametrize("kind", ["AgentBadReply", "AgentUnreachable"])
async def test_an_agent_that_answers_nonsense_or_not_at_all_is_a_condition_not_a_crash(kind):
    w = World()
    w.add_pods()
    w.agent("x-prefill-1").broken = kind
    delay = await w.settle()
    c = w.condition("AgentsReady")
    assert c["status"] == "False" and c["reason"] == kind and "x-prefill-1" in c["message"]
    assert w.status["phase"] == "Degraded" and delay is not None
    # the others are linked among themselves meanwhile
    assert set(w.agent("x-decoder-0").links) == {0}
    asked = w.log.count("agent.status")
    await w.step()
    assert w.log.count("agent.status") == asked, "a failing agent is asked again only after its backoff"


async def test_an_invalid_spec_is_terminal():
    w = World({**SPEC, "datadist": {"port": "not-a-port"}})
    with pytest.raises(TerminalError) as e:
        await w.step()
    assert e.value.diagnosis.reason == "InvalidSpec"


async def test_an_apply_the_api_server_rejects_is_reported_and_tried_again_with_backoff():
    w = World()
    w.kube.reject["StatefulSet"] = (403, "exceeded quota: compute-resources")
    delay = await w.ctl.pass_once(KEY)   # as its worker runs it: the failure through the error policy
    assert any(c[0] == "event" and c[1] == "ApplyRejected" for c in w.log)
    assert delay == 5.0, "tried again later, not only on a spec change"
    c = w.condition("Ready")
    assert w.status["phase"] == "Degraded" and c["reason"] == "ApplyRejected"
    assert "exceeded quota" in c["message"] and "tried again in 5s" in c["message"], c
    # before it is due nothing is applied; refused again, the wait doubles
    applies = sum(1 for x in w.log if x[0] == "apply")
    await w.step()
    assert sum(1 for x in w.log if x[0] == "apply") == applies
    w.clock.advance(6)
    with pytest.raises(TerminalError) as e:
        await w.step()
    assert e.value.retry_s == 10.0
    # the quota is raised elsewhere: the next try is taken, without a spec change
    del w.kube.reject["StatefulSet"]
    w.clock.advance(14)
    w.add_pods()
    await w.settle()
    assert w.status["phase"] == "Ready" and w.condition("Ready")["reason"] == "Ready"


async def test_a_retried_apply_is_not_taken_while_a_token_secret_is_foreign():
    import base64
    w = World()
    w.kube.reject["StatefulSet"] = (403, "exceeded quota")
    with pytest.raises(TerminalError):
        await w.step()
    # someone replaces the control token Secret's content meanwhile
    sec = w.kube.objects[("Secret", "ns", "x-agent-token")]
    sec["data"] = {"token": base64.b64encode(b"chosen-by-them").decode()}
    sec.pop("stringData", None)
    del w.kube.reject["StatefulSet"]
    w.clock.advance(60)   # past the retry and the token's re-read
    applies = sum(1 for c in w.log if c[0] == "apply" and c[1] == "StatefulSet")
    await w.step()
    assert sum(1 for c in w.log if c[0] == "apply" and c[1] == "StatefulSet") == applies
    assert w.condition("Ready")["reason"] == "TokenSecretNotOwned"


# ---- live switching ----------------------------------------------------------------------------

def switch_steps(log: Log) -> list[str]:
    out: list[str] = []
    for c in log:
        if c[0] == "status":
            for s in c[1].get("switches", []):
                if not out or out[-1] != s["step"]:
                    out.append(s["step"])
    return out


async def test_decoder_to_prefill_walks_every_step_and_records_each_before_acting():
    w = await ready_world({**SPEC, "rebalance": MANUAL})
    w.patch_spec(manual={"prefill": 3})
    start = len(w.log)
    await w.settle()
    log = Log(w.log[start:])
    assert switch_steps(log) == ["Drain", "Unlink", "SwitchRole", "Relink", "Verify", "Undrain"]
    last = w.status["lastSwitch"]
    assert last["result"] == "Completed" and last["from"] == "decoder" and last["to"] == "prefill"
    pod_ = last["pod"]
    assert w.agent(pod_).role == "prompt" and not w.agent(pod_).draining
    assert w.status["prefill"] == 3 and w.status["linksSummary"] == "3/3"
    # each action comes after the status that recorded its step
    first_status = {step: next(i for i, c in enumerate(log) if c[0] == "status"
                               and any(s["step"] == step for s in c[1].get("switches", [])))
                    for step in ("Drain", "Unlink", "SwitchRole")}
    assert first_status["Drain"] < next(i for i, c in enumerate(log) if c == ("agent.drain", pod_))
    assert first_status["Unlink"] < next(i for i, c in enumerate(log) if c == ("agent.unlink", pod_))
    assert first_status["SwitchRole"] < next(i for i, c in enumerate(log) if c == ("agent.switch_role", pod_))
    labels = [c[3]["metadata"]["labels"]["pdoperator.io/role"] for c in log
              if c[0] == "patch" and c[2] == pod_ and "labels" in c[3]["metadata"]]
    assert labels == ["switching", "prefill"]


@pytest.mark.parametrize("crash_at", ["Drain", "Unlink", "SwitchRole", "Relink", "Verify", "Undrain"])
async def test_a_restarted_operator_resumes_the_switch_from_status(crash_at):
    w = await ready_world({**SPEC, "rebalance": MANUAL})
    seen: list[str] = []

    class Crash(Exception):
        pass

    def stop_at(switches):
        if any(s.step == crash_at for s in switches):
            seen.append(crash_at)
            raise Crash
    w.controller(after_record=stop_at)
    w.patch_spec(manual={"prefill": 3})
    with pytest.raises(Crash):
        await w.settle()
    recorded = w.status["switches"][0]
    assert recorded["step"] == crash_at
    # a new operator: no memory, only what status recorded
    w.controller()
    start = len(w.log)
    await w.settle()
    # the step as stored is not written again (nothing changed); the next recorded is the one after it
    steps = [recorded["step"], *switch_steps(Log(w.log[start:]))]
    steps = [x for i, x in enumerate(steps) if i == 0 or steps[i - 1] != x]
    assert steps == list(STEPS[STEPS.index(crash_at):len(steps) + STEPS.index(crash_at)]), \
        f"resumed where it was, not started again: {steps}"
    assert w.status["lastSwitch"]["result"] == "Completed" and w.status["prefill"] == 3
    assert w.log[start:].count(("agent.drain", recorded["pod"])) == 0 or crash_at == "Drain"


async def test_prefill_to_decoder_waits_for_pending_caches_then_completes():
    w = await ready_world({**SPEC, "rebalance": MANUAL})
    for p in ("x-prefill-0", "x-prefill-1"):
        w.agent(p).pending_kv = 1
    w.patch_spec(manual={"prefill": 1})
    for _ in range(5):
        await w.step()
    assert w.status["switches"][0]["step"] == "Drain", "a cache waits: it stays a prefill, linked"
    pod_ = w.status["switches"][0]["pod"]
    assert w.agent(pod_).role == "prompt" and w.agent(pod_).incoming
    w.agent(pod_).pending_kv = 0
    await w.settle()
    assert w.status["lastSwitch"]["result"] == "Completed" and w.agent(pod_).role == "decoder"
    assert w.status["decoder"] == 3 and w.status["linksSummary"] == "3/3"


async def test_drain_timeout_aborts_and_puts_the_pod_back():
    w = await ready_world({**SPEC, "rebalance": {**MANUAL, "drainTimeoutSeconds": 0, "cooldownSeconds": 600}})
    for d in ("x-decoder-0", "x-decoder-1"):
        w.agent(d).in_flight = 1
    w.patch_spec(manual={"prefill": 3})
    await w.settle()
    last = w.status["lastSwitch"]
    assert last["result"] == "Aborted" and "drain timed out" in last["message"]
    a = w.agent(last["pod"])
    assert a.role == "decoder" and not a.draining
    assert w.kube.objects[("Pod", "ns", last["pod"])]["metadata"]["labels"]["pdoperator.io/role"] == "decoder"
    assert any(c[0] == "event" and c[1] == "SwitchAborted" for c in w.log)
    assert w.condition("Rebalancing")["reason"] == "Cooldown"


async def test_paused_starts_no_switch_says_what_it_would_and_withdraws_a_drain():
    w = await ready_world({**SPEC, "rebalance": {**MANUAL, "paused": True}})
    w.patch_spec(manual={"prefill": 3})
    await w.settle()
    assert not w.status.get("switches") and "lastSwitch" not in w.status
    c = w.condition("Rebalancing")
    assert c["reason"] == "Paused" and "spec.rebalance.paused" in c["message"] and "3" in c["message"], c
    # unpaused, the move starts; paused again while it drains, it is withdrawn (the pod stays)
    for d in ("x-decoder-0", "x-decoder-1"):
        w.agent(d).in_flight = 1
    w.patch_spec(paused=False)
    await w.step()
    assert w.status["switches"][0]["step"] == "Drain"
    w.patch_spec(paused=True)
    await w.settle()
    last = w.status["lastSwitch"]
    assert last["result"] == "Aborted" and "spec.rebalance.paused" in last["message"]
    assert w.agent(last["pod"]).role == "decoder" and not w.agent(last["pod"]).draining
    assert "retryAfter" not in w.status.get("rebalance", {}), "a pause is not a failure to cool down from"


async def test_a_switch_past_drain_finishes_under_pause():
    w = await ready_world({**SPEC, "rebalance": MANUAL})
    w.patch_spec(manual={"prefill": 3})
    while w.status.get("switches", [{}])[0].get("step") in (None, "Drain"):
        await w.step()
    w.patch_spec(paused=True)
    await w.settle()
    assert w.status["lastSwitch"]["result"] == "Completed" and w.status["prefill"] == 3


def annotate_abort(w: World, pod_: str) -> None:
    obj = w.kube.objects[("PDDeployment", "ns", "x")]
    obj["metadata"].setdefault("annotations", {})["pdoperator.io/switch-abort"] = pod_
    w.ctl.on_deployment("MODIFIED", copy.deepcopy(obj))


async def test_switch_abort_before_switch_role_puts_the_pod_back_and_clears_the_annotation():
    w = await ready_world({**SPEC, "rebalance": {**MANUAL, "cooldownSeconds": 600}})
    for d in ("x-decoder-0", "x-decoder-1"):
        w.agent(d).in_flight = 1   # held in Drain
    w.patch_spec(manual={"prefill": 3})
    await w.step()
    pod_ = w.status["switches"][0]["pod"]
    annotate_abort(w, pod_)
    await w.settle()
    last = w.status["lastSwitch"]
    assert last["pod"] == pod_ and last["result"] == "Aborted" and "aborted on request" in last["message"]
    assert w.agent(pod_).role == "decoder" and not w.agent(pod_).draining
    assert "pdoperator.io/switch-abort" not in w.kube.objects[("PDDeployment", "ns", "x")]["metadata"]["annotations"]
    assert w.status["rebalance"]["retryAfter"], "the policy does not start it again at once"


async def test_switch_abort_past_switch_role_is_refused_with_what_finishing_requires():
    w = await ready_world({**SPEC, "rebalance": MANUAL})
    w.agents.verify_ok = False   # held in Verify: the probes through it fail
    w.patch_spec(manual={"prefill": 3})
    while w.status.get("switches", [{}])[0].get("step") != "Verify":
        await w.step()
    pod_ = w.status["switches"][0]["pod"]
    annotate_abort(w, pod_)
    await w.step()
    c = w.condition("Rebalancing")
    assert c["reason"] == "AbortRefused" and pod_ in c["message"] and "past switch_role" in c["message"], c
    assert w.kube.objects[("PDDeployment", "ns", "x")]["metadata"]["annotations"]["pdoperator.io/switch-abort"]
    w.agents.verify_ok = True
    w.clock.advance(600)   # past the failed probes' backoff
    await w.settle()
    assert w.status["lastSwitch"]["result"] == "Completed"
    assert "pdoperator.io/switch-abort" not in w.kube.objects[("PDDeployment", "ns", "x")]["metadata"]["annotations"]


async def test_a_switch_stuck_in_a_step_is_named_with_what_to_check():
    from pd_operator import switch as sw_
    s = sw_.Switch(pod="p", uid="u", from_="decoder", to="prefill", step="Relink", started=0, step_started=0,
                   message="link: LLM_LINK_FAILED")
    assert sw_.stuck([s], 100, 300) is None
    msg = sw_.stuck([s], 400, 300)
    assert msg.startswith("p in step Relink since 1970-01-01T00:00:00") and "LinksReady" in msg \
        and "LLM_LINK_FAILED" in msg
    assert sw_.stuck([s], 500, 300) == msg, "the same message pass after pass: no status write for the clock"


async def test_a_leaving_prefill_keeps_its_links_until_its_agent_refuses_work():
    w = await ready_world()
    p1 = w.kube.objects[("Pod", "ns", "x-prefill-1")]
    p1["metadata"]["deletionTimestamp"] = "2027-01-01T00:00:00Z"
    w.ctl.on_pod("MODIFIED", copy.deepcopy(w.kube.store(p1)))
    for _ in range(3):
        await w.step()
    assert 1 in w.agent("x-decoder-0").links, "still taking requests: its links stay"
    w.agent("x-prefill-1").draining = True      # SIGTERM reached it
    w.clock.advance(SETTLED_POLL_S)
    await w.settle()
    assert 1 not in w.agent("x-decoder-0").links and 1 not in w.agent("x-decoder-1").links
    assert not any(c[0] == "agent.force_unlink" for c in w.log), "unlinked normally, not by force"


# ---- the pure core ----------------------------------------------------------------------------

async def test_decide_is_deterministic_and_changes_none_of_its_inputs():
    from pd_operator.decide import decide
    w = await ready_world({**SPEC, "rebalance": MANUAL})
    w.patch_spec(manual={"prefill": 3})
    await w.step()   # a switch is in flight: the richest kind of pass
    snap = await w.ctl.observer.observe(KEY, w.ctl.deployments[KEY])
    mem = snap.memory
    before = (copy.deepcopy(mem.book), dict(mem.reports), dict(mem.next_poll), dict(mem.failures),
              mem.verified_links, copy.deepcopy(snap.body))
    a, b = decide(snap), decide(snap)
    for field in ("status", "to_apply", "links", "verify", "verify_after_links", "switch_intents", "started",
                  "outcomes", "events", "decisions"):
        assert getattr(a, field) == getattr(b, field), field
    assert a.memory is not mem and a.memory.book is not mem.book
    assert (mem.book, dict(mem.reports), dict(mem.next_poll), dict(mem.failures), mem.verified_links,
            snap.body) == before, "decide changed its snapshot"


def test_the_decide_side_imports_nothing_that_does_io():
    import subprocess
    import sys
    code = ("import sys, pd_operator.decide; "
            "print(sorted(m for m in ('httpx', 'kubernetes', 'aiohttp', 'kopf') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


async def test_replace_applies_the_grown_group_in_the_pass_that_decided_it():
    w = await ready_world({**SPEC, "rebalance": {**MANUAL, "method": "Replace"}})
    w.patch_spec(manual={"prefill": 3})
    start = len(w.log)
    await w.step()
    assert ("apply", "StatefulSet", "x-prefill") in w.log[start:], "applied when decided, not a resync later"
    assert w.kube.objects[("StatefulSet", "ns", "x-prefill")]["spec"]["replicas"] == 3
    assert w.status["rebalance"]["groupSizes"] == {"prefill": 3, "decoder": 2, "growing": "prefill", "moving": 1}


async def test_a_move_in_progress_follows_a_new_target_and_its_stopped_drains_hold_nothing_back():
    w = await ready_world({**SPEC, "rebalance": {**MANUAL, "cooldownSeconds": 600, "maxConcurrentSwitches": "50%"}})
    for d in ("x-decoder-0", "x-decoder-1"):
        w.agent(d).in_flight = 1
    w.patch_spec(manual={"prefill": 3})
    for _ in range(3):
        await w.step()
    pod_ = w.status["switches"][0]["pod"]
    assert w.status["switches"][0]["step"] == "Drain", "a decode in flight holds the drain"
    w.patch_spec(manual={"prefill": 2})
    await w.settle()
    last = w.status["lastSwitch"]
    assert (last["pod"], last["result"]) == (pod_, "Aborted") and last["message"].startswith("no longer wanted")
    a = w.agent(pod_)
    assert a.role == "decoder" and not a.draining and not w.status.get("switches")
    assert "retryAfter" not in w.status.get("rebalance", {}), "the policy stopped it: no hold"
    assert w.condition("Rebalancing")["reason"] == "AtTarget"


def test_resyncs_are_spread_over_deployments():
    """Deployments that settled together do not resync together: a fixed offset per key."""
    delays = {rc.resync_s(("ns", f"d-{i}")) for i in range(100)}
    assert all(0.8 * rc.RESYNC_S <= d <= rc.RESYNC_S for d in delays)
    assert len(delays) > 80 and max(delays) - min(delays) > 0.15 * rc.RESYNC_S
    assert rc.resync_s(("ns", "d-1")) == rc.resync_s(("ns", "d-1"))


def test_every_kind_of_switch_intent_has_its_handler():
    """Intents are dispatched from one table typed by IntentKind: none falls through."""
    from typing import get_args

    from pd_operator import act
    from pd_operator.switch import IntentKind
    assert set(act.INTENTS) == set(get_args(IntentKind))
    assert {k for k, (calls_agent, _) in act.INTENTS.items() if not calls_agent} == {"label", "annotate"}


async def test_a_restarted_operator_adopts_children_as_applied_and_still_repairs_later_drift():
    w = await ready_world()
    w.controller()                     # a restart (or a takeover): nothing remembered
    before = len(w.log)
    await w.settle()
    assert not [c for c in w.log[before:] if c[0] == "apply"], "children stamped with their form: not re-applied"
    assert not [c for c in w.log[before:] if c[0] == "event" and c[1] in ("Updated", "Created")]
    sts = w.kube.objects[("StatefulSet", "ns", "x-prefill")]
    sts["spec"]["replicas"] = 7        # changed outside the operator, after the restart
    w.ctl.on_child("MODIFIED", copy.deepcopy(w.kube.store(sts)))
    await w.settle()
    assert w.kube.objects[("StatefulSet", "ns", "x-prefill")]["spec"]["replicas"] == 2


def test_a_child_someone_else_wrote_is_not_adopted_but_applied():
    from pd_operator import children as ch
    desired = [ch.stamped({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s"}, "spec": {"a": 1}})]
    stamp = desired[0]["metadata"]["annotations"]
    ours = {"metadata": {"name": "s", "annotations": stamp, "resourceVersion": "5",
                         "managedFields": [{"manager": "pd-operator", "operation": "Apply"},
                                           {"manager": "kube-controller-manager", "subresource": "status"}]}}
    edited = {"metadata": {**ours["metadata"], "managedFields": ours["metadata"]["managedFields"] + [
        {"manager": "kubectl-edit", "operation": "Update"}]}}
    assert ch.adopt(desired, {("Service", "s"): ours}, {}, "pd-operator") == {
        ("Service", "s"): (ch.digest(desired[0]), "rv5")}
    assert ch.adopt(desired, {("Service", "s"): edited}, {}, "pd-operator") == {}, "edited while no one led"


# ---- a takeover keeps a verification that still holds (verification.py) -------------------------

def verifies(w: World, since: int) -> int:
    return sum(1 for c in w.log[since:] if c[0] == "agent.verify")


async def test_a_new_leader_takes_a_recent_round_over_the_same_links_and_stays_ready():
    w = await ready_world()
    recorded = copy.deepcopy(w.status["lastVerified"])
    assert recorded.get("links"), "the round's link digest is recorded"
    w.controller()                     # a takeover: nothing remembered
    before = len(w.log)
    for _ in range(3):
        await w.step()
        assert w.status["phase"] == "Ready" and w.condition("KVPathVerified")["status"] == "True", w.status
    assert verifies(w, before) == 0, "the round recorded a moment ago stands"
    assert not [c for c in w.log[before:] if c[0] == "status"], "nothing changed: nothing written"
    assert w.status["lastVerified"] == recorded
    assert not [c for c in w.log[before:] if c[0] == "event" and c[1] == "KVPathVerified"]
    w.clock.advance(61)                # the interval from the recorded round, not from the takeover
    await w.settle()
    assert verifies(w, before) >= 2
    assert w.status["lastVerified"]["at"] != recorded["at"] and w.status["lastVerified"]["links"] == recorded["links"]


@pytest.mark.parametrize("change", ["restarted", "old"])
async def test_a_new_leader_verifies_at_once_when_the_recorded_round_does_not_hold(change):
    w = await ready_world()
    if change == "restarted":          # same links, another engine process behind one end
        w.agent("x-prefill-0").boot_id = "boot-2"
    else:
        w.clock.advance(61)
    w.controller()
    before = len(w.log)
    await w.step()
    assert verifies(w, before) >= 2, "verified in the first pass"
    await w.settle()
    assert w.condition("KVPathVerified")["status"] == "True"


async def test_a_child_name_another_owner_controls_is_not_applied_over():
    """A PDGateway named `x-engines` owns a NetworkPolicy of the name this deployment's engines'
    policy has: the operator does not apply over it (it would replace the other owner's object, or
    the other would replace the engines' and open the datadist port); nothing of this generation is
    applied, and the condition names the object and its owner."""
    w = World()
    w.kube.store({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {
        "name": "x-engines", "namespace": "ns", "ownerReferences": [
            {"apiVersion": "pdoperator.io/v1alpha1", "kind": "PDGateway", "name": "x-engines", "uid": "uid-gw",
             "controller": True}]}, "spec": {"podSelector": {}}})
    with pytest.raises(TerminalError, match="NetworkPolicy x-engines is controlled by PDGateway x-engines"):
        await w.step()
    await w.step()   # before the retry is due: reported, nothing applied
    assert not [c for c in w.log if c[0] == "apply"], [c[:2] for c in w.log if c[0] == "apply"]
    ready = w.condition("Ready")
    assert ready["reason"] == "NameTaken" and "NetworkPolicy x-engines" in ready["message"]
    assert "PDGateway x-engines" in ready["message"]
    assert w.kube.objects[("NetworkPolicy", "ns", "x-engines")]["metadata"]["ownerReferences"][0]["uid"] == "uid-gw"
    del w.kube.objects[("NetworkPolicy", "ns", "x-engines")]   # the PDGateway renamed: applied when due
    w.clock.advance(60)
    await w.step()
    assert any(c[0] == "apply" and c[1] == "NetworkPolicy" for c in w.log)
    await w.step()   # the status of the pass after the apply
    assert w.condition("Ready")["reason"] != "NameTaken"


async def test_inference_pools_follow_the_spec_and_the_crd_and_pods_get_llmd_labels():
    spec = {**copy.deepcopy(SPEC), "routing": {"inferencePool": True, "poolScope": "Role"}}
    w = World(spec)
    w.add_pods()
    await w.settle()
    cond = w.condition("InferencePoolReady")
    assert (cond["status"], cond["reason"]) == ("False", "CRDNotInstalled"), cond
    assert not [c for c in w.log if c[:2] == ("apply", "InferencePool")]
    for (kind, _, name), obj in w.kube.objects.items():   # the labels, whatever the pools
        if kind == "Pod":
            labels = obj["metadata"]["labels"]
            assert labels["llm-d.ai/role"] == ("prefill" if "prefill" in name else "decode"), labels
            assert labels["llm-d.ai/inferenceServing"] == "true"
    # the CRD is installed: found within the operator's next look, the pools follow
    w.kube.served.add("inferencepools")
    w.clock.advance(31)
    await w.settle()
    pools = sorted(n for (k, _, n) in w.kube.objects if k == "InferencePool")
    assert pools == ["x-decode", "x-prefill"]
    cond = w.condition("InferencePoolReady")
    assert (cond["status"], cond["reason"]) == ("True", "Kept"), cond
    assert "x-prefill: 2 serving pods; x-decode: 2 serving pods" in cond["message"]
    applies = len([c for c in w.log if c[:2] == ("apply", "InferencePool")])
    await w.step()
    assert len([c for c in w.log if c[:2] == ("apply", "InferencePool")]) == applies, "kept, not re-applied"
    # routing off: the pools go with it, and the condition
    obj = w.kube.objects[("PDDeployment", "ns", "x")]
    del obj["spec"]["routing"]
    obj["metadata"]["generation"] += 1
    w.ctl.on_deployment("MODIFIED", copy.deepcopy(obj))
    await w.settle()
    assert not [n for (k, _, n) in w.kube.objects if k == "InferencePool"]
    assert w.condition("InferencePoolReady") == {}


async def test_with_rollout_the_statefulsets_are_applied_held_at_their_partition():
    spec = {**copy.deepcopy(SPEC), "rollout": {"maxSkew": 1}}
    w = await ready_world(spec)
    for (kind, _, name), obj in w.kube.objects.items():
        if kind == "StatefulSet":   # no status of this generation yet: held (nothing rolls unasked)
            assert obj["spec"]["updateStrategy"] == {"type": "RollingUpdate",
                                                     "rollingUpdate": {"partition": obj["spec"]["replicas"]}}, name
    assert w.condition("RevisionSkew") == {}
