"""The network preflight on the local cluster: each fault of the simulated devices' network (a
device's link down, the TLS switch off the other nodes', no gateway) keeps the pod out of service
with condition NetworkPreflight naming node, device and check; fixed, the pod serves again."""
from __future__ import annotations

import pytest

from tests.conftest import Cluster, wait_for
from tests.integration.conftest import agent_post, agent_status, condition, pdd, sample, wait_phase

pytestmark = pytest.mark.integration
NAME = "pf"
TP = 2
FAULTS = "/v1/admin/faults"
PODS = [f"{NAME}-prefill-0", f"{NAME}-decoder-0", f"{NAME}-decoder-1"]


def spec() -> dict:
    doc = sample(NAME, **{"model.kvCache.tensorParallel": TP, "datadist.verifyIntervalSeconds": 5,
                          "prefill.replicas": 1, "decoder.replicas": 2,
                          "sim.faults": {"preflightLinkDown": [1]}})
    for g in ("prefill", "decoder"):
        doc["spec"][g]["resources"] = {"limits": {"huawei.com/Ascend910": TP}}
    return doc


def preflight(cluster: Cluster, ns: str, status: str, reason: str, *needles: str) -> dict:
    def seen():
        c = condition(pdd(cluster, ns, NAME), "NetworkPreflight")
        return c if c.get("status") == status and c.get("reason") == reason and \
            all(n in c.get("message", "") for n in needles) else None
    return wait_for(f"NetworkPreflight {status}/{reason} naming {needles}", seen, timeout=120, interval=1)


def node_of(cluster: Cluster, ns: str, pod: str) -> str:
    return cluster.get_json("pod", pod, "-n", ns)["spec"]["nodeName"]


def linked(cluster: Cluster, ns: str, decoder: str) -> set[str]:
    return {link["name"] for link in agent_status(cluster, ns, decoder, NAME)["links"]
            if all(r["code"] == "LLM_SUCCESS" for r in link.get("ranks") or [link])}


def serving(cluster: Cluster, ns: str) -> dict:
    return wait_phase(cluster, ns, "Ready", name=NAME, timeout=180,
                      extra=lambda o: o["status"]["linksSummary"] == "4/4"
                      and condition(o, "NetworkPreflight").get("status") == "True")


def test_each_preflight_fault_keeps_the_pod_out_until_fixed(cluster: Cluster, namespace: str, operator) -> None:
    ns = namespace
    cluster.apply(spec(), ns)

    # every pod starts with its rank-1 device's link down: no engine starts, the condition names them
    wait_for("the pods scheduled and their agents answering", lambda: all(
        (agent_status(cluster, ns, p, NAME) or {}).get("preflight") for p in PODS), timeout=120, interval=1)
    st = agent_status(cluster, ns, PODS[0], NAME)
    dev = st["ranks"][1]["device_id"]
    c = preflight(cluster, ns, "False", "CheckFailed", f"{PODS[0]} on node {node_of(cluster, ns, PODS[0])}: "
                  f"device {dev} link: link DOWN", "docs/operations.md#networkpreflight")
    assert "net_health" in c["message"]
    for p in PODS:
        st = agent_status(cluster, ns, p, NAME)
        assert not st["initialized"] and st["preflight"]["state"] == "failed", (p, st["preflight"])
        assert not any(r["registered"] for r in st["ranks"]), "no rank engine starts before the preflight passes"
        assert not cluster.get_json("pod", p, "-n", ns)["status"].get("containerStatuses", [{}])[0].get("ready")

    # fixed: every pod's engines start, link and verify
    for p in PODS:
        agent_post(cluster, ns, p, FAULTS, {"preflight_link_down": []}, NAME)
    obj = serving(cluster, ns)
    assert "3 pods" in condition(obj, "NetworkPreflight")["message"]
    assert linked(cluster, ns, PODS[1]) == linked(cluster, ns, PODS[2]) == {PODS[0]}

    # one decoder's TLS switch differs from the other nodes': named, and unlinked while it differs
    odd = PODS[2]
    agent_post(cluster, ns, odd, FAULTS, {"preflight_tls_switch": 1}, NAME)
    preflight(cluster, ns, "False", "TLSDiffers", f"TLS switch 1 on {node_of(cluster, ns, odd)} ({odd})")
    wait_for(f"{odd} unlinked", lambda: not linked(cluster, ns, odd), timeout=60, interval=1)
    assert linked(cluster, ns, PODS[1]) == {PODS[0]}, "the other decoder keeps its link"
    agent_post(cluster, ns, odd, FAULTS, {"preflight_tls_switch": 0}, NAME)
    serving(cluster, ns)
    assert linked(cluster, ns, odd) == {PODS[0]}

    # the prefill's devices lose their gateway: every decoder lets go of it until it is back
    agent_post(cluster, ns, PODS[0], FAULTS, {"preflight_no_gateway": True}, NAME)
    preflight(cluster, ns, "False", "CheckFailed", f"{PODS[0]} on node {node_of(cluster, ns, PODS[0])}",
              "gateway: no gateway address")
    wait_for("the prefill unlinked by every decoder", lambda: not (linked(cluster, ns, PODS[1])
                                                                   | linked(cluster, ns, PODS[2])),
             timeout=60, interval=1)
    agent_post(cluster, ns, PODS[0], FAULTS, {"preflight_no_gateway": False}, NAME)
    obj = serving(cluster, ns)
    assert condition(obj, "KVPathVerified")["status"] == "True"
