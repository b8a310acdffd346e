"""Operator fixtures: the CRD installed once per session, and the operator as a real
process (``python -m pd_operator``) watching the test's namespace."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, Cluster, wait_for
from tests.procs import spawn


@pytest.fixture
def agents():
    """Agents as real processes on their own loopback IPs, stopped at the end."""
    from tests.agent_procs import AgentProc

    started: list[AgentProc] = []

    def make(role: str, cluster_id: int, **kw) -> AgentProc:
        a = AgentProc(role, cluster_id, **kw)
        started.append(a)
        return a
    yield make
    for a in started:
        a.stop()


@pytest.fixture(scope="session")
def crd(cluster: Cluster) -> None:
    cluster.kubectl("apply", "-f", str(REPO / "crds"))
    # a just-started API server may not list a CRD it just took (`wait` then exits at once): ask again
    wait_for("the CRDs Established", lambda: cluster.kubectl(
        "wait", "--for=condition=Established", "crd/pddeployments.pdoperator.io", "crd/pdgateways.pdoperator.io",
        "--timeout=10s", check=False).returncode == 0, timeout=120, interval=1)


class OperatorProc:
    kubeconfig: Path | None = None   # a test may point the operator elsewhere (a proxy)

    def __init__(self, cluster: Cluster, namespace: str, log_dir: Path):
        self.cluster = cluster
        self.namespace = namespace
        self.log_dir = log_dir
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.stopped_by_test = False
        from pd_localcluster.cluster import free_port
        self.metrics_port = free_port()
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"

    def start(self, **extra_env: str) -> None:
        self.starts += 1
        self.stopped_by_test = False
        log = open(self.log_dir / f"operator-{self.starts}.log", "wb")
        env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
        env.update(KUBECONFIG=str(self.kubeconfig or self.cluster.kubeconfig), PD_OPERATOR_NAMESPACES=self.namespace,
                   PD_OPERATOR_METRICS_ADDR=f"127.0.0.1:{self.metrics_port}", **extra_env)
        self.proc = spawn([sys.executable, "-m", "pd_operator"], env=env, stdout=log,
                                     stderr=subprocess.STDOUT)

    def wait_exit(self, timeout: float = 60) -> int:
        """Wait for the operator to exit on its own (a fault point told it to)."""
        self.stopped_by_test = True
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """An abrupt stop (SIGKILL), as a node failure would."""
        self.stopped_by_test = True
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> int | None:
        self.stopped_by_test = True
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode if self.proc else None

    def metric(self, name: str, **labels: str) -> float:
        """The operator's own /metrics, as Prometheus would scrape it (0 when absent)."""
        import httpx
        from prometheus_client.parser import text_string_to_metric_families
        text = httpx.get(self.metrics_url, trust_env=False, timeout=5).text
        return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.log_dir.glob("operator-*.log")))


@pytest.fixture
def operator(cluster: Cluster, crd, namespace: str, tmp_path: Path, request):
    op = OperatorProc(cluster, namespace, tmp_path)
    op.start()
    yield op
    crashed = op.proc.poll() is not None and not op.stopped_by_test
    op.stop()
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        print("---- operator log (tail) ----\n" + op.logs()[-6000:])
    assert not crashed, f"the operator exited on its own with code {op.proc.returncode}"


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)


def sample(name: str = "sim-small", **overrides) -> dict:
    doc = yaml.safe_load((REPO / "examples" / "sim-small.yaml").read_text())
    doc["metadata"]["name"] = name
    for path, value in overrides.items():
        node = doc["spec"]
        keys = path.split(".")
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    return doc


def keys_secret(cluster: Cluster, ns: str, name: str = "sim-small-keys", opt_in: bool = True, **keys: str) -> None:
    """An API-keys Secret; opted in (the label a gateway's keys Secret must carry) unless told."""
    literals = [f"--from-literal={k}={v}" for k, v in keys.items()]
    cluster.kubectl("create", "secret", "generic", name, "-n", ns, *literals)
    if opt_in:
        cluster.kubectl("label", "secret", name, "-n", ns, "pdoperator.io/keys=true")


def pdd(cluster: Cluster, ns: str, name: str = "sim-small") -> dict:
    return cluster.get_json("pdd", name, "-n", ns)


def condition(obj: dict, ctype: str) -> dict:
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == ctype), {})


def wait_phase(cluster: Cluster, ns: str, phase: str, name: str = "sim-small", timeout: float = 90,
               extra=lambda o: True) -> dict:
    return wait_for(f"{name} phase {phase}", lambda: (
        o if (o := pdd(cluster, ns, name)).get("status", {}).get("phase") == phase and extra(o) else None),
        timeout=timeout)


def _agent(cluster: Cluster, ns: str, pod: str, name: str) -> tuple[str, dict]:
    import base64
    token = base64.b64decode(cluster.get_json("secret", f"{name}-agent-token", "-n", ns)["data"]["token"]).decode()
    ip = cluster.get_json("pod", pod, "-n", ns)["status"]["podIP"]
    return f"http://{ip}:8080", {"Authorization": f"Bearer {token}"}


def agent_status(cluster: Cluster, ns: str, pod: str, name: str = "sim-small") -> dict:
    import httpx
    url, headers = _agent(cluster, ns, pod, name)
    return httpx.get(f"{url}/v1/status", headers=headers, trust_env=False, timeout=5).json()


def agent_post(cluster: Cluster, ns: str, pod: str, path: str, body: dict, name: str = "sim-small") -> dict:
    import httpx
    url, headers = _agent(cluster, ns, pod, name)
    return httpx.post(f"{url}{path}", json=body, headers=headers, trust_env=False, timeout=10).json()


def events(cluster: Cluster, ns: str, name: str = "sim-small") -> list[dict]:
    return cluster.get_json("events", "-n", ns, "--field-selector",
                            f"involvedObject.kind=PDDeployment,involvedObject.name={name}")["items"]
