"""The agent's HTTP layer (aiohttp): a thin shell over AgentCore.

Every /v1 call needs the bearer token; bodies are the pydantic models in models.py and a
malformed one gets 400 naming the field. /healthz (readiness: the engine is initialised),
/livez (liveness: the process answers) and /metrics are open."""
from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import signal
import time
from typing import Awaitable, Callable

import httpx
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from pd_contract.agent_api import (
    DecodeRequest,
    DrainRequest,
    FaultsRequest,
    LinkRequest,
    NotifyRequest,
    PrefillRequest,
    ProbeRequest,
    PullRequest,
    SwitchRoleRequest,
    UnlinkRequest,
    VerifyRequest,
)

from .core import AgentCore, AgentError
from .devices import DeviceError, resolve_env
from .identity import ConfigError, Identity, import_backend
from .inference import Inference
from .metrics import AgentMetrics
from .mindie_hook import attach as attach_mindie
from .notify import Notifier

log = logging.getLogger("pd_agent")
CORE = web.AppKey("core", AgentCore)
METRICS = web.AppKey("metrics", AgentMetrics)
HTTP = web.AppKey("http", httpx.AsyncClient)
BODY_TIMEOUT_S = 30.0   # a request body (at most client_max_size) must arrive within this
MAX_BODY_BYTES = 8 << 20   # a prefill's token ids (up to 2**20 of them, as JSON)


def _error(status: int, code: str, message: str, **extra) -> web.Response:
    return web.json_response({"code": code, "message": message, **extra}, status=status)


# The data scope: what a router needs (read status, prefill, decode). The peer scope: the
# other agents' pull notices, and nothing else. Everything else (init, link, unlink,
# switch_role, drain, verify, probe, faults) is the control scope: the operator's token only.
DATA_ROUTES = {("GET", "/v1/status"), ("POST", "/v1/prefill"), ("POST", "/v1/decode")}
PEER_ROUTES = {("POST", "/v1/notify")}


SCOPE = web.RequestKey("scope", str)   # the caller's scope (control | data | peer), set by the auth middleware


def control_fields(request: web.Request, body: BaseModel, names: tuple[str, ...],
                   scopes: tuple[str, ...] = ("control",)) -> None:
    """Fields only the operator's own agents may set (they bypass the instance's admission, or
    free other requests' caches): a caller of another scope setting one gets 403."""
    if request.get(SCOPE) in scopes:
        return
    bad = [n for n in names if getattr(body, n, None) not in (None, False, [])]
    if bad:
        raise AgentError("AgentForbidden", f"{', '.join(bad)} may be set only with the control token", 403)


def _presented(request: web.Request) -> str:
    got = request.headers.get("Authorization", "")
    if got.startswith("Bearer "):
        return got[7:]
    # through the API server's pod proxy the Authorization header is the API server's: use this one
    return request.headers.get("X-PD-Agent-Token", "")


def _same(a: str, b: str | None) -> bool:
    # headers may carry any bytes (aiohttp hands them over surrogate-escaped): surrogatepass
    # encodes every str, so a stray byte is a wrong token, never an exception
    return bool(b) and hmac.compare_digest(a.encode("utf-8", "surrogatepass"), b.encode("utf-8", "surrogatepass"))


def auth_middleware(token: str | None, data_token: str | None = None, peer_token: str | None = None):
    @web.middleware
    async def mw(request: web.Request, handler):
        if not request.path.startswith("/v1/"):
            return await handler(request)
        if not token:
            return _error(401, "AgentUnauthorized", "the agent has no token configured (PD_AGENT_TOKEN)")
        got = _presented(request)
        if _same(got, token):
            request[SCOPE] = "control"
            return await handler(request)
        route = (request.method, request.path)
        held = [(scope, allowed) for scope, secret, allowed in (("data", data_token, DATA_ROUTES),
                                                                ("peer", peer_token, PEER_ROUTES))
                if _same(got, secret)]
        for scope, allowed in held:
            if route in allowed:
                request[SCOPE] = scope
                return await handler(request)
        if held:
            what = "a pull notice: it takes the peer token (pulled, linked, released)" if route in PEER_ROUTES \
                else "a data call" if route in DATA_ROUTES else "an operator (control) call"
            return _error(403, "AgentForbidden", f"the {held[0][0]} token may not call {request.method} "
                                                 f"{request.path}; it is {what}")
        return _error(401, "AgentUnauthorized", "missing or wrong bearer token")
    return mw


