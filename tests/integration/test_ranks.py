"""Real Ascend instances on the local cluster: one engine per tensor-parallel rank, each on the
device IP the local device plugin wrote into the pod's annotation, rank-matched links and
per-rank-pair KV-path verification."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import Cluster, wait_for
from tests.integration.conftest import agent_post, agent_status, condition, pdd, sample, wait_phase
from tests.integration.test_gateway import kubectl_pdd

pytestmark = pytest.mark.integration
NAME = "tp4"
ANNOTATION = "ascend.kubectl.kubernetes.io/ascend-910-configuration"
TP = 4
PODS = [f"{NAME}-{g}-{i}" for g in ("prefill", "decoder") for i in (0, 1)]


def tp4() -> dict:
    doc = sample(NAME, **{"model.kvCache.tensorParallel": TP, "datadist.verifyIntervalSeconds": 5})
    for g in ("prefill", "decoder"):
        doc["spec"][g]["resources"] = {"limits": {"huawei.com/Ascend910": TP}}
    return doc


def annotation(cluster: Cluster, ns: str, pod: str) -> dict:
    return json.loads(cluster.get_json("pod", pod, "-n", ns)["metadata"]["annotations"][ANNOTATION])


def test_tp4_ranks_on_device_ips_link_rank_to_rank_and_verify(cluster: Cluster, namespace: str, operator) -> None:
    ns = namespace
    cluster.apply(tp4(), ns)
    obj = wait_phase(cluster, ns, "Ready", name=NAME, timeout=180,
                     extra=lambda o: o["status"]["linksSummary"] == "16/16")
    assert obj["status"]["links"] == {"expected": 16, "up": 16}
    assert condition(obj, "KVPathVerified")["status"] == "True"

    # 16 rank engines, each on a distinct loopback device IP from the annotation the local device plugin wrote
    status = {p: agent_status(cluster, ns, p, NAME) for p in PODS}
    ips = set()
    for pod, st in status.items():
        devices = annotation(cluster, ns, pod)["devices"]
        assert len(devices) == TP and st["device_ips"] == "annotation", (pod, st["device_ips"])
        assert st["tensor_parallel"] == TP and len(st["ranks"]) == TP and st["initialized"]
        group, index = pod.rsplit("-", 2)[1], int(pod.rsplit("-", 1)[1])
        base = 0 if group == "prefill" else 1000
        for r, rank in enumerate(st["ranks"]):
            assert rank["rank"] == r and rank["initialized"]
            assert rank["cluster_id"] == base + index * TP + r
            assert rank["ip"] == devices[r]["device_ip"] and rank["device_id"] == int(devices[r]["device_id"])
            assert rank["ip"].startswith("127.") and rank["ip"] != cluster.get_json(
                "pod", pod, "-n", ns)["status"]["podIP"]
            ips.add((rank["ip"], rank["port"]))
    assert len(ips) == 16

    # decoder rank r links rank r of every prefill
    for d in (f"{NAME}-decoder-0", f"{NAME}-decoder-1"):
        links = {l["name"]: l for l in status[d]["links"]}
        assert set(links) == {f"{NAME}-prefill-0", f"{NAME}-prefill-1"}
        for p, link in links.items():
            assert [x["cluster_id"] for x in link["ranks"]] == [x["cluster_id"] for x in status[p]["ranks"]]
            assert [x["ip"] for x in link["ranks"]] == [x["ip"] for x in status[p]["ranks"]]
            assert all(x["code"] == "LLM_SUCCESS" for x in link["ranks"])
    members = {m["pod"]: m for m in obj["status"]["members"]}
    assert members[f"{NAME}-decoder-0"]["ranks"] == {"tensorParallel": TP, "initialized": TP,
                                                     "deviceIps": "annotation"}

    # every rank pair's KV path is verified within a few verification intervals
    seen: set[str] = set()

    def all_pairs() -> bool:
        seen.update(pdd(cluster, ns, NAME)["status"].get("lastVerified", {}).get("paths", []))
        return {f"{NAME}-decoder-{d} <- {NAME}-prefill-{p} ({TP} rank pairs)" for d in (0, 1) for p in (0, 1)} <= seen
    wait_for("every decoder/prefill pair verified at every rank", all_pairs, timeout=60, interval=1)
    p0 = status[f"{NAME}-prefill-0"]
    p0_url = f"http://{cluster.get_json('pod', f'{NAME}-prefill-0', '-n', ns)['status']['podIP']}:8080"
    peer = {"name": f"{NAME}-prefill-0", "cluster_id": 0, "ip": p0["ip"], "port": 26000, "agent_url": p0_url,
            "ranks": [{k: x[k] for k in ("rank", "cluster_id", "ip", "port")} for x in p0["ranks"]]}
    res = agent_post(cluster, ns, f"{NAME}-decoder-1", "/v1/verify", {"peer": peer}, name=NAME)
    assert res["ok"] and [x["rank"] for x in res["ranks"]] == [0, 1, 2, 3] and all(x["ok"] for x in res["ranks"])

    # kubectl pdd: link and probe per rank pair, each rank's device IP
    r = kubectl_pdd(cluster, "verify", NAME, "-n", ns)
    assert r.returncode == 0 and r.stdout.count("4/4 ranks up") == 4, r.stdout + r.stderr
    assert r.stdout.count("4 rank pairs") == 2 and "bytes match" in r.stdout, r.stdout
    r = kubectl_pdd(cluster, "status", NAME, "-n", ns)
    assert r.returncode == 0, r.stdout + r.stderr
    for rank in status[f"{NAME}-prefill-1"]["ranks"]:
        assert f"{rank['ip']}:{rank['port']}" in r.stdout, r.stdout

    # a pod whose annotation lacks one rank's device: the condition names the pod and the rank; the others link
    broken = f"{NAME}-prefill-1"
    ann = annotation(cluster, ns, broken)
    partial = {**ann, "devices": ann["devices"][:3]}
    cluster.kubectl("annotate", "--overwrite", "pod", broken, "-n", ns, f"{ANNOTATION}={json.dumps(partial)}")
    agent_post(cluster, ns, broken, "/v1/admin/faults", {"crash": True}, name=NAME)   # its container restarts
    obj = wait_for("DeviceIPUnknown naming the pod and rank 3", lambda: (
        o if "DeviceIPUnknown" == condition(o := pdd(cluster, ns, NAME), "AgentsReady").get("reason")
        and broken in condition(o, "AgentsReady")["message"] and "rank 3" in condition(o, "AgentsReady")["message"]
        else None), timeout=120)
    assert obj["status"]["phase"] == "Degraded"
    wait_for("the other prefill's rank links up (8 of the 8 remaining)",
             lambda: pdd(cluster, ns, NAME)["status"]["links"] == {"expected": 8, "up": 8}, timeout=60)
    # the device plugin writes the whole mapping: the pod's agent reads it from the volume and starts its ranks
    cluster.kubectl("annotate", "--overwrite", "pod", broken, "-n", ns, f"{ANNOTATION}={json.dumps(ann)}")
    wait_phase(cluster, ns, "Ready", name=NAME, timeout=120, extra=lambda o: o["status"]["linksSummary"] == "16/16")


# ---- the pod's agent over its rank processes, without a cluster -----------------------------------

def rank_peer(a, st: dict) -> dict:
    return {"name": a.name, "cluster_id": st["cluster_id"], "ip": st["ip"], "port": st["port"], "agent_url": a.url,
            "ranks": [{k: x[k] for k in ("rank", "cluster_id", "ip", "port")} for x in st["ranks"]]}


def test_simulator_pod_without_annotation_runs_ranks_on_the_pod_ip_with_port_offsets(agents, tmp_path) -> None:
    env = {"PD_TENSOR_PARALLEL": "3", "PD_HCCN_CONF": str(tmp_path / "absent"),
           "PD_DEVICE_ANNOTATION_FILE": str(tmp_path / "absent"), "PD_AGENT_DATA_TOKEN": "data-token"}
    p, d = agents("prompt", 0, env=env), agents("decoder", 1000, env=env)
    ps = p.status()
    assert ps["device_ips"] == "pod-ip" and not ps["device_error"]
    assert [(r["cluster_id"], r["ip"], r["port"]) for r in ps["ranks"]] == [(i, p.ip, 26000 + i) for i in range(3)]
    r = d.post("/v1/link", {"peers": [rank_peer(p, ps)], "timeout_ms": 3000})
    assert r.status_code == 200 and r.json()["rank_rets"][p.name] == ["LLM_SUCCESS"] * 3, r.text
    v = d.post("/v1/verify", {"peer": rank_peer(p, ps)}).json()
    assert v["ok"] and [x["rank"] for x in v["ranks"]] == [0, 1, 2] and all(x["bytes"] > 0 for x in v["ranks"])
    wait_for("the prefill's ranks to list the decoder", lambda: sorted(p.status()["incoming"]) == [1000], timeout=10)
    # a peer whose TP neither divides nor is divided by ours is refused, naming the reason
    two = {**rank_peer(p, ps), "ranks": rank_peer(p, ps)["ranks"][:2]}
    r = d.post("/v1/link", {"peers": [two]})
    assert r.status_code == 400 and "one must divide the other" in r.json()["message"]
    # the data scope (routers) cannot reach a rank's own API or set the instance's own fields
    data = {"Authorization": "Bearer data-token"}
    assert d.http.get("/r/0/v1/status", headers=data).status_code == 200
    assert d.http.post("/r/0/v1/decode", headers=data, json={}).status_code == 403
    r = d.http.post("/v1/decode", headers=data, json={"req_id": 1, "prompt_cluster_id": 0, "prompt_tokens": 8,
                                                      "output_tokens": 2, "admitted": True})
    assert r.status_code == 403 and "admitted" in r.json()["message"]
    r = p.http.post("/v1/notify", headers=data, json={"decoder_cluster_id": 1000, "released": [1]})
    assert r.status_code == 403 and "released" in r.json()["message"]
    # unlink by name drops every rank's link
    r = d.post("/v1/unlink", {"peers": [{"name": p.name, "cluster_id": 0, "ip": p.ip, "port": 26000}]})
    assert r.json()["rank_rets"][p.name] == ["LLM_SUCCESS"] * 3 and d.status()["links"] == []


def test_hccn_conf_line_that_does_not_parse_is_reported_by_the_agent(tmp_path) -> None:
    import httpx

    from tests.agent_procs import TOKEN, next_ip
    from tests.procs import spawn
    conf = tmp_path / "hccn.conf"
    conf.write_text("address_0=192.168.100.101\naddress_1 = 192.168.100.102 extra\n")
    ip = next_ip()
    env = {k: v for k, v in __import__("os").environ.items() if "proxy" not in k.lower()}
    env.update(PD_LOCAL_POD_IP=ip, POD_NAME="bad-hccn", LLM_DATADIST_ROLE="prompt", LLM_DATADIST_CLUSTER_ID="0",
               LLM_DATADIST_IP=ip, PD_AGENT_TOKEN=TOKEN, PD_TENSOR_PARALLEL="2", PD_HCCN_CONF=str(conf),
               PD_DEVICE_ANNOTATION_FILE=str(tmp_path / "absent"), PD_BACKEND="sim")
    proc = spawn([sys.executable, "-m", "pd_agent"], env=env, stdout=open(tmp_path / "log", "wb"),
                 stderr=subprocess.STDOUT)
    try:
        with httpx.Client(base_url=f"http://{ip}:8080", trust_env=False, timeout=5,
                          headers={"Authorization": f"Bearer {TOKEN}"}) as http:
            def reported():
                try:
                    st = http.get("/v1/status").json()
                except httpx.HTTPError:
                    return None
                return st if st.get("device_error") else None
            st = wait_for("the agent to report the bad line", reported, timeout=60)
            assert f"{conf} line 2" in st["device_error"] and "does not parse" in st["device_error"]
            assert not st["initialized"] and http.get("/healthz").status_code == 503
    finally:
        proc.terminate()
        proc.wait(30)


def test_single_rank_decoder_reads_rank_0_of_a_multi_rank_mla_prefill(agents, tmp_path) -> None:
    """MLA: a decoder of TP 1 pairs with prefill rank 0; the copy on rank 1 is released when rank 0's is pulled."""
    env = {"PD_HCCN_CONF": str(tmp_path / "absent"), "PD_DEVICE_ANNOTATION_FILE": str(tmp_path / "absent")}
    p = agents("prompt", 0, env={**env, "PD_TENSOR_PARALLEL": "2"})
    d = agents("decoder", 1000, env=env)
    ps = p.status()
    r = d.post("/v1/link", {"peers": [rank_peer(p, ps)], "timeout_ms": 3000})
    assert r.json()["rets"][p.name] == "LLM_SUCCESS", r.text
    v = d.post("/v1/verify", {"peer": rank_peer(p, ps)}).json()
    assert v["ok"], v
    assert p.post("/v1/prefill", {"req_id": 42, "prompt_tokens": 64}).status_code == 200
    wait_for("a copy on each prefill rank", lambda: p.status()["load"]["pending_kv"] == 2, timeout=10)
    r = d.post("/v1/decode", {"req_id": 42, "prompt_cluster_id": ps["cluster_id"], "prompt_agent_url": p.url,
                              "prompt_tokens": 64, "output_tokens": 3})
    assert r.status_code == 200 and r.json()["tokens"] == 3, r.text
    wait_for("both ranks' copies freed", lambda: p.status()["load"]["pending_kv"] == 0, timeout=10)
