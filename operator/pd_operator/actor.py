"""record and act, the PDDeployment pass's writes: the status first, once per pass and before
acting (whatever the pass is about to do is recorded first), then the plan carried out: Events,
the ends of switches, server-side apply under one field manager, links, unlinks, verifications
and switch intents (act.py). What they did comes back as Results, folded into the memory the
next pass decides from (results.fold), also when acting stops half way on an API error."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from . import act
from . import children as ch
from . import links as lk
from . import switch as sw_
from .agentclient import AgentClient
from .api import GROUP, KIND, VERSION, PDDeploymentSpec
from .caches import Caches
from .conditions import iso, set_condition
from .decide import Plan, Snapshot
from .diagnosis import Diagnosis
from .errors import TerminalError, apply_retry_s
from .events import Events
from .kube import Kube, KubeError
from .metrics import OperatorMetrics
from .objmeta import owner_reference
from .results import Results, fold, fold_seen
from .runtime import Clock, Limiters
from .state import RETRIED, Memory

log = logging.getLogger("pd_operator.actor")
Key = tuple[str, str]


def spec_changes(old: Any, new: Any, prefix: str = "spec") -> list[str]:
    """Leaf fields that differ, as `path: old -> new`, for the Updated Event."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return [] if old == new else [f"{prefix}: {old!r} -> {new!r}"]
    out = []
    for k in sorted(set(old) | set(new)):
        out += spec_changes(old.get(k), new.get(k), f"{prefix}.{k}")
    return out


