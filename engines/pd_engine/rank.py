"""One rank process under pd-operator: its identity, its LLM-DataDist engine, the agent API the
operator drives it through, and the adapter that computes.

`serve_rank(adapter, identity_env=os.environ)` is the entry point an inference server calls once
per rank process. It builds the pieces pd-operator already has and ties the adapter in:

1. the identity from the env the operator (and the pod's agent, `pd_agent.front.rank_env`)
   injects: `Identity.from_env` (role, cluster id, device IP and port, CacheDesc, tokens);
2. the LLM-DataDist engine: CANN's `llm_datadist` for `PD_BACKEND=llm-datadist`, the simulator
   `llm_datadist_sim` for `sim`, initialised as the agent would (`AgentCore.options`);
3. `adapter.register_kv_caches(rank)`, checked against the operator's CacheDesc;
4. the agent core over that engine (`pd_agent.core.AgentCore(llm, identity, engine)`), with the
   adapter's `before_switch`/`after_switch` as the core's switch hooks and its `load()` in the
   core's status; its HTTP API (`pd_agent.server.build_app`, without the simulated serving) on a
   local port, registered with the pod's agent (`AgentClient.register`, `POST /v1/ranks`), so the
   operator's link, unlink, verify and switch calls reach this engine.

It returns a `RankServer` (`block=False`) or serves until SIGTERM, then drains like the agent."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from collections.abc import Mapping
from typing import Any

import httpx

from pd_agent.core import AgentCore, AgentError
from pd_agent.identity import Identity, import_backend
from pd_contract import agent_api as api
from pd_contract.agent_api import AgentPath, Load
from pd_contract.engine_env import PD_AGENT_URL, PD_RANK, PD_RANK_REGISTER_URL, PD_TENSOR_PARALLEL

from .adapter import (
    CacheHandle,
    DecodeRequest,
    EngineAdapter,
    NotLinked,
    PrefillRequest,
    PrefillResult,
    PullTarget,
    Rank,
    Sampling,
    SwitchRefused,
    check_layout,
    pull,
    serve_decode,
)

log = logging.getLogger("pd_engine")
DEFAULT_AGENT_URL = "http://127.0.0.1:8080"
HELD_TTL_S = 60.0   # a pulled shard whose decode never came is freed after this
HELD_MAX = 256      # and never more held than this


class AgentClient:
    """The rank's calls to its pod's agent: where it registers its agent API (`POST /v1/ranks`,
    body `{"rank", "url", "boot_id"}`, the control token). The URL: `PD_RANK_REGISTER_URL` (what
    the pod's agent gives the ranks it starts), else `PD_AGENT_URL` (default
    http://127.0.0.1:8080) + `/v1/ranks`. The pod's agent reads each rank's cluster id, device IP
    and port from that rank's `/v1/status`. Tests pass a client of their own."""

    def __init__(self, env: Mapping[str, str] | None = None, token: str | None = None, timeout_s: float = 60.0):
        env = os.environ if env is None else env
        base = (env.get(PD_AGENT_URL) or DEFAULT_AGENT_URL).rstrip("/")
        self.register_url = env.get(PD_RANK_REGISTER_URL) or f"{base}{AgentPath.RANKS}"
        self.token = token
        self.timeout_s = timeout_s

    def register(self, rank: int, url: str, boot_id: str) -> None:
        """Until the agent takes it (it may start after this process), at most timeout_s."""
        body = {"rank": rank, "url": url, "boot_id": boot_id}
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        deadline = time.monotonic() + self.timeout_s
        last = ""
        with httpx.Client(trust_env=False, timeout=5) as http:
            while time.monotonic() < deadline:
                try:
                    r = http.post(self.register_url, json=body, headers=headers)
                    if r.status_code == 200:
                        return
                    last = f"{r.status_code} {r.text[:200]}"
                    if r.status_code in (400, 401, 403):
                        break
                except httpx.HTTPError as e:
                    last = repr(e)
                time.sleep(0.5)
        raise RuntimeError(f"registering rank {rank} with the pod's agent at {self.register_url}: {last}")


class _AdapterServing:
    """Stands where the agent core keeps its serving (`core.inference`): the agent API's
    `/v1/prefill`, `/v1/pull` and `/v1/decode` (what pd-gateway and the pod's agent send) are
    served by the adapter, and its load figures are the core's. An adapter over the reference model
    (`reference`, as `ReferenceAdapter` has) also lets the content probe compare the real KV."""

    def __init__(self, core: AgentCore, adapter: EngineAdapter, rank: Rank):
        self.core = core
        self.adapter = adapter
        self.rank = rank
        self.ref = getattr(adapter, "reference", None)
        self.in_flight = 0
        self.responding = 0
        self.held: dict[int, tuple[float, CacheHandle, PullTarget]] = {}   # pulled on this rank, for its decode

    def load(self) -> Load:
        f = self.adapter.load()
        return Load(queue_depth=f.queue_depth, running=f.running, in_flight=max(f.running, self.in_flight),
                    kv_capacity_bytes=f.kv_capacity_bytes, kv_used_bytes=f.kv_used_bytes)

    def start(self) -> None:
        return None

    async def stop(self) -> None:
        for _, _, target in self.held.values():
            self._free(target)
        self.held.clear()

    def _admit(self, role: str, admitted: bool) -> None:
        """Refusals before any work, as the simulator's serving answers them, so a router can send
        the request elsewhere (DRAINING, ROLE_CHANGED: 503, retryable)."""
        core = self.core
        if core.initialized and core.draining and not admitted:
            raise AgentError("DRAINING", f"{core.id.pod} is draining; send the request elsewhere", 503)
        if core.initialized and core.role != role:
            raise AgentError("ROLE_CHANGED", f"{core.id.pod} now serves as {core.role}; send the "
                             f"{'prefill' if role == 'prompt' else 'decode'} elsewhere", 503)
        core._require(role, "prefill" if role == "prompt" else "decode")

    def _hold(self, req_id: int, handle: CacheHandle, target: PullTarget) -> None:
        """Keep a pulled shard for its decode; expired, over the bound or replaced ones are freed."""
        now = time.monotonic()
        old = self.held.pop(req_id, None)   # a retried pull: the first one's target goes
        if old is not None:
            self._free(old[2])
        for k, (at, _, t) in list(self.held.items()):   # in the order they were pulled
            if now - at > HELD_TTL_S or len(self.held) >= HELD_MAX:
                self._free(t)
                del self.held[k]
        self.held[req_id] = (now, handle, target)

    def _free(self, target: PullTarget) -> None:
        if target.owned:
            self.core.engine.kv_cache_manager.deallocate_cache(target.cache)

    @staticmethod
    def _sampling(s: Any) -> Sampling:
        return Sampling(s.temperature, s.top_p, s.seed) if s is not None else Sampling()

    async def prefill(self, req: api.PrefillRequest) -> api.PrefillResponse:
        self._admit("prompt", req.admitted)
        if req.token_ids is None:
            raise AgentError("LLM_PARAM_INVALID", "this engine computes its prompts: send token_ids", 400)
        self.in_flight += 1
        t0 = time.monotonic()
        try:
            out = await asyncio.to_thread(self.adapter.prefill, PrefillRequest(
                req.req_id, tuple(req.token_ids), self._sampling(req.sampling)))
        except ValueError as e:
            raise AgentError("LLM_PARAM_INVALID", f"the engine refused the prompt: {e}", 400) from e
        finally:
            self.in_flight -= 1
        self.core.cache_ready(req.req_id)      # counted as pending until a decoder pulls it
        self.core.meter.arrived(len(req.token_ids))
        return api.PrefillResponse(prompt_cluster_id=out.handle.cluster_id, req_id=req.req_id,
                                   model_id=out.handle.model_id, queue_ms=0.0,
                                   prefill_ms=(time.monotonic() - t0) * 1000, first_token=out.first_token)

    def _handle(self, req: api.DecodeRequest | api.PullRequest) -> CacheHandle:
        return CacheHandle(req.prompt_cluster_id, req.req_id, self.core.id.model_id, req.prompt_tokens)

    async def _pull(self, req: api.DecodeRequest | api.PullRequest) -> tuple[CacheHandle, PullTarget, float]:
        """The handle's KV pulled over the operator's link into a target of the adapter's."""
        handle = self._handle(req)
        t0 = time.monotonic()
        llm = self.core.llm
        try:
            # one thread call, shielded: a cancelled request (the client went away, a shutdown)
            # never frees a target the pull is still writing into, nor leaks one just allocated
            target = await asyncio.shield(asyncio.to_thread(self._target_and_pull, handle))
        except ValueError as e:
            raise AgentError("LLM_PARAM_INVALID", f"the engine refused the decode: {e}", 400) from e
        except NotLinked as e:
            raise AgentError("NOT_LINKED", f"{e}; nothing was pulled", 503) from e
        except llm.LLMException as e:
            code = getattr(e.status_code, "name", str(e.status_code))
            self.core.note_link(req.prompt_cluster_id, code)
            raise AgentError(code, str(e), 502) from e
        self.core.note_link(req.prompt_cluster_id, "LLM_SUCCESS")
        peer = self.core.peers.get(req.prompt_cluster_id)
        if self.core.notifier and peer is not None and peer.agent_url:
            self.core.notifier.pulled(peer.agent_url, req.req_id)
        return handle, target, (time.monotonic() - t0) * 1000

    def _target_and_pull(self, handle: CacheHandle) -> PullTarget:
        target = self.adapter.pull_target(handle)
        try:
            pull(self.rank, handle, target)
        except BaseException:
            self._free(target)
            raise
        return target

    async def pull(self, req: api.PullRequest) -> api.PullResponse:
        """A rank of a multi-rank decoder: pull this rank's shard; the decode (rank 0) follows."""
        self._admit("decoder", req.admitted)
        self.in_flight += 1
        try:
            handle, target, ms = await self._pull(req)
            if self.rank.rank != 0:
                # the pod's rank 0 decodes (an MLA rank holds the whole latent): this shard arrived,
                # which is what the first token waits for; nothing here reads it again
                await asyncio.to_thread(self._free, target)
                return api.PullResponse(pull_ms=ms)
            self._hold(req.req_id, handle, target)
            return api.PullResponse(pull_ms=ms)
        finally:
            self.in_flight -= 1

    async def decode(self, req: api.DecodeRequest, out: asyncio.Queue | None = None) -> api.DecodeResponse:
        """Tokens are queued for a stream once the adapter's decode returned them all (the adapter
        interface decodes a request whole)."""
        got = self.held.pop(req.req_id, None) if req.kv_pulled_ms is not None else None
        try:
            self._admit("decoder", req.admitted)
            if req.first_token is None:
                raise AgentError("LLM_PARAM_INVALID", "the decode continues from the prefill's first token: send "
                                 "first_token (the prefill's answer has it)", 400)
        except AgentError:
            if got is not None:   # refused: what the pod's agent had this rank pull goes now
                self._free(got[2])
            raise
        self.in_flight += 1
        t0 = time.monotonic()
        try:
            if req.kv_pulled_ms is not None:   # the pod's agent had every rank pull already
                if got is None:
                    raise AgentError("KV_NOT_HELD", f"rank {self.core.id.rank} holds no pulled KV for req_id "
                                     f"{req.req_id}", 502)
                handle, target, pull_ms = got[1], got[2], req.kv_pulled_ms
            else:
                handle, target, pull_ms = await self._pull(req)
            try:   # the adapter's decode frees the target (PullTarget.owned), whatever happens
                tokens = await asyncio.shield(asyncio.to_thread(self.adapter.decode, handle, target, DecodeRequest(
                    req.first_token, req.output_tokens, self._sampling(req.sampling))))
            except ValueError as e:
                raise AgentError("LLM_PARAM_INVALID", f"the engine refused the decode: {e}", 400) from e
            ms = (time.monotonic() - t0) * 1000
            for i, tok in enumerate(tokens):
                if out is not None:
                    out.put_nowait({"token": i, "ms": round(ms, 2), "id": tok})
            now = time.monotonic()
            self.core.meter.generated(len(tokens), now)   # Goodput's output tokens per request
            self.core.meter.completed(now)
            return api.DecodeResponse(tokens=len(tokens), token_ids=list(tokens), pull_ms=pull_ms,
                                      first_token_ms=ms, tbt_ms_mean=0.0, tbt_ms_max=0.0, total_ms=ms)
        finally:
            self.in_flight -= 1

    def take_held(self, req_id: int) -> bytes:
        raise AgentError("KV_NOT_HELD", "an adapter's ranks decode from their own pulled KV (each rank "
                         "continues on its own shard): nothing is gathered", 404)


def rank_env_for(env: Mapping[str, str], rank: int, tensor_parallel: int | None = None,
                 wait_s: float = 120.0) -> dict[str, str]:
    """Rank `rank`'s identity env, from the pod's (what the operator injects in the engine container):
    its cluster id, device IP and port from the device plugin's annotation (re-read until it names
    every rank, at most `wait_s`: the annotation may come after the container starts) or the pod IP,
    and where it registers. An env that already names its rank (PD_RANK) is returned as it is."""
    if env.get(PD_RANK):
        return dict(env)
    from pd_agent.devices import DeviceError, resolve_env
    from pd_agent.front import rank_env
    tp = tensor_parallel or int(env.get(PD_TENSOR_PARALLEL) or 1)
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} of a pod with tensor parallel {tp}")
    pod = {**env, PD_TENSOR_PARALLEL: str(tp)}
    deadline = time.monotonic() + wait_s
    while True:
        try:
            devices = resolve_env(pod)
            problem = "" if devices.complete else devices.error
        except DeviceError as e:
            problem = str(e)
        if not problem:
            return rank_env(pod, devices, rank, AgentClient(env).register_url)
        if time.monotonic() >= deadline:
            raise RuntimeError(f"rank {rank}: no device IP after {wait_s:.0f}s: {problem}")
        log.warning("rank %d: %s; re-reading in 1s", rank, problem)
        time.sleep(1.0)


