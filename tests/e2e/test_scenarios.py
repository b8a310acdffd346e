"""The user's path, end to end, with every pod from its image: install the chart, apply
examples/sim-small.yaml with a gateway, wait for Ready with links and the KV path verified,
serve load through the gateway while the ratio switches live, check with `kubectl pdd
verify`, uninstall, and find nothing left but the CRD."""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
import uuid

import pytest
import yaml

from tests.conftest import REPO, Cluster, wait_for
from tests.e2e.conftest import image, version

pytestmark = pytest.mark.e2e
CHART = str(REPO / "charts" / "pd-operator")
# what a namespace holds on its own, before anything is installed in it
BACKGROUND = {("ConfigMap", "kube-root-ca.crt"), ("ServiceAccount", "default")}


def helm(c: Cluster, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([str(c.bin_dir / "helm"), f"--kubeconfig={c.kubeconfig}", *args], capture_output=True,
                       text=True, timeout=300)
    assert not check or r.returncode == 0, r.stdout + r.stderr
    return r


def status(c: Cluster, ns: str) -> dict:
    return c.get_json("pdd", "sim-small", "-n", ns).get("status") or {}


def condition(st: dict, ctype: str) -> dict:
    return next((x for x in st.get("conditions") or [] if x["type"] == ctype), {})


def leftovers(c: Cluster, ns: str) -> list[tuple[str, str]]:
    kinds = "pods,statefulsets,deployments,replicasets,services,secrets,configmaps,serviceaccounts,roles," \
            "rolebindings,networkpolicies,pddeployments,leases,poddisruptionbudgets"
    items = c.get_json(kinds, "-n", ns)["items"]
    return sorted((i["kind"], i["metadata"]["name"]) for i in items
                  if (i["kind"], i["metadata"]["name"]) not in BACKGROUND)


def test_install_serve_switch_verify_uninstall(e2e_cluster: Cluster, tmp_path) -> None:
    c = e2e_cluster
    ns = f"e2e-{uuid.uuid4().hex[:6]}"
    op_ns = f"{ns}-system"
    release = "pd"
    for n in (ns, op_ns):
        c.kubectl("create", "namespace", n)
    wait_for("the default ServiceAccount", lambda: c.kubectl("get", "sa", "default", "-n", ns, check=False)
             .returncode == 0, timeout=30)
    t0 = time.monotonic()
    helm(c, "install", release, CHART, "-n", op_ns, "--set", f"watchNamespaces={{{ns}}}",
         "--set", f"image.repository={image('pd-operator').rsplit(':', 1)[0]}", "--set", f"image.tag={version()}",
         "--wait", "--timeout", "180s")
    print(f"\nchart installed, operator Ready in {time.monotonic() - t0:.1f} s")
    op = c.get_json("pods", "-n", op_ns, "-l", "app.kubernetes.io/name=pd-operator")["items"][0]
    sc = op["spec"]["containers"][0]["securityContext"]
    assert sc["readOnlyRootFilesystem"] and op["spec"]["securityContext"]["runAsNonRoot"]

    doc = yaml.safe_load((REPO / "examples" / "sim-small.yaml").read_text())
    doc["metadata"]["namespace"] = ns
    doc["spec"]["image"] = image("pd-sim-agent")
    doc["spec"]["gateway"] = {"enabled": True, "apiKeysSecret": "sim-small-keys"}
    doc["spec"]["rebalance"] = {"policy": "Manual", "manual": {"prefill": 2}, "cooldownSeconds": 0}
    c.kubectl("create", "secret", "generic", "sim-small-keys", "-n", ns, "--from-literal=e2e=sk-e2e-scenario-0001")
    c.kubectl("label", "secret", "sim-small-keys", "-n", ns, "pdoperator.io/keys=true")   # opts in
    c.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
    t0 = time.monotonic()
    wait_for("Ready, 4/4 links, KV path verified", lambda: (s := status(c, ns)).get("phase") == "Ready"
                  and s.get("linksSummary") == "4/4" and condition(s, "KVPathVerified").get("status") == "True"
                  and s, timeout=240)
    print(f"sim-small Ready with links and the KV path verified in {time.monotonic() - t0:.1f} s")
    gw = wait_for("the gateway pod Ready", lambda: [
        p for p in c.get_json("pods", "-n", ns, "-l", "pdoperator.io/gateway=sim-small")["items"]
        if any(x["type"] == "Ready" and x["status"] == "True" for x in p["status"].get("conditions") or [])],
        timeout=120)[0]
    for p in c.get_json("pods", "-n", ns)["items"]:
        assert p["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"], p["metadata"]["name"]

    # load through the gateway, from a pod of the agent's image, while the ratio switches live
    gw_url = f"http://{gw['status']['podIP']}:8000"
    c.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "load"}, "spec": {
        "restartPolicy": "Never", "containers": [{
            "name": "load", "image": image("pd-sim-agent"),
            "command": ["python", "-m", "pd_agent.loadgen"],
            "args": ["--gateway", gw_url, "--api-key", "sk-e2e-scenario-0001", "--rate", "4", "--duration", "45",
                     "--workload", "code", "--max-prompt", "512", "--max-output", "24", "--json"],
            "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                "capabilities": {"drop": ["ALL"]}}}],
        "securityContext": {"runAsNonRoot": True, "runAsUser": 10001}}}, ns)
    wait_for("the load pod running", lambda: c.get_json("pod", "load", "-n", ns)["status"].get("phase")
             in ("Running", "Succeeded"), timeout=60)
    time.sleep(5)
    for target, to in ((3, "prefill"), (2, "decoder")):
        before = (status(c, ns).get("lastSwitch") or {}).get("at", "")
        c.kubectl("patch", "pdd", "sim-small", "-n", ns, "--type=merge",
                  "-p", json.dumps({"spec": {"rebalance": {"manual": {"prefill": target}}}}))
        last = wait_for(f"a live switch to {target} prefills", lambda: (
            (s := status(c, ns)).get("lastSwitch") or {}).get("at", "") > before and s["lastSwitch"]["to"] == to
            and s.get("phase") == "Ready" and s.get("prefill") == target and s["lastSwitch"], timeout=120)
        print(f"switch {last['from']} -> {last['to']} ({last['pod']}): {last['result']}, total {last['totalMs']} ms")
        assert last["result"] == "Completed"
    wait_for("the load pod done", lambda: c.get_json("pod", "load", "-n", ns)["status"].get("phase")
             in ("Succeeded", "Failed"), timeout=180)
    out = c.kubectl("logs", "load", "-n", ns).stdout
    summary = json.loads(out[out.index("{"):])
    print(f"load through the gateway during the switches: {summary['requests']} requests, "
          f"{summary['completed']} completed, {summary['failed']} failed {summary['failed_by_reason'] or ''}")
    assert summary["completed"] > 50 and summary["failed"] == 0

    # kubectl pdd verify, as a user runs it
    key = base64.b64decode(c.get_json("secret", "sim-small-keys", "-n", ns)["data"]["e2e"]).decode()
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env["KUBECONFIG"] = str(c.kubeconfig)
    r = subprocess.run([sys.executable, "-m", "pd_operator.kubectl_pdd", "verify", "sim-small", "-n", ns,
                        "--api-key", key], capture_output=True, text=True, env=env, timeout=120)
    print(r.stdout[-1500:])
    assert r.returncode == 0, r.stdout + r.stderr

    # uninstall: nothing but the CRD is left
    c.kubectl("delete", "pdd", "sim-small", "-n", ns, "--wait=true", "--timeout=120s")
    c.kubectl("delete", "pod", "load", "-n", ns, "--wait=true", "--timeout=60s")
    c.kubectl("delete", "secret", "sim-small-keys", "-n", ns)
    helm(c, "uninstall", release, "-n", op_ns, "--wait", "--timeout", "120s")
    wait_for("nothing left in the namespaces", lambda: not leftovers(c, ns) and not leftovers(c, op_ns),
             timeout=120)
    cluster_wide = [i["metadata"]["name"] for i in c.get_json("clusterroles,clusterrolebindings")["items"]
                    if "pd-operator" in i["metadata"]["name"]]
    assert not cluster_wide, cluster_wide
    assert c.kubectl("get", "crd", "pddeployments.pdoperator.io", check=False).returncode == 0
