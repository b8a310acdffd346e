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
from dataclasses import replace
from typing import Callable

from . import links as lk
from . import policies, snapshots
from . import switch as sw_
from .actor import Actor, spec_changes  # noqa: F401 (spec_changes: re-exported)
from .agentclient import AgentClient
from .caches import Caches, lean
from .config import OperatorConfig
from .decide import Plan, Snapshot, decide
from .errors import TerminalError, apply_retry_s, error_policy  # noqa: F401 (re-exported)
from .events import Events
from .kube import Kube, KubeError
from .metrics import OperatorMetrics
from .observer import Observer
from .runtime import SYSTEM_CLOCK, Clock, Limiters, Runtime, spread
from .shards import shard_of
from .state import AGENT_CONCURRENCY, Memory

log = logging.getLogger("pd_operator.reconcile")
Key = tuple[str, str]
RESYNC_S = 5.0            # a Ready deployment is looked at again after this, events or not
NOT_READY_RESYNC_S = 1.0
HOLDING_RECHECK_S = 0.5   # a leaving prefill is unlinked as soon as nothing waits on it
ACTED_DELAY_S = 0.05      # the next pass after one that acted
SWITCH_POLL_S = 0.1       # while a switch waits on something observed (a drain)


def resync_s(key: Key) -> float:
    """RESYNC_S less up to 20%, fixed per deployment: deployments that settled together (an
    operator start, a takeover) do not resync together forever after."""
    return RESYNC_S * (0.8 + 0.2 * spread(key))


