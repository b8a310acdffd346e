"""The one reconcile per PDDeployment: observe → decide → record → act.

- observe: the resource, its children and pods (watch caches, checked against a fresh list
  now and then so an object deleted while a watch was away leaves no ghost), and what each
  agent reports about its engine;
- decide (pure): the desired children (builders), which of them to apply (children), the
  link plan (links), the verification round, the status (status);
- record: status, written once per pass and before the pass acts, so whatever it is about
  to do is recorded first;
- act: server-side apply under one field manager, link, unlink, verify, Events. A pass
  that acted wakes the next one at once; its results are observed there.

Kopf is only the event source (handlers.py): every watch event lands in a cache here and
wakes the deployment's worker. Errors go through `error_policy`: terminal ones (a spec
that does not parse, an apply the API server rejects) become a condition and are not
retried hot; transient ones back off."""
from __future__ import annotations

import asyncio
import base64
import logging
import os
import time
from dataclasses import replace
from typing import Callable

from . import act, kinds, observe, policies
from . import children as ch
from . import links as lk
from . import rebalance as rb
from . import replace as rp
from . import switch as sw_
from .agentclient import AgentClient
from .api import GROUP, KIND, VERSION, PDDeploymentSpec, parse_spec
from .builders import LABEL_DEPLOYMENT, desired_children, token_secret_name
from .conditions import set_condition
from .diagnosis import Diagnosis
from .events import Events
from .kube import Kube, KubeError
from .members import Problem, member_of, pod_ready, with_report
from .metrics import OperatorMetrics
from .objmeta import owner_reference
from .state import Memory
from .status import Observed, build_status

log = logging.getLogger("pd_operator.reconcile")
Key = tuple[str, str]
RESYNC_S = 5.0            # a Ready deployment is looked at again after this, events or not
NOT_READY_RESYNC_S = 1.0
# caches are checked against a fresh list this often
RELIST_S = float(os.environ.get("PD_OPERATOR_RELIST_SECONDS", "30"))
HOLDING_RECHECK_S = 0.5   # a leaving prefill is unlinked as soon as nothing waits on it
TOKEN_TTL_S = 20.0
SETTLED_POLL_S = 5.0      # a member that is linked and well is asked this often
ACTED_DELAY_S = 0.05      # the next pass after one that acted
SWITCH_POLL_S = 0.1       # while a switch waits on something observed (a drain)


class TerminalError(Exception):
    """Retrying will not help until the spec changes."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.diagnosis = Diagnosis(reason, message)


def error_policy(error: Exception, attempts: int) -> float | None:
    """Seconds until the next pass after a failed one; None: wait for a change."""
    if isinstance(error, TerminalError):
        return None
    return min(30.0, 0.5 * 2 ** (attempts - 1))


def spec_changes(old: dict | None, new: dict, prefix: str = "spec") -> list[str]:
    """Leaf fields that differ, as `path: old -> new`, for the Updated Event."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return [] if old == new else [f"{prefix}: {old!r} -> {new!r}"]
    out = []
    for k in sorted(set(old) | set(new)):
        out += spec_changes(old.get(k), new.get(k), f"{prefix}.{k}")
    return out


def verify_due(engines: list[lk.Engine], reported: dict[str, list[dict]], per: dict[str, tuple[int, int, list]],
               mem: Memory, now: float, interval_s: float) -> list[tuple[lk.Engine, lk.Engine]]:
    """Verify when every desired link is up and either the link set changed or the interval passed."""
    expected, up = lk.totals(per)
    if not expected or up != expected:
        return []
    link_set = frozenset((d, l["cluster_id"]) for d, ls in reported.items() for l in ls)
    if link_set == mem.verified_links and now < mem.next_verify:
        return []
    mem.verified_links = link_set
    return lk.verify_pairs(engines, mem.verify_round)


