"""pd-gateway against bad pods and hostile clients, in process: the engines are fake agents
behind an httpx MockTransport (they count the work they are given), the gateway serves on a
loopback port. Every malformed request is a 4xx in its API's error shape with no engine work;
a pod's bad status report skips that pod only; the gateway's work per token does not grow
with the prompt; requests in flight, bodies, headers and key reloads are bounded.
test_gateway_tokens uses these fakes for the tokenizer's part: the prompt's ids, the reply's
text, the context."""
from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import logging

import httpx
import pytest
from aiohttp import web

from pd_contract import tokens
from pd_gateway import wire
from pd_gateway.keys import Keys
from pd_gateway.server import Config, Gateway, Route
from pd_router import routing
from pd_router.routing import Attempt, EngineError, Fleet, Unavailable, fixed_finder, generate

MODEL = "m-1"
KEY = "sk-test-key-0123456789"
OTHER = "sk-other-key-0123456789"
CONTEXT = 1000
BODY_LIMIT = 64 << 10
P_HOST, D_HOST, BAD_HOST = "10.0.0.1", "10.0.0.2", "10.0.0.3"
LOAD = {"queue_depth": 0, "queued_prompt_tokens": 0, "running": 0, "kv_used_bytes": 0}
# engines that compute (they take token ids and answer with them)
PREFILL = {"pod": "p0", "role": "prompt", "cluster_id": 1, "boot_id": "b1", "backend": "sim", "initialized": True,
           "engine": "reference",
           "ip": P_HOST, "port": 26000, "model_id": 0, "draining": False, "load": LOAD, "links": []}
DECODER = {**PREFILL, "pod": "d0", "role": "decoder", "cluster_id": 1001, "boot_id": "b2", "ip": D_HOST,
           "links": [{"name": "p0", "cluster_id": 1, "code": "LLM_SUCCESS"}]}
REPLY = " the cache moves from prefill to decode over a link"


class FakeAgents:
    """Agents as an httpx transport: /v1/status answers each host's report (a dict, raw bytes
    or a whole response), /v1/prefill accepts, /v1/decode streams the tokens asked for (or
    `lines`), after `hold` is set if there is one. Token i carries the id reply_ids[i] (cycled),
    or no id if reply_ids is None (an engine that only models timing). The prefill and decode
    bodies are kept."""

    def __init__(self) -> None:
        self.status: dict[str, object] = {P_HOST: PREFILL, D_HOST: DECODER}
        self.calls: collections.Counter[str] = collections.Counter()
        self.bodies: dict[str, list[dict]] = collections.defaultdict(list)
        self.reply_ids: list[int] | None = tokens.encode(REPLY)
        self.hold: asyncio.Event | None = None
        self.lines: list[bytes] | None = None
        self.prefill_reply: httpx.Response | None = None
        self.prefill_delay = 0.0
        self.decode_refusals = 0   # the first decodes answered 503 DRAINING

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.calls[path] += 1
        if path == "/v1/status":
            st = self.status[request.url.host]
            if isinstance(st, httpx.Response):
                return st
            return httpx.Response(200, content=st if isinstance(st, bytes) else json.dumps(st).encode())
        body = json.loads(request.content)
        self.bodies[path].append(body)
        if path == "/v1/prefill":
            await asyncio.sleep(self.prefill_delay)
            # an engine that computes answers with the first token it chose
            first = {"first_token": 300} if "token_ids" in body else {}
            return self.prefill_reply or httpx.Response(200, json={
                "prompt_cluster_id": 1, "req_id": body["req_id"], "model_id": 0, "queue_ms": 0, "prefill_ms": 1,
                **first})
        if self.decode_refusals > 0:
            self.decode_refusals -= 1
            return httpx.Response(503, json={"code": "DRAINING", "message": "draining"})

        async def stream():
            if self.hold is not None:
                await self.hold.wait()
            if self.lines is not None:
                for line in self.lines:
                    yield line
                return
            ids = self.reply_ids
            for i in range(body["output_tokens"]):
                msg = {"token": i, "ms": i} if ids is None else {"token": i, "ms": i, "id": ids[i % len(ids)]}
                yield json.dumps(msg).encode() + b"\n"
            yield json.dumps({"done": {"tokens": body["output_tokens"]}}).encode() + b"\n"
        return httpx.Response(200, content=stream())

    def fleet(self, **kw) -> Fleet:
        http = httpx.AsyncClient(transport=httpx.MockTransport(self.handle))
        return Fleet(http, "data-token", fixed_finder([f"http://{h}:8080" for h in self.status]), **kw)

    @property
    def engine_calls(self) -> int:
        return self.calls["/v1/prefill"] + self.calls["/v1/decode"]


class Served:
    def __init__(self, gw: Gateway, agents: FakeAgents, url: str, port: int):
        self.gw, self.agents, self.url, self.port = gw, agents, url, port
        self.http = httpx.AsyncClient(base_url=url, trust_env=False, timeout=30)
        self.metrics: httpx.AsyncClient | None = None   # the metrics port, where the fixture serves it

    async def serve_metrics(self) -> web.AppRunner:
        """The gateway's metrics port (/metrics, /stats) on a loopback port of its own."""
        runner = self.gw.metrics_runner()
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        self.metrics = httpx.AsyncClient(base_url=f"http://127.0.0.1:{runner.addresses[0][1]}", trust_env=False,
                                         timeout=30)
        return runner

    async def post(self, path: str, body: bytes | dict, key: str | bytes | None = KEY, api: str = "openai",
                   headers: dict | None = None) -> httpx.Response:
        h: dict = {"Content-Type": "application/json"}
        if key is not None:
            h.update({"Authorization": b"Bearer " + key if isinstance(key, bytes) else f"Bearer {key}"}
                     if api == "openai" else {"x-api-key": key})
        h.update(headers or {})
        return await self.http.post(path, content=body if isinstance(body, bytes) else json.dumps(body), headers=h)


