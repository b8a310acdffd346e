"""The Helm chart: lint, install, and the operator running as a pod with only the chart's RBAC."""
from __future__ import annotations

import json
import subprocess

import pytest
import yaml

from tests.conftest import REPO, Cluster, wait_for
from tests.integration.conftest import keys_secret, sample, wait_phase

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
        # an instance of several pods restarts whole, or gives its NPUs back, by its pods' deletion
        assert can("delete", "pods", "-n", namespace) == "yes"
        assert can("list", "secrets", "-n", namespace) == "no"
        # watchNamespaces: Roles there, nothing elsewhere (can-i for what it must not do)
        assert can("get", "secrets", "-n", namespace) == "yes"
        for other in ("default", "kube-system"):
            assert can("get", "secrets", "-n", other) == "no"
            assert can("patch", "pods", "-n", other) == "no"
            assert can("create", "statefulsets.apps", "-n", other) == "no"
            assert can("create", "roles.rbac.authorization.k8s.io", "-n", other) == "no"
        assert can("create", "clusterroles.rbac.authorization.k8s.io") == "no"
        assert can("list", "pods", "--all-namespaces") == "no"
        assert can("list", "customresourcedefinitions.apiextensions.k8s.io") == "yes"   # Kopf's discovery

        # the admission policy: host paths and gateway images only from the chart's values
        bad = sample(name="hostile")
        bad["spec"]["ascend"] = {"extraHostPaths": ["/usr/local/dcmi", "/var/run/docker.sock"]}
        r = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(bad), check=False)
        assert r.returncode != 0 and "spec.ascend.extraHostPaths: host paths /var/run/docker.sock are not " \
            "allowed (allowed: /etc/hccn.conf,/usr/local/Ascend/driver,/usr/local/dcmi" in r.stderr, r.stderr
        bad = sample(name="hostile", gateway={"enabled": True, "apiKeysSecret": "sim-small-keys",
                                              "image": "example.com/evil/reads-secrets:1"})
        r = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(bad), check=False)
        assert r.returncode != 0 and "spec.gateway.image: example.com/evil/reads-secrets:1 is not an allowed " \
            "gateway image (allowed: example.com/pd/pd-gateway:0.1.0" in r.stderr, r.stderr
        # scheduling: no system priority class, no other scheduler, no affinity across namespaces
        for field, value, said in [
                ("priorityClassName", "system-node-critical",
                 "spec.decoder.priorityClassName: system-node-critical is not allowed (allowed: any but system-*"),
                ("schedulerName", "my-scheduler", "spec.decoder.schedulerName: my-scheduler is not allowed"),
                ("affinity", {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                    {"topologyKey": "kubernetes.io/hostname", "labelSelector": {}, "namespaceSelector": {}}]}},
                 "spec.decoder.affinity: pod affinity and anti-affinity terms may not select pods of other "
                 "namespaces")]:
            bad = sample(name="hostile")
            bad["spec"]["decoder"][field] = value
            r = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(bad), check=False)
            assert r.returncode != 0 and said in r.stderr, (field, r.stderr)
        own = sample(name="own-affinity")
        own["spec"]["decoder"]["affinity"] = {"podAffinity": None, "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"topologyKey": "kubernetes.io/hostname", "labelSelector": {}, "namespaces": [namespace],
                 "namespaceSelector": None}],
            "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1, "podAffinityTerm": None}]}}
        r = cluster.kubectl("apply", "-n", namespace, "-f", "-", "--dry-run=server", input=json.dumps(own),
                            check=False)
        assert r.returncode == 0, r.stderr

        # the gateway's objects too: its Role grants only what the chart's ServiceAccount holds
        assert can("create", "roles.rbac.authorization.k8s.io", "-n", namespace) == "yes"
        assert can("create", "networkpolicies.networking.k8s.io", "-n", namespace) == "yes"
        assert can("create", "deployments.apps", "-n", namespace) == "yes"
        keys_secret(cluster, namespace, a="sk-chart-test-key-0001")
        cluster.apply(sample(gateway={"enabled": True, "apiKeysSecret": "sim-small-keys"}), namespace)
        wait_phase(cluster, namespace, "Ready", timeout=120, extra=lambda o: o["status"]["linksSummary"] == "4/4")
        wait_for("the gateway Ready", lambda: cluster.get_json("deployment", "sim-small-gateway", "-n", namespace)[
            "status"].get("readyReplicas") == 1, timeout=60)
        pods = wait_for("the operator pods", lambda: cluster.get_json(
            "pods", "-n", namespace, "-l", "app.kubernetes.io/name=pd-operator")["items"])
        assert len(pods) == 2   # a leader and a standby
        logs = {p["metadata"]["name"]: cluster.kubectl("logs", p["metadata"]["name"], "-n", namespace).stdout
                for p in pods}
        assert all("pd-operator started" in text for text in logs.values())
        leaders = [n for n, text in logs.items() if "became the leader" in text]
        assert len(leaders) == 1 and "Linked" in logs[leaders[0]], logs
        holder = cluster.get_json("lease", f"{release}-pd-operator-leader", "-n", namespace)["spec"]["holderIdentity"]
        assert holder.startswith(leaders[0] + "_")
        assert not any("Forbidden" in text or "403" in text for text in logs.values())
        pod = next(p for p in pods if p["metadata"]["name"] == leaders[0])
        # the operator's metrics, where the chart's Service points
        import httpx
        svc = cluster.get_json("service", f"{release}-pd-operator-metrics", "-n", namespace)
        assert svc["spec"]["ports"][0]["port"] == 8080
        text = httpx.get(f"http://{pod['status']['podIP']}:8080/metrics", trust_env=False, timeout=5).text
        assert 'pd_operator_reconciles_total{result="ok"}' in text
        assert 'pd_operator_deployment_phase{name="sim-small"' in text
    finally:
        helm(cluster, "uninstall", release, "-n", namespace, "--wait", "--timeout", "60s")


