"""The agent API's HTTP plumbing, shared by the single-rank agent (server.py), the pod's agent
over its ranks (front.py) and the MindIE hook: body parsing and validation, JSON and error
replies, the auth and error middlewares, control-only fields, the route table turned into
aiohttp routes over an AgentService, the runners and the metrics port.

Every /v1 call needs a bearer token of a scope its route admits (routes.py); a malformed body
gets 400 naming the field. /healthz, /livez and /metrics are open. This module imports no
other HTTP module of the agent: server.py and front.py import it, never the other way."""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
from typing import Any, Awaitable, Callable

from aiohttp import web
from pydantic import BaseModel, ValidationError

from pd_contract.agent_api import AgentPath

from .core import AgentError
from .identity import Identity
from .metrics import AgentMetrics
from .routes import DATA_ROUTES, PEER_ROUTES, ROUTES, AgentService, Route

log = logging.getLogger("pd_agent")
METRICS = web.AppKey("metrics", AgentMetrics)
SCOPE = web.RequestKey("scope", str)   # the caller's scope (control | data | peer), set by the auth middleware
BODY_TIMEOUT_S = 30.0   # a request body (at most client_max_size) must arrive within this
MAX_BODY_BYTES = 8 << 20   # a prefill's token ids (up to 2**20 of them, as JSON)


def error_reply(status: int, code: str, message: str, **extra) -> web.Response:
    return web.json_response({"code": code, "message": message, **extra}, status=status)


def model_reply(model: BaseModel, status: int = 200) -> web.Response:
    return web.json_response(model.model_dump(mode="json"), status=status)


def control_fields(request: web.Request, body: BaseModel, names: tuple[str, ...],
                   scopes: tuple[str, ...] = ("control",)) -> None:
    """Fields only the operator's own agents may set (they bypass the instance's admission, or
    free other requests' caches): a caller of another scope setting one gets 403."""
    if request.get(SCOPE) in scopes:
        return
    bad = [n for n in names if getattr(body, n, None) not in (None, False, [])]
    if bad:
        raise AgentError("AgentForbidden", f"{', '.join(bad)} may be set only with the control token", 403)


def presented_token(request: web.Request) -> str:
    got = request.headers.get("Authorization", "")
    if got.startswith("Bearer "):
        return got[7:]
    # through the API server's pod proxy the Authorization header is the API server's: use this one
    return request.headers.get("X-PD-Agent-Token", "")


def same_token(a: str, b: str | None) -> bool:
    # headers may carry any bytes (aiohttp hands them over surrogate-escaped): surrogatepass
    # encodes every str, so a stray byte is a wrong token, never an exception
    if not b:
        return False
    return hmac.compare_digest(a.encode("utf-8", "surrogatepass"), b.encode("utf-8", "surrogatepass"))


def auth_middleware(token: str | None, data_token: str | None = None, peer_token: str | None = None):
    @web.middleware
    async def mw(request: web.Request, handler):
        if not request.path.startswith(AgentPath.API):
            return await handler(request)
        if not token:
            return error_reply(401, "AgentUnauthorized", "the agent has no token configured (PD_AGENT_TOKEN)")
        got = presented_token(request)
        if same_token(got, token):
            request[SCOPE] = "control"
            return await handler(request)
        route = (request.method, request.path)
        held = [(scope, allowed) for scope, secret, allowed in (("data", data_token, DATA_ROUTES),
                                                                ("peer", peer_token, PEER_ROUTES))
                if same_token(got, secret)]
        for scope, allowed in held:
            if route in allowed:
                request[SCOPE] = scope
                return await handler(request)
        if held:
            what = "a pull notice: it takes the peer token (pulled, linked, released)" if route in PEER_ROUTES \
                else "a data call" if route in DATA_ROUTES else "an operator (control) call"
            return error_reply(403, "AgentForbidden", f"the {held[0][0]} token may not call {request.method} "
                                                      f"{request.path}; it is {what}")
        return error_reply(401, "AgentUnauthorized", "missing or wrong bearer token")
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
        resp = error_reply(e.status, "".join(e.reason.title().split()), e.text or e.reason)
        if "Allow" in e.headers:
            resp.headers["Allow"] = e.headers["Allow"]
        return resp
    except AgentError as e:
        metrics.api_calls.labels(op, str(e.status)).inc()
        resp = error_reply(e.status, e.code, str(e))
        if e.retry_after is not None:
            resp.headers["Retry-After"] = str(e.retry_after)
        return resp
    except RuntimeError as e:
        # the llm_datadist API raises RuntimeError before init, LLMException (a RuntimeError) after
        code = getattr(getattr(e, "status_code", None), "name", "ENGINE_ERROR")
        metrics.api_calls.labels(op, "409").inc()
        return error_reply(409, code, str(e))
    except Exception as e:  # noqa: BLE001 - a bug, still answered in the agent's shape (and logged)
        log.exception("%s %s failed", request.method, request.path)
        metrics.api_calls.labels(op, "500").inc()
        return error_reply(500, "AgentInternalError", f"{type(e).__name__}: {e}")


