"""The HTTP API of pd_engine.vllm_standin, as vLLM's OpenAI server answers: `GET /health` (200, empty), `GET
/v1/models`, `POST /v1/chat/completions` and `POST /v1/completions` with vLLM's request fields
(pd_engine.vllm_protocol; a body vLLM refuses is a 400 in vLLM's error shape), streamed (SSE, with the
usage chunk of `stream_options.include_usage`) or not, `kv_transfer_params` at the top level of a
reply. Every request body is kept as received (the last few hundred) for `GET /standin/requests`,
so tests can check what a router passed through; `GET /healthz` is the stand-in's own state."""
from __future__ import annotations

import asyncio
import json
import random
import threading
from collections.abc import Iterator
from functools import partial
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import ValidationError

from pd_agent.metrics import ModelServerGauges
from pd_contract import tokens

from . import vllm_protocol as proto
from .vllm_standin_engine import Choice, Generation, NoRoom, StandIn

_DONE = object()


def _prompt_ids(body: proto.ChatCompletionRequest | proto.CompletionRequest) -> list[int]:
    """The reference model's tokenizer and chat template: cl100k over a line "role: content" per message."""
    if isinstance(body, proto.ChatCompletionRequest):
        def text(content: Any) -> str:
            if isinstance(content, list):
                return "".join(p.get("text", "") for p in content if isinstance(p, dict))
            return content if isinstance(content, str) else ""
        return tokens.encode("\n".join(f"{m.get('role', '')}: {text(m.get('content'))}" for m in body.messages))
    p = body.prompt
    if isinstance(p, list) and p and isinstance(p[0], int):
        return [int(x) for x in p]
    if isinstance(p, list):
        raise ValueError("the stand-in serves one prompt per request")
    return tokens.encode(str(p))


def generation(standin: StandIn, body: proto.ChatCompletionRequest | proto.CompletionRequest) -> Generation:
    ids = _prompt_ids(body) or [tokens.ENDOFTEXT]
    room = standin.max_model_len - len(ids)
    asked = body.asked()
    if room < 1 or (asked is not None and asked > room):
        raise ValueError(f"This model's maximum context length is {standin.max_model_len} tokens. However, you "
                         f"requested {len(ids) + (asked or 0)} tokens ({len(ids)} in the messages, {asked or 0} in "
                         f"the completion). Please reduce the length of the messages or completion.")
    temperature = 1.0 if body.temperature is None else float(body.temperature)
    seed = body.seed if body.seed is not None else random.getrandbits(62)
    return Generation(ids, asked or room, temperature, 1.0 if body.top_p is None else float(body.top_p), seed,
                      max(1, body.n or 1), body.stops(), body.ignore_eos)