@pytest.fixture
async def serve():
    """serve(**config) -> a gateway on a loopback port (its metrics on another) in front of FakeAgents
    (`tokenizer`: the route's, default cl100k)."""
    made: list[tuple[Served, list[web.AppRunner]]] = []

    async def make(agents: FakeAgents | None = None, keys: Keys | None = None, tokenizer=None, **cfg) -> Served:
        agents = agents or FakeAgents()
        fleet = agents.fleet()
        cfg = {"max_context_tokens": CONTEXT, "max_body_bytes": BODY_LIMIT, **cfg}
        keys = Keys(lambda: {"team-a": KEY, "team-b": OTHER}) if keys is None else keys
        keys.refresh()
        tokens.encoding()   # as the gateway's start does: built before the first request
        routes = [Route(MODEL, fleet, tokenizer=tokenizer)] if tokenizer is not None else None
        gw = Gateway(Config(model=MODEL, namespace="t", **cfg), keys, fleet, routes=routes)
        await fleet.refresh()
        runner = gw.runner()
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        s = Served(gw, agents, f"http://127.0.0.1:{port}", port)
        made.append((s, [runner, await s.serve_metrics()]))
        return s
    yield make
    for s, runners in made:
        await s.gw.stop()
        await s.http.aclose()
        await s.metrics.aclose()
        await s.gw.fleet.http.aclose()
        for runner in runners:
            await runner.cleanup()


def openai_shaped(r: httpx.Response) -> dict:
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), r.text
    return err


def anthropic_shaped(r: httpx.Response) -> dict:
    body = r.json()
    assert body["type"] == "error" and isinstance(body["error"]["message"], str), r.text
    assert body["error"]["type"] != "api_error" or r.status_code >= 500, r.text
    return body["error"]


# ---- malformed requests: 4xx in the API's shape, before any engine work --------------------------

CHAT, COMPLETIONS, MESSAGES = "/v1/chat/completions", "/v1/completions", "/v1/messages"
GOOD = {CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        COMPLETIONS: {"model": MODEL, "prompt": "hi", "max_tokens": 4},
        MESSAGES: {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}}
GOOD_TEXT = {CHAT: "user: hi", COMPLETIONS: "hi", MESSAGES: "user: hi"}   # as the chat template lays it out
DEEP = b"[" * 20_000 + b"]" * 20_000   # far past the recursion limit, within the body limit


def with_(path: str, drop: tuple = (), **changes) -> bytes:
    body = {k: v for k, v in GOOD[path].items() if k not in drop}
    return json.dumps({**body, **changes}).encode()


def msgs(*content) -> list[dict]:
    return [{"role": "user", "content": c} for c in content]


