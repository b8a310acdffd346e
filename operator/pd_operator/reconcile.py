"""The one reconcile per PDDeployment: observe → decide → record → act.

- observe: the resource, its children and pods (watch caches, checked against a fresh list
  now and then so an object deleted while a watch was away leaves no ghost), and what each
  agent reports about its engine, frozen into a Snapshot;
- decide (decide.py, pure): the Snapshot -> a Plan: the desired children and which to apply,
  the link plan, the verification round, switch steps, the status, Events, the memory to keep;
- record: the status, written once per pass and before the pass acts, so whatever it is
  about to do is recorded first; then the decided memory is kept;
- act: server-side apply under one field manager, link, unlink, verify, switch intents,
  Events. A pass that acted wakes the next one at once; its results are observed there.

Kopf is only the event source (handlers.py): every watch event lands in a cache here and
wakes the deployment's worker. Errors go through `error_policy`: terminal ones (a spec
that does not parse, an apply the API server rejects) become a condition and are not
retried hot; transient ones back off."""
from __future__ import annotations

import asyncio
import logging
import os
import zlib
from dataclasses import replace
from typing import Callable

from pd_contract.names import LABEL_KEYS

from . import act, kinds, observe, policies
from . import children as ch
from . import links as lk
from . import switch as sw_
from . import tokens as tk
from .agentclient import AgentClient
from .api import GROUP, KIND, VERSION, PDDeploymentSpec, parse_spec
from .builders import LABEL_DEPLOYMENT
from .conditions import iso, set_condition
from .config import OperatorConfig
from .decide import Plan, Snapshot, decide
from .diagnosis import Diagnosis
from .events import Events
from .kube import Kube, KubeError
from .members import Problem, claimed_owner, foreign, member_of, own_statefulsets, pod_ready
from .metrics import OperatorMetrics
from .objmeta import owner_reference
from .observe import ask_always, to_ask
from .runtime import SYSTEM_CLOCK, Clock, Runtime
from .state import Memory

log = logging.getLogger("pd_operator.reconcile")
Key = tuple[str, str]
RESYNC_S = 5.0            # a Ready deployment is looked at again after this, events or not
NOT_READY_RESYNC_S = 1.0
# caches are checked against a fresh list this often
RELIST_S = float(os.environ.get("PD_OPERATOR_RELIST_SECONDS", "30"))
HOLDING_RECHECK_S = 0.5   # a leaving prefill is unlinked as soon as nothing waits on it
TOKEN_TTL_S = 20.0
STRAY_RELIST_S = 5.0      # a pod claiming a StatefulSet not in the cache makes a fresh list this often
ACTED_DELAY_S = 0.05      # the next pass after one that acted
SWITCH_POLL_S = 0.1       # while a switch waits on something observed (a drain)


class TerminalError(Exception):
    """Retrying at once will not help: wait for the spec to change, or `retry_s` (what another
    party may fix, such as a quota or a webhook that refused an object)."""

    def __init__(self, reason: str, message: str, retry_s: float | None = None):
        super().__init__(message)
        self.diagnosis = Diagnosis(reason, message)
        self.retry_s = retry_s


def error_policy(error: Exception, attempts: int) -> float | None:
    """Seconds until the next pass after a failed one; None: wait for a change."""
    if isinstance(error, TerminalError):
        return error.retry_s
    return min(30.0, 0.5 * 2 ** (attempts - 1))


def apply_retry_s(attempts: int) -> float:
    """An apply the API server refused is tried again after this (5 s doubling to 5 min)."""
    return min(300.0, 5.0 * 2 ** (attempts - 1))


def resync_s(key: Key) -> float:
    """RESYNC_S less up to 20%, fixed per deployment: deployments that settled together (an
    operator start, a takeover) do not resync together forever after."""
    return RESYNC_S * (0.8 + 0.2 * (zlib.crc32(f"{key[0]}/{key[1]}".encode()) % 1000) / 1000)


