"""Monitoring (docs/operations/monitoring.md): what the dashboard and the alerts query is what the
code exports; the chart renders the Prometheus Operator objects and the dashboard only when asked;
the engines' NetworkPolicy admits monitoring to the agents' metrics port, never to their API; the
agent serves /metrics, and nothing else, on that port."""
from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

import llm_datadist_sim as llm
from pd_agent.core import AgentCore
from pd_agent.front import Front, build_front_app
from pd_agent.http import metrics_app, serve_metrics
from pd_agent.identity import ConfigError, Identity
from pd_agent.metrics import AgentMetrics
from pd_agent.server import build_app
from pd_contract.names import AGENT_METRICS_PORT, AGENT_PORT, GATEWAY_METRICS_PORT
from pd_gateway.metrics import GatewayMetrics
from pd_operator import builders, sharedgateway
from pd_operator.api import parse_spec
from pd_operator.api_gateway import parse_spec as parse_gateway_spec
from pd_operator.config import OperatorConfig
from pd_operator.metrics import OperatorMetrics
from tests.conftest import REPO

CHART = REPO / "charts" / "pd-operator"
DASHBOARD = CHART / "dashboards" / "pd-operator.json"
RUNBOOK = REPO / "docs" / "operations" / "monitoring.md"
MONITORING = {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
# labels Prometheus puts on every scraped series (the PodMonitor's relabelings included), which
# a query may match on besides the metric's own
TARGET_LABELS = {"job", "instance", "namespace", "pod", "container", "endpoint", "service",
                 "deployment", "group", "role", "gateway", "pdgateway"}
ALL_ON = ["--set", "monitoring.podMonitor.enabled=true", "--set", "monitoring.serviceMonitor.enabled=true",
          "--set", "monitoring.prometheusRule.enabled=true", "--set", "monitoring.dashboard.enabled=true",
          "--set", "monitoring.labels.release=prometheus"]
MONITORING_KINDS = {"PodMonitor", "ServiceMonitor", "PrometheusRule"}


# ---- (a) every metric a query names exists -------------------------------------------------------

def exported() -> dict[str, set[str]]:
    """Every series name the code's registries expose (counters as _total, histograms as
    _bucket/_sum/_count) -> the metric's own label names."""
    out: dict[str, set[str]] = {}
    for holder in (OperatorMetrics(), GatewayMetrics(), AgentMetrics()):
        registries = [v for v in vars(holder).values() if isinstance(v, CollectorRegistry)]
        assert registries, f"{type(holder).__name__} has no registry"
        # the holder's metrics, and those of a group of metrics it holds (the model-server gauges)
        parts = [holder, *(v for v in vars(holder).values() if type(v).__module__.startswith("pd_")
                           and not isinstance(v, (CollectorRegistry, MetricWrapperBase)))]
        labels = {m._name: set(m._labelnames) for part in parts for m in vars(part).values()
                  if isinstance(m, MetricWrapperBase)}
        for registry in registries:
            for family in registry.collect():
                suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                            "summary": ("_sum", "_count")}.get(family.type, ("",))
                own = labels.get(family.name, set())
                assert family.name in labels, f"{family.name} is not an attribute of {type(holder).__name__}"
                for s in suffixes:
                    out[family.name + s] = own | ({"le"} if s == "_bucket" else set())
    return out


def test_the_registries_are_read_whole():
    names = exported()
    for name in ("pd_operator_deployment_phase", "pd_operator_leader", "pd_operator_link_operations_total",
                 "pd_operator_switch_duration_seconds_bucket", "pd_gateway_requests_total",
                 "pd_gateway_ttft_ms_bucket", "pd_agent_requests_total", "pd_agent_links"):
        assert name in names, name
    assert names["pd_gateway_requests_total"] == {"key", "api", "status"}


SELECTOR = re.compile(r"\b(pd_[a-z0-9_]+)\s*(\{[^}]*\})?")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*\"")


