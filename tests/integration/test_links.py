"""Operator-driven links, KV-path verification and failure diagnosis, end to end."""
from __future__ import annotations

import pytest

from tests.conftest import Cluster, wait_for
from tests.integration.conftest import agent_post, agent_status, condition, events, pdd, sample, wait_phase

pytestmark = pytest.mark.integration
DECODERS = ("sim-small-decoder-0", "sim-small-decoder-1")


def links_of(cluster: Cluster, ns: str, pod: str) -> dict[int, dict]:
    return {l["cluster_id"]: l for l in agent_status(cluster, ns, pod)["links"]}


def ready_with(cluster: Cluster, ns: str, summary: str, timeout: float = 90) -> dict:
    return wait_phase(cluster, ns, "Ready", timeout=timeout, extra=lambda o: o["status"]["linksSummary"] == summary)


def test_scale_prefill_up_keeps_links_and_down_removes_stale(cluster: Cluster, namespace: str, operator) -> None:
    ns = namespace
    cluster.apply(sample(), ns)
    ready_with(cluster, ns, "4/4")
    before = {d: links_of(cluster, ns, d) for d in DECODERS}
    assert all(set(v) == {0, 1} for v in before.values())

    cluster.kubectl("patch", "pdd", "sim-small", "-n", ns, "--type=merge", "-p", '{"spec":{"prefill":{"replicas":4}}}')
    obj = ready_with(cluster, ns, "8/8")
    for d in DECODERS:
        after = links_of(cluster, ns, d)
        assert set(after) == {0, 1, 2, 3}
        for cid in (0, 1):  # the existing links were not dropped and re-made
            assert after[cid]["since"] == before[d][cid]["since"], f"{d} re-made its link to {cid}"
    assert condition(obj, "KVPathVerified")["status"] == "True"

    cluster.kubectl("patch", "pdd", "sim-small", "-n", ns, "--type=merge", "-p", '{"spec":{"prefill":{"replicas":1}}}')
    ready_with(cluster, ns, "2/2")
    for d in DECODERS:
        assert set(links_of(cluster, ns, d)) == {0}, f"{d} kept stale links"
    assert sorted(agent_status(cluster, ns, "sim-small-prefill-0")["incoming"]) == [1000, 1001]
    assert any(e["reason"] == "Unlinked" for e in events(cluster, ns))


def test_deleted_prefill_is_relinked_to_its_replacement(cluster: Cluster, namespace: str, operator) -> None:
    ns = namespace
    cluster.apply(sample(), ns)
    obj = ready_with(cluster, ns, "4/4")
    old_boot = next(m["bootId"] for m in obj["status"]["members"] if m["pod"] == "sim-small-prefill-0")
    pid = operator.proc.pid
    cluster.kubectl("delete", "pod", "sim-small-prefill-0", "-n", ns)
    obj = wait_phase(cluster, ns, "Ready", timeout=90, extra=lambda o: o["status"]["linksSummary"] == "4/4" and any(
        m["pod"] == "sim-small-prefill-0" and m.get("bootId") not in (None, old_boot) for m in o["status"]["members"]))
    new_ip = next(m["ip"] for m in obj["status"]["members"] if m["pod"] == "sim-small-prefill-0")
    for d in DECODERS:
        link = links_of(cluster, ns, d)[0]
        assert link["code"] == "LLM_SUCCESS" and link["ip"] == new_ip
    assert operator.proc.pid == pid and operator.proc.poll() is None
    # the new path was verified too
    wait_for("a verification against the replacement", lambda: "sim-small-prefill-0" in
             " ".join(pdd(cluster, ns)["status"].get("lastVerified", {}).get("paths", [])), timeout=60)


def test_fault_diagnosis_and_recovery(cluster: Cluster, namespace: str, operator) -> None:
    ns = namespace
    cluster.apply(sample(), ns)
    ready_with(cluster, ns, "4/4")

    # a prefill that refuses links: EndpointUnreachable, naming the pod
    agent_post(cluster, ns, "sim-small-prefill-1", "/v1/admin/faults", {"refuse_links": True})
    # each decoder finds its link to it broken on its own probe: wait for both, not the first
    obj = wait_phase(cluster, ns, "Degraded", extra=lambda o: condition(o, "LinksReady").get("reason") ==
                     "EndpointUnreachable" and o["status"].get("links", {}).get("up") == 2)
    msg = condition(obj, "LinksReady")["message"]
    assert "sim-small-prefill-1" in msg and "26000" in msg
    assert any(e["reason"] == "EndpointUnreachable" and e["type"] == "Warning" for e in events(cluster, ns))
    # retried with backoff; the repeats bump one Event per decoder, they do not add Events
    wait_for("retries", lambda: operator.metric("pd_operator_link_operations_total", op="link",
                                                code="LLM_LINK_FAILED") >= 4, timeout=90)
    unreachable = [e for e in events(cluster, ns) if e["reason"] == "EndpointUnreachable"]
    assert len(unreachable) <= 2, [e["message"] for e in unreachable]

    # a slow prompt side: the handshake outlasts linkTimeoutMs (2000): LinkTimeout
    agent_post(cluster, ns, "sim-small-prefill-1", "/v1/admin/faults", {"refuse_links": False, "link_delay_ms": 3500})
    obj = wait_phase(cluster, ns, "Degraded", timeout=120,
                     extra=lambda o: condition(o, "LinksReady").get("reason") == "LinkTimeout")
    assert "linkTimeoutMs" in condition(obj, "LinksReady")["message"]

    # fault cleared: Ready again, every path verified
    agent_post(cluster, ns, "sim-small-prefill-1", "/v1/admin/faults", {"link_delay_ms": 0})
    obj = ready_with(cluster, ns, "4/4", timeout=120)
    assert condition(obj, "LinksReady")["status"] == "True"


