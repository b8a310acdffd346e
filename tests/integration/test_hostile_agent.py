"""The agent against callers that hold less than the control token, or send what no agent
would: real agent processes, no cluster."""
from __future__ import annotations

import asyncio
import socket
import threading

import httpx
from aiohttp import web

from tests.agent_procs import TOKEN, next_ip
from tests.conftest import wait_for

DATA, PEER = "data-token", "peer-token"


class Listener:
    """A tiny HTTP server a test controls: it answers 200 to anything and records every request."""

    def __init__(self) -> None:
        self.ip = next_ip()
        with socket.socket() as s:
            s.bind((self.ip, 0))
            self.port = s.getsockname()[1]
        self.url = f"http://{self.ip}:{self.port}"
        self.seen: list[tuple[str, str, dict[str, str]]] = []
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        async def record(request: web.Request) -> web.Response:
            self.seen.append((request.method, request.path, dict(request.headers)))
            return web.json_response({})

        async def serve() -> None:
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", record)
            self.runner = web.AppRunner(app)
            await self.runner.setup()
            await web.TCPSite(self.runner, self.ip, self.port).start()
            started.set()

        self.thread = threading.Thread(target=lambda: (self.loop.run_until_complete(serve()),
                                                       self.loop.run_forever()), daemon=True)
        self.thread.start()
        assert started.wait(10)

    def carrying(self, secret: str) -> list[tuple[str, str]]:
        return [(m, p) for m, p, h in self.seen if any(secret in v for v in h.values())]

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _unlinked_agent_url(a) -> dict:
    return {k: v for k, v in a.peer().items() if k != "agent_url"}


def test_a_data_caller_never_receives_the_control_token(agents):
    """A data-token holder names a URL it controls as the prefill's agent: the decoder never
    sends it anything (with or without the prefill's agent URL known from the link), so the
    control token the notices carry (no peer token configured) never leaves for it."""
    env = {"PD_AGENT_DATA_TOKEN": DATA}
    p, p2, d = agents("prompt", 0, env=env), agents("prompt", 1, env=env), agents("decoder", 1000, env=env)
    trap = Listener()
    try:
        # p is linked without its agent URL, p2 with it (as the operator links)
        r = d.post("/v1/link", {"peers": [_unlinked_agent_url(p), p2.peer()]}).json()
        assert r["ret"] == "LLM_SUCCESS", r
        data = httpx.Client(trust_env=False, timeout=30, headers={"Authorization": f"Bearer {DATA}"})
        for prefill, req_id in ((p, 1), (p2, 2)):
            r = data.post(f"{prefill.url}/v1/prefill", json={"req_id": req_id, "prompt_tokens": 32})
            assert r.status_code == 200, r.text
            r = data.post(f"{d.url}/v1/decode", json={
                "req_id": req_id, "prompt_cluster_id": prefill.cluster_id, "prompt_agent_url": trap.url,
                "prompt_tokens": 32, "output_tokens": 2})
            assert r.status_code == 200, r.text
        # the linked prefill hears of its pull; the one linked without an agent URL expires its cache
        wait_for("the linked prefill's pull notice", lambda: p2.status()["load"]["pending_kv"] == 0, timeout=10)
        assert p.status()["load"]["pending_kv"] == 1
        d.stop()   # a stopping agent flushes every notice it still holds
        assert trap.carrying(TOKEN) == [] and trap.seen == []
    finally:
        trap.close()


def test_notices_carry_the_peer_token_to_the_linked_agent(agents):
    env = {"PD_AGENT_DATA_TOKEN": DATA, "PD_AGENT_PEER_TOKEN": PEER}
    p, d = agents("prompt", 0, env=env), agents("decoder", 1000, env=env)
    linked = Listener()   # the prefill's agent, as the operator names it in the link
    try:
        assert d.post("/v1/link", {"peers": [{**p.peer(), "agent_url": linked.url}]}).json()["ret"] == "LLM_SUCCESS"
        assert p.post("/v1/prefill", {"req_id": 3, "prompt_tokens": 32}).status_code == 200
        assert d.post("/v1/decode", {"req_id": 3, "prompt_cluster_id": 0, "prompt_tokens": 32,
                                     "output_tokens": 1}).status_code == 200
        wait_for("the pull notice", lambda: any(path == "/v1/notify" for _, path, _ in linked.seen), timeout=10)
        assert all(h.get("Authorization") == f"Bearer {PEER}" for _, _, h in linked.seen), linked.seen
        assert linked.carrying(TOKEN) == []
    finally:
        linked.close()


CONTROL_CALLS = [("GET", "/v1/status"), ("POST", "/v1/prefill"), ("POST", "/v1/decode"), ("POST", "/v1/pull"),
                 ("POST", "/v1/init"), ("POST", "/v1/link"), ("POST", "/v1/unlink"), ("POST", "/v1/switch_role"),
                 ("POST", "/v1/verify"), ("POST", "/v1/probe"), ("POST", "/v1/drain"), ("POST", "/v1/undrain"),
                 ("POST", "/v1/admin/faults"), ("GET", "/v1/admin/faults")]