def api_app(token: str | None, data_token: str | None, peer_token: str | None,
            metrics: AgentMetrics) -> web.Application:
    """An empty agent API app: its middlewares (auth, then errors), body limit and metrics."""
    app = web.Application(middlewares=[auth_middleware(token, data_token, peer_token), error_middleware],
                          client_max_size=MAX_BODY_BYTES)
    app[METRICS] = metrics
    return app


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


async def read_body(request: web.Request) -> bytes:
    """The whole body: over client_max_size 413 (error_middleware), trickling past BODY_TIMEOUT_S 408."""
    try:
        return await asyncio.wait_for(request.read(), BODY_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise AgentError("RequestTimeout", f"the request body did not arrive within {BODY_TIMEOUT_S:.0f}s",
                         408) from None


async def read_model(request: web.Request, model: type[BaseModel]) -> BaseModel:
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


def _handler(svc: AgentService, route: Route) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    fn: Callable[..., Awaitable[Any]] = getattr(svc, route.op)

    async def h(request: web.Request) -> web.StreamResponse:
        args: list[Any] = []
        if route.model is not None:
            body = await read_model(request, route.model)
            if route.control_fields:
                control_fields(request, body, route.control_fields, route.control_scopes)
            args.append(body)
        if route.request:
            return await fn(*args, request)
        out = await fn(*args)
        if route.changes:
            svc.changed()
        if isinstance(out, dict):
            return web.json_response(out)
        return model_reply(out if out is not None else await svc.current_status())
    return h


def api_routes(svc: AgentService) -> list[web.RouteDef]:
    """The route table's routes `svc` offers, each answered by its method `Route.op`."""
    return [web.get(r.path, _handler(svc, r)) if r.method == "GET" else web.route(r.method, r.path, _handler(svc, r))
            for r in ROUTES if svc.offers(r)]


def app_runner(app: web.Application, identity: Identity) -> web.AppRunner:
    """aiohttp keeps a connection that never sends a whole request for an hour; ours go sooner."""
    return web.AppRunner(app, access_log=None, keepalive_timeout=identity.idle_timeout_s)


def metrics_app(app: web.Application) -> web.Application:
    """`app`'s GET /metrics and nothing else, for the metrics port: a NetworkPolicy admits the
    monitoring namespaces there, never to the API. Open like /metrics on the API port: it names
    no key, request or token (counts by phase, reason, route and status; gauges; latencies)."""
    handler = next(r.handler for r in app.router.routes()
                   if r.method == "GET" and r.resource is not None and r.resource.canonical == AgentPath.METRICS)
    out = web.Application()
    out[METRICS] = app[METRICS]
    out.router.add_get(AgentPath.METRICS, handler)
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


async def wait_event(ev: asyncio.Event, seconds: float) -> None:
    """Until `ev` is set or `seconds` pass, whichever is first."""
    try:
        await asyncio.wait_for(ev.wait(), seconds)
    except asyncio.TimeoutError:
        pass