@web.middleware
async def error_middleware(request: web.Request, handler):
    # the route's name, never the path: a label value is kept for good, and callers choose paths
    resource = request.match_info.route.resource
    op = resource.canonical.rsplit("/", 1)[-1] if resource is not None else "unmatched"
    metrics: AgentMetrics = request.app[METRICS]
    try:
        resp = await handler(request)
        metrics.api_calls.labels(op, str(resp.status)).inc()
        return resp
    except web.HTTPException as e:
        metrics.api_calls.labels(op, str(e.status)).inc()
        if e.status < 400 or e.content_type == "application/json":
            raise
        # aiohttp's own refusals (404, 405, 413 body too large) in the agent's error shape
        resp = _error(e.status, "".join(e.reason.title().split()), e.text or e.reason)
        if "Allow" in e.headers:
            resp.headers["Allow"] = e.headers["Allow"]
        return resp
    except AgentError as e:
        metrics.api_calls.labels(op, str(e.status)).inc()
        resp = _error(e.status, e.code, str(e))
        if e.retry_after is not None:
            resp.headers["Retry-After"] = str(e.retry_after)
        return resp
    except RuntimeError as e:
        # the llm_datadist API raises RuntimeError before init, LLMException (a RuntimeError) after
        code = getattr(getattr(e, "status_code", None), "name", "ENGINE_ERROR")
        metrics.api_calls.labels(op, "409").inc()
        return _error(409, code, str(e))
    except Exception as e:  # noqa: BLE001 - a bug, still answered in the agent's shape (and logged)
        log.exception("%s %s failed", request.method, request.path)
        metrics.api_calls.labels(op, "500").inc()
        return _error(500, "AgentInternalError", f"{type(e).__name__}: {e}")


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


