"""The agent's HTTP API over real agent processes (simulator backend), and the agent core
embedded around an engine its host created."""
from __future__ import annotations

import asyncio
import socket
import subprocess
import time

import httpx
from aiohttp import web

from tests.agent_procs import TOKEN, next_ip
from tests.conftest import wait_for


def test_auth_and_bad_input(agents):
    a = agents("decoder", 1000, env={"PD_AGENT_DATA_TOKEN": "data-token"})
    raw = httpx.Client(base_url=a.url, trust_env=False)
    assert raw.get("/v1/status").status_code == 401
    r = raw.get("/v1/status", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json()["code"] == "AgentUnauthorized"
    assert raw.get("/healthz").status_code == 200
    r = a.post("/v1/link", {"peers": [{"name": "p", "cluster_id": 0, "ip": "127.0.0.1", "port": 70000}]})
    assert r.status_code == 400 and r.json()["field"] == "peers.0.port"
    r = a.http.post("/v1/link", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["message"]
    r = a.post("/v1/link", {"peers": []})
    assert r.status_code == 400 and r.json()["field"] == "peers"
    r = a.post("/v1/switch_role", {"role": "mixed"})
    assert r.status_code == 400 and r.json()["field"] == "role"
    # fields only a multi-rank pod's own agent may set: refused to the data scope, before any work
    data = {"Authorization": "Bearer data-token"}
    r = raw.post("/v1/decode", headers=data, json={"req_id": 1, "prompt_cluster_id": 0, "prompt_tokens": 8,
                                                   "output_tokens": 2, "kv_pulled_ms": 1.0})
    assert r.status_code == 403 and "kv_pulled_ms" in r.json()["message"]
    r = raw.post("/v1/notify", headers=data, json={"decoder_cluster_id": 1, "released": [5]})
    assert r.status_code == 403 and "released" in r.json()["message"]
    assert a.http.get("/healthz").status_code == 200  # still alive


def test_link_verify_requests_metrics(agents):
    p = agents("prompt", 0)
    d = agents("decoder", 1000)
    st = d.status()
    assert st["role"] == "decoder" and st["cluster_id"] == 1000 and st["boot_id"]
    r = d.post("/v1/link", {"peers": [p.peer()], "timeout_ms": 2000}).json()
    assert r["ret"] == "LLM_SUCCESS" and r["rets"] == {"prompt-0": "LLM_SUCCESS"}
    links = d.status()["links"]
    assert [(l["name"], l["code"]) for l in links] == [("prompt-0", "LLM_SUCCESS")]
    assert p.status()["incoming"] == [1000]

    v = d.post("/v1/verify", {"peer": p.peer()}).json()
    assert v["ok"] and v["code"] == "LLM_SUCCESS" and v["bytes"] > 0 and v["pull_ms"] > 0

    pf = p.post("/v1/prefill", {"req_id": 7, "prompt_tokens": 300}).json()
    assert pf["prompt_cluster_id"] == 0 and pf["prefill_ms"] > 0
    assert p.status()["load"]["pending_kv"] == 1
    dc = d.post("/v1/decode", {"req_id": 7, "prompt_cluster_id": 0, "prompt_tokens": 300,
                               "output_tokens": 5}).json()
    assert dc["tokens"] == 5 and dc["tbt_ms_mean"] > 0
    # the decoder's agent tells the prefill's agent the cache was pulled (the v1 API does not)
    wait_for("pull notice", lambda: p.status()["load"]["pending_kv"] == 0, timeout=5)
    # the same key twice: already pulled
    r = d.post("/v1/decode", {"req_id": 7, "prompt_cluster_id": 0, "prompt_tokens": 300, "output_tokens": 5})
    assert r.status_code == 502 and r.json()["code"] == "LLM_KV_CACHE_NOT_EXIST"
    metrics = d.http.get("/metrics").text
    assert 'pd_agent_requests_total{phase="decode"} 1.0' in metrics
    assert 'pd_agent_requests_failed_total{reason="LLM_KV_CACHE_NOT_EXIST"} 1.0' in metrics
    assert "pd_agent_tbt_ms_count 4.0" in metrics
    assert 'pd_agent_links{state="up"} 1.0' in metrics


def test_switch_role_live(agents):
    p = agents("prompt", 0)
    d = agents("decoder", 1000)
    d2 = agents("decoder", 1001)
    d.post("/v1/link", {"peers": [p.peer()]})
    r = d.post("/v1/switch_role", {"role": "prompt"})
    assert r.status_code == 409 and r.json()["code"] == "LLM_EXIST_LINK"
    assert d.post("/v1/unlink", {"peers": [p.peer()]}).json()["ret"] == "LLM_SUCCESS"
    assert d.post("/v1/switch_role", {"role": "prompt"}).json()["role"] == "prompt"
    new_prompt = {**d.peer(), "name": "switched"}
    assert d2.post("/v1/link", {"peers": [new_prompt, p.peer()]}).json()["rets"] == {
        "switched": "LLM_SUCCESS", "prompt-0": "LLM_SUCCESS"}
    assert d2.post("/v1/verify", {"peer": new_prompt}).json()["ok"]


def test_drain_waits_for_pending_kv(agents):
    p = agents("prompt", 0)
    d = agents("decoder", 1000)
    d.post("/v1/link", {"peers": [p.peer()]})
    p.post("/v1/prefill", {"req_id": 1, "prompt_tokens": 100})
    r = p.post("/v1/drain", {"timeout_s": 0.3}).json()
    assert r == {"draining": True, "in_flight": 0, "pending_kv": 1, "drained": False}
    assert p.post("/v1/prefill", {"req_id": 2, "prompt_tokens": 100}).status_code == 503
    d.post("/v1/decode", {"req_id": 1, "prompt_cluster_id": 0, "prompt_tokens": 100, "output_tokens": 2})
    assert p.post("/v1/drain", {"timeout_s": 5}).json()["drained"] is True
    assert p.post("/v1/undrain").json()["draining"] is False


def test_faults_and_proxy_report(agents):
    p = agents("prompt", 0)
    d = agents("decoder", 1000, env={"https_proxy": "http://proxy.example:3128"})
    assert d.status()["proxy_env"] == {"https_proxy": "http://proxy.example:3128"}
    assert p.post("/v1/admin/faults", {"refuse_links": True}).status_code == 200
    r = d.post("/v1/link", {"peers": [p.peer()], "timeout_ms": 1000}).json()
    assert r["rets"] == {"prompt-0": "LLM_LINK_FAILED"}
    p.post("/v1/admin/faults", {"refuse_links": False})
    assert d.post("/v1/link", {"peers": [p.peer()]}).json()["ret"] == "LLM_SUCCESS"
    p.post("/v1/admin/faults", {"crash": True})
    p.proc.wait(5)
    assert p.proc.returncode == 137


def test_paged_verify(agents):
    desc = '{"num_tensors": 4, "shape": [2, 256, 1, 64], "data_type": "DT_BF16", ' \
           '"paged": {"block_size": 16, "num_blocks": 32}}'
    p = agents("prompt", 0, cache_desc=desc)
    d = agents("decoder", 1000, cache_desc=desc)
    d.post("/v1/link", {"peers": [p.peer()]})
    v = d.post("/v1/verify", {"peer": p.peer()}).json()
    assert v["ok"], v
    assert v["bytes"] == 4 * 16 * 64 * 2


async def test_embedded_core_over_host_engine(agents):
    """An inference server creates its own engine; the agent core serves the API over it."""
    import llm_datadist_sim as llm
    from pd_agent.core import AgentCore
    from pd_agent.identity import Identity
    from pd_agent.server import build_app

    p = await asyncio.to_thread(agents, "prompt", 0)
    ip = next_ip()
    engine = llm.LLMDataDist(llm.LLMRole.DECODER, 1500)
    engine.init(llm.LLMConfig(enable_switch_role=True).generate_options())
    try:
        ident = Identity(pod="embedded", role="decoder", cluster_id=1500, ip=ip, port=26000, token=TOKEN)
        core = AgentCore(llm, ident, engine=engine)
        runner = web.AppRunner(build_app(core, TOKEN))
        await runner.setup()
        with socket.socket() as s:
            s.bind((ip, 0))
            port = s.getsockname()[1]
        await web.TCPSite(runner, ip, port).start()
        async with httpx.AsyncClient(base_url=f"http://{ip}:{port}", trust_env=False,
                                     headers={"Authorization": f"Bearer {TOKEN}"}) as c:
            st = (await c.get("/v1/status")).json()
            assert st["pod"] == "embedded" and st["initialized"] and st["role"] == "decoder"
            r = (await c.post("/v1/link", json={"peers": [p.peer()]})).json()
            assert r["ret"] == "LLM_SUCCESS"
            assert engine.sim_links() != {}  # the host's own engine holds the link
            v = (await c.post("/v1/verify", json={"peer": p.peer()})).json()
            assert v["ok"], v
        await runner.cleanup()
    finally:
        engine.finalize()


def test_loadgen_cli_against_agents(agents):
    import json
    import subprocess
    import sys
    p1, p2 = agents("prompt", 0), agents("prompt", 1)
    d = agents("decoder", 1000)
    d.post("/v1/link", {"peers": [p1.peer(), p2.peer()]})
    out = subprocess.run(
        [sys.executable, "-m", "pd_agent.loadgen", "--agent", p1.url, "--agent", p2.url, "--agent", d.url,
         "--token", TOKEN, "--rate", "20", "--duration", "2", "--max-prompt", "256", "--max-output", "8",
         "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)
    assert s["requests"] > 10 and s["failed"] == 0 and s["completed"] == s["requests"]
    assert s["ttft_ms"]["p90"] > 0 and s["goodput_rps"] > 0
    wait_for("pull notices", lambda: p1.status()["load"]["pending_kv"] == 0
             and p2.status()["load"]["pending_kv"] == 0, timeout=5)


def test_loadgen_honours_sigterm_with_requests_stuck_in_flight(agents):
    """Every pull hangs (the prompt side answers after 10 minutes, and the decoder waits that
    long). The first SIGTERM stops
    sending and gives the requests in flight --stop-grace seconds; a second one cancels them at
    once. Either way the load generator prints its summary and exits."""
    import json
    import signal
    import sys
    import tempfile

    from tests.procs import spawn
    p = agents("prompt", 0, env={"PD_SIM_FAULT_PULL_DELAY_MS": "600000"})
    d = agents("decoder", 1000, env={"LLM_DATADIST_SYNC_KV_TIMEOUT_MS": "600000"})
    d.post("/v1/link", {"peers": [p.peer()]})
    for grace, signals in (("3", 1), ("600", 2)):
        before = d.status()["load"]["in_flight"]   # the first run's cancelled decodes still hang there
        out = tempfile.TemporaryFile("w+")
        lg = spawn([sys.executable, "-m", "pd_agent.loadgen", "--agent", p.url, "--agent", d.url, f"--token={TOKEN}",
                    "--rate", "5", "--duration", "600", "--max-prompt", "64", "--max-output", "4",
                    "--stop-grace", grace, "--seed", grace, "--json"], stdout=out, stderr=subprocess.STDOUT, text=True)
        wait_for("decodes stuck on the decoder", lambda: d.status()["load"]["in_flight"] >= before + 2,
                 timeout=90)
        for _ in range(signals):
            lg.send_signal(signal.SIGTERM)
            time.sleep(0.5)
        assert lg.wait(120) == 1, "no request completed, so the exit code says so"
        out.seek(0)
        text = out.read()
        s = json.loads(text[text.index("{"):])
        assert s["completed"] == 0 and s["failed"] == s["requests"] >= 2, s
        assert s["failed_by_reason"] == {"Cancelled": s["requests"]}, s
