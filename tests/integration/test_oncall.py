"""On call: rebalancing paused under load, a switch aborted before switch_role with traffic
running, and pods the scheduler cannot place named with its reason."""
from __future__ import annotations

import json
import time

import pytest

from tests.conftest import Cluster, wait_for
from tests.integration.conftest import condition, pdd, sample, wait_phase
from tests.integration.test_switching import REBALANCE, links_match_roles, roles, set_prefill
from tests.integration.test_traffic import TRAFFIC_SPEC, Load

pytestmark = pytest.mark.integration


def rebalancing(cluster: Cluster, ns: str) -> dict:
    return condition(pdd(cluster, ns), "Rebalancing")


def test_paused_rebalancing_starts_no_switch_under_load(cluster: Cluster, namespace: str, operator):
    ns = namespace
    cluster.apply(sample(**{"model.kvCache.maxSeqLen": 2048, "sim": {"timeScale": 1.0},
                            "rebalance": {"policy": "Load", "evaluationIntervalSeconds": 5, "cooldownSeconds": 8,
                                          "minPrefill": 1, "minDecoder": 1, "paused": True}}), ns)
    wait_phase(cluster, ns, "Ready", timeout=180, extra=lambda o: o["status"]["linksSummary"] == "4/4")
    # prompt-heavy: the Load policy wants a third prefill, but rebalancing is paused
    load = Load(cluster, ns, duration=300, rate=16, workload="code", max_output=8)
    c = wait_for("the policy saying what it would do, paused", lambda: (
        c if (c := rebalancing(cluster, ns)).get("reason") == "Paused" and "prefill" in c.get("message", "")
        and (pdd(cluster, ns)["status"].get("lastDecision") or {}).get("reason") == "PrefillBound" else None),
        timeout=240)
    assert "spec.rebalance.paused" in c["message"], c
    for _ in range(3):   # three more evaluations under pressure: still nothing moves
        time.sleep(5)
        st = pdd(cluster, ns)["status"]
        assert not st.get("switches") and not st.get("lastSwitch"), st.get("switches") or st.get("lastSwitch")
    assert {r for r, *_ in roles(cluster, ns).values()} == {"prefill", "decoder"}
    assert sum(1 for r, *_ in roles(cluster, ns).values() if r == "prefill") == 2
    # unpaused, it moves
    cluster.kubectl("patch", "pdd", "sim-small", "-n", ns, "--type=merge", "-p",
                    json.dumps({"spec": {"rebalance": {"paused": False}}}))
    wait_for("a third prefill once unpaused", lambda: (x := pdd(cluster, ns))["status"].get("prefill") == 3
             and x["status"]["phase"] == "Ready", timeout=240)
    s = load.stop()
    assert s["failed"] == 0, s["failed_by_reason"]


def test_switch_aborted_before_switch_role_serves_in_its_role_again(cluster: Cluster, namespace: str, operator):
    ns = namespace
    cluster.apply(sample(**TRAFFIC_SPEC, rebalance=REBALANCE), ns)
    wait_phase(cluster, ns, "Ready", timeout=180, extra=lambda o: o["status"]["linksSummary"] == "4/4")
    load = Load(cluster, ns, duration=600)
    time.sleep(2)
    # the operator stops right after recording Unlink, so the abort surely finds the switch there
    operator.stop()
    operator.start(PD_OPERATOR_FAULT_POINT="decoder-to-prefill:Unlink")
    set_prefill(cluster, ns, 3)
    assert operator.wait_exit(180) == 17
    sw = pdd(cluster, ns)["status"]["switches"][0]
    pod = sw["pod"]
    assert sw["from"] == "decoder" and sw["step"] == "Unlink", sw   # its links still held: not past Unlink
    cluster.kubectl("annotate", "pdd", "sim-small", "-n", ns, f"pdoperator.io/switch-abort={pod}")
    operator.start()
    o = wait_for("the switch aborted and Ready", lambda: (
        o if ((o := pdd(cluster, ns))["status"].get("lastSwitch") or {}).get("result") == "Aborted"
        and o["status"]["phase"] == "Ready" and o["status"]["linksSummary"] == "4/4" else None), timeout=180)
    last = o["status"]["lastSwitch"]
    assert last["pod"] == pod and "aborted on request" in last["message"], last
    assert "pdoperator.io/switch-abort" not in (o["metadata"].get("annotations") or {})
    assert o["status"]["rebalance"]["retryAfter"], "the policy holds before it moves again"
    assert roles(cluster, ns)[pod][0] == "decoder"
    links_match_roles(cluster, ns)
    time.sleep(5)   # it serves as a decoder, and no switch starts meanwhile
    assert not pdd(cluster, ns)["status"].get("switches")
    s = load.stop()
    assert s["failed"] == 0, s["failed_by_reason"]


def test_pods_the_scheduler_cannot_place_are_named_with_its_reason(cluster: Cluster, namespace: str, operator):
    ns = namespace
    cluster.apply(sample(**{"prefill.replicas": 1, "decoder.replicas": 1,
                            "prefill.resources": {"limits": {"huawei.com/Ascend910": 1},
                                                  "requests": {"memory": "4000Ti"}}}), ns)
    c = wait_for("PodsReady naming the scheduler's reason", lambda: (
        c if (c := condition(pdd(cluster, ns), "PodsReady")).get("reason") == "Unschedulable" else None),
        timeout=120)
    assert "sim-small-prefill-0 cannot be scheduled" in c["message"] and "Insufficient memory" in c["message"], c
    assert "memory=4000Ti" in c["message"], c
    assert pdd(cluster, ns)["status"]["phase"] == "Pending"
