"""Instances of several pods (gangs): the layout fields and what they render, each pod's place in
its instance and its ranks' env, the operator's placement, incarnation and membership decisions,
the leading agent taking its members' ranks on, and data-parallel groups."""
from __future__ import annotations

import asyncio
import copy
from pathlib import Path

import httpx
import pytest
import yaml

from pd_agent.gang import Groups, Members
from pd_contract import engine_env as ev
from pd_contract.agent_api import AgentStatus, GangMember, GangRequest, GangState, RegisterRank
from pd_contract.names import GANG_GATE
from pd_operator import builders, gangs
from pd_operator.api import parse_spec
from pd_operator.members import member_of

REPO = Path(__file__).resolve().parents[2]
SPEC = yaml.safe_load((REPO / "examples" / "sim-small.yaml").read_text())["spec"]


def gang_spec(**prefill) -> dict:
    spec = copy.deepcopy(SPEC)
    spec["model"]["kvCache"].update(attention="MLA", latentDim=64)
    spec["prefill"].update({"replicas": 1, "tensorParallel": 16, "podsPerInstance": 2, "resources": {"limits": {
        "huawei.com/Ascend910": 8}}, **prefill})
    spec["decoder"].update(replicas=2, tensorParallel=1, dataParallel=8, podsPerInstance=2, resources={"limits": {
        "huawei.com/Ascend910": 4}})
    return spec


def env_of(sts: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]}


# ---- API and rendering ----------------------------------------------------------------------

def test_a_spec_without_the_layout_fields_renders_as_before():
    spec = parse_spec(SPEC)
    sts = builders.statefulset("llm", "ns", spec, "prefill", {})
    assert sts["spec"]["replicas"] == 2
    assert "schedulingGates" not in sts["spec"]["template"]["spec"]
    assert not {ev.PD_PODS_PER_INSTANCE, ev.PD_DATA_PARALLEL, ev.PD_TP_SIZE} & set(env_of(sts))
    assert spec.tp("prefill") == spec.instance_ranks("prefill") == 1 and not spec.gang("prefill")


def test_a_gang_renders_its_pods_gated_with_their_share_of_ranks():
    spec = parse_spec(gang_spec())
    p, d = (builders.statefulset("llm", "ns", spec, g, {}) for g in ("prefill", "decoder"))
    assert p["spec"]["replicas"] == 2 and d["spec"]["replicas"] == 4          # instances x pods per instance
    assert p["spec"]["template"]["spec"]["schedulingGates"] == [{"name": GANG_GATE}]
    pe, de = env_of(p), env_of(d)
    assert (pe[ev.PD_TENSOR_PARALLEL], pe[ev.PD_PODS_PER_INSTANCE], pe[ev.PD_DATA_PARALLEL], pe[ev.PD_TP_SIZE]) == \
        ("8", "2", "1", "16")
    assert (de[ev.PD_TENSOR_PARALLEL], de[ev.PD_DATA_PARALLEL], de[ev.PD_TP_SIZE]) == ("4", "8", "1")
    assert spec.kv_cache_for("prefill").tensor_parallel == 16   # the CacheDesc follows the TP group
    assert builders.npu_mismatch(spec, "huawei.com/Ascend910") is None
    bad = parse_spec(gang_spec(resources={"limits": {"huawei.com/Ascend910": 16}}))
    assert "spec.prefill.resources" in (builders.npu_mismatch(bad, "huawei.com/Ascend910") or "")
    # instance n's cluster ids: the group's base + n x its ranks
    assert builders.cluster_id(spec, "decoder", 2) == 1000 + 8


def test_the_pod_and_rank_place_in_an_instance():
    env = {ev.PD_PODS_PER_INSTANCE: "2", ev.PD_DATA_PARALLEL: "8", ev.PD_TP_SIZE: "1", ev.PD_TENSOR_PARALLEL: "4",
           ev.LLM_DATADIST_POD_INDEX: "3"}
    g = ev.Gang.from_env(env)
    assert (g.index, g.per_pod, g.first_rank, g.leader, g.ranks) == (1, 4, 4, False, 8)
    assert g.rank_env(2) == {ev.PD_RANK: "0", ev.PD_TENSOR_PARALLEL: "1", ev.PD_INSTANCE_RANK: "6", ev.PD_DP_RANK: "6"}
    tp16 = ev.Gang(pods=2, tp=16, dp=1, index=1)
    assert tp16.rank_env(3) == {ev.PD_RANK: "11", ev.PD_TENSOR_PARALLEL: "16", ev.PD_INSTANCE_RANK: "11",
                                ev.PD_DP_RANK: "0"}
    assert not ev.Gang.from_env({ev.PD_TENSOR_PARALLEL: "4"}).spans
    with pytest.raises(ValueError, match=ev.PD_PODS_PER_INSTANCE):
        ev.Gang.from_env({ev.PD_PODS_PER_INSTANCE: "3", ev.PD_TP_SIZE: "4"})


# ---- the operator's decisions -----------------------------------------------------------------

