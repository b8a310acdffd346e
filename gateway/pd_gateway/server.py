"""pd-gateway: one Base URL, one API key and one model id in front of a PDDeployment.

OpenAI (`GET /v1/models`, `POST /v1/chat/completions`, `POST /v1/completions`) and Anthropic
(`POST /v1/messages`) wire formats, streamed (SSE) and not, over P-D routing (pd_contract.routing).
Every error is the API's own error object, so a client always has something to read.
Open endpoints: /healthz, /metrics, /stats (recent TTFT/TBT percentiles)."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import time
from dataclasses import dataclass

import httpx
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from pd_contract.names import AGENT_PORT
from pd_contract.routing import Attempt, EngineError, Fleet, Unavailable, fixed_finder, generate, pod_finder

from . import wire
from .keys import Keys, RateLimits, from_env, from_secret
from .metrics import GatewayMetrics

log = logging.getLogger("pd_gateway")
PORT = 8000
MAX_OUTPUT_TOKENS = 4096
PROXY_VARS = ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY")


@dataclass
class Config:
    model: str
    namespace: str
    deployment: str | None = None
    data_token: str | None = None
    keys_secret: str | None = None
    rpm: dict | None = None
    agents: list[str] | None = None      # fixed agent URLs instead of discovery (outside a cluster)
    max_output_tokens: int = MAX_OUTPUT_TOKENS

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "Config":
        env = dict(os.environ if env is None else env)
        return cls(model=env.get("PD_MODEL_NAME", "model"),
                   namespace=env.get("POD_NAMESPACE", "default"),
                   deployment=env.get("PD_GATEWAY_DEPLOYMENT") or None,
                   data_token=env.get("PD_AGENT_DATA_TOKEN") or None,
                   keys_secret=env.get("PD_GATEWAY_KEYS_SECRET") or None,
                   rpm=json.loads(env.get("PD_GATEWAY_RPM") or "{}"),
                   agents=[u for u in env.get("PD_GATEWAY_AGENTS", "").split(",") if u] or None,
                   max_output_tokens=int(env.get("PD_GATEWAY_MAX_OUTPUT_TOKENS", MAX_OUTPUT_TOKENS)))


class Gateway:
    def __init__(self, cfg: Config, keys: Keys, fleet: Fleet, metrics: GatewayMetrics | None = None):
        self.cfg = cfg
        self.keys = keys
        self.limits = RateLimits(cfg.rpm or {})
        self.fleet = fleet
        self.m = metrics or GatewayMetrics()

    # ---- errors and auth ---------------------------------------------------------------------
    @staticmethod
    def error(api: str, status: int, message: str, etype: str, code: str | None = None,
              headers: dict | None = None) -> web.Response:
        body = wire.anthropic_error(status, message) if api == "anthropic" else wire.openai_error(message, etype, code)
        return web.json_response(body, status=status, headers=headers)

    def authenticate(self, request: web.Request, api: str, endpoint: str) -> tuple[str | None, web.Response | None]:
        got = request.headers.get("Authorization", "")
        presented = got[7:].strip() if got.startswith("Bearer ") else request.headers.get("x-api-key", "").strip()
        if not presented:
            return None, self.error(api, 401, "missing API key: send it as `Authorization: Bearer <key>` (OpenAI "
                                              "clients: api_key) or `x-api-key: <key>` (Anthropic clients)",
                                    "authentication_error", "missing_api_key")
        name = self.keys.name_of(presented)
        if name is None:
            return None, self.error(api, 401, "invalid API key: it is not one of this gateway's keys (check for "
                                              "a typo, spaces, or a key from another deployment)",
                                    "authentication_error", "invalid_api_key")
        wait = self.limits.admit(name)
        if wait is not None:
            self.m.requests.labels(name, endpoint, "429").inc()
            return None, self.error(api, 429, f"rate limit for key {name!r} reached "
                                              f"({self.limits.rpm[name]} requests per minute); retry in {wait:.0f}s",
                                    "rate_limit_error", "rate_limit_exceeded",
                                    headers={"Retry-After": str(max(1, round(wait)))})
        return name, None

    async def parse(self, request: web.Request, model: type[BaseModel], api: str):
        try:
            data = await request.json()
        except ValueError as e:
            return None, self.error(api, 400, f"the body is not JSON: {e}", "invalid_request_error")
        try:
            body = model.model_validate(data)
        except ValidationError as e:
            first = e.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or "(body)"
            return None, self.error(api, 400, f"{field}: {first['msg']}", "invalid_request_error", "invalid_value")
        if body.model != self.cfg.model:
            return None, self.error(api, 404, f"model {body.model!r} not found; this gateway serves "
                                              f"{self.cfg.model!r}", "invalid_request_error", "model_not_found")
        return body, None

    # ---- routes ------------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        name, err = self.authenticate(request, "openai", "models")
        if err:
            return err
        self.m.requests.labels(name, "models", "200").inc()
        return web.json_response(wire.models_reply(self.cfg.model))

    async def chat(self, request: web.Request) -> web.StreamResponse:
        name, err = self.authenticate(request, "openai", "chat")
        if err:
            return err
        body, err = await self.parse(request, wire.ChatRequest, "openai")
        if err:
            return err
        return await self.serve(request, name, "chat", body.prompt(), body.output_tokens(), body.stream,
                                include_usage=bool((body.stream_options or {}).get("include_usage")))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        name, err = self.authenticate(request, "openai", "completions")
        if err:
            return err
        body, err = await self.parse(request, wire.CompletionRequest, "openai")
        if err:
            return err
        return await self.serve(request, name, "completions", body.text(), body.output_tokens(), body.stream,
                                include_usage=bool((body.stream_options or {}).get("include_usage")))

    async def messages(self, request: web.Request) -> web.StreamResponse:
        name, err = self.authenticate(request, "anthropic", "anthropic")
        if err:
            return err
        body, err = await self.parse(request, wire.MessagesRequest, "anthropic")
        if err:
            return err
        return await self.serve(request, name, "anthropic", body.prompt(), body.max_tokens, body.stream)

    async def not_found(self, request: web.Request) -> web.Response:
        api = "anthropic" if "messages" in request.path else "openai"
        return self.error(api, 404, wire.path_hint(request.path), "invalid_request_error", "not_found")

    # ---- one request -----------------------------------------------------------------------------
    async def serve(self, request: web.Request, key: str, api: str, prompt: str, max_tokens: int, stream: bool,
                    include_usage: bool = False) -> web.StreamResponse:
        t0 = time.monotonic()
        prompt_tokens = wire.approx_tokens(prompt)
        out_tokens = min(max_tokens, self.cfg.max_output_tokens)
        rid = wire.new_id("msg" if api == "anthropic" else ("chatcmpl" if api == "chat" else "cmpl"))
        attempt = Attempt()
        gen = generate(self.fleet, random.getrandbits(63), prompt_tokens, out_tokens, attempt)
        pieces: list[str] = []
        times: list[float] = []
        resp: web.StreamResponse | None = None
        status = "200"
        try:
            async for msg in gen:
                if "token" in msg:
                    times.append(time.monotonic())
                    text = wire.piece(prompt, msg["token"])
                    pieces.append(text)
                    if stream:
                        if resp is None:
                            resp = await self._open_stream(request, api, rid, prompt_tokens)
                        await resp.write(self._chunk(api, rid, text))
            n = len(pieces)
            finish = "length" if n >= out_tokens else "stop"
            self._account(key, api, attempt, t0, times, prompt_tokens, n)
            if not stream:
                text = "".join(pieces)
                if api == "chat":
                    return web.json_response(wire.chat_reply(rid, self.cfg.model, text, prompt_tokens, n, finish))
                if api == "completions":
                    return web.json_response(wire.completion_reply(rid, self.cfg.model, text, prompt_tokens, n,
                                                                   finish))
                return web.json_response(wire.message_reply(rid, self.cfg.model, text, prompt_tokens, n,
                                                            "max_tokens" if finish == "length" else "end_turn"))
            if resp is None:
                resp = await self._open_stream(request, api, rid, prompt_tokens)
            await self._close_stream(resp, api, rid, prompt_tokens, n, finish, include_usage)
            return resp
        except (Unavailable, EngineError) as e:
            status = "503" if isinstance(e, Unavailable) else "502"
            reason = e.reason if isinstance(e, Unavailable) else e.code
            self.m.errors.labels(key, reason).inc()
            log.warning("request %s (key %s) failed: %s", rid, key, e)
            if resp is None:   # nothing sent yet: a proper HTTP error
                return self.error("anthropic" if api == "anthropic" else "openai", int(status), str(e),
                                  "server_error" if status == "502" else "overloaded_error", reason)
            # mid-stream: the API's error event; the client sees the stream end with it
            if api == "anthropic":
                await resp.write(wire.sse(wire.anthropic_error(int(status), str(e)), "error"))
            else:
                await resp.write(wire.sse(wire.openai_error(str(e), "server_error", reason)))
            return resp
        finally:
            await gen.aclose()
            self.m.requests.labels(key, api, status).inc()
            for role, pod in (("prefill", attempt.prefill), ("decoder", attempt.decoder)):
                if pod:
                    self.m.pod_requests.labels(pod, role, "ok" if status == "200" else "failed").inc()
            for reason, n in attempt.refusals.items():
                self.m.retries.labels(reason).inc(n)

    def _account(self, key: str, api: str, attempt: Attempt, t0: float, times: list[float], prompt: int,
                 completion: int) -> None:
        if times:
            gaps = [(b - a) * 1000 for a, b in zip(times, times[1:])]
            self.m.record(key, (times[0] - t0) * 1000, sum(gaps) / len(gaps) if gaps else None)
        self.m.tokens.labels(key, "prompt").inc(prompt)
        self.m.tokens.labels(key, "completion").inc(completion)

    async def _open_stream(self, request: web.Request, api: str, rid: str, prompt_tokens: int) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        if api == "chat":
            await resp.write(wire.sse(wire.chat_chunk(rid, self.cfg.model, {"role": "assistant", "content": ""})))
        elif api == "anthropic":
            await resp.write(wire.sse({"type": "message_start", "message": {
                "id": rid, "type": "message", "role": "assistant", "content": [], "model": self.cfg.model,
                "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}}, "message_start"))
            await resp.write(wire.sse({"type": "content_block_start", "index": 0,
                                       "content_block": {"type": "text", "text": ""}}, "content_block_start"))
        return resp

    def _chunk(self, api: str, rid: str, text: str) -> bytes:
        if api == "chat":
            return wire.sse(wire.chat_chunk(rid, self.cfg.model, {"content": text}))
        if api == "completions":
            return wire.sse(wire.completion_chunk(rid, self.cfg.model, text))
        return wire.sse({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}},
                        "content_block_delta")

    async def _close_stream(self, resp: web.StreamResponse, api: str, rid: str, prompt: int, n: int, finish: str,
                            include_usage: bool) -> None:
        usage = wire.usage(prompt, n)
        if api == "chat":
            await resp.write(wire.sse(wire.chat_chunk(rid, self.cfg.model, {}, finish)))
            if include_usage:
                await resp.write(wire.sse(wire.chat_chunk(rid, self.cfg.model, {}, usage_=usage, choices=False)))
            await resp.write(wire.sse("[DONE]"))
        elif api == "completions":
            await resp.write(wire.sse(wire.completion_chunk(rid, self.cfg.model, "", finish)))
            if include_usage:
                await resp.write(wire.sse(wire.completion_chunk(rid, self.cfg.model, "", usage_=usage,
                                                                choices=False)))
            await resp.write(wire.sse("[DONE]"))
        else:
            await resp.write(wire.sse({"type": "content_block_stop", "index": 0}, "content_block_stop"))
            await resp.write(wire.sse({"type": "message_delta", "delta": {
                "stop_reason": "max_tokens" if finish == "length" else "end_turn", "stop_sequence": None},
                "usage": {"output_tokens": n}}, "message_delta"))
            await resp.write(wire.sse({"type": "message_stop"}, "message_stop"))
        await resp.write_eof()

    # ---- open endpoints ------------------------------------------------------------------------
    async def healthz(self, request: web.Request) -> web.Response:
        ok = len(self.keys) > 0
        return web.json_response({"ok": ok, "keys": len(self.keys), "prefills": len(self.fleet.prefills),
                                  "decoders": len(self.fleet.decoders),
                                  "errors": [e for e in (self.keys.error, self.fleet.error) if e]},
                                 status=200 if ok else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.m.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.m.stats())

    def app(self) -> web.Application:
        app = web.Application(client_max_size=8 << 20)
        app.add_routes([
            web.get("/healthz", self.healthz), web.get("/metrics", self.metrics), web.get("/stats", self.stats),
            web.get("/v1/models", self.models), web.post("/v1/chat/completions", self.chat),
            web.post("/v1/completions", self.completions), web.post("/v1/messages", self.messages),
        ])
        app.router.add_route("*", "/{tail:.*}", self.not_found)
        return app


async def _refresh_keys(keys: Keys) -> None:
    while True:
        await asyncio.to_thread(keys.refresh)
        await asyncio.sleep(10)


async def serve(cfg: Config, host: str, port: int) -> None:
    set_proxy = [v for v in PROXY_VARS if os.environ.get(v)]
    if set_proxy:
        log.warning("proxy variables set (%s): ignored; calls to the engines never go through a proxy",
                    ", ".join(set_proxy))
    http = httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(120, connect=2),
                             limits=httpx.Limits(max_connections=2048, max_keepalive_connections=256))
    if cfg.agents:
        finder = fixed_finder(cfg.agents)
    elif cfg.deployment:
        finder = pod_finder(cfg.namespace, cfg.deployment)
    else:
        raise SystemExit("pd_gateway: set PD_GATEWAY_DEPLOYMENT (or PD_GATEWAY_AGENTS)")
    keys = Keys(from_secret(cfg.namespace, cfg.keys_secret) if cfg.keys_secret else from_env())
    await asyncio.to_thread(keys.refresh)
    fleet = Fleet(http, cfg.data_token, finder)
    gw = Gateway(cfg, keys, fleet)
    tasks = [asyncio.create_task(fleet.run()), asyncio.create_task(_refresh_keys(keys))]
    runner = web.AppRunner(gw.app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    log.info("pd-gateway serving model %s on %s:%d (%d API keys)", cfg.model, host, port, len(keys))
    stop = asyncio.Event()
    import signal
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down")
    for t in tasks:
        t.cancel()
    await runner.cleanup()
    await http.aclose()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="pd_gateway", description=__doc__)
    ap.add_argument("--host", default=os.environ.get("PD_LOCAL_POD_IP", "0.0.0.0"))
    ap.add_argument("--port", type=int, default=int(os.environ.get("PD_GATEWAY_PORT", PORT)))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would drown the log
    asyncio.run(serve(Config.from_env(), args.host, args.port))


__all__ = ["AGENT_PORT", "Config", "Gateway", "main"]