class Controller:
    def __init__(self, kube: Kube, agents: AgentClient, metrics: OperatorMetrics | None = None,
                 after_record: Callable[[list[sw_.Switch]], None] | None = None):
        self.kube = kube
        self.agents = agents
        self.metrics = metrics or agents.metrics
        self.events = Events(kube)
        self.deployments: dict[Key, dict] = {}
        self.pods: dict[Key, dict[str, tuple[dict, float]]] = {}        # -> name -> (object, cached at)
        self.children: dict[Key, dict[ch.ChildKey, tuple[dict, float]]] = {}
        self.relisted_at: dict[Key, float] = {}
        self.ready_since: dict[Key, dict[str, float]] = {}   # pod -> when its watch event said Ready
        self.memory: dict[Key, Memory] = {}
        self.wake: dict[Key, asyncio.Event] = {}
        self.tasks: dict[Key, asyncio.Task] = {}
        self.stopping = False
        self.after_record = after_record   # called with the switches each recorded status holds

    # ---- fed by Kopf's watch events ------------------------------------------------------
    def on_deployment(self, etype: str | None, body: dict) -> None:
        key = (body["metadata"]["namespace"], body["metadata"]["name"])
        if etype == "DELETED" or body["metadata"].get("deletionTimestamp"):
            self.deployments.pop(key, None)
            task = self.tasks.pop(key, None)
            if task:
                task.cancel()
            self.memory.pop(key, None)
            self.ready_since.pop(key, None)
            self.metrics.forget(*key)
            return
        before = self.deployments.get(key)
        self.deployments[key] = body
        if key not in self.tasks and not self.stopping:
            self.wake[key] = asyncio.Event()
            self.tasks[key] = asyncio.create_task(self._worker(key), name=f"pdd/{key[0]}/{key[1]}")
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
            self.ready_since.setdefault(key, {})[meta["name"]] = time.monotonic()
        mem = self.memory.get(key)
        if mem is not None:
            mem.dirty.add(meta["name"])
        self.poke(key)

    def on_child(self, etype: str | None, body: dict) -> None:
        meta = body["metadata"]
        key = (meta["namespace"], meta.get("labels", {}).get(LABEL_DEPLOYMENT, ""))
        self._cache(self.children.setdefault(key, {}), (body.get("kind", ""), meta["name"]), etype, body)
        self.poke(key)

    @staticmethod
    def _cache(cache: dict, name, etype: str | None, body: dict) -> None:
        if etype == "DELETED":
            cache.pop(name, None)
        else:
            cache[name] = (body, time.monotonic())

    def poke(self, key: Key) -> None:
        ev = self.wake.get(key)
        if ev:
            ev.set()

    async def stop(self) -> None:
        self.stopping = True
        for t in self.tasks.values():
            t.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    # ---- the worker ----------------------------------------------------------------------
    async def _worker(self, key: Key) -> None:
        while not self.stopping:
            self.wake[key].clear()
            t0 = time.perf_counter()
            mem = self.memory.setdefault(key, Memory())
            try:
                delay = await self.reconcile(key)
                mem.errors = 0
                self.metrics.reconciles.labels("requeue" if delay == ACTED_DELAY_S else "ok").inc()
            except asyncio.CancelledError:
                raise
            except TerminalError as e:
                log.warning("%s/%s: %s", key[0], key[1], e)
                self.metrics.reconciles.labels("terminal").inc()
                await self._record_terminal(key, mem, e.diagnosis)
                delay = error_policy(e, 1)
            except Exception as e:  # noqa: BLE001 - never let one deployment stop the operator
                mem.errors += 1
                self.relisted_at.pop(key, None)  # the API server may have been away: list again first
                delay = error_policy(e, mem.errors)
                (log.warning if isinstance(e, KubeError) else log.exception)(
                    "%s/%s: pass failed (%s), again in %.1fs", key[0], key[1], e, delay)
                self.metrics.reconciles.labels("transient").inc()
            self.metrics.reconcile_seconds.observe(time.perf_counter() - t0)
            try:
                await asyncio.wait_for(self.wake[key].wait(), delay)
                await asyncio.sleep(0.02)  # coalesce bursts of watch events
            except asyncio.TimeoutError:
                pass

    # ---- observe ---------------------------------------------------------------------------
    async def _relist(self, key: Key) -> None:
        """Check the caches against a fresh list: a watch that reconnects lists again but sends
        no DELETED for objects removed while it was away."""
        ns, name = key
        t0 = time.monotonic()
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

    async def _token(self, key: Key, mem: Memory) -> str | None:
        # Re-read now and then: a rotated Secret must show up (as AgentUnauthorized until
        # the pods restart with it), and RBAC allows `get` on the Secret, not a watch.
        if mem.token and time.monotonic() - mem.token_read_at < TOKEN_TTL_S:
            return mem.token
        sec = await self.kube.get("v1", "Secret", key[0], token_secret_name(key[1]))
        mem.token = base64.b64decode(sec["data"]["token"]).decode() if sec and sec.get("data", {}).get("token") \
            else None
        mem.token_read_at = time.monotonic()
        return mem.token

    async def _take_reports(self, body: dict, mem: Memory, engines: list[lk.Engine],
                            reports: dict[str, observe.Report], obs: Observed) -> list[lk.Engine]:
        """Merge this pass's reports (and the last good ones of members not asked) into the engines."""
        out = []
        for e in engines:
            rep = reports.get(e.pod)
            if rep is not None and rep.error is not None:
                mem.reports.pop(e.pod, None)
                if e.ready and not e.terminating:  # a pod that is not Ready, or leaving, may well not answer
                    mem.agent_errors[e.pod] = (rep.error.kind, str(rep.error))
                else:
                    mem.agent_errors.pop(e.pod, None)
            elif rep is not None:
                s = rep.status
                mem.agent_errors.pop(e.pod, None)
                prev = mem.boot_ids.get(e.pod)
                if prev and prev != s.boot_id:
                    await self.events.post(body, "Normal", "AgentRestarted",
                                           f"{e.pod} restarted (boot id {s.boot_id[:8]}); relinking",
                                           key=f"{e.pod} restarted")
                mem.boot_ids[e.pod] = s.boot_id
                mem.reports[e.pod] = s
                mem.reported_at[e.pod] = time.monotonic()
                if s.proxy_env and f"{e.pod}/{s.boot_id}" not in mem.proxy_warned:
                    mem.proxy_warned.add(f"{e.pod}/{s.boot_id}")
                    await self.events.post(body, "Warning", "ProxyEnvironment",
                                           f"{e.pod} has {', '.join(sorted(s.proxy_env))} set; datadist links "
                                           f"can be rerouted. Unset them or list peers in no_proxy")
            if e.pod in mem.agent_errors and e.ready and not e.terminating:
                obs.agent_errors[e.pod] = mem.agent_errors[e.pod]
            s = mem.reports.get(e.pod)
            if s is not None:
                e = with_report(e, s)
                obs.boot_ids[e.pod] = s.boot_id
                if s.role == "decoder":
                    obs.reported[e.pod] = [link.model_dump() for link in s.links]
                if s.proxy_env:
                    obs.proxy[e.pod] = s.proxy_env
            out.append(e)
        return out

    @staticmethod
    def _ask_always(spec: PDDeploymentSpec, book: sw_.Book, engines: list[lk.Engine]) -> set[str]:
        """Switching pods every pass; everyone when a Load or SLO evaluation is due, so it
        decides on fresh signals rather than on reports up to SETTLED_POLL_S old."""
        pods = {s.pod for s in book.switches}
        rb_ = spec.rebalance
        if rb_ is not None and rb_.policy in ("Load", "SLO") and time.time() >= book.next_evaluation:
            pods |= {e.pod for e in engines}
        return pods

    @staticmethod
    def _to_ask(mem: Memory, engines: list[lk.Engine], now: float, always: set[str] = frozenset()) -> set[str]:
        """Members to ask this pass: any whose pod changed, that is not settled (not linked yet,
        leaving, never asked), or whose settled interval is over. A large deployment coming up
        then costs a call per changing member, not one per member on every pass."""
        ask = {e.pod for e in engines if e.pod in mem.dirty or e.leaving or e.pod not in mem.reports
               or e.pod in always or now >= mem.next_poll.get(e.pod, 0.0)}
        mem.dirty -= ask
        return ask

    # ---- the pass ------------------------------------------------------------------------------
    async def reconcile(self, key: Key) -> float | None:
        body = self.deployments.get(key)
        if body is None:
            return None
        ns, name = key
        mem = self.memory.setdefault(key, Memory())
        meta = body["metadata"]
        gen = meta.get("generation", 0)
        now = time.monotonic()
        try:
            spec = parse_spec(body["spec"])
        except ValueError as e:
            raise TerminalError("InvalidSpec", f"spec is invalid (admission should have refused it): {e}") from e

        # observe
        if now - self.relisted_at.get(key, 0.0) > RELIST_S:
            await self._relist(key)
        all_pods = [o for o, _ in self.pods.get(key, {}).values()]
        live = [p for p in all_pods if not p["metadata"].get("deletionTimestamp")]
        observed_children = {k: o for k, (o, _) in self.children.get(key, {}).items()}
        members = [member_of(p, spec) for p in all_pods]
        problems = [m for m in members if isinstance(m, Problem)]
        engines = [m for m in members if not isinstance(m, Problem)]
        token = await self._token(key, mem)
        if mem.book is None:  # after a restart: the switches in flight, as recorded before their steps
            mem.book = sw_.Book.from_status(body.get("status"))
        book = mem.book
        obs = Observed(generation=gen, pods=live, engines=engines, problems=problems, model_id=spec.model.model_id,
                       topology=spec.datadist.topology, selector=f"{LABEL_DEPLOYMENT}={name}")
        if token:
            reports = await observe.gather(engines, self.agents, token, mem.agent_backoff, now, mem.limiter,
                                           only=self._to_ask(mem, engines, now, self._ask_always(spec, book, engines)))
            if any(r.error is not None and r.error.kind == "AgentUnauthorized" for r in reports.values()):
                mem.token_read_at = 0.0  # the Secret may have been rotated: read it again next pass
        else:
            reports = {}
        obs.engines = engines = await self._take_reports(body, mem, engines, reports, obs)
        if spec.rebalance is not None and spec.rebalance.policy == "SLO" and spec.gateway and spec.gateway.enabled \
                and time.time() >= book.next_evaluation:
            mem.gateway_stats = await self._gateway_stats(ns, name)
        alive = {e.pod: e for e in engines}
        mem.agent_backoff.prune(lambda k: k[0] in alive and k == observe.backoff_key(alive[k[0]]))
        for pod in [p for p in set(mem.reports) | set(mem.next_poll) if p not in alive]:
            mem.reports.pop(pod, None)
            mem.reported_at.pop(pod, None)
            mem.next_poll.pop(pod, None)
            mem.agent_errors.pop(pod, None)

        # rebalance: switches in flight advance on what this pass observed; maybe one starts
        wall = time.time()
        steps = [(s.pod, s.step) for s in book.switches]
        mesh, want_map, per = self._mesh(engines, book, obs, spec)
        switch_intents, started, outcomes = self._advance_switches(spec, mem, book, all_pods, engines, obs, reports,
                                                                   wall, mesh, want_map, per)
        # the link planner sees switching pods by their engine's role and step: the mesh is
        # worked out again only if a switch moved (most passes have none)
        if [(s.pod, s.step) for s in book.switches] != steps:
            mesh, want_map, per = self._mesh(engines, book, obs, spec)
        engines = mesh
        obs.per_decoder = per
        obs.switches, obs.last_switch, obs.last_decision = list(book.switches), book.last, book.decision
        obs.cooldown_until = sw_.iso(book.cooldown_until) if book.cooldown_until else None
        obs.group_sizes = book.sizes if spec.rebalance is not None and spec.rebalance.method == "Replace" else None
        for e in engines:
            if e.pod in reports and reports[e.pod].error is None:
                settled = e.agent_ok and not e.leaving and (e.pod not in per or per[e.pod][0] == per[e.pod][1])
                mem.next_poll[e.pod] = now + SETTLED_POLL_S if settled else 0.0

        # decide
        blocked = mem.blocked if mem.blocked_generation == gen else None
        desired = desired_children(name, ns, meta["uid"], spec, book.sizes)
        obs.desired_pods = sum(spec.group_sizes(book.sizes).values())
        to_apply = [] if blocked else ch.to_apply(desired, observed_children, mem.applied)
        plans = lk.plan(engines, obs.reported, spec.datadist.topology, due=mem.due) if token else []
        want = {(d, e.cluster_id) for d, es in want_map.items() for e in es}
        # failures are reported for wanted links only; backoff also covers links still to unlink
        reported_keys = {(d, link["cluster_id"]) for d, ls in obs.reported.items() for link in ls}
        for k in [k for k in mem.failures if k not in want]:
            mem.failures.pop(k)
        mem.link_backoff.prune(lambda k: k in want or k in reported_keys)
        obs.link_failures = dict(mem.failures)
        pairs = verify_due(engines, obs.reported, per, mem, now, spec.datadist.verify_interval_seconds) \
            if token else []
        # linking that completes the mesh is followed by verification in the same pass
        complete_after = lk.completes(engines, obs.reported, plans, spec.datadist.topology) if plans else None
        if not want:
            mem.verify.clear()
        obs.verify = {d: r for d, r in mem.verify.items() if d in alive}
        obs.verified_at = mem.verified_at
        obs.blocked = blocked
        # observedGeneration moves only once the children of this generation were applied
        obs.observed_generation = gen if not to_apply and not blocked else \
            (body.get("status") or {}).get("observedGeneration")
        status = build_status(spec, obs, body.get("status"))

        # record
        if status != mem.last_status:
            await self._write_status(key, status)
            mem.last_status = status
        if self.after_record is not None:
            self.after_record(book.switches)
        since = self.ready_since.get(key, {})
        self._observe_phase(key, mem, status, max((since.get(p["metadata"]["name"], now) for p in live), default=now))

        log.debug("%s/%s pass: asked %d in %.0f ms, %s, %d link plans, %d verify pairs, %d to apply", ns, name,
                  len(reports), (time.monotonic() - now) * 1000, status["phase"], len(plans), len(pairs),
                  len(to_apply))
        # act
        mismatched = lk.mismatches(engines)
        if mismatched:
            pods = sorted({e.pod for pair in mismatched for e in pair})
            await self.events.post(body, "Warning", "CacheDescMismatch", ", ".join(pods) + " run different "
                                   "CacheDescs; pairs across them are not linked", key=",".join(pods))
        acted = False
        if mem.decision_event:
            await self.events.post(body, "Normal", "RebalanceDecision", mem.decision_event)
            mem.decision_event = None
        for s in started:
            await self.events.post(body, "Normal", "SwitchStarted", f"{s.pod}: {s.from_} -> {s.to} ({s.reason})",
                                   key=f"start {s.pod} {s.started}")
        for o in outcomes:
            await self._switch_ended(body, o)
        if switch_intents and token:
            by_pod = {e.pod: e for e in engines}
            probes = {s.pod: [(by_pod[d], by_pod[p]) for d, p in rb.switch_pairs(s, engines, want_map)
                              if d in by_pod and p in by_pod] for s in book.switches if s.step == "Verify"}
            grouped: dict[str, list[sw_.Intent]] = {}
            for it in switch_intents:
                grouped.setdefault(it.pod, []).append(it)
            await asyncio.gather(*(act.switch_intents(self.kube, self.agents, mem, ns, its, by_pod, obs.reported,
                                                      probes, token) for its in grouped.values()))
            mem.dirty.update(grouped)
            acted = True
        if token is None or not mem.tokens_ensured:
            await act.ensure_token(self.kube, name, ns, owner_reference(name, meta["uid"]))
            mem.tokens_ensured = True
            acted = acted or token is None
        if to_apply:
            await self._apply(body, spec, mem, gen, to_apply, created=not observed_children,
                              everything=len(to_apply) == len(desired))
            acted = True
        if plans:
            mem.dirty.update(p.decoder.pod for p in plans)  # ask them again next pass
            await asyncio.gather(*(act.execute(body, self.agents, self.events, self.metrics, mem, p, token,
                                               spec.datadist.link_timeout_ms) for p in plans))
            acted = True
            if complete_after is not None and not mem.failures and not pairs:
                mem.verified_links = complete_after
                pairs = lk.verify_pairs(engines, mem.verify_round)
        if pairs:
            await act.verify(body, self.agents, self.events, mem, pairs, token)
            mem.verify_round += 1
            interval = spec.datadist.verify_interval_seconds
            mem.next_verify = now + (interval if all(r["ok"] for r in mem.verify.values()) else min(interval, 5))
            acted = True
        if acted:
            log.debug("%s/%s acted in %.0f ms", ns, name, (time.monotonic() - now) * 1000)
            return ACTED_DELAY_S
        if book.switches:
            return SWITCH_POLL_S
        fire = policies.next_fire(spec, time.time()) if spec.rebalance is not None else None
        if fire is not None and fire < RESYNC_S:
            return fire + 0.01   # a schedule entry fires then: be there
        if lk.holding_links(engines, obs.reported):
            return HOLDING_RECHECK_S
        if status["phase"] != "Ready":
            retry = mem.next_retry_in()
            return min(NOT_READY_RESYNC_S, retry) if retry is not None else NOT_READY_RESYNC_S
        return min(RESYNC_S, max(0.5, mem.next_verify - time.monotonic()))

    @staticmethod
    def _mesh(engines: list[lk.Engine], book: sw_.Book, obs: Observed, spec: PDDeploymentSpec
              ) -> tuple[list[lk.Engine], dict, dict]:
        """The engines as the link planner sees them, the desired links and per-decoder counts."""
        mesh = rb.mesh(engines, book.switches)
        topo = spec.datadist.topology
        return mesh, lk.desired(mesh, topo), lk.per_decoder(mesh, obs.reported, topo)

    def _advance_switches(self, spec: PDDeploymentSpec, mem: Memory, book: sw_.Book, pods: list[dict],
                          engines: list[lk.Engine], obs: Observed, reports: dict, wall: float,
                          mesh: list[lk.Engine], want: dict, per: dict
                          ) -> tuple[list[sw_.Intent], list[sw_.Switch], list[sw_.Outcome]]:
        """Decide (pure calls): advance each switch in flight, start one if the policy wants a
        different prefill count, and repair pods whose label disagrees with their engine."""
        pods_by_name = {p["metadata"]["name"]: p for p in pods}
        by_pod = {e.pod: e for e in engines}

        def view(s: sw_.Switch) -> sw_.View:
            e = by_pod.get(s.pod)
            asked = s.pod in reports and reports[s.pod].error is None
            verified = mem.switch_verified.get((s.pod, e.boot_id or ""), set()) if e else set()
            return rb.view(s, pods_by_name.get(s.pod), e, mesh, obs.reported, want, per, verified,
                           mem.switch_refused.get(s.pod), asked)

        intents: list[sw_.Intent] = []
        started: list[sw_.Switch] = []
        outcomes: list[sw_.Outcome] = []
        kept: list[sw_.Switch] = []
        timeout = rb.drain_timeout(spec)
        for s in book.switches:
            if s.step != sw_.ABORT:
                s = replace(s, attempts=mem.switch_fails.get(s.pod, 0), message=mem.switch_errors.get(s.pod, ""))
            new, its, out = sw_.advance(s, view(s), wall, timeout)
            if out is not None:
                outcomes.append(out)
                for d in (mem.switch_errors, mem.switch_fails, mem.switch_refused if out.result == "Interrupted"
                          else {}):
                    d.pop(s.pod, None)
                mem.switch_verified = {k: v for k, v in mem.switch_verified.items() if k[0] != s.pod}
                book.last = out.record()
                book.cooldown_until = wall + (spec.rebalance.cooldown_seconds if spec.rebalance else 0)
            else:
                kept.append(new)
                intents += its
        book.switches = kept
        obs.decision = None
        if spec.rebalance is not None:
            cands = rb.candidates(engines, kept, set(mem.switch_refused))
            current = sw_.prefill_count(cands)
            sig = rb.signals(mesh, mem.reports, mem.reported_at, time.monotonic(), mem.gateway_stats) \
                if spec.rebalance.policy in ("Load", "SLO") else policies.Signals()
            verdict, changed = rb.decide_target(spec, book, sig, current, wall)
            if verdict is not None:
                self.metrics.decisions.labels(spec.rebalance.policy, verdict.reason).inc()
                if changed and book.target != current:
                    mem.decision_event = f"{spec.rebalance.policy}: prefill {current} -> {book.target}: " \
                                         f"{verdict.message}"
            last = book.decision or {}
            lim = rb.limits(spec, book.cooldown_until)
            total = spec.total
            target = sw_.clamp_target(book.target, total, lim) if book.target is not None else None
            why = f"{spec.rebalance.policy}: {last.get('message', '')}"
            unsettled = self._unsettled(spec, engines, obs, per, mem, book.sizes)
            if spec.rebalance.method == "Replace":
                sizes = {**spec.group_sizes(book.sizes), **({"growing": book.sizes["growing"]}
                                                            if book.sizes and book.sizes.get("growing") else {})}
                new, decision = rp.plan(sizes, target, lim, wall, unsettled, why)
                if new is not None:
                    if not new.get("growing"):
                        book.cooldown_until = wall + spec.rebalance.cooldown_seconds
                    book.sizes = new
                    mem.decision_event = (mem.decision_event + "; " if mem.decision_event else "") + \
                        f"Replace: prefill {new['prefill']}, decoder {new['decoder']}: {decision.message}"
            else:
                decision = sw_.choose(cands, kept, target, lim, wall, why, unsettled=unsettled)
            decision = rb.condition_for(decision, last.get("reason"), last.get("message"))
            if decision.start is not None:
                s = decision.start
                book.switches = kept = kept + [s]
                intents += sw_.intents(s, view(s))
                started.append(s)
            obs.decision = decision
        intents += rb.repairs(engines, kept)
        return intents, started, outcomes

    async def _gateway_stats(self, ns: str, name: str) -> tuple[dict, float] | None:
        """The gateway's recent client-side TTFT/TBT percentiles (what the SLO policy reads where
        a gateway is deployed); None if no gateway pod answers."""
        from .gateway import GATEWAY_PORT, LABEL_GATEWAY
        try:
            pods = await self.kube.list("v1", "Pod", ns, f"{LABEL_GATEWAY}={name}")
        except KubeError:
            return None
        for p in pods:
            ip = (p.get("status") or {}).get("podIP")
            if ip and pod_ready(p) and not p["metadata"].get("deletionTimestamp"):
                stats = await self.agents.gateway_stats(f"http://{ip}:{GATEWAY_PORT}")
                if stats is not None:
                    return stats, time.monotonic()
        return None

    @staticmethod
    def _unsettled(spec: PDDeploymentSpec, engines: list[lk.Engine], obs: Observed, per: dict, mem: Memory,
                   decided: dict | None = None) -> str | None:
        """Why the fleet is not steady enough to start a switch (None: it is)."""
        want = sum(spec.group_sizes(decided).values())
        if len(obs.pods) != want:
            return f"{len(obs.pods)}/{want} engine pods exist"
        waiting = sorted(p["metadata"]["name"] for p in obs.pods if not pod_ready(p))
        if waiting:
            return f"pods not ready: {', '.join(waiting[:5])}"
        if obs.agent_errors:
            return f"agents not answering: {', '.join(sorted(obs.agent_errors)[:5])}"
        expected, up = lk.totals(per)
        if up < expected or mem.failures:
            return f"links {up}/{expected} up"
        return None

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
        else:
            await self.events.post(body, "Warning", f"Switch{o.result}", f"{s.pod}: {s.from_} -> {s.to} "
                                   f"{o.result.lower()}: {o.message}", key=f"{o.result} {s.pod} {s.started}")

    # ---- act ---------------------------------------------------------------------------------
    async def _apply(self, body: dict, spec: PDDeploymentSpec, mem: Memory, gen: int, objs: list[dict],
                     created: bool, everything: bool) -> None:
        try:
            await act.apply_children(self.kube, self.metrics, mem, objs)
        except KubeError as e:
            if 400 <= e.status < 500 and e.status not in (409, 429):
                mem.blocked = Diagnosis("ApplyRejected", f"the API server rejected an owned object: {e}")
                mem.blocked_generation = gen
                await self.events.post(body, "Warning", "ApplyRejected", str(e))
                raise TerminalError("ApplyRejected", str(e)) from e
            raise
        name = body["metadata"]["name"]
        if mem.applied_event_generation != gen:
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
        elif not everything:  # (everything: the first pass after a restart)
            await self.events.post(body, "Normal", "DriftRepaired", "re-applied " + ", ".join(
                f"{o['kind']} {o['metadata']['name']}" for o in objs) + " (changed or deleted outside the operator)",
                key="drift " + ", ".join(sorted(o["metadata"]["name"] for o in objs)))
        mem.applied_spec = body["spec"]

    async def _record_terminal(self, key: Key, mem: Memory, diag: Diagnosis) -> None:
        body = self.deployments.get(key)
        if body is None:
            return
        gen = body["metadata"].get("generation", 0)
        mem.blocked, mem.blocked_generation = diag, gen
        prev = body.get("status") or {}
        conds = set_condition(prev.get("conditions"), "Ready", False, diag.reason, diag.message, gen)
        status = {**{k: v for k, v in prev.items() if k != "conditions"}, "conditions": conds, "phase": "Degraded"}
        if status != mem.last_status:
            await self._write_status(key, status)
            mem.last_status = status
        await self.events.post(body, "Warning", diag.reason, diag.message)

    def _observe_phase(self, key: Key, mem: Memory, status: dict, last_pod_ready: float) -> None:
        """Phase gauge, and the time from the last pod's Ready (as its watch event arrived)
        to the deployment's Ready."""
        self.metrics.set_phase(key[0], key[1], status["phase"])
        pods_ready = next((c["status"] == "True" for c in status["conditions"] if c["type"] == "PodsReady"), False)
        if not pods_ready:
            mem.pods_ready_at, mem.was_ready = None, False
        elif mem.pods_ready_at is None:
            mem.pods_ready_at = last_pod_ready
        if status["phase"] == "Ready" and not mem.was_ready and mem.pods_ready_at is not None:
            mem.was_ready = True
            self.metrics.ready_seconds.observe(time.monotonic() - mem.pods_ready_at)

    async def _write_status(self, key: Key, status: dict) -> None:
        obj = {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
               "metadata": {"name": key[1], "namespace": key[0]}, "status": status}
        try:
            await self.kube.apply(obj, subresource="status")
        except KubeError as e:
            if e.status != 404:
                raise