class Metrics:
    """vLLM's own /metrics names for what the stand-in does: every request it holds is running
    (it refuses, never queues, when its blocks are used up), and its blocks' use."""

    def __init__(self, served: str, standin: StandIn):
        self.registry = CollectorRegistry()
        self.gauges = ModelServerGauges(self.registry)
        self.served, self.standin, self.running = served, standin, 0

    @web.middleware
    async def count(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Requests to the OpenAI paths are running while they are answered."""
        if not request.path.startswith("/v1/") or request.method != "POST":
            return await handler(request)
        self.running += 1
        try:
            return await handler(request)
        finally:
            self.running -= 1

    async def scrape(self, _: web.Request) -> web.Response:
        return web.Response(body=self.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    def render(self) -> bytes:
        s = self.standin
        self.gauges.set(self.served, 0, self.running, 1 - len(s.free) / s.num_blocks, s.block_size, s.num_blocks)
        return generate_latest(self.registry)


def app(standin: StandIn, served: str) -> web.Application:
    async def run(request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            raw = await request.json()
        except ValueError as e:
            return web.json_response(proto.error(f"the body is not JSON: {e}"), status=400)
        standin.requests.append(raw)
        try:
            model = proto.ChatCompletionRequest if chat else proto.CompletionRequest
            body = model.model_validate(raw)
            gen = generation(standin, body)
        except (ValidationError, ValueError) as e:
            return web.json_response(proto.error(str(e)), status=400)
        rid = proto.new_id("chatcmpl" if chat else "cmpl", request.headers.get("X-Request-Id"))
        params = body.kv_transfer_params or {}
        try:
            if params.get("do_remote_decode"):
                choices, out_params = await asyncio.to_thread(standin.prefill_remote, rid, gen, params)
                return web.json_response(_reply(chat, rid, served, body, gen, choices, out_params))
            source = (standin.decode_remote(rid, gen, params) if params.get("do_remote_prefill")
                      else standin.local(gen))
            if body.stream:
                return await _stream(request, standin, chat, rid, served, body, gen, source)
            choices = await asyncio.to_thread(lambda: _collect(standin, gen, source))
            return web.json_response(_reply(chat, rid, served, body, gen, choices, None))
        except NoRoom as e:
            return web.json_response(proto.error(str(e), 503), status=503)

    async def health(_: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(_: web.Request) -> web.Response:
        return web.json_response(proto.models(served, served, standin.max_model_len))

    async def recorded(_: web.Request) -> web.Response:
        return web.json_response({"requests": list(standin.requests), "counts": standin.counts})

    async def prefill_bytes(request: web.Request) -> web.Response:
        b = await request.json()
        out = await asyncio.to_thread(standin.prefill_bytes, str(b["request_id"]), int(b["prompt_len"]),
                                      int(b.get("seed", 0)))
        return web.json_response(out)

    async def decode_bytes(request: web.Request) -> web.Response:
        b = await request.json()
        return web.json_response(await asyncio.to_thread(standin.decode_bytes, str(b["request_id"]),
                                                         dict(b["kv_transfer_params"])))

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"ok": True, "held": len(standin.held), "free_blocks": len(standin.free),
                                  "kv_connector": standin.connector, "kv_role": standin.kv_role, **standin.counts})

    async def ticker(a: web.Application):
        async def loop() -> None:
            while True:
                await asyncio.sleep(1)
                await asyncio.to_thread(standin.tick)
        task = asyncio.create_task(loop())
        yield
        task.cancel()

    metrics = Metrics(served, standin)
    a = web.Application(client_max_size=16 << 20, middlewares=[metrics.count])
    a.add_routes([web.post("/v1/chat/completions", partial(run, chat=True)),
                  web.post("/v1/completions", partial(run, chat=False)),
                  web.get("/health", health), web.get("/v1/models", models), web.get("/standin/requests", recorded),
                  web.post("/prefill", prefill_bytes), web.post("/decode", decode_bytes),
                  web.get("/healthz", healthz), web.get("/metrics", metrics.scrape)])
    a.cleanup_ctx.append(ticker)
    return a


def _collect(standin: StandIn, gen: Generation, source: Iterator[tuple[int, int]]) -> list[Choice]:
    out: dict[int, Choice] = {}
    for c, _ in standin.choices(gen, source):
        out[c.index] = c
    return [out.get(i) or Choice(i) for i in range(gen.n)]


def _choice(chat: bool, c: Choice, ids: bool) -> dict:
    token_ids = c.token_ids if ids else None
    return (proto.chat_choice if chat else proto.completion_choice)(c.index, c.text, c.finish, c.stop_reason,
                                                                      token_ids)


def _reply(chat: bool, rid: str, served: str, body: Any, gen: Generation, choices: list[Choice],
           params: dict | None) -> dict:
    ids = bool(body.return_token_ids)
    return proto.reply(chat, rid, body.model or served, [_choice(chat, c, ids) for c in choices], len(gen.ids),
                       sum(len(c.token_ids) for c in choices), params, gen.ids if ids else None)


async def _stream(request: web.Request, standin: StandIn, chat: bool, rid: str, served: str, body: Any,
                  gen: Generation, source: Iterator[tuple[int, int]]) -> web.StreamResponse:
    """Token by token as the model produces them (a thread computes, the loop writes)."""
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()

    gone = threading.Event()   # the client left: the generation stops, as vLLM aborts the request

    def produce() -> None:
        try:
            for c, text in standin.choices(gen, source):
                if gone.is_set():
                    return
                loop.call_soon_threadsafe(q.put_nowait, (c, text))
            loop.call_soon_threadsafe(q.put_nowait, _DONE)
        except BaseException as e:  # noqa: BLE001 - ends the stream with an error event
            loop.call_soon_threadsafe(q.put_nowait, e)
    model = body.model or served
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    seen: dict[int, Choice] = {}
    worker = loop.run_in_executor(None, produce)
    try:
        while (item := await q.get()) is not _DONE:
            if isinstance(item, BaseException):
                await resp.write(_sse(proto.error(f"{type(item).__name__}: {item}", 500)))
                break
            c, text = item
            if chat and c.index not in seen:
                await resp.write(_sse(proto.chunk(chat, rid, model, c.index, None, role=True)))
            seen[c.index] = c
            if text:
                await resp.write(_sse(proto.chunk(chat, rid, model, c.index, text)))
    finally:
        gone.set()
        await worker
    for i in range(gen.n):
        c = seen.get(i) or Choice(i)
        await resp.write(_sse(proto.chunk(chat, rid, model, i, "", finish=c.finish)))
    opts = body.stream_options
    if opts is not None and opts.include_usage:
        await resp.write(_sse(proto.usage_chunk(chat, rid, model, len(gen.ids),
                                                sum(len(c.token_ids) for c in seen.values()))))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
