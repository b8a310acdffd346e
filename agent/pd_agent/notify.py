"""Decoder agent -> prefill agent notices: what the llm_datadist v1 API never tells the
prompt side. A pull leaves no trace on the prompt engine that the host can read, so the
decoder's agent reports each pulled req_id (the prefill then knows which of its KV caches
still wait); link and unlink are reported so a terminating prefill knows when every
decoder has let go of it. Notices are batched per prefill and best effort: a prefill that
misses one expires the cache after its TTL, and a shutdown waits at most a bounded time.

Notices go only to the prefill agents this agent was linked to (Peer.agent_url in a control
call), with the peer token (PD_AGENT_PEER_TOKEN), or the control token when none is set."""
from __future__ import annotations

import asyncio
import logging
from collections import defaultdict

import httpx

from pd_contract.agent_api import AgentPath

log = logging.getLogger("pd_agent.notify")
BATCH_WINDOW_S = 0.01


class Notifier:
    def __init__(self, http: httpx.AsyncClient, token: str | None, cluster_id: int):
        self.http = http
        self.token = token
        self.cluster_id = cluster_id
        self._pulled: dict[str, list[int]] = defaultdict(list)
        self._linked: dict[str, bool] = {}      # the latest link state to report, per prefill agent
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.sent = 0
        self.errors = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="peer-notices")

    async def stop(self) -> None:
        if self._task:
            await self.flush()
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def pulled(self, url: str | None, req_id: int) -> None:
        if url:
            self._pulled[url].append(req_id)
            self._wake.set()

    def linked(self, url: str | None, linked: bool) -> None:
        """Queued, never awaited by the caller: a link call must not wait on other agents."""
        if url:
            self._linked[url] = linked
            self._wake.set()

    async def flush(self) -> None:
        pulled, self._pulled = self._pulled, defaultdict(list)
        linked, self._linked = self._linked, {}
        bodies: dict[str, dict] = {}
        for url, ids in pulled.items():
            bodies.setdefault(url, {})["pulled"] = ids
        for url, state in linked.items():
            bodies.setdefault(url, {})["linked"] = state
        await asyncio.gather(*(self._post(url, body) for url, body in bodies.items()))

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            await asyncio.sleep(BATCH_WINDOW_S)
            self._wake.clear()
            await self.flush()

    async def _post(self, url: str, body: dict) -> None:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        try:
            r = await self.http.post(f"{url}{AgentPath.NOTIFY}", json={"decoder_cluster_id": self.cluster_id, **body},
                                     headers=headers, timeout=5)
            if r.status_code == 200:
                self.sent += 1
                return
            self.errors += 1
            log.info("notice to %s answered %d: %s", url, r.status_code, r.text[:200])
        except (httpx.HTTPError, httpx.InvalidURL, ValueError) as e:
            # a link's agent_url that does not parse fails its own notices, never the loop
            self.errors += 1
            log.info("notice to %s failed: %r", url, e)
