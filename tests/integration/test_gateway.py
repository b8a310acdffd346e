"""pd-gateway deployed by the operator (`spec.gateway.enabled`) in the local cluster: its
objects and least privilege, the real `openai` client against it, load through it during
live role switches in both directions, and the gateway's container killed under load."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import Cluster, wait_for
from tests.integration.conftest import agent_post, keys_secret, pdd, sample, wait_phase
from tests.integration.test_switching import REBALANCE, set_prefill, switched
from tests.integration.test_traffic import TRAFFIC_SPEC, Load

pytestmark = pytest.mark.integration
KEY = "sk-pd-test-0001-gateway"


def gateway_pod(cluster: Cluster, ns: str) -> dict:
    pods = cluster.get_json("pods", "-n", ns, "-l", "pdoperator.io/gateway=sim-small")["items"]
    return next(p for p in pods if not p["metadata"].get("deletionTimestamp"))


@pytest.fixture
def served(cluster: Cluster, namespace: str, operator):
    ns = namespace
    keys_secret(cluster, ns, **{"team-a": KEY})
    cluster.apply(sample(**TRAFFIC_SPEC, rebalance=REBALANCE, gateway={"enabled": True,
                                                                       "apiKeysSecret": "sim-small-keys"}), ns)
    wait_phase(cluster, ns, "Ready", timeout=120, extra=lambda o: o["status"]["linksSummary"] == "4/4")

    def ready():
        try:
            p = gateway_pod(cluster, ns)
        except StopIteration:
            return None
        ok = any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))
        return ok and f"http://{p['status']['podIP']}:8000"
    url = wait_for("the gateway Ready", ready, timeout=60)
    wait_for("the gateway sees the fleet", lambda: httpx.get(f"{url}/healthz", trust_env=False).json()[
        "decoders"] >= 2, timeout=30)
    return ns, url


def test_gateway_objects_and_openai_client(cluster: Cluster, served):
    import openai
    ns, url = served
    sa = f"system:serviceaccount:{ns}:sim-small-gateway"
    can = lambda *a: cluster.kubectl("auth", "can-i", *a, f"--as={sa}", "-n", ns, check=False).stdout.strip()  # noqa
    assert can("list", "pods") == "yes" and can("get", "secret/sim-small-keys") == "yes"
    assert can("get", "secret/sim-small-agent-token") == "no" and can("patch", "pods") == "no"
    np = cluster.get_json("networkpolicy", "sim-small-engines", "-n", ns)
    assert np["spec"]["podSelector"]["matchLabels"] == {"pdoperator.io/deployment": "sim-small"}
    svc = cluster.get_json("service", "sim-small-gateway", "-n", ns)
    assert svc["spec"]["ports"][0]["port"] == 8000
    c = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, http_client=httpx.Client(trust_env=False))
    model = c.models.list().data[0].id
    assert model == pdd(cluster, ns)["spec"]["model"]["name"]
    r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=5)
    assert r.usage.completion_tokens == 5 and r.choices[0].message.content
    chunks = [ch.choices[0].delta.content for ch in c.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=6, stream=True)
        if ch.choices and ch.choices[0].delta.content]
    assert len(chunks) == 6
    assert c.completions.create(model=model, prompt="Say this is a test", max_tokens=3).usage.completion_tokens == 3
    http = httpx.Client(trust_env=False)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", http_client=http).models.list()
    with pytest.raises(openai.NotFoundError, match="doubles /v1"):
        openai.OpenAI(base_url=f"{url}/v1/v1", api_key=KEY, http_client=http).chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.NotFoundError, match=model):
        c.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    curl = subprocess.run(["curl", "-s", "--noproxy", "*", f"{url}/v1/chat/completions", "-H",
                           f"Authorization: Bearer {KEY}", "-H", "Content-Type: application/json", "-d",
                           json.dumps({"model": model, "max_tokens": 2,
                                       "messages": [{"role": "user", "content": "x"}]})],
                          capture_output=True, text=True, timeout=30)
    assert json.loads(curl.stdout)["usage"]["completion_tokens"] == 2
    logs = cluster.kubectl("logs", gateway_pod(cluster, ns)["metadata"]["name"], "-n", ns).stdout
    assert "pd-gateway serving model" in logs and KEY not in logs


def test_load_through_the_gateway_during_switches_both_ways(cluster: Cluster, served):
    ns, url = served
    load = Load(cluster, ns, duration=300, gateway=url, api_key=KEY)
    time.sleep(3)
    with load.change("decoder -> prefill"):
        set_prefill(cluster, ns, 3)
        last = switched(cluster, ns, "prefill", None, "3/3")["status"]["lastSwitch"]
    time.sleep(2)
    with load.change("prefill -> decoder"):
        set_prefill(cluster, ns, 2)
        switched(cluster, ns, "decoder", last["at"], "4/4")
    time.sleep(2)
    s = load.stop()
    assert s["failed"] == 0, s["failed_by_reason"]
    assert s["completed"] == s["requests"], s
    load.assert_traffic_through_changes()
    # the metrics port (/metrics, /stats name every key): the API port answers 404 for them
    metrics_url = url.replace(":8000", ":9090")
    assert httpx.get(f"{url}/stats", trust_env=False).status_code == 404
    metrics = httpx.get(f"{metrics_url}/metrics", trust_env=False).text
    assert 'pd_gateway_requests_total{api="chat",key="team-a",status="200"}' in metrics
    stats = httpx.get(f"{metrics_url}/stats", trust_env=False).json()
    assert stats["requests"] > 0 and stats["ttft_ms"]["p90"] is not None


def test_gateway_container_killed_under_load(cluster: Cluster, served):
    """Requests in flight on the killed gateway fail to their clients; the next ones succeed
    once the container is back (same pod, same address)."""
    ns, url = served
    load = Load(cluster, ns, duration=300, gateway=url, api_key=KEY)
    time.sleep(4)
    pod = gateway_pod(cluster, ns)
    cid = pod["status"]["containerStatuses"][0]["containerID"]
    os.kill(int(cid.rsplit("/", 1)[1]), signal.SIGKILL)
    wait_for("the gateway restarted", lambda: gateway_pod(cluster, ns)["status"]["containerStatuses"][0][
        "restartCount"] >= 1, timeout=30)
    wait_for("the gateway back", lambda: httpx.get(f"{url}/healthz", trust_env=False).status_code == 200, timeout=30)
    time.sleep(4)
    s = load.stop()
    print(f"\ngateway killed under load: {json.dumps(s)}")
    assert s["completed"] > 20
    assert s["failed"] > 0 or s["requests"] == s["completed"]
    assert set(s["failed_by_reason"]) <= {"RemoteProtocolError", "ConnectError", "ReadError", "ShortStream"}, s


def kubectl_pdd(cluster: Cluster, *args: str) -> subprocess.CompletedProcess:
    """As a user runs it: kubectl finds the `kubectl-pdd` plugin on PATH."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "KUBECONFIG": str(cluster.kubeconfig)}
    return subprocess.run([str(cluster.bin_dir / "kubectl"), "pdd", *args],
                          capture_output=True, text=True, env=env, timeout=120)


