"""P-D routing, shared by pd-gateway and the load generator: the engines and how a request
goes through them.

The fleet is the deployment's pods (listed through the API, so pods that come and go are
followed) and what each agent reports (`/v1/status`, with the data-scope token). A request
is prefilled on a prefill-role engine (least queued prompt tokens) and decoded on a decoder
linked to it (least running and waiting decodes, then KV use), the loads as last reported plus
what this router sent each engine since. Pods that are draining, switching, leaving
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
from typing import AsyncGenerator, AsyncIterator, Callable

import httpx
from pydantic import ValidationError

from pd_contract.agent_api import AgentPath, AgentStatus
from pd_contract.names import AGENT_PORT, INSTANCE_INCOMPLETE, LABEL_DEPLOYMENT, LABEL_ROLE, SWITCHING
from pd_contract.revisions import pairable, revision

log = logging.getLogger("pd_routing")
# a decoder that sends no token for this long has failed the request (a hung or stopped peer
# must not hold a client forever)
TOKEN_GAP_TIMEOUT_S = 120.0
STATUS_TIMEOUT_S = 2.0
# a fleet that had a linked pair lately and has none holds a request this long (from its start)
# for one to come back: an instance of several pods restarts whole in about ten seconds
HOLD_WINDOW_S = 60.0
# what a pod may send at most: a status (512 links of 8 ranks is under 1 MiB), a reply, a line
# of the decode stream (a token or the summary); more is a broken or hostile pod, not memory to spend
MAX_STATUS_BYTES = 4 << 20
MAX_REPLY_BYTES = 64 << 10
MAX_LINE_BYTES = 64 << 10
# NOT_LINKED: the decoder has no (healthy) link to that prefill any more and pulled nothing, so
# another decoder linked to it can take the request; OVERLOADED: that agent's prefill queue is full
RETRYABLE = frozenset({"DRAINING", "ROLE_CHANGED", "NOT_LINKED", "OVERLOADED", "ConnectError", "ConnectTimeout",
                       "RemoteProtocolError", "ReadError", "NoLinkedPair", INSTANCE_INCOMPLETE})


class Unavailable(Exception):
    """No pair could take the request within the retry window."""

    def __init__(self, reason: str, refusals: dict[str, int]):
        super().__init__(f"no prefill/decoder pair could take the request ({reason}); refusals: {refusals}")
        self.reason = reason
        self.refusals = refusals


class BadReport(Exception):
    """A pod's status answer routing cannot use: that pod is skipped, the others are not."""


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
    def __init__(self, http: httpx.AsyncClient, token: str | None, discover: Callable[[], list[dict]],
                 on_bad_report: Callable[[str, str], None] | None = None,
                 token_gap_timeout: float = TOKEN_GAP_TIMEOUT_S, engine_port: int | None = None):
        self.http = http
        # engines that serve their own OpenAI API (vLLM): routed to on this port, and only while
        # its /health answers 200
        self.engine_port = engine_port
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.discover = discover    # -> [{"name", "ip", "label", "leaving"}]
        self.prefills: list[dict] = []
        self.decoders: list[dict] = []
        self.refreshed_at = 0.0
        self.known: list[dict] = []     # the pods the last listing that worked found
        self.error = ""
        self.bad: dict[str, str] = {}   # pod -> why its last status answer was not used
        self.on_bad_report = on_bad_report   # (pod, why), at every bad answer: a counter
        self.token_gap_timeout = token_gap_timeout
        # decoders picked for a prefill in its own A3 superpod, in another, or either unknown
        self.pulls = {"within": 0, "across": 0, "unknown": 0}
        # what this router sent each engine (url -> [prompt tokens, requests]) since the loads it
        # routes on were asked for: without it every request of a second goes to the engine that
        # was least loaded at the refresh, and a fleet of few prefills queues on one at a time
        self.sent: dict[str, list[int]] = {}
        self.paired_at: float | None = None   # when a refresh last found a linked pair
        self.present: set[str] = set()        # the agents of the pods listed, not leaving (a cache there may be pulled)
        self.hold_window = HOLD_WINDOW_S

    def paired_lately(self) -> bool:
        """A linked pair was there within the hold window: one is coming back (an instance restarting)."""
        return self.paired_at is not None and self.refreshed_at - self.paired_at < self.hold_window

    async def status(self, url: str) -> dict:
        """A pod's /v1/status checked against the contract (AgentStatus), so what routing reads
        has the right shape and types. Raises BadReport, or httpx.HTTPError when it does not answer."""
        async with self.http.stream("GET", f"{url}{AgentPath.STATUS}", headers=self.headers,
                                    timeout=STATUS_TIMEOUT_S) as r:
            if r.status_code != 200:
                raise BadReport(f"/v1/status answered HTTP {r.status_code}")
            body = await read_capped(r, MAX_STATUS_BYTES, "/v1/status answer")
        try:
            return AgentStatus.model_validate_json(body).model_dump()
        except ValidationError as e:
            raise BadReport(f"/v1/status: {summary(e)}") from None

    async def healthy(self, engine_url: str) -> bool:
        """The engine's own server answers `GET /health` with 200 (vLLM's readiness)."""
        async def ask() -> bool:
            async with self.http.stream("GET", f"{engine_url}/health", timeout=STATUS_TIMEOUT_S) as r:
                return r.status_code == 200     # the body is not read: whatever it holds
        try:
            return await asyncio.wait_for(ask(), 2 * STATUS_TIMEOUT_S)
        except (httpx.HTTPError, asyncio.TimeoutError):   # asyncio.TimeoutError: not TimeoutError before 3.11
            return False

    def _report(self, pod: str, why: str | None) -> None:
        if why is None:
            if self.bad.pop(pod, None) is not None:
                log.info("pod %s: its status report is usable again", pod)
            return
        if self.on_bad_report:
            self.on_bad_report(pod, why)
        if self.bad.get(pod) != why:   # once per pod and new error, not once a second
            log.warning("pod %s: not routed to, its status report is not usable: %s", pod, why)
        self.bad[pod] = why

    async def refresh(self) -> None:
        try:
            pods = await asyncio.to_thread(self.discover)
        except Exception as e:  # noqa: BLE001 - keep routing on the last view; the API server may be away
            error = f"listing pods: {e}"
            if error != self.error:   # once per new error, not once a second while the API server is away
                log.warning("%s (routing to the pods it last listed until it answers)", error)
            self.error = error
            # their agents are still asked: a pod dropped after a refusal (drop()) comes back once
            # it answers, however long the API server is away
            pods = self.known
        else:
            self.known = pods
            if self.error:
                log.info("listing pods works again")
                self.error = ""
        pods = [p for p in pods if p.get("ip") and not p.get("leaving")]
        self.present = {f"http://{p['ip']}:{AGENT_PORT}" for p in pods}   # switching ones too: they hold caches
        pods = [p for p in pods if p.get("label") != SWITCHING]

        async def one(p: dict) -> dict | None:
            url = f"http://{p['ip']}:{AGENT_PORT}"
            try:
                # a whole deadline too (httpx's is per read): a pod dripping its answer must not
                # hold up the refresh
                st = await asyncio.wait_for(self.status(url), 2 * STATUS_TIMEOUT_S)
            except (httpx.HTTPError, asyncio.TimeoutError):   # asyncio.TimeoutError: not TimeoutError before 3.11
                return None   # not answering (starting, gone, too slow): not a report
            except BadReport as e:
                self._report(p["name"], str(e))
                return None
            self._report(p["name"], None)
            # a pod of an instance that another pod leads holds ranks only: the leading pod is routed to
            if not st["initialized"] or (st.get("gang") or {}).get("index", 0) != 0:
                return None
            entry = {**st, "url": url, "name": p["name"], "revision": p.get("revision", "")}
            if self.engine_port:
                entry["engine_url"] = f"http://{p['ip']}:{self.engine_port}"
                if not await self.healthy(entry["engine_url"]):
                    return None
            return entry
        asked = {url: list(n) for url, n in self.sent.items()}   # the answers count what was sent until now
        sts = [s for s in await asyncio.gather(*(one(p) for p in pods)) if s]
        names = {p["name"] for p in pods}
        self.bad = {k: v for k, v in self.bad.items() if k in names}
        self.prefills = [s for s in sts if s["role"] == "prompt" and not s["draining"]]
        self.decoders = [s for s in sts if s["role"] == "decoder" and not s["draining"]]
        self.sent = {url: [max(0, n[0] - asked.get(url, [0, 0])[0]), max(0, n[1] - asked.get(url, [0, 0])[1])]
                     for url, n in self.sent.items() if n != asked.get(url)}
        self.refreshed_at = time.monotonic()
        if any(self.linked(p, d) for p in self.prefills for d in self.decoders):
            self.paired_at = self.refreshed_at

    async def run(self, interval: float = 1.0) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(interval)

    def context(self) -> int | None:
        """The longest prompt + output the engines hold: the smallest CacheDesc sequence length
        (shape[1]) among the engines routed to, or None before any reported."""
        seqs = []
        for s in self.prefills + self.decoders:
            shape = (s.get("cache_desc") or {}).get("shape")
            if isinstance(shape, list) and len(shape) > 1 and isinstance(shape[1], int) and shape[1] > 0:
                seqs.append(shape[1])
        return min(seqs) if seqs else None

    @staticmethod
    def linked(p: dict, d: dict) -> bool:
        """d has a healthy link to p as it runs now (not to an earlier start of it: same cluster id,
        another boot id), and they are of one revision (never a pair across an upgrade)."""
        return pairable(p.get("revision", ""), d.get("revision", "")) and any(
            link["cluster_id"] == p["cluster_id"] and link.get("healthy", True)
            and link.get("peer_boot_id") in (None, p.get("boot_id")) for link in d["links"])

    def _sent(self, url: str) -> list[int]:
        return self.sent.get(url, [0, 0])

    def _took(self, url: str, tokens: int) -> None:
        n = self.sent.setdefault(url, [0, 0])
        n[0] += tokens
        n[1] += 1

    def pick_prefill(self, avoid: set[str], tokens: int) -> dict | None:
        """The least-loaded prefill (queued prompt tokens, then queue depth, as reported plus what
        was sent it since) that has a decoder to pass the cache to; counted as sent `tokens`."""
        ok = [p for p in self.prefills if p["url"] not in avoid
              and any(self.linked(p, d) for d in self.decoders if d["url"] not in avoid)]
        if not ok:
            return None

        def load(s: dict) -> tuple[int, int]:
            sent = self._sent(s["url"])
            return s["load"].get("queued_prompt_tokens", 0) + sent[0], s["load"]["queue_depth"] + sent[1]
        best = min(load(p) for p in ok)
        p = random.choice([p for p in ok if load(p) == best])
        self._took(p["url"], tokens)
        return p

    def pick_decoder(self, p: dict, avoid: set[str]) -> dict | None:
        """The least-loaded decoder linked to p (requests running and waiting, as reported plus
        what was sent it since, then KV in use). A decoder in another A3 superpod than p's counts
        SUPERPOD_FACTOR times its load plus SUPERPOD_SLACK: the KV pull stays on the superpod's
        fabric unless the decoders there carry more than that."""
        ok = [d for d in self.decoders if d["url"] not in avoid and self.linked(p, d)]
        if not ok:
            return None
        home = superpod(p)

        def load(s: dict) -> tuple[int, int]:
            n = s["load"]["running"] + s["load"]["queue_depth"] + self._sent(s["url"])[1]
            if home and superpod(s) and superpod(s) != home:
                n = n * SUPERPOD_FACTOR + SUPERPOD_SLACK
            return n, s["load"]["kv_used_bytes"]
        best = min(load(d) for d in ok)
        d = random.choice([d for d in ok if load(d) == best])
        self._took(d["url"], 0)
        self.pulls["unknown" if not home or not superpod(d) else "within" if superpod(d) == home else "across"] += 1
        return d

    def drop(self, url: str) -> None:
        """A pod refused (draining, gone): stop choosing it until the next refresh says otherwise."""
        self.prefills = [s for s in self.prefills if s["url"] != url]
        self.decoders = [s for s in self.decoders if s["url"] != url]


