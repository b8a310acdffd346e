"""Instances that span nodes, on the reference engine (MLA): a prefill instance of 2 pods x 8 ranks
(TP 16 across two nodes) and decoder instances of 2 pods x 4 ranks (DP 8), each a gang placed all
or none, fronted by its first pod's agent, linked rank to rank across pods and nodes and verified
on every rank pair. Completions through pd-gateway equal one engine's; one pod of the prefill
instance killed under traffic restarts its instance whole with nothing failed; a decoder
instance switched live to prefill under traffic and content checks, with the operator killed
after its switch_role, finishes under the standby. An instance the nodes cannot hold whole holds
no NPUs after its deadline, and PodsReady names it."""
from __future__ import annotations

import time

import pytest

from tests.conftest import Cluster, wait_for
from tests.integration.conftest import agent_status, condition, events, keys_secret, pdd, wait_phase
from tests.integration.test_content import (
    KEY,
    Checker,
    assert_all_match,
    gateway_url,
    one_engine,
    prompts,
    reference_doc,
)
from tests.integration.test_ha import leader_to_kill_and_standby, lease
from tests.integration.test_switching import set_prefill, switched
from tests.integration.test_traffic import Load

pytestmark = pytest.mark.integration
NPU = "huawei.com/Ascend910"
NAME = "sim-small"
PREFILL = [f"{NAME}-prefill-{i}" for i in (0, 1)]
DECODERS = [f"{NAME}-decoder-{i}" for i in range(4)]
REBALANCE = {"policy": "Manual", "manual": {"prefill": 1}, "cooldownSeconds": 0, "minPrefill": 1, "minDecoder": 1}


def gang_doc(**extra) -> dict:
    """1 prefill instance (TP 16 over 2 pods of 8 NPUs), 2 decoder instances (DP 8 of TP 1 over 2 pods of 4)."""
    doc = reference_doc(16, 1, attention="MLA", **extra)
    spec = doc["spec"]
    spec["prefill"].update(replicas=1, tensorParallel=16, podsPerInstance=2, resources={"limits": {NPU: 8}})
    spec["decoder"].update(replicas=2, tensorParallel=1, dataParallel=8, podsPerInstance=2,
                           resources={"limits": {NPU: 4}})
    spec["ascend"] = {"npusPerNode": 32}
    return doc


def nodes_of(cluster: Cluster, ns: str, pods: list[str]) -> dict[str, str]:
    return {p: cluster.get_json("pod", p, "-n", ns)["spec"]["nodeName"] for p in pods}


def uids(cluster: Cluster, ns: str) -> dict[str, str]:
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in cluster.get_json(
        "pods", "-n", ns, "-l", f"pdoperator.io/deployment={NAME}")["items"]}


def rank_links(st: dict) -> dict[str, list[tuple[int, int]]]:
    """A leading pod's links: peer -> (its rank, the peer's cluster id) for every rank link up."""
    return {link["name"]: [(x["rank"], x["cluster_id"]) for x in link["ranks"] if x["code"] == "LLM_SUCCESS"]
            for link in st["links"]}


