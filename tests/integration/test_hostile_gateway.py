"""pd-gateway as a process (no cluster) against bad pods and hostile clients: a pod whose
status report is malformed is skipped and counted while the others serve; a decoder that
stops sending ends the client's stream with an error event; slow, oversized and undecodable
requests are cut off or refused with a 4xx, with no engine work.

The bad pods are fake agents served from a thread of the test, each on its own loopback IP
and the agent port, as the gateway finds agents (PD_GATEWAY_AGENTS)."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
from aiohttp import web

from pd_contract.names import AGENT_PORT
from tests.agent_procs import next_ip
from tests.conftest import wait_for
from tests.integration.test_gateway_api import DATA_TOKEN, KEYS, MODEL, GatewayProc

pytestmark = pytest.mark.integration
KEY = KEYS["team-a"]
# the shared fixture's keys may be shorter than the gateway's default minimum
KEY_ENV = {"PD_GATEWAY_MIN_KEY_LENGTH": str(min(len(k) for k in KEYS.values()))}
AGENT_ENV = {"PD_AGENT_DATA_TOKEN": DATA_TOKEN, "PD_SIM_TIME_SCALE": "10"}


def report(pod: str, role: str, cluster_id: int, ip: str, links: list[dict] | None = None) -> dict:
    return {"pod": pod, "role": role, "cluster_id": cluster_id, "boot_id": f"boot-{pod}", "backend": "sim",
            "initialized": True, "ip": ip, "port": 26000, "model_id": 0, "links": links or [], "draining": False,
            "load": {"queue_depth": 0, "queued_prompt_tokens": 0, "running": 0, "kv_used_bytes": 0}}


class FakeAgent:
    """An agent that answers /v1/status with `status` (any bytes), /v1/prefill with success,
    and /v1/decode with `tokens` tokens and then nothing (a hung engine)."""

    def __init__(self, status: dict | bytes | None = None, tokens: int = 0, cluster_id: int = 0):
        self.ip = next_ip()
        self.url = f"http://{self.ip}:{AGENT_PORT}"
        self.cluster_id = cluster_id
        self.status = status if status is not None else report(self.ip, "prompt", cluster_id, self.ip)
        self.tokens = tokens
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self) -> web.AppRunner:
        app = web.Application()
        app.add_routes([web.get("/v1/status", self._status), web.post("/v1/prefill", self._prefill),
                        web.post("/v1/decode", self._decode)])
        runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1)
        await runner.setup()
        await web.TCPSite(runner, self.ip, AGENT_PORT).start()
        return runner

    async def _status(self, request: web.Request) -> web.Response:
        body = self.status if isinstance(self.status, bytes) else json.dumps(self.status).encode()
        return web.Response(body=body, content_type="application/json")

    async def _prefill(self, request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"prompt_cluster_id": self.cluster_id, "req_id": body["req_id"], "model_id": 0,
                                  "queue_ms": 0, "prefill_ms": 1})

    async def _decode(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        for i in range(self.tokens):
            await resp.write(json.dumps({"token": i, "ms": i}).encode() + b"\n")
        await asyncio.sleep(3600)
        return resp

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(20)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def fakes():
    made: list[FakeAgent] = []

    def make(**kw) -> FakeAgent:
        a = FakeAgent(**kw)
        made.append(a)
        return a
    yield make
    for a in made:
        a.stop()


@pytest.fixture
def pair(agents):
    """A linked prefill and decoder, real agent processes."""
    p = agents("prompt", 0, env=AGENT_ENV)
    d = agents("decoder", 1000, env=AGENT_ENV)
    assert d.post("/v1/link", {"peers": [p.peer()]}).json()["ret"] == "LLM_SUCCESS"
    return p, d


def metric(url: str, line_start: str) -> float:
    """From the gateway's metrics port (a 404 must not read as zero)."""
    r = httpx.get(f"{url}/metrics", trust_env=False, timeout=5)
    assert r.status_code == 200, r.text[:200]
    text = r.text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start))