# a decoder across superpods (its pulls over RoCE, not the superpod's fabric) counts as this much busier
SUPERPOD_FACTOR = 2
SUPERPOD_SLACK = 1


def superpod(s: dict) -> str:
    """An engine's A3 superpod, as its agent's network preflight reports it ("" unknown)."""
    return str((s.get("preflight") or {}).get("superpod") or "")


def summary(e: ValidationError) -> str:
    """The first problem of a pydantic error, without the input (which may be large)."""
    errs = e.errors(include_url=False, include_input=False)
    where = ".".join(str(p) for p in errs[0]["loc"]) or "(body)"
    more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
    return f"{where}: {errs[0]['msg']}{more}"


async def read_capped(r: httpx.Response, limit: int, what: str) -> bytes:
    body = bytearray()
    async for chunk in r.aiter_bytes():
        body += chunk
        if len(body) > limit:
            raise BadReport(f"{what} is over {limit} bytes")
    return bytes(body)


async def lines_capped(r: httpx.Response, limit: int) -> AsyncIterator[bytes]:
    """The response's lines (httpx's aiter_lines buffers a line however long it is)."""
    buf = bytearray()
    async for chunk in r.aiter_bytes():
        buf += chunk
        start = 0
        while (end := buf.find(b"\n", start)) >= 0:
            yield bytes(buf[start:end])
            start = end + 1
        del buf[:start]
        if len(buf) > limit:
            raise BadReport(f"a line of the decode stream is over {limit} bytes")
    if buf:
        yield bytes(buf)


