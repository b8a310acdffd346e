"""The single-rank agent (aiohttp): the agent API over one AgentCore, and the process that serves it.

The routes, their scopes and bodies are routes.py's table; `CoreAPI` answers them over the
core; the HTTP plumbing (auth, bodies, errors, metrics port) is http.py's. With several ranks
(PD_TENSOR_PARALLEL > 1, or PD_RANKS_EXTERNAL) the pod's agent is front.py's, over the same table."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import time

import httpx
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from pd_contract.agent_api import (
    AgentStatus,
    DecodeRequest,
    DrainRequest,
    DrainResult,
    FaultsRequest,
    LinkRequest,
    LinkResult,
    NotifyRequest,
    PrefillRequest,
    PrefillResponse,
    ProbeRequest,
    ProbeResponse,
    PullRequest,
    PullResponse,
    SwitchRoleRequest,
    UnlinkRequest,
    VerifyRequest,
    VerifyResult,
)
from pd_contract.engine_env import (
    PD_INSTANCE_RANK,
    PD_LOCAL_POD_IP,
    PD_RANK,
    PD_RANK_REGISTER_URL,
    PD_RANKS_EXTERNAL,
    PD_TENSOR_PARALLEL,
    Gang,
    flag,
)

from .core import AgentCore, AgentError, Serving
from .devices import DeviceError, Devices, resolve_env
from .front import serve_front
from .http import METRICS, api_app, api_routes, app_runner, error_reply, model_reply, serve_metrics, wait_event
from .identity import ConfigError, Identity, import_backend
from .inference import Inference
from .metrics import AgentMetrics, scrape
from .mindie_hook import attach as attach_mindie
from .notify import Notifier
from .preflight import PREFLIGHT_FAULTS, Preflight, held
from .routes import AgentService, Route

log = logging.getLogger("pd_agent")
CORE = web.AppKey("core", AgentCore)
HTTP = web.AppKey("http", httpx.AsyncClient)


class CoreAPI(AgentService):
    """The agent API over one AgentCore: the single-rank agent, or one rank process of a pod."""

    where = "agent"

    def __init__(self, core: AgentCore, token: str | None, http: httpx.AsyncClient):
        self.core, self.token, self.http = core, token, http
        self.inf = core.inference

    def offers(self, route: Route) -> bool:
        # an agent an inference server embeds without the simulated serving: no serving routes
        return super().offers(route) and (self.inf is not None or not route.serving)

    async def current_status(self) -> AgentStatus:
        return self.core.status()

    async def healthz(self, request: web.Request) -> web.Response:
        core = self.core
        ok = core.initialized and not held(core.preflight)   # held: its network preflight failed
        return web.json_response({"ok": ok, "role": core.role, "boot_id": core.boot_id,
                                  "last_error": core.last_error}, status=200 if ok else 503)

    async def livez(self, request: web.Request) -> web.Response:
        """The event loop answers: an engine that cannot init yet is /healthz's to report (it
        retries), and restarting the pod would not help it."""
        return web.json_response({"ok": True, "boot_id": self.core.boot_id})

    async def metrics(self, request: web.Request) -> web.Response:
        m, core = request.app[METRICS], self.core
        st = core.status()
        m.kv_used.set(st.load.kv_used_bytes)
        m.links.labels("up").set(sum(1 for l in st.links if l.code == "LLM_SUCCESS"))
        m.links.labels("down").set(sum(1 for l in st.links if l.code != "LLM_SUCCESS"))
        return web.Response(body=scrape(m, core.id, st.load),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def get_status(self) -> AgentStatus:
        return self.core.status()

    async def init(self) -> None:
        await self.core.init()

    async def link(self, req: LinkRequest) -> LinkResult:
        return await self.core.link(req)

    async def unlink(self, req: UnlinkRequest) -> LinkResult:
        return await self.core.unlink(req)

    async def switch_role(self, req: SwitchRoleRequest) -> None:
        await self.core.switch_role(req.role)

    async def verify(self, req: VerifyRequest) -> VerifyResult:
        return await self.core.verify(req.peer, self.http, self.token)

    async def probe(self, req: ProbeRequest) -> ProbeResponse:
        return await self.core.probe(req.req_id, req.content)

    async def drain(self, req: DrainRequest) -> DrainResult:
        return await self.core.drain(req.timeout_s)

    async def undrain(self) -> DrainResult:
        return await self.core.undrain()

    async def notify(self, req: NotifyRequest) -> None:
        self.core.notify(req)

    async def set_faults(self, req: FaultsRequest) -> None:
        if not hasattr(self.core.llm, "SIMULATED"):
            raise AgentError("LLM_FEATURE_NOT_ENABLED", "fault injection exists only on the simulator", 400)
        if req.crash:
            log.warning("crash requested through the admin API")
            asyncio.get_running_loop().call_later(0.05, os._exit, 137)
            return
        from llm_datadist_sim import faults as f
        if self.core.preflight is not None:
            self.core.preflight.set_faults(req)
        f.update(**req.model_dump(exclude_none=True,
                                  exclude={"crash", "switch_crash_after_ranks", *PREFLIGHT_FAULTS}))

    async def get_faults(self) -> dict:
        from llm_datadist_sim import faults as f
        return f.current().as_dict()

    # ---- serving (offered with an Inference only) ----
    def _inf(self) -> Serving:
        assert self.inf is not None
        return self.inf

    async def prefill(self, req: PrefillRequest) -> PrefillResponse:
        return await self._inf().prefill(req)

    async def pull(self, req: PullRequest) -> PullResponse:
        return await self._inf().pull(req)

    async def kv(self, request: web.Request) -> web.Response:
        """A rank of a multi-rank decoder: the shard it pulled for a request, once, for the rank
        that decodes (the reference engine)."""
        try:
            req_id = int(request.match_info["req_id"])
        except ValueError:
            return error_reply(400, "BadRequest", "req_id must be an integer")
        return web.Response(body=self._inf().take_held(req_id), content_type="application/octet-stream")

    async def decode(self, req: DecodeRequest, request: web.Request) -> web.StreamResponse:
        """Plain: one JSON reply. `stream: true`: NDJSON, a line per token as the decode loop
        emits it ({"token": i, "ms": since the decode started}), then {"done": DecodeResponse}
        or {"error": {code, message}}. Refusals before the first token are plain HTTP errors,
        so a router can send the request elsewhere. A client that goes away cancels the decode."""
        inf = self._inf()
        if not req.stream:
            return model_reply(await inf.decode(req))
        inf.responding += 1
        try:
            return await self._stream(request, req)
        finally:
            inf.responding -= 1

    async def _stream(self, request: web.Request, body: DecodeRequest) -> web.StreamResponse:
        tokens: asyncio.Queue = asyncio.Queue()
        task = asyncio.create_task(self._inf().decode(body, tokens))
        first = asyncio.create_task(tokens.get())
        try:
            await asyncio.wait({task, first}, return_when=asyncio.FIRST_COMPLETED)
            if not first.done():
                first.cancel()
                await task  # finished (or failed) before any token: raises its AgentError as a plain error
                return model_reply(task.result())
            resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
            await resp.prepare(request)
            await resp.write((json.dumps(first.result()) + "\n").encode())
            while True:
                get = asyncio.create_task(tokens.get())
                await asyncio.wait({task, get}, return_when=asyncio.FIRST_COMPLETED)
                if get.done():
                    await resp.write((json.dumps(get.result()) + "\n").encode())
                    continue
                get.cancel()
                while not tokens.empty():
                    await resp.write((json.dumps(tokens.get_nowait()) + "\n").encode())
                try:
                    out = {"done": task.result().model_dump(mode="json")}
                except AgentError as e:
                    out = {"error": {"code": e.code, "message": str(e)}}
                await resp.write((json.dumps(out) + "\n").encode())
                await resp.write_eof()
                return resp
        finally:
            if not task.done():
                task.cancel()
            if not first.done():
                first.cancel()


def build_app(core: AgentCore, token: str | None, metrics: AgentMetrics | None = None,
              serve_inference: bool = True, data_token: str | None = None,
              peer_token: str | None = None) -> web.Application:
    """The HTTP API over `core`. An inference server embedding the agent calls this with a
    core built around its own engine and mounts or runs the app."""
    metrics = metrics or AgentMetrics()
    if serve_inference and core.inference is None:
        Inference(core, metrics)
    app = api_app(token, data_token, peer_token, metrics)
    app[CORE] = core
    # agent-to-agent calls (verify) must not go through a proxy
    app[HTTP] = httpx.AsyncClient(trust_env=False, timeout=10)
    app.add_routes(api_routes(CoreAPI(core, token, app[HTTP])))

    async def lifecycle(app: web.Application):
        if core.notifier is None:
            # Notices go only to the agents the operator linked this one to (never to a URL a
            # request names), so without a peer token the control token is what they carry.
            core.notifier = Notifier(app[HTTP], peer_token or token, core.id.cluster_id)
            core.notifier.start()
        notifier = core.notifier
        health = asyncio.create_task(core.health_loop(), name="link-health")
        if core.inference is not None:
            core.inference.start()
        yield
        health.cancel()
        if core.inference is not None:
            await core.inference.stop()
        await notifier.stop()
        await app[HTTP].aclose()

    app.cleanup_ctx.append(lifecycle)
    return app


def _device_of(core: AgentCore) -> None:
    """A single-rank pod the operator manages: the engine listens on its NPU's device IP (the
    simulator without one: the pod IP, as before). Raises ConfigError naming what is missing."""
    if not os.environ.get(PD_TENSOR_PARALLEL):
        return
    try:
        devs = resolve_env()
    except DeviceError as e:
        core.device_error = str(e)
        raise ConfigError(str(e)) from None
    core.device_ips, core.device_error = devs.source, devs.error
    if devs.error:
        raise ConfigError(f"DeviceIPUnknown: {devs.error}")
    d = devs.ranks[0]
    core.id.ip, core.id.port = d.ip or core.id.ip, d.port
    if d.device_id is not None and core.id.device_id is None:
        core.id.device_id = 0   # the process-visible index of its one device


async def _preflight(core: AgentCore, stop: asyncio.Event) -> None:
    """A pod the operator runs checks its devices' network before its engine starts (preflight.py);
    devices not known yet are waited for (the annotation may come late; the init loop reports why)."""
    while os.environ.get(PD_TENSOR_PARALLEL) and not stop.is_set():
        try:
            devs: Devices | None = resolve_env()
        except DeviceError as e:
            devs, core.device_error = None, str(e)
        if devs is not None and devs.complete:
            try:
                core.preflight = Preflight.from_env(devs, time.time)
            except ValueError as e:   # a bad PD_PREFLIGHT: said, and the engine starts unchecked
                core.last_error = f"preflight: {e}"
                log.error("network preflight not run: %s", e)
                return
            if core.preflight is not None:
                await core.preflight.gate(stop)
                core.preflight.start(stop)
            return
        core.device_error = devs.error if devs is not None else core.device_error
        await wait_event(stop, 2.0)


async def _register(url: str, rank: int, my_url: str, boot_id: str, token: str | None, stop: asyncio.Event) -> None:
    """A rank process tells the pod's agent where its API is, until the agent takes it."""
    body = {"rank": rank, "url": my_url, "boot_id": boot_id}
    async with httpx.AsyncClient(trust_env=False, timeout=5) as http:
        while not stop.is_set():
            try:
                r = await http.post(url, json=body, headers={"Authorization": f"Bearer {token}"} if token else {})
                if r.status_code == 200:
                    return
                log.error("registering rank %d with %s: %s %s", rank, url, r.status_code, r.text[:200])
            except httpx.HTTPError as e:
                log.info("registering rank %d with %s: %r; retrying", rank, url, e)
            await wait_event(stop, 0.5)


