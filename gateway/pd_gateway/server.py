"""pd-gateway: one Base URL, one API key and one model id in front of a PDDeployment.

OpenAI (`GET /v1/models`, `POST /v1/chat/completions`, `POST /v1/completions`) and Anthropic
(`POST /v1/messages`) wire formats, streamed (SSE) and not, over P-D routing (pd_router.routing).
Every error is the API's own error object, so a client always has something to read; a
malformed request is a 4xx, refused before any engine works on it.
Open endpoints: /healthz (readiness) and /livez (liveness) on the API port; /metrics and /stats
(recent TTFT/TBT percentiles) on a port of their own (9090), since they name every key and its
usage: the API port is public, the metrics port is for the operator and monitoring only.

The prompt is tokenized here (pd_contract.tokens) and sent to the prefill as token ids with
the request's sampling (temperature, top_p, seed); the reply text is the decoder's token ids
decoded as they arrive. `usage` counts those tokens.

Bounds (env, generous defaults): requests in flight per key (429) and in total (503), the
body's size (413) and read time (408), the body bytes held by the requests in flight (503: what
bounds the gateway's memory), the time to send a request's headers (the connection
is closed), the prompt and the output tokens asked for against the model's context (400
context_length_exceeded), the gap between tokens from a decoder (the stream ends with an error
event)."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Coroutine

import httpx
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from pd_contract import tokens
from pd_contract.engine_env import (
    PD_AGENT_DATA_TOKEN,
    PD_LOCAL_POD_IP,
    PD_LOCAL_ROOT,
    PD_MODEL_NAME,
    POD_NAMESPACE,
    flag,
)
from pd_contract.gateway_env import (
    PD_GATEWAY_BOS_TOKEN,
    PD_GATEWAY_CHAT_TEMPLATE,
    PD_GATEWAY_DECODER_FIRST,
    PD_GATEWAY_DEPLOYMENT,
    PD_GATEWAY_ENGINE_PORT,
    PD_GATEWAY_EOS_TOKEN,
    PD_GATEWAY_KEY_POLICY,
    PD_GATEWAY_KEYS_SECRET,
    PD_GATEWAY_ROUTES,
    PD_GATEWAY_RPM,
    PD_GATEWAY_TOKENIZER,
    PD_GATEWAY_USAGE_CONFIGMAP,
    PD_MODEL_ALIASES,
    POD_IP,
)
from pd_contract.names import AGENT_PORT, GATEWAY_METRICS_PORT
from pd_router.routing import (
    TOKEN_GAP_TIMEOUT_S,
    Attempt,
    EngineError,
    Fleet,
    Unavailable,
    fixed_finder,
    generate,
    pod_finder,
    summary,
)

from . import bodies, policy, vllm_route, wire
from .bodies import BodyBytes, Held, Lanes, Refused
from .keys import MIN_KEY_LENGTH, REFRESH_S, Keys, RateLimits, from_env, from_secret
from .metrics import GatewayMetrics
from .stops import StopScanner
from .tokenizer import Cl100k, HuggingFace, ModelTokenizer, PromptRefused, PromptTooLong
from .tokenizer import Unavailable as TokenizerUnavailable
from .tokenizer import load as load_tokenizer
from .usage import DAY, MAX_NAME, SYNC_S, ConfigMapStore, Usage

log = logging.getLogger("pd_gateway")
PORT = 8000
MAX_OUTPUT_TOKENS = 4096
# the most a request's prompt and output tokens may add up to (the common 128k of current models)
# unless PD_GATEWAY_MAX_CONTEXT_TOKENS says otherwise: the context before the engines report
# theirs (their KV cache's sequence length), and a ceiling on it after
MAX_CONTEXT_TOKENS = 131072
# a prompt longer than this (characters) is tokenized in a worker thread, so the event loop
# goes on serving the other requests meanwhile (about 15 ms per 100 KB)
THREAD_TOKENIZE_CHARS = 64 << 10
# in flight: below the engine connection pool (2048), so the pods' status polls and prefills
# always find a connection; a key gets a quarter, so one client cannot take every slot
MAX_STREAMS = 1024
MAX_STREAMS_PER_KEY = 256
MAX_BODY_BYTES = 8 << 20       # a 2M-character prompt, JSON-escaped
# A body lives as long as its request, with its parse and its prompt's token ids: 12x its size for
# English text, up to 27x for text of one-character tokens (a Python int per token). 1024 bodies of
# 8 MiB would be 8 GiB; this many body bytes in flight (Content-Length, or the limit if a body names
# none) stay under about 650 MiB at worst, within the chart's default 1 GiB memory limit.
MAX_BODY_BYTES_IN_FLIGHT = 3 * MAX_BODY_BYTES
BODY_TIMEOUT_S = 60.0          # 8 MiB at 1 Mbit/s
HEADER_TIMEOUT_S = 30.0        # also how long an idle keep-alive connection is kept
PROXY_VARS = ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY")
JSON_CHARSETS = ("utf-8", "utf8", "us-ascii", "ascii")   # JSON between systems is UTF-8 (RFC 8259)
KNOWN = {"/v1/models": "GET", "/v1/chat/completions": "POST", "/v1/completions": "POST", "/v1/messages": "POST",
         "/v1/responses": "POST", "/v1/usage": "GET"}


def _positive(env: dict[str, str], name: str, default: Any, cast: Callable[[str], Any] = int) -> Any:
    raw = env.get(name)
    if not raw:
        return default
    try:
        value = cast(raw)
    except ValueError:
        raise SystemExit(f"pd_gateway: {name} must be a number, got {raw!r}") from None
    if not value > 0:
        raise SystemExit(f"pd_gateway: {name} must be positive, got {raw!r}")
    return value


@dataclass
class Config:
    model: str
    namespace: str
    deployment: str | None = None
    aliases: tuple[str, ...] = ()
    data_token: str | None = None
    keys_secret: str | None = None
    rpm: dict | None = None
    agents: list[str] | None = None      # fixed agent URLs instead of discovery (outside a cluster)
    max_output_tokens: int = MAX_OUTPUT_TOKENS
    max_context_tokens: int = MAX_CONTEXT_TOKENS
    max_streams: int = MAX_STREAMS
    max_streams_per_key: int = MAX_STREAMS_PER_KEY
    max_body_bytes: int = MAX_BODY_BYTES
    max_body_bytes_in_flight: int = MAX_BODY_BYTES_IN_FLIGHT
    max_body_bytes_per_key: int | None = None   # default: half the bytes in flight, at least one body
    max_json_values: int = bodies.MAX_JSON_VALUES
    body_timeout_s: float = BODY_TIMEOUT_S
    header_timeout_s: float = HEADER_TIMEOUT_S
    token_gap_timeout_s: float = TOKEN_GAP_TIMEOUT_S
    min_key_length: int = MIN_KEY_LENGTH
    # a gateway shared by several deployments (a PDGateway): [{model, aliases, deployment, tokenEnv}]
    routes: list[dict] | None = None
    key_policy: dict[str, policy.KeyPolicy] | None = None
    usage_configmap: str | None = None
    # the engines serve vLLM's OpenAI API on this port (spec.engine.adapter vLLM): vLLM's P-D protocol
    engine_port: int | None = None
    decoder_first: bool = False     # ... decoder first, through this gateway's metaserver
    self_url: str = ""              # where the engines reach this gateway's pod (the metaserver)
    # the model's own tokenizer.json and chat template (spec.model.tokenizer); default cl100k
    tokenizer: str | None = None
    chat_template: str | None = None
    bos_token: str = ""
    eos_token: str = ""

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "Config":
        env = dict(os.environ if env is None else env)
        return cls(model=env.get(PD_MODEL_NAME, "model"),
                   aliases=tuple(json.loads(env.get(PD_MODEL_ALIASES) or "[]")),
                   namespace=env.get(POD_NAMESPACE, "default"),
                   deployment=env.get(PD_GATEWAY_DEPLOYMENT) or None,
                   data_token=env.get(PD_AGENT_DATA_TOKEN) or None,
                   keys_secret=env.get(PD_GATEWAY_KEYS_SECRET) or None,
                   rpm=json.loads(env.get(PD_GATEWAY_RPM) or "{}"),
                   agents=[u for u in env.get("PD_GATEWAY_AGENTS", "").split(",") if u] or None,
                   max_output_tokens=_positive(env, "PD_GATEWAY_MAX_OUTPUT_TOKENS", MAX_OUTPUT_TOKENS),
                   max_context_tokens=_positive(env, "PD_GATEWAY_MAX_CONTEXT_TOKENS", MAX_CONTEXT_TOKENS),
                   max_streams=_positive(env, "PD_GATEWAY_MAX_STREAMS", MAX_STREAMS),
                   max_streams_per_key=_positive(env, "PD_GATEWAY_MAX_STREAMS_PER_KEY", MAX_STREAMS_PER_KEY),
                   max_body_bytes=_positive(env, "PD_GATEWAY_MAX_BODY_BYTES", MAX_BODY_BYTES),
                   max_body_bytes_in_flight=_positive(env, "PD_GATEWAY_MAX_BODY_BYTES_IN_FLIGHT",
                                                      MAX_BODY_BYTES_IN_FLIGHT),
                   max_body_bytes_per_key=_positive(env, "PD_GATEWAY_MAX_BODY_BYTES_PER_KEY", None),
                   max_json_values=_positive(env, "PD_GATEWAY_MAX_JSON_VALUES", bodies.MAX_JSON_VALUES),
                   body_timeout_s=_positive(env, "PD_GATEWAY_BODY_TIMEOUT_S", BODY_TIMEOUT_S, float),
                   header_timeout_s=_positive(env, "PD_GATEWAY_HEADER_TIMEOUT_S", HEADER_TIMEOUT_S, float),
                   token_gap_timeout_s=_positive(env, "PD_GATEWAY_UPSTREAM_READ_TIMEOUT_S", TOKEN_GAP_TIMEOUT_S,
                                                 float),
                   min_key_length=_positive(env, "PD_GATEWAY_MIN_KEY_LENGTH", MIN_KEY_LENGTH),
                   routes=json.loads(env[PD_GATEWAY_ROUTES]) if env.get(PD_GATEWAY_ROUTES) else None,
                   key_policy=policy.parse(env.get(PD_GATEWAY_KEY_POLICY)),
                   usage_configmap=env.get(PD_GATEWAY_USAGE_CONFIGMAP) or None,
                   engine_port=_positive(env, PD_GATEWAY_ENGINE_PORT, None),
                   decoder_first=flag(env, PD_GATEWAY_DECODER_FIRST),
                   self_url=_self_url(env.get(POD_IP) or env.get(PD_LOCAL_POD_IP) or "127.0.0.1",
                                      int(env.get("PD_GATEWAY_PORT") or PORT)),
                   tokenizer=env.get(PD_GATEWAY_TOKENIZER) or None,
                   chat_template=env.get(PD_GATEWAY_CHAT_TEMPLATE) or None,
                   bos_token=env.get(PD_GATEWAY_BOS_TOKEN, ""), eos_token=env.get(PD_GATEWAY_EOS_TOKEN, ""))


def _self_url(ip: str, port: int) -> str:
    return f"http://[{ip}]:{port}" if ":" in ip else f"http://{ip}:{port}"


@dataclass
class Route:
    """One model the gateway serves: the deployment whose P-D pairs serve it, and the model's
    tokenizer (for the token path)."""
    model: str
    fleet: Fleet
    deployment: str | None = None
    aliases: tuple[str, ...] = ()
    tokenizer: ModelTokenizer = field(default_factory=Cl100k)
    decoder_first: bool = False     # vLLM engines with vllm-ascend's layerwise Mooncake: the decoder first


@dataclass
class Choice:
    """One choice of a reply as it is generated."""
    index: int
    stops: StopScanner
    ids: list[int] = field(default_factory=list)         # the token ids, when the engine sends them
    times: list[float] = field(default_factory=list)     # when each token came
    pieces: list[str] = field(default_factory=list)      # the text, for a reply that is not streamed
    finish: str = "stop"
    opened: bool = False                                 # its first stream chunk was written


@dataclass
class Reply:
    """A request's reply as it is built: its choices, and the stream once opened."""
    rid: str
    model: str
    api: str
    stream: bool
    prompt_tokens: int
    rs: wire.ResponsesStream | None = None
    choices: list[Choice] = field(default_factory=list)
    resp: web.StreamResponse | None = None
    seed: bytes | None = None       # placeholder text's: the prompt digested once, if a token comes without its id