def rules_of(cluster: Cluster, *values: str) -> dict[tuple[str, str], list[dict]]:
    """The chart's RBAC objects as rendered, by (kind, namespace)."""
    r = helm(cluster, "template", "x", CHART, "-n", "pd-system", "--kube-version", "1.36.0", *values)
    assert r.returncode == 0, r.stderr
    docs = [d for d in yaml.safe_load_all(r.stdout) if d and d["kind"] in ("ClusterRole", "Role")]
    leader = [d for d in docs if d["metadata"]["name"].endswith("-leader")]
    # leader election: its own Lease, read and written, nothing else
    assert [d["rules"] for d in leader] == [[{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                                              "resourceNames": ["x-pd-operator-leader"], "verbs": ["get", "update"]}]]
    return {(d["kind"], d["metadata"].get("namespace", "")): d["rules"] for d in docs if d not in leader}


def test_chart_rbac_takes_only_what_the_operator_uses(cluster: Cluster) -> None:
    """Both install modes, as objects: verbs the code uses and nothing cluster-wide that
    watchNamespaces does not need."""
    def grants(rules: list[dict], resource: str, verb: str) -> bool:
        return any(resource in r["resources"] and verb in r["verbs"] for r in rules)
    wide = rules_of(cluster)
    assert set(wide) == {("ClusterRole", "")}
    scoped = rules_of(cluster, "--set", "watchNamespaces={team-a,team-b}")
    assert set(scoped) == {("ClusterRole", ""), ("Role", "team-a"), ("Role", "team-b")}
    cluster_role = scoped[("ClusterRole", "")]
    assert {res for r in cluster_role for res in r["resources"]} == {"customresourcedefinitions", "namespaces"}
    assert all(set(r["verbs"]) <= {"get", "list", "watch"} for r in cluster_role)
    for rules in (wide[("ClusterRole", "")], scoped[("Role", "team-a")]):
        assert grants(rules, "secrets", "get") and grants(rules, "secrets", "create")
        for resource, verb in (("secrets", "list"), ("secrets", "watch"), ("secrets", "update"),
                               ("pods", "create"), ("statefulsets", "delete"),
                               ("roles", "escalate"), ("roles", "bind"), ("pods/exec", "create")):
            assert not grants(rules, resource, verb), (resource, verb)
        assert not any("*" in r["verbs"] or "*" in r["resources"] for r in rules)


def test_an_installed_operator_watching_every_namespace_is_found(cluster: Cluster, namespace: str) -> None:
    """What the suite refuses to run beside (tests/conftest.py): an operator of the chart's whose
    PD_OPERATOR_NAMESPACES is empty would act on every test's namespace (make demo scopes its own)."""
    from tests.conftest import operators_watching_everything

    def deployment(watch: str) -> dict:
        labels = {"app.kubernetes.io/name": "pd-operator", "app.kubernetes.io/instance": "stray"}
        return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "stray", "labels": labels},
                "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "template": {
                    "metadata": {"labels": labels},
                    "spec": {"nodeSelector": {"pdoperator.io/no-such-node": "true"}, "containers": [{
                        "name": "operator", "image": "example.com/pd/pd-operator:0.1.0",
                        "env": [{"name": "PD_OPERATOR_NAMESPACES", "value": watch}]}]}}}}
    cluster.apply(deployment(""), namespace)
    assert f"{namespace}/stray" in operators_watching_everything(cluster)
    cluster.apply(deployment(namespace), namespace)
    assert f"{namespace}/stray" not in operators_watching_everything(cluster)
    demo = (REPO / "hack" / "demo.sh").read_text()
    assert "--set 'watchNamespaces={pd-demo}'" in demo