async def _reason(r: httpx.Response) -> tuple[str, str]:
    """A refusal's code and message, from whatever the pod answered."""
    try:
        raw = await read_capped(r, MAX_REPLY_BYTES, "the answer")
    except BadReport as e:
        return str(r.status_code), str(e)
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        body = None
    if not isinstance(body, dict):
        return str(r.status_code), raw[:200].decode(errors="replace")
    return str(body.get("code", r.status_code))[:100], str(body.get("message", ""))[:1000]


def _message(pod: str, line: bytes) -> dict:
    """A line of the decode stream: a JSON object, else the decoder failed the request."""
    try:
        msg = json.loads(line)
    except (ValueError, RecursionError):
        raise EngineError(pod, "BAD_STREAM", "a line of the decode stream is not JSON") from None
    if not isinstance(msg, dict):
        raise EngineError(pod, "BAD_STREAM", "a line of the decode stream is not a JSON object")
    if "error" in msg:
        err = msg["error"] if isinstance(msg["error"], dict) else {}
        raise EngineError(pod, str(err.get("code", "ENGINE_ERROR"))[:100], str(err.get("message", ""))[:1000])
    return msg


def _first_token(pod: str, answer: bytes) -> int | None:
    """The prefill's first token, if its engine computes one (the timing engine does not)."""
    try:
        body = json.loads(answer)
    except (ValueError, RecursionError):
        raise EngineError(pod, "BAD_REPLY", "the prefill's answer is not JSON") from None
    tok = body.get("first_token") if isinstance(body, dict) else None
    if tok is None:
        return None
    if not isinstance(tok, int) or isinstance(tok, bool) or not 0 <= tok < 2**32:
        raise EngineError(pod, "BAD_REPLY", f"the prefill's first_token is not a token id: {str(tok)[:40]}")
    return tok


