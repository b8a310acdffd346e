"""Rebalancing policies on a live fleet: Load follows a workload that shifts from
prompt-heavy to decode-heavy, within the min counts and the cooldown between decisions; a Schedule entry
switches at its minute."""
from __future__ import annotations

import json
import threading
import time

import pytest

from tests.conftest import Cluster, wait_for
from tests.integration.conftest import events, pdd, sample, wait_phase
from tests.integration.switch_helpers import parse_time
from tests.integration.test_traffic import TRAFFIC_SPEC, Load, settled

pytestmark = pytest.mark.integration
INTERVAL = 5
COOLDOWN = 8


class Watcher:
    """Polls the PDDeployment's status while the test runs: decisions, switches, counts."""

    def __init__(self, cluster: Cluster, ns: str):
        self.cluster, self.ns = cluster, ns
        self.decisions: dict[str, dict] = {}     # at -> lastDecision
        self.switches: dict[str, dict] = {}      # pod@startedAt -> switch in flight
        self.ended: dict[str, dict] = {}         # at -> lastSwitch
        self.min_serving = {"prefill": 99, "decoder": 99}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                st = pdd(self.cluster, self.ns).get("status") or {}
            except Exception:  # noqa: BLE001 - the next poll
                continue
            if st.get("lastDecision"):
                self.decisions.setdefault(st["lastDecision"]["at"], st["lastDecision"])
            for s in st.get("switches") or []:
                self.switches.setdefault(f"{s['pod']}@{s['startedAt']}", s)
            if st.get("lastSwitch", {}).get("at"):
                self.ended.setdefault(st["lastSwitch"]["at"], st["lastSwitch"])
            for role in ("prefill", "decoder"):
                if st.get(role) is not None and st.get("phase") in ("Ready", "Switching"):
                    self.min_serving[role] = min(self.min_serving[role], st[role])
            time.sleep(0.2)

    def evaluations_since(self, t: str) -> list[dict]:
        return [d for at, d in sorted(self.decisions.items()) if at >= t]

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + f".{int(time.time() * 1000) % 1000:03d}Z"


def since_pressed(evaluations: list[dict], last: dict) -> list[dict]:
    """The evaluations up to `last`, from the first that saw the load (not "within thresholds")."""
    upto = [d for d in evaluations if d["at"] <= last["at"]]
    start = next((i for i, d in enumerate(upto) if d["reason"] != "Balanced"), 0)
    return upto[start:]


def test_load_policy_follows_a_shifting_workload(cluster: Cluster, namespace: str, operator):
    ns = namespace
    cluster.apply(sample(**{"model.kvCache.maxSeqLen": 2048, "drainTimeoutSeconds": 30, "sim": {"timeScale": 1.0},
                            "rebalance": {"policy": "Load", "evaluationIntervalSeconds": INTERVAL,
                                          "cooldownSeconds": COOLDOWN, "minPrefill": 1, "minDecoder": 1}}), ns)
    wait_phase(cluster, ns, "Ready", timeout=120, extra=lambda o: o["status"]["linksSummary"] == "4/4")
    w = Watcher(cluster, ns)
    try:
        # prompt-heavy: 2k-token prompts at 16/s are far more than two prefills compute; short outputs
        t1 = now_iso()
        load = Load(cluster, ns, duration=300, rate=16, workload="code", max_output=8)
        o = wait_for("a third prefill", lambda: (x := pdd(cluster, ns))["status"].get("prefill") == 3
                     and x["status"]["phase"] == "Ready" and x, timeout=240)
        first = next(d for d in w.evaluations_since(t1) if d["reason"] == "PrefillBound")
        # counted from the first evaluation that saw the load: one that ran before the load reached
        # the engines ("within thresholds") says nothing about how fast the policy follows
        evals_p = since_pressed(w.evaluations_since(t1), first)
        s1 = load.stop()
        print(f"\nprompt-heavy: {len(evals_p)} evaluations to PrefillBound {first}; load {s1}")
        assert o["status"]["lastSwitch"]["to"] == "prefill"
        # decode-heavy: long outputs at a modest rate fill the decoders' batches
        t2 = now_iso()
        load = Load(cluster, ns, duration=300, rate=3, workload="chat", max_output=256)
        wait_for("back to one prefill", lambda: (x := pdd(cluster, ns))["status"].get("prefill") == 1
                 and x["status"]["phase"] == "Ready", timeout=300)
        s2 = load.stop()
        first_d = next(d for d in w.evaluations_since(t2) if d["reason"] == "DecodeBound")
        evals_d = since_pressed(w.evaluations_since(t2), first_d)
        print(f"decode-heavy: {len(evals_d)} evaluations to DecodeBound {first_d}; load {s2}")
    finally:
        w.close()
    assert s1["failed"] == 0 and s2["failed"] == 0, (s1["failed_by_reason"], s2["failed_by_reason"])
    assert len(evals_p) <= 2 and len(evals_d) <= 2, "followed within two evaluation intervals"
    # min counts held at every poll, and the target changed no sooner than the cooldown after it last did
    # (the cooldown runs between decisions; the switches of one move run back to back)
    assert w.min_serving["prefill"] >= 1 and w.min_serving["decoder"] >= 1, w.min_serving
    evals = w.evaluations_since("")
    changes = [parse_time(d["at"]) for prev, d in zip(evals, evals[1:])
               if d.get("targetPrefill") != prev.get("targetPrefill")]
    for before, after in zip(changes, changes[1:]):
        assert after - before >= COOLDOWN - 0.01, (before, after)
    print(f"switches: {len(w.switches)}, min serving {w.min_serving}")