def check(where: str, expr: str, names: dict[str, set[str]]) -> list[str]:
    """What in `expr` the code does not export: a metric name, or a label matched on a metric
    that has no such label (its own or a target's)."""
    bad = []
    found = SELECTOR.findall(expr)
    if not found:
        bad.append(f"{where}: no pd_ metric in {expr!r}")
    for name, matchers in found:
        if name not in names:
            bad.append(f"{where}: {name} is not exported")
            continue
        for label, _ in MATCHER.findall(matchers or ""):
            if label not in names[name] | TARGET_LABELS:
                bad.append(f"{where}: {name} has no label {label!r}")
    return bad


def dashboard_queries() -> list[tuple[str, str]]:
    d = json.loads(DASHBOARD.read_text())
    out = []
    for p in d["panels"]:
        out += [(f"panel {p['title']!r}", t["expr"]) for t in p.get("targets", [])]
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            out.append((f"variable {v['name']}", v["definition"]))
    return out


def test_every_metric_the_dashboard_queries_is_exported():
    names = exported()
    queries = dashboard_queries()
    assert len(queries) > 20
    bad = [b for where, expr in queries for b in check(where, expr, names)]
    assert not bad, "\n".join(bad)
    d = json.loads(DASHBOARD.read_text())
    assert d["uid"] == "pd-operator" and all(p["type"] == "row" or p.get("targets") for p in d["panels"])
    titles = {p["title"] for p in d["panels"]}
    for want in ("Phase", "Links up / expected", "Switch duration (p50, p95)", "KV-path verifications",
                 "Requests finished", "Agent TTFT (p50, p95)", "Requests by status", "Gateway TTFT (p50, p95, p99)"):
        assert want in titles


def pod_templates() -> dict[str, dict]:
    """The pod templates the operator makes: engines, a deployment's gateway, a PDGateway."""
    config = OperatorConfig(namespace="pd-system", gateway_image="example.com/pd/pd-gateway:0.1.0")
    out: dict[str, dict] = {}
    deployments = []
    for example in ("sim-small.yaml", "sim-chat.yaml"):
        doc = yaml.safe_load((REPO / "examples" / example).read_text())
        deployments.append({**doc, "metadata": {**doc["metadata"], "namespace": "serving"}})
        for o in builders.desired_children(doc["metadata"]["name"], "serving", "uid", parse_spec(doc["spec"]),
                                           config=config):
            if o["kind"] in ("StatefulSet", "Deployment"):
                out[f"{o['kind']}/{o['metadata']['name']}"] = o["spec"]["template"]
    gw = yaml.safe_load((REPO / "examples" / "sim-shared-gateway.yaml").read_text())
    spec = parse_gateway_spec(gw["spec"])
    for o in sharedgateway.objects(gw["metadata"]["name"], "serving", spec, sharedgateway.owner_reference("g", "u"),
                                   sharedgateway.routing(deployments, spec.selector), "img", True, config):
        if o["kind"] == "Deployment":
            out[f"PDGateway/{o['metadata']['name']}"] = o["spec"]["template"]
    return out


def selects(selector: dict, labels: dict[str, str]) -> bool:
    ok = all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())
    for e in selector.get("matchExpressions") or []:
        if e["operator"] == "In":
            ok &= labels.get(e["key"]) in e["values"]
        elif e["operator"] == "Exists":
            ok &= e["key"] in labels
        else:
            raise AssertionError(f"unexpected operator {e['operator']}")
    return ok


# ---- (c) the engines' NetworkPolicy --------------------------------------------------------------

SPEC = yaml.safe_load((REPO / "examples" / "sim-small.yaml").read_text())["spec"]


def engines_policy(config: OperatorConfig) -> dict:
    objs = builders.desired_children("llm", "serving", "uid", parse_spec(SPEC), config=config)
    return next(o for o in objs if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "llm-engines")["spec"]


def ports_from(policy: dict, peer: dict) -> set[int]:
    return {p["port"] for rule in policy["ingress"] if peer in rule.get("from", []) for p in rule["ports"]}