# (name, path, body, headers or a key, expected status)
MALFORMED = [
    ("not JSON", CHAT, b"{not json", None, 400),
    ("empty body", CHAT, b"", None, 400),
    ("nested too deeply", CHAT, DEEP, None, 400),
    ("nested too deeply in a field", CHAT, b'{"model": "m-1", "messages": ' + DEEP + b"}", None, 400),
    ("an array, not an object", CHAT, b"[]", None, 400),
    ("not UTF-8", CHAT, b'{"model": "\xff\xfe"}', None, 400),
    ("a bogus charset", CHAT, with_(CHAT), {"Content-Type": "application/json; charset=bogus-42"}, 415),
    ("a charset that is not UTF-8", CHAT, with_(CHAT), {"Content-Type": "application/json; charset=utf-16"}, 415),
    ("a bytes-to-bytes codec as charset", CHAT, with_(CHAT), {"Content-Type": "application/json; charset=rot13"},
     415),
    ("too large", CHAT, with_(CHAT, messages=msgs("x" * BODY_LIMIT)), None, 413),
    ("model a number", CHAT, with_(CHAT, model=5), None, 400),
    ("model missing", CHAT, with_(CHAT, drop=("model",)), None, 400),
    ("model null", CHAT, with_(CHAT, model=None), None, 400),
    ("messages a string", CHAT, with_(CHAT, messages="hi"), None, 400),
    ("messages empty", CHAT, with_(CHAT, messages=[]), None, 400),
    ("a message not an object", CHAT, with_(CHAT, messages=[5]), None, 400),
    ("role a number", CHAT, with_(CHAT, messages=[{"role": 5, "content": "x"}]), None, 400),
    ("content a number", CHAT, with_(CHAT, messages=msgs(5)), None, 400),
    ("content an object", CHAT, with_(CHAT, messages=msgs({"text": "x"})), None, 400),
    ("a content part not an object", CHAT, with_(CHAT, messages=msgs(["hi", 5])), None, 400),
    ("a text part's text a number", CHAT, with_(CHAT, messages=msgs([{"type": "text", "text": 5}])), None, 400),
    ("a text part's text an object", CHAT, with_(CHAT, messages=msgs([{"type": "text", "text": {"a": 1}}])), None,
     400),
    ("a lone surrogate in content", CHAT, with_(CHAT, messages=msgs("hi \ud800 there")), None, 400),
    ("a lone surrogate in a text part", CHAT, with_(CHAT, messages=msgs([{"type": "text", "text": "\udfff"}])),
     None, 400),
    ("a lone surrogate in the role", CHAT, with_(CHAT, messages=[{"role": "\ud83d", "content": "x"}]), None, 400),
    ("max_tokens a string", CHAT, with_(CHAT, max_tokens="5"), None, 400),
    ("max_tokens a float", CHAT, with_(CHAT, max_tokens=1.5), None, 400),
    ("max_tokens a boolean", CHAT, with_(CHAT, max_tokens=True), None, 400),
    ("max_tokens zero", CHAT, with_(CHAT, max_tokens=0), None, 400),
    ("max_tokens NaN", CHAT, with_(CHAT).replace(b'"max_tokens": 4', b'"max_tokens": NaN'), None, 400),
    ("max_tokens huge", CHAT, with_(CHAT, max_tokens=10**30), None, 400),
    ("max_tokens past the context", CHAT, with_(CHAT, max_tokens=CONTEXT + 1), None, 400),
    ("max_completion_tokens past the context", CHAT, with_(CHAT, max_completion_tokens=CONTEXT + 1), None, 400),
    ("stream a string", CHAT, with_(CHAT, stream="yes"), None, 400),
    ("stream a number", CHAT, with_(CHAT, stream=1), None, 400),
    ("stream_options a string", CHAT, with_(CHAT, stream_options="usage"), None, 400),
    ("temperature a string", CHAT, with_(CHAT, temperature="0.5"), None, 400),
    ("temperature a boolean", CHAT, with_(CHAT, temperature=True), None, 400),
    ("temperature past 2", CHAT, with_(CHAT, temperature=2.5), None, 400),
    ("temperature negative", CHAT, with_(CHAT, temperature=-0.1), None, 400),
    ("temperature NaN", CHAT, with_(CHAT).replace(b'"max_tokens": 4', b'"temperature": NaN'), None, 400),
    ("top_p a string", CHAT, with_(CHAT, top_p="0.9"), None, 400),
    ("top_p past 1", CHAT, with_(CHAT, top_p=1.5), None, 400),
    ("seed a float", CHAT, with_(CHAT, seed=1.5), None, 400),
    ("seed a string", CHAT, with_(CHAT, seed="7"), None, 400),
    ("seed past 64 bits", CHAT, with_(CHAT, seed=2**63), None, 400),
    ("a Bearer key that is not UTF-8", CHAT, with_(CHAT), b"\xff\xfe\xfd-not-utf8-key", 401),
    ("a Bearer key that is not ASCII", CHAT, with_(CHAT), "ключ-ключ-ключ-ключ".encode(), 401),
    ("the wrong method", CHAT, None, None, 405),
    ("prompt a number", COMPLETIONS, with_(COMPLETIONS, prompt=5), None, 400),
    ("prompt token ids", COMPLETIONS, with_(COMPLETIONS, prompt=[1, 2]), None, 400),
    ("prompt with a lone surrogate", COMPLETIONS, with_(COMPLETIONS, prompt=["ok", "\udc80"]), None, 400),
    ("completions max_tokens a string", COMPLETIONS, with_(COMPLETIONS, max_tokens="x"), None, 400),
    ("completions max_tokens past the context", COMPLETIONS, with_(COMPLETIONS, max_tokens=CONTEXT + 1), None, 400),
    ("completions temperature an object", COMPLETIONS, with_(COMPLETIONS, temperature={"v": 1}), None, 400),
    ("completions seed a boolean", COMPLETIONS, with_(COMPLETIONS, seed=True), None, 400),
    ("completions nested too deeply", COMPLETIONS, DEEP, None, 400),
    ("anthropic max_tokens missing", MESSAGES, with_(MESSAGES, drop=("max_tokens",)), None, 400),
    ("anthropic max_tokens a string", MESSAGES, with_(MESSAGES, max_tokens="10"), None, 400),
    ("anthropic max_tokens past the context", MESSAGES, with_(MESSAGES, max_tokens=CONTEXT + 1), None, 400),
    ("anthropic system a number", MESSAGES, with_(MESSAGES, system=5), None, 400),
    ("anthropic temperature past 1", MESSAGES, with_(MESSAGES, temperature=1.5), None, 400),
    ("anthropic top_p a string", MESSAGES, with_(MESSAGES, top_p="high"), None, 400),
    ("anthropic system text a number", MESSAGES, with_(MESSAGES, system=[{"type": "text", "text": 5}]), None, 400),
    ("anthropic a null content part", MESSAGES, with_(MESSAGES, messages=msgs([None])), None, 400),
    ("anthropic a lone surrogate", MESSAGES, with_(MESSAGES, messages=msgs([{"type": "text", "text": "\ud800"}])),
     None, 400),
    ("anthropic stream a string", MESSAGES, with_(MESSAGES, stream="true"), None, 400),
    ("anthropic not JSON", MESSAGES, b"{", None, 400),
    ("anthropic nested too deeply", MESSAGES, DEEP, None, 400),
    ("anthropic a bogus charset", MESSAGES, with_(MESSAGES), {"Content-Type": "application/json; charset=x"}, 415),
    ("anthropic too large", MESSAGES, b" " * (BODY_LIMIT + 1), None, 413),
    ("an x-api-key that is not UTF-8", MESSAGES, with_(MESSAGES), b"\xc3\x28-not-utf8-key-000", 401),
]


@pytest.mark.parametrize("name,path,body,extra,status", MALFORMED, ids=[c[0] for c in MALFORMED])
async def test_malformed_requests_are_4xx_in_the_api_shape_before_engine_work(serve, name, path, body, extra, status):
    s = await serve()
    api = "anthropic" if path == MESSAGES else "openai"
    key: str | bytes = KEY
    headers = None
    if isinstance(extra, bytes):
        key = extra
    elif isinstance(extra, dict):
        headers = extra
    if body is None:
        r = await s.http.get(path, headers={"Authorization": f"Bearer {KEY}"})
    elif api == "anthropic" and isinstance(key, bytes):
        r = await s.post(path, body, key=None, headers={"x-api-key": key})
    else:
        r = await s.post(path, body, key=key, api=api, headers=headers)
    assert r.status_code == status, r.text
    (anthropic_shaped if api == "anthropic" else openai_shaped)(r)
    assert s.agents.engine_calls == 0


