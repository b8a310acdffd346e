"""The operator's Prometheus metrics (its own registry) and the /metrics endpoint.

What each PDDeployment is now (phase, links, conditions, switches in flight) is in a registry of
its own that /metrics shows only while this replica leads: a standby (or a former leader) would
otherwise keep exporting the last state it saw, and an alert would fire on it."""
from __future__ import annotations

import datetime as dt
import logging
import os
from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pd_contract.engine_env import PD_LOCAL_POD_IP

log = logging.getLogger("pd_operator.metrics")
PHASES = ("Pending", "Linking", "Ready", "Switching", "Degraded")
CONDITION_STATUSES = ("True", "False", "Unknown")
VERIFY_RESULTS = ("ok", "mismatch", "failed")   # a KV-path verification: bytes matched; content not the model's; else
SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class OperatorMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        d = self.state_registry = CollectorRegistry()   # per deployment, now: shown while leading
        # whether this replica leads (acts); the operator's start-up sets it (default: it does)
        self.leading: Callable[[], bool] = lambda: True
        self.leader = Gauge("pd_operator_leader", "1 on the replica that leads (acts on PDDeployments), 0 on a "
                            "standby", registry=r)
        self.leader.set_function(lambda: 1.0 if self.leading() else 0.0)
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
                           ["namespace", "name", "phase"], registry=d)
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
        # per PDDeployment, from the status the operator writes (observe_status), for alerts
        self.links = Gauge("pd_operator_deployment_links", "Decoder-to-prefill links the deployment's status "
                           "counts, by state (up; expected: every link its topology needs)",
                           ["namespace", "name", "state"], registry=d)
        self.condition = Gauge("pd_operator_deployment_condition", "1 for each status condition's status "
                               "(True, False, Unknown), by condition type",
                               ["namespace", "name", "condition", "status"], registry=d)
        self.switches_in_flight = Gauge("pd_operator_switches_in_flight", "Role switches in flight (status.switches)",
                                        ["namespace", "name"], registry=d)
        self.oldest_switch = Gauge("pd_operator_oldest_switch_start_timestamp_seconds",
                                   "Unix time the oldest switch in flight started (absent: none in flight)",
                                   ["namespace", "name"], registry=d)
        self.verifications = Counter("pd_operator_kv_verifications", "KV-path verifications (a decoder pulls a "
                                     "probe cache from a prefill) by result: ok, mismatch (the reference engine's "
                                     "content is not the model's), failed", ["namespace", "name", "result"],
                                     registry=r)
        self._conditions: dict[tuple[str, str], set[str]] = {}

    def exposition(self) -> bytes:
        """/metrics: the counters and histograms, and while leading what each deployment is now."""
        return generate_latest(self.registry) + (generate_latest(self.state_registry) if self.leading() else b"")

    def set_phase(self, namespace: str, name: str, phase: str | None) -> None:
        for p in PHASES:
            self.phase.labels(namespace, name, p).set(1 if p == phase else 0)

    def observe_status(self, namespace: str, name: str, status: dict) -> None:
        """The deployment's links, conditions and switches, as the status just computed says."""
        links = status.get("links") or {}
        for state in ("up", "expected"):
            self.links.labels(namespace, name, state).set(links.get(state) or 0)
        seen = self._conditions.setdefault((namespace, name), set())
        now = set()
        for c in status.get("conditions") or []:
            now.add(c["type"])
            for st in CONDITION_STATUSES:
                self.condition.labels(namespace, name, c["type"], st).set(1 if c.get("status") == st else 0)
        for gone in seen - now:
            self._remove(self.condition, [(namespace, name, gone, st) for st in CONDITION_STATUSES])
        seen.clear()
        seen.update(now)
        switches = status.get("switches") or []
        self.switches_in_flight.labels(namespace, name).set(len(switches))
        started = [t for t in (_unix(s.get("startedAt")) for s in switches) if t is not None]
        if started:
            self.oldest_switch.labels(namespace, name).set(min(started))
        else:
            self._remove(self.oldest_switch, [(namespace, name)])

    def verified(self, namespace: str, name: str, ok: bool, code: str) -> None:
        result = "ok" if ok else "mismatch" if code == "KV_CONTENT_MISMATCH" else "failed"
        self.verifications.labels(namespace, name, result).inc()

    @staticmethod
    def _remove(metric, label_sets) -> None:
        for labels in label_sets:
            try:
                metric.remove(*labels)
            except KeyError:
                pass

    def forget(self, namespace: str, name: str) -> None:
        self._remove(self.phase, [(namespace, name, p) for p in PHASES])
        self._remove(self.links, [(namespace, name, s) for s in ("up", "expected")])
        self._remove(self.condition, [(namespace, name, c, st) for c in self._conditions.pop((namespace, name), ())
                                      for st in CONDITION_STATUSES])
        self._remove(self.switches_in_flight, [(namespace, name)])
        self._remove(self.oldest_switch, [(namespace, name)])
        self._remove(self.verifications, [(namespace, name, r) for r in VERIFY_RESULTS])


def _unix(iso: str | None) -> float | None:
    """An RFC 3339 time of the status (2024-01-02T03:04:05Z) as Unix seconds."""
    if not iso:
        return None
    try:
        t = dt.datetime.fromisoformat(iso.replace("Z", "+00:00"))
    except ValueError:
        return None
    return (t if t.tzinfo else t.replace(tzinfo=dt.timezone.utc)).timestamp()


def listen_address() -> tuple[str, int] | None:
    """PD_OPERATOR_METRICS_ADDR as host:port ('off' disables it); by default port 8081 on
    the pod's address."""
    raw = os.environ.get("PD_OPERATOR_METRICS_ADDR", "")
    if raw == "off":
        return None
    if raw:
        host, _, port = raw.rpartition(":")
        return host or "0.0.0.0", int(port)
    return os.environ.get(PD_LOCAL_POD_IP, "0.0.0.0"), 8081


async def serve(metrics: OperatorMetrics) -> web.AppRunner | None:
    addr = listen_address()
    if addr is None:
        return None

    async def handle(_: web.Request) -> web.Response:
        return web.Response(body=metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})
    app = web.Application()
    app.router.add_get("/metrics", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, addr[0], addr[1]).start()
    log.info("metrics on http://%s:%d/metrics", *addr)
    return runner
