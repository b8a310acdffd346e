"""The agent's core: one LLM-DataDist engine and the operations the operator drives
(init, link, unlink, switch_role, verify, drain, status).

It codes against the llm_datadist API only, over whichever module it is given (the real
CANN module or the simulator), or over an engine its host process already created: the
real library allows one engine per process, so an inference server embeds this object
around its own engine and serves the same HTTP API (see server.py)."""
from __future__ import annotations

import asyncio
import hashlib
import os
import random
import time
import uuid
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Protocol

import httpx

from pd_contract.agent_api import (
    AgentPath,
    AgentStatus,
    DecodeRequest,
    DecodeResponse,
    DrainResult,
    LinkRequest,
    LinkResult,
    LinkState,
    Load,
    NotifyRequest,
    Peer,
    PrefillRequest,
    PrefillResponse,
    ProbeResponse,
    PullRequest,
    PullResponse,
    Role,
    UnlinkRequest,
    VerifyResult,
)
from pd_contract.names import BROKEN_CODES, LINKED_CODES

from .identity import Identity, proxy_environment
from .loadmeter import LoadMeter
from .notify import Notifier

if TYPE_CHECKING:
    from .reference import ReferenceEngine

PROBE_TTL_S = 60
PROBE_SEQ = 128
PENDING_TTL_S = 120        # a prefilled cache nobody pulled is removed after this
HEALTH_INTERVAL_S = 1.0    # how often links are checked, off the request path
UNLINK_WAIT_S = 10.0       # a terminating prefill waits this long at most for decoders to unlink it


def _code_name(code: Any) -> str:
    return getattr(code, "name", str(code))


class AgentError(Exception):
    """A request the engine refused; `code` is an LLMStatusCode name, `status` an HTTP code."""

    def __init__(self, code: str, message: str, status: int = 409, retry_after: int | None = None):
        super().__init__(message)
        self.code = code
        self.status = status
        self.retry_after = retry_after   # seconds, sent as Retry-After: the refusal is for now, not for good


class Serving(Protocol):
    """What serves the agent API's requests over the engine (pd_agent.inference's Inference, or
    an engine adapter's serving in pd_engine.rank): the core reads its load and in-flight work,
    the agent API hands it prefills, pulls and decodes."""
    ref: ReferenceEngine | None      # the reference engine, whose KV the content probe compares
    in_flight: int
    responding: int                  # streamed answers still being written (the HTTP layer counts them)

    def load(self) -> Load: ...

    def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def prefill(self, req: PrefillRequest) -> PrefillResponse: ...

    async def pull(self, req: PullRequest) -> PullResponse: ...

    async def decode(self, req: DecodeRequest, out: asyncio.Queue | None = None) -> DecodeResponse: ...

    def take_held(self, req_id: int) -> bytes: ...