@pytest.mark.parametrize("path,field", [(CHAT, "max_tokens"), (CHAT, "max_completion_tokens"),
                                        (COMPLETIONS, "max_tokens"), (MESSAGES, "max_tokens")])
async def test_output_tokens_past_the_context_name_the_field(serve, path, field):
    s = await serve()
    api = "anthropic" if path == MESSAGES else "openai"
    r = await s.post(path, with_(path, **{field: CONTEXT + 1}), api=api)
    assert r.status_code == 400
    err = anthropic_shaped(r) if api == "anthropic" else openai_shaped(r)
    assert field in err["message"] and str(CONTEXT) in err["message"]
    if api == "openai":
        assert err["param"] == field
    room = CONTEXT - tokens.count(GOOD_TEXT[path])
    ok = await s.post(path, with_(path, **{field: room}), api=api)
    assert ok.status_code == 200, ok.text
    assert s.agents.bodies["/v1/decode"][-1]["output_tokens"] == room


@pytest.mark.parametrize("path,param,value", [(CHAT, "temperature", "hot"), (CHAT, "top_p", 2),
                                              (CHAT, "seed", 0.5), (COMPLETIONS, "seed", -(2**63) - 1),
                                              (MESSAGES, "temperature", 1.01)])
async def test_a_bad_sampling_parameter_is_a_400_naming_it(serve, path, param, value):
    s = await serve()
    api = "anthropic" if path == MESSAGES else "openai"
    r = await s.post(path, with_(path, **{param: value}), api=api)
    assert r.status_code == 400
    if api == "openai":
        assert openai_shaped(r)["param"] == param
    else:
        assert param in anthropic_shaped(r)["message"]
    assert s.agents.engine_calls == 0


async def test_well_formed_variants_are_served(serve):
    """The checks refuse wrong types, not what clients legitimately send."""
    s = await serve()
    parts = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
    for path, body in [(CHAT, with_(CHAT, messages=msgs(parts), stream=None, max_tokens=None, temperature=0.2)),
                       (CHAT, with_(CHAT, messages=[{"role": "assistant", "content": None}, *msgs("é ✓ 😀")])),
                       (COMPLETIONS, with_(COMPLETIONS, prompt=["a", "b"])),
                       (MESSAGES, with_(MESSAGES, system=[{"type": "text", "text": "be brief"}]))]:
        r = await s.post(path, body, api="anthropic" if path == MESSAGES else "openai",
                         headers={"Content-Type": "application/json; charset=UTF-8"})
        assert r.status_code == 200, (path, r.text)
    r = await s.http.post(CHAT, content=with_(CHAT), headers={"Authorization": f"bearer {KEY}"})
    assert r.status_code == 200, "the auth scheme is case-insensitive"


async def test_an_unexpected_error_is_a_500_in_the_api_shape_and_logged(serve, monkeypatch, caplog):
    s = await serve()

    def broken(text: str) -> list[int]:
        raise RuntimeError("boom")
    monkeypatch.setattr(tokens, "encode", broken)
    with caplog.at_level(logging.ERROR, logger="pd_gateway"):
        r = await s.post(CHAT, with_(CHAT))
        assert r.status_code == 500 and openai_shaped(r)["code"] == "internal_error"
        r = await s.post(MESSAGES, with_(MESSAGES), api="anthropic")
        assert r.status_code == 500 and anthropic_shaped(r)["type"] == "api_error"
    logged = [rec for rec in caplog.records if rec.exc_info and "boom" in str(rec.exc_info[1])]
    assert len(logged) == 2 and CHAT in logged[0].getMessage()


@pytest.mark.parametrize("with_ids", [True, False], ids=["token ids", "timing only"])
async def test_an_unexpected_error_mid_stream_ends_the_stream_with_an_error_event(serve, monkeypatch, caplog,
                                                                                  with_ids):
    agents = FakeAgents()
    if not with_ids:
        agents.reply_ids = None
    s = await serve(agents)
    real_piece, real_push, pushed = wire.piece, tokens.Detokenizer.push, []

    def piece(seed: bytes, i: int) -> str:
        if i == 2:
            raise RuntimeError("boom")
        return real_piece(seed, i)

    def push(self, token_id: int) -> str:
        pushed.append(token_id)
        if len(pushed) == 3:
            raise RuntimeError("boom")
        return real_push(self, token_id)
    monkeypatch.setattr(wire, "piece", piece)
    monkeypatch.setattr(tokens.Detokenizer, "push", push)
    with caplog.at_level(logging.ERROR, logger="pd_gateway"):
        r = await s.post(CHAT, with_(CHAT, stream=True, max_tokens=5))
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert r.status_code == 200 and sum(1 for e in events if e.get("choices", [{}])[0].get("delta", {}).get(
        "content")) == 2
    assert events[-1]["error"]["code"] == "internal_error"
    assert any(rec.exc_info for rec in caplog.records)


# ---- the simulated text: work per token does not grow with the prompt -------------------------

class _Counted:
    def __init__(self, h, seen: list[int]):
        self._h, self._seen = h, seen

    def update(self, data: bytes) -> None:
        self._seen.append(len(data))
        self._h.update(data)

    def digest(self) -> bytes:
        return self._h.digest()

    def hexdigest(self) -> str:
        return self._h.hexdigest()


