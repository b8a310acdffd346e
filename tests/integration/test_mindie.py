"""The MindIE role path: with spec.mindie enabled the operator keeps a global rank table of its
pods (a ConfigMap mounted in them), and each pod's agent pushes its role to the MindIE server with
POST /v2/role/{prefill|decode}: once its engine is up, after a live switch, and when its peers
change. A stand-in that speaks that API receives the pushes here, while traffic runs."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.conftest import REPO, Cluster, wait_for
from tests.integration.conftest import sample, wait_phase
from tests.integration.test_switching import REBALANCE, TRAFFIC_SPEC, set_prefill, switched
from tests.integration.test_traffic import Load

pytestmark = pytest.mark.integration
NPU = "huawei.com/Ascend910"
HOST = "127.250.0.1"     # a loopback address no local pod is given


@pytest.fixture
def standin():
    with socket.socket() as s:
        s.bind((HOST, 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "pd_engine.mindie_standin", "--host", HOST, "--port", str(port)],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://{HOST}:{port}"
    wait_for("the MindIE stand-in", lambda: httpx.get(f"{url}/healthz", trust_env=False).status_code == 200,
             timeout=30)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def pushes(url: str) -> list[dict]:
    return httpx.get(f"{url}/pushes", trust_env=False, timeout=10).json()


def pods(cluster: Cluster, ns: str) -> dict[str, dict]:
    return {p["metadata"]["name"]: p for p in
            cluster.get_json("pods", "-n", ns, "-l", "pdoperator.io/deployment=sim-small")["items"]}


def last_push_of(url: str, pod_ip: str) -> dict | None:
    mine = [p for p in pushes(url) if p.get("status") == 200 and p["body"]["local"][0]["server_ip"] == pod_ip]
    return mine[-1] if mine else None


def device_ips(pod: dict) -> list[str]:
    doc = json.loads(pod["metadata"]["annotations"]["ascend.kubectl.kubernetes.io/ascend-910-configuration"])
    return [d["device_ip"] for d in sorted(doc["devices"], key=lambda d: int(d["device_id"]))]


def peer_ips(push: dict) -> set[str]:
    return {inst[0]["server_ip"] for inst in push["body"]["peers"]}


def pushed_as(url: str, cluster: Cluster, ns: str, want: dict[str, str]) -> bool:
    """Every pod's last push names its role (want: pod -> prefill | decode), its own devices, and
    the other role's pods as peers."""
    ps = pods(cluster, ns)
    ip = {name: p["status"].get("podIP") for name, p in ps.items()}
    for name, role in want.items():
        push = last_push_of(url, ip[name])
        if push is None or push["role"] != role:
            return False
        devices = [d["device_ip"] for d in push["body"]["local"][0]["dp_inst_list"][0]["device"]]
        if devices != device_ips(ps[name]):
            return False
        if peer_ips(push) != {ip[n] for n, r in want.items() if r != role}:
            return False
    return True


def test_the_mindie_server_gets_its_role_and_peers_through_a_live_switch(
        cluster: Cluster, namespace: str, operator, standin: str) -> None:
    ns = namespace
    doc = sample(**TRAFFIC_SPEC, rebalance=REBALANCE, mindie={"enabled": True, "roleUrl": standin})
    for g in ("prefill", "decoder"):
        doc["spec"][g]["resources"] = {"limits": {NPU: 1}}
    cluster.apply(doc, ns)
    wait_phase(cluster, ns, "Ready", timeout=120, extra=lambda o: o["status"]["linksSummary"] == "4/4")
    table = json.loads(cluster.get_json("configmap", "sim-small-rank-table", "-n", ns)["data"]["ranktable.json"])
    groups = {g["group_name"]: len(g["server_list"]) for g in table["server_group_list"]}
    assert table["status"] == "completed" and groups == {"prefill": 2, "decode": 2}, table
    start = {f"sim-small-prefill-{i}": "prefill" for i in (0, 1)} | {f"sim-small-decoder-{i}": "decode" for i in (0, 1)}
    wait_for("each pod's role and peers pushed", lambda: pushed_as(standin, cluster, ns, start), timeout=90)

    load = Load(cluster, ns, duration=300, rate=4)
    time.sleep(3)
    with load.change("decoder -> prefill"):
        before = len(pushes(standin))
        set_prefill(cluster, ns, 3)
        moved = switched(cluster, ns, "prefill", None, "3/3", timeout=150)["status"]["lastSwitch"]["pod"]
    assert moved.startswith("sim-small-decoder-")
    after = {**start, moved: "prefill"}
    wait_for("the switched pod and its peers pushed again", lambda: pushed_as(standin, cluster, ns, after),
             timeout=90)
    time.sleep(2)
    s = load.stop()
    assert s["failed"] == 0, s["failed_by_reason"]
    load.assert_traffic_through_changes()

    ip = pods(cluster, ns)[moved]["status"]["podIP"]
    mine = [p for p in pushes(standin)[before:] if p.get("status") == 200
            and p["body"]["local"][0]["server_ip"] == ip]
    assert mine and mine[0]["role"] == "prefill", mine[:2]
    assert not [p for p in pushes(standin) if p.get("status") != 200], "a push the MindIE API refuses"
    table = json.loads(cluster.get_json("configmap", "sim-small-rank-table", "-n", ns)["data"]["ranktable.json"])
    groups = {g["group_name"]: len(g["server_list"]) for g in table["server_group_list"]}
    assert groups == {"prefill": 3, "decode": 1}, table
