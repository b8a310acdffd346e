"""Trust boundaries the operator keeps itself, with no admission policy installed (the chart
test covers the policy): host paths and gateway images outside its configuration are refused
with a condition, a token Secret it did not make is never used (planted before the deployment or
right after it, owned by it), and an API-keys Secret
reaches the gateway only once it opted in."""
from __future__ import annotations

import base64
import hashlib

import httpx
import pytest

from tests.conftest import Cluster, wait_for
from tests.integration.conftest import condition, events, keys_secret, pdd, sample, wait_phase

pytestmark = pytest.mark.integration
SMALL = {"prefill.replicas": 1, "decoder.replicas": 1}


def refused(cluster: Cluster, ns: str, name: str, reason: str) -> dict:
    def ready_false():
        o = pdd(cluster, ns, name)
        c = condition(o, "Ready")
        return o if c.get("status") == "False" and c.get("reason") == reason else None
    return wait_for(f"{name} refused with {reason}", ready_false, timeout=120)


def test_what_the_configuration_does_not_allow_is_refused_with_a_condition(cluster: Cluster, namespace: str,
                                                                          operator) -> None:
    ns = namespace
    hostile = sample(name="hostpath", **SMALL)
    hostile["spec"]["ascend"] = {"hccnConf": "/etc/hccn.conf", "extraHostPaths": ["/root/.ssh"]}
    cluster.apply(hostile, ns)
    image = sample(name="gwimage", **SMALL, gateway={"enabled": True, "apiKeysSecret": "k",
                                                     "image": "example.com/evil/reads-secrets:1"})
    cluster.apply(image, ns)
    # a token Secret someone made before the deployment: its token is known to them
    cluster.kubectl("create", "secret", "generic", "planted-agent-token", "-n", ns, "--from-literal=token=chosen")
    cluster.apply(sample(name="planted", **SMALL), ns)

    o = refused(cluster, ns, "hostpath", "NotAllowed")
    msg = condition(o, "Ready")["message"]
    assert "spec.ascend.extraHostPaths[0]: host path /root/.ssh is not allowed" in msg and "/etc/hccn.conf" in msg
    assert o["status"]["phase"] == "Degraded"
    o = refused(cluster, ns, "gwimage", "NotAllowed")
    assert "spec.gateway.image: example.com/evil/reads-secrets:1 is not an allowed gateway image" in \
        condition(o, "Ready")["message"]
    o = refused(cluster, ns, "planted", "TokenSecretNotOwned")
    assert "planted-agent-token" in condition(o, "Ready")["message"]
    # nothing of theirs was applied, and the planted token is untouched (not adopted, not replaced)
    sts = {s["metadata"]["name"] for s in cluster.get_json("statefulsets", "-n", ns)["items"]}
    assert not sts & {"hostpath-prefill", "gwimage-prefill", "planted-prefill"}
    planted = cluster.get_json("secret", "planted-agent-token", "-n", ns)
    assert base64.b64decode(planted["data"]["token"]).decode() == "chosen"
    assert not planted["metadata"].get("ownerReferences")

    # fixing the spec is all it takes
    hostile["spec"]["ascend"]["extraHostPaths"] = ["/usr/local/dcmi"]
    cluster.apply(hostile, ns)
    wait_for("the fixed spec applied", lambda: cluster.kubectl(
        "get", "statefulset", "hostpath-prefill", "-n", ns, check=False).returncode == 0, timeout=120)
    assert operator.proc.poll() is None


