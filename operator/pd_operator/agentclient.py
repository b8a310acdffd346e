"""Async client of the in-pod agents (httpx): timeouts, typed bodies, metrics.

Concurrency is bounded per deployment (the caller passes its limiter), so one deployment
whose links time out never holds up another's. Any answer that is not what the API says (an
HTTP error, a body that is not JSON or not the model) is an AgentCallError, never an
exception that escapes into the reconcile; unknown fields in a reply are ignored.

Whatever answers on an agent's port is the tenant's code (its image, command, engine): an answer is
read with a size cap (MAX_REPLY_BYTES) and a deadline for the whole of it, not per read; JSON nested
too deep is a bad reply; strings longer than MAX_STRING are cut before the report is kept, and only
small bodies are remembered; link codes that are not LLM-DataDist's become one metric label."""
from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from pd_contract.agent_api import (
    AgentPath,
    AgentStatus,
    DrainRequest,
    DrainResult,
    GangRequest,
    LinkRequest,
    LinkResult,
    Peer,
    SwitchRoleRequest,
    UnlinkRequest,
    VerifyRequest,
    VerifyResult,
)
from pd_contract.names import STATUS_CODES

from .metrics import OperatorMetrics
from .reports import AgentCallError
from .runtime import SYSTEM_CLOCK, Clock

__all__ = ["STATUS_TIMEOUT_S", "AgentCallError", "AgentClient", "code_label"]

STATUS_TIMEOUT_S = 3.0
# agents with a client kept (one per engine pod of a large fleet: 100 deployments of 8 pods), and
# the connections kept open to each (a pass calls one agent a few times at once at most)
AGENT_POOL = 1024
PER_AGENT = 16
CLOSE_AFTER_S = 120.0   # a client let go is closed this much later (longer than any call on it)
MAX_REMEMBERED = 8192   # agents' last status bodies kept (a fleet's engine pods)
# an answer's bytes at most: a TP 8 pod's status with 512 links is well under 1 MiB
MAX_REPLY_BYTES = 4 << 20
MAX_CACHED_BODY = 256 << 10   # larger status bodies are validated again rather than kept
MAX_STRING = 4096             # a reply's strings are cut to this before the report is kept
DEADLINE_MARGIN_S = 2.0       # the whole answer: the call's read timeout plus this
M = TypeVar("M", bound=BaseModel)


class _TooLarge(Exception):
    pass


def code_label(code: str) -> str:
    """A link code as a metric label value: LLM-DataDist's codes as they are, anything else OTHER
    (an agent inventing codes must not make label values without end)."""
    return code if code in STATUS_CODES else "OTHER"


def _cut(v: Any) -> Any:
    """The reply with every long string in it cut (its first MAX_STRING characters, marked), nested
    ones too (a link's code, a rank's error); what holds none is returned as it is."""
    if isinstance(v, str):
        return v if len(v) <= MAX_STRING else v[:MAX_STRING - 6] + " (cut)"
    if isinstance(v, BaseModel):
        update = {k: y for k, x in v.__dict__.items() if (y := _cut(x)) is not x}
        return v.model_copy(update=update) if update else v
    if isinstance(v, list):
        out = [_cut(x) for x in v]
        return out if any(a is not b for a, b in zip(out, v)) else v
    if isinstance(v, dict):
        pairs = [(_cut(k), _cut(x)) for k, x in v.items()]
        changed = any(a is not k or b is not x for (a, b), (k, x) in zip(pairs, v.items()))
        return dict(pairs) if changed else v
    return v


def _error_of(content: bytes) -> dict[str, Any]:
    try:
        data = json.loads(content)
    except (ValueError, RecursionError):
        data = None
    return data if isinstance(data, dict) else {"message": content[:300].decode(errors="replace")}