def test_the_peer_token_reaches_notify_and_nothing_else(agents):
    p = agents("prompt", 0, env={"PD_AGENT_DATA_TOKEN": DATA, "PD_AGENT_PEER_TOKEN": PEER})
    peer = httpx.Client(base_url=p.url, trust_env=False, timeout=10, headers={"Authorization": f"Bearer {PEER}"})
    assert p.post("/v1/prefill", {"req_id": 9, "prompt_tokens": 16}).status_code == 200
    r = peer.post("/v1/notify", json={"decoder_cluster_id": 1000, "pulled": [9], "linked": True})
    assert r.status_code == 200, r.text
    assert p.status()["load"]["pending_kv"] == 0
    # a decoder pod's agent frees the copies none of its ranks reads
    assert peer.post("/v1/notify", json={"decoder_cluster_id": 1000, "released": [9]}).status_code == 200
    for method, path in CONTROL_CALLS:
        r = peer.request(method, path, json={"role": "decoder", "crash": True, "timeout_s": 0} if method == "POST"
                         else None)
        assert r.status_code == 403 and r.json()["code"] == "AgentForbidden", (method, path, r.text)
    # and the data token no longer sends notices
    r = httpx.post(f"{p.url}/v1/notify", json={"decoder_cluster_id": 1000, "pulled": [9]}, trust_env=False,
                   headers={"Authorization": f"Bearer {DATA}"})
    assert r.status_code == 403 and "peer token" in r.json()["message"]
    st = p.status()
    assert st["role"] == "prompt" and not st["draining"] and p.proc.poll() is None


def test_a_multi_rank_pod_takes_peer_notices_at_its_agent_and_ranks(agents, tmp_path):
    env = {"PD_TENSOR_PARALLEL": "2", "PD_HCCN_CONF": str(tmp_path / "absent"),
           "PD_DEVICE_ANNOTATION_FILE": str(tmp_path / "absent"), "PD_AGENT_DATA_TOKEN": DATA,
           "PD_AGENT_PEER_TOKEN": PEER}
    p = agents("prompt", 0, env=env)
    d = agents("decoder", 1000, env={"PD_AGENT_DATA_TOKEN": DATA, "PD_AGENT_PEER_TOKEN": PEER})
    ps = p.status()
    peer_of_p = {**p.peer(), "ranks": [{k: x[k] for k in ("rank", "cluster_id", "ip", "port")} for x in ps["ranks"]]}
    # a single-rank decoder links the pod's rank 0 and reports its pulls to the pod's agent
    assert d.post("/v1/link", {"peers": [peer_of_p]}).json()["ret"] == "LLM_SUCCESS"
    assert p.post("/v1/prefill", {"req_id": 4, "prompt_tokens": 16}).status_code == 200
    wait_for("a copy on each rank", lambda: p.status()["load"]["pending_kv"] == 2, timeout=10)
    assert d.post("/v1/decode", {"req_id": 4, "prompt_cluster_id": 0, "prompt_tokens": 16,
                                 "output_tokens": 1}).status_code == 200
    wait_for("rank 0's pull notice and rank 1's release", lambda: p.status()["load"]["pending_kv"] == 0, timeout=10)

    peer = httpx.Client(base_url=p.url, trust_env=False, timeout=10, headers={"Authorization": f"Bearer {PEER}"})
    notice = {"decoder_cluster_id": 1000, "pulled": [77]}
    assert peer.post("/v1/notify", json=notice).status_code == 200
    assert peer.post("/r/1/v1/notify", json=notice).status_code == 200
    for method, path in [("POST", "/r/0/v1/probe"), ("POST", "/r/1/v1/link"), ("POST", "/v1/link"),
                         ("POST", "/v1/probe"), ("POST", "/v1/drain"), ("POST", "/v1/prefill")]:
        r = peer.request(method, path, json={})
        assert r.status_code == 403 and r.json()["code"] == "AgentForbidden", (method, path, r.text)
    data = {"Authorization": f"Bearer {DATA}"}
    assert peer.post("/r/0/v1/notify", json=notice, headers=data).status_code == 403
    assert peer.post("/v1/notify", json=notice, headers=data).status_code == 403


def test_a_multi_rank_pod_refuses_prefills_past_its_bound_for_another_pod(agents, tmp_path):
    # a batch of prefills takes about half a minute here, so what the pod holds stays put while the test looks
    env = {"PD_TENSOR_PARALLEL": "2", "PD_HCCN_CONF": str(tmp_path / "absent"),
           "PD_DEVICE_ANNOTATION_FILE": str(tmp_path / "absent"), "PD_AGENT_DATA_TOKEN": DATA,
           "PD_AGENT_MAX_PREFILL_QUEUE": "1", "PD_SIM_TIME_SCALE": "300"}
    p = agents("prompt", 0, env=env)
    data = {"Authorization": f"Bearer {DATA}"}

    def prefill(req_id: int) -> None:
        try:
            httpx.post(f"{p.url}/v1/prefill", json={"req_id": req_id, "prompt_tokens": 256}, headers=data,
                       trust_env=False, timeout=600)
        except httpx.HTTPError:
            pass   # cut when the test ends
    # the bound: one waiting beyond a running batch (the default cache's batch is 4)
    for i in range(5):
        threading.Thread(target=prefill, args=(i,), daemon=True).start()
    # the pod's in flight: the 5 it took on, and each of its 2 ranks' part of them
    wait_for("5 prefills in hand", lambda: p.status()["load"]["in_flight"] == 5 + 2 * 5, timeout=20)
    r = httpx.post(f"{p.url}/v1/prefill", json={"req_id": 9, "prompt_tokens": 256}, headers=data, trust_env=False,
                   timeout=30)
    assert r.status_code == 503 and r.json()["code"] == "OVERLOADED" and r.headers["Retry-After"] == "1", r.text


def test_a_connection_that_never_sends_a_whole_request_is_closed(agents):
    a = agents("prompt", 0, env={"PD_AGENT_IDLE_TIMEOUT_S": "0.5"})
    with socket.create_connection((a.ip, 8080), timeout=30) as s:
        s.sendall(b"GET /v1/status HTTP/1.1\r\nHo")
        assert s.recv(4096) == b""   # closed, not held for aiohttp's default hour