def test_schedule_switches_at_its_minute(cluster: Cluster, namespace: str, operator):
    ns = namespace
    # even minutes: 3 prefills; odd minutes: 2
    cluster.apply(sample(rebalance={"policy": "Schedule", "cooldownSeconds": 0, "timeZone": "Europe/Berlin",
                                    "schedule": [{"cron": "*/2 * * * *", "prefill": 3},
                                                 {"cron": "1-59/2 * * * *", "prefill": 2}]}), ns)
    wait_phase(cluster, ns, "Ready", timeout=120)
    st = wait_for("a schedule decision", lambda: pdd(cluster, ns)["status"].get("lastDecision"), timeout=30)
    assert st["reason"] == "Schedule" and "Europe/Berlin" in st["message"]

    def at_target():
        """The fleet settled at the target of the entry that fired last (-> that target)."""
        o = pdd(cluster, ns)["status"]
        target = o.get("lastDecision", {}).get("targetPrefill")
        return o.get("phase") == "Ready" and not o.get("switches") and o.get("prefill") == target and target
    # settled well inside a minute: close to its end, the entry may flip between the settled
    # reading and the boundary worked out from the clock, and the test would time the wrong one
    while True:
        first_target = wait_for("the fleet at the current entry's count", at_target, timeout=60)
        if time.time() % 60 < 45:
            break
        time.sleep(62 - time.time() % 60)
    # the next minute boundary flips the target; the switch follows within seconds
    boundary = (int(time.time()) // 60 + 1) * 60
    after = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(boundary))
    o = wait_for("the next entry's switch", lambda: (x := pdd(cluster, ns))["status"].get("lastSwitch", {}).get(
        "at", "") > after and x["status"].get("prefill") == 5 - first_target and x, timeout=100)
    last, dec = o["status"]["lastSwitch"], o["status"]["lastDecision"]
    assert dec["targetPrefill"] == 5 - first_target and last["result"] == "Completed"
    started = parse_time(last["at"]) - last["totalMs"] / 1000
    print(f"\nschedule: entry fired at {after}Z, switch started {started - boundary:.1f}s later, "
          f"ended {parse_time(last['at']) - boundary:.1f}s after the minute")
    assert started >= boundary - 0.001, "not before its minute"


def test_kubectl_scale_under_load(cluster: Cluster, namespace: str, operator):
    """The scale subresource: `kubectl scale pdd` grows and shrinks the fleet (spread over the
    groups) the way HPA and KEDA would, under load, failing no request."""
    ns = namespace
    cluster.apply(sample(**TRAFFIC_SPEC), ns)
    settled(cluster, ns, "4/4", 4)
    load = Load(cluster, ns, duration=300)
    time.sleep(3)
    t0 = time.monotonic()
    cluster.kubectl("scale", "pdd", "sim-small", "-n", ns, "--replicas=6")
    settled(cluster, ns, "9/9", 6)
    up = time.monotonic() - t0
    scale = json.loads(cluster.kubectl("get", "--raw",
                                       f"/apis/pdoperator.io/v1alpha1/namespaces/{ns}/pddeployments/sim-small/scale")
                       .stdout)
    assert scale["spec"]["replicas"] == 6 and scale["status"]["replicas"] == 6
    assert scale["status"]["selector"] == "pdoperator.io/deployment=sim-small"
    t0 = time.monotonic()
    cluster.kubectl("scale", "pdd", "sim-small", "-n", ns, "--replicas=4")
    settled(cluster, ns, "4/4", 4)
    down = time.monotonic() - t0
    time.sleep(2)
    s = load.stop()
    print(f"\nkubectl scale 4->6 settled in {up:.1f}s, 6->4 in {down:.1f}s; load {json.dumps(s)}")
    assert s["failed"] == 0, s["failed_by_reason"]
    sts = {x["metadata"]["name"]: x["spec"]["replicas"] for x in cluster.get_json("statefulsets", "-n", ns)["items"]}
    assert sts == {"sim-small-prefill": 2, "sim-small-decoder": 2}


