"""vLLM's P-D protocol, for deployments whose engines serve vLLM's own OpenAI API
(`spec.engine.adapter: vLLM`): the request goes to a prefill engine's port with
`kv_transfer_params: {"do_remote_decode": true}`, `max_tokens: 1` and `stream: false`; the
`kv_transfer_params` its reply carries (the KV connector's: which prefill rank holds which blocks) go
with the client's request, otherwise untouched, to a decoder linked to that prefill, whose reply is
relayed to the client as it comes. The engine applies its own chat template, tokenizer, tools, stop,
n, logprobs and response_format; usage is the engine's.

The engines are the fleet's (pd_router.routing.Fleet with `engine_port`): roles, draining and
links from the pods' agents, so routing follows live switches as for agent engines, and an engine
is routed to only while its `/health` answers. Refusals before the decoder accepted the request
(503s, connections refused, a pod that went away) go to another prefill or decoder within the
retry window; once a decoder has the request (it answered with anything but 503 or 429, or the
connection broke after it was sent), a failure ends the request (its KV may have been pulled, and
another decoder could not pull it again). The client's own kv_transfer_params never reach an
engine. Usage is the engine's; a reply cut short before its usage counts the prompt's bound and
the chunks sent."""
from __future__ import annotations

import asyncio
import copy
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx
from aiohttp import web

from pd_contract.mooncake import METASERVER_PATH
from pd_router.routing import BadReport, EngineError, Fleet, Unavailable, lines_capped, read_capped

from . import policy

log = logging.getLogger("pd_gateway")

MAX_PREFILL_REPLY = 1 << 20        # a one-token reply and the connector's kv_transfer_params
MAX_REPLY = 16 << 20               # a whole non-streamed reply (n choices, logprobs)
MAX_LINE = 1 << 20                 # one SSE line of the decoder's stream
# a prefill answering these is tried elsewhere (it kept nothing a decoder will pull); a decoder only
# when it refused before any work (503: draining, full; 429), or its connection was refused
RETRYABLE_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
DECODER_REFUSED = frozenset({429, 503})
DECODER_UNREACHED = (httpx.ConnectError, httpx.ConnectTimeout)
WHOLE_REPLY_S = 1800.0   # a non-streamed reply comes whole when generation ends: its wait, at most


