"""What the simulator's listener and the agent's HTTP API do with peers and callers that
misbehave: failures to accept, connection floods, silent or malformed peers, and bodies no
client should send. One engine per process: each test makes its own and finalizes it."""
from __future__ import annotations

import asyncio
import errno
import json
import socket
import struct
import threading
import time
import tracemalloc

import httpx
import pytest
from aiohttp import web

import llm_datadist_sim as llm
from llm_datadist_sim import (
    CacheDesc,
    CacheKey,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
)
from llm_datadist_sim.status import LLMStatusCode as C
from llm_datadist_sim.wire import MAGIC, LinkClosed, recv_header, send_msg
from pd_agent.core import AgentCore
from pd_agent.identity import Identity
from pd_agent.inference import Inference
from pd_agent.loadmeter import MIN_WINDOW_S
from pd_agent.metrics import AgentMetrics
from pd_agent.server import build_app
from pd_agent.timing import TimingModel
from pd_contract.agent_api import NotifyRequest
from tests.conftest import DEADLINE_SCALE, wait_for
from tests.unit.test_sim import PromptPeer  # a prompt engine in its own process

WAIT_S = 10 * DEADLINE_SCALE   # how long a test waits for what must happen (never a performance bound)
TOKEN, DATA, PEER = "control-token", "data-token", "peer-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the simulator's listener ------------------------------------------------------------------

@pytest.fixture
def prompt_engine(monkeypatch):
    """A prompt engine in this process, with the listener settings given as env."""
    made: list[LLMDataDist] = []

    def make(**settings: str) -> tuple[LLMDataDist, int]:
        for k, v in settings.items():
            monkeypatch.setenv(k, v)
        port = free_port()
        e = LLMDataDist(LLMRole.PROMPT, 0)
        e.init(LLMConfig(listen_ip_info=f"127.0.0.1:{port}").generate_options())
        made.append(e)
        return e, port
    yield make
    for e in made:
        e.finalize()


def hello(port: int, cluster_id: int = 0, me: int = 1000) -> tuple[socket.socket, dict]:
    s = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    send_msg(s, {"magic": MAGIC, "op": "hello", "cluster_id": me, "remote_cluster_id": cluster_id})
    return s, recv_header(s)


def closed_by_peer(s: socket.socket) -> bool:
    """True once the other end closed (what it sent before is read and dropped)."""
    s.settimeout(WAIT_S)
    try:
        while s.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return True


def test_an_accept_failure_does_not_stop_the_listener(prompt_engine, monkeypatch, caplog):
    real = socket.socket.accept
    failed: list[int] = []

    def accept(self):
        if not failed:   # the first accept finds the process out of file descriptors
            failed.append(1)
            raise OSError(errno.EMFILE, "Too many open files")
        return real(self)
    monkeypatch.setattr(socket.socket, "accept", accept)
    caplog.set_level("WARNING", logger="llm_datadist_sim")
    _, port = prompt_engine()
    s, reply = hello(port)
    s.close()
    assert failed and reply["ret"] == "LLM_SUCCESS"
    assert "accept failed" in caplog.text


def test_a_thread_that_cannot_start_costs_one_connection_not_the_listener(prompt_engine, monkeypatch):
    real = threading.Thread.start
    failed: list[int] = []

    def start(self):
        if getattr(getattr(self, "_target", None), "__name__", "") == "_serve" and not failed:
            failed.append(1)
            raise RuntimeError("can't start new thread")
        return real(self)
    monkeypatch.setattr(threading.Thread, "start", start)
    _, port = prompt_engine()
    first = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    assert closed_by_peer(first)
    s, reply = hello(port)
    s.close()
    assert failed and reply["ret"] == "LLM_SUCCESS"


