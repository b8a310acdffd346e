"""The one reconcile per PDGateway: observe (the PDGateway, the namespace's PDDeployments, the
keys Secret, the gateway Deployment, all read fresh) → decide (sharedgateway.py, pure) →
record (status) → act (server-side apply of its objects; the usage ConfigMap created once).

A pass runs on any event of the PDGateway or of a PDDeployment of its namespace, and every
RESYNC_S otherwise (the keys Secret's label and the gateway pods' readiness are not watched).
Only the leader acts, as for PDDeployments. What rarely changes is not asked for every pass: a
deployment's data-token Secret once seen is checked again every RECHECK_S (Secrets are read by
name, never listed), and the objects are applied when they change or every RECHECK_S (drift)."""
from __future__ import annotations

import asyncio
import logging

from .api import GROUP, VERSION
from .api import KIND as DEPLOYMENT_KIND
from .api_gateway import KIND, parse_spec
from .children import digest
from .conditions import iso, set_condition
from .config import OperatorConfig
from .errors import error_policy
from .events import Events
from .gateway import data_token_secret_name
from .kube import Kube, KubeError
from .runtime import SYSTEM_CLOCK, Clock, Runtime
from .sharedgateway import (
    Routing,
    current_owners,
    keys_state,
    objects,
    owner_reference,
    routing,
    serving,
    status,
    usage_configmap,
    usage_configmap_name,
)
from .tokens import made_by_operator

log = logging.getLogger("pd_operator.gateways")
Key = tuple[str, str]
RESYNC_S = 5.0
RECHECK_S = 60.0


