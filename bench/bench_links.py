"""`make bench-links`: time from "all pods Ready" to "PDDeployment Ready" (every decoder
linked to every prefill and the KV path verified), on the local cluster with the operator
as a real process. Goal: 8P+8D within 2 s."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402
from kubernetes import client, config  # noqa: E402

from pd_localcluster.__main__ import bin_dir_default  # noqa: E402
from pd_localcluster.cluster import LocalCluster  # noqa: E402

SIZES = [(2, 2), (8, 8), (16, 16)]


def pod_ready(p) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in (p.status.conditions or []))


def main() -> None:
    lc = LocalCluster(REPO / ".localcluster")
    started = False
    if not lc.is_up():
        lc.up(bin_dir_default())
        started = True
    kubectl = [str(bin_dir_default() / "kubectl"), f"--kubeconfig={lc.paths.kubeconfig}"]
    subprocess.run(kubectl + ["apply", "-f", str(REPO / "crds" / "pddeployment.yaml")], check=True,
                   capture_output=True)
    subprocess.run(kubectl + ["wait", "--for=condition=Established", "crd/pddeployments.pdoperator.io"],
                   check=True, capture_output=True)
    api = config.new_client_from_config(config_file=str(lc.paths.kubeconfig))
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    rows = []
    for p, d in SIZES:
        ns = f"bench-{p}p{d}d-{uuid.uuid4().hex[:6]}"
        core.create_namespace({"metadata": {"name": ns}})
        env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
        env.update(KUBECONFIG=str(lc.paths.kubeconfig), PD_OPERATOR_NAMESPACES=ns)
        op = subprocess.Popen([sys.executable, "-m", "pd_operator"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
        try:
            while True:  # the ServiceAccount admission needs the default SA
                if core.list_namespaced_service_account(ns).items:
                    break
                time.sleep(0.1)
            doc = yaml.safe_load((REPO / "examples" / "sim-small.yaml").read_text())
            doc["spec"]["prefill"]["replicas"] = p
            doc["spec"]["decoder"]["replicas"] = d
            t0 = time.monotonic()
            custom.create_namespaced_custom_object("pdoperator.io", "v1alpha1", ns, "pddeployments", doc)
            pods_ready = ready = None
            deadline = t0 + 300
            while time.monotonic() < deadline:
                now = time.monotonic()
                if pods_ready is None:
                    pods = core.list_namespaced_pod(ns).items
                    if len(pods) == p + d and all(pod_ready(x) for x in pods):
                        pods_ready = now
                obj = custom.get_namespaced_custom_object("pdoperator.io", "v1alpha1", ns, "pddeployments",
                                                          "sim-small")
                st = obj.get("status") or {}
                if st.get("phase") == "Ready" and st.get("linksSummary") == f"{p * d}/{p * d}":
                    ready = now
                    pods_ready = pods_ready or now
                    break
                time.sleep(0.05)
            if ready is None:
                rows.append((p, d, None, None))
                print(f"{p}P+{d}D: did not become Ready within 300 s", flush=True)
                continue
            rows.append((p, d, pods_ready - t0, ready - pods_ready))
            print(f"{p}P+{d}D: pods Ready {pods_ready - t0:6.2f} s after apply; links {p * d}/{p * d} up "
                  f"and KV path verified {ready - pods_ready:5.2f} s after that", flush=True)
        finally:
            op.terminate()
            op.wait(20)
            core.delete_namespace(ns)
    goal = next((r for r in rows if r[:2] == (8, 8)), None)
    if goal and goal[3] is not None:
        print(f"goal 8P+8D <= 2 s: {'met' if goal[3] <= 2 else 'missed'} ({goal[3]:.2f} s)")
    if started:
        lc.down()


if __name__ == "__main__":
    main()