async def test_per_token_work_does_not_depend_on_the_prompt_length(serve, monkeypatch):
    """The placeholder text of an engine that sends no token ids: seeded by the prompt, digested once."""
    agents = FakeAgents()
    agents.reply_ids = None
    s = await serve(agents, max_body_bytes=4 << 20, max_context_tokens=1 << 20)
    seen: list[int] = []
    real = hashlib.sha256

    def counting(data: bytes = b"", **kw):
        seen.append(len(data))
        return _Counted(real(data, **kw), seen)
    monkeypatch.setattr(hashlib, "sha256", counting)
    tokens = 16
    per_token = {}
    texts = {}
    for size in (1 << 10, 1 << 20):
        seen.clear()
        content = "x" * size
        r = await s.post(CHAT, with_(CHAT, messages=msgs(content), max_tokens=tokens))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == tokens
        texts[size] = r.json()["choices"][0]["message"]["content"]
        prompt_bytes = len(f"user: {content}".encode())
        assert sum(seen) >= prompt_bytes, "the prompt seeds the text"
        per_token[size] = (sum(seen) - prompt_bytes) / tokens
    assert per_token[1 << 10] == per_token[1 << 20] <= 64, per_token
    again = await s.post(CHAT, with_(CHAT, messages=msgs("x" * 1024), max_tokens=tokens))
    assert again.json()["choices"][0]["message"]["content"] == texts[1 << 10], "deterministic for a prompt"
    assert texts[1 << 10] != texts[1 << 20]


# ---- bounds ------------------------------------------------------------------------------------

async def test_requests_in_flight_are_bounded_per_key_and_in_total(serve):
    agents = FakeAgents()
    agents.hold = asyncio.Event()
    s = await serve(agents, max_streams_per_key=2, max_streams=3)

    def stream(key: str, path: str = CHAT) -> asyncio.Task:
        api = "anthropic" if path == MESSAGES else "openai"
        return asyncio.create_task(s.post(path, with_(path, stream=True), key=key, api=api))

    async def decodes(n: int) -> None:
        while agents.calls["/v1/decode"] < n:
            await asyncio.sleep(0.01)
    held = [stream(KEY), stream(KEY)]
    await asyncio.wait_for(decodes(2), 10)
    r = await s.post(CHAT, with_(CHAT), key=KEY)
    assert r.status_code == 429 and r.headers["Retry-After"] == "1"
    assert "in flight" in openai_shaped(r)["message"] and agents.calls["/v1/prefill"] == 2
    held.append(stream(OTHER))
    await asyncio.wait_for(decodes(3), 10)
    r = await s.post(CHAT, with_(CHAT), key=OTHER)
    assert r.status_code == 503 and r.headers["Retry-After"] == "1" and openai_shaped(r)
    r = await s.post(MESSAGES, with_(MESSAGES), key=OTHER, api="anthropic")
    assert r.status_code == 503 and anthropic_shaped(r)["type"] == "overloaded_error"
    assert agents.calls["/v1/prefill"] == 3
    agents.hold.set()
    assert [t.status_code for t in await asyncio.gather(*held)] == [200, 200, 200]
    assert s.gw.streams.count == 0 and s.gw.streams.by_key == {}
    assert (await s.post(CHAT, with_(CHAT), key=KEY)).status_code == 200
    metrics = (await s.metrics.get("/metrics")).text
    assert 'pd_gateway_requests_total{api="chat",key="team-a",status="429"} 1.0' in metrics


async def test_body_bytes_in_flight_are_bounded_per_key_and_in_total(serve):
    agents = FakeAgents()
    agents.hold = asyncio.Event()
    body = with_(CHAT, stream=True)
    n = len(body)
    s = await serve(agents, max_body_bytes=n, max_body_bytes_per_key=2 * n + 5, max_body_bytes_in_flight=3 * n + 10)
    held = [asyncio.create_task(s.post(CHAT, body)) for _ in range(2)]
    while agents.calls["/v1/decode"] < 2:
        await asyncio.sleep(0.01)
    r = await s.post(CHAT, body)   # the key's share is taken
    assert r.status_code == 429 and r.headers["Retry-After"] == "1"
    assert "its share" in openai_shaped(r)["message"] and agents.calls["/v1/prefill"] == 2
    held.append(asyncio.create_task(s.post(CHAT, body, key=OTHER)))   # another key still gets in
    while agents.calls["/v1/decode"] < 3:
        await asyncio.sleep(0.01)
    r = await s.post(CHAT, body, key=OTHER)   # now the gateway's total is taken
    assert r.status_code == 503 and r.headers["Retry-After"] == "1"
    assert "bytes of request bodies" in openai_shaped(r)["message"] and agents.calls["/v1/prefill"] == 3
    agents.hold.set()
    assert [t.status_code for t in await asyncio.gather(*held)] == [200, 200, 200]
    assert s.gw.body_bytes.used == 0 and s.gw.body_bytes.by_key == {} and s.gw.streams.count == 0
    assert (await s.post(CHAT, body, key=OTHER)).status_code == 200


async def test_metrics_and_stats_are_on_the_metrics_port_only(serve):
    """They name every key and its usage: the public API port answers 404 for them."""
    s = await serve()
    assert (await s.post(CHAT, with_(CHAT))).status_code == 200
    for path in ("/metrics", "/stats"):
        r = await s.http.get(path)
        assert r.status_code == 404 and openai_shaped(r), path
    metrics = await s.metrics.get("/metrics")
    assert metrics.status_code == 200 and 'key="team-a"' in metrics.text
    stats = await s.metrics.get("/stats")
    assert stats.status_code == 200 and isinstance(stats.json(), dict)
    assert (await s.metrics.get("/v1/models")).status_code == 404
    for http in (s.http, s.metrics):
        assert (await http.get("/livez")).json() == {"ok": True, "errors": []}


