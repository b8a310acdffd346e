"""Async client of the in-pod agents (httpx): bounded concurrency, timeouts, typed bodies."""
from __future__ import annotations

import asyncio

import httpx

from pd_agent.models import AgentStatus, LinkRequest, LinkResult, Peer, UnlinkRequest, VerifyRequest, VerifyResult


class AgentCallError(Exception):
    def __init__(self, kind: str, message: str, code: str = ""):
        super().__init__(message)
        self.kind = kind      # AgentUnreachable | AgentUnauthorized | AgentError
        self.code = code      # the agent's error code, if it answered


class AgentClient:
    def __init__(self, concurrency: int = 32, timeout: float = 5.0):
        self._http = httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(timeout, connect=2.0),
                                       limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))
        self._sem = asyncio.Semaphore(concurrency)

    async def close(self) -> None:
        await self._http.aclose()

    async def _call(self, method: str, url: str, token: str, body=None, timeout: float | None = None) -> dict:
        async with self._sem:
            try:
                r = await self._http.request(
                    method, url, headers={"Authorization": f"Bearer {token}"},
                    json=body.model_dump(mode="json") if body is not None else None,
                    **({"timeout": timeout} if timeout else {}))
            except httpx.HTTPError as e:
                raise AgentCallError("AgentUnreachable", f"{url}: {type(e).__name__}: {e}") from e
        if r.status_code == 401:
            raise AgentCallError("AgentUnauthorized", f"{url}: the agent rejected the operator's token")
        if r.status_code >= 400:
            try:
                data = r.json()
            except ValueError:
                data = {"message": r.text[:300]}
            raise AgentCallError("AgentError", f"{url}: {data.get('message')}", data.get("code", ""))
        return r.json()

    async def status(self, base: str, token: str) -> AgentStatus:
        return AgentStatus.model_validate(await self._call("GET", f"{base}/v1/status", token, timeout=3))

    async def init(self, base: str, token: str) -> AgentStatus:
        return AgentStatus.model_validate(await self._call("POST", f"{base}/v1/init", token))

    async def link(self, base: str, token: str, peers: list[Peer], timeout_ms: int) -> LinkResult:
        body = LinkRequest(peers=peers, timeout_ms=timeout_ms)
        data = await self._call("POST", f"{base}/v1/link", token, body, timeout=timeout_ms / 1000 * 1.5 + 5)
        return LinkResult.model_validate(data)

    async def unlink(self, base: str, token: str, peers: list[Peer], force: bool = False) -> LinkResult:
        return LinkResult.model_validate(
            await self._call("POST", f"{base}/v1/unlink", token, UnlinkRequest(peers=peers, force=force)))

    async def verify(self, base: str, token: str, peer: Peer) -> VerifyResult:
        return VerifyResult.model_validate(
            await self._call("POST", f"{base}/v1/verify", token, VerifyRequest(peer=peer), timeout=20))