def test_silent_peers_are_dropped_and_idle_links_are_not(prompt_engine):
    e, port = prompt_engine(PD_SIM_HANDSHAKE_TIMEOUT_S="0.2", PD_SIM_IO_TIMEOUT_S="0.2")
    # connects and says nothing
    silent = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    assert closed_by_peer(silent)
    # links, then starts a message and stops half-way
    stalled, reply = hello(port, me=1001)
    assert reply["ret"] == "LLM_SUCCESS"
    stalled.sendall(b"\x00\x00")
    assert closed_by_peer(stalled)
    # links and idles past both timeouts: a link waits for its next pull as long as it likes
    kv = e.kv_cache_manager
    cache = kv.allocate_cache(CacheDesc(1, [1, 16], DataType.DT_FLOAT16), [CacheKey(0, 5)])
    cache.slot(0, 0)[:] = bytes(range(cache.slot_bytes))
    kv.deallocate_cache(cache)
    link, reply = hello(port, me=1002)
    assert reply["ret"] == "LLM_SUCCESS"
    time.sleep(0.6)
    send_msg(link, {"op": "pull", "req_id": 5, "model_id": 0, "prefix_id": 2 ** 64 - 1, "num_tensors": 1,
                    "slot_bytes": cache.slot_bytes, "size": -1})
    got = recv_header(link)
    assert got["ret"] == "LLM_SUCCESS" and got["length"] == cache.slot_bytes
    data = b""
    while len(data) < got["length"]:
        data += link.recv(got["length"] - len(data))
    assert data == bytes(range(cache.slot_bytes))
    link.close()


@pytest.fixture
def decoder():
    made: list[LLMDataDist] = []

    def make() -> LLMDataDist:
        e = LLMDataDist(LLMRole.DECODER, 1000)
        e.init(LLMConfig(sync_kv_timeout=int(WAIT_S * 1000)).generate_options())
        made.append(e)
        return e
    yield make
    for e in made:
        e.finalize()


def info(port: int, ip: str = "127.0.0.1") -> LLMClusterInfo:
    i = LLMClusterInfo()
    i.remote_cluster_id = 0
    i.append_local_ip_info("127.0.0.1", 26000)
    i.append_remote_ip_info(ip, port)
    return i


def test_connections_over_the_bound_are_refused_while_pulls_go_on(decoder):
    desc = {"num_tensors": 2, "shape": [1, 64, 1, 16], "data_type": "DT_FLOAT16"}
    p = PromptPeer(0, {"PD_SIM_MAX_CONNECTIONS": "2", "PD_SIM_HANDSHAKE_TIMEOUT_S": "600"})
    held: list[socket.socket] = []
    try:
        d = decoder()
        assert d.link_clusters([info(p.port)], 5000)[1] == [C.LLM_SUCCESS]          # one
        held.append(socket.create_connection(("127.0.0.1", p.port), timeout=WAIT_S))  # two, silent
        over = socket.create_connection(("127.0.0.1", p.port), timeout=WAIT_S)       # three: refused
        held.append(over)
        reply = recv_header(over)
        assert reply["ret"] == "LLM_LINK_FAILED" and "too many connections" in reply["message"]
        assert closed_by_peer(over)
        # the link already made still serves pulls
        got = p.cmd(op="alloc", req_ids=[7], desc=desc)
        kv = d.kv_cache_manager
        cache = kv.allocate_cache(CacheDesc(desc["num_tensors"], desc["shape"], DataType.DT_FLOAT16))
        kv.pull_cache(CacheKey(0, 7), cache, 0)
        import hashlib
        h = hashlib.sha256()
        for t in range(cache.cache_desc.num_tensors):
            h.update(cache.slot(t, 0))
        assert h.hexdigest() == got["sha256"][0]
        # a connection that goes frees its place
        held.pop(0).close()

        def links() -> bool:
            s, r = hello(p.port, me=1001)
            s.close()
            return r["ret"] == "LLM_SUCCESS"
        wait_for("a place for a new link", links, timeout=10)
    finally:
        for s in held:
            s.close()
        p.close()