async def _raw(port: int, data: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    return reader, writer


async def test_a_client_slow_to_send_its_headers_is_cut_off(serve):
    s = await serve(header_timeout_s=0.5)
    reader, writer = await _raw(s.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
    assert await asyncio.wait_for(reader.read(), 10) == b"", "closed without an answer"
    writer.close()
    # one header byte at a time, each well within the timeout: the bound is on the whole
    reader, writer = await _raw(s.port, b"POST /v1/chat/completions HTTP/1.1\r\n")
    closed = False
    for _ in range(200):
        try:
            writer.write(b"X")
            await writer.drain()
            closed = await asyncio.wait_for(reader.read(), 0.05) == b""
        except (ConnectionError, TimeoutError):
            closed = closed or writer.is_closing() or reader.at_eof()
        if closed:
            break
    assert closed, "a client dripping its headers was still connected after 10 s"
    writer.close()


@pytest.mark.parametrize("path", [CHAT, MESSAGES])
async def test_a_client_slow_to_send_its_body_gets_408(serve, path):
    s = await serve(body_timeout_s=0.5)
    key = f"Authorization: Bearer {KEY}" if path == CHAT else f"x-api-key: {KEY}"
    reader, writer = await _raw(s.port, f"POST {path} HTTP/1.1\r\nHost: x\r\n{key}\r\nContent-Type: "
                                        f"application/json\r\nContent-Length: 1000\r\n\r\n{{\"model\"".encode())
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 408"), head
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(
        b"content-length")))
    r = httpx.Response(408, content=await reader.readexactly(length))
    (anthropic_shaped if path == MESSAGES else openai_shaped)(r)
    writer.close()
    assert s.agents.engine_calls == 0


