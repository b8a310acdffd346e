"""MindIE's role path: the rank table from the pods, the role body, the stand-in's checks, the
agent's pushes after a switch, and the operator keeping the table (only when spec.mindie asks)."""
from __future__ import annotations

import copy
import json
import socket

import httpx
import pytest
from aiohttp import web

import llm_datadist_sim as llm
from pd_agent.core import AgentCore
from pd_agent.identity import Identity
from pd_agent.mindie_hook import Pusher, body_for, role_url
from pd_contract.mindie import rank_table, render, role_body, servers
from pd_engine.mindie_standin import build_app
from pd_operator import ranktable
from pd_operator.api import parse_spec
from tests.unit.controller_fakes import pod
from tests.unit.test_controller_scenarios import MANUAL, SPEC, World

ANN = "ascend.kubectl.kubernetes.io/ascend-910-configuration"


def annotated(name: str, group: str, index: int, ip: str, host: str, devs: list[int], role: str | None = None) -> dict:
    p = pod(name, group, index, ip, role=role)
    third = 0 if group == "prefill" else 1
    p["metadata"]["annotations"][ANN] = json.dumps({
        "pod_name": name, "server_id": host,
        # the plugin's order is not the ranks': rank r is the r-th device by id
        "devices": [{"device_id": str(d), "device_ip": f"10.{third}.{index}.{d + 1}"} for d in reversed(devs)]})
    p["status"]["hostIP"] = host
    p["spec"] = {"nodeName": f"node-{host.rsplit('.', 1)[1]}"}
    return p


def fleet() -> list[dict]:
    """2 prefill + 2 decoder pods of TP 2, two pods per node."""
    return [annotated("x-decoder-1", "decoder", 1, "172.16.1.11", "192.168.0.2", [2, 3]),
            annotated("x-prefill-0", "prefill", 0, "172.16.0.10", "192.168.0.1", [0, 1]),
            annotated("x-decoder-0", "decoder", 0, "172.16.1.10", "192.168.0.2", [0, 1]),
            annotated("x-prefill-1", "prefill", 1, "172.16.0.11", "192.168.0.1", [2, 3])]


def server(pod_name: str, ip: str, host: str, instance: int, ips: list[tuple[int, str]]) -> dict:
    return {"server_id": host, "host_ip": host, "server_ip": ip, "container_ip": ip, "pod_name": pod_name,
            "instance_id": instance,
            "device": [{"device_id": str(d), "device_ip": dip, "device_logical_id": str(r), "rank_id": str(r)}
                       for r, (d, dip) in enumerate(ips)]}


EXPECTED = {
    "version": "1.0", "status": "completed",
    "server_group_list": [
        {"group_id": "0", "group_name": "prefill", "server_count": "2", "server_list": [
            server("x-prefill-0", "172.16.0.10", "192.168.0.1", 0, [(0, "10.0.0.1"), (1, "10.0.0.2")]),
            server("x-prefill-1", "172.16.0.11", "192.168.0.1", 1, [(2, "10.0.1.3"), (3, "10.0.1.4")])]},
        {"group_id": "1", "group_name": "decode", "server_count": "2", "server_list": [
            server("x-decoder-0", "172.16.1.10", "192.168.0.2", 1000, [(0, "10.1.0.1"), (1, "10.1.0.2")]),
            server("x-decoder-1", "172.16.1.11", "192.168.0.2", 1001, [(2, "10.1.1.3"), (3, "10.1.1.4")])]}]}


# ---- the rank table and the body (pure) --------------------------------------------------------

def test_rank_table_of_two_prefill_and_two_decoder_pods_at_tp_2():
    assert rank_table(fleet()) == EXPECTED
    assert render(rank_table(reversed(fleet()))) == render(EXPECTED)   # the pods' order does not matter


