"""observe: what decide works from, frozen into a Snapshot: the deployment, its pods and children
from the caches (checked against a fresh list now and then), the control token and the gateway's
keys Secret (read now and then, never watched), what each agent asked this pass reports about its
engine, and the gateway's latency figures where the SLO policy reads them. What it writes to memory
is bookkeeping of its own calls (the agents' backoff, the token it read), never a decision."""
from __future__ import annotations

import asyncio
import logging
import os

from pd_contract.names import LABEL_DEPLOYMENT, LABEL_KEYS

from . import gangs as gangs_
from . import observe
from . import pools as pools_
from . import switch as sw_
from . import tokens as tk
from .agentclient import AgentClient
from .api import GROUP, KIND, VERSION, PDDeploymentSpec, parse_spec
from .caches import Caches
from .config import OperatorConfig
from .decide import Snapshot
from .errors import TerminalError
from .kube import Kube, KubeError
from .members import Problem, claimed_owner, listed_strays, member_of, pod_ready
from .observe import ask_always, to_ask
from .runtime import Clock, Limiters, spread
from .state import Memory, Seen

log = logging.getLogger("pd_operator.observer")
Key = tuple[str, str]
# caches are checked against a fresh list this often
RELIST_S = float(os.environ.get("PD_OPERATOR_RELIST_SECONDS", "30"))
STRAY_RELIST_S = 5.0      # a pod claiming a StatefulSet not in the cache makes a fresh list this often
TOKEN_TTL_S = 20.0
POOL_API_TTL_S = 30.0     # whether InferencePools are served is asked again this often
POOL_RELIST_S = 10.0      # a deployment's InferencePools are read again this often (at once after a write)
FREE_NPUS_TTL_S = 10.0    # the nodes' free NPUs are read at most this often (while an instance waits for room)


def relist_s(key: Key) -> float:
    """RELIST_S plus up to half again, fixed per deployment: a fleet that settled together does
    not list all its pods and children in the same second, every time."""
    return RELIST_S * (1.0 + 0.5 * spread(key))