def spec_changes(old: dict | None, new: dict, prefix: str = "spec") -> list[str]:
    """Leaf fields that differ, as `path: old -> new`, for the Updated Event."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return [] if old == new else [f"{prefix}: {old!r} -> {new!r}"]
    out = []
    for k in sorted(set(old) | set(new)):
        out += spec_changes(old.get(k), new.get(k), f"{prefix}.{k}")
    return out


class Controller:
    def __init__(self, kube: Kube, agents: AgentClient, metrics: OperatorMetrics | None = None,
                 after_record: Callable[[list[sw_.Switch]], None] | None = None, npu_resource: str | None = None,
                 config: OperatorConfig | None = None, clock: Clock = SYSTEM_CLOCK):
        self.kube = kube
        self.clock = clock
        # what the cluster admin allows (chart values): NPU resource, host paths, gateway image
        self.config = config or OperatorConfig.from_env()
        if npu_resource:
            self.config = replace(self.config, npu_resource=npu_resource)
        self.npu_resource = self.config.npu_resource
        self.agents = agents
        self.metrics = metrics or agents.metrics
        self.events = Events(kube, clock)
        self.deployments: dict[Key, dict] = {}
        self.pods: dict[Key, dict[str, tuple[dict, float]]] = {}        # -> name -> (object, cached at)
        self.children: dict[Key, dict[ch.ChildKey, tuple[dict, float]]] = {}
        self.relisted_at: dict[Key, float] = {}
        self.ready_since: dict[Key, dict[str, float]] = {}   # pod -> when its watch event said Ready
        self.memory: dict[Key, Memory] = {}
        self.dirty: dict[Key, set[str]] = {}   # pods whose object changed since their agent was asked
        # set while this process may act: always without leader election, only while it holds
        # the Lease with it (a standby keeps its caches warm and runs no pass)
        self.leading = asyncio.Event()
        self.leading.set()
        self.runtime = Runtime("pdd", self._pass, self._failed, self.leading,
                               timed=self.metrics.reconcile_seconds.observe, clock=clock)
        self.after_record = after_record   # called with the switches each recorded status holds

    @property
    def stopping(self) -> bool:
        return self.runtime.stopping

    @stopping.setter
    def stopping(self, value: bool) -> None:
        self.runtime.stopping = value

    # ---- fed by Kopf's watch events ------------------------------------------------------
    def on_deployment(self, etype: str | None, body: dict) -> None:
        key = (body["metadata"]["namespace"], body["metadata"]["name"])
        if etype == "DELETED" or body["metadata"].get("deletionTimestamp"):
            self.deployments.pop(key, None)
            self.runtime.forget(key)
            self.memory.pop(key, None)
            self.dirty.pop(key, None)
            self.ready_since.pop(key, None)
            self.metrics.forget(*key)
            return
        before = self.deployments.get(key)
        self.deployments[key] = body
        self.runtime.ensure(key)
        # Our own status writes come back as events; only a spec change needs a pass.
        if before is None or before["metadata"].get("generation") != body["metadata"].get("generation"):
            self.poke(key)

    def on_pod(self, etype: str | None, body: dict) -> None:
        meta = body["metadata"]
        key = (meta["namespace"], meta.get("labels", {}).get(LABEL_DEPLOYMENT, ""))
        cache = self.pods.setdefault(key, {})
        was_ready = meta["name"] in cache and pod_ready(cache[meta["name"]][0])
        self._cache(cache, meta["name"], etype, body)
        if etype != "DELETED" and pod_ready(body) and not was_ready:
            self.ready_since.setdefault(key, {})[meta["name"]] = self.clock.monotonic()
        self.dirty.setdefault(key, set()).add(meta["name"])
        self.poke(key)

    def on_child(self, etype: str | None, body: dict) -> None:
        meta = body["metadata"]
        key = (meta["namespace"], meta.get("labels", {}).get(LABEL_DEPLOYMENT, ""))
        self._cache(self.children.setdefault(key, {}), (body.get("kind", ""), meta["name"]), etype, body)
        self.poke(key)

    def _cache(self, cache: dict, name, etype: str | None, body: dict) -> None:
        if etype == "DELETED":
            cache.pop(name, None)
        else:
            cache[name] = (body, self.clock.monotonic())

    def poke(self, key: Key) -> None:
        self.runtime.poke(key)

    async def lead(self) -> None:
        """This process became the leader: start from what the API server says, as a fresh
        process would (switches in flight come back from status)."""
        self.memory.clear()
        self.relisted_at.clear()
        self.leading.set()
        self.runtime.poke_all()

    async def follow(self) -> None:
        """Leadership lost: stop acting now (passes in flight are cancelled; what they recorded
        is in status for the next leader) and wait to lead again."""
        self.leading.clear()
        await self.runtime.restart()

    async def stop(self) -> None:
        await self.runtime.stop()

    # ---- a pass, and a pass that failed (the runtime's calls) ------------------------------
    async def _pass(self, key: Key) -> float | None:
        delay = await self.reconcile(key)
        self.memory.setdefault(key, Memory()).errors = 0   # (the pass may have kept a new memory)
        self.metrics.reconciles.labels("requeue" if delay == ACTED_DELAY_S else "ok").inc()
        return delay

    async def _failed(self, key: Key, e: Exception) -> float | None:
        mem = self.memory.setdefault(key, Memory())
        if isinstance(e, TerminalError):
            log.warning("%s/%s: %s", key[0], key[1], e)
            self.metrics.reconciles.labels("terminal").inc()
            await self._record_terminal(key, mem, e.diagnosis)
            return error_policy(e, 1)
        mem.errors += 1
        self.relisted_at.pop(key, None)  # the API server may have been away: list again first
        delay = error_policy(e, mem.errors)
        (log.warning if isinstance(e, KubeError) else log.exception)(
            "%s/%s: pass failed (%s), again in %.1fs", key[0], key[1], e, delay)
        self.metrics.reconciles.labels("transient").inc()
        return delay

    # ---- observe: the caches and the token ---------------------------------------------------------
    def _own_statefulsets(self, key: Key, uid: str) -> set[str]:
        return own_statefulsets((o for o, _ in self.children.get(key, {}).values()), key[1], uid)

    async def _relist(self, key: Key) -> None:
        """Check the caches against a fresh list: a watch that reconnects lists again but sends
        no DELETED for objects removed while it was away."""
        ns, name = key
        t0 = self.clock.monotonic()
        selector = f"{LABEL_DEPLOYMENT}={name}"
        pods = {p["metadata"]["name"]: p for p in await self.kube.list("v1", "Pod", ns, selector)}
        kids = {}
        for k in kinds.CHILDREN:
            for obj in await self.kube.list(k.api_version, k.kind, ns, selector):
                obj.setdefault("kind", k.kind)
                kids[(k.kind, obj["metadata"]["name"])] = obj
        for cache, fresh in ((self.pods.setdefault(key, {}), pods), (self.children.setdefault(key, {}), kids)):
            for k, (_, cached_at) in list(cache.items()):
                if k not in fresh and cached_at < t0:
                    log.info("%s/%s: %s is gone (not in a fresh list)", ns, name, k)
                    del cache[k]
            for k, obj in fresh.items():
                if k not in cache or cache[k][1] < t0:
                    cache[k] = (obj, t0)
        self.relisted_at[key] = t0

    async def _token(self, key: Key, mem: Memory, uid: str, status: dict | None) -> str | None:
        """The control token, from the Secret the operator made (tokens.judge: its digest is in
        status). Re-read now and then: a Secret deleted to rotate it must show up (a new one is made;
        the running pods answer AgentUnauthorized until they restart with it), and RBAC allows `get`
        on the Secret, not a watch."""
        if (mem.token or mem.token_problem) and not mem.token_create \
                and self.clock.monotonic() - mem.token_read_at < TOKEN_TTL_S:
            return mem.token
        ns, name = key
        found = {role: await self.kube.get("v1", "Secret", ns, secret_name(name))
                 for role, secret_name in tk.SECRETS.items()}
        # what this operator wrote last is newer than the cached object's status
        v = tk.judge(name, ns, uid, found, mem.last_status or status, mem.token_create)
        if v.foreign and mem.last_status is None:
            # no write of its own yet (a restart, a takeover): the cache may trail the status the
            # operator wrote before; a Secret is called foreign only against the status as stored
            fresh = await self.kube.get(f"{GROUP}/{VERSION}", KIND, ns, name)
            if fresh is not None:
                v = tk.judge(name, ns, uid, found, fresh.get("status"), mem.token_create)
        mem.token, mem.token_problem, mem.token_digests = v.token, v.problem, v.digests
        mem.token_create = v.create
        mem.token_read_at = self.clock.monotonic()
        return mem.token

    async def _keys_secret(self, key: Key, mem: Memory, spec: PDDeploymentSpec) -> tuple[bool, str, str] | None:
        """Whether the gateway may be given its keys Secret: only one that opted in with the label
        pdoperator.io/keys: "true". Re-read every pass until it is allowed, then now and then."""
        gw = spec.gateway
        if gw is None or not gw.enabled or not gw.api_keys_secret:
            mem.keys_verdict = None
            return None
        v = mem.keys_verdict
        if v is not None and v[0] and self.clock.monotonic() - mem.keys_read_at < TOKEN_TTL_S:
            return v
        sec = await self.kube.get("v1", "Secret", key[0], gw.api_keys_secret)
        n = gw.api_keys_secret
        if sec is None:
            v = (False, "KeysSecretNotFound", f"Secret {n} (spec.gateway.apiKeysSecret) does not exist in {key[0]}; "
                                              f"the gateway runs once it exists with the label {LABEL_KEYS}=true")
        elif (sec["metadata"].get("labels") or {}).get(LABEL_KEYS) != "true":
            v = (False, "KeysSecretNotOptedIn", f"Secret {n} (spec.gateway.apiKeysSecret) does not carry the label "
                                                f"{LABEL_KEYS}: \"true\", so the gateway is not given it (no gateway "
                                                f"pod runs); `kubectl label secret {n} {LABEL_KEYS}=true` opts it in")
        else:
            v = (True, "KeysSecretOptedIn", f"Secret {n} opted in as the gateway's API keys")
        mem.keys_verdict, mem.keys_read_at = v, self.clock.monotonic()
        return v

    # ---- the pass ------------------------------------------------------------------------------
    async def reconcile(self, key: Key) -> float | None:
        """One pass: observe -> decide (pure) -> record -> act. Returns when to look again."""
        body = self.deployments.get(key)
        if body is None:
            return None
        snap = await self.observe(key, body)
        plan = decide(snap)
        await self.record(snap, plan)
        acted = await self.act(snap, plan)
        log.debug("%s/%s pass: asked %d in %.0f ms, %s, %d link plans, %d verify pairs, %d to apply%s", *key,
                  len(snap.reports), (self.clock.monotonic() - snap.now) * 1000, plan.status["phase"], len(plan.links),
                  len(plan.verify), len(plan.to_apply), ", acted" if acted else "")
        return self.requeue(snap, plan, acted)

    # ---- observe ---------------------------------------------------------------------------
    async def observe(self, key: Key, body: dict) -> Snapshot:
        """The Snapshot decide works from. What it writes to memory is bookkeeping of its own
        calls (the agents' backoff, the token it read), never a decision."""
        ns, name = key
        mem = self.memory.setdefault(key, Memory())
        now, wall = self.clock.monotonic(), self.clock.time()
        try:
            spec = parse_spec(body["spec"])
        except ValueError as e:
            raise TerminalError("InvalidSpec", f"spec is invalid (admission should have refused it): {e}") from e
        if now - self.relisted_at.get(key, 0.0) > RELIST_S:
            await self._relist(key)
        uid = body["metadata"].get("uid", "")
        own = self._own_statefulsets(key, uid)
        cached = [o for o, _ in self.pods.get(key, {}).values()]
        if any(claimed_owner(p) not in own | {None} for p in cached) \
                and now - self.relisted_at.get(key, 0.0) > STRAY_RELIST_S:
            # a StatefulSet's watch event may trail its pods': look before calling a pod foreign
            await self._relist(key)
            own = self._own_statefulsets(key, uid)
            cached = [o for o, _ in self.pods.get(key, {}).values()]
        strays = [pr for p in cached if (pr := foreign(p, own))]
        all_pods = [p for p in cached if claimed_owner(p) in own]
        stray_pods = tuple(p for p in cached if claimed_owner(p) not in own)
        members = [member_of(p, spec) for p in all_pods]
        problems = tuple(strays) + tuple(m for m in members if isinstance(m, Problem))
        engines = [m for m in members if not isinstance(m, Problem)]
        token = await self._token(key, mem, uid, body.get("status"))
        keys = await self._keys_secret(key, mem, spec)
        book = mem.book or sw_.Book.from_status(body.get("status"))
        reports: dict = {}
        ask: set[str] = set()
        if token:
            dirty = self.dirty.setdefault(key, set())
            ask = to_ask(mem, engines, now, dirty, ask_always(spec, book, engines, wall))
            dirty -= ask   # (given back if this pass's record fails: its reports are then lost)
            reports = await observe.gather(engines, self.agents, token, mem.agent_backoff, now, mem.limiter,
                                           only=ask)
            if any(r.error is not None and r.error.kind == "AgentUnauthorized" for r in reports.values()):
                mem.token_read_at = 0.0  # the Secret may have been rotated: read it again next pass
        stats, read = None, False
        rbs = spec.rebalance
        if rbs is not None and rbs.policy == "SLO" and spec.gateway and spec.gateway.enabled \
                and wall >= book.next_evaluation:
            stats, read = await self._gateway_stats(ns, name), True
        alive = {e.pod: e for e in engines}
        mem.agent_backoff.prune(lambda k: k[0] in alive and k == observe.backoff_key(alive[k[0]]))
        return Snapshot(key=key, body=body, spec=spec, now=now, wall=wall, pods=tuple(all_pods),
                        children={k: o for k, (o, _) in self.children.get(key, {}).items()},
                        engines=tuple(engines), problems=problems, token=token, reports=reports,
                        gateway_stats=stats, gateway_read=read, asked=frozenset(ask), memory=mem,
                        npu_resource=self.npu_resource, config=self.config, token_problem=mem.token_problem,
                        token_digests=tuple(sorted(mem.token_digests.items())),
                        keys=keys, strays=stray_pods)

    async def _gateway_stats(self, ns: str, name: str) -> tuple[dict, float] | None:
        """The gateway's recent client-side TTFT/TBT percentiles (what the SLO policy reads where
        a gateway is deployed); None if no gateway pod answers."""
        from .gateway import GATEWAY_METRICS_PORT, LABEL_GATEWAY
        try:
            pods = await self.kube.list("v1", "Pod", ns, f"{LABEL_GATEWAY}={name}")
        except KubeError:
            return None
        for p in pods:
            ip = (p.get("status") or {}).get("podIP")
            if ip and pod_ready(p) and not p["metadata"].get("deletionTimestamp"):
                stats = await self.agents.gateway_stats(f"http://{ip}:{GATEWAY_METRICS_PORT}")
                if stats is not None:
                    return stats, self.clock.monotonic()
        return None

    # ---- record ------------------------------------------------------------------------------
    async def record(self, snap: Snapshot, plan: Plan) -> None:
        """The status first; once it is written, the decided memory is the memory."""
        key = snap.key
        mem = plan.memory
        if plan.status != mem.last_status:
            try:
                await self._write_status(key, plan.status)
            except Exception:
                # the decided memory (with this pass's reports) is dropped: ask those agents again
                self.dirty.setdefault(key, set()).update(snap.asked)
                raise
            mem.last_status = plan.status
        self.memory[key] = mem
        for policy, reason in plan.decisions:
            self.metrics.decisions.labels(policy, reason).inc()
        if self.after_record is not None:
            self.after_record(plan.book.switches)
        since = self.ready_since.get(key, {})
        live = [p for p in snap.pods if not p["metadata"].get("deletionTimestamp")]
        self._observe_phase(key, mem, plan.status,
                            max((since.get(p["metadata"]["name"], snap.now) for p in live), default=snap.now))

    # ---- act ---------------------------------------------------------------------------------
    async def act(self, snap: Snapshot, plan: Plan) -> bool:
        """Carry out the plan; results land in memory for the next pass. True if it acted."""
        (ns, name), body, spec, token = snap.key, snap.body, snap.spec, snap.token
        mem = self.memory[snap.key]
        dirty = self.dirty.setdefault(snap.key, set())
        for ev in plan.events:
            await self.events.post(body, ev.type, ev.reason, ev.message, key=ev.key)
        for o in plan.outcomes:
            await self._switch_ended(body, o)
        acted = False
        if plan.clear_abort:
            # only if it still names that pod: an abort of another pod asked for meanwhile stays
            key = "/metadata/annotations/" + sw_.ANNOTATION_ABORT.replace("~", "~0").replace("/", "~1")
            asked = (body["metadata"].get("annotations") or {}).get(sw_.ANNOTATION_ABORT)
            try:
                await self.kube.patch(f"{GROUP}/{VERSION}", KIND, ns, name, [
                    {"op": "test", "path": key, "value": asked}, {"op": "remove", "path": key}], json_patch=True)
            except KubeError as e:   # changed meanwhile (422), or not allowed: the next pass looks again
                log.info("%s/%s: the %s annotation not removed: %s", ns, name, sw_.ANNOTATION_ABORT, e)
        if plan.switch_intents and token:
            by_pod = {e.pod: e for e in plan.engines}
            grouped: dict[str, list[sw_.Intent]] = {}
            for it in plan.switch_intents:
                grouped.setdefault(it.pod, []).append(it)
            await asyncio.gather(*(act.switch_intents(self.kube, self.agents, mem, ns, its, by_pod, plan.reported,
                                                      plan.switch_probes, token, self.clock)
                                   for its in grouped.values()))
            dirty.update(grouped)
            acted = True
        if mem.token_create and not snap.token_problem:   # their digests are in the status just written
            await act.create_tokens(self.kube, mem, name, ns, owner_reference(name, body["metadata"]["uid"]),
                                    self.clock)
            acted = True
        if plan.to_apply:
            await self._apply(body, spec, mem, snap.generation, plan.to_apply, created=not snap.children,
                              everything=len(plan.to_apply) == len(plan.desired),
                              keys_ok=snap.keys is None or bool(snap.keys[0]))
            acted = True
        pairs = plan.verify
        if plan.links and token:
            dirty.update(p.decoder.pod for p in plan.links)  # ask them again next pass
            await asyncio.gather(*(act.execute(body, self.agents, self.events, self.metrics, mem, p, token,
                                               spec.datadist.link_timeout_ms, self.clock) for p in plan.links))
            acted = True
            if plan.verify_after_links is not None and not mem.failures and not pairs:
                mem.verified_links = plan.verify_after_links
                pairs = lk.verify_pairs(plan.engines, mem.verify_round)
        if pairs and token:
            await act.verify(body, self.agents, self.events, mem, pairs, token, self.clock)
            mem.verify_round += 1
            interval = spec.datadist.verify_interval_seconds
            mem.next_verify = snap.now + (interval if all(r["ok"] for r in mem.verify.values()) else min(interval, 5))
            acted = True
        return acted

    def requeue(self, snap: Snapshot, plan: Plan, acted: bool) -> float:
        """Seconds until the next pass, events aside."""
        mem, spec = self.memory[snap.key], snap.spec
        if acted:
            return ACTED_DELAY_S
        if plan.book.switches:
            return SWITCH_POLL_S
        fire = policies.next_fire(spec, self.clock.time()) if spec.rebalance is not None else None
        if fire is not None and fire < RESYNC_S:
            return fire + 0.01   # a schedule entry fires then: be there
        if lk.holding_links(plan.engines, plan.reported):
            return HOLDING_RECHECK_S
        if plan.status["phase"] != "Ready":
            retry = mem.next_retry_in(self.clock.monotonic())
            return min(NOT_READY_RESYNC_S, retry) if retry is not None else NOT_READY_RESYNC_S
        return min(resync_s(snap.key), max(0.5, mem.next_verify - self.clock.monotonic()))

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

    async def _apply(self, body: dict, spec: PDDeploymentSpec, mem: Memory, gen: int, objs: list[dict],
                     created: bool, everything: bool, keys_ok: bool = True) -> None:
        # drift: what the operator wanted did not change, the object did (a role count moving a
        # disruption budget, or a Replace resizing a group, is the operator's own change)
        drifted = [o for o in objs if (a := mem.applied.get(ch.child_key(o))) is not None and a[0] == ch.digest(o)]
        try:
            await act.apply_children(self.kube, self.metrics, mem, objs)
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
        if mem.blocked is not None and mem.blocked.reason == "ApplyRejected":
            mem.blocked, mem.blocked_attempts, mem.blocked_retry_at = None, 0, None   # taken this time
        name = body["metadata"]["name"]
        keys_flipped = mem.applied_keys is not None and mem.applied_keys != keys_ok
        mem.applied_keys = keys_ok
        if keys_flipped:
            secret = spec.gateway.api_keys_secret if spec.gateway else ""
            await self.events.post(body, "Normal", "GatewayKeys", f"Secret {secret} opted in: the gateway is given "
                                   f"it" if keys_ok else f"Secret {secret} no longer opts in: the gateway's access "
                                   f"to it is revoked and its pods stopped")
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

    async def _record_terminal(self, key: Key, mem: Memory, diag: Diagnosis) -> None:
        body = self.deployments.get(key)
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