class _CacheLost(Exception):
    """The prefill that holds a request's cache went away before any decoder took it."""


class _Request:
    """One request's way through the fleet: its refusals, the pods it avoids, its windows."""

    def __init__(self, fleet: Fleet, attempt: Attempt, retry_window: float):
        self.fleet, self.attempt, self.window = fleet, attempt, retry_window
        self.deadline = time.monotonic() + retry_window
        # no pair at all in a fleet that had one lately (an instance restarting whole): Fleet.hold_window
        self.held = self.deadline + max(0.0, fleet.hold_window - retry_window)
        self.avoid: set[str] = set()

    def refuse(self, reason: str, url: str | None) -> None:
        if url is None and reason in self.attempt.refusals:
            return  # waiting for a pair is counted once per request, however long it waits
        self.attempt.refusals[reason] = self.attempt.refusals.get(reason, 0) + 1
        if url:
            self.avoid.add(url)
            self.fleet.drop(url)

    async def wait(self, until: float | None = None) -> None:
        if time.monotonic() >= (until or self.deadline):
            raise Unavailable(next(reversed(self.attempt.refusals), "NoLinkedPair"), self.attempt.refusals)
        await asyncio.sleep(0.1)

    async def refused(self, r: httpx.Response, pod: dict) -> None:
        """A non-200 answer: retried elsewhere if the engine refused before doing anything."""
        code, msg = await _reason(r)
        if code not in RETRYABLE:
            raise EngineError(pod["name"], code, msg)
        self.refuse(code, pod["url"])
        await self.wait()

    async def prefill(self, body: dict, timing_body: dict, tokens: int) -> tuple[dict, int | None]:
        """A prefill that took the request, and the first token it chose (None: a timing engine)."""
        fleet = self.fleet
        while True:
            p = fleet.pick_prefill(self.avoid, tokens)
            if p is None:
                self.refuse("NoLinkedPair", None)
                await self.wait(max(self.held, self.deadline) if not self.avoid and fleet.paired_lately() else None)
                self.avoid.clear()
                continue
            t0 = time.monotonic()
            try:
                async with fleet.http.stream("POST", f"{p['url']}{AgentPath.PREFILL}", headers=fleet.headers,
                                             json=body if p.get("engine") != "timing" else timing_body) as r:
                    if r.status_code != 200:
                        await self.refused(r, p)
                        continue
                    # read whole, so the connection is reused
                    answer = await read_capped(r, MAX_REPLY_BYTES, "the prefill's answer")
            except httpx.HTTPError as e:
                self.refuse(type(e).__name__, p["url"])
                await self.wait()
                continue
            except BadReport as e:
                raise EngineError(p["name"], "BAD_REPLY", str(e)) from None
            self.attempt.prefill, self.attempt.prefill_ms = p["name"], (time.monotonic() - t0) * 1000
            # the cache now waits on p: a refused decode gets the whole window again, however long the
            # prefill queued (a busy fleet must not throw away prefills it has computed)
            self.deadline = max(self.deadline, time.monotonic() + self.window)
            return p, _first_token(p["name"], answer)

    async def decode(self, p: dict, body: dict) -> AsyncGenerator[dict, None]:
        """The decode stream from a decoder linked to p. _CacheLost when p went away before any took it."""
        fleet = self.fleet
        while True:
            d = fleet.pick_decoder(p, self.avoid)
            if d is None:
                if p["url"] not in fleet.present:
                    raise _CacheLost()
                self.refuse("NoDecoderForCache", None)
                await self.wait()
                self.avoid.discard(p["url"])
                continue
            started = False
            try:
                async with fleet.http.stream("POST", f"{d['url']}{AgentPath.DECODE}", headers=fleet.headers,
                                             json=body, timeout=httpx.Timeout(None, connect=2,
                                                                              read=fleet.token_gap_timeout)) as r:
                    if r.status_code != 200:
                        await self.refused(r, d)
                        continue
                    self.attempt.decoder = d["name"]
                    async for line in lines_capped(r, MAX_LINE_BYTES):
                        if not line.strip():
                            continue
                        msg = _message(d["name"], line)
                        started = True
                        yield msg
                        if "done" in msg:
                            return
                    raise EngineError(d["name"], "STREAM_ENDED", "the decoder's stream ended before the last token")
            except httpx.HTTPError as e:
                if started:
                    raise EngineError(d["name"], type(e).__name__, str(e) or type(e).__name__) from e
                self.refuse(type(e).__name__, d["url"])
                await self.wait()
            except BadReport as e:
                raise EngineError(d["name"], "BAD_STREAM", str(e)) from None