def test_replace_moves_replicas_and_loses_no_request(cluster: Cluster, namespace: str, operator):
    """method: Replace, for engines that cannot switch: the groups' sizes move by one (a new pod
    first, then one of the other group drains and goes), under load."""
    from tests.integration.test_switching import set_prefill
    ns = namespace
    cluster.apply(sample(**TRAFFIC_SPEC, rebalance={"policy": "Manual", "manual": {"prefill": 2},
                                                    "method": "Replace", "cooldownSeconds": 0}), ns)
    settled(cluster, ns, "4/4", 4)
    sts = lambda: {x["metadata"]["name"].rsplit("-", 1)[1]: x["spec"]["replicas"]  # noqa: E731
                   for x in cluster.get_json("statefulsets", "-n", ns)["items"]}
    load = Load(cluster, ns, duration=300)
    time.sleep(3)
    t0 = time.monotonic()
    set_prefill(cluster, ns, 3)
    settled(cluster, ns, "3/3", 4)
    wait_for("prefill 3, decoder 1", lambda: sts() == {"prefill": 3, "decoder": 1}, timeout=30)
    up = time.monotonic() - t0
    assert pdd(cluster, ns)["status"]["rebalance"]["groupSizes"] == {"prefill": 3, "decoder": 1}
    # drift repair keeps the decision
    cluster.kubectl("scale", "statefulset", "sim-small-decoder", "-n", ns, "--replicas=2")
    wait_for("the decided size back", lambda: sts() == {"prefill": 3, "decoder": 1}, timeout=30)
    settled(cluster, ns, "3/3", 4)
    t0 = time.monotonic()
    set_prefill(cluster, ns, 2)
    settled(cluster, ns, "4/4", 4)
    wait_for("prefill 2, decoder 2", lambda: sts() == {"prefill": 2, "decoder": 2}, timeout=30)
    down = time.monotonic() - t0
    time.sleep(2)
    s = load.stop()
    print(f"\nReplace 2->3 in {up:.1f}s, 3->2 in {down:.1f}s; load {json.dumps(s)}")
    assert s["failed"] == 0, s["failed_by_reason"]
    reasons = [e["reason"] for e in events(cluster, ns)]
    assert "RebalanceDecision" in reasons and "Switched" not in reasons


def test_goodput_policy_moves_whole_and_says_why(cluster: Cluster, namespace: str, operator):
    """policy Goodput on a live fleet: it measures demand and capacity from the agents' load
    reports, moves to the prefill count its model predicts best (a whole move at once), says why
    in status.lastDecision, and fails no request."""
    ns = namespace
    cluster.apply(sample(**{"model.kvCache.maxSeqLen": 2048, "drainTimeoutSeconds": 30, "sim": {"timeScale": 1.0},
                            "rebalance": {"policy": "Goodput", "targets": {"ttftP90Ms": 3000, "tbtP90Ms": 60},
                                          "evaluationIntervalSeconds": INTERVAL, "cooldownSeconds": INTERVAL,
                                          "maxConcurrentSwitches": "50%", "minPrefill": 1, "minDecoder": 1}}), ns)
    wait_phase(cluster, ns, "Ready", timeout=120, extra=lambda o: o["status"]["linksSummary"] == "4/4")
    w = Watcher(cluster, ns)
    try:
        # prompt-heavy: 2k-token prompts at 16/s, short outputs
        t1 = now_iso()
        load = Load(cluster, ns, duration=300, rate=16, workload="code", max_output=8)
        o = wait_for("more prefills", lambda: (x := pdd(cluster, ns))["status"].get("prefill", 0) >= 3
                     and x["status"]["phase"] == "Ready" and x, timeout=240)
        moved = next(d for d in w.evaluations_since(t1) if d["reason"] == "GoodputGain")
        s1 = load.stop()
        # decode-heavy: long outputs at a modest rate
        t2 = now_iso()
        load = Load(cluster, ns, duration=300, rate=3, workload="chat", max_output=256)
        wait_for("back to one prefill", lambda: (x := pdd(cluster, ns))["status"].get("prefill") == 1
                 and x["status"]["phase"] == "Ready", timeout=300)
        s2 = load.stop()
        back = next(d for d in w.evaluations_since(t2) if d["reason"] in ("GoodputGain", "Relieve"))
    finally:
        w.close()
    print(f"\nGoodput: {moved['message']}\n         {back['message']}\nloads {s1} {s2}")
    assert s1["failed"] == 0 and s2["failed"] == 0, (s1["failed_by_reason"], s2["failed_by_reason"])
    assert w.min_serving["prefill"] >= 1 and w.min_serving["decoder"] >= 1, w.min_serving
    for key in ("requestsPerS", "promptTokensPerS", "outputTokensPerS", "prefillTokensPerBusyS", "decodeStepMs",
                "forecastRequestsPerS", "goodputNow", "goodputAtBest", "bestPrefill", "gain", "cost"):
        assert key in moved["numbers"], key
    assert float(moved["numbers"]["goodputAtBest"]) > float(moved["numbers"]["goodputNow"])
    assert o["status"]["lastDecision"]["policy"] == "Goodput"
