"""The pod's agent over its tensor-parallel ranks (PD_TENSOR_PARALLEL > 1).

An Ascend instance runs one LLM-DataDist engine per rank, one per process (the library allows
one engine per process). Each rank process embeds the agent core over its own engine and serves
the agent API on a local port; it registers that URL here (POST /v1/ranks). This agent (port
8080) fronts them, so the operator and kubectl make one call per pod:
- link/unlink: the decoder's rank r links the peer pod's rank r (`Peer.ranks`);
- verify: each rank pair pulls a probe, all at once; the result names a failing rank;
- status: the pod's ranks, their device IPs, and one link per peer pod with its rank links;
- init, drain, undrain, switch_role, faults: every rank;
- /r/<rank>/v1/...: that rank's own API (a rank's peers reach its probe and notify there).

The rank contract (see README): a rank process gets PD_RANK, PD_TENSOR_PARALLEL,
LLM_DATADIST_CLUSTER_ID (group base + pod index x TP + rank), LLM_DATADIST_DEVICE_ID (its
process-visible device index, the rank), PD_DEVICE_ID (the physical NPU), LLM_DATADIST_IP and
LLM_DATADIST_PORT (its device IP and the datadist port) and PD_RANK_REGISTER_URL; `rank_env`
computes them from the pod's environment. With PD_RANKS_EXTERNAL=1 this agent starts no rank
processes and waits for an inference server's workers to register; otherwise (the simulator)
it starts one `python -m pd_agent` per rank and exits if one dies, so the pod restarts whole."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass, replace
from typing import Awaitable, Callable

import httpx
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from pd_contract import engine_env as ev
from pd_contract.agent_api import (
    AgentPath,
    AgentStatus,
    DecodeRequest,
    DecodeResponse,
    DrainRequest,
    DrainResult,
    FaultsRequest,
    GangRequest,
    LinkRequest,
    LinkResult,
    LinkState,
    Load,
    NotifyRequest,
    Peer,
    PrefillRequest,
    PrefillResponse,
    ProbeRequest,
    PullRequest,
    PullResponse,
    RankInfo,
    RankLinkState,
    RankVerify,
    RegisterRank,
    SwitchRoleRequest,
    UnlinkRequest,
    VerifyRequest,
    VerifyResult,
)
from pd_contract.names import BROKEN_CODES, INSTANCE_INCOMPLETE, LINKED_CODES

from .core import AgentError
from .devices import DeviceError, Devices, resolve_env
from .gang import Groups, Members
from .http import (
    METRICS,
    api_app,
    api_routes,
    app_runner,
    error_reply,
    model_reply,
    presented_token,
    read_body,
    same_token,
    serve_metrics,
    wait_event,
)
from .identity import Identity, proxy_environment
from .inference import OVERLOADED_RETRY_S, no_first_token
from .metrics import AgentMetrics, scrape
from .mindie_hook import attach as attach_mindie
from .preflight import PREFLIGHT_FAULTS, Preflight, held
from .routes import AgentService

log = logging.getLogger("pd_agent.front")
FRONT = web.AppKey("front", object)
RANK_CALL_S = 10.0
STALE_S = 15.0      # a rank whose status calls time out keeps its last status this long
HEALTH_AGE_S = 2.0  # readiness probes take a status round up to this old
STATUS_AGE_S = 0.3  # status polls (operator, routers) take one up to this old
SERVE_S = 600.0     # a prefill or decode on a rank: as long as its queue and output take
PULL_TRIES = 3
DEVICE_RETRY_S = 2.0


def rank_env(env: dict[str, str], devices: Devices, rank: int, register_url: str,
             gang: ev.Gang | None = None) -> dict[str, str]:
    """The environment of the process of the pod's rank `rank`, from the pod's (the rank contract);
    in an instance of several pods or groups, with its place in the instance (`Gang.rank_env`)."""
    d = devices.ranks[rank]
    tp = len(devices.ranks)
    # the pod's identity is rank 0's; the rank's device index among the visible ones is its rank
    pod = ev.EngineIdentity.from_env({**env, ev.PD_TENSOR_PARALLEL: str(tp), ev.PD_RANK: "0"})
    me = replace(pod.for_rank(rank), ip=d.ip or "", port=d.port, device_id=rank, npu=d.device_id)
    placed = gang.rank_env(rank) if gang is not None and gang.spans else {}
    return {**env, **me.to_env(), **placed, ev.PD_RANK_REGISTER_URL: register_url}


def rank_map(local_tp: int, peer_tp: int, r: int) -> int:
    """The peer rank this pod's rank r links and pulls from. Equal TP: rank r. One TP a multiple
    k of the other (MLA: every rank holds the whole latent): a decoder of smaller TP reads every
    k-th prefill rank (r x k); a decoder of larger TP shares prefill rank r // k among k ranks."""
    if peer_tp == local_tp:
        return r
    if max(local_tp, peer_tp) % min(local_tp, peer_tp):
        raise AgentError("LLM_PARAM_INVALID", f"tensor parallelism {local_tp} and a peer's {peer_tp}: one must "
                                              f"divide the other for ranks to be paired", 400)
    return r * (peer_tp // local_tp) if peer_tp > local_tp else r // (local_tp // peer_tp)


@dataclass
class Rank:
    rank: int
    url: str | None = None
    boot_id: str | None = None
    status: AgentStatus | None = None
    error: str = ""
    seen: float = 0.0      # when its status last answered


def links_of(front: Front) -> list[LinkState]:
    """A front's links: one per peer pod, with its rank links and the worst rank's code."""
    ranks, tp, peer_tps = front.ranks, front.tp, front.peer_tps
    by_peer: dict[str, dict[int, LinkState]] = {}
    for r, rk in ranks.items():
        for link in (rk.status.links if rk.status else []):
            by_peer.setdefault(link.name, {})[r] = link
    out = []
    for name, per in sorted(by_peer.items()):
        any_link = per.get(0) or next(iter(per.values()))
        anchor_rank = 0 if 0 in per else min(per)
        peer_tp = peer_tps.get(name, tp)
        pair = lambda r, t=peer_tp: rank_map(tp, t, r)  # noqa: E731 - the peer rank rank r pairs with
        base_cid = any_link.cluster_id - pair(anchor_rank)   # the peer's rank 0 names the peer pod
        rank_links: list[RankLinkState] = []
        for r in range(tp):
            rl = per.get(r)
            if rl is None:
                rank_links.append(RankLinkState(rank=r, cluster_id=base_cid + pair(r), code="LLM_NOT_YET_LINK",
                                           healthy=False))
            else:
                rank_links.append(RankLinkState(rank=r, cluster_id=rl.cluster_id, ip=rl.ip, port=rl.port,
                                           code=rl.code, healthy=rl.healthy))
        worst = next((x for x in rank_links if not x.healthy or x.code in BROKEN_CODES), None) \
            or next((x for x in rank_links if x.code != "LLM_SUCCESS"), rank_links[0])
        r0 = per.get(0)
        out.append(LinkState(name=name, cluster_id=base_cid, ip=r0.ip if r0 else "", port=r0.port if r0 else 0,
                             code=worst.code, healthy=all(x.healthy for x in rank_links),
                             since=max(x.since for x in per.values()),
                             peer_boot_id=(r0 or any_link).peer_boot_id, ranks=rank_links))
    return out


def combine(tp: int, peers: list[Peer], results: list[dict], ranks: list[int] | None = None,
            missing: str = "LLM_FAILED") -> LinkResult:
    """The ranks' link (or unlink) results as the pod's: per peer, the worst rank's code."""
    ranks = ranks if ranks is not None else list(range(tp))
    rank_rets: dict[str, list[str]] = {p.name: [missing] * tp for p in peers}
    for r, res in zip(ranks, results):
        for name, code in res.get("rets", {}).items():
            if name in rank_rets:
                rank_rets[name][r] = code
    ok = LINKED_CODES | {"LLM_NOT_YET_LINK"} if missing == "LLM_NOT_YET_LINK" else LINKED_CODES
    rets = {n: next((c for c in codes if c not in ok), codes[0]) for n, codes in rank_rets.items()}
    failed = next((c for c in rets.values() if c not in ok), None)
    return LinkResult(ret=failed or "LLM_SUCCESS", rets=rets, rank_rets=rank_rets,
                      duration_ms=max((r.get("duration_ms", 0) for r in results), default=0))


async def release(front: Front, url: str, req_id: int, ranks: list[int]) -> None:
    """A decoder's notice to a prefill's agent: the copies of `req_id` on `ranks` are nobody's to pull."""
    rel = NotifyRequest(decoder_cluster_id=front.id.cluster_id, released=[req_id], ranks=ranks)
    with contextlib.suppress(httpx.HTTPError):
        await front.http.post(f"{url}{AgentPath.NOTIFY}", json=rel.model_dump(mode="json"),
                              headers=front._peer_headers(), timeout=RANK_CALL_S)


class Front(AgentService):
    """The pod's agent over its ranks; as an AgentService it answers the agent API (routes.py)."""

    where = "front"

    def __init__(self, identity: Identity, tp: int, http: httpx.AsyncClient, env: dict[str, str] | None = None):
        self.id, self.http = identity, http
        self.env = dict(os.environ if env is None else env)
        g = ev.Gang.from_env(self.env)
        self.layout = g if g.spans else ev.Gang(tp=tp)
        self.tp = self.layout.ranks if self.layout.leader else tp   # a leading pod fronts its instance's ranks
        self.members = Members(self.layout, http, self._headers, self.register, time.monotonic)
        self.groups = Groups(self.layout)
        self.boot_id = uuid.uuid4().hex
        self.ranks = {r: Rank(r) for r in range(self.layout.first_rank, self.layout.first_rank + self.tp)}
        self.devices: Devices | None = None
        self.device_error = ""
        self.preflight: Preflight | None = None   # the network preflight, once the devices are known
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        self.refreshed_at, self._refreshing = 0.0, asyncio.Lock()
        self.background: set[asyncio.Task] = set()
        self.terminating, self.draining = False, False   # draining: it refuses new requests (its ranks too)
        self.serving = self.prefilling = 0   # requests the instance took on and has not answered yet; prefills
        self.switching_to: str | None = None   # the role the last switch_role asked for
        self.peer_urls: dict[str, str] = {}    # peer pod -> its agent, as linked (never a request's URL)
        self.failed = asyncio.Event()      # a rank process died: the pod restarts whole
        self.external = ev.flag(self.env, ev.PD_RANKS_EXTERNAL)
        self.peer_tps: dict[str, int] = {}  # peer pod -> its TP, as linked
        self.faults: dict[str, int] = {}    # the agent's own fault points (the simulator's are the ranks')
        # as AgentCore's: told (old_role, new_role) once every rank switched
        self.after_switch: list[Callable[[str, str], Awaitable[None]]] = []

    # ---- ranks -------------------------------------------------------------------------------
    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.id.token}"} if self.id.token else {}

    def _peer_headers(self) -> dict[str, str]:
        """For notices to another pod's agent: the peer token. Without one, the control token, which
        is safe only because notices go to agents the operator linked us to (peer_urls), never to
        a URL a request names."""
        token = self.id.peer_token or self.id.token
        return {"Authorization": f"Bearer {token}"} if token else {}

    async def call(self, r: int, method: str, path: str, body: BaseModel | dict | None = None,
                   timeout: float = RANK_CALL_S) -> dict:
        rk = self.ranks[r]
        if not rk.url:
            raise AgentError("RANK_NOT_REGISTERED", f"rank {r} has not registered with the pod's agent", 503)
        data = body.model_dump(mode="json", exclude_none=True) if isinstance(body, BaseModel) else body
        try:
            resp = await self.http.request(method, f"{rk.url}{path}", json=data, headers=self._headers(),
                                           timeout=timeout)
        except httpx.HTTPError as e:
            raise AgentError("RANK_UNREACHABLE", f"rank {r} ({rk.url}): {e!r}", 503) from None
        try:
            out = resp.json()
        except ValueError:
            out = {"code": "RANK_ERROR", "message": resp.text[:300]}
        if resp.status_code >= 400:
            raise AgentError(out.get("code", "RANK_ERROR"), f"rank {r}: {out.get('message', '')}", resp.status_code)
        return out

    async def each(self, method: str, path: str, bodies: dict[int, BaseModel | dict | None] | None = None,
                   timeout: float = RANK_CALL_S) -> list[dict]:
        """The same call on every rank, at once; the first failure (lowest rank) is raised."""
        ranks = sorted(bodies) if bodies is not None else sorted(self.ranks)
        res = await asyncio.gather(*(self.call(r, method, path, bodies[r] if bodies else None, timeout)
                                     for r in ranks), return_exceptions=True)
        for x in res:
            if isinstance(x, BaseException):
                raise x
        return res  # type: ignore[return-value]

    def register(self, req: RegisterRank) -> None:
        if held(self.preflight):   # an engine beside the agent: its ranks start serving once the checks pass
            raise AgentError("PREFLIGHT_FAILED", "the pod's network preflight has not passed: its ranks wait", 503)
        if req.rank not in self.ranks:
            raise AgentError("LLM_PARAM_INVALID", f"rank {req.rank} registered, but this pod has ranks "
                                                  f"{min(self.ranks)}-{max(self.ranks)}", 400)
        rk = self.ranks[req.rank]
        if rk.boot_id and rk.boot_id != req.boot_id:
            # a rank restarted (its engine and links are new): the pod is a new peer for the decoders
            log.warning("rank %d registered again with a new boot id (it restarted)", req.rank)
            self.boot_id = uuid.uuid4().hex
        rk.url, rk.boot_id, rk.error = req.url.rstrip("/"), req.boot_id, ""
        log.info("rank %d registered at %s", req.rank, rk.url)

    async def resolve_devices(self, stop: asyncio.Event) -> bool:
        """Device IPs, re-read until every rank has one (the annotation may come late)."""
        while not stop.is_set():
            try:
                self.devices = resolve_env(self.env)
                self.device_error = self.devices.error
            except DeviceError as e:
                self.devices, self.device_error = None, str(e)
            if self.devices is not None and self.devices.complete:
                log.info("device IPs from %s: %s", self.devices.source,
                         ", ".join(f"rank {d.rank} {d.ip}:{d.port}" for d in self.devices.ranks))
                return True
            log.warning("DeviceIPUnknown: %s; re-reading in %.0fs", self.device_error, DEVICE_RETRY_S)
            await wait_event(stop, DEVICE_RETRY_S)
        return False

    async def spawn(self, register_url: str) -> None:
        assert self.devices is not None
        for i in range(self.layout.per_pod):   # its own ranks (a leading pod takes the others' on)
            env, r = rank_env(self.env, self.devices, i, register_url, self.layout), self.layout.first_rank + i
            self.procs[r] = await asyncio.create_subprocess_exec(sys.executable, "-m", "pd_agent", env=env)
            asyncio.create_task(self._watch(r, self.procs[r]))

    async def _watch(self, r: int, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        if not self.terminating:
            log.error("rank %d exited with %s: the pod's agent exits so the pod restarts whole", r, code)
            self.ranks[r].error = f"rank process exited with {code}"
            self.failed.set()

    async def stop_ranks(self, grace: float) -> None:
        for p in self.procs.values():
            if p.returncode is None:
                p.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in self.procs.values())), grace)
        except asyncio.TimeoutError:
            for p in self.procs.values():
                if p.returncode is None:
                    p.kill()

    # ---- status ---------------------------------------------------------------------------------
    async def refresh(self, max_age: float = 0.0) -> None:
        """The ranks' statuses, asked at once; callers that can use a recent answer say how
        recent (probes and pollers share one round instead of each asking every rank). A rank
        that answers late on a busy host keeps its last status for a while: it is slow, not gone."""
        if time.monotonic() - self.refreshed_at <= max_age:
            return
        await self.members.adopt(missing=any(not rk.url or rk.error for rk in self.ranks.values()))
        async with self._refreshing:
            if time.monotonic() - self.refreshed_at <= max_age:
                return

            async def one(rk: Rank) -> None:
                if not rk.url:
                    return
                try:
                    rk.status = AgentStatus.model_validate(await self.call(rk.rank, "GET", AgentPath.STATUS, timeout=5))
                    rk.error, rk.seen = rk.status.last_error, time.monotonic()
                except AgentError as e:
                    rk.error = str(e)
                    if rk.status is None or time.monotonic() - rk.seen > STALE_S:
                        rk.status = None
            await asyncio.gather(*(one(rk) for rk in self.ranks.values()))
            self.refreshed_at = time.monotonic()

    @property
    def initialized(self) -> bool:
        return all(rk.status is not None and rk.status.initialized for rk in self.ranks.values())

    def status(self) -> AgentStatus:
        sts = {r: rk.status for r, rk in self.ranks.items()}
        first = sts.get(min(sts))
        dev = {d.rank: d for d in self.devices.ranks} if self.devices else {}
        infos = []
        for r, rk in sorted(self.ranks.items()):
            s, d, base = sts[r], dev.get(r), self.id.cluster_id - self.layout.first_rank
            infos.append(RankInfo(rank=r, cluster_id=s.cluster_id if s else base + r,
                                  device_id=d.device_id if d else None, ip=(s.ip if s else (d.ip if d else "")) or "",
                                  port=s.port if s else (d.port if d else 0), initialized=bool(s and s.initialized),
                                  registered=rk.url is not None, last_error=rk.error))
        live = [s for s in sts.values() if s is not None]
        # the instance's serving figures are rank 0's (every rank prefills each request; rank 0
        # decodes it); work in hand and memory are every rank's
        load = first.load.model_copy() if first else Load()
        load.in_flight = self.serving + sum(s.load.in_flight for s in live)
        load.pending_kv = sum(s.load.pending_kv for s in live)
        load.kv_used_bytes = sum(s.load.kv_used_bytes for s in live)
        load.kv_capacity_bytes = sum(s.load.kv_capacity_bytes for s in live)
        last_error = self.device_error or next((f"rank {r}: {rk.error}" for r, rk in sorted(self.ranks.items())
                                                if rk.error), self.members.error)
        roles = {s.role for s in live}
        # ranks in different roles (a switch cut short): not the switch's target, so the operator
        # repeats the (idempotent) switch_role; after a restart, the role the pod started in
        if len(roles) == 1:
            role = roles.pop()
        elif self.switching_to is not None:
            role = "decoder" if self.switching_to == "prompt" else "prompt"
        else:
            role = self.id.role
        return AgentStatus(
            pod=self.id.pod, role=role, cluster_id=self.id.cluster_id,
            boot_id=self.boot_id, backend=self.id.backend, initialized=self.initialized,
            ip=infos[0].ip, port=infos[0].port, model_id=self.id.model_id, links=links_of(self),
            incoming=first.incoming if first else [], load=load,
            draining=self.draining or any(s.draining for s in live),
            terminating=self.terminating or any(s.terminating for s in live),
            switchable=all(s.switchable for s in live) if live else self.id.switchable,
            proxy_env=proxy_environment(), memory_scale=first.memory_scale if first else 1,
            cache_desc=first.cache_desc if first else self.id.cache_desc,
            engine=first.engine if first else self.id.engine, last_error=last_error,
            tensor_parallel=self.tp, ranks=infos, device_ips=self.devices.source if self.devices else "",
            device_error=self.device_error, preflight=self.preflight.report if self.preflight else None,
            gang=self.members.state(lambda r: self.ranks[r].url is not None) if self.layout.spans else None)

    # ---- operations -------------------------------------------------------------------------------
    def _rank_peer(self, p: Peer, r: int) -> Peer:
        """The peer engine this pod's rank r pairs with (rank_map), as that rank's own peer."""
        if not p.ranks:   # a single-rank pod: every rank pairs with its one engine
            rank_map(self.tp, 1, r)
            return Peer(name=p.name, cluster_id=p.cluster_id, ip=p.ip, port=p.port, boot_id=p.boot_id,
                        agent_url=p.agent_url)
        j = rank_map(self.tp, len(p.ranks), r)
        ep = p.ranks[j]
        return Peer(name=p.name, cluster_id=ep.cluster_id, ip=ep.ip, port=ep.port, boot_id=p.boot_id,
                    agent_url=f"{p.agent_url.rstrip('/')}{AgentPath.rank_prefix(j)}" if p.agent_url else None)

    async def link(self, req: LinkRequest) -> LinkResult:
        bodies = {r: LinkRequest(peers=[self._rank_peer(p, r) for p in req.peers], timeout_ms=req.timeout_ms)
                  for r in range(self.tp)}   # raises for a peer whose TP cannot be paired with ours
        for p in req.peers:
            self.peer_tps[p.name] = len(p.ranks) if p.ranks else 1
            if p.agent_url:
                self.peer_urls[p.name] = p.agent_url.rstrip("/")
        return combine(self.tp, req.peers, await self.each("POST", AgentPath.LINK, bodies,  # type: ignore[arg-type]
                                                        timeout=req.timeout_ms / 1000 + RANK_CALL_S))

    async def unlink(self, req: UnlinkRequest) -> LinkResult:
        """Each rank drops its link to the named peer pods (found by name in the rank's own
        links when the request does not list the peer's ranks)."""
        await self.refresh(max_age=STATUS_AGE_S)   # a link made since invalidated the round
        bodies: dict[int, BaseModel | dict | None] = {}
        for r, rk in self.ranks.items():
            known = {l.name: l for l in (rk.status.links if rk.status else [])}
            peers = []
            for p in req.peers:
                if p.name in known:
                    l = known[p.name]
                    peers.append(Peer(name=p.name, cluster_id=l.cluster_id, ip=l.ip or "0.0.0.0", port=l.port or 1))
                elif p.ranks:
                    peers.append(self._rank_peer(p, r))
            if peers:
                bodies[r] = UnlinkRequest(peers=peers, timeout_ms=req.timeout_ms, force=req.force)
        if not bodies:
            return LinkResult(ret="LLM_SUCCESS", rets={p.name: "LLM_NOT_YET_LINK" for p in req.peers})
        res = await self.each("POST", AgentPath.UNLINK, bodies, timeout=req.timeout_ms / 1000 + RANK_CALL_S)
        return combine(self.tp, req.peers, res, ranks=sorted(bodies), missing="LLM_NOT_YET_LINK")

    async def verify(self, req: VerifyRequest) -> VerifyResult:
        ranks = req.ranks if req.ranks is not None else list(range(self.tp))
        bad = [r for r in ranks if not 0 <= r < self.tp]
        if bad:
            raise AgentError("LLM_PARAM_INVALID", f"ranks {bad} do not exist: this pod has ranks 0-{self.tp - 1}", 400)
        bodies = {r: VerifyRequest(peer=self._rank_peer(req.peer, r)) for r in ranks}

        peer_tp = len(req.peer.ranks) if req.peer.ranks else 1

        async def one(r: int) -> RankVerify:
            j = rank_map(self.tp, peer_tp, r)
            try:
                v = VerifyResult.model_validate(await self.call(r, "POST", AgentPath.VERIFY, bodies[r], timeout=15))
                return RankVerify(rank=r, peer_rank=j, ok=v.ok, code=v.code, message=v.message, bytes=v.bytes,
                                  pull_ms=v.pull_ms)
            except AgentError as e:
                return RankVerify(rank=r, peer_rank=j, ok=False, code=e.code, message=str(e))
        results = await asyncio.gather(*(one(r) for r in ranks))
        # a content mismatch is named first: it is the one failure the link itself does not show
        failed = next((x for x in results if x.code == "KV_CONTENT_MISMATCH"), None) \
            or next((x for x in results if not x.ok), None)
        return VerifyResult(ok=failed is None, code=failed.code if failed else "LLM_SUCCESS",
                            message=f"rank {failed.rank} (from prefill rank {failed.peer_rank}): {failed.message}"
                            if failed else "",
                            prefill=req.peer.name, decoder=self.id.pod, bytes=sum(x.bytes for x in results),
                            pull_ms=max((x.pull_ms for x in results), default=0), ranks=list(results))

    async def drain(self, req: DrainRequest) -> DrainResult:
        self.draining = True    # the instance refuses new work first; its ranks finish what it took on
        res = [DrainResult.model_validate(x) for x in await self.each(
            "POST", AgentPath.DRAIN, {r: DrainRequest(timeout_s=req.timeout_s) for r in range(self.tp)},
            timeout=req.timeout_s + RANK_CALL_S)]
        return DrainResult(draining=True, in_flight=sum(x.in_flight for x in res) + self.serving,
                           pending_kv=sum(x.pending_kv for x in res),
                           drained=all(x.drained for x in res) and not self.serving)

    async def undrain(self) -> DrainResult:
        res = [DrainResult.model_validate(x) for x in await self.each("POST", AgentPath.UNDRAIN)]
        self.draining = False
        return DrainResult(draining=False, in_flight=sum(x.in_flight for x in res),
                           pending_kv=sum(x.pending_kv for x in res), drained=False)

    # ---- serving --------------------------------------------------------------------------------
    def _admit(self, role: str) -> None:
        """The instance takes a request on or refuses it whole, before any rank does any of it:
        a rank refusing half-way would leave shards pulled that another decoder then misses."""
        if self.draining or self.terminating or not self.layout.leader:   # (an instance's other pods hold ranks only)
            raise AgentError("DRAINING", f"{self.id.pod} takes no request now; send it to another instance", 503)
        st = {rk.status.role for rk in self.ranks.values() if rk.status}
        if st and st != {role}:
            raise AgentError("ROLE_CHANGED", f"{self.id.pod} now serves as {'/'.join(sorted(st))}; send the "
                             f"{'prefill' if role == 'prompt' else 'decode'} elsewhere", 503)

    async def prefill(self, req: PrefillRequest) -> PrefillResponse:
        """Every rank computes its shard and leaves it under its own CacheKey; a rank that fails
        frees the shards the others made."""
        self._admit("prompt")
        # the ranks take every request the instance admits, so the bound is here: the waiting
        # prefills beyond a running batch, as a single-rank agent counts them
        bound = self.id.max_prefill_queue + max(1, self.id.cache_desc["shape"][0])
        if self.prefilling >= bound:
            raise AgentError("OVERLOADED", f"{self.id.pod} has {self.prefilling} prefills in hand (the bound, "
                             f"PD_AGENT_MAX_PREFILL_QUEUE plus a batch); send the request elsewhere", 503,
                             retry_after=OVERLOADED_RETRY_S)
        self.serving += 1
        self.prefilling += 1
        try:
            return await self._prefill(req.model_copy(update={"admitted": True}))
        finally:
            self.serving -= 1
            self.prefilling -= 1

    async def _prefill(self, req: PrefillRequest) -> PrefillResponse:
        res = await asyncio.gather(*(self.call(r, "POST", AgentPath.PREFILL, req, timeout=SERVE_S)
                                     for r in range(self.tp)), return_exceptions=True)
        failed = next((x for x in res if isinstance(x, BaseException)), None)
        if failed is not None:
            made = [r for r, x in enumerate(res) if not isinstance(x, BaseException)]
            rel = NotifyRequest(decoder_cluster_id=self.id.cluster_id, released=[req.req_id])
            await asyncio.gather(*(self.call(r, "POST", AgentPath.NOTIFY, rel) for r in made), return_exceptions=True)
            if isinstance(failed, AgentError) and failed.code in ("RANK_UNREACHABLE", "RANK_NOT_REGISTERED"):
                failed = AgentError(INSTANCE_INCOMPLETE, f"{failed}; nothing of the request was kept", 503)
            raise failed
        out = [PrefillResponse.model_validate(x) for x in res]
        # every rank computes the whole (reference) model, so every rank chose the same first token
        return PrefillResponse(prompt_cluster_id=self.id.cluster_id, req_id=req.req_id, model_id=self.id.model_id,
                               queue_ms=max(x.queue_ms for x in out), prefill_ms=max(x.prefill_ms for x in out),
                               first_token=out[0].first_token)

    async def _peer_link(self, prompt_cluster_id: int) -> LinkState:
        for attempt in (0, 1):
            link = next((x for x in links_of(self) if x.cluster_id == prompt_cluster_id), None)
            if link is not None and link.healthy:
                return link
            if attempt == 0:
                await self.refresh()
        raise AgentError("NOT_LINKED", f"{self.id.pod} has no healthy link to the prefill with cluster id "
                                       f"{prompt_cluster_id} at every rank; nothing was pulled", 503)

    async def pull_all(self, req: DecodeRequest, group: list[int]) -> float:
        """Every rank pulls its shard from the prefill rank it pairs with, at once; a failed rank
        pull is retried, then the request is refused before its first token (never half-served).
        Returns the slowest pull's milliseconds."""
        link = await self._peer_link(req.prompt_cluster_id)
        peer_ranks = link.ranks
        assert peer_ranks is not None
        peer_tp = self._peer_tp(link)
        base_url = self.peer_urls.get(link.name)   # as linked: a request's URL never gets a notice

        async def one(r: int) -> float:
            j = rank_map(self.tp, peer_tp, r)
            # the rank reports the pull to the prefill rank's agent as it linked it (Peer.agent_url)
            body = PullRequest(req_id=req.req_id, prompt_cluster_id=peer_ranks[r].cluster_id,
                               prompt_tokens=req.prompt_tokens, admitted=True)
            for attempt in range(PULL_TRIES):
                try:
                    return PullResponse.model_validate(await self.call(r, "POST", AgentPath.PULL, body,
                                                                       timeout=SERVE_S)).pull_ms
                except AgentError as e:
                    if attempt == PULL_TRIES - 1 or e.status in (503,):
                        raise AgentError(e.code, f"rank {r} pulling from prefill rank {j}: {e}", e.status) from None
                    await asyncio.sleep(0.05 * (attempt + 1))
            raise AssertionError("unreachable")
        t0 = time.monotonic()
        res = await asyncio.gather(*(one(r) for r in group), return_exceptions=True)
        failed = [x for x in res if isinstance(x, BaseException)]
        if failed:
            pulled = len(res) - len(failed)
            if pulled and all(isinstance(x, AgentError) and x.code == "NOT_LINKED" for x in failed):
                # some shards moved (a pull consumes them): the request cannot go to another decoder
                raise AgentError("LLM_NOT_YET_LINK", f"{failed[0]}; {pulled} of {len(group)} ranks pulled already, "
                                                     "so the request cannot move", 502)
            raise failed[0]
        ms = [x for x in res if not isinstance(x, BaseException)]
        read = {rank_map(self.tp, peer_tp, r) for r in group}
        if len(read) < peer_tp and base_url:   # prefill ranks no rank of ours reads: one notice frees their copies
            await release(self, base_url, req.req_id, [j for j in range(peer_tp) if j not in read])
        return max(max(ms), (time.monotonic() - t0) * 1000)

    def _peer_tp(self, link: LinkState) -> int:
        """The peer pod's TP: as it was linked, else from the cluster ids our ranks paired with."""
        if link.name in self.peer_tps:
            return self.peer_tps[link.name]
        if not link.ranks or len(link.ranks) < 2:
            return 1 if self.tp == 1 else self.tp
        step = link.ranks[1].cluster_id - link.ranks[0].cluster_id
        if step == 0:     # our ranks share peer ranks: the peer has fewer
            shared = sum(1 for x in link.ranks if x.cluster_id == link.ranks[0].cluster_id)
            return max(1, self.tp // shared)
        return self.tp * step

    async def decode(self, body: DecodeRequest, request: web.Request) -> web.StreamResponse:
        """Pull on every rank first, so the first token waits for the slowest rank's pull, then
        decode on rank 0 (the step time is the instance's) and pass its answer or stream on."""
        self._admit("decoder")
        st0 = self.ranks[0].status
        # an engine that computes (the reference engine; an inference server's ranks, which the
        # adapter interface decodes from the first token) continues from the prefill's first token:
        # refused before any rank pulls, a pulled shard being gone from the prefill
        if body.first_token is None and (self.external or (st0 is not None and st0.engine == "reference")):
            raise no_first_token()
        self.serving += 1
        try:
            return await self._decode(request, body)
        finally:
            self.serving -= 1

    async def _decode(self, request: web.Request, body: DecodeRequest) -> web.StreamResponse:
        with self.groups.take() as g:   # one data-parallel group pulls and decodes (without DP: every rank)
            group = self.groups.ranks(g)
            pulled_ms = await self.pull_all(body, group)
            return await self._decode_on(request, body.model_copy(update={"kv_pulled_ms": pulled_ms,
                                                                          "admitted": True}), group[0])

    async def _decode_on(self, request: web.Request, rank0: DecodeRequest, r0: int) -> web.StreamResponse:
        if not self.ranks[r0].url:
            raise AgentError("RANK_NOT_REGISTERED", f"rank {r0} has not registered with the pod's agent", 503)
        url = f"{self.ranks[r0].url}{AgentPath.DECODE}"
        data = rank0.model_dump(mode="json", exclude_none=True)
        if not rank0.stream:
            return model_reply(DecodeResponse.model_validate(await self.call(r0, "POST", AgentPath.DECODE, rank0,
                                                                             timeout=SERVE_S)))
        resp = None
        try:
            async with self.http.stream("POST", url, json=data, headers=self._headers(),
                                        timeout=httpx.Timeout(SERVE_S, connect=5)) as r:
                if r.status_code != 200:
                    raw = await r.aread()
                    return web.Response(body=raw, status=r.status_code, content_type="application/json")
                resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
                await resp.prepare(request)
                async for chunk in r.aiter_raw():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        except httpx.HTTPError as e:
            if resp is None:   # nothing sent yet: a plain error (the shards were pulled: not retryable)
                raise AgentError("RANK_UNREACHABLE", f"rank {r0} ({self.ranks[r0].url}): {e!r}", 502) from None
            await resp.write((json.dumps({"error": {"code": "RANK_UNREACHABLE", "message": f"rank {r0}: {e!r}"}})
                              + "\n").encode())
            await resp.write_eof()
            return resp

    # ---- role switching ---------------------------------------------------------------------------
    async def switch_role(self, req: SwitchRoleRequest) -> None:
        """Every rank or none: a rank that refuses puts the ones already switched back, so the
        pod stays whole in its old role. Repeating the call finishes a pod left part-way (each
        rank's switch is idempotent)."""
        self.switching_to = req.role
        crash_after = self.faults.get("switch_crash_after_ranks")
        if crash_after is not None:   # a fault point: ranks one by one, the agent dies part-way
            for r in range(self.tp):
                if r == crash_after:
                    log.warning("fault point: crashing after %d of %d ranks switched to %s", r, self.tp, req.role)
                    self.crash()
                await self.call(r, "POST", AgentPath.SWITCH_ROLE, req, timeout=SERVE_S)
            return
        await self.refresh()
        before = {r: rk.status.role for r, rk in self.ranks.items() if rk.status}
        res = await asyncio.gather(*(self.call(r, "POST", AgentPath.SWITCH_ROLE, req, timeout=SERVE_S)
                                     for r in range(self.tp)), return_exceptions=True)
        failed = [(r, x) for r, x in enumerate(res) if isinstance(x, BaseException)]
        if not failed:
            # a rank in another role before (or none known): the pod switched
            old = next((r for r in before.values() if r != req.role),
                       None if before else ("decoder" if req.role == "prompt" else "prompt"))
            if old is not None:
                for hook in self.after_switch:
                    await hook(old, req.role)
            return
        done = [r for r, x in enumerate(res) if not isinstance(x, BaseException)
                and before.get(r) not in (None, req.role)]
        unknown = [r for r, x in enumerate(res) if not isinstance(x, BaseException) and r not in before]
        for r in done:
            try:
                await self.call(r, "POST", AgentPath.SWITCH_ROLE, SwitchRoleRequest(role=before[r]), timeout=SERVE_S)
            except AgentError as e:
                log.error("rank %d could not switch back to %s: %s", r, before[r], e)
        r, err = failed[0]
        if isinstance(err, AgentError):
            why = str(err).removeprefix(f"rank {r}: ")
            raise AgentError(err.code, f"rank {r} refused switch_role: {why}"
                             + (f"; ranks {done} switched back to {before[done[0]]}" if done else "")
                             + (f"; ranks {unknown} in an unknown role before it" if unknown else ""), err.status)
        raise err

    async def notify(self, req: NotifyRequest) -> None:
        """A single-rank decoder's notices (multi-rank ones reach each rank at /r/<rank>): they
        concern rank 0, the rank it links; the copies on the others are nobody's to pull (`ranks`: those)."""
        if req.ranks is not None:
            rel = NotifyRequest(decoder_cluster_id=req.decoder_cluster_id, released=req.released)
            await asyncio.gather(*(self.call(r, "POST", AgentPath.NOTIFY, rel) for r in req.ranks if r in self.ranks),
                                 return_exceptions=True)
            return
        await self.call(0, "POST", AgentPath.NOTIFY, req)
        if req.pulled and self.tp > 1:
            rel = NotifyRequest(decoder_cluster_id=req.decoder_cluster_id, released=req.pulled)
            await asyncio.gather(*(self.call(r, "POST", AgentPath.NOTIFY, rel) for r in range(1, self.tp)),
                                 return_exceptions=True)

    # ---- the agent API (AgentService) -----------------------------------------------------------
    def changed(self) -> None:
        self.refreshed_at = 0.0   # a control call changed the ranks: the next status asks them

    async def current_status(self) -> AgentStatus:
        await self.refresh()
        return self.status()

    async def healthz(self, request: web.Request) -> web.Response:
        # a probe never waits on a busy rank: it reads the last round and starts the next one
        if self.refreshed_at == 0.0:
            await self.refresh()
        elif time.monotonic() - self.refreshed_at > HEALTH_AGE_S and not self._refreshing.locked():
            task = asyncio.create_task(self.refresh(max_age=HEALTH_AGE_S))
            self.background.add(task)
            task.add_done_callback(self.background.discard)
        st, ok = self.status(), self.status().initialized and not held(self.preflight)   # held: out of service
        return web.json_response({"ok": ok, "role": st.role, "boot_id": st.boot_id, "last_error": st.last_error},
                                 status=200 if ok else 503)

    async def livez(self, request: web.Request) -> web.Response:
        # the front's own loop answers; the ranks' state is /healthz's (readiness)
        return web.json_response({"ok": True})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=scrape(request.app[METRICS], self.id, self.status().load),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def get_status(self) -> AgentStatus:
        await self.refresh(max_age=STATUS_AGE_S)
        return self.status()

    async def register_rank(self, req: RegisterRank) -> dict:
        self.register(req)
        return {"ok": True}

    async def get_ranks(self) -> dict:
        return {"ranks": [RegisterRank(rank=r, url=rk.url, boot_id=rk.boot_id or "-").model_dump()
                          for r, rk in sorted(self.ranks.items()) if rk.url]}

    async def gang(self, req: GangRequest) -> AgentStatus:
        if self.members.tell(req):   # their ranks read in the background: a busy pod answers late
            self.background.add(task := asyncio.create_task(self.members.adopt(missing=True)))
            task.add_done_callback(self.background.discard)
        return self.status()

    async def init(self) -> None:
        await self.each("POST", AgentPath.INIT)

    async def probe(self, req: ProbeRequest) -> dict:
        return await self.call(0, "POST", AgentPath.PROBE, req)

    async def set_faults(self, req: FaultsRequest) -> None:
        if req.switch_crash_after_ranks is not None:
            self.faults["switch_crash_after_ranks"] = req.switch_crash_after_ranks
        rest = req.model_dump(exclude_none=True, exclude={"switch_crash_after_ranks", *PREFLIGHT_FAULTS})
        if self.preflight:
            self.preflight.set_faults(req)
        if rest and rest != {"crash": False}:
            await self.each("POST", AgentPath.FAULTS, {r: FaultsRequest(**rest) for r in self.ranks})

    async def get_faults(self) -> dict:
        return await self.call(0, "GET", AgentPath.FAULTS)

    def crash(self) -> None:
        """The whole pod's agent dies at once, ranks included (a container crash)."""
        for p in self.procs.values():
            if p.returncode is None:
                p.kill()
        os._exit(137)

    async def proxy(self, request: web.Request) -> web.Response:
        """/r/<rank>/<path>: that rank's own API (the rank checks the token)."""
        try:
            r = int(request.match_info["rank"])
        except ValueError:
            return error_reply(404, "NotFound", "no such rank")
        call, got = (request.method, request.match_info["tail"]), presented_token(request)
        # the tail is the rank's path without its leading "/"
        if not (call == ("GET", AgentPath.STATUS[1:]) or (self.id.token and same_token(got, self.id.token))
                or (call == ("POST", AgentPath.NOTIFY[1:]) and same_token(got, self.id.peer_token))):
            return error_reply(403, "AgentForbidden", "a rank's own API takes the control token (its status: either; "
                                                 "its pull notices: the peer token)")
        rk = self.ranks.get(r)
        if rk is None or not rk.url:
            return error_reply(503, "RANK_NOT_REGISTERED", f"rank {r} has not registered with the pod's agent")
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "x-pd-agent-token",
                                                                              "content-type")}
        try:
            resp = await self.http.request(request.method, f"{rk.url}/{request.match_info['tail']}",
                                           content=await read_body(request), headers=headers, timeout=SERVE_S)
        except httpx.HTTPError as e:
            return error_reply(503, "RANK_UNREACHABLE", f"rank {r}: {e!r}")
        return web.Response(body=resp.content, status=resp.status_code,
                            content_type=resp.headers.get("content-type", "application/json").split(";")[0])


