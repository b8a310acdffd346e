"""Shared fixtures: a session-scoped local cluster (reused if `.localcluster` is up) and a
fresh namespace per test."""
from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest

from tests import procs

REPO = Path(__file__).resolve().parents[1]
# every process the suite starts, directly or through the local cluster, inherits this
SESSION = os.environ[procs.SESSION_ENV] = uuid.uuid4().hex


@pytest.fixture(scope="session", autouse=True)
def nothing_left_running():
    """Set up first, torn down last: after the local clusters are down, no process this
    session started may still run."""
    yield
    # a cluster's shutdown may still be reaping what it killed: give it a few seconds
    deadline = time.monotonic() + 10
    while (left := procs.session_processes(SESSION)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if left:
        procs.kill_all([pid for pid, _ in left])
        pytest.fail("processes started by the suite were still running after it (now killed): "
                    + "; ".join(f"{pid} {cmd}" for pid, cmd in left))


@pytest.fixture(autouse=True)
def processes_end_with_the_test():
    yield
    killed = procs.end_owned()
    assert not killed, f"these ignored SIGTERM for 20 s and were killed: {killed}"


@dataclass
class Cluster:
    kubeconfig: Path
    bin_dir: Path

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(self.bin_dir / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args],
            input=input, capture_output=True, text=True, check=check, timeout=timeout)

    def get_json(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def apply(self, manifest: dict | str, namespace: str | None = None) -> None:
        text = manifest if isinstance(manifest, str) else json.dumps(manifest)
        ns = ["-n", namespace] if namespace else []
        self.kubectl("apply", *ns, "-f", "-", input=text)

    def api(self):
        from kubernetes import config
        return config.new_client_from_config(config_file=str(self.kubeconfig))


# Deadlines are for a machine running at a fraction of its speed (a busy CI runner): each is
# stretched by this factor. A test waits on what it observes and never asserts on elapsed time.
DEADLINE_SCALE = float(os.environ.get("PD_TEST_DEADLINE_SCALE", "3"))


def wait_for(what: str, fn: Callable[[], Any], timeout: float = 60, interval: float = 0.3) -> Any:
    """Poll `fn` until it returns something truthy; fail with `what` and the last value."""
    timeout *= DEADLINE_SCALE
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = fn()
            if last:
                return last
        except Exception as e:  # noqa: BLE001 - keep polling, report at the end
            last = e
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


@pytest.fixture(scope="session")
def cluster() -> Cluster:
    from pd_localcluster.__main__ import bin_dir_default
    from pd_localcluster.cluster import LocalCluster

    bin_dir = bin_dir_default()
    lc = LocalCluster(REPO / ".localcluster")
    started = False
    if not lc.is_up():
        lc.up(bin_dir)
        started = True
    c = Cluster(kubeconfig=lc.paths.kubeconfig, bin_dir=bin_dir)
    others = operators_watching_everything(c)
    if others:
        pytest.fail(f"an operator installed in this cluster watches every namespace ({', '.join(others)}): it would "
                    f"act on the tests' deployments beside each test's own operator. Scope it (chart value "
                    f"watchNamespaces, as `make demo` does) or uninstall it (helm uninstall -n <namespace> <release>)")
    yield c
    if started:
        lc.down()


def operators_watching_everything(c: Cluster) -> list[str]:
    """Installed pd-operators (the chart's Deployments) whose PD_OPERATOR_NAMESPACES is empty."""
    out = []
    for d in c.get_json("deployments", "-A", "-l", "app.kubernetes.io/name=pd-operator").get("items", []):
        for ctr in d["spec"]["template"]["spec"].get("containers", []):
            env = {e["name"]: e.get("value") for e in ctr.get("env") or []}
            if "PD_OPERATOR_NAMESPACES" in env and not env["PD_OPERATOR_NAMESPACES"] and d["spec"].get("replicas", 1):
                out.append(f"{d['metadata']['namespace']}/{d['metadata']['name']}")
    return out


@pytest.fixture
def namespace(cluster: Cluster) -> str:
    name = f"t-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    wait_for(f"default ServiceAccount in {name}",
             lambda: cluster.kubectl("get", "sa", "default", "-n", name, check=False).returncode == 0)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