def open_rank(identity_env: Mapping[str, str] | None = None, llm: Any = None) -> tuple[Identity, Rank, AgentCore]:
    """The identity, the initialised engine and the agent core over it (steps 1, 2 and 4's core)."""
    identity = Identity.from_env(dict(os.environ if identity_env is None else identity_env))
    llm = llm or import_backend(identity.backend)
    role = llm.LLMRole.PROMPT if identity.role == "prompt" else llm.LLMRole.DECODER
    engine = llm.LLMDataDist(role, identity.cluster_id)
    core = AgentCore(llm, identity, engine=engine)
    engine.init(core.options(identity.role))
    rank = Rank(llm, engine, identity.cluster_id, identity.model_id, identity.rank, identity.tensor_parallel,
                dict(identity.cache_desc))
    return identity, rank, core


class RankServer:
    """A rank process's pieces once `serve_rank` built them: `rank` (identity and engine), `core`
    (the agent core), `url` (its agent API), and the adapter's serving paths."""

    def __init__(self, adapter: EngineAdapter, identity: Identity, rank: Rank, core: AgentCore):
        self.adapter, self.identity, self.rank, self.core = adapter, identity, rank, core
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: Any = None

    # -- serving (what the inference server's own API calls) --
    def prefill(self, req: PrefillRequest) -> PrefillResult:
        out = self.adapter.prefill(req)
        self.core.cache_ready(out.handle.req_id)   # counted as pending until a decoder pulls it
        self.core.meter.arrived(len(req.token_ids))
        return out

    def decode(self, handle: CacheHandle, req: DecodeRequest) -> list[int]:
        return serve_decode(self.adapter, self.rank, handle, req)

    # -- the agent API, on a thread of its own --
    def start_api(self, host: str = "127.0.0.1", port: int = 0) -> str:
        from aiohttp import web

        from pd_agent.server import build_app

        ident = self.identity
        app = build_app(self.core, ident.token, serve_inference=False, data_token=ident.data_token,
                        peer_token=ident.peer_token)
        ready = threading.Event()
        failed: list[BaseException] = []

        async def up() -> None:
            self._runner = web.AppRunner(app)
            await self._runner.setup()
            site = web.TCPSite(self._runner, host, port)
            await site.start()
            bound = self._runner.addresses[0][1]
            self.url = f"http://{host}:{bound}"

        def run() -> None:
            loop = self._loop = asyncio.new_event_loop()
            try:
                loop.run_until_complete(up())
            except BaseException as e:  # noqa: BLE001 - reported to the caller
                failed.append(e)
                ready.set()
                return
            ready.set()
            loop.run_forever()

        self._thread = threading.Thread(target=run, name=f"pd-rank-{ident.rank}-api", daemon=True)
        self._thread.start()
        ready.wait()
        if failed:
            raise failed[0]
        return self.url

    def run(self, coro: Any, timeout: float | None = None) -> Any:
        """Run a coroutine on the API's loop (the core's calls: link, switch_role, ...)."""
        if self._loop is None:
            raise RuntimeError("start_api first")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def stop(self) -> None:
        if self._loop is not None:
            if self._runner is not None:
                self.run(self._runner.cleanup(), 30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._thread is not None:
                self._thread.join(10)
            self._loop = None
        self.rank.engine.finalize()


def _hook(fn: Any) -> Any:
    async def call(old: str, new: str) -> None:
        try:
            await asyncio.to_thread(fn, old, new)
        except SwitchRefused as e:
            raise AgentError("SWITCH_REFUSED", f"the engine refused the switch: {e}", 409) from e
    return call


def serve_rank(adapter: EngineAdapter, identity_env: Mapping[str, str] | None = None, *, host: str = "127.0.0.1",
               port: int = 0, agent: AgentClient | None = None, block: bool = True, llm: Any = None) -> RankServer:
    """The entry point of a rank process (see the module docstring). `identity_env`: the env the
    operator injected (default os.environ). `agent`: where to register (default `AgentClient`
    from that env; `register=None`-like stubs in tests). `block`: serve until SIGTERM/SIGINT, then
    drain (`PD_DRAIN_TIMEOUT_S`) and finalize; else return the running `RankServer`."""
    identity, rank, core = open_rank(identity_env, llm)
    server = RankServer(adapter, identity, rank, core)
    try:
        layout = adapter.register_kv_caches(rank)
        check_layout(layout, identity.cache_desc)
        core.before_switch.append(_hook(adapter.before_switch))
        core.after_switch.append(_hook(adapter.after_switch))
        core.inference = _AdapterServing(core, adapter, rank)
        url = server.start_api(host, port)
        (agent or AgentClient(identity_env, identity.token)).register(identity.rank, url, core.boot_id)
    except BaseException:
        server.stop()
        raise
    log.info("rank %d (%s, cluster_id %d) agent API on %s, datadist %s:%d", identity.rank, identity.role,
             identity.cluster_id, server.url, identity.ip, identity.port)
    if not block:
        return server
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("drained: %s", server.run(core.terminate(identity.drain_timeout_s)))
    server.stop()
    return server