class Observer:
    def __init__(self, kube: Kube, agents: AgentClient, caches: Caches, memory: dict[Key, Memory],
                 config: OperatorConfig, clock: Clock, limiters: Limiters):
        self.kube, self.agents, self.caches, self.memory, self.config, self.clock = \
            kube, agents, caches, memory, config, clock
        self.limiters = limiters
        self._pool_api_seen: tuple[bool | None, float | None] = (None, None)
        self._free_seen: tuple[float, dict[str, int] | None] = (float("-inf"), None)

    async def observe(self, key: Key, body: dict) -> Snapshot:
        """The Snapshot decide works from. What it writes to memory is bookkeeping of its own
        calls (the agents' backoff, the token it read), never a decision."""
        ns, name = key
        mem = self.memory.setdefault(key, Memory())
        seen = self.caches.seen_of(key)
        now, wall = self.clock.monotonic(), self.clock.time()
        try:
            spec = parse_spec(body["spec"])
        except ValueError as e:
            raise TerminalError("InvalidSpec", f"spec is invalid (admission should have refused it): {e}") from e
        c = self.caches
        if now - c.relisted_at.get(key, 0.0) > relist_s(key):
            await c.relist(self.kube, key)
        uid = body["metadata"].get("uid", "")
        own = c.own_statefulsets(key, uid)
        cached = c.cached_pods(key)
        if any(claimed_owner(p) not in own | {None} for p in cached) \
                and now - c.relisted_at.get(key, 0.0) > STRAY_RELIST_S:
            # a StatefulSet's watch event may trail its pods': look before calling a pod foreign
            await c.relist(self.kube, key)
            own = c.own_statefulsets(key, uid)
            cached = c.cached_pods(key)
        stray_pods, strays = listed_strays(cached, own)
        all_pods = [p for p in cached if claimed_owner(p) in own]
        # an instance of several pods is one member, its leading pod (gangs.py keeps the others)
        members = [m for m in (member_of(p, spec) for p in all_pods) if m is not None]
        problems = tuple(strays) + tuple(m for m in members if isinstance(m, Problem))
        engines = [m for m in members if not isinstance(m, Problem)]
        token = await self._token(key, mem, seen, uid, body.get("status"))
        keys = await self._keys_secret(key, seen, spec)
        book = mem.book or sw_.Book.from_status(body.get("status"))
        reports: dict = {}
        ask: set[str] = set()
        if token:
            dirty = c.dirty.setdefault(key, set())
            ask = to_ask(mem, engines, now, dirty, ask_always(spec, book, engines, wall))
            dirty -= ask   # (given back if this pass's record fails: its reports are then lost)
            reports = await observe.gather(engines, self.agents, token, seen.agent_backoff, now, self.limiters(key),
                                           only=ask)
            if any(r.error is not None and r.error.kind == "AgentUnauthorized" for r in reports.values()):
                seen.token_read_at = 0.0  # the Secret may have been rotated: read it again next pass
        stats, read = None, False
        rbs = spec.rebalance
        if rbs is not None and rbs.policy == "SLO" and spec.gateway and spec.gateway.enabled \
                and wall >= book.next_evaluation:
            stats, read = await self._gateway_stats(ns, name), True
        pool_api, pools = await self._pools(key, spec, seen)   # (before the pass reads seen.pool_error)
        alive = {e.pod: e for e in engines}
        seen.agent_backoff.prune(lambda k: k[0] in alive and k == observe.backoff_key(alive[k[0]]))
        return Snapshot(key=key, body=body, spec=spec, now=now, wall=wall, pods=tuple(all_pods),
                        children=c.child_objects(key),
                        engines=tuple(engines), problems=problems, token=token, reports=reports,
                        gateway_stats=stats, gateway_read=read, asked=frozenset(ask), memory=mem,
                        npu_resource=self.config.npu_resource, config=self.config, token_problem=seen.token_problem,
                        token_digests=tuple(sorted(seen.token_digests.items())),
                        keys=keys, strays=stray_pods, pool_api=pool_api, pools=pools,
                        pool_error=seen.pool_error, free_npus=await self._free_npus(mem))

    async def _free_npus(self, mem: Memory) -> dict[str, int] | None:
        """The nodes' free NPUs, read only while an instance of several pods waits for room to be
        placed whole (at most every FREE_NPUS_TTL_S, one read for every deployment)."""
        if not any(getattr(m, "unplaced", "") for m in mem.gangs.values()):
            return None
        at, free = self._free_seen
        if self.clock.monotonic() - at < FREE_NPUS_TTL_S:
            return free
        try:
            nodes = await self.kube.list("v1", "Node", None)
            pods = await self.kube.list("v1", "Pod", None, fields="status.phase!=Succeeded,status.phase!=Failed")
        except (KubeError, OSError) as e:
            log.warning("cannot read the nodes' free NPUs: %s", e)
            return None
        free = gangs_.free_npus(nodes, pods, self.config.npu_resource)
        self._free_seen = (self.clock.monotonic(), free)
        return free

    async def _pool_api(self) -> bool | None:
        """Whether the API server serves InferencePools, asked again every POOL_API_TTL_S (a CRD
        installed later is found); None while it cannot be told."""
        served, at = self._pool_api_seen
        if at is None or self.clock.monotonic() - at >= POOL_API_TTL_S:
            try:
                served = await self.kube.serves(pools_.POOL_API, pools_.POOL_PLURAL)
            except (KubeError, OSError) as e:
                log.warning("cannot tell whether %s is served: %s", pools_.POOL_API, e)
            self._pool_api_seen = (served, self.clock.monotonic())
        return served

    async def _pools(self, key: Key, spec: PDDeploymentSpec, seen: Seen
                     ) -> tuple[bool | None, tuple[dict, ...] | None]:
        """The InferencePool API's presence and this deployment's pools (those it labelled, and any
        of the names it wants): read while pools are wanted, and once more after (to delete those
        that were kept); again every POOL_RELIST_S, or at once after the operator wrote one. None:
        they could not be read (why: seen.pool_error)."""
        if not pools_.wanted(spec) and not seen.pools_kept:
            return None, ()
        api = await self._pool_api()
        if not api:
            seen.pools_kept = False
            return api, ()
        now = self.clock.monotonic()
        if seen.pools is not None and now - seen.pools_at < POOL_RELIST_S:
            return api, seen.pools
        ns, name = key
        try:
            listed = await self.kube.list(pools_.POOL_API, pools_.POOL_KIND, ns, f"{LABEL_DEPLOYMENT}={name}")
            have = {p["metadata"]["name"] for p in listed}
            for pool in pools_.selectors(name, spec) if pools_.wanted(spec) else ():
                if pool not in have and (got := await self.kube.get(pools_.POOL_API, pools_.POOL_KIND, ns, pool)):
                    listed.append(got)
        except KubeError as e:
            seen.pools, seen.pool_error = None, f"cannot read InferencePools: {e}"
            return api, None
        seen.pools, seen.pools_at = tuple(listed), now
        seen.pools_kept = pools_.wanted(spec) or bool(listed)
        return api, seen.pools

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

    async def _token(self, key: Key, mem: Memory, seen: Seen, uid: str, status: dict | None) -> str | None:
        """The control token, from the Secret the operator made (tokens.judge: its digest is in
        status). Re-read now and then: a Secret deleted to rotate it must show up (a new one is made;
        the running pods answer AgentUnauthorized until they restart with it), and RBAC allows `get`
        on the Secret, not a watch."""
        if (seen.token or seen.token_problem) and not seen.token_create \
                and self.clock.monotonic() - seen.token_read_at < TOKEN_TTL_S:
            return seen.token
        ns, name = key
        # read at once: a takeover's first passes each wait on these before asking any agent
        got = await asyncio.gather(*(self.kube.get("v1", "Secret", ns, secret_name(name))
                                     for secret_name in tk.SECRETS.values()))
        found = dict(zip(tk.SECRETS, got, strict=True))
        # what this operator wrote last is newer than the cached object's status
        v = tk.judge(name, ns, uid, found, mem.last_status or status, seen.token_create)
        if v.foreign and mem.last_status is None:
            # no write of its own yet (a restart, a takeover): the cache may trail the status the
            # operator wrote before; a Secret is called foreign only against the status as stored
            fresh = await self.kube.get(f"{GROUP}/{VERSION}", KIND, ns, name)
            if fresh is not None:
                v = tk.judge(name, ns, uid, found, fresh.get("status"), seen.token_create)
        seen.token, seen.token_problem, seen.token_digests = v.token, v.problem, v.digests
        seen.token_create = v.create
        seen.token_read_at = self.clock.monotonic()
        return seen.token

    async def _keys_secret(self, key: Key, seen: Seen, spec: PDDeploymentSpec) -> tuple[bool, str, str] | None:
        """Whether the gateway may be given its keys Secret: only one that opted in with the label
        pdoperator.io/keys: "true". Re-read every pass until it is allowed, then now and then."""
        gw = spec.gateway
        if gw is None or not gw.enabled or not gw.api_keys_secret:
            seen.keys_verdict = None
            return None
        v = seen.keys_verdict
        if v is not None and v[0] and self.clock.monotonic() - seen.keys_read_at < TOKEN_TTL_S:
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
        seen.keys_verdict, seen.keys_read_at = v, self.clock.monotonic()
        return v
