"""The Helm chart: lint, install, and the operator running as a pod with only the chart's RBAC."""
from __future__ import annotations

import subprocess

import pytest

from tests.conftest import REPO, Cluster, wait_for
from tests.integration.conftest import sample, wait_phase

pytestmark = pytest.mark.integration
CHART = str(REPO / "charts" / "pd-operator")


def helm(cluster: Cluster, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(cluster.bin_dir / "helm"), f"--kubeconfig={cluster.kubeconfig}", *args],
                          capture_output=True, text=True, timeout=180)


def test_chart_lints_and_rejects_bad_values(cluster: Cluster) -> None:
    r = helm(cluster, "lint", CHART, "--strict")
    assert r.returncode == 0, r.stdout + r.stderr
    r = helm(cluster, "template", "x", CHART, "--set", "logLevel=LOUD")
    assert r.returncode != 0 and "logLevel" in r.stderr


def test_operator_installed_by_the_chart_runs_with_its_rbac(cluster: Cluster, crd, namespace: str) -> None:
    release = f"op-{namespace}"
    r = helm(cluster, "install", release, CHART, "-n", namespace, "--set", f"watchNamespaces={{{namespace}}}",
             "--wait", "--timeout", "120s")
    assert r.returncode == 0, r.stdout + r.stderr
    try:
        sa = f"system:serviceaccount:{namespace}:{release}-pd-operator"
        can = lambda *a: cluster.kubectl("auth", "can-i", *a, f"--as={sa}", check=False).stdout.strip()  # noqa: E731
        assert can("patch", "statefulsets", "-n", namespace) == "yes"
        assert can("patch", "pddeployments.pdoperator.io/status", "-n", namespace) == "yes"
        assert can("delete", "statefulsets", "-n", namespace) == "no"
        assert can("delete", "pods", "-n", namespace) == "no"
        assert can("list", "secrets", "-n", namespace) == "no"

        # the gateway's objects too: its Role grants only what the chart's ServiceAccount holds
        assert can("create", "roles.rbac.authorization.k8s.io", "-n", namespace) == "yes"
        assert can("create", "networkpolicies.networking.k8s.io", "-n", namespace) == "yes"
        assert can("create", "deployments.apps", "-n", namespace) == "yes"
        cluster.kubectl("create", "secret", "generic", "sim-small-keys", "-n", namespace, "--from-literal=a=sk-1")
        cluster.apply(sample(gateway={"enabled": True, "apiKeysSecret": "sim-small-keys"}), namespace)
        wait_phase(cluster, namespace, "Ready", timeout=120, extra=lambda o: o["status"]["linksSummary"] == "4/4")
        wait_for("the gateway Ready", lambda: cluster.get_json("deployment", "sim-small-gateway", "-n", namespace)[
            "status"].get("readyReplicas") == 1, timeout=60)
        pod = wait_for("the operator pod", lambda: cluster.get_json(
            "pods", "-n", namespace, "-l", "app.kubernetes.io/name=pd-operator")["items"])[0]
        logs = cluster.kubectl("logs", pod["metadata"]["name"], "-n", namespace).stdout
        assert "pd-operator started" in logs and "Linked" in logs
        assert "Forbidden" not in logs and "403" not in logs
        # the operator's metrics, where the chart's Service points
        import httpx
        svc = cluster.get_json("service", f"{release}-pd-operator-metrics", "-n", namespace)
        assert svc["spec"]["ports"][0]["port"] == 8080
        text = httpx.get(f"http://{pod['status']['podIP']}:8080/metrics", trust_env=False, timeout=5).text
        assert 'pd_operator_reconciles_total{result="ok"}' in text
        assert 'pd_operator_deployment_phase{name="sim-small"' in text
    finally:
        helm(cluster, "uninstall", release, "-n", namespace, "--wait", "--timeout", "60s")