def test_a_pod_with_a_malformed_status_is_skipped_and_counted_while_the_others_serve(pair, fakes):
    p, d = pair
    no_role = {k: v for k, v in report("bad", "prompt", 7, "x").items() if k != "role"}
    bad = fakes(status=no_role)
    garbage = fakes(status=b"[" * 50_000)
    gw = GatewayProc([p.url, bad.url, garbage.url, d.url], env=KEY_ENV)
    try:
        r = httpx.post(f"{gw.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}, trust_env=False,
            timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        wait_for("several refreshes counted the bad reports",
                 lambda: metric(gw.metrics_url, f'pd_gateway_bad_reports_total{{pod="{bad.ip}"}}') >= 3
                 and metric(gw.metrics_url, f'pd_gateway_bad_reports_total{{pod="{garbage.ip}"}}') >= 3, timeout=60)
        health = httpx.get(f"{gw.url}/healthz", trust_env=False, timeout=5)
        assert health.status_code == 200 and health.json()["prefills"] == 1 and health.json()["decoders"] == 1
        assert any(bad.ip in e and "role" in e for e in health.json()["errors"]), health.json()
    finally:
        log = gw.stop()
    warned = [line for line in log.splitlines() if f"pod {bad.ip}: not routed to" in line]
    assert len(warned) == 1 and "role" in warned[0], log[-3000:]
    assert len([line for line in log.splitlines() if f"pod {garbage.ip}: not routed to" in line]) == 1


def test_a_decoder_that_stops_sending_ends_the_stream_with_an_error_event(fakes):
    prefill = fakes(cluster_id=5)
    decoder = fakes(tokens=2)
    decoder.status = report("fake-d", "decoder", 1005, decoder.ip, links=[
        {"name": "fake-p", "cluster_id": 5, "code": "LLM_SUCCESS"}])
    gw = GatewayProc([prefill.url, decoder.url], env={**KEY_ENV, "PD_GATEWAY_UPSTREAM_READ_TIMEOUT_S": "1"})
    try:
        for path, body, headers in [
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
             {"Authorization": f"Bearer {KEY}"}),
            ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}]}, {"x-api-key": KEY}),
        ]:
            with httpx.stream("POST", f"{gw.url}{path}", headers=headers, trust_env=False, timeout=30,
                              json={"model": MODEL, "max_tokens": 50, "stream": True, **body}) as r:
                data = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            texts = [e for e in data if e.get("choices") and e["choices"][0]["delta"].get("content")
                     or e.get("type") == "content_block_delta"]
            assert len(texts) == 2, data
            err = data[-1]["error"]
            assert "ReadTimeout" in (err.get("code") or "") + err["message"], data[-1]
            if path == "/v1/messages":
                assert data[-1]["type"] == "error"
    finally:
        gw.stop()


def _raw(host: str, data: bytes, wait: float = 30) -> bytes:
    """Send `data`; what comes back: an answer (headers and Content-Length bytes), or b"" when
    the server closes without one. Fails if neither happens within `wait` seconds."""
    with socket.create_connection((host, 8000), timeout=wait) as s:
        s.sendall(data)
        out = b""
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                return out
            out += chunk
            head, sep, body = out.partition(b"\r\n\r\n")
            length = [int(v) for k, _, v in (line.partition(b":") for line in head.split(b"\r\n"))
                      if k.strip().lower() == b"content-length"]
            if sep and length and len(body) >= length[0]:
                return out
        raise AssertionError(f"no answer and still open after {wait}s; got {out[:300]!r}")


def _json_of(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_slow_oversized_and_undecodable_requests_are_refused(pair):
    p, d = pair
    gw = GatewayProc([p.url, d.url], env={**KEY_ENV, "PD_GATEWAY_HEADER_TIMEOUT_S": "1",
                                          "PD_GATEWAY_BODY_TIMEOUT_S": "1", "PD_GATEWAY_MAX_BODY_BYTES": "65536"})
    try:
        # headers never completed: closed without an answer
        assert _raw(gw.ip, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthor") == b""
        # a body that never arrives: 408 in the API's shape
        status, body = _json_of(_raw(gw.ip, f"POST /v1/messages HTTP/1.1\r\nHost: x\r\nx-api-key: {KEY}\r\n"
                                            f"Content-Length: 500\r\n\r\n{{\"model\"".encode()))
        assert status == 408 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        h = {"Authorization": f"Bearer {KEY}"}
        url = f"{gw.url}/v1/chat/completions"
        big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 70_000}]}
        r = httpx.post(url, json=big, headers=h, trust_env=False, timeout=30)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        r = httpx.post(url, content=b"[" * 30_000, headers=h, trust_env=False, timeout=30)
        assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]
        lone = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "\ud800"}]})   # "\\ud800"
        r = httpx.post(url, content=lone, headers=h, trust_env=False, timeout=30)
        assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"]
        r = httpx.post(url, json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, trust_env=False,
                       headers={"Authorization": b"Bearer \xff\xfe\xfd\xfc-not-a-key"}, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert metric(gw.metrics_url, "pd_gateway_pod_requests_total") == 0, "no engine saw any of them"
        ok = httpx.post(url, json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                        headers=h, trust_env=False, timeout=30)
        assert ok.status_code == 200
    finally:
        log = gw.stop()
    assert "Traceback" not in log, log[-3000:]
