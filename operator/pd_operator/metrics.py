"""The operator's Prometheus metrics (its own registry) and the /metrics endpoint."""
from __future__ import annotations

import logging
import os

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

log = logging.getLogger("pd_operator.metrics")
PHASES = ("Pending", "Linking", "Ready", "Switching", "Degraded")
SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class OperatorMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.reconciles = Counter("pd_operator_reconciles", "Reconcile passes by result "
                                  "(ok, requeue: acted and goes again, transient, terminal)", ["result"], registry=r)
        self.reconcile_seconds = Histogram("pd_operator_reconcile_duration_seconds", "One reconcile pass",
                                           buckets=SECONDS, registry=r)
        self.link_ops = Counter("pd_operator_link_operations", "link/unlink per peer, by LLMStatusCode",
                                ["op", "code"], registry=r)
        self.agent_calls = Counter("pd_operator_agent_calls", "Calls to in-pod agents by operation and result",
                                   ["op", "result"], registry=r)
        self.agent_seconds = Histogram("pd_operator_agent_call_duration_seconds", "Agent call latency",
                                       ["op"], buckets=SECONDS, registry=r)
        self.ready_seconds = Histogram("pd_operator_pods_ready_to_ready_seconds",
                                       "From every pod Ready to the deployment Ready (links up, KV path verified)",
                                       buckets=SECONDS, registry=r)
        self.phase = Gauge("pd_operator_deployment_phase", "1 for the phase each PDDeployment is in",
                           ["namespace", "name", "phase"], registry=r)
        self.applies = Counter("pd_operator_child_applies", "Server-side applies of owned objects by kind",
                               ["kind"], registry=r)
        # filled by role switching and the rebalancing policies
        self.switches = Counter("pd_operator_switches", "Role switches by direction and result",
                                ["direction", "result"], registry=r)
        self.switch_seconds = Histogram("pd_operator_switch_duration_seconds",
                                        "Role switches that completed, by direction and part (drain; switch: "
                                        "unlink and switch_role; relink: links and KV-path check; control: all "
                                        "but the drain; total)", ["direction", "part"], buckets=SECONDS,
                                        registry=r)
        self.decisions = Counter("pd_operator_policy_decisions", "Rebalancing decisions by policy and outcome",
                                 ["policy", "outcome"], registry=r)

    def set_phase(self, namespace: str, name: str, phase: str | None) -> None:
        for p in PHASES:
            self.phase.labels(namespace, name, p).set(1 if p == phase else 0)

    def forget(self, namespace: str, name: str) -> None:
        for p in PHASES:
            try:
                self.phase.remove(namespace, name, p)
            except KeyError:
                pass


def listen_address() -> tuple[str, int] | None:
    """PD_OPERATOR_METRICS_ADDR as host:port ('off' disables it); by default port 8081 on
    the pod's address."""
    raw = os.environ.get("PD_OPERATOR_METRICS_ADDR", "")
    if raw == "off":
        return None
    if raw:
        host, _, port = raw.rpartition(":")
        return host or "0.0.0.0", int(port)
    return os.environ.get("PD_LOCAL_POD_IP", "0.0.0.0"), 8081


async def serve(metrics: OperatorMetrics) -> web.AppRunner | None:
    addr = listen_address()
    if addr is None:
        return None

    async def handle(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})
    app = web.Application()
    app.router.add_get("/metrics", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, addr[0], addr[1]).start()
    log.info("metrics on http://%s:%d/metrics", *addr)
    return runner