def prefill_body(data: dict) -> dict:
    """The client's request as vLLM's P-D routers send it to a prefill: one token, not streamed,
    asking the connector to keep the KV for a remote decode."""
    body = copy.deepcopy(data)
    body["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
    body["stream"] = False
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    for name in ("stream_options", "min_tokens", "min_completion_tokens"):   # one token: no minimum above it
        body.pop(name, None)
    return body


def decode_body(data: dict, params: dict | None) -> tuple[dict, bool]:
    """The client's request with the prefill's kv_transfer_params; a stream also asks for the usage
    chunk (dropped on the way back when the client did not ask for it). Returns (body, usage added)."""
    body = dict(data)
    # the prefill's, never the client's: a client's own would name another request's blocks to pull
    body.pop("kv_transfer_params", None)
    if params:
        body["kv_transfer_params"] = params
    added = False
    if body.get("stream"):
        given = body.get("stream_options")
        opts: dict = given if isinstance(given, dict) else {}
        if not opts.get("include_usage"):
            body["stream_options"] = {**opts, "include_usage": True}
            added = True
    return body, added


def usage_of(reply: dict) -> tuple[int, int] | None:
    u = reply.get("usage") if isinstance(reply, dict) else None
    if not isinstance(u, dict):
        return None
    p, c = u.get("prompt_tokens"), u.get("completion_tokens")
    if isinstance(p, int) and isinstance(c, int) and not isinstance(p, bool) and p >= 0 and c >= 0:
        return p, c
    return None


def sse_json(line: bytes) -> dict | None:
    """The JSON of an SSE `data:` line, else None ([DONE], comments, blank lines)."""
    if not line.startswith(b"data:"):
        return None
    payload = line[5:].strip()
    if not payload.startswith(b"{"):
        return None
    try:
        obj = json.loads(payload)
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


@dataclass
class Relayed:
    """What came back: the engines', as they sent it."""
    prefill: str = ""
    decoder: str = ""
    status: int = 200
    body: bytes = b""                                # a non-streamed reply, or an engine's refusal
    usage: tuple[int, int] | None = None
    refusals: dict[str, int] = field(default_factory=dict)


class Pairing:
    """One request's way through the fleet: which pods refused it, until when it may retry."""

    def __init__(self, fleet: Fleet, retry_window: float, clock=time.monotonic):
        self.fleet, self.window, self.clock = fleet, retry_window, clock
        self.deadline = clock() + retry_window
        self.avoid: set[str] = set()
        self.refusals: dict[str, int] = {}
        self.rid = uuid.uuid4().hex
        self.prefilled = ""      # decoder first: the prefill that pushed the KV (the metaserver's pick)
        self.sent_to: list[dict] = []    # the decoders the request was sent to

    def refuse(self, reason: str, url: str | None) -> None:
        if url is None and reason in self.refusals:
            return
        self.refusals[reason] = self.refusals.get(reason, 0) + 1
        if url:
            self.avoid.add(url)
            self.fleet.drop(url)

    async def wait(self) -> None:
        if self.clock() >= self.deadline:
            raise Unavailable(next(reversed(self.refusals), "NoLinkedPair"), self.refusals)
        await asyncio.sleep(0.1)

    async def prefill(self, path: str, data: dict, tokens: int, out: Relayed) -> tuple[dict, dict | None]:
        """(the prefill pod, its kv_transfer_params); a refusal of the request itself (4xx) ends
        here with out.status and out.body set."""
        body = prefill_body(data)
        while True:
            p = self.fleet.pick_prefill(self.avoid, tokens)
            if p is None:
                self.refuse("NoLinkedPair", None)
                await self.wait()
                self.avoid.clear()
                continue
            try:
                status, raw = await self._post(p["engine_url"] + path, body)
            except httpx.HTTPError as e:
                self.refuse(type(e).__name__, p["url"])
                await self.wait()
                continue
            except BadReport as e:
                raise EngineError(p["name"], "BAD_REPLY", str(e)) from None
            if status in RETRYABLE_STATUS:
                self.refuse(f"HTTP{status}", p["url"])
                await self.wait()
                continue
            if status != 200:
                out.status, out.body, out.prefill = status, raw, p["name"]
                return p, None
            try:
                reply = json.loads(raw)
            except (ValueError, RecursionError):
                raise EngineError(p["name"], "BAD_REPLY", "the prefill's reply is not JSON") from None
            params = reply.get("kv_transfer_params") if isinstance(reply, dict) else None
            out.prefill = p["name"]
            self.deadline = max(self.deadline, self.clock() + self.window)
            return p, params if isinstance(params, dict) else None

    async def _post(self, url: str, body: dict) -> tuple[int, bytes]:
        async with self.fleet.http.stream("POST", url, json=body, headers={"X-Request-Id": self.rid}) as r:
            if r.status_code in RETRYABLE_STATUS:
                return r.status_code, b""
            return r.status_code, await read_capped(r, MAX_PREFILL_REPLY, "the prefill's reply")

    async def decoder(self, p: dict, path: str, body: dict) -> tuple[dict, httpx.Response]:
        """A decoder linked to p that accepted the request: its open response (status 200, or a
        refusal of the request itself), to be read and closed by the caller."""
        while True:
            d = self.fleet.pick_decoder(p, self.avoid)
            if d is None:
                self.refuse("NoDecoderForCache", None)
                await self.wait()
                self.avoid.discard(p["url"])
                continue
            self.sent_to.append(d)   # as it was when picked (decoder first: the metaserver's post names it)
            # a stream's headers come at once and its chunks each token; a whole reply only at the end
            read = self.fleet.token_gap_timeout if body.get("stream") else WHOLE_REPLY_S
            req = self.fleet.http.build_request(
                "POST", f"{d['engine_url']}{path}", json=body, headers={"X-Request-Id": self.rid},
                timeout=httpx.Timeout(None, connect=2, read=read))
            try:
                r = await self.fleet.http.send(req, stream=True)
            except DECODER_UNREACHED as e:   # it never saw the request: another decoder may take it
                self.refuse(type(e).__name__, d["url"])
                await self.wait()
                continue
            except httpx.HTTPError as e:      # it had the request, and may have pulled: the request ends
                raise EngineError(d["name"], type(e).__name__, str(e) or type(e).__name__) from e
            if r.status_code in DECODER_REFUSED:
                await r.aclose()
                self.refuse(f"HTTP{r.status_code}", d["url"])
                await self.wait()
                continue
            return d, r


async def read_reply(r: httpx.Response, decoder: str) -> bytes:
    try:
        return await read_capped(r, MAX_REPLY, "the decoder's reply")
    except BadReport as e:
        raise EngineError(decoder, "BAD_REPLY", str(e)) from None
    except httpx.HTTPError as e:
        raise EngineError(decoder, type(e).__name__, str(e) or type(e).__name__) from e


async def relay_lines(r: httpx.Response, decoder: str):
    """The decoder's stream, line by line (a line is at most MAX_LINE bytes)."""
    try:
        async for line in lines_capped(r, MAX_LINE):
            yield line
    except BadReport as e:
        raise EngineError(decoder, "BAD_STREAM", str(e)) from None
    except httpx.HTTPError as e:
        raise EngineError(decoder, type(e).__name__, str(e) or type(e).__name__) from e


def _estimate(body) -> int:
    """An upper bound on the prompt's tokens before the engine counts them: its UTF-8 bytes (no
    token is shorter than a byte), so a day's budget reserved for it is never too small."""
    return len(body.text().encode("utf-8", "surrogatepass")) + 1


async def serve(gw, request: web.Request, key: str, api: str, data: dict, body, route) -> web.StreamResponse:
    """One request of a vLLM route through pd-gateway `gw`: the key's budget reserved, the P-D
    relay, usage and metrics from the engine's reply."""
    path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
    given = data.get("n")
    n = given if isinstance(given, int) and not isinstance(given, bool) and given > 0 else 1
    estimate, asked = _estimate(body), (body.asked_tokens() or body.default_tokens()) * n
    reserved, refused = _reserve(gw, key, api, estimate + asked)
    if refused is not None:
        return refused
    pairing, out = Pairing(route.fleet, RETRY_WINDOW_S), Relayed()
    t0, times, status = time.monotonic(), [], "200"
    resp: web.StreamResponse | None = None
    r: httpx.Response | None = None
    gw.usage.reserve(key, reserved)
    try:
        first = decoder_first(pairing, request.app, path, data, estimate, out) if route.decoder_first else \
            prefill_first(pairing, path, data, estimate, out)
        d, r, usage_added = await first
        if r is None:        # the engine refused the request itself: its answer, as it gave it
            status = str(out.status)
            return web.Response(body=out.body, status=out.status, content_type="application/json")
        out.decoder = d["name"]
        if r.status_code != 200:
            status = str(r.status_code)
            return web.Response(body=await read_reply(r, d["name"]), status=r.status_code,
                                content_type="application/json")
        if not data.get("stream"):
            raw = await read_reply(r, d["name"])
            times.append(time.monotonic())
            out.usage = usage_of(_json(raw))
            return web.Response(body=raw, status=200, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        async for line in relay_lines(r, d["name"]):
            obj = sse_json(line)
            if obj is not None:
                out.usage = usage_of(obj) or out.usage
                if obj.get("choices"):
                    times.append(time.monotonic())
                elif usage_added and obj.get("usage") is not None:
                    continue         # the usage chunk the client did not ask for
            await resp.write(line + b"\n")
        await resp.write_eof()
        return resp
    except (Unavailable, EngineError) as e:
        status = "503" if isinstance(e, Unavailable) else "502"
        reason = e.reason if isinstance(e, Unavailable) else e.code
        gw.m.errors.labels(key, reason).inc()
        log.warning("request to %s (key %s) failed: %s", route.model, key, e)
        if resp is None:
            why = f"model {route.model!r}" + (f" (deployment {route.deployment})" if route.deployment else "")
            return gw.error("openai", int(status), f"{why}: {e}",
                            "server_error" if status == "502" else "overloaded_error", reason)
        await resp.write(b"data: " + json.dumps({"error": {"message": str(e), "type": "server_error",
                                                           "code": reason}}).encode() + b"\n\n")
        return resp
    finally:
        request.app.get(PENDING, {}).pop(pairing.rid, None)
        if r is not None:
            await r.aclose()
        gw.usage.settle(key, reserved)
        if out.decoder:
            # the engine's usage; a reply cut short before its usage chunk counts the prompt's bound
            # and the chunks that carried text (a client must not get an answer for nothing)
            prompt, completion = out.usage or (estimate, len(times))
            if status == "200" and out.usage:
                gw._account(key, api, None, t0, times, prompt, completion, route.model)
            else:
                gw.usage.record(key, route.model, prompt, completion, gw.clock())
        gw.counted(key, api, status, out.prefill or pairing.prefilled, out.decoder, pairing.refusals)


RETRY_WINDOW_S = 10.0


def _reserve(gw, key: str, api: str, tokens: int) -> tuple[int, web.Response | None]:
    """A day's token budget: (tokens reserved, or the refusal when they do not fit)."""
    pol = gw.policies.get(key)
    if pol is None or pol.tokens_per_day is None:
        return 0, None
    now = gw.clock()
    refused = policy.tokens_fit(key, pol, now, gw.usage.tokens_today(key, now), tokens)
    if refused:
        gw.m.requests.labels(key, api, str(refused.status)).inc()
        return 0, gw.refuse("openai", refused)
    return tokens, None


async def prefill_first(pairing: Pairing, path: str, data: dict, tokens: int,
                        out: Relayed) -> tuple[dict, httpx.Response | None, bool]:
    """vLLM's order: a prefill, then a decoder linked to it with the prefill's kv_transfer_params.
    (decoder, its open response or None when the prefill refused the request itself, usage added)."""
    p, params = await pairing.prefill(path, data, tokens, out)
    if out.status != 200:
        return {}, None, False
    decode, added = decode_body(data, params)
    d, r = await pairing.decoder(p, path, decode)
    return d, r, added


# ---- decoder first (vllm-ascend's MooncakeLayerwiseConnector) ------------------------------------
# The request goes to a decoder with `kv_transfer_params: {"do_remote_prefill": true, "metaserver":
# <this gateway>/v1/metaserver/<secret>}`. The decoder's connector allocates the prompt's blocks and
# posts them there (`request_id`, `remote_block_ids`, `remote_host`, ...); the gateway then sends the
# request to a prefill linked to that decoder with those kv_transfer_params, `max_tokens: 1`,
# `stream: false`, and the prefill pushes the KV into the decoder's blocks layer by layer. Both
# engines get the request under one X-Request-Id: the prefill's push names it. The decoder's reply is
# relayed as in vLLM's order. The metaserver answers only a post that names a request this gateway
# sent, at that request's own secret path, from the decoder it was sent to; when no prefill takes the
# blocks, the decoder's request is ended (vLLM aborts it) and the client gets a 502.

PENDING: web.AppKey[dict] = web.AppKey("pd_gateway.decoder_first", dict)
SELF_URL: web.AppKey[str] = web.AppKey("pd_gateway.self_url", str)
RID = re.compile(r"[0-9a-f]{32}")


@dataclass
class Waiting:
    """A decoder-first request whose decoder has not named its blocks yet."""
    pairing: Pairing
    path: str
    data: dict
    first: dict                 # the prefill picked with the decoder (linked to it)
    secret: str
    out: Relayed
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    why: str = ""
    response: httpx.Response | None = None

    def decoder(self, host: str) -> dict | None:
        """The decoder at `host` (the blocks' owner the post names) among those the request was sent
        to, as it was then: it may be draining or switching by now, and still needs its blocks filled."""
        return next((d for d in reversed(self.pairing.sent_to) if urlsplit(d["engine_url"]).hostname == host), None)

    async def prefill(self, params: dict, decoder: dict) -> None:
        """The prefill that pushes the KV: the one picked first, else another linked to the decoder."""
        pr, body = self.pairing, prefill_body(self.data)
        body["kv_transfer_params"] = params
        pr.deadline = pr.clock() + pr.window      # the decoder may have queued it: the window starts now
        while True:
            linked = [p for p in pr.fleet.prefills if pr.fleet.linked(p, decoder)]
            p = next((p for p in [self.first, *linked] if p["url"] not in pr.avoid and pr.fleet.linked(p, decoder)),
                     None)
            if p is None:
                pr.refuse("NoLinkedPair", None)
                await pr.wait()
                pr.avoid.clear()
                continue
            try:
                status, raw = await pr._post(p["engine_url"] + self.path, body)
            except (httpx.HTTPError, BadReport) as e:
                pr.refuse(type(e).__name__, p["url"])
                await pr.wait()
                continue
            if status in RETRYABLE_STATUS:
                pr.refuse(f"HTTP{status}", p["url"])
                await pr.wait()
                continue
            if status != 200:      # the prefill refused the request itself: so would any other
                raise EngineError(p["name"], f"HTTP{status}", raw[:300].decode("utf-8", "replace"))
            pr.prefilled = p["name"]
            return

    async def abort(self, why: str) -> None:
        """No prefill fills the decoder's blocks: its request ends (closing it aborts it in vLLM)."""
        self.why = why
        self.aborted.set()
        if self.response is not None:
            await self.response.aclose()


def attach(app: web.Application, self_url: str, decoder_first: bool) -> None:
    """The metaserver route, on the gateway's API port, when a route runs decoder first."""
    app[PENDING] = {}
    app[SELF_URL] = self_url
    if decoder_first:
        app.router.add_post(METASERVER_PATH + "/{secret}", metaserver)


async def decoder_first(pairing: Pairing, app: web.Application, path: str, data: dict, tokens: int,
                        out: Relayed) -> tuple[dict, httpx.Response | None, bool]:
    n, prompt = data.get("n"), data.get("prompt")
    if (isinstance(n, int) and n > 1) or isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        out.status, out.body = 400, json.dumps({"error": {
            "message": "n > 1 and batched prompts are not served by engines that run decoder first "
                       "(spec.engine.kvTransfer mooncake-layerwise): send one prompt and one choice per request",
            "type": "invalid_request_error", "code": "unsupported_parameter"}}).encode()
        return {}, None, False
    while (p := pairing.fleet.pick_prefill(pairing.avoid, tokens)) is None:
        pairing.refuse("NoLinkedPair", None)
        await pairing.wait()
        pairing.avoid.clear()
    waiting = app[PENDING][pairing.rid] = Waiting(pairing, path, data, p, uuid.uuid4().hex, out)
    decode, added = decode_body(data, {"do_remote_decode": False, "do_remote_prefill": True,
                                       "metaserver": f"{app[SELF_URL]}{METASERVER_PATH}/{waiting.secret}"})
    send = asyncio.ensure_future(pairing.decoder(p, path, decode))
    stop = asyncio.ensure_future(waiting.aborted.wait())
    try:
        await asyncio.wait({send, stop}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:      # the client went away (the handler is cancelled): nothing left running
        await _discard(send)
        raise
    finally:
        stop.cancel()
    if waiting.aborted.is_set():   # a reply that comes whole waited for the KV: it is not read
        await _discard(send)
        raise EngineError("decoder", "NoPrefill", waiting.why)
    d, r = send.result()
    waiting.response = r
    return d, r, added


async def _discard(send: asyncio.Future) -> None:
    """A decoder request nobody will read: cancelled, or its response closed (vLLM aborts it)."""
    send.cancel()
    got = (await asyncio.gather(send, return_exceptions=True))[0]
    if isinstance(got, tuple):
        await got[1].aclose()


async def metaserver(request: web.Request) -> web.Response:
    """A decoder's connector names the blocks of a request this gateway sent it: a prefill fills them."""
    try:
        msg = await request.json()
    except ValueError:
        return web.json_response({"error": "the body is not JSON"}, status=400)
    m = RID.search(str(msg.get("request_id", ""))) if isinstance(msg, dict) else None
    pending: dict[str, Waiting] = request.app[PENDING]
    waiting = pending.get(m.group(0)) if m else None
    if waiting is None or request.match_info["secret"] != waiting.secret:
        return web.json_response({"error": "no request of this gateway waits for that id here"}, status=404)
    del pending[m.group(0)]  # type: ignore[union-attr]
    decoder = waiting.decoder(str(msg.get("remote_host", "")))
    if decoder is None:        # vLLM does not read the answer: the request is ended here
        await waiting.abort(f"the metaserver's post named remote_host {msg.get('remote_host')!r}, not the decoder "
                            "the request was sent to")
        return web.json_response({"error": "remote_host is not the decoder this request was sent to"}, status=400)
    try:
        await waiting.prefill(msg, decoder)
    except (Unavailable, EngineError) as e:
        log.warning("request %s: no prefill took the decoder's blocks: %s", waiting.pairing.rid, e)
        await waiting.abort(f"no prefill took the decoder's blocks: {e}")
        return web.json_response({"error": str(e)}, status=502)
    return web.json_response({})


def _json(raw: bytes) -> dict:
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return {}
    return obj if isinstance(obj, dict) else {}
