"""P-D routing, shared by pd-gateway and the load generator: the engines and how a request
goes through them.

The fleet is the deployment's pods (listed through the API, so pods that come and go are
followed) and what each agent reports (`/v1/status`, with the data-scope token). A request
is prefilled on a prefill-role engine (least queued prompt tokens) and decoded on a decoder
linked to it (least running batch, then KV use). Pods that are draining, switching, leaving
or not linked are never chosen. A refusal before the first token (draining, a role that
just changed, a pod that went away) sends the request to another pair; after the first
token a failure ends the request."""
from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import httpx

from .names import AGENT_PORT, LABEL_DEPLOYMENT, LABEL_ROLE, SWITCHING

log = logging.getLogger("pd_routing")
# a decoder that sends no token for this long has failed the request (a hung or stopped peer
# must not hold a client forever)
TOKEN_GAP_TIMEOUT_S = 120.0
# NOT_LINKED: the decoder has no (healthy) link to that prefill any more and pulled nothing, so
# another decoder linked to it can take the request
RETRYABLE = frozenset({"DRAINING", "ROLE_CHANGED", "NOT_LINKED", "ConnectError", "ConnectTimeout",
                       "RemoteProtocolError", "ReadError", "NoLinkedPair"})


class Unavailable(Exception):
    """No pair could take the request within the retry window."""

    def __init__(self, reason: str, refusals: dict[str, int]):
        super().__init__(f"no prefill/decoder pair could take the request ({reason}); refusals: {refusals}")
        self.reason = reason
        self.refusals = refusals


class EngineError(Exception):
    """An engine failed the request after admitting it."""

    def __init__(self, pod: str, code: str, message: str):
        super().__init__(f"{pod}: {code}: {message}")
        self.pod, self.code = pod, code


@dataclass
class Attempt:
    prefill: str = ""
    decoder: str = ""
    prefill_ms: float = 0.0
    refusals: dict[str, int] = field(default_factory=dict)


class Fleet:
    def __init__(self, http: httpx.AsyncClient, token: str | None, discover: Callable[[], list[dict]]):
        self.http = http
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.discover = discover    # -> [{"name", "ip", "label", "leaving"}]
        self.prefills: list[dict] = []
        self.decoders: list[dict] = []
        self.refreshed_at = 0.0
        self.error = ""

    async def refresh(self) -> None:
        try:
            pods = await asyncio.to_thread(self.discover)
        except Exception as e:  # noqa: BLE001 - keep routing on the last view; the API server may be away
            error = f"listing pods: {e}"
            if error != self.error:   # once per new error, not once a second while the API server is away
                log.warning("%s (routing on the last view until it answers)", error)
            self.error = error
            return
        if self.error:
            log.info("listing pods works again")
            self.error = ""
        pods = [p for p in pods if p.get("ip") and not p.get("leaving") and p.get("label") != SWITCHING]

        async def one(p: dict) -> dict | None:
            url = f"http://{p['ip']}:{AGENT_PORT}"
            try:
                st = (await self.http.get(f"{url}/v1/status", headers=self.headers, timeout=2)).json()
            except (httpx.HTTPError, ValueError):
                return None
            if not isinstance(st, dict) or not st.get("initialized"):
                return None
            return {**st, "url": url, "name": p["name"]}
        sts = [s for s in await asyncio.gather(*(one(p) for p in pods)) if s]
        self.prefills = [s for s in sts if s["role"] == "prompt" and not s["draining"]]
        self.decoders = [s for s in sts if s["role"] == "decoder" and not s["draining"]]
        self.refreshed_at = time.monotonic()

    async def run(self, interval: float = 1.0) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(interval)

    @staticmethod
    def linked(p: dict, d: dict) -> bool:
        return any(link["cluster_id"] == p["cluster_id"] and link.get("healthy", True) for link in d["links"])

    def pick_prefill(self, avoid: set[str]) -> dict | None:
        ok = [p for p in self.prefills if p["url"] not in avoid
              and any(self.linked(p, d) for d in self.decoders if d["url"] not in avoid)]
        if not ok:
            return None
        load = lambda s: (s["load"].get("queued_prompt_tokens", 0), s["load"]["queue_depth"])  # noqa: E731
        best = min(load(p) for p in ok)
        return random.choice([p for p in ok if load(p) == best])

    def pick_decoder(self, p: dict, avoid: set[str]) -> dict | None:
        ok = [d for d in self.decoders if d["url"] not in avoid and self.linked(p, d)]
        if not ok:
            return None
        load = lambda s: (s["load"]["running"] + s["load"]["queue_depth"], s["load"]["kv_used_bytes"])  # noqa: E731
        best = min(load(d) for d in ok)
        return random.choice([d for d in ok if load(d) == best])

    def drop(self, url: str) -> None:
        """A pod refused (draining, gone): stop choosing it until the next refresh says otherwise."""
        self.prefills = [s for s in self.prefills if s["url"] != url]
        self.decoders = [s for s in self.decoders if s["url"] != url]


