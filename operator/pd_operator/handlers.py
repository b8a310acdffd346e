"""Kopf is the event source, nothing more: every watch event on a PDDeployment, its pods or
its children (StatefulSets, Services, ConfigMaps, the gateway's objects, the NetworkPolicy)
lands in the controller's caches and wakes
that deployment's one reconcile (reconcile.py). No handler applies anything, so there is
one reconciler, and no finalizer: owner references clean up after a deleted PDDeployment."""
from __future__ import annotations

import logging

import kopf

from . import faultpoint, kinds
from .agentclient import AgentClient
from .api import GROUP, PLURAL, VERSION
from .builders import LABEL_DEPLOYMENT
from .kube import Kube
from .metrics import OperatorMetrics, serve
from .reconcile import Controller

log = logging.getLogger("pd_operator")
STATE: dict = {}
WATCHED_CHILDREN = tuple((k.group, k.version, k.plural) for k in kinds.CHILDREN)


def _controller() -> Controller | None:
    return STATE.get("controller")


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, **_) -> None:
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 10
    settings.networking.request_timeout = 60
    settings.peering.standalone = True
    # Watch only what carries the deployment label, filtered by the API server.
    settings.watching.label_selectors["pods"] = LABEL_DEPLOYMENT
    for group, _, plural in WATCHED_CHILDREN:
        settings.watching.label_selectors[f"{group}/{plural}" if group else plural] = LABEL_DEPLOYMENT
    metrics = OperatorMetrics()
    kube = Kube()
    agents = AgentClient(metrics)
    controller = Controller(kube, agents, metrics, after_record=faultpoint.from_env())
    STATE.update(kube=kube, agents=agents, metrics=metrics, controller=controller,
                 metrics_runner=await serve(metrics))
    log.info("pd-operator started")


@kopf.on.cleanup()
async def cleanup(**_) -> None:
    c = _controller()
    if c:
        await c.stop()
    if STATE.get("metrics_runner"):
        await STATE["metrics_runner"].cleanup()
    if STATE.get("agents"):
        await STATE["agents"].close()
    if STATE.get("kube"):
        await STATE["kube"].close()
    log.info("pd-operator stopped")


@kopf.on.event(GROUP, VERSION, PLURAL)
async def deployment_event(event, **_) -> None:
    c = _controller()
    if c and event.get("object"):
        c.on_deployment(event.get("type"), event["object"])


@kopf.on.event("", "v1", "pods", labels={LABEL_DEPLOYMENT: kopf.PRESENT})
async def pod_event(event, **_) -> None:
    c = _controller()
    if c and event.get("object"):
        c.on_pod(event.get("type"), event["object"])


def _child_handler(group: str, version: str, plural: str) -> None:
    @kopf.on.event(group, version, plural, labels={LABEL_DEPLOYMENT: kopf.PRESENT})
    async def child_event(event, **_) -> None:
        c = _controller()
        if c and event.get("object"):
            c.on_child(event.get("type"), event["object"])


for _g, _v, _p in WATCHED_CHILDREN:
    _child_handler(_g, _v, _p)