def test_kubectl_pdd_verify_and_status(cluster: Cluster, served):
    ns, _ = served
    r = kubectl_pdd(cluster, "verify", "sim-small", "-n", ns)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("ok  sim-small-decoder-") >= 4 + 2, "4 links and 2 probes"
    assert "bytes match" in r.stdout and "model tiny-llama, 8 tokens" in r.stdout and "all checks passed" in r.stdout
    # this cluster's pod IPs are loopback addresses, which the API server will not proxy to
    assert "calling the pods directly" in r.stdout
    r = kubectl_pdd(cluster, "status", "sim-small", "-n", ns)
    assert r.returncode == 0 and "sim-small-prefill-0" in r.stdout and "Rebalancing" in r.stdout, r.stdout
    # a broken KV path and a wrong key, explained in the conditions' words
    agent_post(cluster, ns, "sim-small-prefill-0", "/v1/admin/faults", {"pull_fail": True})
    r = kubectl_pdd(cluster, "verify", "sim-small", "-n", ns, "--api-key", "sk-wrong")
    print(r.stdout)
    assert r.returncode == 1
    assert "FAIL" in r.stdout and "<- sim-small-prefill-0" in r.stdout
    assert "HTTP 401" in r.stdout and "key is missing or wrong" in r.stdout


def test_slo_policy_reads_the_gateway(cluster: Cluster, served):
    """Where a gateway is deployed, the SLO policy decides on the client-side percentiles it serves."""
    ns, url = served
    load = Load(cluster, ns, duration=300, gateway=url, api_key=KEY)
    cluster.kubectl("patch", "pdd", "sim-small", "-n", ns, "--type=merge", "-p", json.dumps({"spec": {"rebalance": {
        "policy": "SLO", "manual": None, "targets": {"ttftP90Ms": 60000, "tbtP90Ms": 60000},
        "evaluationIntervalSeconds": 2}}}))
    d = wait_for("an SLO decision on the gateway's numbers", lambda: (x := pdd(cluster, ns)["status"].get(
        "lastDecision") or {}).get("numbers", {}).get("source") == "gateway" and x, timeout=60)
    load.stop()
    print(f"\nSLO decision: {d}")
    assert d["policy"] == "SLO" and d["reason"] == "WithinTargets"
    assert float(d["numbers"]["ttftP90Ms"]) > 0
