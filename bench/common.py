"""What the cluster benchmarks share: the local cluster (started if it is not up), a fresh
namespace with the operator as a real process, and the operator's metrics."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kubernetes import client, config  # noqa: E402

from pd_localcluster.__main__ import bin_dir_default  # noqa: E402
from pd_localcluster.cluster import LocalCluster, free_port  # noqa: E402


def metrics(url: str) -> dict[str, float]:
    """Samples summed over labels (name -> value)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url, trust_env=False, timeout=5).text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pod_ready(p) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in (p.status.conditions or []))


class Bench:
    """The local cluster with the CRD installed; `operator(ns)` starts one operator process."""

    def __init__(self) -> None:
        self.lc = LocalCluster(REPO / ".localcluster")
        self.started = False
        if not self.lc.is_up():
            self.lc.up(bin_dir_default())
            self.started = True
        self.kubeconfig = str(self.lc.paths.kubeconfig)
        self.kubectl = [str(bin_dir_default() / "kubectl"), f"--kubeconfig={self.kubeconfig}"]
        subprocess.run(self.kubectl + ["apply", "-f", str(REPO / "crds")], check=True,
                       capture_output=True)
        subprocess.run(self.kubectl + ["wait", "--for=condition=Established", "crd/pddeployments.pdoperator.io"],
                       check=True, capture_output=True)
        api = config.new_client_from_config(config_file=self.kubeconfig)
        self.core, self.custom = client.CoreV1Api(api), client.CustomObjectsApi(api)

    def namespace(self, ns: str) -> None:
        self.core.create_namespace({"metadata": {"name": ns}})
        while not self.core.list_namespaced_service_account(ns).items:  # admission needs the default SA
            time.sleep(0.1)

    def operator(self, ns: str, log_name: str) -> tuple[subprocess.Popen, str]:
        env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
        port = free_port()
        env.update(KUBECONFIG=self.kubeconfig, PD_OPERATOR_NAMESPACES=ns, PD_OPERATOR_METRICS_ADDR=f"127.0.0.1:{port}")
        log_path = Path(os.environ.get("TMPDIR", "/tmp")) / log_name
        op = subprocess.Popen([sys.executable, "-m", "pd_operator"], env=env, stdout=open(log_path, "wb"),
                              stderr=subprocess.STDOUT)
        return op, f"http://127.0.0.1:{port}/metrics"

    def pdd(self, ns: str, name: str = "sim-small") -> dict:
        return self.custom.get_namespaced_custom_object("pdoperator.io", "v1alpha1", ns, "pddeployments", name)

    def close(self) -> None:
        if self.started:
            self.lc.down()