def test_rank_table_follows_roles_and_waits_for_devices():
    pods = fleet()
    pods[2]["metadata"]["labels"]["pdoperator.io/role"] = "switching"          # x-decoder-0, being switched
    pods[2]["metadata"]["annotations"]["pdoperator.io/assigned-role"] = "prefill"
    pods[0]["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"          # x-decoder-1 is leaving
    t = rank_table(pods)
    assert [s["pod_name"] for s in servers(t, "prefill")] == ["x-decoder-0", "x-prefill-0", "x-prefill-1"]
    assert servers(t, "decode") == [] and t["status"] == "completed"
    del pods[3]["metadata"]["annotations"][ANN]                                 # the plugin has not written yet
    t = rank_table(pods)
    assert t["status"] == "initializing" and "x-prefill-1" not in [s["pod_name"] for s in servers(t, "prefill")]


def test_role_body_has_local_and_the_other_roles_instances():
    pods = fleet()
    body = role_body("decode", pods[2], servers(EXPECTED, "prefill"))
    dev = lambda d, ip, r: {"device_id": str(d), "device_ip": ip, "device_logical_id": str(r), "rank_id": str(r)}  # noqa: E731
    assert body == {
        "local": [{"server_ip": "172.16.1.10", "host_ip": "192.168.0.2", "dp_inst_list": [
            {"dp_inst_id": 1000, "device": [dev(0, "10.1.0.1", 0), dev(1, "10.1.0.2", 1)]}]}],
        "peers": [[{"server_ip": "172.16.0.10", "host_ip": "192.168.0.1", "dp_inst_list": [
                      {"dp_inst_id": 0, "device": [dev(0, "10.0.0.1", 0), dev(1, "10.0.0.2", 1)]}]}],
                  [{"server_ip": "172.16.0.11", "host_ip": "192.168.0.1", "dp_inst_list": [
                      {"dp_inst_id": 1, "device": [dev(2, "10.0.1.3", 0), dev(3, "10.0.1.4", 1)]}]}]]}
    with pytest.raises(ValueError):
        role_body("decoder", pods[2], [])


# ---- the stand-in ------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
async def standin():
    runner = web.AppRunner(build_app(), access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def test_the_standin_takes_a_good_body_and_names_the_field_of_a_bad_one(standin):
    good = role_body("prefill", fleet()[1], servers(EXPECTED, "decode"))
    async with httpx.AsyncClient(base_url=standin, trust_env=False) as c:
        assert (await c.get("/v2/role")).json()["role"] is None
        r = await c.post("/v2/role/prefill", json=good)
        assert r.status_code == 200 and r.json()["role"] == "prefill"
        bad = copy.deepcopy(good)
        del bad["local"][0]["dp_inst_list"][0]["device"][1]["device_ip"]
        r = await c.post("/v2/role/decode", json=bad)
        assert r.status_code == 400 and r.json()["field"] == "local[0].dp_inst_list[0].device[1].device_ip"
        for mutate, field in ((lambda b: b.pop("peers"), "peers"),
                              (lambda b: b["peers"][0][0].update(server_ip="pod-a"), "peers[0][0].server_ip"),
                              (lambda b: b["local"][0]["dp_inst_list"][0].update(dp_inst_id=-1),
                               "local[0].dp_inst_list[0].dp_inst_id"),
                              (lambda b: b["local"][0]["dp_inst_list"][0]["device"][0].update(rank_id=0),
                               "local[0].dp_inst_list[0].device[0].rank_id")):
            b = copy.deepcopy(good)
            mutate(b)
            r = await c.post("/v2/role/decode", json=b)
            assert r.status_code == 400 and r.json()["field"] == field, r.text
        assert (await c.post("/v2/role/decoder", json=good)).status_code == 400
        assert (await c.get("/v2/role")).json() == {"role": "prefill", "local": good["local"], "peers": good["peers"]}
        pushes = (await c.get("/pushes")).json()
    assert [(p["seq"], p["role"], p["status"]) for p in pushes] == \
        [(1, "prefill", 200)] + [(i, "decode", 400) for i in range(2, 7)] + [(7, "decoder", 400)]
    assert pushes[0]["body"] == good


# ---- the agent's pushes --------------------------------------------------------------------------

def pod_env(tmp_path, table: dict | None, me: dict, **extra) -> dict[str, str]:
    ann = tmp_path / "ascend-910-configuration"
    ann.write_text(me["metadata"]["annotations"][ANN])
    env = {"POD_NAME": me["metadata"]["name"], "LLM_DATADIST_IP": me["status"]["podIP"],
           "PD_TENSOR_PARALLEL": "2", "PD_DEVICE_ANNOTATION_FILE": str(ann),
           "PD_MINDIE_RANK_TABLE_FILE": str(tmp_path / "ranktable.json"), **extra}
    if table is not None:
        (tmp_path / "ranktable.json").write_text(render(table))
    return env


def test_the_body_is_this_pods_devices_and_the_other_roles_servers(tmp_path):
    me = fleet()[1]   # x-prefill-0
    role, body = body_for("prompt", pod_env(tmp_path, EXPECTED, me))
    assert role == "prefill" and body == role_body("prefill", me, servers(EXPECTED, "decode"))
    # after a switch to decoder the peers are the prefills but this pod (the table may still list it there)
    role, body = body_for("decoder", pod_env(tmp_path, EXPECTED, me))
    assert role == "decode" and body == role_body("decode", me, servers(EXPECTED, "prefill")[1:])
    # no table yet: no peers
    (tmp_path / "ranktable.json").unlink()
    _, body = body_for("prompt", pod_env(tmp_path, None, me))
    assert body["peers"] == [] and body["local"][0]["server_ip"] == "172.16.0.10"


def test_the_role_url_on_the_process_runtime_is_the_pods_own_address():
    env = {"PD_MINDIE_ROLE_URL": "http://127.0.0.1:1026/", "PD_LOCAL_POD_IP": "127.3.0.7"}
    assert role_url(env) == "http://127.3.0.7:1026"
    assert role_url({"PD_MINDIE_ROLE_URL": "http://mindie:1026"}) == "http://mindie:1026"
    assert role_url({}) is None


async def test_a_switch_pushes_the_new_role_with_its_peers(tmp_path, standin):
    me = fleet()[2]   # x-decoder-0
    env = pod_env(tmp_path, EXPECTED, me)
    core = AgentCore(llm, Identity(pod="x-decoder-0", role="decoder", cluster_id=1000, ip="127.0.0.1",
                                   port=free_port(), switchable=True))
    pusher = Pusher(standin, env, core.role)
    core.after_switch.append(pusher.after_switch)
    await core.init()
    try:
        assert await pusher.push("initial role")
        assert await pusher.push("nothing changed")          # the server has it: not sent again
        await core.switch_role("prompt")
        async with httpx.AsyncClient(base_url=standin, trust_env=False) as c:
            pushes = (await c.get("/pushes")).json()
            current = (await c.get("/v2/role")).json()
    finally:
        await pusher.aclose()
        await core.finalize()
    assert [(p["role"], p["status"]) for p in pushes] == [("decode", 200), ("prefill", 200)]
    assert pushes[0]["body"] == role_body("decode", me, servers(EXPECTED, "prefill"))
    assert pushes[1]["body"] == role_body("prefill", me, servers(EXPECTED, "decode")[1:])
    assert current["role"] == "prefill"


async def test_a_push_the_server_cannot_take_is_retried(tmp_path):
    me = fleet()[1]
    port = free_port()
    pusher = Pusher(f"http://127.0.0.1:{port}", pod_env(tmp_path, EXPECTED, me), "prompt")
    try:
        assert not await pusher.push("initial role")          # nothing listens yet
        assert pusher.failures == 1 and "ConnectError" in pusher.last_error
        runner = web.AppRunner(build_app(), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            assert await pusher.push("retry") and pusher.failures == 0 and pusher.pushes == 1
        finally:
            await runner.cleanup()
    finally:
        await pusher.aclose()


# ---- the operator --------------------------------------------------------------------------------

def test_the_pods_get_the_table_and_the_url_only_when_mindie_is_enabled():
    spec = parse_spec({**SPEC, "mindie": {"enabled": True, "roleUrl": "http://127.0.0.1:1027"}})
    env, volumes, mounts = ranktable.mindie_pod_patch(spec, "x")
    assert {e["name"]: e["value"] for e in env} == {"PD_MINDIE_ROLE_URL": "http://127.0.0.1:1027",
                                                    "PD_MINDIE_RANK_TABLE_FILE": "/etc/pd-mindie/ranktable.json"}
    assert volumes == [{"name": "mindie-rank-table", "configMap": {"name": "x-rank-table", "optional": True}}]
    assert mounts[0]["mountPath"] == "/etc/pd-mindie"
    assert ranktable.mindie_pod_patch(parse_spec(SPEC), "x") == ([], [], [])
    assert ranktable.mindie_pod_patch(parse_spec({**SPEC, "mindie": {}}), "x") == ([], [], [])


def annotate(w: World) -> None:
    """The device plugin writes each pod's annotation."""
    for (kind, _, name), p in list(w.kube.objects.items()):
        if kind == "Pod":
            group = p["metadata"]["labels"]["pdoperator.io/group"]
            index = int(p["metadata"]["labels"]["apps.kubernetes.io/pod-index"])
            host = "192.168.0.1" if group == "prefill" else "192.168.0.2"
            p["metadata"]["annotations"][ANN] = annotated(name, group, index, p["status"]["podIP"], host,
                                                          [2 * index, 2 * index + 1])["metadata"]["annotations"][ANN]
            w.kube.feed(w.kube.store(p))


def table_of(w: World) -> dict:
    return json.loads(w.kube.objects[("ConfigMap", "ns", "x-rank-table")]["data"]["ranktable.json"])


async def test_the_operator_keeps_the_rank_table_only_when_mindie_is_enabled():
    w = World()
    w.add_pods()
    annotate(w)
    await w.settle()
    assert ("ConfigMap", "ns", "x-rank-table") not in w.kube.objects
    sts = w.kube.objects[("StatefulSet", "ns", "x-prefill")]["spec"]["template"]["spec"]
    assert not any(v["name"] == "mindie-rank-table" for v in sts.get("volumes", []))

    w = World({**SPEC, "rebalance": MANUAL, "mindie": {"enabled": True}})
    w.add_pods()
    annotate(w)
    await w.settle()
    t = table_of(w)
    assert t["status"] == "completed"
    assert [s["pod_name"] for s in servers(t, "prefill")] == ["x-prefill-0", "x-prefill-1"]
    assert [s["pod_name"] for s in servers(t, "decode")] == ["x-decoder-0", "x-decoder-1"]
    sts = w.kube.objects[("StatefulSet", "ns", "x-decoder")]["spec"]["template"]["spec"]
    assert {"name": "PD_MINDIE_ROLE_URL", "value": "http://127.0.0.1:1026"} in sts["containers"][0]["env"]
    # a settled pass does not write the table again
    before = len(w.log)
    await w.settle()
    assert ("apply", "ConfigMap", "x-rank-table") not in w.log[before:]
    # a live switch: the table follows the pod's role
    w.patch_spec(manual={"prefill": 3})
    await w.settle()
    assert w.status["lastSwitch"]["result"] == "Completed"
    moved = w.status["lastSwitch"]["pod"]
    t = table_of(w)
    assert moved in [s["pod_name"] for s in servers(t, "prefill")] and len(servers(t, "prefill")) == 3
    assert [s["pod_name"] for s in servers(t, "decode")] == [p for p in ("x-decoder-0", "x-decoder-1") if p != moved]