async def generate(fleet: Fleet, req_id: int, prompt_tokens: int, output_tokens: int, attempt: Attempt,
                   retry_window: float = 10.0, token_ids: list[int] | None = None,
                   sampling: dict | None = None) -> AsyncGenerator[dict, None]:
    """Yield {"token": i, "ms": ..., "id": token id} per token, then {"done": {...}}. Raises Unavailable
    when no pair took the request (refusals retried for `retry_window` seconds from the start for the
    prefill, from the prefill's end for the decode; no pair at all in a fleet that had one lately, as
    an instance restarts whole: `Fleet.hold_window`), EngineError when one failed it. `token_ids` and
    `sampling` go to the prefill; its first token and `sampling` to the decoder, which continues. A
    prefill that goes away before any decoder took its cache (its instance restarting) is done again."""
    req = _Request(fleet, attempt, retry_window)
    prefill_body: dict = {"req_id": req_id, "prompt_tokens": prompt_tokens}
    if token_ids is not None:
        prefill_body["token_ids"] = token_ids
    if sampling is not None:
        prefill_body["sampling"] = sampling
    # an engine that only models timing takes the count alone: its requests stay as small as they were
    timing_body = {"req_id": req_id, "prompt_tokens": prompt_tokens}
    while True:
        p, first_token = await req.prefill(prefill_body, timing_body, prompt_tokens)
        # decode: the cache waits on p, so only decoders linked to p can take it
        body = {"req_id": req_id, "prompt_cluster_id": p["cluster_id"], "prompt_agent_url": p["url"],
                "prompt_tokens": prompt_tokens, "output_tokens": output_tokens, "stream": True,
                "prefill_ms": round(attempt.prefill_ms, 3)}
        if first_token is not None:   # an engine that computes: it continues from there, sampling the same way
            body["first_token"] = first_token
            if sampling is not None:
                body["sampling"] = sampling
        try:
            async for msg in req.decode(p, body):
                yield msg
            return
        except _CacheLost:
            req.refuse("PrefillLost", None)


