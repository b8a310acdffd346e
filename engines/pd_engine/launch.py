"""`python3 -m pd_engine.launch -- <server command...>`: an inference server whose KV connector takes
its role at start (vllm-ascend's Mooncake connector: `kv_role` kv_producer or kv_consumer), under
pd-operator. The operator runs the engine container of `spec.engine.kvTransfer: mooncake` this way.

The launcher
1. registers with the pod's agent as the pod's ranks (`POST /v1/ranks`, each rank's URL its own
   prefix here), retrying while the agent refuses (its network preflight has not passed), so the
   server starts only on a pod cleared to serve;
2. starts the server with the pod's role's `--kv-transfer-config` (pd_contract.mooncake: kv_role,
   kv_port, engine_id the pod's name with a suffix new at every start, both roles' parallel sizes
   from PD_KV_PARALLEL), in a process group of its own;
3. answers the rank API the pod's agent relays the operator's calls to:
   - status: the role, initialised while the server answers `/health`, its load from vLLM's own
     `/metrics` (`vllm:num_requests_running`, `vllm:num_requests_waiting`);
   - link / unlink: Mooncake connects per request, so a link is the operator's pairing, checked by
     connecting to the prefill rank's side channel (its kv_port + rank);
   - verify: a real request through the pair: a prefill on the peer's server (do_remote_decode, one
     token), its kv_transfer_params to this server, the output compared with this server computing
     the same prompt alone (KV_CONTENT_MISMATCH if they differ);
   - drain: waits until the server holds no request (and no prefilled blocks, where it reports
     them);
   - switch_role: a drained restart in place: the server is stopped (SIGTERM, then killed after the
     drain timeout) and started again with the flipped kv_role; the pod, its NPUs and the agent
     stay. The call waits 3 s, then answers 503 SWITCH_IN_PROGRESS; a repeated call joins the
     restart in progress, and the role is the old one until the server serves in the new.
4. exits with the server's code when the server exits on its own (the container restarts); on
   SIGTERM waits until the server holds no request (at most the drain timeout), then stops it.
Without a command after `--` it runs `vllm serve`."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from pd_contract import engine_env as ev
from pd_contract import mooncake
from pd_contract.agent_api import (
    AgentPath,
    AgentStatus,
    DrainRequest,
    DrainResult,
    LinkRequest,
    LinkResult,
    LinkState,
    Load,
    Role,
    SwitchRoleRequest,
    UnlinkRequest,
    VerifyRequest,
    VerifyResult,
)

log = logging.getLogger("pd_engine.launch")
HEALTH_EVERY_S = 1.0
SWITCH_WAIT_S = 3.0           # switch_role waits this long for the restart, then says it is in progress
PROBE_TIMEOUT_S = 12.0        # a pair's verification, whole (the pod's agent waits 15 s for it)
METASERVER_GRACE_S = 3.0      # layerwise: how long after the decoder's reply the prefill's may come
START_TIMEOUT_S = 1800.0      # weights load: a server that has not answered /health by then failed
PROBE_PROMPT = "pd-operator checks the KV path between a prefill and a decoder with this prompt."
PROBE_TOKENS = 8
METRIC = re.compile(r"^(vllm:num_requests_running|vllm:num_requests_waiting)(\{[^}]*\})?\s+([0-9.eE+-]+)", re.M)


@dataclass(frozen=True)
class Settings:
    """What the launcher runs from: the pod's env (the operator's) and the server command."""
    command: tuple[str, ...]
    kind: mooncake.Kind
    pod: str
    role: Role
    tensor_parallel: int
    kv_port: int
    parallel: dict
    engine_port: int
    host: str                     # the pod's address: where the server and its side channels listen
    drain_timeout_s: float
    token: str | None
    identity: Any = field(repr=False)
    env: Mapping[str, str] = field(repr=False, default_factory=dict)

    @staticmethod
    def from_env(argv: Sequence[str], env: Mapping[str, str]) -> Settings:
        from pd_agent.identity import Identity
        ident = Identity.from_env({k: v for k, v in env.items() if k != ev.PD_RANK})   # the pod's rank 0
        kind = env.get(ev.PD_KV_TRANSFER) or "mooncake"
        if not mooncake.is_mooncake(kind):
            raise SystemExit(f"{ev.PD_KV_TRANSFER}={kind!r}: pd_engine.launch runs "
                             f"{' or '.join(mooncake.CONNECTORS)}")
        cmd = tuple(argv[1:] if argv and argv[0] == "--" else argv) or ("vllm", "serve")
        port = int(env.get(ev.PD_ENGINE_PORT) or 0)
        if not port:
            raise SystemExit(f"{ev.PD_ENGINE_PORT} (spec.engine.port) is required: the launcher checks the "
                             "server there")
        given = next((a.split("=", 1)[1] if "=" in a else b for a, b in zip(cmd, (*cmd[1:], ""))
                      if a == "--port" or a.startswith("--port=")), None)
        if given is not None and given != str(port):
            raise SystemExit(f"the server's --port {given} is not {ev.PD_ENGINE_PORT} {port} (spec.engine.port): the "
                             "launcher would wait for a server on the other port")
        parallel = json.loads(env.get(ev.PD_KV_PARALLEL) or "{}") or mooncake.extra_config(1, 1)
        return Settings(command=cmd, kind=kind, pod=ident.pod, role=ident.role,  # type: ignore[arg-type]
                        tensor_parallel=int(env.get(ev.PD_TENSOR_PARALLEL) or 1),
                        kv_port=int(env.get(ev.PD_KV_PORT) or mooncake.DEFAULT_KV_PORT), parallel=parallel,
                        engine_port=port, host=ev.engine_ip(env), drain_timeout_s=ident.drain_timeout_s,
                        token=ident.token, identity=ident, env=dict(env))

    def argv(self, role: str, engine_id: str) -> list[str]:
        """The server's command with the role's --kv-transfer-config (one given is replaced).
        engine_id: new at every start (a peer caches an engine's addresses by its id)."""
        cfg = mooncake.kv_transfer_config(role, kv_port=self.kv_port, engine_id=engine_id,  # type: ignore[arg-type]
                                          prefill_tp=self.parallel["prefill"]["tp_size"],
                                          decoder_tp=self.parallel["decode"]["tp_size"],
                                          prefill_dp=self.parallel["prefill"]["dp_size"],
                                          decoder_dp=self.parallel["decode"]["dp_size"], kind=self.kind)
        out, skip = [], False
        for a in self.command:
            if skip:
                skip = False
                continue
            if a == "--kv-transfer-config":
                skip = True
                continue
            if a.startswith("--kv-transfer-config="):
                continue
            out.append(a)
        return out + ["--kv-transfer-config", json.dumps(cfg, separators=(",", ":"), sort_keys=True)]


def _signal_group(proc: Any, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def parse_load(metrics_text: str) -> tuple[int, int]:
    """(running, waiting) from vLLM's /metrics."""
    running = waiting = 0.0
    for name, _, value in METRIC.findall(metrics_text):
        if name.endswith("running"):
            running += float(value)
        else:
            waiting += float(value)
    return int(running), int(waiting)


async def reach(host: str, port: int, timeout: float) -> str:
    """A side channel accepts a connection: the pair can move KV."""
    try:
        _, w = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        w.close()
        return "LLM_SUCCESS"
    except (OSError, asyncio.TimeoutError) as e:
        log.warning("side channel %s:%d unreachable: %r", host, port, e)
        return "LLM_LINK_FAILED"


def link_ends(s: Settings, r: int, peers: Sequence[Any]) -> list[tuple[str, int]]:
    """Where rank r's link to each peer connects: the prefill rank's side channel; layerwise, where
    the prefill pushes into this decoder, its own (the pair's verification proves the push)."""
    if mooncake.decoder_first(s.kind):
        return [(s.host, s.kv_port + r)] * len(peers)
    return [(host_of(p.agent_url) or p.ip, p.port) for p in peers]


def host_of(url: str | None) -> str | None:
    return urlsplit(url).hostname if url else None


class PairProbe:
    """verify: a real request through a prefill and this decoder, compared with this server alone.
    mooncake: prefill first, its kv_transfer_params to the decoder. mooncake-layerwise: decoder
    first with this launcher's metaserver, which sends the prefill the decoder's blocks."""

    def __init__(self, s: Settings, http: httpx.AsyncClient, engine_url: Callable[[], str],
                 clock: Callable[[], float]):
        self.s, self.http, self.engine_url, self.clock = s, http, engine_url, clock
        self.served = ""
        self.metaserver = ""      # this launcher's, as the pod's server reaches it (set once it listens)
        self.pending: dict[str, tuple[str, dict, asyncio.Future]] = {}   # probe id -> (prefill host, body, status)

    async def _model(self) -> str:
        if not self.served:
            r = await self.http.get(f"{self.engine_url()}/v1/models", timeout=10)
            self.served = r.json()["data"][0]["id"]
        return self.served

    async def probe(self, role: str, peer: str, host: str) -> VerifyResult:
        try:
            return await asyncio.wait_for(self._probe(role, peer, host), PROBE_TIMEOUT_S)
        except asyncio.TimeoutError:
            return VerifyResult(ok=False, code="LLM_WAIT_PROCESS_TIMEOUT", prefill=peer, decoder=self.s.pod,
                                message=f"a request through {peer} and {self.s.pod} took over {PROBE_TIMEOUT_S:.0f}s")

    async def _probe(self, role: str, peer: str, host: str) -> VerifyResult:
        def result(ok: bool, code: str, message: str = "", pull_ms: float = 0.0) -> VerifyResult:
            return VerifyResult(ok=ok, code=code, message=message, pull_ms=pull_ms, prefill=peer, decoder=self.s.pod)
        if role != "decoder":
            return result(ok=False, code="LLM_PARAM_INVALID", message=f"{self.s.pod} serves as {role}")
        try:
            body = {"model": await self._model(), "prompt": PROBE_PROMPT, "temperature": 0, "stream": False}
            t0 = self.clock()
            if mooncake.decoder_first(self.s.kind):
                dec, refused = await self._decoder_first(host, body)
            else:
                dec, refused = await self._prefill_first(host, body)
            if refused or dec is None:
                return result(ok=False, code="PEER_AGENT_ERROR", message=refused)
            ms = (self.clock() - t0) * 1000
            alone = await self.http.post(f"{self.engine_url()}/v1/completions",
                                         json={**body, "max_tokens": PROBE_TOKENS})
            if dec.status_code != 200 or alone.status_code != 200:
                return result(ok=False, code="LLM_FAILED", message=f"the decoder's server answered "
                                    f"{dec.status_code}/{alone.status_code}: {(dec.text or alone.text)[:200]}")
            got, want = dec.json()["choices"][0]["text"], alone.json()["choices"][0]["text"]
            if got != want:
                return result(ok=False, code="KV_CONTENT_MISMATCH", message=f"decoding from {peer}'s KV gave "
                                    f"{got!r}, computing the prompt here {want!r}", pull_ms=ms)
            return result(ok=True, code="LLM_SUCCESS", pull_ms=ms)
        except (httpx.HTTPError, ValueError, KeyError, IndexError, asyncio.TimeoutError) as e:
            return result(ok=False, code="PEER_AGENT_UNREACHABLE", message=f"probing through {host}: {e!r}")

    async def _prefill_first(self, host: str, body: dict) -> tuple[httpx.Response | None, str]:
        rid = {"X-Request-Id": uuid.uuid4().hex}     # one id on both engines, as pd-gateway sends
        pre = await self.http.post(f"http://{host}:{self.s.engine_port}/v1/completions", headers=rid, json={
            **body, "max_tokens": 1, "kv_transfer_params": {
                "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None}})
        params = pre.json().get("kv_transfer_params") if pre.status_code == 200 else None
        if not params or not params.get("remote_block_ids"):
            return pre, (f"the prefill's server at {host}:{self.s.engine_port} answered {pre.status_code} without "
                         f"KV to read: {pre.text[:200]}")
        dec = await self.http.post(f"{self.engine_url()}/v1/completions", headers=rid,
                                   json={**body, "max_tokens": PROBE_TOKENS, "kv_transfer_params": params})
        return dec, ""

    async def _decoder_first(self, host: str, body: dict) -> tuple[httpx.Response | None, str]:
        pid = uuid.uuid4().hex
        status: asyncio.Future = asyncio.get_running_loop().create_future()
        self.pending[pid] = (host, body, status)
        try:
            # the decoder and the prefill must see one request id: the prefill's push names it
            post = asyncio.ensure_future(self.http.post(
                f"{self.engine_url()}/v1/completions", headers={"X-Request-Id": pid}, json={
                    **body, "max_tokens": PROBE_TOKENS, "kv_transfer_params": {
                        "do_remote_decode": False, "do_remote_prefill": True,
                        "metaserver": f"{self.metaserver}{mooncake.METASERVER_PATH}/{pid}"}}))
            try:
                await asyncio.wait({post, status}, return_when=asyncio.FIRST_COMPLETED)
                if not post.done() and status.result()[0] != 200:   # no push will come: the prefill's answer
                    code, text = status.result()
                    return None, f"the prefill's server at {host}:{self.s.engine_port} answered {code}: {text[:200]}"
                dec = await post
            finally:
                post.cancel()
            try:   # the prefill's answer may come a moment after the decoder's (the push ended first)
                code, text = await asyncio.wait_for(asyncio.shield(status), METASERVER_GRACE_S)
            except asyncio.TimeoutError:
                return dec, "the decoder's server never asked the metaserver for a prefill"
            if code != 200:
                return dec, f"the prefill's server at {host}:{self.s.engine_port} answered {code}: {text[:200]}"
            return dec, ""
        finally:
            self.pending.pop(pid, None)

    async def metaserve(self, pid: str, params: dict) -> None:
        """The decoder's server names its blocks: the probe's prefill is sent them."""
        if pid not in self.pending:
            raise LaunchError("NOT_FOUND", f"no probe {pid} in progress", 404)
        host, body, status = self.pending[pid]
        try:
            pre = await self.http.post(f"http://{host}:{self.s.engine_port}/v1/completions",
                                       headers={"X-Request-Id": pid},
                                       json={**body, "max_tokens": 1, "kv_transfer_params": params})
            outcome = (pre.status_code, pre.text)
        except httpx.HTTPError as e:
            outcome = (0, repr(e))
        if not status.done():
            status.set_result(outcome)


class Launcher:
    """The server process and the rank API over it (observe: the server's health and load; act:
    start, stop, restart in another role)."""

    def __init__(self, s: Settings, http: httpx.AsyncClient, spawn: Callable[..., Awaitable[Any]] | None = None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time):
        self.s, self.http, self.clock, self.wall = s, http, clock, wall
        self.spawn = spawn or asyncio.create_subprocess_exec
        self.role: Role = s.role
        self.boot_id = uuid.uuid4().hex
        self.proc: Any = None
        self.healthy = False
        self.restarting: asyncio.Task | None = None
        self.restart_role: str | None = None
        self.restart_at = 0.0
        self.window_end = 0.0
        self.stopping = False
        self.draining = False
        self.exited = asyncio.Event()
        self.exit_code = 0
        self.running = self.waiting = self.held = 0
        self.links: dict[int, dict[str, LinkState]] = {r: {} for r in range(s.tensor_parallel)}
        self.probes: dict[str, tuple[float, asyncio.Task]] = {}
        self.pairs = PairProbe(s, http, lambda: self.engine_url, clock)

    @property
    def engine_url(self) -> str:
        return f"http://{self.s.host}:{self.s.engine_port}"

    # ---- the server process -------------------------------------------------------------------------
    async def start(self, role: Role | None = None) -> None:
        role = role or self.role
        argv = self.s.argv(role, f"{self.s.pod}-{uuid.uuid4().hex[:8]}")
        log.info("starting the server as %s: %s", role, " ".join(argv))
        self.healthy = False
        # a session of its own: a stop reaches the server's workers too (they hold the NPUs and ports)
        self.proc = await self.spawn(*argv, env=dict(self.s.env), start_new_session=True)
        proc = self.proc
        asyncio.get_running_loop().create_task(self._watch(proc))

    async def _watch(self, proc: Any) -> None:
        code = await proc.wait()
        if proc is self.proc and not self.stopping and self.restarting is None:
            log.error("the server exited with %s: the launcher exits so the container restarts", code)
            self.exit_code = code or 1
            self.exited.set()

    async def stop(self, grace: float) -> None:
        proc, self.healthy = self.proc, False
        if proc is None:
            return
        if proc.returncode is not None:
            _signal_group(proc, signal.SIGKILL)     # the server is gone; workers it left behind go too
            return
        _signal_group(proc, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), grace)
        except asyncio.TimeoutError:
            log.warning("the server did not stop in %.0fs: killing it", grace)
            _signal_group(proc, signal.SIGKILL)
            await proc.wait()
        _signal_group(proc, signal.SIGKILL)     # a worker that outlived the server

    async def wait_healthy(self, timeout: float) -> None:
        deadline = self.clock() + timeout
        while self.clock() < deadline:
            if self.proc is not None and self.proc.returncode is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} while starting")
            if await self.observe():
                return
            await asyncio.sleep(0.2)
        raise RuntimeError(f"the server did not answer {self.engine_url}/health in {timeout:.0f}s")

    async def observe(self) -> bool:
        """The server's health (returned) and load; it counts as initialised only outside a restart."""
        try:
            r = await self.http.get(f"{self.engine_url}/health", timeout=5)
            healthy = r.status_code == 200
            m = await self.http.get(f"{self.engine_url}/metrics", timeout=5)
            self.running, self.waiting = parse_load(m.text) if m.status_code == 200 else (0, 0)
            h = await self.http.get(f"{self.engine_url}/healthz", timeout=5)   # the stand-in's held blocks
            is_json = h.status_code == 200 and "json" in h.headers.get("content-type", "")
            body = h.json() if is_json else {}
            self.held = int(body.get("held", 0)) if isinstance(body, dict) else 0
        except (httpx.HTTPError, ValueError):
            healthy = False
        self.healthy = healthy and self.restarting is None and not self.stopping
        return healthy

    async def health_loop(self) -> None:
        while not self.exited.is_set():
            if self.restarting is None and self.proc is not None:
                await self.observe()
            await asyncio.sleep(HEALTH_EVERY_S)

    # ---- the rank API -------------------------------------------------------------------------------
    def status(self, r: int) -> AgentStatus:
        ident = self.s.identity
        in_flight = self.running + self.waiting
        return AgentStatus(   # rank r's cluster id: the pod's block of TP ids from rank 0's
            pod=self.s.pod, role=self.role, cluster_id=ident.cluster_id + r, boot_id=self.boot_id,
            backend=ident.backend, initialized=self.healthy, ip=self.s.host,
            port=self.s.kv_port + r, model_id=ident.model_id, links=list(self.links[r].values()),
            load=Load(running=self.running, queue_depth=self.waiting, in_flight=in_flight if r == 0 else 0,
                      pending_kv=self.held if r == 0 else 0),
            draining=self.draining, terminating=self.stopping,
            switchable=ev.flag(self.s.env, ev.PD_ENABLE_SWITCH_ROLE, True), cache_desc=ident.cache_desc,
            engine="vllm", tensor_parallel=1)

    async def link(self, r: int, req: LinkRequest) -> LinkResult:
        t0 = self.clock()
        ends = link_ends(self.s, r, req.peers)
        distinct = list(dict.fromkeys(ends))      # each endpoint once (layerwise: one, this pod's own)
        codes = dict(zip(distinct, await asyncio.gather(*(reach(h, port, req.timeout_ms / 1000)
                                                          for h, port in distinct))))
        rets = [codes[e] for e in ends]
        now = self.wall()
        for p, code in zip(req.peers, rets):
            self.links[r][p.name] = LinkState(name=p.name, cluster_id=p.cluster_id, ip=p.ip, port=p.port, code=code,
                                              since=now, healthy=code == "LLM_SUCCESS", peer_boot_id=p.boot_id)
        failed = next((c for c in rets if c != "LLM_SUCCESS"), None)
        return LinkResult(ret=failed or "LLM_SUCCESS", rets={p.name: c for p, c in zip(req.peers, rets)},
                          duration_ms=(self.clock() - t0) * 1000)

    def unlink(self, r: int, req: UnlinkRequest) -> LinkResult:
        rets = {p.name: "LLM_SUCCESS" if self.links[r].pop(p.name, None) else "LLM_NOT_YET_LINK" for p in req.peers}
        return LinkResult(ret="LLM_SUCCESS", rets=rets)

    async def verify(self, r: int, req: VerifyRequest) -> VerifyResult:
        """A real request through the pair (one per peer at a time, shared by the pod's ranks)."""
        host = host_of(req.peer.agent_url) or req.peer.ip
        key = req.peer.name
        at, task = self.probes.get(key, (0.0, None))
        if task is None or (task.done() and self.clock() - at > 1.0):
            task = asyncio.get_running_loop().create_task(self.pairs.probe(self.role, req.peer.name, host))
            self.probes[key] = (self.clock(), task)
        return await asyncio.shield(task)

    async def drain(self, req: DrainRequest) -> DrainResult:
        self.draining = True
        deadline = self.clock() + req.timeout_s
        while True:
            await self.observe()
            busy = self.running + self.waiting + self.held
            if not busy or self.clock() >= deadline:
                return DrainResult(draining=True, in_flight=self.running + self.waiting, pending_kv=self.held,
                                   drained=not busy)
            await asyncio.sleep(0.2)

    def undrain(self) -> DrainResult:
        self.draining = False
        return DrainResult(draining=False, in_flight=self.running + self.waiting, pending_kv=self.held, drained=False)

    async def switch_role(self, req: SwitchRoleRequest) -> None:
        """Starts the restart (or joins the one running) and waits a little for it: a server that
        loads for longer answers 503 SWITCH_IN_PROGRESS, and the caller asks again (the role is the
        old one until the server serves in the new)."""
        if self.stopping:
            raise LaunchError("TERMINATING", f"{self.s.pod} is stopping", 503)
        if self.restarting is None:
            if req.role == self.role and self.proc is not None and self.proc.returncode is None:
                return
            self.restart_role, self.restart_at = req.role, self.clock()
            self.restarting = asyncio.get_running_loop().create_task(self._restart(req.role))
        elif self.restart_role != req.role:
            raise LaunchError("SWITCH_IN_PROGRESS", f"{self.s.pod} is restarting as {self.restart_role}", 409)
        task, now = self.restarting, self.clock()
        if now >= self.window_end:     # the pod's ranks ask at once: one window for the lot, one answer
            self.window_end = now + SWITCH_WAIT_S
        done, _ = await asyncio.wait({task}, timeout=max(0.0, self.window_end - now))
        if not done:
            raise LaunchError("SWITCH_IN_PROGRESS", f"{self.s.pod}: the server restarts as {req.role} "
                              f"({self.clock() - self.restart_at:.0f}s so far); it serves once it answers /health",
                              503)
        task.result()

    async def _restart(self, role: Role) -> None:
        t0 = self.clock()
        try:
            log.info("switching %s from %s to %s: restarting the server", self.s.pod, self.role, role)
            await self.stop(self.s.drain_timeout_s)
            for links in self.links.values():
                links.clear()
            self.pairs.served = ""
            await self.start(role)
            await self.wait_healthy(START_TIMEOUT_S)
            self.role = role
            log.info("%s serves as %s (restart %.1fs)", self.s.pod, role, self.clock() - t0)
        except Exception as e:
            log.error("the server did not come back as %s: %s; the launcher exits", role, e)
            self.exit_code = 1
            self.exited.set()
            raise LaunchError("SWITCH_FAILED", f"restarting as {role}: {e}", 500) from None
        finally:
            self.restarting = None
            self.restart_role = None
            self.healthy = self.proc is not None and self.proc.returncode is None and not self.exited.is_set()


class LaunchError(Exception):
    def __init__(self, code: str, message: str, status: int):
        super().__init__(message)
        self.code, self.status = code, status


def _route(launcher: Launcher, fn: Callable[[int, Any], Awaitable[Any]], body: type | None = None) -> Any:
    """A rank API handler: the control token, the rank, the body validated, errors as the agent's."""
    from aiohttp import web

    async def handler(request: web.Request) -> web.Response:
        t = launcher.s.token
        if t and request.headers.get("Authorization") != f"Bearer {t}":
            return web.json_response({"code": "UNAUTHORIZED", "message": "control token required"}, status=401)
        r = int(request.match_info["rank"])
        if not 0 <= r < launcher.s.tensor_parallel:
            return web.json_response({"code": "LLM_PARAM_INVALID", "message": f"no rank {r}"}, status=404)
        try:
            arg = body.model_validate(await request.json()) if body is not None else None  # type: ignore[attr-defined]
            out = await fn(r, arg)
        except LaunchError as e:
            return web.json_response({"code": e.code, "message": str(e)}, status=e.status)
        except ValueError as e:
            return web.json_response({"code": "LLM_PARAM_INVALID", "message": str(e)[:500]}, status=400)
        return web.json_response(out.model_dump(mode="json") if hasattr(out, "model_dump") else (out or {}))
    return handler


def build_app(launcher: Launcher) -> Any:
    from aiohttp import web

    def route(fn: Callable[[int, Any], Awaitable[Any]], body: type | None = None) -> Any:
        return _route(launcher, fn, body)

    async def status(r: int, _: Any) -> AgentStatus:
        return launcher.status(r)

    async def unlink(r: int, req: UnlinkRequest) -> LinkResult:
        return launcher.unlink(r, req)

    async def drain(r: int, req: DrainRequest) -> DrainResult:
        return await launcher.drain(req)

    async def undrain(r: int, _: Any) -> DrainResult:
        return launcher.undrain()

    async def switch(r: int, req: SwitchRoleRequest) -> dict:
        await launcher.switch_role(req)
        return {"role": launcher.role}

    async def nothing(r: int, _: Any) -> dict:
        return {}

    async def metaserver(request: web.Request) -> web.Response:
        try:
            params = await request.json()
            await launcher.pairs.metaserve(request.match_info["probe"], params if isinstance(params, dict) else {})
        except LaunchError as e:
            return web.json_response({"code": e.code, "message": str(e)}, status=e.status)
        except ValueError as e:
            return web.json_response({"code": "LLM_PARAM_INVALID", "message": str(e)[:500]}, status=400)
        return web.json_response({})

    p = "/rank/{rank}"
    app = web.Application()
    # the pod's server posts a verification probe's blocks here (mooncake-layerwise); a probe id is
    # known only to the probe that made it
    app.add_routes([web.post(mooncake.METASERVER_PATH + "/{probe}", metaserver)])
    app.add_routes([
        web.get(p + AgentPath.STATUS, route(status)),
        web.post(p + AgentPath.LINK, route(launcher.link, LinkRequest)),
        web.post(p + AgentPath.UNLINK, route(unlink, UnlinkRequest)),
        web.post(p + AgentPath.VERIFY, route(launcher.verify, VerifyRequest)),
        web.post(p + AgentPath.DRAIN, route(drain, DrainRequest)),
        web.post(p + AgentPath.UNDRAIN, route(undrain)),
        web.post(p + AgentPath.SWITCH_ROLE, route(switch, SwitchRoleRequest)),
        web.post(p + AgentPath.INIT, route(nothing)),         # the server initialises itself
        web.post(p + AgentPath.NOTIFY, route(nothing)),       # Mooncake tells the prefill itself
        web.post(p + AgentPath.FAULTS, route(nothing)),       # the agent's own faults; none here
    ])
    return app


async def register(s: Settings, url: str, boot_id: str, stop: asyncio.Event) -> bool:
    """Every rank, retried with backoff while the agent refuses (preflight) or is not up yet."""
    base = (s.env.get(ev.PD_AGENT_URL) or "http://127.0.0.1:8080").rstrip("/")
    target = s.env.get(ev.PD_RANK_REGISTER_URL) or f"{base}{AgentPath.RANKS}"
    headers = {"Authorization": f"Bearer {s.token}"} if s.token else {}
    delay = 0.5
    async with httpx.AsyncClient(trust_env=False, timeout=5) as http:
        pending = list(range(s.tensor_parallel))
        while pending and not stop.is_set():
            r = pending[0]
            try:
                resp = await http.post(target, json={"rank": r, "url": f"{url}/rank/{r}", "boot_id": boot_id},
                                       headers=headers)
                if resp.status_code == 200:
                    pending.pop(0)
                    delay = 0.5
                    continue
                log.warning("the pod's agent refused rank %d: %s %s", r, resp.status_code, resp.text[:200])
            except httpx.HTTPError as e:
                log.warning("the pod's agent at %s: %r", target, e)
            try:
                await asyncio.wait_for(stop.wait(), delay)
            except asyncio.TimeoutError:
                pass
            delay = min(delay * 2, 10.0)
    return not pending


async def serve(s: Settings) -> int:
    from aiohttp import web
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with httpx.AsyncClient(trust_env=False, timeout=10) as http:
        launcher = Launcher(s, http)
        runner = web.AppRunner(build_app(launcher), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]   # type: ignore[union-attr]
        url = f"http://127.0.0.1:{port}"
        launcher.pairs.metaserver = url
        log.info("rank API of %s on %s (%d ranks)", s.pod, url, s.tensor_parallel)
        code = 0
        if await register(s, url, launcher.boot_id, stop):
            await launcher.start()
            health = loop.create_task(launcher.health_loop())
            waiters = {loop.create_task(stop.wait()), loop.create_task(launcher.exited.wait())}
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            for w in waiters:
                w.cancel()
            code = launcher.exit_code if launcher.exited.is_set() and not stop.is_set() else 0
            launcher.stopping = True
            if launcher.restarting is not None:
                launcher.restarting.cancel()
            elif not code:   # SIGTERM: what the server took on finishes first, as the agent drains
                await launcher.drain(DrainRequest(timeout_s=s.drain_timeout_s))
            await launcher.stop(5)
            health.cancel()
        await runner.cleanup()
        return code


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    s = Settings.from_env(list(sys.argv[1:] if argv is None else argv), os.environ)
    raise SystemExit(asyncio.run(serve(s)))


if __name__ == "__main__":
    main()