class AgentClient:
    def __init__(self, metrics: OperatorMetrics | None = None, timeout: float = 5.0, clock: Clock = SYSTEM_CLOCK,
                 transport: httpx.AsyncBaseTransport | None = None):
        self.clock = clock
        self._timeout, self._transport = httpx.Timeout(timeout, connect=2.0), transport
        # a client per agent: httpx's pool scans every connection it holds on each request, so one
        # pool for a fleet's hundreds of agents costs more than the calls themselves
        self._clients: dict[str, httpx.AsyncClient] = {}
        # one TLS context for them all: httpx builds one per client otherwise (certifi's bundle
        # loaded each time, ~17 ms of CPU), which was most of a takeover's first pass at 800 agents
        self._tls: ssl.SSLContext | None = None
        self.metrics = metrics or OperatorMetrics()
        # url -> (the last status body, its model): a settled agent answers the same bytes pass
        # after pass, and a TP 8 decoder's report is tens of KB to validate
        self._statuses: dict[str, tuple[bytes, AgentStatus]] = {}

    def _client(self, url: str) -> httpx.AsyncClient:
        origin = url[:url.find("/", url.find("//") + 2)] if url.count("/") > 2 else url
        http = self._clients.pop(origin, None)   # (put back last: the least recently used goes first)
        if http is None:
            if len(self._clients) >= AGENT_POOL:   # pods come and go: old addresses' clients are let go,
                old = self._clients.pop(next(iter(self._clients)))   # closed once calls on them ended
                asyncio.get_running_loop().call_later(CLOSE_AFTER_S, lambda: asyncio.ensure_future(old.aclose()))
            if self._tls is None:
                self._tls = httpx.create_ssl_context()
            http = httpx.AsyncClient(
                trust_env=False, timeout=self._timeout, transport=self._transport, verify=self._tls,
                limits=httpx.Limits(max_connections=PER_AGENT, max_keepalive_connections=PER_AGENT))
        self._clients[origin] = http
        return http

    async def close(self) -> None:
        for http in list(self._clients.values()):
            await http.aclose()
        self._clients.clear()

    async def _fetch(self, method: str, url: str, token: str, body, timeout: float | None) -> tuple[int, bytes]:
        async with self._client(url).stream(
                method, url, headers={"Authorization": f"Bearer {token}"},
                json=body.model_dump(mode="json") if body is not None else None,
                timeout=timeout if timeout else httpx.USE_CLIENT_DEFAULT) as r:
            buf = bytearray()
            async for chunk in r.aiter_bytes():
                buf += chunk
                if len(buf) > MAX_REPLY_BYTES:
                    raise _TooLarge()
            return r.status_code, bytes(buf)

    async def _call(self, op: str, method: str, url: str, token: str, reply: type[M], body=None,
                    timeout: float | None = None, limiter: asyncio.Semaphore | None = None) -> M:
        t0 = self.clock.monotonic()
        result = "ok"
        deadline = (timeout or self._timeout.read or 5.0) + DEADLINE_MARGIN_S
        try:
            async with limiter or contextlib.nullcontext():
                try:
                    status, content = await asyncio.wait_for(self._fetch(method, url, token, body, timeout), deadline)
                except asyncio.TimeoutError as e:
                    raise AgentCallError("AgentUnreachable", f"{url}: no whole answer within its deadline of "
                                                             f"{deadline:g} s") from e
                except _TooLarge as e:
                    raise AgentCallError("AgentBadReply", f"{url}: answered more than {MAX_REPLY_BYTES} bytes") from e
                except httpx.HTTPError as e:
                    raise AgentCallError("AgentUnreachable", f"{url}: {type(e).__name__}: {e}".rstrip(": ")) from e
            if status == 401:
                raise AgentCallError("AgentUnauthorized", f"{url}: the agent rejected the operator's token")
            if status >= 400:
                data = _error_of(content)
                raise AgentCallError("AgentError", f"{url}: {str(data.get('message'))[:300]}",
                                     str(data.get("code", ""))[:100])
            if reply is AgentStatus and (seen := self._statuses.get(url)) is not None and seen[0] == content:
                return seen[1]  # type: ignore[return-value]
            try:
                model = _cut(reply.model_validate_json(content))
            except ValidationError as e:   # not JSON (or nested too deep), or JSON that is not the reply
                bad_json = any(err["type"] == "json_invalid" for err in e.errors(include_url=False))
                what = "is not JSON" if bad_json else "is not the expected reply"
                raise AgentCallError("AgentBadReply", f"{url}: answered {status} with a body that {what}: "
                                                      f"{content[:120].decode(errors='replace')!r}") from e
            if isinstance(model, AgentStatus) and len(content) <= MAX_CACHED_BODY:
                if len(self._statuses) >= MAX_REMEMBERED and url not in self._statuses:
                    self._statuses.clear()   # pods come and go: the addresses of old ones are let go
                self._statuses[url] = (content, model)
            return model
        except AgentCallError as e:
            result = e.kind
            raise
        finally:
            self.metrics.agent_calls.labels(op, result).inc()
            self.metrics.agent_seconds.labels(op).observe(self.clock.monotonic() - t0)

    async def status(self, base: str, token: str, limiter=None) -> AgentStatus:
        return await self._call("status", "GET", f"{base}{AgentPath.STATUS}", token, AgentStatus,
                                timeout=STATUS_TIMEOUT_S, limiter=limiter)

    async def init(self, base: str, token: str, limiter=None) -> AgentStatus:
        return await self._call("init", "POST", f"{base}{AgentPath.INIT}", token, AgentStatus, limiter=limiter)

    async def link(self, base: str, token: str, peers: list[Peer], timeout_ms: int, limiter=None) -> LinkResult:
        return await self._call("link", "POST", f"{base}{AgentPath.LINK}", token, LinkResult,
                                LinkRequest(peers=peers, timeout_ms=timeout_ms),
                                timeout=timeout_ms / 1000 * 1.5 + 5, limiter=limiter)

    async def unlink(self, base: str, token: str, peers: list[Peer], force: bool = False, limiter=None) -> LinkResult:
        return await self._call("unlink", "POST", f"{base}{AgentPath.UNLINK}", token, LinkResult,
                                UnlinkRequest(peers=peers, force=force), limiter=limiter)

    async def verify(self, base: str, token: str, peer: Peer, limiter=None) -> VerifyResult:
        return await self._call("verify", "POST", f"{base}{AgentPath.VERIFY}", token, VerifyResult,
                                VerifyRequest(peer=peer), timeout=20, limiter=limiter)

    async def drain(self, base: str, token: str, limiter=None) -> DrainResult:
        """Set the drain flag and return at once: the operator reads the drain back each pass."""
        return await self._call("drain", "POST", f"{base}{AgentPath.DRAIN}", token, DrainResult,
                                DrainRequest(timeout_s=0), limiter=limiter)

    async def undrain(self, base: str, token: str, limiter=None) -> DrainResult:
        return await self._call("undrain", "POST", f"{base}{AgentPath.UNDRAIN}", token, DrainResult, limiter=limiter)

    async def switch_role(self, base: str, token: str, role: str, limiter=None) -> AgentStatus:
        return await self._call("switch_role", "POST", f"{base}{AgentPath.SWITCH_ROLE}", token, AgentStatus,
                                SwitchRoleRequest.model_validate({"role": role}), limiter=limiter)

    async def gang(self, base: str, token: str, req: GangRequest, limiter=None) -> AgentStatus:
        return await self._call("gang", "POST", f"{base}{AgentPath.GANG}", token, AgentStatus, req, limiter=limiter)

    async def gateway_stats(self, base: str) -> dict | None:
        """pd-gateway's /stats: recent client-side TTFT/TBT percentiles. `base` is its metrics
        port's address (GATEWAY_METRICS_PORT: /stats is not on the public API port)."""
        try:
            r = await self._client(base).get(f"{base}/stats", timeout=STATUS_TIMEOUT_S)
            return r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None
