"""Two agents as pods on the local cluster, driven directly (no operator): link, verify,
simulated requests through the real KV path, and /metrics showing them."""
from __future__ import annotations

import httpx
import pytest

from tests.conftest import Cluster, wait_for

pytestmark = pytest.mark.integration
TOKEN = "pods-test-token"


def agent_pod(name: str, role: str, cluster_id: int) -> dict:
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": "agents"}},
        "spec": {"containers": [{
            "name": "agent", "image": "example.com/pd/pd-sim-agent:0.1",
            "env": [
                {"name": "LLM_DATADIST_ROLE", "value": role},
                {"name": "LLM_DATADIST_CLUSTER_ID", "value": str(cluster_id)},
                {"name": "LLM_DATADIST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "LLM_DATADIST_PORT", "value": "26000"},
                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "PD_AGENT_TOKEN", "valueFrom": {"secretKeyRef": {"name": "agent-token", "key": "token"}}},
                {"name": "PD_SIM_TIME_SCALE", "value": "0.1"},
            ],
            "ports": [{"name": "http", "containerPort": 8080}],
            "readinessProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 1},
        }]},
    }


def test_two_agent_pods_link_verify_and_serve(cluster: Cluster, namespace: str) -> None:
    cluster.kubectl("create", "secret", "generic", "agent-token", "-n", namespace, f"--from-literal=token={TOKEN}")
    cluster.apply(agent_pod("prompt-a", "prompt", 0), namespace)
    cluster.apply(agent_pod("decoder-a", "decoder", 1000), namespace)

    def ips():
        pods = cluster.get_json("pods", "-n", namespace, "-l", "app=agents")["items"]
        ready = {p["metadata"]["name"]: p["status"]["podIP"] for p in pods if any(
            c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))}
        return ready if len(ready) == 2 else None
    ip = wait_for("both agent pods Ready", ips, timeout=60)
    h = {"Authorization": f"Bearer {TOKEN}"}
    c = httpx.Client(trust_env=False, headers=h, timeout=30)
    P, D = f"http://{ip['prompt-a']}:8080", f"http://{ip['decoder-a']}:8080"
    peer = {"name": "prompt-a", "cluster_id": 0, "ip": ip["prompt-a"], "port": 26000, "agent_url": P}

    assert c.post(f"{D}/v1/link", json={"peers": [peer]}).json()["rets"] == {"prompt-a": "LLM_SUCCESS"}
    v = c.post(f"{D}/v1/verify", json={"peer": peer}).json()
    assert v["ok"] and v["bytes"] > 0
    for req_id in range(5):
        assert c.post(f"{P}/v1/prefill", json={"req_id": req_id, "prompt_tokens": 200}).status_code == 200
        r = c.post(f"{D}/v1/decode", json={"req_id": req_id, "prompt_cluster_id": 0, "prompt_tokens": 200,
                                           "output_tokens": 4})
        assert r.status_code == 200 and r.json()["tokens"] == 4
    dm = c.get(f"{D}/metrics").text
    pm = c.get(f"{P}/metrics").text
    assert 'pd_agent_requests_total{phase="decode"} 5.0' in dm
    assert "pd_agent_kv_pull_ms_count 5.0" in dm
    assert 'pd_agent_requests_total{phase="prefill"} 5.0' in pm
    st = c.get(f"{D}/v1/status").json()
    assert st["pod"] == "decoder-a" and st["load"]["completed"] == 5 and st["links"][0]["code"] == "LLM_SUCCESS"
    assert httpx.get(f"{D}/v1/status", trust_env=False).status_code == 401