def _reason(r: httpx.Response) -> tuple[str, str]:
    try:
        body = r.json()
        return body.get("code", str(r.status_code)), body.get("message", "")
    except ValueError:
        return str(r.status_code), r.text[:200]


async def generate(fleet: Fleet, req_id: int, prompt_tokens: int, output_tokens: int, attempt: Attempt,
                   retry_window: float = 10.0) -> AsyncIterator[dict]:
    """Yield {"token": i, "ms": ...} per token, then {"done": {...}}. Raises Unavailable when
    no pair took the request, EngineError when one failed it."""
    deadline = time.monotonic() + retry_window
    avoid: set[str] = set()

    def refuse(reason: str, url: str | None) -> None:
        if url is None and reason in attempt.refusals:
            return  # waiting for a pair is counted once per request, however long it waits
        attempt.refusals[reason] = attempt.refusals.get(reason, 0) + 1
        if url:
            avoid.add(url)
            fleet.drop(url)

    async def wait() -> None:
        if time.monotonic() >= deadline:
            raise Unavailable(next(reversed(attempt.refusals), "NoLinkedPair"), attempt.refusals)
        await asyncio.sleep(0.1)

    async def refused(r: httpx.Response, pod: dict) -> None:
        """A non-200 answer: retried elsewhere if the engine refused before doing anything."""
        code, msg = _reason(r)
        if code not in RETRYABLE:
            raise EngineError(pod["name"], code, msg)
        refuse(code, pod["url"])
        await wait()

    while True:
        p = fleet.pick_prefill(avoid)
        if p is None:
            refuse("NoLinkedPair", None)
            await wait()
            avoid.clear()
            continue
        t0 = time.monotonic()
        try:
            r = await fleet.http.post(f"{p['url']}/v1/prefill", headers=fleet.headers,
                                      json={"req_id": req_id, "prompt_tokens": prompt_tokens})
        except httpx.HTTPError as e:
            refuse(type(e).__name__, p["url"])
            await wait()
            continue
        if r.status_code != 200:
            await refused(r, p)
            continue
        attempt.prefill, attempt.prefill_ms = p["name"], (time.monotonic() - t0) * 1000
        break
    # decode: the cache waits on p, so only decoders linked to p can take it
    body = {"req_id": req_id, "prompt_cluster_id": p["cluster_id"], "prompt_agent_url": p["url"],
            "prompt_tokens": prompt_tokens, "output_tokens": output_tokens, "stream": True,
            "prefill_ms": round(attempt.prefill_ms, 3)}
    while True:
        d = fleet.pick_decoder(p, avoid)
        if d is None:
            refuse("NoDecoderForCache", None)
            await wait()
            avoid.discard(p["url"])
            continue
        started = False
        try:
            async with fleet.http.stream("POST", f"{d['url']}/v1/decode", headers=fleet.headers, json=body,
                                         timeout=httpx.Timeout(None, connect=2, read=TOKEN_GAP_TIMEOUT_S)) as r:
                if r.status_code != 200:
                    await r.aread()
                    await refused(r, d)
                    continue
                attempt.decoder = d["name"]
                async for line in r.aiter_lines():
                    if not line:
                        continue
                    msg = json.loads(line)
                    if "error" in msg:
                        raise EngineError(d["name"], msg["error"].get("code", "ENGINE_ERROR"),
                                          msg["error"].get("message", ""))
                    started = True
                    yield msg
                    if "done" in msg:
                        return
                raise EngineError(d["name"], "STREAM_ENDED", "the decoder's stream ended before the last token")
        except httpx.HTTPError as e:
            if started:
                raise EngineError(d["name"], type(e).__name__, str(e)) from e
            refuse(type(e).__name__, d["url"])
            await wait()


# ---- where the engines are ----------------------------------------------------------------

def pod_finder(namespace: str, deployment: str, kubeconfig: str | None = None) -> Callable[[], list[dict]]:
    """() -> the deployment's engine pods (name, ip, role label, leaving), listed afresh each call."""
    from kubernetes import client, config
    if kubeconfig:
        api = client.CoreV1Api(config.new_client_from_config(config_file=kubeconfig))
    else:
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        api = client.CoreV1Api()

    def find() -> list[dict]:
        pods = api.list_namespaced_pod(namespace, label_selector=f"{LABEL_DEPLOYMENT}={deployment}",
                                       _request_timeout=5).items
        out = []
        for p in pods:
            meta, st = p.metadata, p.status
            if meta is None:
                continue
            out.append({"name": meta.name, "ip": st.pod_ip if st else None,
                        "label": (meta.labels or {}).get(LABEL_ROLE, ""),
                        "leaving": meta.deletion_timestamp is not None})
        return out
    return find


def fixed_finder(urls: list[str]) -> Callable[[], list[dict]]:
    def find() -> list[dict]:
        out = []
        for u in urls:
            host = httpx.URL(u).host
            out.append({"name": host, "ip": host, "label": ""})
        return out
    return find