def test_engines_admit_monitoring_to_the_metrics_port_and_not_the_api():
    selector = {"matchLabels": {"kubernetes.io/metadata.name": "observability"}}
    np = engines_policy(OperatorConfig(namespace="pd-system", metrics_namespaces=selector))
    assert ports_from(np, {"namespaceSelector": selector}) == {AGENT_METRICS_PORT}
    # nobody else reaches the metrics port, and the monitoring namespace nothing else
    (rule,) = [r for r in np["ingress"] if {"protocol": "TCP", "port": AGENT_METRICS_PORT} in r["ports"]]
    assert rule["ports"] == [{"protocol": "TCP", "port": AGENT_METRICS_PORT}]
    operator = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "pd-system"}},
                "podSelector": {"matchLabels": {"app.kubernetes.io/name": "pd-operator"}}}
    assert rule["from"] == [operator, {"namespaceSelector": selector}]
    api = [r for r in np["ingress"] if {"protocol": "TCP", "port": AGENT_PORT} in r["ports"]]
    assert api and not any("namespaceSelector" in f and "podSelector" not in f for r in api for f in r["from"])
    # every rule names its peers: no port is open to all
    assert all(r.get("from") for r in np["ingress"])


def test_one_value_governs_both_metrics_ports():
    """networkPolicy.metricsNamespaceSelector (the operator's metrics_namespaces) admits the same
    namespaces to the gateways' metrics port and the agents'."""
    spec = parse_spec({**SPEC, "gateway": {"enabled": True, "apiKeysSecret": "keys"}})
    for selector in (MONITORING, {"matchLabels": {"team": "obs"}}):
        objs = builders.desired_children("llm", "serving", "uid", spec,
                                         config=OperatorConfig(namespace="pd-system", metrics_namespaces=selector))
        pols = {o["metadata"]["name"]: o["spec"] for o in objs if o["kind"] == "NetworkPolicy"}
        assert ports_from(pols["llm-engines"], {"namespaceSelector": selector}) == {AGENT_METRICS_PORT}
        assert ports_from(pols["llm-gateway"], {"namespaceSelector": selector}) == {GATEWAY_METRICS_PORT}
    # null: the operator alone; outside a cluster as well: no rule at all
    np = engines_policy(OperatorConfig(namespace="pd-system", metrics_namespaces=None))
    (rule,) = [r for r in np["ingress"] if r["ports"] == [{"protocol": "TCP", "port": AGENT_METRICS_PORT}]]
    assert all("podSelector" in f for f in rule["from"])
    np = engines_policy(OperatorConfig(metrics_namespaces=None))
    assert not [r for r in np["ingress"] if {"protocol": "TCP", "port": AGENT_METRICS_PORT} in r["ports"]]


def test_engine_pods_serve_metrics_on_their_metrics_port():
    objs = builders.desired_children("llm", "serving", "uid", parse_spec(SPEC))
    for sts in (o for o in objs if o["kind"] == "StatefulSet"):
        t = sts["spec"]["template"]
        c = t["spec"]["containers"][0]
        assert {"name": "metrics", "containerPort": AGENT_METRICS_PORT, "protocol": "TCP"} in c["ports"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["PD_AGENT_METRICS_PORT"] == str(AGENT_METRICS_PORT)
        assert t["metadata"]["annotations"]["prometheus.io/port"] == str(AGENT_METRICS_PORT)


# ---- the agent's metrics port --------------------------------------------------------------------

def test_the_metrics_port_is_read_from_the_environment():
    base = {"LLM_DATADIST_CLUSTER_ID": "0"}
    assert Identity.from_env(base).metrics_port is None
    assert Identity.from_env({**base, "PD_AGENT_METRICS_PORT": "0"}).metrics_port is None
    assert Identity.from_env({**base, "PD_AGENT_METRICS_PORT": "9091"}).metrics_port == 9091
    for bad in ("x", "70000"):
        with pytest.raises(ConfigError, match="PD_AGENT_METRICS_PORT"):
            Identity.from_env({**base, "PD_AGENT_METRICS_PORT": bad})


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_the_agent_serves_metrics_alone_on_its_metrics_port():
    token = "control-token-not-for-monitoring"
    ident = Identity(pod="secret-pod-name", role="prompt", cluster_id=0, ip="127.0.0.1", port=free_port(),
                     token=token, metrics_port=free_port())
    core = AgentCore(llm, ident)
    app = build_app(core, token, AgentMetrics())
    runner = await serve_metrics(app, ident, "127.0.0.1")
    assert runner is not None
    try:
        await core.init()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ident.metrics_port}", trust_env=False,
                                     timeout=10) as c:
            r = await c.get("/metrics")   # no token
            assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/plain")
            assert 'pd_agent_links{state="up"}' in r.text and "pd_agent_kv_cache_used_bytes" in r.text
            # nothing a scrape could leak: no token, no pod name
            assert token not in r.text and "secret-pod-name" not in r.text
            for path in ("/v1/status", "/healthz", "/livez", "/v1/init"):
                assert (await c.get(path, headers={"Authorization": f"Bearer {token}"})).status_code == 404, path
    finally:
        await runner.cleanup()
        await core.finalize()
    assert await serve_metrics(app, Identity(pod="p", role="prompt", cluster_id=0, ip="127.0.0.1", port=1),
                               "127.0.0.1") is None