def test_token_secrets_planted_with_the_deployments_owner_reference_are_never_used(cluster: Cluster, namespace: str,
                                                                                   operator) -> None:
    """Someone who may only create Secrets makes the three token Secrets, owned by the deployment
    (its uid is readable), the moment it appears: the operator refuses them and names them."""
    ns = namespace
    operator.stop()   # so the planted Secrets surely come first, as a fast attacker's did
    cluster.apply(sample(name="race", **SMALL), ns)
    uid = pdd(cluster, ns, "race")["metadata"]["uid"]
    owner = [{"apiVersion": "pdoperator.io/v1alpha1", "kind": "PDDeployment", "name": "race", "uid": uid,
              "controller": True, "blockOwnerDeletion": True}]
    for sname in ("race-agent-token", "race-agent-data-token", "race-agent-peer-token"):
        cluster.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": sname, "ownerReferences": owner},
                       "stringData": {"token": "chosen-by-them"}}, ns)
    operator.start()
    o = refused(cluster, ns, "race", "TokenSecretNotOwned")
    msg = condition(o, "Ready")["message"]
    assert "race-agent-token" in msg and "race-agent-data-token" in msg and "race-agent-peer-token" in msg, msg
    sts = {s["metadata"]["name"] for s in cluster.get_json("statefulsets", "-n", ns)["items"]}
    assert not sts & {"race-prefill", "race-decoder"}, "no engine was started with their tokens"
    assert not o["status"].get("tokenDigests"), "nothing of theirs is recorded as the operator's"

    # deleting them is all it takes: the operator makes its own, records them, and uses them
    for sname in ("race-agent-token", "race-agent-data-token", "race-agent-peer-token"):
        cluster.kubectl("delete", "secret", sname, "-n", ns)
    o = wait_phase(cluster, ns, "Ready", name="race", timeout=120)
    token = base64.b64decode(cluster.get_json("secret", "race-agent-token", "-n", ns)["data"]["token"]).decode()
    assert token != "chosen-by-them" and o["status"]["tokenDigests"]["control"] == \
        hashlib.sha256(token.encode()).hexdigest()


def test_a_keys_secret_reaches_the_gateway_only_once_it_opted_in(cluster: Cluster, namespace: str,
                                                                 operator) -> None:
    ns = namespace
    key = "sk-trust-test-key-00000001"
    keys_secret(cluster, ns, opt_in=False, **{"team-a": key})
    cluster.apply(sample(**SMALL, gateway={"enabled": True, "apiKeysSecret": "sim-small-keys"}), ns)

    def keys_condition(status: str):
        c = condition(pdd(cluster, ns), "GatewayKeys")
        return c if c.get("status") == status else None
    c = wait_for("the keys Secret refused", lambda: keys_condition("False"), timeout=120)
    assert c["reason"] == "KeysSecretNotOptedIn" and "pdoperator.io/keys" in c["message"]
    wait_for("the engines linked", lambda: pdd(cluster, ns)["status"].get("linksSummary") == "1/1", timeout=180)
    role = cluster.get_json("role", "sim-small-gateway", "-n", ns)
    assert not any("secrets" in r["resources"] for r in role["rules"])
    assert cluster.get_json("deployment", "sim-small-gateway", "-n", ns)["spec"]["replicas"] == 0
    sa = f"system:serviceaccount:{ns}:sim-small-gateway"
    assert cluster.kubectl("auth", "can-i", "get", "secret/sim-small-keys", "-n", ns, f"--as={sa}",
                           check=False).stdout.strip() == "no"

    cluster.kubectl("label", "secret", "sim-small-keys", "-n", ns, "pdoperator.io/keys=true")
    wait_for("the keys Secret opted in", lambda: keys_condition("True"), timeout=120)
    wait_phase(cluster, ns, "Ready", timeout=180)

    def gateway_url():
        pods = cluster.get_json("pods", "-n", ns, "-l", "pdoperator.io/gateway=sim-small")["items"]
        ready = [p for p in pods if any(c["type"] == "Ready" and c["status"] == "True"
                                        for c in p["status"].get("conditions", []))]
        return ready and f"http://{ready[0]['status']['podIP']}:8000"
    url = wait_for("the gateway Ready", gateway_url, timeout=180)
    r = wait_for("a completion through the gateway", lambda: (resp := httpx.post(
        f"{url}/v1/completions", json={"model": "tiny-llama", "prompt": "hello", "max_tokens": 4},
        headers={"Authorization": f"Bearer {key}"}, trust_env=False, timeout=30)).status_code == 200 and resp,
        timeout=120)
    assert r.json()["choices"][0]["text"]
    assert any(e["reason"] == "GatewayKeys" for e in events(cluster, ns))
    assert not any(e["reason"] == "DriftRepaired" for e in events(cluster, ns))