async def _serve(identity: Identity, host: str, port: int, rank: int | None = None) -> None:
    llm = import_backend(identity.backend)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    core = AgentCore(llm, identity)
    # MindIE's server learns its role from the pod's agent (rank processes: the front pushes)
    mindie = attach_mindie(core.after_switch, identity.role, lambda: core.initialized, stop) if rank is None else None
    app = build_app(core, identity.token, data_token=identity.data_token, peer_token=identity.peer_token)
    runner = app_runner(app, identity)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    # a rank process's metrics stay on its local API port: the pod's agent is what is scraped
    metrics_runner = await serve_metrics(app, identity, host) if rank is None else None
    if rank is not None:
        port = runner.addresses[0][1]
        asyncio.create_task(_register(os.environ[PD_RANK_REGISTER_URL], rank, f"http://{host}:{port}",
                                      core.boot_id, identity.token, stop))
    log.info("agent %s%s (%s, cluster_id %d) serving on %s:%d, datadist %s:%d, backend %s",
             identity.pod, f" rank {rank}" if rank is not None else "", identity.role, identity.cluster_id,
             host, port, identity.ip, identity.port, identity.backend)
    if identity.engine_start_s > 0:
        # the simulator's stand-in for loading weights and building the engine
        log.info("engine start-up takes %.1fs", identity.engine_start_s)
        await wait_event(stop, identity.engine_start_s)
    if rank is None:
        await _preflight(core, stop)
    # Keep trying to init: a bad listen address is reported in /healthz, not a crash loop.
    delay = 0.5
    while not core.initialized and not stop.is_set():
        try:
            if rank is None:
                _device_of(core)
            t0 = time.perf_counter()
            await core.init()
            log.info("engine initialised in %.1f ms", (time.perf_counter() - t0) * 1000)
        except Exception as e:  # noqa: BLE001
            core.last_error = f"init: {e}"
            log.error("engine init failed: %s; retrying in %.1fs", e, delay)
            await wait_event(stop, delay)
            delay = min(10, delay * 2)
    await stop.wait()
    if core.initialized:
        log.info("SIGTERM: refusing new work, draining (up to %.0fs)", identity.drain_timeout_s)
        res = await core.terminate(identity.drain_timeout_s)
        log.info("drained: %s", json.dumps(res))
    log.info("shutting down")
    if metrics_runner is not None:
        await metrics_runner.cleanup()
    await runner.cleanup()
    if mindie is not None:
        await mindie[1]
        await mindie[0].aclose()
    await core.finalize()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="pd_agent", description="The in-pod LLM-DataDist agent")
    ap.add_argument("--host", default=os.environ.get(PD_LOCAL_POD_IP, "0.0.0.0"))
    ap.add_argument("--port", type=int, default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would drown the log
    try:
        identity = Identity.from_env()
        tp = identity.tensor_parallel
        # a rank process registers under its rank in the instance (a gang's), else its rank
        slot = os.environ.get(PD_INSTANCE_RANK) or os.environ.get(PD_RANK)
        rank = int(slot) if slot else None
        spans = Gang.from_env(os.environ).spans
    except (ConfigError, ValueError) as e:
        raise SystemExit(f"pd_agent: bad configuration: {e}") from None
    if rank is not None:
        # a rank process: its API on a local port, registered with the pod's agent
        _die_with_parent()
        asyncio.run(_serve(identity, os.environ.get(PD_LOCAL_POD_IP) or "127.0.0.1", 0, rank=rank))
    elif tp > 1 or spans or flag(os.environ, PD_RANKS_EXTERNAL):
        # several ranks, or an inference server beside this agent starts its own: the pod's agent
        asyncio.run(serve_front(identity, tp, args.host, args.port or identity.agent_port))
    else:
        asyncio.run(_serve(identity, args.host, args.port or identity.agent_port))


def _die_with_parent() -> None:
    """A rank process must not outlive the pod's agent that started it."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