def test_a_header_buffer_grows_as_the_header_arrives():
    """A peer's length is a claim: 10 bytes of a declared 1 MiB header cost about 10 bytes."""
    a, b = socket.socketpair()
    b.sendall(struct.pack("!I", 1 << 20) + b"{" * 10)
    b.close()
    tracemalloc.start()
    try:
        with pytest.raises(LinkClosed):
            recv_header(a)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        a.close()
    assert peak < (1 << 20) // 4


class NonsensePrompt:
    """A listener that links like a prompt engine, then answers a pull with `reply`."""

    def __init__(self, reply) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.reply = reply
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            recv_header(conn)
            send_msg(conn, {"ret": "LLM_SUCCESS", "cluster_id": 0})
            recv_header(conn)
            raw = json.dumps(self.reply).encode()
            conn.sendall(struct.pack("!I", len(raw)) + raw)
            try:
                conn.recv(1)   # holds the link open until the decoder lets go
            except OSError:
                pass

    def close(self) -> None:
        self.listener.close()


@pytest.mark.parametrize("reply", [{"ret": "NO_SUCH_CODE"}, {"ret": ["LLM_SUCCESS"]},
                                   {"ret": "LLM_SUCCESS", "length": 1 << 40}, {"ret": "LLM_SUCCESS", "length": "8"},
                                   {"ret": "LLM_SUCCESS"}, ["not", "a", "header"]])
def test_a_prompt_side_that_answers_nonsense_breaks_its_link_only(decoder, reply):
    fake = NonsensePrompt(reply)
    try:
        d = decoder()
        assert d.link_clusters([info(fake.port)], 5000)[1] == [C.LLM_SUCCESS]
        kv = d.kv_cache_manager
        cache = kv.allocate_cache(CacheDesc(1, [1, 8], DataType.DT_FLOAT16))
        with pytest.raises(LLMException) as ei:
            kv.pull_cache(CacheKey(0, 1), cache, 0)
        assert ei.value.status_code is C.LLM_LINK_FAILED
        with pytest.raises(LLMException) as ei:
            d.check_link_status(0)
        assert ei.value.status_code is C.LLM_LINK_FAILED
    finally:
        fake.close()


def test_a_link_to_something_that_is_not_an_address_is_a_failed_link(decoder):
    d = decoder()
    assert d.link_clusters([info(26000, ip="a" * 300)], 2000)[1] == [C.LLM_LINK_FAILED]
    assert d.link_clusters([info(26000, ip="bad\x00ip")], 2000)[1] == [C.LLM_LINK_FAILED]


# ---- the agent's HTTP API ----------------------------------------------------------------------

class Agent:
    def __init__(self, url: str, core: AgentCore, runner: web.AppRunner):
        self.url, self.core, self.runner = url, core, runner
        self.port = int(url.rsplit(":", 1)[1])

    def client(self, token: str = TOKEN) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, trust_env=False, timeout=WAIT_S,
                                 headers={"Authorization": f"Bearer {token}"})

    async def raw(self, request: bytes) -> tuple[int, dict[str, str], bytes]:
        """An HTTP/1.1 request as bytes (headers a client library would not send)."""
        r, w = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            w.write(request)
            await w.drain()
            head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), WAIT_S)
            lines = head.decode("latin-1").strip().split("\r\n")
            headers = dict(line.split(": ", 1) for line in lines[1:])
            body = await asyncio.wait_for(r.readexactly(int(headers.get("Content-Length", 0))), WAIT_S)
        finally:
            w.close()
        return int(lines[0].split()[1]), headers, body