class AgentCore:
    def __init__(self, llm, identity: Identity, engine: Any = None):
        self.llm, self.id, self.engine = llm, identity, engine
        self.owns_engine = engine is None
        self.boot_id = uuid.uuid4().hex
        self.peers: dict[int, Peer] = {}          # decoder: linked prompt peers by cluster id
        self.link_since: dict[int, float] = {}
        self.ops = asyncio.Lock()                 # link/unlink/switch never interleave
        self.link_codes: dict[int, str] = {}      # decoder: last code the engine gave per link
        self.draining = False
        self.terminating = False
        self.last_error = ""
        self.blocks_cache: Any = None             # paged: this engine's blocks cache (the backend's Cache)
        # paged, but the blocks are the inference server's (vLLM's, through its KV connector): the
        # core allocates none, and probes go through a cache of their own, never a live block
        self.engine_owns_blocks = False
        self._probes: dict[int, float] = {}       # prompt: probe req_id -> created
        self.kv_pending: dict[int, float] = {}    # prompt: req_id -> prefilled at, until pulled
        self.linked_by: set[int] = set()          # prompt: decoders that told us they linked
        self.notifier: Notifier | None = None     # set by the server
        self.inference: Serving | None = None     # set by pd_agent.inference (or an adapter) when serving
        self.meter = LoadMeter(started=time.monotonic())   # what the serving did lately (the report's window)
        self.device_ips, self.device_error = "", ""   # where the device IP came from (devices.resolve); why not
        self.preflight: Any = None    # the network preflight (a preflight.Preflight), run by server.py
        # The host's scheduler follows the engine's role: before-hooks may refuse a switch
        # (raise AgentError), after-hooks learn the new role. (old_role, new_role) -> None.
        self.before_switch: list[Callable[[str, str], Awaitable[None]]] = []
        self.after_switch: list[Callable[[str, str], Awaitable[None]]] = []

    # ---- engine ------------------------------------------------------------------------
    @property
    def initialized(self) -> bool:
        return self.engine is not None and getattr(self.engine, "_initialized", True)

    @property
    def role(self) -> Role:
        if self.engine is None:
            return self.id.role
        return "prompt" if self.engine.role == self.llm.LLMRole.PROMPT else "decoder"

    @property
    def paged(self) -> dict | None:
        return self.id.cache_desc.get("paged")

    def options(self, role: str) -> dict[str, str]:
        cfg = self.llm.LLMConfig()
        if self.id.device_id is not None:
            cfg.device_id = self.id.device_id
        cfg.sync_kv_timeout = self.id.sync_kv_timeout_ms
        cfg.enable_switch_role = self.id.switchable
        if role == "prompt":
            cfg.listen_ip_info = f"{self.id.ip}:{self.id.port}"
        return cfg.generate_options()

    async def init(self) -> None:
        if self.engine is not None and not self.owns_engine:
            await self._ensure_blocks_cache()
            return
        if self.engine is None:
            role = self.llm.LLMRole.PROMPT if self.id.role == "prompt" else self.llm.LLMRole.DECODER
            self.engine = self.llm.LLMDataDist(role, self.id.cluster_id)
        await asyncio.to_thread(self.engine.init, self.options(self.id.role))
        await self._ensure_blocks_cache()

    async def finalize(self) -> None:
        if self.engine is not None and self.owns_engine:
            await asyncio.to_thread(self.engine.finalize)

    def desc(self, batch: int | None = None, seq: int | None = None):
        d = self.id.cache_desc
        shape = list(d["shape"])
        if batch is not None:
            shape[0] = batch
        if seq is not None:
            shape[1] = seq
        return self.llm.CacheDesc(d["num_tensors"], shape, getattr(self.llm.DataType, d["data_type"]))

    def blocks_desc(self):
        p = self.paged
        assert p is not None, "a blocks cache is a paged engine's"
        d = self.id.cache_desc
        shape = [p["num_blocks"], p["block_size"], *d["shape"][2:]]
        return self.llm.CacheDesc(d["num_tensors"], shape, getattr(self.llm.DataType, d["data_type"]))

    async def _ensure_blocks_cache(self) -> None:
        if not self.paged or self.blocks_cache is not None or self.engine_owns_blocks:
            return
        mgr = self.engine.kv_cache_manager
        if self.role == "prompt":
            key = self.llm.BlocksCacheKey(self.id.cluster_id, self.id.model_id)
            self.blocks_cache = await asyncio.to_thread(mgr.allocate_blocks_cache, self.blocks_desc(), key)
        else:
            self.blocks_cache = await asyncio.to_thread(mgr.allocate_blocks_cache, self.blocks_desc())

    async def _drop_blocks_cache(self) -> None:
        if self.blocks_cache is not None:
            await asyncio.to_thread(self.engine.kv_cache_manager.deallocate_cache, self.blocks_cache)
            self.blocks_cache = None

    def _require(self, role: str, what: str) -> None:
        if not self.initialized:
            raise AgentError("NOT_INITIALIZED", "the engine is not initialised; POST /v1/init", 409)
        if self.role != role:
            raise AgentError("LLM_PARAM_INVALID", f"{what} needs a {role} engine; this one is {self.role}")

    # ---- links (decoder side) -------------------------------------------------------------
    def cluster_info(self, peer: Peer):
        info = self.llm.LLMClusterInfo()
        info.remote_cluster_id = peer.cluster_id
        info.remote_role_type = self.llm.LLMRole.PROMPT
        info.append_local_ip_info(self.id.ip, self.id.port)
        info.append_remote_ip_info(peer.ip, peer.port)
        return info

    async def link(self, req: LinkRequest) -> LinkResult:
        self._require("decoder", "link")
        async with self.ops:
            t0 = time.perf_counter()
            infos = [self.cluster_info(p) for p in req.peers]
            ret, rets = await asyncio.to_thread(self.engine.link_clusters, infos, req.timeout_ms)
            result = {}
            for peer, code in zip(req.peers, rets):
                name = _code_name(code)
                result[peer.name] = name
                if name in LINKED_CODES:
                    self.peers[peer.cluster_id] = peer
                    self.link_since.setdefault(peer.cluster_id, time.time())
                    self.link_codes[peer.cluster_id] = "LLM_SUCCESS"
            if _code_name(ret) != "LLM_SUCCESS":
                self.last_error = f"link_clusters: {_code_name(ret)} {result}"
            if self.notifier:
                for p in req.peers:
                    if result[p.name] in LINKED_CODES:
                        self.notifier.linked(p.agent_url, True)
            return LinkResult(ret=_code_name(ret), rets=result,
                              duration_ms=(time.perf_counter() - t0) * 1000)

    async def unlink(self, req: UnlinkRequest) -> LinkResult:
        if not self.initialized:
            raise AgentError("NOT_INITIALIZED", "the engine is not initialised", 409)
        async with self.ops:
            t0 = time.perf_counter()
            infos = [self.cluster_info(p) for p in req.peers]
            ret, rets = await asyncio.to_thread(self.engine.unlink_clusters, infos, req.timeout_ms, req.force)
            result = {}
            released = []
            for peer, code in zip(req.peers, rets):
                result[peer.name] = _code_name(code)
                if self.role == "decoder" and _code_name(code) in ("LLM_SUCCESS", "LLM_NOT_YET_LINK"):
                    known = self.peers.pop(peer.cluster_id, None)
                    self.link_since.pop(peer.cluster_id, None)
                    self.link_codes.pop(peer.cluster_id, None)
                    released.append((known or peer).agent_url)
            if self.notifier:
                for url in released:
                    self.notifier.linked(url, False)
            return LinkResult(ret=_code_name(ret), rets=result,
                              duration_ms=(time.perf_counter() - t0) * 1000)

    def link_states(self) -> list[LinkState]:
        """From what the engine last said; never calls into it (see check_links)."""
        if not self.initialized or self.role != "decoder":
            return []
        out = []
        for cid, peer in list(self.peers.items()):
            code = self.link_codes.get(cid, "LLM_SUCCESS")
            out.append(LinkState(name=peer.name, cluster_id=cid, ip=peer.ip, port=peer.port, code=code,
                                 healthy=code not in BROKEN_CODES, since=self.link_since.get(cid, 0),
                                 peer_boot_id=peer.boot_id))
        return out

    def note_link(self, cluster_id: int, code: str) -> None:
        """What a pull (or a check) said about a link: a broken one stays broken until relinked."""
        if cluster_id not in self.peers:
            return
        if code in BROKEN_CODES or self.link_codes.get(cluster_id) not in BROKEN_CODES:
            self.link_codes[cluster_id] = code

    def _check_links(self, cluster_ids: list[int]) -> dict[int, str]:
        codes = {}
        for cid in cluster_ids:
            try:
                self.engine.check_link_status(cid)
                codes[cid] = "LLM_SUCCESS"
            except self.llm.LLMException as e:
                codes[cid] = _code_name(e.status_code)
        return codes

    async def check_links(self) -> None:
        """Ask the engine about every link, in a worker thread: on the real library
        check_link_status may wait while a pull holds the link, and status polls must never
        wait on the data path. BUSY and PROCESSING keep the last verdict."""
        if not self.initialized or self.role != "decoder" or not self.peers:
            return
        codes = await asyncio.to_thread(self._check_links, list(self.peers))
        for cid, code in codes.items():
            if code in ("LLM_LINK_BUSY", "LLM_PROCESSING_LINK"):
                continue  # in use or being made: the last verdict stands
            self.note_link(cid, code)

    async def health_loop(self) -> None:
        while True:
            try:
                await self.check_links()
            except Exception as e:  # noqa: BLE001 - a failed check must not stop the checks
                self.last_error = f"check_link_status: {e}"
            await asyncio.sleep(HEALTH_INTERVAL_S)

    # ---- role switching -------------------------------------------------------------------
    async def switch_role(self, role: str) -> None:
        if not self.initialized:
            raise AgentError("NOT_INITIALIZED", "the engine is not initialised", 409)
        if role == self.role:
            return  # idempotent: a resumed switch may repeat this step
        if not self.id.switchable:
            raise AgentError("LLM_FEATURE_NOT_ENABLED", "this engine was initialised without "
                             "llm.EnableSwitchRole (PD_ENABLE_SWITCH_ROLE=0); it cannot switch roles")
        async with self.ops:
            old = self.role
            for hook in self.before_switch:
                await hook(old, role)
            target = self.llm.LLMRole.PROMPT if role == "prompt" else self.llm.LLMRole.DECODER
            opts = {"llm.listenIpInfo": f"{self.id.ip}:{self.id.port}"} if role == "prompt" else None
            await self._drop_blocks_cache()
            try:
                await asyncio.to_thread(self.engine.switch_role, target, opts)
            except self.llm.LLMException as e:
                await self._ensure_blocks_cache()
                raise AgentError(_code_name(e.status_code), str(e)) from e
            self.peers.clear()
            self.link_since.clear()
            self.link_codes.clear()
            self.linked_by.clear()
            self.meter.reset(left="prefill" if old == "prompt" else "decoder")
            await self._ensure_blocks_cache()
            for hook in self.after_switch:
                await hook(old, role)

    # ---- KV-path verification ---------------------------------------------------------------
    async def probe(self, req_id: int, content: bool = False) -> ProbeResponse:
        """Prompt side: put random bytes under a probe CacheKey (or in a block) for a decoder to pull;
        `content` on the reference engine: this rank's shard of the probe prompt's real KV."""
        self._require("prompt", "probe")
        mgr = self.engine.kv_cache_manager
        self._expire_probes()
        ref = self.inference.ref if self.inference is not None else None
        if content and ref is not None:
            shard = await asyncio.to_thread(ref.probe_shard)
            key = self.llm.CacheKey(self.id.cluster_id, req_id, self.id.model_id)
            seq = shard.shape[1]
            cache = await asyncio.to_thread(mgr.allocate_cache, self.desc(batch=1, seq=seq), [key])
            self._probes[req_id] = time.monotonic()   # expires with the probes, whatever happens next
            try:
                ref.write(cache, shard)
            finally:
                await asyncio.to_thread(mgr.deallocate_cache, cache)
            data = shard.tobytes()
            return ProbeResponse(prompt_cluster_id=self.id.cluster_id, req_id=req_id, model_id=self.id.model_id,
                                 sha256=hashlib.sha256(data).hexdigest(), bytes=len(data), content=True, seq=seq)
        if self.paged and self.blocks_cache is not None:
            cache = self.blocks_cache
            block = random.randrange(cache.cache_desc.shape[0])
            data = _fill(self.llm, cache, [block])
            return ProbeResponse(prompt_cluster_id=self.id.cluster_id, req_id=req_id, model_id=self.id.model_id,
                                 sha256=hashlib.sha256(data).hexdigest(), bytes=len(data), paged=True,
                                 block=block)
        key = self.llm.CacheKey(self.id.cluster_id, req_id, self.id.model_id)
        seq = min(PROBE_SEQ, self.id.cache_desc["shape"][1])
        cache = await asyncio.to_thread(mgr.allocate_cache, self.desc(batch=1, seq=seq), [key])
        data = _fill(self.llm, cache, [0])
        # Freed by the engine once the key is pulled (or removed when the probe expires).
        await asyncio.to_thread(mgr.deallocate_cache, cache)
        self._probes[req_id] = time.monotonic()
        return ProbeResponse(prompt_cluster_id=self.id.cluster_id, req_id=req_id, model_id=self.id.model_id,
                             sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))

    def _expire_probes(self) -> None:
        self._expire(self._probes, PROBE_TTL_S)

    def _expire(self, created: dict[int, float], ttl: float) -> None:
        """Remove the cache keys nobody pulled within ttl, so their memory is freed."""
        now = time.monotonic()
        for req_id, t in list(created.items()):
            if now - t > ttl:
                del created[req_id]
                try:
                    self.engine.kv_cache_manager.remove_cache_key(
                        self.llm.CacheKey(self.id.cluster_id, req_id, self.id.model_id))
                except Exception:  # noqa: BLE001 - already pulled, or gone with the engine
                    pass

    async def verify(self, peer: Peer, http: httpx.AsyncClient, token: str | None) -> VerifyResult:
        """Decoder side: ask the prefill's agent for a probe, pull it over the link, compare bytes."""
        self._require("decoder", "verify")
        base: dict[str, Any] = {"prefill": peer.name, "decoder": self.id.pod}
        if not peer.agent_url:
            raise AgentError("LLM_PARAM_INVALID", "verify needs peer.agent_url", 400)
        req_id = random.getrandbits(63)
        ref = self.inference.ref if self.inference is not None else None
        try:
            r = await http.post(f"{peer.agent_url}{AgentPath.PROBE}",
                                json={"req_id": req_id, "content": ref is not None},
                                headers={"Authorization": f"Bearer {token}"} if token else {}, timeout=10)
        except (httpx.HTTPError, httpx.InvalidURL) as e:
            return VerifyResult(ok=False, code="PEER_AGENT_UNREACHABLE",
                                message=f"prefill agent {peer.agent_url}: {e!r}", **base)
        if r.status_code != 200:
            return VerifyResult(ok=False, code="PEER_AGENT_ERROR",
                                message=f"prefill agent answered {r.status_code}: {r.text[:200]}", **base)
        try:
            probe = ProbeResponse.model_validate(r.json())
            if probe.paged and probe.block is None:
                raise ValueError("a paged probe without its block")
        except ValueError as e:
            return VerifyResult(ok=False, code="PEER_AGENT_ERROR",
                                message=f"prefill agent's probe is not one: {e}", **base)
        if probe.paged and self.blocks_cache is None:
            return VerifyResult(ok=False, code="ENGINE_MISMATCH", message="the prefill probes a block of its own "
                                "blocks cache, but this decoder's blocks are its inference server's: both sides "
                                "must run the same engine (spec.engine)", **base)
        mgr = self.engine.kv_cache_manager
        t0 = time.perf_counter()
        pulled = None
        try:
            if probe.paged:
                assert probe.block is not None   # a paged probe without its block was refused above
                cache = self.blocks_cache
                key = self.llm.BlocksCacheKey(probe.prompt_cluster_id, probe.model_id)
                await asyncio.to_thread(mgr.pull_blocks, key, cache, [probe.block], [probe.block])
                pull_ms = (time.perf_counter() - t0) * 1000
                got = _read(cache, [probe.block])
            else:
                seq = min(PROBE_SEQ, self.id.cache_desc["shape"][1])
                if probe.content and probe.seq:   # the peer's word, bounded by this engine's cache
                    seq = min(probe.seq, self.id.cache_desc["shape"][1])
                cache = await asyncio.to_thread(mgr.allocate_cache, self.desc(batch=1, seq=seq))
                try:
                    key = self.llm.CacheKey(probe.prompt_cluster_id, probe.req_id, probe.model_id)
                    await asyncio.to_thread(mgr.pull_cache, key, cache, 0)
                    pull_ms = (time.perf_counter() - t0) * 1000
                    got = _read(cache, [0])
                    pulled = ref.read(cache, seq) if probe.content and ref is not None else None
                finally:
                    await asyncio.to_thread(mgr.deallocate_cache, cache)
        except self.llm.LLMException as e:
            return VerifyResult(ok=False, code=_code_name(e.status_code), message=str(e), **base)
        if ref is not None and not probe.content:
            return VerifyResult(ok=False, code="ENGINE_MISMATCH", bytes=len(got), pull_ms=pull_ms,
                                message="this decoder runs the reference engine but the prefill does not (its probe "
                                        "has no content): both sides must run the same spec.sim.engine", **base)
        if pulled is not None and ref is not None:
            wrong = await asyncio.to_thread(ref.check_probe, pulled)
            if wrong is not None:
                return VerifyResult(ok=False, code="KV_CONTENT_MISMATCH", bytes=len(got), pull_ms=pull_ms,
                                    message=wrong, **base)
        if hashlib.sha256(got).hexdigest() != probe.sha256:
            return VerifyResult(ok=False, code="DATA_MISMATCH", bytes=len(got), pull_ms=pull_ms,
                                message="pulled bytes differ from the prefill's probe", **base)
        return VerifyResult(ok=True, code="LLM_SUCCESS", bytes=len(got), pull_ms=pull_ms, **base)

    # ---- pending KV caches (prompt side) ----------------------------------------------------------
    def cache_ready(self, req_id: int) -> None:
        """A prefill left a cache under CacheKey(this cluster, req_id) for a decoder to pull."""
        self.kv_pending[req_id] = time.monotonic()

    def notify(self, req: NotifyRequest) -> None:
        for req_id in req.pulled:
            self.kv_pending.pop(req_id, None)
        for req_id in req.released:   # nobody pulls this copy: free it now rather than at its TTL
            if self.kv_pending.pop(req_id, None) is not None and self.initialized:
                try:
                    self.engine.kv_cache_manager.remove_cache_key(
                        self.llm.CacheKey(self.id.cluster_id, req_id, self.id.model_id))
                except Exception:  # noqa: BLE001 - already gone
                    pass
        if req.linked is True:
            self.linked_by.add(req.decoder_cluster_id)
        elif req.linked is False:
            self.linked_by.discard(req.decoder_cluster_id)

    def pending_kv(self) -> int:
        self._expire(self.kv_pending, PENDING_TTL_S)
        return len(self.kv_pending)

    def incoming(self) -> list[int]:
        """Prompt side: the decoders linked to this engine."""
        if self.initialized and self.role == "prompt" and hasattr(self.engine, "sim_links"):
            return sorted(self.engine.sim_links())
        return sorted(self.linked_by) if self.role == "prompt" else []

    # ---- drain ------------------------------------------------------------------------------
    def in_flight(self) -> tuple[int, int]:
        """Requests being served (a streamed answer counts until its last line is written, so a
        drain that ends the process never cuts a response short), and KV caches not yet pulled."""
        inf = self.inference
        return (inf.in_flight + inf.responding if inf else 0), self.pending_kv()

    async def drain(self, timeout_s: float) -> DrainResult:
        """Stop taking requests, then wait for in-flight work and un-pulled KV caches."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while True:
            in_flight, pending = self.in_flight()
            if (in_flight == 0 and pending == 0) or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.05)
        return DrainResult(draining=True, in_flight=in_flight, pending_kv=pending,
                           drained=in_flight == 0 and pending == 0)

    async def undrain(self) -> DrainResult:
        self.draining = False
        in_flight, pending = self.in_flight()
        return DrainResult(draining=False, in_flight=in_flight, pending_kv=pending, drained=False)

    async def terminate(self, timeout_s: float) -> dict:
        """SIGTERM: refuse new work, finish in-flight requests, wait until every pending KV
        cache was pulled (or expired), and on the prompt side until the decoders unlinked
        this engine (the operator does that once nothing is pending), all within timeout_s."""
        self.terminating = True
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        res = await self.drain(timeout_s)
        drained_ms = (time.monotonic() - t0) * 1000
        if self.role == "decoder" and self.notifier:
            # our links go with this process: tell the prefills, so none waits for us to let go
            for p in self.peers.values():
                self.notifier.linked(p.agent_url, False)
            await self.notifier.flush()
        # the decoders' agents report their links to us; a real engine does not list them
        unlink_deadline = min(deadline, time.monotonic() + UNLINK_WAIT_S)
        while self.role == "prompt" and self.linked_by and time.monotonic() < unlink_deadline:
            await asyncio.sleep(0.05)
        return {"drained": res.drained, "in_flight": res.in_flight, "pending_kv": res.pending_kv,
                "drain_ms": round(drained_ms, 1), "still_linked": sorted(self.linked_by),
                "total_ms": round((time.monotonic() - t0) * 1000, 1)}

    # ---- status -----------------------------------------------------------------------------
    def status(self) -> AgentStatus:
        load = self.meter.fill(self.inference.load() if self.inference else Load())
        if self.initialized:
            mgr = self.engine.kv_cache_manager
            load.kv_used_bytes = getattr(mgr, "used_bytes", 0)
        incoming = self.incoming()
        scale = self.llm.memory_scale() if hasattr(self.llm, "memory_scale") else 1
        return AgentStatus(
            pod=self.id.pod, role=self.role, cluster_id=self.id.cluster_id, boot_id=self.boot_id,
            backend=self.id.backend, initialized=self.initialized, ip=self.id.ip, port=self.id.port,
            model_id=self.id.model_id, links=self.link_states(), incoming=incoming, load=load,
            draining=self.draining, terminating=self.terminating, switchable=self.id.switchable,
            proxy_env=proxy_environment(), memory_scale=scale,
            cache_desc=self.id.cache_desc, engine=self.id.engine, last_error=self.last_error,
            device_ips=self.device_ips, device_error=self.device_error,
            preflight=self.preflight.report if self.preflight else None,
        )


def _host_view(cache) -> None:
    # Byte-level probes read and write cache memory from Python. The simulator exposes it
    # (Cache.slot); on the real backend the cache lives in NPU memory and needs a device
    # copy (torch_npu), which this agent does not do: say so instead of guessing.
    if not hasattr(cache, "slot"):
        raise AgentError("LLM_FEATURE_NOT_ENABLED",
                         "byte-level KV probes need host access to cache memory, which this backend "
                         "does not expose; links are still checked with check_link_status", 501)


def _fill(llm, cache, slots: list[int]) -> bytes:
    _host_view(cache)
    out = bytearray()
    for t in range(cache.cache_desc.num_tensors):
        for s in slots:
            view = cache.slot(t, s)
            data = os.urandom(len(view))
            view[:] = data
            out += data
    return bytes(out)


def _read(cache, slots: list[int]) -> bytes:
    _host_view(cache)
    out = bytearray()
    for t in range(cache.cache_desc.num_tensors):
        for s in slots:
            out += cache.slot(t, s)
    return bytes(out)