class Controller:
    """Wires the pass's parts (caches, observer, actor, the runtime's workers) and runs it."""

    def __init__(self, kube: Kube, agents: AgentClient, metrics: OperatorMetrics | None = None,
                 after_record: Callable[[list[sw_.Switch]], None] | None = None, npu_resource: str | None = None,
                 config: OperatorConfig | None = None, clock: Clock = SYSTEM_CLOCK, workers: bool = True,
                 shards: int = 1):
        # what the cluster admin allows (chart values): NPU resource, host paths, gateway image
        self.config = config or OperatorConfig.from_env()
        if npu_resource:
            self.config = replace(self.config, npu_resource=npu_resource)
        self.kube, self.agents, self.clock = kube, agents, clock
        self.metrics = metrics or agents.metrics
        self.events = Events(kube, clock)
        self.caches = Caches(clock)
        self.deployments, self.dirty = self.caches.deployments, self.caches.dirty
        self.memory: dict[Key, Memory] = {}
        self.limiters = Limiters(AGENT_CONCURRENCY)
        self.record_dir = os.environ.get("PD_OPERATOR_RECORD_DIR", "")
        self.observer = Observer(kube, agents, self.caches, self.memory, self.config, clock, self.limiters)
        self.actor = Actor(kube, agents, self.events, self.metrics, self.caches, self.memory, clock, self.limiters,
                           after_record)
        # set while this process may act: always without leader election, only while it holds
        # the Lease with it (a standby keeps its caches warm and runs no pass)
        self.leading = asyncio.Event()
        self.leading.set()
        # sharded: a deployment's passes run while this replica leads its shard (shards.shard_of)
        self.shards = max(1, shards)
        self.shard_leading = [self.leading] if self.shards == 1 else [asyncio.Event() for _ in range(self.shards)]
        for ev in self.shard_leading:
            ev.set()
        self.runtime = Runtime("pdd", self._pass, self._failed,
                               lambda key: self.shard_leading[shard_of(key, self.shards)],
                               timed=self.metrics.reconcile_seconds.observe, clock=clock, workers=workers)

    # ---- fed by Kopf's watch events ------------------------------------------------------
    def on_deployment(self, etype: str | None, body: dict) -> None:
        key = (body["metadata"]["namespace"], body["metadata"]["name"])
        if etype == "DELETED" or body["metadata"].get("deletionTimestamp"):
            self.caches.forget(key)
            self.runtime.forget(key)
            self.limiters.forget(key)
            self.memory.pop(key, None)
            self.metrics.forget(*key)
            return
        before = self.deployments.get(key)
        self.deployments[key] = body = lean(body)
        self.runtime.ensure(key)
        # Our own status writes come back as events; only a spec change needs a pass.
        if before is None or before["metadata"].get("generation") != body["metadata"].get("generation"):
            self.runtime.poke(key)

    def on_pod(self, etype: str | None, body: dict) -> None:
        self.runtime.poke(self.caches.on_pod(etype, body))

    def on_child(self, etype: str | None, body: dict) -> None:
        self.runtime.poke(self.caches.on_child(etype, body))

    # ---- leadership and the workers -------------------------------------------------------
    async def lead(self, shard: int | None = None) -> None:
        """This process became the leader (of one shard): start from what the API server says,
        as a fresh process would (switches in flight come back from status; caches.took_over)."""
        keys = self._keys(shard)
        for key in keys:
            self.memory.pop(key, None)
            self.caches.took_over(key)
        for ev in self._events(shard):
            ev.set()
        self.leading.set()
        self.runtime.poke_all(fresh=True, keys=keys)

    async def follow(self, shard: int | None = None) -> None:
        """Leadership (of one shard) lost: stop acting on it now (passes in flight are cancelled;
        what they recorded is in status for the next leader) and wait to lead it again."""
        for ev in self._events(shard):
            ev.clear()
        if not any(ev.is_set() for ev in self.shard_leading):
            self.leading.clear()
        await self.runtime.restart(self._keys(shard))

    def _events(self, shard: int | None) -> list[asyncio.Event]:
        return self.shard_leading if shard is None else [self.shard_leading[shard]]

    def _keys(self, shard: int | None) -> list[Key]:
        return [k for k in self.deployments if shard is None or shard_of(k, self.shards) == shard]

    async def stop(self) -> None:
        await self.runtime.stop()

    async def pass_once(self, key: Key) -> float | None:
        """One pass of `key` as its worker runs it (failures through the error policy)."""
        return await self.runtime.once(key)

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
            await self.actor.record_terminal(key, mem, e.diagnosis)
            return error_policy(e, 1)
        mem.errors += 1
        self.caches.relisted_at.pop(key, None)  # the API server may have been away: list again first
        delay = error_policy(e, mem.errors)
        (log.warning if isinstance(e, KubeError) else log.exception)(
            "%s/%s: pass failed (%s), again in %.1fs", key[0], key[1], e, delay)
        self.metrics.reconciles.labels("transient").inc()
        return delay

    # ---- the pass ------------------------------------------------------------------------------
    async def reconcile(self, key: Key) -> float | None:
        """One pass: observe -> decide (pure) -> record -> act. Returns when to look again."""
        body = self.deployments.get(key)
        if body is None:
            return None
        snap = await self.observer.observe(key, body)
        if self.record_dir:   # on call: the pass as decide saw it, to replay (python -m pd_operator.snapshots)
            snapshots.record(self.record_dir, snap)
        plan = decide(snap)
        await self.actor.record(snap, plan)
        acted = await self.actor.act(snap, plan)
        log.debug("%s/%s pass: asked %d in %.0f ms, %s, %d link plans, %d verify pairs, %d to apply%s", *key,
                  len(snap.reports), (self.clock.monotonic() - snap.now) * 1000, plan.status["phase"], len(plan.links),
                  len(plan.verify), len(plan.to_apply), ", acted" if acted else "")
        return self.requeue(snap, plan, acted)

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
            now = self.clock.monotonic()   # a link's or an agent's backoff ends sooner
            retry = min((w for w in (mem.next_retry_in(now), self.caches.seen_of(snap.key).next_retry_in(now))
                         if w is not None), default=None)
            return min(NOT_READY_RESYNC_S, retry) if retry is not None else NOT_READY_RESYNC_S
        return min(resync_s(snap.key), max(0.5, mem.next_verify - self.clock.monotonic()))