def test_gang_instances_span_nodes_serve_restart_whole_and_switch_as_one(cluster: Cluster, namespace: str,
                                                                         operator, tmp_path) -> None:
    ns = namespace
    keys_secret(cluster, ns, **{"team-a": KEY})
    doc = gang_doc(rebalance=REBALANCE)
    t0 = time.monotonic()
    cluster.apply(doc, ns)
    # 16 decoder ranks x 1 prefill instance: each decoder rank links the prefill rank it pairs with
    obj = wait_phase(cluster, ns, "Ready", timeout=420, extra=lambda o: o["status"]["linksSummary"] == "16/16"
                     and condition(o, "KVContentMismatch").get("status") == "False")
    ready_s = time.monotonic() - t0
    assert condition(obj, "KVPathVerified")["status"] == "True"
    rows = {m["pod"]: m for m in obj["status"]["members"]}
    assert {p for p, m in rows.items() if "leader" not in m} == {PREFILL[0], DECODERS[0], DECODERS[2]}, rows
    assert rows[PREFILL[1]]["leader"] == PREFILL[0] and rows[PREFILL[0]]["instance"] == "prefill-0"

    # each instance's pods on two nodes, each rank on its own node's device IP; the leading pod fronts them all
    placed = nodes_of(cluster, ns, PREFILL + DECODERS)
    prefill = agent_status(cluster, ns, PREFILL[0])
    assert prefill["tensor_parallel"] == 16 and prefill["initialized"], prefill["last_error"]
    assert prefill["gang"]["index"] == 0 and set(prefill["gang"]["members"]) == {PREFILL[1]}
    assert [r["cluster_id"] for r in prefill["ranks"]] == list(range(16))
    follower = agent_status(cluster, ns, PREFILL[1])
    assert follower["gang"]["index"] == 1 and [r["rank"] for r in follower["ranks"]] == list(range(8, 16))
    assert [r["ip"] for r in follower["ranks"]] == [r["ip"] for r in prefill["ranks"][8:]]
    assert len({r["ip"] for r in prefill["ranks"]}) == 16
    cross = 0
    for d in (DECODERS[0], DECODERS[2]):
        st = agent_status(cluster, ns, d)
        assert st["tensor_parallel"] == 8 and st["gang"]["dp"] == 8
        links = rank_links(st)
        assert set(links) == {PREFILL[0]} and len(links[PREFILL[0]]) == 8, links
        # decoder rank r (TP 1) reads prefill rank 2r's copy of the latent
        assert links[PREFILL[0]] == [(r, 2 * r) for r in range(8)]
        dnode = {r: placed[d if r < 4 else DECODERS[DECODERS.index(d) + 1]] for r in range(8)}
        pnode = {j: placed[PREFILL[0] if j < 8 else PREFILL[1]] for j in range(16)}
        cross += sum(dnode[r] != pnode[2 * r] for r in range(8))
    print(f"\nReady in {ready_s:.1f}s; pods on nodes {placed}; 16 rank links, {cross} of them across nodes")
    assert len(set(placed[p] for p in PREFILL)) == 2, "the TP 16 instance spans two nodes"

    # the content probe passed on every rank pair; 50 completions equal one engine's
    verified = pdd(cluster, ns)["status"]["lastVerified"]
    print(f"last verification: {verified}")
    url = gateway_url(cluster, ns, decoders=2)
    check = Checker(url, one_engine(doc))
    assert_all_match(check.run(prompts(50, seed=5)))

    # one pod of the prefill instance killed with traffic running: its instance restarts whole, nothing fails
    before = uids(cluster, ns)
    # every rank of the TP 16 instance computes each prompt whole on this machine's two cores: a light load
    load = Load(cluster, ns, duration=900, rate=0.5, gateway=url, api_key=KEY, max_prompt=128, max_output=16)
    with check.running(seed=500, batch=1):
        time.sleep(3)
        killed_at = time.monotonic()
        cluster.kubectl("delete", "pod", PREFILL[1], "-n", ns, "--wait=false")
        wait_for("the prefill instance restarted whole", lambda: all(
            uids(cluster, ns).get(p) not in (None, before[p]) for p in PREFILL), timeout=120)
        wait_phase(cluster, ns, "Ready", timeout=300, extra=lambda o: o["status"]["linksSummary"] == "16/16"
                   and condition(o, "KVPathVerified").get("status") == "True")
        back_s = time.monotonic() - killed_at
        time.sleep(3)
    after = uids(cluster, ns)
    assert all(after[d] == before[d] for d in DECODERS), "the decoders were not restarted"
    assert any(e["reason"] == "GangRestarted" for e in events(cluster, ns))
    c = check.summary()
    print(f"prefill pod killed: the instance back in service in {back_s:.1f}s; content checks {c}")
    assert c["failed"] == 0 and c["mismatched"] == 0, c

    # a decoder instance switched live to prefill, content checked throughout; the operator is
    # killed once its switch_role is recorded done and a standby finishes the switch
    standby, first = leader_to_kill_and_standby(cluster, ns, operator, tmp_path)
    try:
        with check.running(seed=900, batch=1):
            time.sleep(3)
            with load.change("decoder instance -> prefill"):
                set_prefill(cluster, ns, 2)
                assert operator.wait_exit(240) == -9
                st = pdd(cluster, ns)["status"]
                moving = st["switches"][0]["pod"]
                assert moving in (DECODERS[0], DECODERS[2]), st["switches"]
                obj = switched(cluster, ns, "prefill", None, "16/16", timeout=300)
            time.sleep(3)
        assert obj["status"]["lastSwitch"]["pod"] == moving
        assert "became the leader" in standby.logs() and lease(cluster, ns)["holderIdentity"] != first
    finally:
        standby.stop()
    s, c = load.stop(), check.summary()
    switched_pods = [moving, DECODERS[DECODERS.index(moving) + 1]]
    roles = {p: cluster.get_json("pod", p, "-n", ns)["metadata"]["labels"]["pdoperator.io/role"]
             for p in switched_pods}
    st = agent_status(cluster, ns, moving)
    print(f"switch of the instance {switched_pods}: {obj['status']['lastSwitch']}; loadgen "
          f"{s['completed']}/{s['requests']}; content checks {c}")
    assert roles == {p: "prefill" for p in switched_pods}, roles
    assert st["role"] == "prompt" and all(r["initialized"] for r in st["ranks"]) and len(st["ranks"]) == 8
    assert s["failed"] == 0, s["failed_by_reason"]
    assert s["completed"] == s["requests"] > 0
    assert c["failed"] == 0 and c["mismatched"] == 0, c
    assert_all_match(Checker(url, one_engine(doc)).run(prompts(20, seed=77)))