def build_front_app(front: Front, token: str | None, data_token: str | None = None,
                    peer_token: str | None = None) -> web.Application:
    app = api_app(token, data_token, peer_token, AgentMetrics())
    app[FRONT] = front
    app.add_routes(api_routes(front))
    return app


async def _preflight(front: Front, stop: asyncio.Event) -> bool:
    """The network preflight before the ranks start (enforced: until it passes); False at stop."""
    assert front.devices is not None
    try:
        front.preflight = Preflight.from_env(front.devices, time.time, front.env)
    except ValueError as e:   # a bad PD_PREFLIGHT: said, and the ranks start unchecked
        front.device_error = f"preflight: {e}"
        log.error("network preflight not run: %s", e)
    if front.preflight is not None:
        await front.preflight.gate(stop)
        front.preflight.start(stop)
    return not stop.is_set()


async def serve_front(identity: Identity, tp: int, host: str, port: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    http = httpx.AsyncClient(trust_env=False, timeout=RANK_CALL_S)
    front = Front(identity, tp, http)
    app = build_front_app(front, identity.token, identity.data_token, identity.peer_token)
    runner = app_runner(app, identity)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    metrics_runner = await serve_metrics(app, identity, host)
    log.info("pod agent %s (%s, %d ranks, cluster_ids %d-%d) serving on %s:%d", identity.pod, identity.role, tp,
             identity.cluster_id, identity.cluster_id + tp - 1, host, port)
    failed = asyncio.create_task(front.failed.wait())

    async def ready() -> bool:
        await front.refresh(max_age=HEALTH_AGE_S)
        return front.initialized
    mindie = attach_mindie(front.after_switch, identity.role, ready, stop)   # one push per pod, from here
    if await front.resolve_devices(stop) and await _preflight(front, stop):
        if front.external:
            log.info("waiting for %d rank processes to register at /v1/ranks", tp)
        else:
            await front.spawn(f"http://{host if host != '0.0.0.0' else '127.0.0.1'}:{port}{AgentPath.RANKS}")
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({failed, stopped}, return_when=asyncio.FIRST_COMPLETED)
    code = 1 if front.failed.is_set() and not stop.is_set() else 0
    front.terminating = True   # the instance refuses new requests; what it took on finishes first
    deadline = time.monotonic() + identity.drain_timeout_s
    while front.serving and not code and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    log.info("%s: stopping %d ranks (each drains for up to %.0fs)", "a rank failed" if code else "SIGTERM",
             len(front.procs), identity.drain_timeout_s)
    await front.stop_ranks(identity.drain_timeout_s + 5)
    failed.cancel()
    stopped.cancel()
    if metrics_runner is not None:
        await metrics_runner.cleanup()
    await runner.cleanup()
    await http.aclose()
    if mindie is not None:
        stop.set()
        await mindie[1]
        await mindie[0].aclose()
    if code:
        raise SystemExit(code)