def pod(name: str, uid: str = "", node: str | None = "n1", phase: str = "Running", gated: bool = False,
        restarts: int = 0, ip: str | None = "127.1.0.1", unschedulable: str | None = None,
        leaving: bool = False) -> dict:
    group = name.rsplit("-", 2)[1]
    p = {"metadata": {"name": name, "uid": uid or f"u-{name}", "labels": {"pdoperator.io/group": group,
                      "pdoperator.io/role": group, "apps.kubernetes.io/pod-index": name.rsplit("-", 1)[1]}},
         "spec": {"containers": [{"name": "agent"}]}, "status": {"phase": phase,
                                                                  "containerStatuses": [{"restartCount": restarts}]}}
    if node:
        p["spec"]["nodeName"] = node
    if ip:
        p["status"]["podIP"] = ip
    if gated:
        p["spec"]["schedulingGates"] = [{"name": GANG_GATE}, {"name": "other.io/keep"}]
    if unschedulable:
        p["status"]["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                      "message": unschedulable}]
    if leaving:
        p["metadata"]["deletionTimestamp"] = "2026-12-07T00:00:00Z"
    return p


SPEC_G = parse_spec(gang_spec())


def test_only_the_first_pod_of_an_instance_is_a_member():
    lead, follow = member_of(pod("x-decoder-2"), SPEC_G), member_of(pod("x-decoder-3"), SPEC_G)
    assert follow is None
    assert lead.tp == 8 and lead.followers == ("x-decoder-3",) and lead.cluster_id == 1008


def test_gates_are_lifted_together_and_an_instance_not_placed_in_time_gives_its_npus_back():
    gated = [pod(f"x-prefill-{i}", node=None, phase="Pending", gated=True, ip=None) for i in (0, 1)]
    # one pod not made yet: nothing lifted
    assert gangs.plan(SPEC_G, gated[:1], {}, {}, None, 0).ungate == []
    out = gangs.plan(SPEC_G, gated, {}, {}, None, 100)
    assert out.ungate == [(f"x-prefill-{i}", f"u-x-prefill-{i}", [{"name": "other.io/keep"}]) for i in (0, 1)]
    memo = out.memos["prefill-0"]
    assert memo.ungated_at == 100
    why = "0/3 nodes are available: 3 Insufficient huawei.com/Ascend910."
    stuck = [pod("x-prefill-0", node="n1", phase="Pending"),
             pod("x-prefill-1", node=None, phase="Pending", unschedulable=why)]
    assert gangs.plan(SPEC_G, stuck, {}, {"prefill-0": memo}, None, 219).delete == []   # within 120 s
    late = gangs.plan(SPEC_G, stuck, {}, {"prefill-0": memo}, None, 221)
    assert [d[0] for d in late.delete] == ["x-prefill-0", "x-prefill-1"]
    assert "instance prefill-0" in late.unplaced[0] and why in late.unplaced[0]
    assert late.events[0][1] == "GangUnplaced"
    # back behind the gate: lifted again only when the free NPUs hold every pod
    memo = late.memos["prefill-0"]
    for free, lifted in ((None, False), ({"n1": 8, "n2": 7}, False), ({"n1": 16}, True), ({"n1": 8, "n2": 8}, True)):
        again = gangs.plan(SPEC_G, gated, {}, {"prefill-0": memo}, free, 300)
        assert bool(again.ungate) == lifted, free
        assert bool(again.unplaced) != lifted and (lifted or "cannot be placed whole" in again.unplaced[0])


def test_a_pod_lost_restarts_its_instance_whole():
    running = [pod("x-prefill-0"), pod("x-prefill-1")]
    memo = gangs.plan(SPEC_G, running, {}, {}, None, 0).memos["prefill-0"]
    assert len(memo.incarnation) == 2
    assert gangs.plan(SPEC_G, running, {}, {"prefill-0": memo}, None, 1).delete == []
    # pod 1 replaced (a new uid, behind its gate): pod 0 goes too
    replaced = [pod("x-prefill-0"), pod("x-prefill-1", uid="new", node=None, phase="Pending", gated=True)]
    out = gangs.plan(SPEC_G, replaced, {}, {"prefill-0": memo}, None, 2)
    assert [d[0] for d in out.delete] == ["x-prefill-0"] and out.events[0][1] == "GangRestarted"
    # until the deletes took, it is deleted again (an API error half way does not leave it half restarted)
    memo2 = out.memos["prefill-0"]
    again = gangs.plan(SPEC_G, replaced, {}, {"prefill-0": memo2}, None, 3)
    assert [d[0] for d in again.delete] == ["x-prefill-0"] and not again.events
    gone = [pod("x-prefill-0", leaving=True), replaced[1]]
    assert gangs.plan(SPEC_G, gone, {}, {"prefill-0": memo2}, None, 4).memos == {}
    # a container restart ends the incarnation too: every pod of it goes
    restarted = [pod("x-prefill-0"), pod("x-prefill-1", restarts=1)]
    assert [d[0] for d in gangs.plan(SPEC_G, restarted, {}, {"prefill-0": memo}, None, 2).delete] == \
        ["x-prefill-0", "x-prefill-1"]
    # a pod being deleted: the rest go at once, before it is gone
    going = gangs.plan(SPEC_G, [pod("x-prefill-0"), pod("x-prefill-1", leaving=True)], {}, {"prefill-0": memo}, None, 3)
    assert [d[0] for d in going.delete] == ["x-prefill-0"] and "x-prefill-1 lost" in going.events[0][2]
    # once restarted, nothing more is done while some of it is still leaving
    leaving = [pod("x-prefill-0", leaving=True), pod("x-prefill-1", uid="new", node=None, gated=True)]
    assert gangs.plan(SPEC_G, leaving, {}, {}, None, 3).delete == []


def test_the_leading_pod_is_told_its_members_until_it_reports_them():
    running = [pod("x-decoder-2", ip="127.1.0.2"), pod("x-decoder-3", ip="127.1.0.3")]
    out = gangs.plan(SPEC_G, running, {}, {}, None, 0)
    assert [(t[0], t[1]) for t in out.tell] == [("x-decoder-2", "http://127.1.0.2:8080")]
    assert out.tell[0][2] == GangRequest(members=[GangMember(pod="x-decoder-3", agent_url="http://127.1.0.3:8080",
                                                             first_rank=4)])
    memo = out.memos["decoder-1"]
    assert gangs.plan(SPEC_G, running, {}, {"decoder-1": memo}, None, 1).tell == []      # told 1 s ago
    assert len(gangs.plan(SPEC_G, running, {}, {"decoder-1": memo}, None, 3).tell) == 1  # not taken: again
    st = AgentStatus(pod="x-decoder-2", role="decoder", cluster_id=1008, boot_id="b", backend="sim", initialized=True,
                     ip="127.1.0.2", port=26000, model_id=0,
                     gang=GangState(index=0, pods=2, members={"x-decoder-3": "http://127.1.0.3:8080"}))
    assert gangs.plan(SPEC_G, running, {"x-decoder-2": st}, {"decoder-1": memo}, None, 9).tell == []


def test_free_npus_count_what_bound_pods_request():
    nodes = [{"metadata": {"name": n}, "status": {"allocatable": {"huawei.com/Ascend910": "32"}}} for n in "ab"] + \
        [{"metadata": {"name": "c"}, "spec": {"unschedulable": True}, "status": {"allocatable": {
            "huawei.com/Ascend910": "32"}}}]
    pods = [{"spec": {"nodeName": "a", "containers": [{"resources": {"limits": {"huawei.com/Ascend910": "24"}}}]}},
            {"spec": {"containers": [{"resources": {"limits": {"huawei.com/Ascend910": "8"}}}]}}]
    assert gangs.free_npus(nodes, pods, "huawei.com/Ascend910") == {"a": 8, "b": 32}
    assert gangs.fits({"a": 8, "b": 32}, 3, 12) is False and gangs.fits({"a": 8, "b": 32}, 3, 8) is True


# ---- the agents ---------------------------------------------------------------------------------

def test_the_leading_agent_takes_its_members_ranks_on():
    registered: list[RegisterRank] = []

    def answer(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/ranks"
        return httpx.Response(200, json={"ranks": [{"rank": r, "url": f"http://127.2.0.1:{9000 + r}", "boot_id": "b"}
                                                   for r in range(8, 16)]})

    async def go() -> None:
        http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        m = Members(ev.Gang(pods=2, tp=16, index=0), http, dict, registered.append, lambda: 0.0)
        with pytest.raises(Exception, match="first rank of another pod"):
            m.tell(GangRequest(members=[GangMember(pod="p-1", agent_url="http://127.2.0.1:8080", first_rank=3)]))
        m.tell(GangRequest(members=[GangMember(pod="p-1", agent_url="http://127.2.0.1:8080", first_rank=8)]))
        await m.adopt(missing=True)
        assert [r.rank for r in registered] == list(range(8, 16))
        await m.adopt(missing=True)          # within ADOPT_EVERY_S: not asked again
        assert len(registered) == 8
        st = m.state(lambda r: r < 16)
        assert st.members == {"p-1": "http://127.2.0.1:8080"} and st.missing == []
        follower = Members(ev.Gang(pods=2, tp=16, index=1), http, dict, registered.append, lambda: 0.0)
        with pytest.raises(Exception, match="pod 1 of its instance"):
            follower.tell(GangRequest(members=[]))
        await http.aclose()
    asyncio.run(go())


def test_data_parallel_groups_take_decodes_by_what_they_hold():
    g = Groups(ev.Gang(pods=2, tp=2, dp=4))
    assert g.ranks(3) == [6, 7]
    with g.take() as a, g.take() as b, g.take() as c:
        assert (a, b, c) == (0, 1, 2)
        with g.take() as d:
            assert d == 3
    with g.take() as e:
        assert e == 0
    one = Groups(ev.Gang(tp=4))
    with one.take() as only:
        assert one.ranks(only) == [0, 1, 2, 3]
