"""Kopf handlers: thin I/O around the pure builders and the controller loop.

- on create/update/resume: server-side apply the children (one field manager) and post
  an Event describing what changed;
- on every PDDeployment or pod event: feed the controller's cache and wake its worker;
- startup/cleanup: settings, the controller task, graceful shutdown."""
from __future__ import annotations

import logging
import secrets

import kopf

from .agentclient import AgentClient
from .api import GROUP, PLURAL, VERSION, parse_spec
from .builders import LABEL_DEPLOYMENT, desired_children, owner_reference, token_secret
from .controller import Controller
from .events import Events
from .kube import Kube, KubeError

log = logging.getLogger("pd_operator")
STATE: dict = {}


def _controller() -> Controller | None:
    return STATE.get("controller")


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, **_) -> None:
    # Progress and diff-base live in annotations: the structural status schema would prune
    # status.kopf silently.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="pdoperator.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="pdoperator.io", key="last-handled-configuration")
    settings.persistence.finalizer = "pdoperator.io/finalizer"
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 10
    settings.networking.request_timeout = 60
    settings.peering.standalone = True
    # Watch only engine pods, filtered by the API server rather than in the operator.
    settings.watching.label_selectors["pods"] = LABEL_DEPLOYMENT
    kube = Kube()
    agents = AgentClient()
    STATE.update(kube=kube, agents=agents, events=Events(kube), controller=Controller(kube, agents))
    log.info("pd-operator started")


@kopf.on.cleanup()
async def cleanup(**_) -> None:
    c = _controller()
    if c:
        await c.stop()
    if STATE.get("agents"):
        await STATE["agents"].close()
    if STATE.get("kube"):
        await STATE["kube"].close()
    log.info("pd-operator stopped")


def _describe(diff) -> str:
    parts = []
    for op, path, old, new in diff or []:
        field = ".".join(str(p) for p in path)
        if field.startswith("metadata"):
            continue
        parts.append(f"{field}: {old!r} -> {new!r}" if op == "change" else f"{op} {field}")
    return "; ".join(parts)[:900]


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
async def apply_children(body, spec, name, namespace, uid, reason, diff, **_) -> None:
    kube: Kube = STATE["kube"]
    events: Events = STATE["events"]
    try:
        parsed = parse_spec(dict(spec))
    except ValueError as e:  # admission validation should have caught it
        await events.post(dict(body), "Warning", "InvalidSpec", str(e))
        raise kopf.PermanentError(f"invalid spec: {e}")
    owner = owner_reference(name, uid)
    try:
        await kube.create(token_secret(name, namespace, secrets.token_urlsafe(32), owner))
        for obj in desired_children(name, namespace, uid, parsed):
            await kube.apply(obj)
    except KubeError as e:
        await events.post(dict(body), "Warning", "ApplyFailed", str(e))
        if 400 <= e.status < 500 and e.status not in (409, 429):
            raise kopf.PermanentError(str(e))
        raise kopf.TemporaryError(str(e), delay=5)
    if reason == "create":
        await events.post(dict(body), "Normal", "Created",
                          f"created StatefulSets {name}-prefill ({parsed.prefill.replicas}) and "
                          f"{name}-decoder ({parsed.decoder.replicas}), Services and ConfigMap")
    elif reason == "update":
        await events.post(dict(body), "Normal", "Updated", _describe(diff) or "spec applied")
    c = _controller()
    if c:
        c.poke((namespace, name))


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