# ---- where the engines are ----------------------------------------------------------------

def pod_finder(namespace: str, deployment: str, kubeconfig: str | None = None) -> Callable[[], list[dict]]:
    """() -> the deployment's engine pods (name, ip, role label, leaving), listed afresh each call.
    Labels alone do not make an engine: only pods its two StatefulSets control (by uid) count,
    so a pod someone else labelled is never sent a request or the data token."""
    from kubernetes import client, config
    if kubeconfig:
        api_client = config.new_client_from_config(config_file=kubeconfig)
    else:
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        api_client = None
    api, apps = client.CoreV1Api(api_client), client.AppsV1Api(api_client)
    owners: dict = {"uids": set(), "at": -1e9}

    def own_uids() -> set:
        if time.monotonic() - owners["at"] > 10:   # StatefulSets are recreated rarely
            uids = set()
            for group in ("prefill", "decoder"):
                try:
                    sts = apps.read_namespaced_stateful_set(f"{deployment}-{group}", namespace, _request_timeout=5)
                except client.ApiException as e:
                    if e.status != 404:
                        raise
                    continue
                if sts.metadata and sts.metadata.uid:
                    uids.add(sts.metadata.uid)
            owners.update(uids=uids, at=time.monotonic())
        return owners["uids"]

    def find() -> list[dict]:
        pods = api.list_namespaced_pod(namespace, label_selector=f"{LABEL_DEPLOYMENT}={deployment}",
                                       _request_timeout=5).items
        own = own_uids()
        out = []
        for p in pods:
            meta, st = p.metadata, p.status
            if meta is None or not any(r.controller and r.kind == "StatefulSet" and r.uid in own
                                       for r in meta.owner_references or []):
                continue
            out.append({"name": meta.name, "ip": st.pod_ip if st else None,
                        "label": (meta.labels or {}).get(LABEL_ROLE, ""),
                        "leaving": meta.deletion_timestamp is not None,
                        "revision": revision((c.name, c.image or "") for c in
                                             list(p.spec.containers or []) + list(p.spec.init_containers or []))
                        if p.spec else ""})
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