class Actor:
    def __init__(self, kube: Kube, agents: AgentClient, events: Events, metrics: OperatorMetrics, caches: Caches,
                 memory: dict[Key, Memory], clock: Clock, limiters: Limiters,
                 after_record: Callable[[list[sw_.Switch]], None] | None = None):
        self.kube, self.agents, self.events, self.metrics = kube, agents, events, metrics
        self.caches, self.memory, self.clock, self.after_record = caches, memory, clock, after_record
        self.limiters = limiters

    # ---- record ------------------------------------------------------------------------------
    async def record(self, snap: Snapshot, plan: Plan) -> None:
        """The status first; once it is written, the decided memory is the memory."""
        key, mem = snap.key, plan.memory
        # after a start or a takeover nothing is remembered as written: the status as stored
        # (the warm cache) stands for it, so a fleet taken over is not rewritten to the same
        written = mem.last_status if mem.last_status is not None else snap.body.get("status")
        if plan.status != written:
            try:
                await self._write_status(key, plan.status)
            except Exception:
                # the decided memory (with this pass's reports) is dropped: ask those agents again
                self.caches.dirty.setdefault(key, set()).update(snap.asked)
                raise
            mem.last_status = plan.status
        self.memory[key] = mem
        for policy, reason in plan.decisions:
            self.metrics.decisions.labels(policy, reason).inc()
        if self.after_record is not None:
            self.after_record(plan.book.switches)
        since = self.caches.ready_since.get(key, {})
        live = [p for p in snap.pods if not p["metadata"].get("deletionTimestamp")]
        self._observe_phase(key, mem, plan.status,
                            max((since.get(p["metadata"]["name"], snap.now) for p in live), default=snap.now))

    # ---- act ---------------------------------------------------------------------------------
    async def act(self, snap: Snapshot, plan: Plan) -> bool:
        """Carry out the plan; what it did is folded into the memory. True if it acted."""
        mem, seen = self.memory[snap.key], self.caches.seen_of(snap.key)   # (a takeover replaces both)
        res = Results()
        try:
            return await self._act(snap, plan, mem, res)
        finally:
            fold(mem, res, self.clock.monotonic())
            fold_seen(seen, res, self.clock.monotonic())

    async def _act(self, snap: Snapshot, plan: Plan, mem: Memory, res: Results) -> bool:
        (ns, name), body, spec, token = snap.key, snap.body, snap.spec, snap.token
        limiter = self.limiters(snap.key)
        dirty = self.caches.dirty.setdefault(snap.key, set())
        for ev in plan.events:
            await self.events.post(body, ev.type, ev.reason, ev.message, key=ev.key)
        for o in plan.outcomes:
            await self._switch_ended(body, o)
        acted = False
        if plan.clear_abort:
            await self._clear_abort(ns, name, body)
        if plan.switch_intents and token:
            by_pod = {e.pod: e for e in plan.engines}
            grouped: dict[str, list[sw_.Intent]] = {}
            for it in plan.switch_intents:
                grouped.setdefault(it.pod, []).append(it)
            await asyncio.gather(*(act.switch_intents(self.kube, self.agents, mem, limiter, res, ns, its, by_pod,
                                                      plan.reported, plan.switch_probes, token, self.clock)
                                   for its in grouped.values()))
            dirty.update(grouped)
            acted = True
        seen = self.caches.seen_of(snap.key)
        if seen.token_create and not snap.token_problem:   # their digests are in the status just written
            await act.create_tokens(self.kube, seen, name, ns, owner_reference(name, body["metadata"]["uid"]), res)
            acted = True
        if plan.to_apply:
            await self._apply(body, spec, mem, res, snap.generation, plan.to_apply, created=not snap.children,
                              everything=len(plan.to_apply) == len(plan.desired),
                              keys_ok=snap.keys is None or bool(snap.keys[0]), observed=frozenset(snap.children))
            acted = True
        acted = await act.pools_and_gangs(self.kube, self.agents, ns, plan, token, limiter, res) or acted
        pairs = plan.verify
        if plan.links and token:
            dirty.update(p.decoder.pod for p in plan.links)  # ask them again next pass
            for attempts in await asyncio.gather(*(
                    act.execute(body, self.agents, self.events, self.metrics, limiter, p, token,
                                spec.datadist.link_timeout_ms) for p in plan.links)):
                res.links += attempts
            acted = True
            if plan.verify_after_links is not None and not res.links_failing(mem.failures) and not pairs:
                res.verified_links = plan.verify_after_links
                pairs = lk.verify_pairs(plan.engines, mem.verify_round)
        if pairs and token:
            await act.verify(body, self.agents, self.events, mem, limiter, pairs, token, res, self.clock.time())
            interval = spec.datadist.verify_interval_seconds
            res.next_verify = snap.now + (interval if all(r["ok"] for r in {**mem.verify, **{
                r["decoder"]: r for r in res.verified}}.values()) else min(interval, 5))
            acted = True
        return acted

    async def _clear_abort(self, ns: str, name: str, body: dict) -> None:
        """The switch-abort annotation goes, only if it still names that pod: an abort of another
        pod asked for meanwhile stays."""
        key = "/metadata/annotations/" + sw_.ANNOTATION_ABORT.replace("~", "~0").replace("/", "~1")
        asked = (body["metadata"].get("annotations") or {}).get(sw_.ANNOTATION_ABORT)
        try:
            await self.kube.patch(f"{GROUP}/{VERSION}", KIND, ns, name, [
                {"op": "test", "path": key, "value": asked}, {"op": "remove", "path": key}], json_patch=True)
        except KubeError as e:   # changed meanwhile (422), or not allowed: the next pass looks again
            log.info("%s/%s: the %s annotation not removed: %s", ns, name, sw_.ANNOTATION_ABORT, e)

    async def _switch_ended(self, body: dict, o: sw_.Outcome) -> None:
        s = o.switch
        self.metrics.switches.labels(s.direction, o.result).inc()
        rec = o.record()
        if o.result == "Completed":
            for part, ms in (("drain", rec.get("drainMs")), ("switch", rec.get("switchMs")),
                             ("relink", rec.get("relinkMs")), ("total", rec["totalMs"]),
                             ("control", rec["totalMs"] - rec.get("drainMs", 0))):
                if ms is not None:
                    self.metrics.switch_seconds.labels(s.direction, part).observe(ms / 1000)
            await self.events.post(body, "Normal", "Switched",
                                   f"{s.pod}: {s.from_} -> {s.to} in {rec['totalMs']} ms (drain {rec.get('drainMs')} "
                                   f"ms, unlink and switch_role {rec['switchMs']} ms, relink and verify "
                                   f"{rec['relinkMs']} ms); {s.reason}", key=f"switched {s.pod} {s.started}")
        elif o.result == "Aborted" and s.message.startswith((sw_.RETARGETED, sw_.PAUSED)):
            # the policy changed its mind, or rebalancing was paused, while this pod drained: nothing went wrong
            await self.events.post(body, "Normal", "SwitchWithdrawn", f"{s.pod}: {s.from_} -> {s.to} withdrawn: "
                                   f"{o.message}", key=f"withdrawn {s.pod} {s.started}")
        else:
            await self.events.post(body, "Warning", f"Switch{o.result}", f"{s.pod}: {s.from_} -> {s.to} "
                                   f"{o.result.lower()}: {o.message}", key=f"{o.result} {s.pod} {s.started}")

    async def _apply(self, body: dict, spec: PDDeploymentSpec, mem: Memory, res: Results, gen: int,
                     objs: list[dict], created: bool, everything: bool, keys_ok: bool = True,
                     observed: frozenset = frozenset()) -> None:
        # drift: what the operator wanted did not change, the object did (a role count moving a
        # disruption budget, or a Replace resizing a group, is the operator's own change)
        drifted = [o for o in objs if (a := mem.applied.get(ch.child_key(o))) is not None and a[0] == ch.digest(o)]
        try:
            await act.apply_children(self.kube, self.metrics, objs, res, observed, body["metadata"]["uid"])
        except act.NameTaken as e:
            # renaming or removing the other object is not a spec change: looked at again when due
            mem.blocked_attempts = mem.blocked_attempts + 1 if mem.blocked_generation == gen else 1
            delay = apply_retry_s(mem.blocked_attempts)
            mem.blocked_retry_at = self.clock.monotonic() + delay
            msg = (f"{e}: applying this deployment's object of that name would take it from its owner; rename one "
                   f"of them (nothing of this generation is applied; looked at again in {delay:.0f}s)")
            mem.blocked, mem.blocked_generation = Diagnosis("NameTaken", msg), gen
            await self.events.post(body, "Warning", "NameTaken", str(e))
            raise TerminalError("NameTaken", msg, retry_s=delay) from e
        except KubeError as e:
            if 400 <= e.status < 500 and e.status not in (409, 429):
                # a quota, a webhook or a policy may be fixed without a spec change: tried again
                mem.blocked_attempts = mem.blocked_attempts + 1 if mem.blocked_generation == gen else 1
                delay = apply_retry_s(mem.blocked_attempts)
                mem.blocked_retry_at = self.clock.monotonic() + delay
                msg = (f"the API server rejected an owned object: {e}; tried again in {delay:.0f}s (at "
                       f"{sw_.iso(self.clock.time() + delay)[:19]}Z, attempt {mem.blocked_attempts + 1}), or at once "
                       f"when the spec changes")
                mem.blocked, mem.blocked_generation = Diagnosis("ApplyRejected", msg), gen
                await self.events.post(body, "Warning", "ApplyRejected", str(e))
                raise TerminalError("ApplyRejected", msg, retry_s=delay) from e
            raise
        if mem.blocked is not None and mem.blocked.reason in RETRIED:
            mem.blocked, mem.blocked_attempts, mem.blocked_retry_at = None, 0, None   # taken this time
        name = body["metadata"]["name"]
        keys_flipped = mem.applied_keys is not None and mem.applied_keys != keys_ok
        mem.applied_keys = keys_ok
        if keys_flipped:
            secret = spec.gateway.api_keys_secret if spec.gateway else ""
            await self.events.post(body, "Normal", "GatewayKeys", f"Secret {secret} opted in: the gateway is given "
                                   f"it" if keys_ok else f"Secret {secret} no longer opts in: the gateway's access "
                                   f"to it is revoked and its pods stopped")
        elif mem.applied_event_generation is None and not created and \
                (body.get("status") or {}).get("observedGeneration") == gen:
            mem.applied_event_generation = gen   # a start or a takeover applying what was applied: no news
        elif mem.applied_event_generation != gen:
            mem.applied_event_generation = gen
            sizes = spec.group_sizes(mem.book.sizes if mem.book else None)
            what = (f"StatefulSets {name}-prefill ({sizes['prefill']}) and {name}-decoder "
                    f"({sizes['decoder']}), Services and ConfigMap")
            if created:
                await self.events.post(body, "Normal", "Created", f"created {what}")
            else:
                changes = spec_changes(mem.applied_spec, body["spec"]) if mem.applied_spec else []
                await self.events.post(body, "Normal", "Updated", f"generation {gen}: "
                                       + ("; ".join(changes)[:700] if changes else f"applied {what}"))
        elif drifted and not everything:  # (everything: the first pass after a restart)
            await self.events.post(body, "Normal", "DriftRepaired", "re-applied " + ", ".join(
                f"{o['kind']} {o['metadata']['name']}" for o in drifted) + " (changed or deleted outside the "
                "operator)", key="drift " + ", ".join(sorted(o["metadata"]["name"] for o in drifted)))
        mem.applied_spec = body["spec"]

    async def record_terminal(self, key: Key, mem: Memory, diag: Diagnosis) -> None:
        body = self.caches.deployments.get(key)
        if body is None:
            return
        gen = body["metadata"].get("generation", 0)
        mem.blocked, mem.blocked_generation = diag, gen
        # what this operator wrote last is newer than the cache (a whole-status write from a stale
        # cache would drop status.tokenDigests written a moment ago)
        prev = mem.last_status or body.get("status") or {}
        conds = set_condition(prev.get("conditions"), "Ready", False, diag.reason, diag.message, gen,
                              at=iso(self.clock.time()))
        status = {**{k: v for k, v in prev.items() if k != "conditions"}, "conditions": conds, "phase": "Degraded"}
        if status != mem.last_status:
            await self._write_status(key, status)
            mem.last_status = status
        await self.events.post(body, "Warning", diag.reason, diag.message)

    def _observe_phase(self, key: Key, mem: Memory, status: dict, last_pod_ready: float) -> None:
        """Phase gauge, and the time from the last pod's Ready (as its watch event arrived)
        to the deployment's Ready."""
        self.metrics.set_phase(key[0], key[1], status["phase"])
        self.metrics.observe_status(key[0], key[1], status)
        pods_ready = next((c["status"] == "True" for c in status["conditions"] if c["type"] == "PodsReady"), False)
        if not pods_ready:
            mem.pods_ready_at, mem.was_ready = None, False
        elif mem.pods_ready_at is None:
            mem.pods_ready_at = last_pod_ready
        if status["phase"] == "Ready" and not mem.was_ready and mem.pods_ready_at is not None:
            mem.was_ready = True
            self.metrics.ready_seconds.observe(self.clock.monotonic() - mem.pods_ready_at)

    async def _write_status(self, key: Key, status: dict) -> None:
        obj = {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
               "metadata": {"name": key[1], "namespace": key[0]}, "status": status}
        try:
            await self.kube.apply(obj, subresource="status")
        except KubeError as e:
            if e.status != 404:
                raise