@pytest.fixture
async def agent():
    made: list[Agent] = []

    async def make(role: str = "prompt", time_scale: float = 0.01, **settings) -> Agent:
        ident = Identity(pod=f"{role}-hardening", role=role, cluster_id=0 if role == "prompt" else 1000,
                         ip="127.0.0.1", port=free_port(), token=TOKEN, data_token=DATA, peer_token=PEER, **settings)
        core = AgentCore(llm, ident)
        metrics = AgentMetrics()
        Inference(core, metrics, TimingModel(time_scale=time_scale))
        # requests a test leaves waiting are cut at its end, not waited for
        runner = web.AppRunner(build_app(core, TOKEN, metrics, data_token=DATA, peer_token=PEER), shutdown_timeout=0.5)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await core.init()
        a = Agent(f"http://127.0.0.1:{port}", core, runner)
        made.append(a)
        return a
    yield make
    for a in made:
        await a.runner.cleanup()
        await a.core.finalize()


def shaped(r: httpx.Response, status: int) -> dict:
    """The agent's error shape: {code, message, ...} with the status."""
    assert r.status_code == status, r.text
    body = r.json()
    assert isinstance(body["code"], str) and isinstance(body["message"], str), body
    return body


@pytest.mark.parametrize("header", [b"Authorization: Bearer \xff\xfe\xc3(", b"X-PD-Agent-Token: \xff\xfe",
                                    b"Authorization: Bearer \xed\xa0\x80"])
async def test_an_authorization_header_that_is_not_utf8_is_a_wrong_token(agent, header):
    a = await agent()
    status, _, body = await a.raw(b"GET /v1/status HTTP/1.1\r\nHost: x\r\n" + header + b"\r\nConnection: close\r\n\r\n")
    assert status == 401 and json.loads(body)["code"] == "AgentUnauthorized"


async def test_livez_is_not_readiness(agent, monkeypatch):
    """Liveness (/livez, open) answers while the engine is not initialised; readiness
    (/healthz) does not: an engine that cannot init yet is retried in place, not restarted."""
    a = await agent()
    monkeypatch.setattr(a.core.engine, "_initialized", False, raising=False)
    async with httpx.AsyncClient(base_url=a.url, trust_env=False, timeout=WAIT_S) as c:
        assert (await c.get("/healthz")).status_code == 503
        live = await c.get("/livez")
        assert live.status_code == 200 and live.json()["ok"] is True


async def post_raw(a: Agent, path: str, body: bytes, content_type: str = "application/json") -> httpx.Response:
    async with a.client() as c:
        return await c.post(path, content=body, headers={"Content-Type": content_type})


