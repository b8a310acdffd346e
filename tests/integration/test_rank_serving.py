"""Multi-rank instances under traffic: requests served across ranks, live switches of whole
instances (every rank or none), the pod's agent crashing part-way through switch_role, a rank
that refuses to switch, and unequal tensor parallelism (MLA) served through the gateway."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.conftest import Cluster, wait_for
from tests.integration.conftest import agent_post, agent_status, condition, events, keys_secret, pdd, sample, wait_phase
from tests.integration.test_switching import REBALANCE, roles, set_prefill, switched
from tests.integration.test_traffic import TRAFFIC_SPEC, Load, force_unlinks

pytestmark = pytest.mark.integration
TP = 4
NPU = "huawei.com/Ascend910"


def ranked(tp_prefill: int = TP, tp_decoder: int = TP, **extra) -> dict:
    doc = sample(**TRAFFIC_SPEC, **extra)
    for g, tp in (("prefill", tp_prefill), ("decoder", tp_decoder)):
        doc["spec"][g]["tensorParallel"] = tp
        doc["spec"][g]["resources"] = {"limits": {NPU: tp}}
    doc["spec"]["model"]["kvCache"]["tensorParallel"] = tp_prefill
    return doc


def rank_roles(cluster: Cluster, ns: str, pod: str) -> list[str]:
    return [r.get("role", "?") for r in (agent_post_get(cluster, ns, pod, r) for r in range(TP))]


def agent_post_get(cluster: Cluster, ns: str, pod: str, rank: int) -> dict:
    """A rank's own status, through the pod's agent (/r/<rank>/v1/status)."""
    from tests.integration.conftest import _agent
    url, headers = _agent(cluster, ns, pod, "sim-small")
    return httpx.get(f"{url}/r/{rank}/v1/status", headers=headers, trust_env=False, timeout=5).json()


@pytest.fixture
def tp_fleet(cluster: Cluster, namespace: str, operator):
    cluster.apply(ranked(rebalance=REBALANCE), namespace)
    wait_phase(cluster, namespace, "Ready", timeout=180, extra=lambda o: o["status"]["linksSummary"] == "16/16")
    return namespace


def test_tp4_serves_and_switches_whole_instances_under_load(cluster: Cluster, tp_fleet: str, operator):
    ns = tp_fleet
    before = roles(cluster, ns)
    load = Load(cluster, ns, duration=400)
    wait_for("requests served across ranks", lambda: sum(
        agent_status(cluster, ns, p)["load"]["completed"] for p in before if "decoder" in p) >= 10, timeout=60)

    # 2 -> 3: a decoder instance becomes a prefill instance, all 4 ranks, same pod, no restart
    set_prefill(cluster, ns, 3)
    obj = switched(cluster, ns, "prefill", None, "12/12", timeout=150)
    last = obj["status"]["lastSwitch"]
    pod = last["pod"]
    assert roles(cluster, ns)[pod][2:] == (before[pod][2], 0), "same pod, no container restart"
    assert rank_roles(cluster, ns, pod) == ["prompt"] * TP
    print(f"\nTP {TP} decoder->prefill: {json.dumps(last)}")

    # 3 -> 2 with the pod's agent crashing after 2 of its 4 ranks switched: it comes back in the
    # new role (the annotation was set first), the operator resumes, every rank ends a decoder
    agent_post(cluster, ns, pod, "/v1/admin/faults", {"switch_crash_after_ranks": 2})
    set_prefill(cluster, ns, 2)
    obj = switched(cluster, ns, "decoder", last["at"], "16/16", timeout=180)
    back = obj["status"]["lastSwitch"]
    assert back["pod"] == pod and back["result"] == "Completed", back
    assert rank_roles(cluster, ns, pod) == ["decoder"] * TP
    assert roles(cluster, ns)[pod][3] == 1, "the crash restarted the container once"
    print(f"TP {TP} prefill->decoder through a crash after 2 ranks: {json.dumps(back)}")

    # a rank that refuses switch_role: the switch aborts, every rank stays, the pod serves again
    decoders = [p for p in roles(cluster, ns) if agent_status(cluster, ns, p)["role"] == "decoder"]
    for p in decoders:
        agent_post(cluster, ns, p, "/r/2/v1/admin/faults", {"refuse_switch": True})
    set_prefill(cluster, ns, 3)
    obj = switched(cluster, ns, "prefill", back["at"], "16/16", result="Aborted", timeout=150)
    aborted = obj["status"]["lastSwitch"]
    assert "rank 2" in aborted["message"], aborted
    assert rank_roles(cluster, ns, aborted["pod"]) == ["decoder"] * TP
    assert not agent_status(cluster, ns, aborted["pod"])["draining"]
    assert any("rank 2" in e["message"] for e in events(cluster, ns) if e["type"] == "Warning"
               or "Abort" in e["reason"]), [e["message"] for e in events(cluster, ns)][-10:]
    served = agent_status(cluster, ns, aborted["pod"])["load"]["completed"]
    wait_for("the pod serving again", lambda: agent_status(cluster, ns, aborted["pod"])["load"]["completed"]
             > served, timeout=60)

    s = load.stop()
    assert s["failed"] == 0, s["failed_by_reason"]
    assert s["completed"] > 50, s
    assert force_unlinks(cluster, ns) == []


def test_unequal_tp_mla_links_by_the_mapping_and_serves_through_the_gateway(cluster: Cluster, namespace: str,
                                                                           operator):
    ns = namespace
    key = "sk-pd-test-mla-ranks-0001"
    keys_secret(cluster, ns, **{"team-a": key})
    doc = ranked(4, 2, gateway={"enabled": True, "apiKeysSecret": "sim-small-keys"})
    doc["spec"]["model"]["kvCache"].update(attention="MLA", latentDim=64)
    cluster.apply(doc, ns)
    # each decoder rank links one prefill rank: 2 decoders x 2 prefills x 2 decoder ranks
    obj = wait_phase(cluster, ns, "Ready", timeout=180, extra=lambda o: o["status"]["linksSummary"] == "8/8")
    assert condition(obj, "KVPathVerified")["status"] == "True"
    p0 = agent_status(cluster, ns, "sim-small-prefill-0")
    d0 = agent_status(cluster, ns, "sim-small-decoder-0")
    link = next(l for l in d0["links"] if l["name"] == "sim-small-prefill-0")
    # decoder rank r reads prefill rank 2r (README: the mapping)
    assert [x["cluster_id"] for x in link["ranks"]] == [p0["ranks"][0]["cluster_id"], p0["ranks"][2]["cluster_id"]]

    def gateway() -> str | None:
        pods = cluster.get_json("pods", "-n", ns, "-l", "pdoperator.io/gateway=sim-small")["items"]
        p = next((p for p in pods if any(c["type"] == "Ready" and c["status"] == "True"
                                         for c in p["status"].get("conditions", []))), None)
        return p and f"http://{p['status']['podIP']}:8000"
    url = wait_for("the gateway Ready", gateway, timeout=60)
    wait_for("the gateway sees the fleet", lambda: httpx.get(f"{url}/healthz", trust_env=False).json()[
        "decoders"] >= 2, timeout=30)
    load = Load(cluster, ns, duration=20, rate=5, gateway=url, api_key=key)
    s = load.result()
    assert s["failed"] == 0, s["failed_by_reason"]
    assert s["completed"] >= 20, s
    # the prefill ranks no decoder rank reads were released, not left to expire
    time.sleep(1)
    assert all(agent_status(cluster, ns, f"sim-small-prefill-{i}")["load"]["pending_kv"] == 0 for i in (0, 1))
    assert pdd(cluster, ns)["status"]["phase"] == "Ready"