def test_proxy_variables_are_reported(cluster: Cluster, namespace: str, operator) -> None:
    ns = namespace
    doc = sample(**{"decoder.env": [{"name": "https_proxy", "value": "http://proxy.corp:3128"}]})
    cluster.apply(doc, ns)
    # both decoders carry the variable; each is named once its agent has reported
    obj = wait_for("ProxyEnvironment naming both decoders", lambda: (
        o if condition(o := pdd(cluster, ns), "ProxyEnvironment").get("status") == "True"
        and all(f"sim-small-decoder-{i}" in condition(o, "ProxyEnvironment")["message"] for i in (0, 1))
        else None), timeout=90)
    c = condition(obj, "ProxyEnvironment")
    assert c["reason"] == "ProxyEnvironment" and "https_proxy" in c["message"] and "sim-small-decoder-0" in c["message"]
    assert any(e["reason"] == "ProxyEnvironment" and e["type"] == "Warning" for e in events(cluster, ns))
    # the env was injected into the pods, as a user would check it
    pod = cluster.get_json("pod", "sim-small-decoder-0", "-n", ns)
    assert {"name": "https_proxy", "value": "http://proxy.corp:3128"} in pod["spec"]["containers"][0]["env"]



def test_wrong_token_is_agent_unauthorized(cluster: Cluster, namespace: str, operator) -> None:
    ns = namespace
    cluster.apply(sample(**{"prefill.replicas": 1, "decoder.replicas": 1}), ns)
    ready_with(cluster, ns, "1/1")
    # a rotation rolls the pods onto the new token; hold that roll back (a partition another field
    # manager set, as an engineer pausing a rollout would), so the running agents keep the old token
    hold = '{"spec":{"updateStrategy":{"type":"RollingUpdate","rollingUpdate":{"partition":1}}}}'
    for role in ("prefill", "decoder"):
        cluster.kubectl("patch", "statefulset", f"sim-small-{role}", "-n", ns, "--type=merge", "-p", hold)
    # rotate the Secret under running pods (delete it: the operator makes a new one)
    cluster.kubectl("delete", "secret", "sim-small-agent-token", "-n", ns)
    obj = wait_phase(cluster, ns, "Degraded", extra=lambda o: condition(o, "AgentsReady").get("reason") ==
                     "AgentUnauthorized")
    assert "rejected the operator's token" in condition(obj, "AgentsReady")["message"]
    assert operator.proc.poll() is None
    # release the roll: the pods start on the new token and the links come back
    release = '{"spec":{"updateStrategy":{"rollingUpdate":{"partition":0}}}}'
    for role in ("prefill", "decoder"):
        cluster.kubectl("patch", "statefulset", f"sim-small-{role}", "-n", ns, "--type=merge", "-p", release)
    ready_with(cluster, ns, "1/1")


def test_crashed_agent_is_restarted_and_relinked(cluster: Cluster, namespace: str, operator) -> None:
    ns = namespace
    cluster.apply(sample(), ns)
    obj = ready_with(cluster, ns, "4/4")
    old_boot = next(m["bootId"] for m in obj["status"]["members"] if m["pod"] == "sim-small-prefill-0")
    old_ip = next(m["ip"] for m in obj["status"]["members"] if m["pod"] == "sim-small-prefill-0")
    try:
        agent_post(cluster, ns, "sim-small-prefill-0", "/v1/admin/faults", {"crash": True})
    except Exception:  # noqa: BLE001 - the process may die before it answers
        pass
    wait_for("a restart of the crashed container", lambda: cluster.get_json("pod", "sim-small-prefill-0", "-n", ns)
             ["status"]["containerStatuses"][0]["restartCount"] >= 1, timeout=60)
    obj = wait_phase(cluster, ns, "Ready", timeout=90, extra=lambda o: o["status"]["linksSummary"] == "4/4" and any(
        m["pod"] == "sim-small-prefill-0" and m.get("bootId") not in (None, old_boot) for m in o["status"]["members"]))
    assert next(m["ip"] for m in obj["status"]["members"] if m["pod"] == "sim-small-prefill-0") == old_ip
    for d in DECODERS:
        assert links_of(cluster, ns, d)[0]["code"] == "LLM_SUCCESS"
    assert any(e["reason"] == "AgentRestarted" and "sim-small-prefill-0" in e["message"] for e in events(cluster, ns))
