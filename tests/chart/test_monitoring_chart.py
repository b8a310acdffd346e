"""The chart's monitoring objects as `helm template` renders them (helm built from its pinned
module by hack/k8s-bins, where the local cluster's binaries are built: not in the unit stage):
the alerts query what the code exports and link their runbooks, monitoring objects render only
when asked, and the PodMonitor scrapes every engine and gateway on its metrics port."""
from __future__ import annotations

import json
import re
import subprocess

import pytest
import yaml

from pd_contract.names import AGENT_METRICS_PORT, GATEWAY_METRICS_PORT
from tests.chart.test_kube_score import built
from tests.conftest import REPO
from tests.unit.test_monitoring import (
    ALL_ON,
    CHART,
    DASHBOARD,
    MONITORING_KINDS,
    RUNBOOK,
    check,
    exported,
    pod_templates,
    selects,
)


@pytest.fixture(scope="module")
def helm() -> str:
    return built(["hack/k8s-bins/build.sh", "--helm"])


def render(helm: str, *values: str) -> list[dict]:
    r = subprocess.run([helm, "template", "pd", str(CHART), "-n", "pd-system", "--kube-version", "1.30.0", *values],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def alert_rules(docs: list[dict]) -> list[dict]:
    rule = next(d for d in docs if d["kind"] == "PrometheusRule")
    return [r for g in rule["spec"]["groups"] for r in g["rules"]]


def dashboards(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] == "ConfigMap"
            and (d["metadata"].get("labels") or {}).get("grafana_dashboard") == "1"]


def test_every_metric_the_alerts_query_is_exported(helm):
    names = exported()
    rules = alert_rules(render(helm, *ALL_ON))
    assert {r["alert"] for r in rules} == {"PDSwitchStuck", "PDLinksDown", "PDLinkOperationsFailing",
                                           "PDKVPathVerifyFailing", "PDDeploymentDegraded",
                                           "PDGatewayHighErrorRate", "PDOperatorNoLeader", "PDOperatorNotScraped"}
    bad = [b for r in rules for b in check(f"alert {r['alert']}", r["expr"], names)]
    assert not bad, "\n".join(bad)


def test_the_runbook_base_url_is_absolute_by_default(helm):
    """Alert receivers open runbook_url as a link: a path relative to nothing opens nothing."""
    rules = alert_rules(render(helm, *ALL_ON))
    assert all(r["annotations"]["runbook_url"].startswith("https://") for r in rules)
    r = subprocess.run([helm, "template", "pd", str(CHART), "--kube-version", "1.30.0", *ALL_ON,
                        "--set", "monitoring.runbookBaseURL=docs/operations/monitoring.md"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "runbookBaseURL" in r.stderr


def test_every_alert_says_what_happened_and_links_its_runbook(helm):
    rules = alert_rules(render(helm, *ALL_ON, "--set", "monitoring.runbookBaseURL=https://example.com/runbook"))
    headings = {re.sub(r"[^a-z0-9-]", "", h.strip().lower().replace(" ", "-"))
                for h in re.findall(r"^#+\s+(.*)$", RUNBOOK.read_text(), re.M)}
    for r in rules:
        a = r["annotations"]
        assert a["summary"] and a["description"], r["alert"]
        assert r["labels"]["severity"] in ("warning", "critical"), r["alert"]
        anchor = r["alert"].lower()
        assert a["runbook_url"] == f"https://example.com/runbook#{anchor}"
        assert anchor in headings, f"{RUNBOOK.relative_to(REPO)} has no heading for {r['alert']}"


# ---- (b) the chart -------------------------------------------------------------------------------

def test_defaults_render_no_monitoring_objects(helm):
    docs = render(helm)
    assert not [d["kind"] for d in docs if d["kind"] in MONITORING_KINDS or d["apiVersion"].startswith("monitoring.")]
    assert not dashboards(docs)


def test_all_monitoring_values_render_every_object(helm):
    docs = render(helm, *ALL_ON)
    kinds = {d["kind"]: d for d in docs if d["kind"] in MONITORING_KINDS}
    assert set(kinds) == MONITORING_KINDS
    assert sum(d["kind"] == "ServiceMonitor" for d in docs) == 1
    for d in kinds.values():
        assert d["apiVersion"] == "monitoring.coreos.com/v1"
        assert d["metadata"]["labels"]["release"] == "prometheus"
    # the operator's own metrics Service, with the deployment's namespace kept on its series
    svc = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "pd-pd-operator-metrics")
    sm = kinds["ServiceMonitor"]["spec"]
    assert sm["selector"]["matchLabels"].items() <= svc["spec"]["selector"].items()
    assert sm["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"] and sm["endpoints"][0]["honorLabels"]
    # the dashboard, whole, as the sidecar loads it
    (cm,) = dashboards(docs)
    assert json.loads(cm["data"]["pd-operator.json"]) == json.loads(DASHBOARD.read_text())


def test_the_old_service_monitor_value_still_works(helm):
    docs = render(helm, "--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.serviceMonitor.interval=15s")
    (sm,) = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert sm["spec"]["endpoints"][0]["interval"] == "15s"
    assert not [d for d in docs if d["kind"] in MONITORING_KINDS - {"ServiceMonitor"}]


def test_the_pod_monitor_scrapes_every_engine_and_gateway_on_its_metrics_port(helm):
    pm = next(d for d in render(helm, *ALL_ON) if d["kind"] == "PodMonitor")["spec"]
    assert pm["namespaceSelector"] == {"any": True}
    assert [e["port"] for e in pm["podMetricsEndpoints"]] == ["metrics"]
    templates = pod_templates()
    kinds = {k.split("/")[0] for k in templates}
    assert kinds == {"StatefulSet", "Deployment", "PDGateway"}, kinds
    for what, t in templates.items():
        assert selects(pm["selector"], t["metadata"]["labels"]), f"the PodMonitor misses {what}"
        ports = {p["name"]: p["containerPort"] for p in t["spec"]["containers"][0]["ports"]}
        want = AGENT_METRICS_PORT if what.startswith("StatefulSet") else GATEWAY_METRICS_PORT
        assert ports["metrics"] == want, what
    # the relabelings name the pods' labels as Prometheus sanitises them
    sources = {r["sourceLabels"][0] for r in pm["podMetricsEndpoints"][0]["relabelings"]}
    engine = next(t for k, t in templates.items() if k.startswith("StatefulSet"))["metadata"]["labels"]
    for label in ("pdoperator.io/deployment", "pdoperator.io/group", "pdoperator.io/role"):
        assert label in engine and "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", label) in sources