async def read_body(request: web.Request) -> bytes:
    """The whole body: over client_max_size 413 (error_middleware), trickling past BODY_TIMEOUT_S 408."""
    try:
        return await asyncio.wait_for(request.read(), BODY_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise AgentError("RequestTimeout", f"the request body did not arrive within {BODY_TIMEOUT_S:.0f}s",
                         408) from None


def app_runner(app: web.Application, identity: Identity) -> web.AppRunner:
    """aiohttp keeps a connection that never sends a whole request for an hour; ours go sooner."""
    return web.AppRunner(app, access_log=None, keepalive_timeout=identity.idle_timeout_s)


def metrics_app(app: web.Application) -> web.Application:
    """`app`'s GET /metrics and nothing else, for the metrics port: a NetworkPolicy admits the
    monitoring namespaces there, never to the API. Open like /metrics on the API port: it names
    no key, request or token (counts by phase, reason, route and status; gauges; latencies)."""
    handler = next(r.handler for r in app.router.routes()
                   if r.method == "GET" and r.resource is not None and r.resource.canonical == "/metrics")
    out = web.Application()
    out[METRICS] = app[METRICS]
    out.router.add_get("/metrics", handler)
    return out


async def serve_metrics(app: web.Application, identity: Identity, host: str) -> web.AppRunner | None:
    """Serve `app`'s /metrics on identity.metrics_port (None: not at all). A port that cannot be
    bound stops the agent, as the API port's would: a pod that cannot be scraped is noticed."""
    if not identity.metrics_port:
        return None
    runner = web.AppRunner(metrics_app(app), access_log=None, keepalive_timeout=identity.idle_timeout_s)
    await runner.setup()
    await web.TCPSite(runner, host, identity.metrics_port).start()
    log.info("metrics on %s:%d/metrics", host, identity.metrics_port)
    return runner


async def _body(request: web.Request, model: type[BaseModel]) -> BaseModel:
    raw = await read_body(request)
    try:
        # bytes: the encoding is JSON's (UTF-8), whatever charset Content-Type names
        data = json.loads(raw, parse_constant=_no_constant) if raw.strip() else {}
    except (ValueError, RecursionError) as e:   # RecursionError: nested too deep to parse
        raise web.HTTPBadRequest(text=json.dumps({"code": "BadRequest", "message": f"body is not JSON: {e}"}),
                                 content_type="application/json") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "(body)"
        raise web.HTTPBadRequest(
            text=json.dumps({"code": "BadRequest", "field": field,
                             "message": f"{field}: {first['msg']}", "errors": json.loads(e.json())}),
            content_type="application/json") from None


def _json(model: BaseModel, status: int = 200) -> web.Response:
    return web.json_response(model.model_dump(mode="json"), status=status)


def routes(core: AgentCore, token: str | None, http: httpx.AsyncClient) -> list[web.RouteDef]:  # noqa: C901
    def handler(model, fn: Callable[[BaseModel], Awaitable[BaseModel | None]], control: tuple[str, ...] = (),
                scopes: tuple[str, ...] = ("control",)):
        async def h(request: web.Request) -> web.Response:
            body = await _body(request, model) if model else None
            if body is not None and control:
                control_fields(request, body, control, scopes)
            out = await fn(body)
            return _json(out if out is not None else core.status())
        return h

    async def healthz(request: web.Request) -> web.Response:
        ok = core.initialized
        return web.json_response({"ok": ok, "role": core.role, "boot_id": core.boot_id,
                                  "last_error": core.last_error}, status=200 if ok else 503)

    async def livez(request: web.Request) -> web.Response:
        """The event loop answers: an engine that cannot init yet is /healthz's to report (it
        retries), and restarting the pod would not help it."""
        return web.json_response({"ok": True, "boot_id": core.boot_id})

    async def metrics(request: web.Request) -> web.Response:
        m = request.app[METRICS]
        st = core.status()
        m.kv_used.set(st.load.kv_used_bytes)
        m.links.labels("up").set(sum(1 for l in st.links if l.code == "LLM_SUCCESS"))
        m.links.labels("down").set(sum(1 for l in st.links if l.code != "LLM_SUCCESS"))
        return web.Response(body=generate_latest(m.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def status(request: web.Request) -> web.Response:
        return _json(core.status())

    async def verify(body: VerifyRequest):
        return await core.verify(body.peer, http, token)

    async def faults(body: FaultsRequest):
        if not hasattr(core.llm, "SIMULATED"):
            raise AgentError("LLM_FEATURE_NOT_ENABLED", "fault injection exists only on the simulator", 400)
        if body.crash:
            log.warning("crash requested through the admin API")
            asyncio.get_running_loop().call_later(0.05, os._exit, 137)
            return None
        from llm_datadist_sim import faults as f
        f.update(**body.model_dump(exclude_none=True, exclude={"crash", "switch_crash_after_ranks"}))
        return None

    async def faults_get(request: web.Request) -> web.Response:
        from llm_datadist_sim import faults as f
        return web.json_response(f.current().as_dict())

    async def init(_):
        await core.init()

    async def notify(body: NotifyRequest):
        core.notify(body)

    async def switch(body: SwitchRoleRequest):
        await core.switch_role(body.role)

    inf = core.inference

    async def kv_held(request: web.Request) -> web.Response:
        """A rank of a multi-rank decoder: the shard it pulled for a request, once, for the rank
        that decodes (the reference engine)."""
        try:
            req_id = int(request.match_info["req_id"])
        except ValueError:
            return _error(400, "BadRequest", "req_id must be an integer")
        return web.Response(body=inf.take_held(req_id), content_type="application/octet-stream")

    async def decode(request: web.Request) -> web.StreamResponse:
        """Plain: one JSON reply. `stream: true`: NDJSON, a line per token as the decode loop
        emits it ({"token": i, "ms": since the decode started}), then {"done": DecodeResponse}
        or {"error": {code, message}}. Refusals before the first token are plain HTTP errors,
        so a router can send the request elsewhere. A client that goes away cancels the decode."""
        body = await _body(request, DecodeRequest)
        control_fields(request, body, ("admitted", "kv_pulled_ms"))
        if not body.stream:
            return _json(await inf.decode(body))
        inf.responding += 1
        try:
            return await _stream(request, body)
        finally:
            inf.responding -= 1

    async def _stream(request: web.Request, body: DecodeRequest) -> web.StreamResponse:
        tokens: asyncio.Queue = asyncio.Queue()
        task = asyncio.create_task(inf.decode(body, tokens))
        first = asyncio.create_task(tokens.get())
        try:
            await asyncio.wait({task, first}, return_when=asyncio.FIRST_COMPLETED)
            if not first.done():
                first.cancel()
                await task  # finished (or failed) before any token: raises its AgentError as a plain error
                return _json(task.result())
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

    r = [
        web.get("/healthz", healthz),
        web.get("/livez", livez),
        web.get("/metrics", metrics),
        web.get("/v1/status", status),
        web.post("/v1/init", handler(None, init)),
        web.post("/v1/link", handler(LinkRequest, core.link)),
        web.post("/v1/unlink", handler(UnlinkRequest, core.unlink)),
        web.post("/v1/switch_role", handler(SwitchRoleRequest, switch)),
        web.post("/v1/verify", handler(VerifyRequest, verify)),
        web.post("/v1/probe", handler(ProbeRequest, lambda b: core.probe(b.req_id, b.content))),
        web.post("/v1/drain", handler(DrainRequest, lambda b: core.drain(b.timeout_s))),
        web.post("/v1/undrain", handler(None, lambda _: core.undrain())),
        web.post("/v1/notify", handler(NotifyRequest, notify, control=("released",), scopes=("control", "peer"))),
        web.post("/v1/admin/faults", handler(FaultsRequest, faults)),
        web.get("/v1/admin/faults", faults_get),
    ]
    if inf is not None:
        r += [web.post("/v1/prefill", handler(PrefillRequest, inf.prefill, control=("admitted",))),
              web.post("/v1/decode", decode),
              web.post("/v1/pull", handler(PullRequest, inf.pull)),
              web.get("/v1/kv/{req_id}", kv_held)]
    return r


def build_app(core: AgentCore, token: str | None, metrics: AgentMetrics | None = None,
              serve_inference: bool = True, data_token: str | None = None,
              peer_token: str | None = None) -> web.Application:
    """The HTTP API over `core`. An inference server embedding the agent calls this with a
    core built around its own engine and mounts or runs the app."""
    metrics = metrics or AgentMetrics()
    if serve_inference and core.inference is None:
        Inference(core, metrics)
    app = web.Application(middlewares=[auth_middleware(token, data_token, peer_token), error_middleware],
                          client_max_size=MAX_BODY_BYTES)
    app[CORE] = core
    app[METRICS] = metrics
    # agent-to-agent calls (verify) must not go through a proxy
    app[HTTP] = httpx.AsyncClient(trust_env=False, timeout=10)
    app.add_routes(routes(core, token, app[HTTP]))

    async def lifecycle(app: web.Application):
        if core.notifier is None:
            # Notices go only to the agents the operator linked this one to (never to a URL a
            # request names), so without a peer token the control token is what they carry.
            core.notifier = Notifier(app[HTTP], peer_token or token, core.id.cluster_id)
            core.notifier.start()
        health = asyncio.create_task(core.health_loop(), name="link-health")
        if core.inference is not None:
            core.inference.start()
        yield
        health.cancel()
        if core.inference is not None:
            await core.inference.stop()
        await core.notifier.stop()
        await app[HTTP].aclose()

    app.cleanup_ctx.append(lifecycle)
    return app


async def _wait(ev: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(ev.wait(), seconds)
    except asyncio.TimeoutError:
        pass


def _device_of(core: AgentCore) -> None:
    """A single-rank pod the operator manages: the engine listens on its NPU's device IP (the
    simulator without one: the pod IP, as before). Raises ConfigError naming what is missing."""
    if not os.environ.get("PD_TENSOR_PARALLEL"):
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
            await _wait(stop, 0.5)


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
        asyncio.create_task(_register(os.environ["PD_RANK_REGISTER_URL"], rank, f"http://{host}:{port}",
                                      core.boot_id, identity.token, stop))
    log.info("agent %s%s (%s, cluster_id %d) serving on %s:%d, datadist %s:%d, backend %s",
             identity.pod, f" rank {rank}" if rank is not None else "", identity.role, identity.cluster_id,
             host, port, identity.ip, identity.port, identity.backend)
    if identity.engine_start_s > 0:
        # the simulator's stand-in for loading weights and building the engine
        log.info("engine start-up takes %.1fs", identity.engine_start_s)
        await _wait(stop, identity.engine_start_s)
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
            await _wait(stop, delay)
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
    ap.add_argument("--host", default=os.environ.get("PD_LOCAL_POD_IP", "0.0.0.0"))
    ap.add_argument("--port", type=int, default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would drown the log
    try:
        identity = Identity.from_env()
        tp = int(os.environ.get("PD_TENSOR_PARALLEL") or 1)
        rank = int(os.environ["PD_RANK"]) if os.environ.get("PD_RANK") else None
    except (ConfigError, ValueError) as e:
        raise SystemExit(f"pd_agent: bad configuration: {e}") from None
    if rank is not None:
        # a rank process: its API on a local port, registered with the pod's agent
        _die_with_parent()
        asyncio.run(_serve(identity, os.environ.get("PD_LOCAL_POD_IP") or "127.0.0.1", 0, rank=rank))
    elif tp > 1 or os.environ.get("PD_RANKS_EXTERNAL", "").lower() in ("1", "true", "yes"):
        # several ranks, or an inference server beside this agent starts its own: the pod's agent
        from .front import serve_front
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