class GatewayController:
    def __init__(self, kube: Kube, events: Events, config: OperatorConfig, leading: asyncio.Event,
                 clock: Clock = SYSTEM_CLOCK):
        self.kube, self.events, self.config, self.leading, self.clock = kube, events, config, leading, clock
        self.gateways: dict[Key, dict] = {}
        self.attempts: dict[Key, int] = {}   # failed passes in a row
        self.runtime = Runtime("pdgw", self._pass, self._failed, leading, clock=clock)
        self.served: dict[Key, list] = {}   # what each gateway routed at its last pass (for Events)
        self.deployment_seen: dict[Key, tuple] = {}   # PDDeployment -> what a gateway's routing reads of it
        self.token_seen: dict[Key, float] = {}        # PDDeployment -> when its data token was last seen
        self.applied: dict[Key, tuple[str, float]] = {}   # PDGateway -> (digest of its objects, when applied)
        self.unserving: dict[Key, float] = {}   # PDDeployment -> since when it has had no serving pair

    def on_gateway(self, etype: str | None, body: dict) -> None:
        key = (body["metadata"]["namespace"], body["metadata"]["name"])
        if etype == "DELETED" or body["metadata"].get("deletionTimestamp"):
            self.gateways.pop(key, None)
            self.applied.pop(key, None)
            self.attempts.pop(key, None)
            self.runtime.forget(key)
            return
        before = self.gateways.get(key)
        self.gateways[key] = body
        self.runtime.ensure(key)
        if before is None or before["metadata"].get("generation") != body["metadata"].get("generation"):
            self.poke(key)

    def on_deployment(self, etype: str | None, body: dict) -> None:
        """Routing reads a deployment's spec, labels and existence: its status writes (many, during
        switches) do not wake the gateways."""
        meta = body["metadata"]
        dkey = (meta["namespace"], meta["name"])
        labels = tuple(sorted((meta.get("labels") or {}).items()))
        seen = None if etype == "DELETED" else (meta.get("generation"), labels, bool(meta.get("deletionTimestamp")))
        if self.deployment_seen.get(dkey) == seen:
            return
        if seen is None:
            self.deployment_seen.pop(dkey, None)
        else:
            self.deployment_seen[dkey] = seen
        for key in list(self.gateways):
            if key[0] == dkey[0]:
                self.poke(key)

    def poke(self, key: Key) -> None:
        self.runtime.poke(key)

    async def lead(self) -> None:
        self.leading.set()
        self.runtime.poke_all()

    async def follow(self) -> None:
        """Leadership lost: passes in flight are cancelled, as the deployments' are (the event is
        shared with the PDDeployment controller: clearing it twice is harmless)."""
        self.leading.clear()
        await self.runtime.restart()

    async def stop(self) -> None:
        await self.runtime.stop()

    async def _pass(self, key: Key) -> float | None:
        await self.reconcile(key)
        self.attempts.pop(key, None)
        return RESYNC_S

    async def _failed(self, key: Key, e: Exception) -> float | None:
        """Retried with backoff; a terminal error (a rejected apply) waits for a change of the
        PDGateway or of a deployment of its namespace, as a PDDeployment's waits for its spec."""
        n = self.attempts[key] = self.attempts.get(key, 0) + 1
        delay = error_policy(e, n)
        log.error("%s/%s: gateway pass failed (%s), %s", *key, e,
                  f"again in {delay:.1f}s" if delay is not None else "again on the next change")
        return delay

    async def reconcile(self, key: Key) -> None:
        ns, name = key
        gw = await self.kube.get(f"{GROUP}/{VERSION}", KIND, ns, name)
        if gw is None or gw["metadata"].get("deletionTimestamp"):
            return
        try:
            spec = parse_spec(gw.get("spec") or {})
        except ValueError as e:
            await self._degraded(gw, "InvalidSpec", f"the spec does not parse: {str(e).splitlines()[0]}", event=False)
            return
        deployments = await self.kube.list(f"{GROUP}/{VERSION}", DEPLOYMENT_KIND, ns)
        secret = await self.kube.get("v1", "Secret", ns, spec.api_keys_secret)
        keys = keys_state(secret, spec.api_keys_secret)
        r = routing(deployments, spec.selector, await self._with_tokens(ns, deployments),
                    current_owners(gw.get("status")), self._outages(ns, deployments))
        owner = owner_reference(name, gw["metadata"]["uid"])
        image = self.config.gateway_image
        if not image:
            await self._degraded(gw, "NoGatewayImage", "the operator's configuration names no gateway image (chart "
                                 "value gateway.image, env PD_OPERATOR_GATEWAY_IMAGE): a PDGateway cannot run "
                                 "without one")
            return
        objs = objects(name, ns, spec, owner, r, image, keys_allowed=keys[0], config=self.config)
        taken, missing = await self._names(ns, name, owner, objs)
        if taken:
            await self._degraded(gw, "NameTaken", f"{', '.join(taken)} already exist and belong to something else; "
                                 f"rename this PDGateway (a PDDeployment's own gateway is named <deployment>-gateway, "
                                 f"its engines' NetworkPolicy <deployment>-engines)")
            return
        want, now = digest({"items": objs}), self.clock.monotonic()
        last = self.applied.get(key)
        if missing or last is None or last[0] != want or now - last[1] >= RECHECK_S:
            for obj in objs:
                await self.kube.apply(obj)
            self.applied[key] = (want, now)
        dep = await self.kube.get("apps/v1", "Deployment", ns, name)
        st = status(gw, r, keys, dep, iso(self.clock.time()))
        if st != (gw.get("status") or {}):
            await self._write_status(gw, st)
        await self._tell(key, gw, r, keys)

    async def _degraded(self, gw: dict, reason: str, msg: str, event: bool = True) -> None:
        prev = gw.get("status") or {}
        conds = set_condition(prev.get("conditions"), "Ready", False, reason, msg, gw["metadata"].get("generation"),
                              at=iso(self.clock.time()))
        await self._write_status(gw, {**prev, "conditions": conds, "phase": "Degraded"})
        if event:
            await self.events.post(gw, "Warning", reason, msg)

    def _outages(self, ns: str, deployments: list[dict]) -> dict[str, float]:
        """Seconds each deployment has gone without a serving pair, as this operator saw it (a new
        leader starts counting afresh: an owner keeps its model longer, never shorter)."""
        now, out = self.clock.monotonic(), {}
        listed = set()
        for d in deployments:
            k = (ns, d["metadata"]["name"])
            listed.add(k)
            if serving(d):
                self.unserving.pop(k, None)
            else:
                out[k[1]] = now - self.unserving.setdefault(k, now)
        for k in [k for k in self.unserving if k[0] == ns and k not in listed]:
            del self.unserving[k]
        return out

    async def _with_tokens(self, ns: str, deployments: list[dict]) -> set[str]:
        """The deployments routed: those whose data token exists (pods read it at start) and is the
        operator's. A token once seen is read again only after RECHECK_S (Secrets are read by name)."""
        tokens = set()
        now = self.clock.monotonic()
        for d in deployments:
            dname = d["metadata"]["name"]
            seen = self.token_seen.get((ns, dname))
            if seen is not None and now - seen < RECHECK_S:
                tokens.add(dname)
            elif made_by_operator(d, await self.kube.get("v1", "Secret", ns, data_token_secret_name(dname))):
                self.token_seen[(ns, dname)] = now   # read again once RECHECK_S passed
                tokens.add(dname)
            else:
                self.token_seen.pop((ns, dname), None)
        listed = {(ns, d["metadata"]["name"]) for d in deployments}
        for k in [k for k in self.token_seen if k[0] == ns and k not in listed]:
            del self.token_seen[k]   # the deployment is gone
        return tokens

    async def _names(self, ns: str, name: str, owner: dict, objs: list[dict]) -> tuple[list[str], bool]:
        """(names this gateway would take that another owner controls, whether an object is missing),
        over every object it applies and its usage ConfigMap. A deployment's own gateway is
        `<deployment>-gateway` and its engines' policy `<deployment>-engines`: a clash is refused, not
        fought over. The usage ConfigMap is created once, never applied: the replicas own its data."""
        taken, missing = [], False
        for kind, api_version, obj_name in [(o["kind"], o["apiVersion"], o["metadata"]["name"]) for o in objs] + [
                ("ConfigMap", "v1", usage_configmap_name(name))]:
            existing = await self.kube.get(api_version, kind, ns, obj_name)
            if existing is None:
                if kind == "ConfigMap":
                    await self.kube.create(usage_configmap(name, ns, owner))
                else:
                    missing = True
                continue
            ctl = next((o for o in existing["metadata"].get("ownerReferences") or [] if o.get("controller")), None)
            if not ctl or ctl.get("uid") != owner["uid"]:
                taken.append(f"{kind} {obj_name}")
        return taken, missing

    async def _tell(self, key: Key, gw: dict, r: Routing, keys: tuple[bool, str, str]) -> None:
        """Events: what it routes (when that changed), model conflicts, keys not usable."""
        served = [(s.model, s.deployment, tuple(s.aliases)) for s in r.served]
        if served != self.served.get(key):
            self.served[key] = served
            await self.events.post(gw, "Normal", "ModelsServed", "routing " + (", ".join(
                f"{m} -> {d}" + (f" (aliases {', '.join(a)})" if a else "") for m, d, a in served) or "no model"))
        for model, deps in sorted(r.conflicts.items()):
            await self.events.post(gw, "Warning", "ModelConflict",
                                   f"model {model!r} is claimed by {', '.join(deps)}: routed to {deps[0]}, "
                                   f"{', '.join(deps[1:])} left out")
        if not keys[0]:
            await self.events.post(gw, "Warning", keys[1], keys[2])

    async def _write_status(self, gw: dict, st: dict) -> None:
        meta = gw["metadata"]
        obj = {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
               "metadata": {"name": meta["name"], "namespace": meta["namespace"]}, "status": st}
        try:
            await self.kube.apply(obj, subresource="status")
        except KubeError as e:
            if e.status != 404:
                raise