async def test_the_multi_rank_front_has_the_same_metrics_port():
    ident = Identity(pod="p-0", role="prompt", cluster_id=0, ip="127.0.0.1", port=1, token="t")
    async with httpx.AsyncClient() as http:
        app = metrics_app(build_front_app(Front(ident, 2, http, env={}), "t"))
        assert {(r.method, r.resource.canonical) for r in app.router.routes()} == {("GET", "/metrics"),
                                                                                 ("HEAD", "/metrics")}


# ---- the operator's per-deployment series --------------------------------------------------------

def test_the_operator_exports_deployment_state_while_it_leads():
    m = OperatorMetrics()
    m.set_phase("serving", "llm", "Switching")
    m.observe_status("serving", "llm", {
        "links": {"up": 3, "expected": 4},
        "conditions": [{"type": "KVPathVerified", "status": "False"}, {"type": "Ready", "status": "False"}],
        "switches": [{"pod": "llm-decoder-0", "startedAt": "2024-01-02T03:04:05.500Z"},
                     {"pod": "llm-decoder-1", "startedAt": "2024-01-02T03:05:00.000Z"}]})
    m.verified("serving", "llm", False, "KV_CONTENT_MISMATCH")
    text = m.exposition().decode()
    for line in ('pd_operator_deployment_links{name="llm",namespace="serving",state="up"} 3.0',
                 'pd_operator_deployment_condition{condition="KVPathVerified",name="llm",namespace="serving",'
                 'status="False"} 1.0',
                 'pd_operator_switches_in_flight{name="llm",namespace="serving"} 2.0',
                 'pd_operator_oldest_switch_start_timestamp_seconds{name="llm",namespace="serving"} 1.7041646455e+09',
                 'pd_operator_kv_verifications_total{name="llm",namespace="serving",result="mismatch"} 1.0',
                 "pd_operator_leader 1.0"):
        assert line in text, line
    # a condition that went away, and switches that ended, leave no series behind
    m.observe_status("serving", "llm", {"links": {"up": 4, "expected": 4},
                                        "conditions": [{"type": "Ready", "status": "True"}]})
    text = m.exposition().decode()
    assert 'condition="KVPathVerified"' not in text and "pd_operator_oldest_switch_start_timestamp_seconds{" not in text
    # a standby exports no deployment's state (it would be stale), and says it is one
    m.leading = lambda: False
    text = m.exposition().decode()
    assert "pd_operator_leader 0.0" in text and "pd_operator_deployment_phase{" not in text
    m.leading = lambda: True
    m.forget("serving", "llm")
    assert 'name="llm"' not in m.exposition().decode()


def test_the_docs_name_the_ports_and_values_the_chart_has():
    text = RUNBOOK.read_text()
    values = yaml.safe_load((CHART / "values.yaml").read_text())["monitoring"]
    for key in ("podMonitor", "serviceMonitor", "prometheusRule", "dashboard"):
        assert f"monitoring.{key}.enabled" in text and values[key]["enabled"] is False
    assert str(AGENT_METRICS_PORT) in text and "networkPolicy.metricsNamespaceSelector" in text
    assert Path(DASHBOARD).is_file()