async def test_bodies_no_client_should_send_are_4xx_in_the_agents_shape(agent):
    a = await agent()
    deep = b'{"req_id": 1, "prompt_tokens": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert shaped(await post_raw(a, "/v1/prefill", deep), 400)["code"] == "BadRequest"
    deep = b"[" * 5_000 + b"]" * 5_000
    assert shaped(await post_raw(a, "/v1/probe", deep), 400)["code"] == "BadRequest"
    # whatever charset the header names, the body is JSON's UTF-8
    r = await post_raw(a, "/v1/probe", b'{"req_id": 3}', "application/json; charset=no-such-charset")
    assert r.status_code == 200, r.text
    r = await post_raw(a, "/v1/probe", b'{"req_id": "\xff"}', "application/json; charset=latin-1")
    assert shaped(r, 400)["code"] == "BadRequest"
    # not numbers JSON knows
    for constant in (b"NaN", b"Infinity", b"-Infinity"):
        assert shaped(await post_raw(a, "/v1/drain", b'{"timeout_s": ' + constant + b"}"), 400)["code"] == "BadRequest"
    # wrong JSON types, at the top and in a field
    for body, field in ((b"[1, 2]", "(body)"), (b'"prefill"', "(body)"), (b"null", "(body)"), (b"7", "(body)"),
                        (b'{"req_id": "one", "prompt_tokens": 8}', "req_id"),
                        (b'{"req_id": 1, "prompt_tokens": {"n": 8}}', "prompt_tokens"),
                        (b'{"req_id": 1.5, "prompt_tokens": 8}', "req_id"),
                        (b'{"req_id": 99999999999999999999999, "prompt_tokens": 8}', "req_id")):
        assert shaped(await post_raw(a, "/v1/prefill", body), 400)["field"] == field, body
    # fields the models do not have
    r = await post_raw(a, "/v1/prefill", b'{"req_id": 1, "prompt_tokens": 8, "priority": 9}')
    assert shaped(r, 400)["field"] == "priority"
    # too large: refused before it is read whole
    big = b'{"peers": [' + b" " * (9 << 20) + b"]}"
    assert shaped(await post_raw(a, "/v1/link", big), 413)["code"] == "RequestEntityTooLarge"
    # no such route, no such method
    async with a.client() as c:
        assert shaped(await c.get("/no/such/thing"), 404)["code"] == "NotFound"
        r = await c.get("/v1/prefill")
        assert shaped(r, 405)["code"] == "MethodNotAllowed" and r.headers["Allow"] == "POST"
        # a request id in use is the caller's mistake, not the engine's
        assert (await c.post("/v1/prefill", json={"req_id": 11, "prompt_tokens": 8})).status_code == 200
        assert shaped(await c.post("/v1/prefill", json={"req_id": 11, "prompt_tokens": 8}), 409)["code"] == \
            "LLM_REPEAT_REQUEST"
        # and the agent is still serving
        assert (await c.get("/v1/status")).json()["initialized"]
        # a path a caller makes up is not a metric of its own
        metrics = (await c.get("/metrics")).text
        assert 'op="thing"' not in metrics and 'op="unmatched"' in metrics


async def test_control_calls_with_bad_addresses_are_answered_not_failed(agent):
    a = await agent("decoder")
    async with a.client() as c:
        r = await c.post("/v1/link", json={"peers": [{"name": "p", "cluster_id": 0, "ip": "a" * 300, "port": 1}]})
        assert r.status_code == 200 and r.json()["rets"] == {"p": "LLM_LINK_FAILED"}, r.text
        peer = {"name": "p", "cluster_id": 0, "ip": "127.0.0.1", "port": 1, "agent_url": "http://[::1"}
        r = await c.post("/v1/verify", json={"peer": peer})
        assert r.status_code == 200 and r.json()["code"] == "PEER_AGENT_UNREACHABLE", r.text


async def test_a_decode_from_a_prefill_not_linked_now_is_a_refusal_another_decoder_may_take(agent):
    """A prefill restarted and not yet relinked: the pull finds no link and moves nothing, so the
    decoder refuses before its first token with a code a router retries on another pair."""
    from pd_router.routing import RETRYABLE
    a = await agent("decoder")
    async with a.client(DATA) as c:
        for stream in (True, False):
            r = await c.post("/v1/decode", json={"req_id": 5, "prompt_cluster_id": 0, "prompt_tokens": 16,
                                                 "output_tokens": 4, "stream": stream})
            body = shaped(r, 503)
            assert body["code"] == "NOT_LINKED" and "LLM_NOT_YET_LINK" in body["message"], body
            assert body["code"] in RETRYABLE


async def test_prefills_past_the_queue_bound_are_refused_for_another_pod(agent):
    # a prefill takes about a minute here, so the queue holds still while the test looks at it
    a = await agent(time_scale=1000.0, max_prefill_queue=1)
    inf = a.core.inference
    data, control = a.client(DATA), a.client(TOKEN)
    tasks = []
    try:
        def body(req_id: int, **kw) -> dict:
            return {"req_id": req_id, "prompt_tokens": 256, **kw}
        tasks.append(asyncio.create_task(data.post("/v1/prefill", json=body(1))))
        await asyncio.wait_for(_until(lambda: inf._prefill_busy == 1), WAIT_S)     # computing
        tasks.append(asyncio.create_task(data.post("/v1/prefill", json=body(2))))
        await asyncio.wait_for(_until(lambda: len(inf.prefill_q) == 1), WAIT_S)    # waiting: the bound
        r = await data.post("/v1/prefill", json=body(3))
        assert shaped(r, 503)["code"] == "OVERLOADED" and r.headers["Retry-After"] == "1"
        # a multi-rank pod's agent admitted it for the instance: its rank takes its part
        tasks.append(asyncio.create_task(control.post("/v1/prefill", json=body(4, admitted=True))))
        await asyncio.wait_for(_until(lambda: len(inf.prefill_q) == 2), WAIT_S)
        st = (await data.get("/v1/status")).json()
        assert st["load"]["queue_depth"] == 2 and st["load"]["failed"] == 0
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await data.aclose()
        await control.aclose()