class Streams:
    """Requests in flight, per key and in total: past a bound a request is refused at once
    rather than queued (for an engine connection, a batch slot) behind everyone else's."""

    def __init__(self, per_key: int, total: int):
        self.per_key, self.total = per_key, total
        self.by_key: dict[str, int] = {}
        self.count = 0

    def take(self, key: str) -> str | None:
        """None if taken (give it back), else which bound refused it: "key" or "total"."""
        if self.by_key.get(key, 0) >= self.per_key:
            return "key"
        if self.count >= self.total:
            return "total"
        self.by_key[key] = self.by_key.get(key, 0) + 1
        self.count += 1
        return None

    def give(self, key: str) -> None:
        self.count -= 1
        left = self.by_key[key] - 1
        if left:
            self.by_key[key] = left
        else:
            del self.by_key[key]


def api_of(path: str) -> str:
    return "anthropic" if "messages" in path else "openai"


class Gateway:
    def __init__(self, cfg: Config, keys: Keys, fleet: Fleet | None = None, metrics: GatewayMetrics | None = None,
                 routes: list[Route] | None = None, usage: Usage | None = None,
                 clock: Callable[[], float] = time.time):
        self.cfg = cfg
        self.keys = keys
        self.limits = RateLimits(cfg.rpm or {})
        self.policies = cfg.key_policy or {}
        self.usage = usage or Usage()
        self.usage.on_reject = lambda reason: self.m.usage_rejected.labels(reason).inc()
        if self.usage.secret is None:
            self.usage.secret = self._reset_secret
        if self.usage.doc_secret is None:   # the usage document is signed with all the keys
            self.usage.doc_secret = lambda: self.keys.digest_of(self.keys.names(), b"pd-gateway usage document")
        self.clock = clock
        if routes is None:
            assert fleet is not None, "a fleet or routes"
            routes = [Route(cfg.model, fleet, cfg.deployment, cfg.aliases)]
        self.routes = routes
        self.by_model: dict[str, Route] = {}
        for r in routes:
            for name in (r.model, *r.aliases):
                self.by_model.setdefault(name, r)
        self.fleet = routes[0].fleet if routes else None
        self.m = (metrics or GatewayMetrics()).counting_pulls(r.fleet for r in routes)
        self.streams = Streams(cfg.max_streams_per_key, cfg.max_streams)
        # never below one body of the largest size, or that body could never be taken
        total = max(cfg.max_body_bytes_in_flight, cfg.max_body_bytes)
        self.body_bytes = BodyBytes(total, min(total, max(cfg.max_body_bytes_per_key or total // 2,
                                                          cfg.max_body_bytes)))
        self.lanes = Lanes()
        self.tasks: dict[str, asyncio.Task] = {}
        self.dead: dict[str, str] = {}   # background task -> how it ended
        for r in routes:
            # a pod whose status routing cannot use is counted here (and logged by the fleet)
            r.fleet.on_bad_report = lambda pod, why: self.m.bad_reports.labels(pod).inc()
            r.fleet.token_gap_timeout = cfg.token_gap_timeout_s

    def refuse(self, api: str, r: policy.Refusal) -> web.Response:
        headers = {"Retry-After": str(r.retry_after)} if r.retry_after else None
        return self.error(api, r.status, r.message, r.etype, r.code, headers=headers)

    # ---- errors and auth ---------------------------------------------------------------------
    @staticmethod
    def error(api: str, status: int, message: str, etype: str, code: str | None = None,
              headers: dict | None = None, param: str | None = None) -> web.Response:
        body = (wire.anthropic_error(status, message) if api == "anthropic"
                else wire.openai_error(message, etype, code, param))
        return web.json_response(body, status=status, headers=headers)

    def authenticate(self, request: web.Request, api: str, endpoint: str) -> tuple[str | None, web.Response | None]:
        got = request.headers.get("Authorization", "")
        # the scheme is case-insensitive (RFC 9110)
        presented = got[7:].strip() if got[:7].lower() == "bearer " else request.headers.get("x-api-key", "").strip()
        if not presented:
            return None, self.error(api, 401, "missing API key: send it as `Authorization: Bearer <key>` (OpenAI "
                                              "clients: api_key) or `x-api-key: <key>` (Anthropic clients)",
                                    "authentication_error", "missing_api_key")
        name = self.keys.name_of(presented)
        if name is None and self.keys.error and not len(self.keys):
            return None, self.error(api, 401, f"the gateway's API keys could not be loaded, so no key is "
                                              f"accepted ({self.keys.error})", "authentication_error",
                                    "keys_unavailable")
        if name is None:
            return None, self.error(api, 401, "invalid API key: it is not one of this gateway's keys (check for "
                                              "a typo, spaces, or a key from another deployment)",
                                    "authentication_error", "invalid_api_key")
        p = self.policies.get(name)
        refused = p and policy.expired(name, p, self.clock())
        if refused:
            self.m.requests.labels(name, endpoint, str(refused.status)).inc()
            return None, self.refuse(api, refused)
        wait = self.limits.admit(name)
        if wait is not None:
            self.m.requests.labels(name, endpoint, "429").inc()
            return None, self.error(api, 429, f"rate limit for key {name!r} reached "
                                              f"({self.limits.rpm[name]} requests per minute); retry in {wait:.0f}s",
                                    "rate_limit_error", "rate_limit_exceeded",
                                    headers={"Retry-After": str(max(1, round(wait)))})
        return name, None

    async def read_body(self, request: web.Request, api: str, held: Held) -> tuple[bytes, web.Response | None]:
        """The body, bounded in size and read time, its bytes charged to the body budget as they
        arrive (`held`); every way it can be wrong is a 4xx."""
        charset = request.charset
        if charset and charset.lower() not in JSON_CHARSETS:
            return b"", self.error(api, 415, f"charset {charset[:40]!r}: the body must be JSON in UTF-8",
                                   "invalid_request_error", "unsupported_charset")
        try:
            return await bodies.read(request, self.body_bytes, held, self.cfg.max_body_bytes,
                                     self.cfg.body_timeout_s), None
        except Refused as e:
            return b"", self.refused_body(api, e)
        except HttpProcessingError as e:   # a bad chunked or compressed body
            return b"", self.error(api, 400, f"the body could not be read: {e.message}", "invalid_request_error")

    def refused_body(self, api: str, e: Refused) -> web.Response:
        err = self.error(api, e.status, e.message, e.etype, e.code,
                         headers={"Retry-After": "1"} if e.status in (429, 503) else None)
        if e.status in (408, 413, 429, 503):   # the rest of the body is not read: the connection is not reused
            err.force_close()
        return err

    async def read_json(self, raw: bytes, api: str) -> tuple[Any, web.Response | None]:
        """The body as JSON, bounded in its values before it is parsed."""
        try:
            await bodies.check_values(raw, self.cfg.max_json_values)
        except Refused as e:
            return None, self.refused_body(api, e)
        try:
            return json.loads(raw.decode("utf-8")), None
        except UnicodeDecodeError as e:
            return None, self.error(api, 400, f"the body is not UTF-8 (byte {e.start})", "invalid_request_error")
        except RecursionError:
            return None, self.error(api, 400, "the body is not JSON: nested too deeply", "invalid_request_error")
        except ValueError as e:
            return None, self.error(api, 400, f"the body is not JSON: {e}", "invalid_request_error")

    def served(self) -> str:
        names = []
        for r in self.routes:
            names.append(repr(r.model) + (f" (aliases {', '.join(map(repr, r.aliases))})" if r.aliases else ""))
        return ", ".join(names) or "no model yet"

    async def parse(self, request: web.Request, model: type[wire.ApiRequest], api: str, key: str, held: Held):
        raw, err = await self.read_body(request, api, held)
        if err:
            return None, err
        if len(raw) < bodies.HEAVY_BYTES:
            return await self._parse(raw, model, api, key)
        async with self.lanes.lane(key):   # parsed and validated on the event loop: the key's turn
            return await self._parse(raw, model, api, key)

    async def _parse(self, raw: bytes, model: type[wire.ApiRequest], api: str, key: str):
        data, err = await self.read_json(raw, api)
        if err:
            return None, err
        try:
            body = model.model_validate(data)
        except ValidationError as e:
            first = e.errors(include_url=False, include_input=False)[0]
            return None, self.error(api, 400, summary(e), "invalid_request_error", "invalid_value",
                                    param=".".join(str(p) for p in first["loc"]) or None)
        except RecursionError:   # nested deep inside a field the models keep as is
            return None, self.error(api, 400, "the body is nested too deeply", "invalid_request_error")
        route = self.by_model.get(body.model)
        if route is None:
            return None, self.error(api, 404, f"model {body.model!r} not found; this gateway serves "
                                              f"{self.served()}", "invalid_request_error", "model_not_found")
        p = self.policies.get(key)
        refused = p and policy.model_allowed(key, p, body.model, (route.model, *route.aliases))
        if refused:
            return None, self.refuse(api, refused)
        context = self.context(route)
        for name, value in body.token_fields().items():
            if value > context:   # whatever the prompt: refused before it is tokenized
                return None, self.error(api, 400, f"{name}: {value} is more than this model's context of "
                                                  f"{context} tokens", "invalid_request_error",
                                        "context_length_exceeded", param=name)
        return (body, route, data), None

    def context(self, route: Route) -> int:
        """The most a request's prompt and output tokens may add up to on this route: what its
        engines hold, once they reported it, never more than the configured context."""
        engines = route.fleet.context()
        return min(engines, self.cfg.max_context_tokens) if engines else self.cfg.max_context_tokens

    # ---- routes ------------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        name, err = self.authenticate(request, "openai", "models")
        if err:
            return err
        self.m.requests.labels(name, "models", "200").inc()
        return web.json_response(wire.models_reply(*[m for r in self.routes for m in (r.model, *r.aliases)]))

    async def usage_report(self, request: web.Request) -> web.Response:
        """A key sees its own usage; an admin key (policy `admin: true`) everyone's."""
        name, err = self.authenticate(request, "openai", "usage")
        if err or name is None:
            return err or web.Response(status=401)
        p = self.policies.get(name)
        admin = bool(p and p.admin)
        self.m.requests.labels(name, "usage", "200").inc()
        body = {"object": "usage", "key": name, "admin": admin,
                "synced": self.usage.synced_at is not None or self.usage.store is None,
                "usage": self.usage.report(None if admin else name)}
        if admin:   # the shared document's health: a rejected one names keys
            body["store"] = {"synced_at": self.usage.synced_at, "error": self.usage.error or None,
                             "rejected": self.usage.rejected}
        return web.json_response(body)

    async def usage_reset(self, request: web.Request) -> web.Response:
        """DELETE /v1/usage/{key}[?day=YYYY-MM-DD]: an admin key forgives a key's usage of a UTC day
        (today by default), on every replica: the one way counts go down."""
        name, err = self.authenticate(request, "openai", "usage_reset")
        if err or name is None:
            return err or web.Response(status=401)
        p = self.policies.get(name)
        if not (p and p.admin):
            self.m.requests.labels(name, "usage_reset", "403").inc()
            return self.error("openai", 403, f"key {name!r} may not reset usage: only an admin key (policy "
                                             f"`admin: true`) may", "permission_error", "permission_denied")
        key, now = request.match_info["key"], self.clock()
        day = request.query.get("day") or policy.day_of(now)
        why = (f"day {day[:40]!r}: a UTC day as YYYY-MM-DD" if not DAY.fullmatch(day) else
               f"a key's name is at most {MAX_NAME} characters" if len(key) > MAX_NAME else None)
        if why:   # a name the usage document cannot hold would make every later write fail
            self.m.requests.labels(name, "usage_reset", "400").inc()
            return self.error("openai", 400, why, "invalid_request_error", "invalid_value")
        self.usage.reset(key, day, now)
        log.info("usage of key %r on %s reset by admin key %r", key, day, name)
        written = await self.usage.sync(now) or self.usage.store is None   # not at the next interval
        self.m.requests.labels(name, "usage_reset", "200").inc()
        return web.json_response({"object": "usage.reset", "key": key, "day": day, "written": written,
                                  "error": self.usage.error or None})

    def _reset_secret(self) -> bytes | None:
        """What signs usage resets: a digest of the admin keys, which whoever can edit the usage
        ConfigMap but not read the keys Secret cannot know (None: no admin key, so no reset)."""
        return self.keys.digest_of(sorted(n for n, p in self.policies.items() if p.admin), b"pd-gateway usage reset")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self.complete(request, "openai", "chat", wire.ChatRequest)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.complete(request, "openai", "completions", wire.CompletionRequest)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        return await self.complete(request, "openai", "responses", wire.ResponsesRequest)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        return await self.complete(request, "anthropic", "anthropic", wire.MessagesRequest)

    async def complete(self, request: web.Request, api: str, endpoint: str,
                       model: type[wire.ApiRequest]) -> web.StreamResponse:
        name, err = self.authenticate(request, api, endpoint)
        if err or name is None:
            return err or web.Response(status=401)
        p = self.policies.get(name)
        if p is not None:   # quotas count completions only (reading models or usage is free)
            now = self.clock()
            refused = policy.quota(name, p, now, self.usage.requests_this_minute(name, now),
                                   self.usage.tokens_today(name, now))
            if refused:
                self.m.requests.labels(name, endpoint, str(refused.status)).inc()
                return self.refuse(api, refused)
            self.usage.admitted(name, now)
        # taken before the body is read: refusing costs nothing, and bodies held in memory are bounded
        bound = self.streams.take(name)
        if bound is not None:
            status = 429 if bound == "key" else 503
            self.m.requests.labels(name, endpoint, str(status)).inc()
            if bound == "key":
                return self.error(api, 429, f"key {name!r} has {self.cfg.max_streams_per_key} requests in flight, "
                                            f"the most a key may have; retry when one ends", "rate_limit_error",
                                  "concurrency_limit_exceeded", headers={"Retry-After": "1"})
            return self.error(api, 503, f"the gateway has {self.cfg.max_streams} requests in flight, the most it "
                                        f"takes; retry shortly", "overloaded_error", "overloaded",
                              headers={"Retry-After": "1"})
        held = Held(name)   # the body's bytes, charged as they arrive
        try:
            parsed, err = await self.parse(request, model, api, name, held)
            if err:
                self.m.requests.labels(name, endpoint, str(err.status)).inc()
                return err
            body, route, data = parsed
            if route.fleet.engine_port:
                if endpoint not in ("chat", "completions"):
                    self.m.requests.labels(name, endpoint, "400").inc()
                    return self.error(api, 400, f"model {body.model!r} is served by vLLM engines, through the OpenAI "
                                                f"chat and completions APIs (/v1/chat/completions, /v1/completions)",
                                      "invalid_request_error", "unsupported_endpoint")
                return await vllm_route.serve(self, request, name, endpoint, data, body, route)
            unsupported = body.unsupported()
            if unsupported:
                self.m.requests.labels(name, endpoint, "400").inc()
                return self.error(api, 400, f"{unsupported}: this model's engines are served through pd-gateway's "
                                            f"token path, which does not implement {unsupported}; the request is "
                                            f"refused rather than answered without it", "invalid_request_error",
                                  "unsupported_parameter", param=unsupported)
            return await self.serve(request, name, endpoint, body, route, heavy=held.n >= bodies.HEAVY_BYTES)
        finally:
            self.body_bytes.give(name, held.n)
            self.streams.give(name)

    async def not_found(self, request: web.Request) -> web.Response:
        api = api_of(request.path)
        method = KNOWN.get(request.path)
        if method:
            return self.error(api, 405, f"{request.path} takes {method}, not {request.method}",
                              "invalid_request_error", "method_not_allowed", headers={"Allow": method})
        return self.error(api, 404, wire.path_hint(request.path), "invalid_request_error", "not_found")

    @web.middleware
    async def guard(self, request: web.Request, handler) -> web.StreamResponse:
        """Whatever goes wrong in a handler, the client reads the API's own error object."""
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            etype = "invalid_request_error" if e.status < 500 else "server_error"
            return self.error(api_of(request.path), e.status, e.reason, etype)
        except ConnectionError:
            raise   # the client went away: nobody to answer
        except Exception as e:  # noqa: BLE001 - answered as a 500 in the API's shape, logged with its traceback
            log.exception("%s %s failed", request.method, request.path)
            return self.error(api_of(request.path), 500, f"the gateway failed on this request "
                                                         f"({type(e).__name__}); it is logged", "server_error",
                              "internal_error")

    # ---- one request -----------------------------------------------------------------------------
    async def tokenize(self, route: Route, body: wire.ApiRequest) -> tuple[str, list[int]]:
        """The prompt as the model reads it, and its token ids. A prompt too long for any
        tokenization to fit the context is refused from its length, before it is tokenized."""
        tok = route.tokenizer
        prompt = await bodies.in_thread(tok.prompt, body) if isinstance(tok, HuggingFace) else tok.prompt(body)
        context = self.context(route)
        at_least = -(-len(prompt) // tok.max_token_chars())   # no token is longer than that
        if at_least >= context:
            raise PromptTooLong(context, at_least, len(prompt))
        templated = tok.templated(body)
        if len(prompt) > THREAD_TOKENIZE_CHARS:   # the tokenizer lets go of the GIL meanwhile
            ids = await bodies.in_thread(tok.encode, prompt, templated)
        else:
            ids = tok.encode(prompt, templated)
        return prompt, ids or tok.boundary()   # an empty prompt: the model starts from a document boundary

    async def serve(self, request: web.Request, key: str, api: str, body: wire.ApiRequest,
                    route: Route | None = None, heavy: bool = False) -> web.StreamResponse:
        route = route or self.routes[0]
        model = route.model
        stream, include_usage = bool(body.stream), body.include_usage()
        t0 = time.monotonic()
        wire_api = "anthropic" if api == "anthropic" else "openai"
        try:
            if heavy:   # a large body's prompt: laid out and tokenized in its key's turn
                async with self.lanes.lane(key):
                    prompt, ids = await self.tokenize(route, body)
            else:
                prompt, ids = await self.tokenize(route, body)
        except PromptRefused as e:   # the chat template refused the messages (raise_exception, or any error)
            self.m.requests.labels(key, api, "400").inc()
            return self.error(wire_api, 400, f"the model's chat template refused the messages: {e}",
                              "invalid_request_error", "invalid_value", param=body.PROMPT_PARAM)
        except TokenizerUnavailable as e:
            self.m.requests.labels(key, api, "503").inc()
            return self.error(wire_api, 503, str(e), "overloaded_error", "tokenizer_unavailable")
        except PromptTooLong as e:
            self.m.requests.labels(key, api, "400").inc()
            return self.error(wire_api, 400, wire.prompt_too_long(api, e.context, e.at_least, e.chars),
                              "invalid_request_error", "context_length_exceeded", param=body.PROMPT_PARAM)
        prompt_tokens = len(ids)
        # before any engine work: the prompt and the output asked for must fit the context; when
        # the client named no number, the default output shrinks to what fits
        context, asked = self.context(route), body.asked_tokens()
        room = context - prompt_tokens
        if (asked is not None and asked > room) or room < 1:
            self.m.requests.labels(key, api, "400").inc()
            return self.error("anthropic" if api == "anthropic" else "openai", 400,
                              wire.context_exceeded(api, context, prompt_tokens, asked), "invalid_request_error",
                              "context_length_exceeded", param=body.PROMPT_PARAM)
        out_tokens = min(asked if asked is not None else min(body.default_tokens(), room), self.cfg.max_output_tokens)
        p = self.policies.get(key)
        reserved = 0
        n_choices = body.choices()
        if p is not None and p.tokens_per_day is not None:
            # reserved (just before the try below), settled when it ends: concurrent requests cannot
            # all pass the same check
            now = self.clock()
            want = prompt_tokens + out_tokens * n_choices
            refused = policy.tokens_fit(key, p, now, self.usage.tokens_today(key, now), want)
            if refused:
                self.m.requests.labels(key, api, str(refused.status)).inc()
                return self.refuse("anthropic" if api == "anthropic" else "openai", refused)
            reserved = want
        rid = wire.new_id({"anthropic": "msg", "chat": "chatcmpl", "responses": "resp"}.get(api, "cmpl"))
        out = Reply(rid, model, api, stream, prompt_tokens,
                    wire.ResponsesStream(rid, model) if api == "responses" else None)
        sampling = body.sampling(random.getrandbits(63))
        attempt = Attempt()
        accounted = False
        status = "200"
        self.usage.reserve(key, reserved)
        try:
            for i in range(n_choices):
                # each choice a generation of its own: the same prompt, the next seed
                c = Choice(i, StopScanner(body.stops()))
                out.choices.append(c)
                one = {**sampling, "seed": (sampling["seed"] + i) % wire.SEEDS}
                await self._generate(request, route, c, out, ids, out_tokens, one, attempt, prompt)
            accounted = True
            produced = sum(len(c.times) for c in out.choices)
            self._account(key, api, attempt, t0, out.choices[0].times, prompt_tokens, produced, model)
            if not stream:
                return web.json_response(self._reply(out, body, ids, prompt_tokens, produced))
            await self._close_stream(request, out, prompt_tokens, produced, include_usage)
            return out.resp   # type: ignore[return-value]
        except (Unavailable, EngineError) as e:
            status = "503" if isinstance(e, Unavailable) else "502"
            reason = e.reason if isinstance(e, Unavailable) else e.code
            self.m.errors.labels(key, reason).inc()
            log.warning("request %s (key %s) failed: %s", rid, key, e)
            if out.resp is None:   # nothing sent yet: a proper HTTP error
                why = f"model {model!r}" + (f" (deployment {route.deployment})" if route.deployment else "")
                return self.error("anthropic" if api == "anthropic" else "openai", int(status), f"{why}: {e}",
                                  "server_error" if status == "502" else "overloaded_error", reason)
            await self._stream_error(out.resp, api, int(status), str(e), reason, out.rs)
            return out.resp
        except ConnectionError:
            raise   # the client went away
        except Exception as e:
            status = "500"
            if out.resp is None:
                raise   # the guard answers it
            log.exception("request %s (key %s) failed mid-stream", rid, key)
            await self._stream_error(out.resp, api, 500, f"the gateway failed on this request ({type(e).__name__}); "
                                                         f"it is logged", "internal_error", out.rs)
            return out.resp
        finally:
            self.usage.settle(key, reserved)
            if not accounted and attempt.decoder:
                # cut short (the client left, an engine failed): the tokens produced still count
                self.usage.record(key, model, prompt_tokens, sum(len(c.times) for c in out.choices), self.clock())
            self.counted(key, api, status, attempt.prefill, attempt.decoder, attempt.refusals)

    async def _generate(self, request: web.Request, route: Route, c: Choice, out: Reply, ids: list[int],
                        out_tokens: int, sampling: dict, attempt: Attempt, prompt: str) -> None:
        """One choice: prefill and decode through the fleet, its text decoded as its tokens come,
        cut at the first stop sequence (which ends its generation), streamed if the reply is."""
        detok = route.tokenizer.detokenizer()
        gen = generate(route.fleet, random.getrandbits(63), len(ids), out_tokens, attempt, token_ids=ids,
                       sampling=sampling)
        try:
            async for msg in gen:
                if "token" not in msg:
                    continue
                n = len(c.times)
                if n >= out_tokens:
                    raise EngineError(attempt.decoder, "TOO_MANY_TOKENS",
                                      f"the decoder sent more than the {out_tokens} tokens asked for")
                c.times.append(time.monotonic())
                tid = msg.get("id")
                if tid is None:   # an engine that only models timing: placeholder text
                    if out.seed is None:
                        out.seed = wire.seed(prompt)
                    text = detok.flush() + wire.piece(out.seed, n)
                elif isinstance(tid, int) and not isinstance(tid, bool):
                    text = detok.push(tid)
                    c.ids.append(tid)
                else:
                    raise EngineError(attempt.decoder, "BAD_STREAM", f"a token's id is not an integer: {str(tid)[:40]}")
                await self._emit(request, out, c, c.stops.push(text))
                if c.stops.stopped is not None:
                    break
        finally:
            await gen.aclose()
        await self._emit(request, out, c, c.stops.push(detok.flush()) + c.stops.flush())
        c.finish = "stop" if c.stops.stopped is not None or len(c.times) < out_tokens else "length"

    def counted(self, key: str, api: str, status: str, prefill: str, decoder: str, refusals: dict[str, int]) -> None:
        """A request's end in the metrics: its status, the pods it went to, the refusals on the way."""
        self.m.requests.labels(key, api, status).inc()
        for role, pod in (("prefill", prefill), ("decoder", decoder)):
            if pod:
                self.m.pod_requests.labels(pod, role, "ok" if status == "200" else "failed").inc()
        for reason, n in refusals.items():
            self.m.retries.labels(reason).inc(n)

    async def _emit(self, request: web.Request, out: Reply, c: Choice, text: str) -> None:
        """Text of a choice for the client: a stream chunk if streaming, else kept for the reply."""
        if out.stream and out.resp is None:
            out.resp = await self._open_stream(request, out.api, out.rid, out.prompt_tokens, out.model, out.rs)
            c.opened = True
        if not text:
            return
        if not out.stream:
            c.pieces.append(text)
            return
        assert out.resp is not None
        if out.api == "chat" and not c.opened:
            await out.resp.write(wire.sse(wire.chat_chunk(out.rid, out.model, {"role": "assistant", "content": ""},
                                                          index=c.index)))
        c.opened = True
        await out.resp.write(out.rs.delta(text) if out.rs else self._chunk(out.api, out.rid, text, out.model, c.index))

    @staticmethod
    def _reply(out: Reply, body: wire.ApiRequest, ids: list[int], prompt: int, produced: int) -> dict:
        api, first = out.api, out.choices[0]
        if api in ("chat", "completions"):
            texts = [("".join(c.pieces), c.finish) for c in out.choices]
            reply = (wire.chat_reply if api == "chat" else wire.completion_reply)(out.rid, out.model, texts, prompt,
                                                                                   produced)
            if body.return_token_ids and all(len(c.ids) == len(c.times) for c in out.choices):
                reply["prompt_token_ids"] = ids
                for c, choice in zip(out.choices, reply["choices"]):
                    choice["token_ids"] = c.ids
            return reply
        if api == "responses":
            return wire.responses_reply(out.rid, out.model, "".join(first.pieces), prompt, produced)
        return wire.message_reply(out.rid, out.model, "".join(first.pieces), prompt, produced,
                                  wire.anthropic_stop(first.finish, first.stops.stopped), first.stops.stopped)

    @staticmethod
    async def _stream_error(resp: web.StreamResponse, api: str, status: int, message: str, code: str,
                            rs: wire.ResponsesStream | None = None) -> None:
        """Mid-stream: the API's error event; the client sees the stream end with it."""
        if rs is not None:
            await resp.write(rs.failed(code, message))
        elif api == "anthropic":
            await resp.write(wire.sse(wire.anthropic_error(status, message), "error"))
        else:
            await resp.write(wire.sse(wire.openai_error(message, "server_error", code)))

    def _account(self, key: str, api: str, attempt: Attempt, t0: float, times: list[float], prompt: int,
                 completion: int, model: str = "") -> None:
        self.usage.record(key, model or self.cfg.model, prompt, completion, self.clock())
        self.m.usage.labels(key, model or self.cfg.model, "requests").inc()
        self.m.usage.labels(key, model or self.cfg.model, "input_tokens").inc(prompt)
        self.m.usage.labels(key, model or self.cfg.model, "output_tokens").inc(completion)
        if times:
            gaps = [(b - a) * 1000 for a, b in zip(times, times[1:])]
            self.m.record(key, (times[0] - t0) * 1000, sum(gaps) / len(gaps) if gaps else None)
        self.m.tokens.labels(key, "prompt").inc(prompt)
        self.m.tokens.labels(key, "completion").inc(completion)

    async def _open_stream(self, request: web.Request, api: str, rid: str, prompt_tokens: int,
                           model: str, rs: wire.ResponsesStream | None = None) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        if rs is not None:
            await resp.write(rs.start())
        elif api == "chat":
            await resp.write(wire.sse(wire.chat_chunk(rid, model, {"role": "assistant", "content": ""})))
        elif api == "anthropic":
            await resp.write(wire.sse({"type": "message_start", "message": {
                "id": rid, "type": "message", "role": "assistant", "content": [], "model": model,
                "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}}, "message_start"))
            await resp.write(wire.sse({"type": "content_block_start", "index": 0,
                                       "content_block": {"type": "text", "text": ""}}, "content_block_start"))
        return resp

    def _chunk(self, api: str, rid: str, text: str, model: str, index: int = 0) -> bytes:
        if api == "chat":
            return wire.sse(wire.chat_chunk(rid, model, {"content": text}, index=index))
        if api == "completions":
            return wire.sse(wire.completion_chunk(rid, model, text, index=index))
        return wire.sse({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}},
                        "content_block_delta")

    async def _close_stream(self, request: web.Request, out: Reply, prompt: int, n: int, include_usage: bool) -> None:
        resp = out.resp
        assert resp is not None
        api, rid, model = out.api, out.rid, out.model
        if out.rs:
            await resp.write(out.rs.finish(prompt, n))
        elif api in ("chat", "completions"):
            chunk = wire.chat_chunk if api == "chat" else wire.completion_chunk
            for c in out.choices:
                await resp.write(wire.sse(chunk(rid, model, {} if api == "chat" else "", c.finish,  # type: ignore[arg-type]
                                                index=c.index)))
            if include_usage:
                await resp.write(wire.sse(chunk(rid, model, {} if api == "chat" else "",  # type: ignore[arg-type]
                                                usage_=wire.usage(prompt, n), choices=False)))
            await resp.write(wire.sse("[DONE]"))
        else:
            first = out.choices[0]
            await resp.write(wire.sse({"type": "content_block_stop", "index": 0}, "content_block_stop"))
            await resp.write(wire.sse({"type": "message_delta", "delta": {
                "stop_reason": wire.anthropic_stop(first.finish, first.stops.stopped),
                "stop_sequence": first.stops.stopped}, "usage": {"output_tokens": n}}, "message_delta"))
            await resp.write(wire.sse({"type": "message_stop"}, "message_stop"))
        await resp.write_eof()

    # ---- open endpoints ------------------------------------------------------------------------
    async def healthz(self, request: web.Request) -> web.Response:
        dead = [f"background task {name} died: {why}" for name, why in self.dead.items()]
        ok = len(self.keys) > 0 and not dead
        fleets = [r.fleet for r in self.routes]
        # a usage document someone else wrote is listed, never failed on: every replica reads the
        # same one, and a readiness probe failing on all of them would take the gateway down
        errors = [e for e in (self.keys.error, *(f.error for f in fleets)) if e]
        errors += self.usage.problems(self.clock()) + dead
        errors += [f"pod {pod} is skipped: {why}" for f in fleets for pod, why in sorted(f.bad.items())]
        body = {"ok": ok, "keys": len(self.keys), "prefills": sum(len(f.prefills) for f in fleets),
                "decoders": sum(len(f.decoders) for f in fleets), "errors": errors}
        if len(self.routes) > 1 or self.cfg.routes:
            body["models"] = {r.model: {"deployment": r.deployment, "prefills": len(r.fleet.prefills),
                                        "decoders": len(r.fleet.decoders)} for r in self.routes}
        return web.json_response(body, status=200 if ok else 503)

    async def livez(self, request: web.Request) -> web.Response:
        """Liveness: the event loop answers and the loops that must run do. A dead loop does not
        come back by itself, so the pod is restarted; what readiness (/healthz) waits on (keys,
        engines) may come back, so it only takes the pod out of its Service."""
        dead = [f"background task {name} died: {why}" for name, why in self.dead.items()]
        return web.json_response({"ok": not dead, "errors": dead}, status=503 if dead else 200)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.m.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.m.stats())

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_body_bytes, middlewares=[self.guard])
        app.add_routes([
            web.get("/healthz", self.healthz), web.get("/livez", self.livez),
            web.get("/v1/models", self.models), web.post("/v1/chat/completions", self.chat),
            web.post("/v1/completions", self.completions), web.post("/v1/messages", self.messages),
            web.post("/v1/responses", self.responses), web.get("/v1/usage", self.usage_report),
            web.delete("/v1/usage/{key}", self.usage_reset)])
        vllm_route.attach(app, self.cfg.self_url, any(r.decoder_first for r in self.routes))
        app.router.add_route("*", "/{tail:.*}", self.not_found)
        return app

    def metrics_app(self) -> web.Application:
        """The metrics port: every key's name and usage, for the operator and monitoring only."""
        app = web.Application(client_max_size=4096)
        app.add_routes([web.get("/metrics", self.metrics), web.get("/stats", self.stats),
                        web.get("/livez", self.livez)])
        return app

    def runner(self) -> web.AppRunner:
        # aiohttp's keep-alive timer runs from the connection's start (and from each answer) until
        # a request's headers are complete: the only bound on a client sending them slowly
        return web.AppRunner(self.app(), access_log=None, handler_cancellation=True,
                             keepalive_timeout=self.cfg.header_timeout_s)

    def metrics_runner(self) -> web.AppRunner:
        return web.AppRunner(self.metrics_app(), access_log=None, handler_cancellation=True,
                             keepalive_timeout=self.cfg.header_timeout_s)

    # ---- background tasks ----------------------------------------------------------------------
    def watch(self, name: str, coro: Coroutine[Any, Any, None]) -> asyncio.Task:
        """A loop that must run as long as the gateway: if it ends, /healthz and /livez say so."""
        task = asyncio.create_task(coro, name=name)
        task.add_done_callback(self._ended)
        self.tasks[name] = task
        return task

    def _ended(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        self.dead[task.get_name()] = f"{type(exc).__name__}: {exc}" if exc else "it returned"
        log.error("background task %s died; /healthz now fails", task.get_name(), exc_info=exc)

    def start(self) -> None:
        for r in self.routes:
            self.watch(f"fleet-refresh/{r.model}", r.fleet.run())
        self.watch("keys-refresh", _refresh_keys(self.keys))
        if self.usage.store is not None:
            self.watch("usage-sync", self._sync_usage())

    async def _sync_usage(self) -> None:
        while True:
            await asyncio.sleep(SYNC_S)
            await self.usage.sync(self.clock())

    async def stop(self) -> None:
        for t in self.tasks.values():
            t.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    async def flush(self) -> None:
        """After the last request ended: what this replica counted since its last sync is written."""
        await self.usage.sync(self.clock())


async def _refresh_keys(keys: Keys) -> None:
    while True:
        await asyncio.to_thread(keys.refresh)
        await asyncio.sleep(REFRESH_S)


async def serve(cfg: Config, host: str, port: int, metrics_port: int = GATEWAY_METRICS_PORT) -> None:
    set_proxy = [v for v in PROXY_VARS if os.environ.get(v)]
    if set_proxy:
        log.warning("proxy variables set (%s): ignored; calls to the engines never go through a proxy",
                    ", ".join(set_proxy))
    http = httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(120, connect=2),
                             limits=httpx.Limits(max_connections=2048, max_keepalive_connections=256))
    routes = []
    local_root = os.environ.get(PD_LOCAL_ROOT) or None
    if cfg.routes is not None:
        for r in cfg.routes:
            token = os.environ.get(r["tokenEnv"]) or None
            routes.append(Route(r["model"], Fleet(http, token, pod_finder(cfg.namespace, r["deployment"]),
                                                  engine_port=r.get("enginePort") or None),
                                r["deployment"], tuple(r.get("aliases") or ()),
                                load_tokenizer(r.get("tokenizer"), os.environ.get(r.get("chatTemplateEnv") or "")
                                               or None, local_root, r.get("bosToken") or "", r.get("eosToken") or "",
                                               strict=False), bool(r.get("decoderFirst"))))
    elif cfg.agents:
        fleet = Fleet(http, cfg.data_token, fixed_finder(cfg.agents), engine_port=cfg.engine_port)
        routes.append(Route(cfg.model, fleet, None, cfg.aliases,
                            load_tokenizer(cfg.tokenizer, cfg.chat_template, local_root, cfg.bos_token,
                                           cfg.eos_token), cfg.decoder_first))
    elif cfg.deployment:
        routes.append(Route(cfg.model, Fleet(http, cfg.data_token, pod_finder(cfg.namespace, cfg.deployment),
                                             engine_port=cfg.engine_port), cfg.deployment, cfg.aliases,
                            load_tokenizer(cfg.tokenizer, cfg.chat_template, local_root, cfg.bos_token,
                                           cfg.eos_token), cfg.decoder_first))
    else:
        raise SystemExit("pd_gateway: set PD_GATEWAY_DEPLOYMENT, PD_GATEWAY_ROUTES or PD_GATEWAY_AGENTS")
    keys = Keys(from_secret(cfg.namespace, cfg.keys_secret) if cfg.keys_secret else from_env(),
                min_length=cfg.min_key_length)
    await asyncio.to_thread(keys.refresh)
    await asyncio.to_thread(tokens.encoding)   # built before the first request, not during it
    usage = Usage(ConfigMapStore(cfg.namespace, cfg.usage_configmap) if cfg.usage_configmap else None)
    gw = Gateway(cfg, keys, routes=routes, usage=usage)
    if usage.store is not None:
        await usage.sync(gw.clock())   # start from the shared counts
    gw.start()
    runner, metrics = gw.runner(), gw.metrics_runner()
    await metrics.setup()
    await web.TCPSite(metrics, host, metrics_port).start()
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    log.info("pd-gateway serving model %s on %s:%d (%d API keys), metrics on port %d", gw.served(), host, port,
             len(keys), metrics_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down")
    await gw.stop()
    await runner.cleanup()   # requests in flight finish (and count) first
    await gw.flush()
    await metrics.cleanup()
    await http.aclose()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="pd_gateway", description=__doc__)
    ap.add_argument("--host", default=os.environ.get(PD_LOCAL_POD_IP, "0.0.0.0"))
    ap.add_argument("--port", type=int, default=int(os.environ.get("PD_GATEWAY_PORT", PORT)))
    ap.add_argument("--metrics-port", type=int,
                    default=int(os.environ.get("PD_GATEWAY_METRICS_PORT", GATEWAY_METRICS_PORT)))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would drown the log
    asyncio.run(serve(Config.from_env(), args.host, args.port, args.metrics_port))


__all__ = ["AGENT_PORT", "Config", "Gateway", "main"]