def test_an_instance_the_nodes_cannot_hold_whole_holds_no_npus(cluster: Cluster, namespace: str, operator) -> None:
    ns = namespace
    doc = gang_doc()
    # 4 pods of 24 NPUs: three nodes of 32 hold three of them, never all four
    doc["spec"]["prefill"].update(tensorParallel=24, dataParallel=4, podsPerInstance=4,
                                  resources={"limits": {NPU: 24}})
    doc["spec"]["decoder"].update(replicas=1)
    doc["spec"]["prefill"]["gangScheduleSeconds"] = 10
    cluster.apply(doc, ns)
    pods = [f"{NAME}-prefill-{i}" for i in range(4)]

    def holding() -> list[str]:
        out = []
        for p in cluster.get_json("pods", "-n", ns, "-l", "pdoperator.io/group=prefill")["items"]:
            if p["spec"].get("nodeName") and not p["metadata"].get("deletionTimestamp"):
                out.append(p["metadata"]["name"])
        return out
    wait_for("some pods of the instance placed (the gate lifted once)", holding, timeout=60)
    obj = wait_for("PodsReady names the instance", lambda: (o if "instance prefill-0" in condition(
        o := pdd(cluster, ns), "PodsReady").get("message", "") else None), timeout=90)
    msg = condition(obj, "PodsReady")["message"]
    print(f"\nPodsReady: {condition(obj, 'PodsReady')['reason']}: {msg}")
    assert condition(obj, "PodsReady")["reason"] == "Unschedulable"
    assert "Insufficient" in msg or "nodes are available" in msg, msg
    time.sleep(12)   # past the deadline again: still nothing placed, the gate stays
    assert holding() == [], holding()
    for p in pods:
        gates = cluster.get_json("pod", p, "-n", ns)["spec"].get("schedulingGates") or []
        assert {"name": "pdoperator.io/gang"} in gates, (p, gates)
    assert any(e["reason"] == "GangUnplaced" for e in events(cluster, ns))