async def test_a_chunked_body_past_the_limit_is_413(serve):
    s = await serve()

    async def chunks():
        for _ in range(BODY_LIMIT // 1024 + 2):
            yield b" " * 1024
    r = await s.http.post(CHAT, content=chunks(), headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 413 and openai_shaped(r)


# ---- bad pods -------------------------------------------------------------------------------------

def _without(d: dict, key: str) -> dict:
    return {k: v for k, v in d.items() if k != key}


BAD_REPORTS = [
    ("no role", _without(PREFILL, "role")),
    ("role a number", {**PREFILL, "role": 5}),
    ("an unknown role", {**PREFILL, "role": "leader"}),
    ("initialized missing", _without(PREFILL, "initialized")),
    ("draining a string", {**PREFILL, "draining": "maybe"}),
    ("load a string", {**PREFILL, "load": "busy"}),
    ("a load figure a string", {**PREFILL, "load": {"queue_depth": "many"}}),
    ("links a string", {**DECODER, "links": "p0"}),
    ("a link a number", {**DECODER, "links": [5]}),
    ("a link without cluster_id", {**DECODER, "links": [{"name": "p0", "code": "LLM_SUCCESS"}]}),
    ("cluster_id a word", {**PREFILL, "cluster_id": "one"}),
    ("an array", b"[]"),
    ("not JSON", b"<html>busy</html>"),
    ("nested too deeply", DEEP),
    ("NaN", json.dumps({**PREFILL, "load": {"queue_depth": float("nan")}}).encode()),
    ("an HTTP error", httpx.Response(500, json={**PREFILL, "role": None})),
    ("too large", json.dumps({**PREFILL, "last_error": "x" * 4096}).encode()),
]


@pytest.mark.parametrize("name,report", BAD_REPORTS, ids=[c[0] for c in BAD_REPORTS])
async def test_a_bad_status_report_skips_that_pod_only(name, report, monkeypatch):
    monkeypatch.setattr(routing, "MAX_STATUS_BYTES", 2048)
    agents = FakeAgents()
    agents.status[BAD_HOST] = report
    seen: list[tuple[str, str]] = []
    fleet = agents.fleet(on_bad_report=lambda pod, why: seen.append((pod, why)))
    async with fleet.http:
        await fleet.refresh()
        assert [p["name"] for p in fleet.prefills] == [P_HOST] and [d["name"] for d in fleet.decoders] == [D_HOST]
        assert [pod for pod, _ in seen] == [BAD_HOST] and BAD_HOST in fleet.bad
        msgs = [m async for m in generate(fleet, 7, 10, 3, Attempt())]
        assert [m["token"] for m in msgs if "token" in m] == [0, 1, 2]


async def test_a_bad_report_is_logged_once_per_pod_and_error_and_counted_each_time(caplog):
    agents = FakeAgents()
    agents.status[BAD_HOST] = _without(PREFILL, "role")
    seen: list[str] = []
    fleet = agents.fleet(on_bad_report=lambda pod, why: seen.append(pod))
    with caplog.at_level(logging.INFO, logger="pd_routing"):
        async with fleet.http:
            for _ in range(3):
                await fleet.refresh()
            agents.status[BAD_HOST] = {**PREFILL, "load": []}
            for _ in range(2):
                await fleet.refresh()
            agents.status[BAD_HOST] = {**PREFILL, "pod": "p9", "cluster_id": 9}
            await fleet.refresh()
            assert len(fleet.prefills) == 2 and not fleet.bad
    lines = [r.getMessage() for r in caplog.records if BAD_HOST in r.getMessage()]
    assert seen == [BAD_HOST] * 5
    assert len(lines) == 3 and "role" in lines[0] and "load" in lines[1] and "usable again" in lines[2], lines


async def test_the_gateway_counts_bad_reports_and_keeps_serving(serve):
    agents = FakeAgents()
    agents.status[BAD_HOST] = _without(DECODER, "role")
    s = await serve(agents)
    await s.gw.fleet.refresh()
    assert (await s.post(CHAT, with_(CHAT))).status_code == 200
    health = await s.http.get("/healthz")
    assert health.status_code == 200 and any(BAD_HOST in e for e in health.json()["errors"])
    metrics = (await s.metrics.get("/metrics")).text
    assert f'pd_gateway_bad_reports_total{{pod="{BAD_HOST}"}} 2.0' in metrics


HOSTILE_STREAMS = [
    ("not JSON", [b"not json\n"]),
    ("not an object", [b"[1]\n"]),
    ("an error that is a string", [b'{"error": "boom"}\n']),
    ("an error with odd fields", [b'{"error": {"code": 5, "message": [1]}}\n']),
    ("a line of a MiB", [b"x" * (1 << 20)]),
    ("garbage after a token", [b'{"token": 0}\n', b"\xff\xfe\n"]),
    ("nested too deeply", [DEEP + b"\n"]),
]


@pytest.mark.parametrize("name,lines", HOSTILE_STREAMS, ids=[c[0] for c in HOSTILE_STREAMS])
async def test_a_hostile_decode_stream_is_an_engine_error(name, lines):
    agents = FakeAgents()
    agents.lines = lines
    fleet = agents.fleet()
    async with fleet.http:
        await fleet.refresh()
        with pytest.raises(EngineError):
            async for _ in generate(fleet, 7, 10, 3, Attempt(), retry_window=0.5):
                pass


@pytest.mark.parametrize("reply", [httpx.Response(500, json=[1, 2]), httpx.Response(500, content=b"\xff" * 10),
                                   httpx.Response(500, content=DEEP), httpx.Response(200, content=b"x" * (1 << 20))])
async def test_a_hostile_prefill_answer_is_an_engine_error(reply):
    agents = FakeAgents()
    agents.prefill_reply = reply
    fleet = agents.fleet()
    async with fleet.http:
        await fleet.refresh()
        with pytest.raises(EngineError):
            async for _ in generate(fleet, 7, 10, 3, Attempt(), retry_window=0.5):
                pass


async def test_a_refused_decode_after_a_long_prefill_queue_still_gets_its_retry_window():
    """The decode's window counts from the prefill's end: a prefill that queued longer than the window is
    decoded on another linked decoder, not thrown away."""
    agents = FakeAgents()
    agents.status["10.0.0.4"] = {**DECODER, "pod": "d1", "cluster_id": 1002, "ip": "10.0.0.4"}
    agents.prefill_delay, agents.decode_refusals = 0.3, 1
    fleet = agents.fleet()
    async with fleet.http:
        await fleet.refresh()
        attempt = Attempt()
        msgs = [m async for m in generate(fleet, 7, 10, 3, attempt, retry_window=0.2)]
    assert [m["token"] for m in msgs if "token" in m] == [0, 1, 2]
    assert attempt.refusals == {"DRAINING": 1} and agents.calls["/v1/decode"] == 2


async def test_a_decoder_sending_more_tokens_than_asked_fails_the_request(serve):
    agents = FakeAgents()
    agents.lines = [json.dumps({"token": i}).encode() + b"\n" for i in range(50)]
    s = await serve(agents)
    r = await s.post(CHAT, with_(CHAT, max_tokens=4))
    assert r.status_code == 502 and openai_shaped(r)["code"] == "TOO_MANY_TOKENS"


# ---- background tasks, keys --------------------------------------------------------------------------

async def test_a_background_task_that_dies_takes_healthz_down(serve, caplog):
    s = await serve()

    async def broken() -> None:
        raise RuntimeError("boom in the loop")
    s.gw.fleet.run = broken
    with caplog.at_level(logging.ERROR, logger="pd_gateway"):
        s.gw.start()
        for _ in range(100):
            if s.gw.dead:
                break
            await asyncio.sleep(0.01)
    r = await s.http.get("/healthz")
    assert r.status_code == 503 and r.json()["ok"] is False
    assert any("fleet-refresh" in e and "boom in the loop" in e for e in r.json()["errors"]), r.json()
    live = await s.http.get("/livez")   # a dead loop does not come back: the pod is restarted
    assert live.status_code == 503 and "fleet-refresh" in live.json()["errors"][0]
    assert "keys-refresh" not in s.gw.dead
    died = [rec for rec in caplog.records if "fleet-refresh" in rec.getMessage()]
    assert died and died[0].exc_info and "boom in the loop" in str(died[0].exc_info[1])


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_keys_that_cannot_be_read_are_revoked_after_the_grace(caplog):
    clock, state = Clock(), {"fail": None}

    def load() -> dict[str, str]:
        if state["fail"]:
            raise state["fail"]
        return {"team-a": KEY}
    keys = Keys(load, grace_s=20, clock=clock)
    keys.refresh()
    assert keys.name_of(KEY) == "team-a"
    state["fail"] = RuntimeError("secrets \"keys\" not found")
    keys.refresh()
    clock.t += 10
    keys.refresh()
    assert keys.name_of(KEY) == "team-a" and len(keys) == 1, "one failed read (and the next) within the grace"
    clock.t += 10
    assert keys.name_of(KEY) is None and len(keys) == 0, "revoked once the grace is over, before the next read"
    with caplog.at_level(logging.ERROR, logger="pd_gateway.keys"):
        keys.refresh()
    assert any("refusing all 1 keys" in r.getMessage() for r in caplog.records)
    assert "not found" in keys.error
    state["fail"] = None
    keys.refresh()
    assert keys.name_of(KEY) == "team-a" and not keys.error


async def test_revoked_keys_are_a_401_saying_why_and_healthz_fails(serve):
    clock, state = Clock(), {"fail": False}

    def load() -> dict[str, str]:
        if state["fail"]:
            raise PermissionError("secrets \"keys\" is forbidden")
        return {"team-a": KEY}
    s = await serve(keys=Keys(load, clock=clock))
    state["fail"] = True
    s.gw.keys.refresh()
    assert (await s.post(CHAT, with_(CHAT))).status_code == 200, "within the grace"
    served = s.agents.engine_calls
    clock.t += s.gw.keys.grace_s
    r = await s.post(CHAT, with_(CHAT))
    assert r.status_code == 401 and "could not be loaded" in openai_shaped(r)["message"]
    r = await s.post(MESSAGES, with_(MESSAGES), api="anthropic")
    assert r.status_code == 401 and "forbidden" in anthropic_shaped(r)["message"]
    health = await s.http.get("/healthz")
    assert health.status_code == 503 and any("forbidden" in e for e in health.json()["errors"])
    assert s.agents.engine_calls == served


def test_short_keys_are_ignored_with_a_warning_naming_them_not_their_value(caplog):
    secret = {"short-one": "sk-tiny-1", "fine": KEY, "not-a-string": 5, "surrogate": "\ud800" * 20}
    keys = Keys(lambda: dict(secret))
    with caplog.at_level(logging.WARNING, logger="pd_gateway.keys"):
        keys.refresh()
        keys.refresh()
    assert keys.name_of("sk-tiny-1") is None and keys.name_of(KEY) == "fine"
    assert keys.name_of("\udcff\udcfe" * 10) is None and keys.name_of("\ud800" * 20) == "surrogate"
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "short-one" in warned[0] and "sk-tiny-1" not in warned[0], warned


async def test_while_pods_cannot_be_listed_the_agents_last_listed_are_still_asked():
    """The API server away: a prefill dropped after one failed request comes back as soon as its
    agent answers again, instead of staying out of routing for the whole outage."""
    agents = FakeAgents()
    fleet = agents.fleet()
    listed = fleet.discover
    down = [False]

    def discover():
        if down[0]:
            raise ConnectionRefusedError("the API server is away")
        return listed()
    fleet.discover = discover
    async with fleet.http:
        await fleet.refresh()
        assert [p["name"] for p in fleet.prefills] == [P_HOST]
        down[0] = True
        fleet.drop(fleet.prefills[0]["url"])   # a request to it failed (a timeout on a busy machine)
        assert not fleet.prefills
        await fleet.refresh()
        assert [p["name"] for p in fleet.prefills] == [P_HOST] and "the API server is away" in fleet.error
        msgs = [m async for m in generate(fleet, 8, 10, 3, Attempt())]
        assert [m["token"] for m in msgs if "token" in m] == [0, 1, 2]


async def test_a_request_waits_for_a_pair_to_come_back_only_in_a_fleet_that_had_one():
    """The only prefill instance restarting whole: a request waits for it (Fleet.hold_window), not
    the refusal window; a fleet that never had a pair answers at once."""
    agents = FakeAgents()
    fleet = agents.fleet()
    async with fleet.http:
        await fleet.refresh()
        assert fleet.paired_lately()
        agents.status[P_HOST] = {**PREFILL, "initialized": False}   # its pods restarting
        await fleet.refresh()
        assert fleet.prefills == [] and fleet.paired_lately()

        async def back() -> None:
            await asyncio.sleep(0.6)
            agents.status[P_HOST] = PREFILL
            await fleet.refresh()
        task = asyncio.create_task(back())
        attempt = Attempt()
        msgs = [m async for m in generate(fleet, 7, 10, 3, attempt, retry_window=0.2)]
        await task
        assert [m["token"] for m in msgs if "token" in m] == [0, 1, 2] and attempt.refusals == {"NoLinkedPair": 1}

        fleet.hold_window = 0.5      # past it: refused
        agents.status[P_HOST] = {**PREFILL, "initialized": False}
        await fleet.refresh()
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(Unavailable):
            async for _ in generate(fleet, 8, 10, 3, Attempt(), retry_window=0.1):
                pass
        assert asyncio.get_running_loop().time() - t0 < 0.6
    never = FakeAgents()
    never.status[P_HOST] = {**PREFILL, "initialized": False}
    fleet = never.fleet()
    async with fleet.http:
        await fleet.refresh()
        assert not fleet.paired_lately()
        with pytest.raises(Unavailable):
            async for _ in generate(fleet, 9, 10, 3, Attempt(), retry_window=0.1):
                pass


async def test_a_prefill_gone_before_any_decoder_took_its_cache_is_done_again():
    """The instance that prefilled a request restarts before a decoder pulled: the request is
    prefilled again on the instance that serves now (nothing was sent to the client yet)."""
    agents = FakeAgents()
    agents.prefill_delay = 0.3
    fleet = agents.fleet()
    new_host = "10.0.0.9"
    async with fleet.http:
        await fleet.refresh()

        async def restart() -> None:
            await asyncio.sleep(0.1)   # while the first prefill runs: its pod goes, another comes
            agents.status[P_HOST] = {**PREFILL, "initialized": False}
            agents.status[new_host] = {**PREFILL, "pod": "p1", "cluster_id": 2, "boot_id": "b3", "ip": new_host}
            agents.status[D_HOST] = {**DECODER, "links": [{"name": "p1", "cluster_id": 2, "code": "LLM_SUCCESS",
                                                           "peer_boot_id": "b3"}]}
            # its pod is gone from the listing (a pod whose status only went unanswered still holds the cache)
            fleet.discover = fixed_finder([f"http://{h}:8080" for h in agents.status if h != P_HOST])
            await fleet.refresh()
        task = asyncio.create_task(restart())
        attempt = Attempt()
        msgs = [m async for m in generate(fleet, 7, 10, 3, attempt, retry_window=1.0)]
        await task
    assert [m["token"] for m in msgs if "token" in m] == [0, 1, 2]
    assert agents.calls["/v1/prefill"] == 2 and attempt.prefill == new_host and "PrefillLost" in attempt.refusals


async def test_a_link_to_an_earlier_start_of_a_prefill_is_not_a_pair():
    p = {**PREFILL, "url": "http://a", "boot_id": "new"}
    d = {**DECODER, "url": "http://b", "links": [{"name": "p0", "cluster_id": 1, "code": "LLM_SUCCESS",
                                                  "peer_boot_id": "old"}]}
    assert not Fleet.linked(p, d)
    d["links"][0]["peer_boot_id"] = "new"
    assert Fleet.linked(p, d)
