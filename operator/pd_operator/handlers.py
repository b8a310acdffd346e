"""Kopf is the event source, nothing more: every watch event on a PDDeployment, its pods or
its children (StatefulSets, Services, ConfigMaps, the gateway's objects, the NetworkPolicy)
lands in the controller's caches and wakes that deployment's one reconcile (reconcile.py).
No handler applies anything, so there is one reconciler, and no finalizer: owner references
clean up after a deleted PDDeployment."""
from __future__ import annotations

import asyncio
import gc
import logging
import os

import kopf

from . import kinds
from .agentclient import AgentClient
from .api import GROUP, PLURAL, VERSION
from .builders import LABEL_DEPLOYMENT
from .gatewaycontroller import GatewayController
from .kube import Kube
from .leader import Elector, LeaseSettings
from .metrics import OperatorMetrics, serve
from .reconcile import Controller
from .shards import ShardElection

log = logging.getLogger("pd_operator")
WATCHED_CHILDREN = tuple((k.group, k.version, k.plural) for k in kinds.CHILDREN)


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_) -> None:
    """The operator's state lives in Kopf's memo (each resource's memo is a shallow copy of it,
    so every handler reaches the one Controller). `memo.after_record`, if set, is the fault
    point hook __main__ installed."""
    settings.posting.level = logging.WARNING
    # A watch ends (and Kopf resumes it) every few minutes; a resumed watch is where rotated
    # credentials are used, so the period bounds how long a revoked token's watch lives on.
    watch_s = int(os.environ.get("PD_OPERATOR_WATCH_TIMEOUT_S", "300"))   # the API takes whole seconds
    settings.watching.server_timeout = watch_s
    settings.watching.client_timeout = watch_s + 30
    settings.watching.connect_timeout = 10
    settings.networking.request_timeout = 60
    settings.peering.standalone = True
    settings.persistence.diffbase_storage = EventsOnly()
    # Watch only what carries the deployment label, filtered by the API server.
    settings.watching.label_selectors["pods"] = LABEL_DEPLOYMENT
    for group, _version, plural in WATCHED_CHILDREN:
        settings.watching.label_selectors[f"{group}/{plural}" if group else plural] = LABEL_DEPLOYMENT
    metrics = OperatorMetrics()
    memo.kube = Kube()
    memo.agents = AgentClient(metrics)
    shards = int(os.environ.get("PD_OPERATOR_SHARDS") or 1)
    memo.controller = Controller(memo.kube, memo.agents, metrics, after_record=memo.get("after_record"), shards=shards)
    metrics.leading = memo.controller.leading.is_set   # a standby exports no deployment's state
    # PDGateways follow shard 0 (the only one without sharding)
    memo.gateways = GatewayController(memo.kube, memo.controller.events, memo.controller.config,
                                      memo.controller.shard_leading[0])
    memo.metrics_runner = await serve(metrics)
    lease = LeaseSettings.from_env()
    if lease is not None:
        await _elect(memo, lease, shards)
    elif shards > 1:
        log.warning("PD_OPERATOR_SHARDS=%d without leader election: this replica acts on every shard", shards)
    _tune_gc(os.environ.get("PD_OPERATOR_GC", "tuned"))
    log.info("pd-operator started")


class EventsOnly(kopf.DiffBaseStorage):
    """No handler here reacts to changes (all are on.event), so no object's essence is kept: Kopf
    would otherwise deep-copy every object on every watch event to diff it (at 800 pods, most of
    the operator's CPU at a takeover, in the standby's too)."""

    def build(self, *, body: kopf.Body, extra_fields=None) -> kopf.BodyEssence:
        return kopf.BodyEssence()

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        pass


GC_THRESHOLDS = (10_000, 20, 20)   # CPython's are (700, 10, 10)


def _tune_gc(mode: str) -> None:
    """What exists once started (modules, models, clients) is frozen out of the collector's
    scans, and young collections run less often: with hundreds of thousands of cached objects
    a full collection pauses every pass in flight. PD_OPERATOR_GC=default keeps CPython's."""
    if mode == "default":
        return
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


async def _elect(memo: kopf.Memo, lease: LeaseSettings, shards: int) -> None:
    """Acting starts once a Lease is won: the leader's, or each shard's."""
    for ev in memo.controller.shard_leading:
        ev.clear()
    memo.controller.leading.clear()

    async def lead(shard: int | None = None) -> None:
        await memo.controller.lead(shard)
        if shard in (None, 0):
            await memo.gateways.lead()

    async def follow(shard: int | None = None) -> None:
        await memo.controller.follow(shard)
        if shard in (None, 0):
            await memo.gateways.follow()
    # the Lease on a client of its own: renewals must not queue behind a takeover's lists and applies
    memo.lease_kube = Kube()
    if shards > 1:
        memo.elector = ShardElection(memo.lease_kube, lease, shards, lead, follow)
    else:
        memo.elector = Elector(memo.lease_kube, lease, lead, follow)
    memo.elector_task = asyncio.create_task(memo.elector.run(), name="leader-election")


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_) -> None:
    if memo.get("elector_task"):
        memo.elector_task.cancel()
        await asyncio.gather(memo.elector_task, return_exceptions=True)
    if memo.get("gateways"):
        await memo.gateways.stop()
    if memo.get("controller"):
        await memo.controller.stop()
    if memo.get("elector"):
        await memo.elector.release()   # after the passes stopped: the next leader starts from status
    if memo.get("metrics_runner"):
        await memo.metrics_runner.cleanup()
    if memo.get("agents"):
        await memo.agents.close()
    if memo.get("kube"):
        await memo.kube.close()
    if memo.get("lease_kube"):
        await memo.lease_kube.close()
    log.info("pd-operator stopped")


@kopf.on.event(GROUP, VERSION, PLURAL)
async def deployment_event(event, memo: kopf.Memo, **_) -> None:
    c = memo.get("controller")
    if c and event.get("object"):
        c.on_deployment(event.get("type"), event["object"])
    g = memo.get("gateways")
    if g and event.get("object"):
        g.on_deployment(event.get("type"), event["object"])


@kopf.on.event(GROUP, VERSION, "pdgateways")
async def gateway_event(event, memo: kopf.Memo, **_) -> None:
    g = memo.get("gateways")
    if g and event.get("object"):
        g.on_gateway(event.get("type"), event["object"])


@kopf.on.event("", "v1", "pods", labels={LABEL_DEPLOYMENT: kopf.PRESENT})
async def pod_event(event, memo: kopf.Memo, **_) -> None:
    c = memo.get("controller")
    if c and event.get("object"):
        c.on_pod(event.get("type"), event["object"])


def _child_handler(group: str, version: str, plural: str) -> None:
    @kopf.on.event(group, version, plural, labels={LABEL_DEPLOYMENT: kopf.PRESENT})
    async def child_event(event, memo: kopf.Memo, **_) -> None:
        c = memo.get("controller")
        if c and event.get("object"):
            c.on_child(event.get("type"), event["object"])


for _g, _v, _p in WATCHED_CHILDREN:
    _child_handler(_g, _v, _p)