async def _until(cond) -> None:
    while not cond():
        await asyncio.sleep(0.01)


async def test_a_body_that_trickles_in_is_cut_off(agent, monkeypatch):
    import pd_agent.http
    monkeypatch.setattr(pd_agent.http, "BODY_TIMEOUT_S", 0.2)
    a = await agent()
    status, _, body = await a.raw(b"POST /v1/prefill HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + DATA.encode()
                                  + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n"
                                  + b"Connection: close\r\n\r\n{\"req_id\": ")
    assert status == 408 and json.loads(body)["code"] == "RequestTimeout"


async def test_queued_prompt_tokens_count_what_will_be_computed(agent):
    a = await agent(time_scale=1000.0)
    inf = a.core.inference
    async with a.client(DATA) as c:
        tasks = [asyncio.create_task(c.post("/v1/prefill", json={"req_id": 1, "prompt_tokens": 8}))]
        try:
            await asyncio.wait_for(_until(lambda: inf._prefill_busy == 1), WAIT_S)
            tasks.append(asyncio.create_task(c.post("/v1/prefill", json={"req_id": 2, "prompt_tokens": 10 ** 30})))
            await asyncio.wait_for(_until(lambda: len(inf.prefill_q) == 1), WAIT_S)
            load = (await c.get("/v1/status")).json()["load"]
            assert load["queued_prompt_tokens"] == inf.max_seq == 256
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def test_the_load_report_counts_what_the_serving_took_on_and_computed(agent):
    t0 = time.monotonic()
    a = await agent()
    async with a.client(DATA) as c:
        r = await c.post("/v1/prefill", json={"req_id": 5, "prompt_tokens": 200})
        assert r.status_code == 200, r.text
        load = (await c.get("/v1/status")).json()["load"]
    ran = time.monotonic() - t0
    assert (load["requests_arrived"], load["prompt_tokens_arrived"], load["prefill_tokens"]) == (1, 200, 200)
    assert load["prefill_busy_s"] > 0
    assert load["window_s"] == load["full_window_s"] <= max(MIN_WINDOW_S, ran), \
        "the agent just started: its window is no longer than it has run"


async def test_what_a_prefill_took_on_stays_in_its_report_after_it_switches_to_decoder(agent):
    """The agent tells its meter which role it left: the prompt it took on as a prefill is still
    the fleet's demand after the switch (earlier_*), not the decoder window's."""
    t0 = time.monotonic()
    a = await agent(switchable=True)
    async with a.client(DATA) as c:
        r = await c.post("/v1/prefill", json={"req_id": 7, "prompt_tokens": 200})
        assert r.status_code == 200, r.text
        a.core.notify(NotifyRequest(decoder_cluster_id=1000, released=[7]))   # nobody pulls it: drained
        await a.core.switch_role("decoder")
        load = (await c.get("/v1/status")).json()["load"]
    assert (load["requests_arrived"], load["earlier_prompts_arrived"], load["earlier_prompt_tokens_arrived"]) == \
        (0, 1, 200)
    assert load["window_s"] <= load["full_window_s"] <= max(MIN_WINDOW_S, time.monotonic() - t0)
