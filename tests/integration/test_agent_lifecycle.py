"""The agent under traffic: link health that does not contend with pulls, pending-KV
accounting through pull notices, and graceful termination on SIGTERM."""
from __future__ import annotations

import json
import signal
import threading

from tests.agent_procs import AgentProc
from tests.conftest import wait_for


def _in_thread(fn):
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fn()), daemon=True)
    t.start()
    return t, out


def test_status_during_a_pull_reports_the_link_healthy(agents):
    p = agents("prompt", 0)
    d = agents("decoder", 1000, env={"LLM_DATADIST_SYNC_KV_TIMEOUT_MS": "10000"})
    assert d.post("/v1/link", {"peers": [p.peer()]}).json()["ret"] == "LLM_SUCCESS"
    p.post("/v1/prefill", {"req_id": 5, "prompt_tokens": 200})
    p.post("/v1/admin/faults", {"pull_delay_ms": 3000})   # the pull holds the link for 3 s
    t, out = _in_thread(lambda: d.post("/v1/decode", {"req_id": 5, "prompt_cluster_id": 0,
                                                       "prompt_tokens": 200, "output_tokens": 2}))
    wait_for("the pull to start", lambda: d.status()["load"]["in_flight"] == 1, timeout=5)
    seen = []
    while t.is_alive() and len(seen) < 50:
        st = d.status()          # answered while the pull holds the link's lock
        if t.is_alive():
            seen.append(st["links"][0])
        threading.Event().wait(0.1)
    t.join(10)
    assert out["r"].status_code == 200, out["r"].text
    assert len(seen) >= 10, "status polls did not overlap the pull"
    assert all(l["healthy"] and l["code"] == "LLM_SUCCESS" for l in seen), seen


def test_a_pull_timeout_marks_the_link_broken(agents):
    p = agents("prompt", 0)
    d = agents("decoder", 1000, env={"LLM_DATADIST_SYNC_KV_TIMEOUT_MS": "300"})
    d.post("/v1/link", {"peers": [p.peer()]})
    p.post("/v1/prefill", {"req_id": 6, "prompt_tokens": 50})
    p.post("/v1/admin/faults", {"pull_delay_ms": 1000})
    r = d.post("/v1/decode", {"req_id": 6, "prompt_cluster_id": 0, "prompt_tokens": 50, "output_tokens": 1})
    assert r.status_code == 502 and r.json()["code"] == "LLM_WAIT_PROCESS_TIMEOUT"
    link = d.status()["links"][0]
    assert not link["healthy"] and link["code"] in ("LLM_WAIT_PROCESS_TIMEOUT", "LLM_LINK_FAILED")


def test_pull_notices_and_links_reach_the_prefill(agents):
    p = agents("prompt", 0)
    d = agents("decoder", 1000)
    d.post("/v1/link", {"peers": [p.peer()]})
    for i in range(3):
        p.post("/v1/prefill", {"req_id": 100 + i, "prompt_tokens": 64})
    assert p.status()["load"]["pending_kv"] == 3
    for i in range(2):
        assert d.post("/v1/decode", {"req_id": 100 + i, "prompt_cluster_id": 0, "prompt_tokens": 64,
                                     "output_tokens": 1}).status_code == 200
    wait_for("two pull notices", lambda: p.status()["load"]["pending_kv"] == 1, timeout=5)
    # notices are per request: a notice for a key that was never prefilled changes nothing
    assert p.post("/v1/notify", {"decoder_cluster_id": 1000, "pulled": [999]}).status_code == 200
    assert p.status()["load"]["pending_kv"] == 1
    r = p.post("/v1/notify", {"decoder_cluster_id": 1000, "pulled": ["x"]})
    assert r.status_code == 400 and r.json()["field"].startswith("pulled")


def test_sigterm_decoder_finishes_in_flight_decodes_then_exits(agents):
    p = agents("prompt", 0)
    d = agents("decoder", 1000, env={"PD_SIM_TIME_SCALE": "1", "PD_DRAIN_TIMEOUT_S": "30"})
    d.post("/v1/link", {"peers": [p.peer()]})
    p.post("/v1/prefill", {"req_id": 1, "prompt_tokens": 64})
    p.post("/v1/prefill", {"req_id": 2, "prompt_tokens": 64})
    t, out = _in_thread(lambda: d.post("/v1/decode", {"req_id": 1, "prompt_cluster_id": 0,
                                                       "prompt_tokens": 64, "output_tokens": 100}))
    wait_for("decode running", lambda: d.status()["load"]["running"] == 1, timeout=5)
    d.proc.send_signal(signal.SIGTERM)
    wait_for("draining", lambda: d.status()["terminating"], timeout=5)
    r = d.post("/v1/decode", {"req_id": 2, "prompt_cluster_id": 0, "prompt_tokens": 64, "output_tokens": 1})
    assert r.status_code == 503 and r.json()["code"] == "DRAINING"
    t.join(30)
    assert out["r"].status_code == 200 and out["r"].json()["tokens"] == 100
    assert d.proc.wait(30) == 0
    drained = _drained(d)
    assert drained["drained"] and drained["in_flight"] == 0


def test_sigterm_prefill_waits_for_pulls_and_unlink(agents):
    p = agents("prompt", 0, env={"PD_DRAIN_TIMEOUT_S": "30"})
    d = agents("decoder", 1000)
    d.post("/v1/link", {"peers": [p.peer()]})
    wait_for("link notice", lambda: p.status()["incoming"] == [1000], timeout=5)
    p.post("/v1/prefill", {"req_id": 1, "prompt_tokens": 64})
    p.proc.send_signal(signal.SIGTERM)
    wait_for("terminating", lambda: p.status()["terminating"], timeout=5)
    assert p.post("/v1/prefill", {"req_id": 2, "prompt_tokens": 64}).status_code == 503
    # still up: its cache waits to be pulled, over a link that is still there
    assert d.post("/v1/decode", {"req_id": 1, "prompt_cluster_id": 0, "prompt_tokens": 64,
                                 "output_tokens": 1}).status_code == 200
    wait_for("nothing pending", lambda: p.status()["load"]["pending_kv"] == 0, timeout=5)
    assert p.proc.poll() is None, "exited while a decoder was still linked to it"
    assert d.post("/v1/unlink", {"peers": [p.peer()]}).json()["ret"] == "LLM_SUCCESS"
    assert p.proc.wait(10) == 0
    drained = _drained(p)
    assert drained["drained"] and drained["still_linked"] == []


def _drained(a: AgentProc) -> dict:
    line = next(l for l in a.output().splitlines() if "drained: " in l)
    return json.loads(line.split("drained: ", 1)[1])


async def test_loadgen_sends_refused_requests_elsewhere(agents):
    """A pod that starts draining between the load generator's fleet refreshes refuses with
    503 DRAINING; the request goes to another pair, and a decode refused after its prefill
    ran goes to another decoder linked to the same prefill."""
    import asyncio

    import httpx

    from pd_agent.loadgen import direct_request, summarize
    from pd_gateway.server import fixed_finder
    from pd_router.routing import Fleet
    from tests.agent_procs import TOKEN
    p1, p2 = await asyncio.gather(asyncio.to_thread(agents, "prompt", 0), asyncio.to_thread(agents, "prompt", 1))
    d1, d2 = await asyncio.gather(asyncio.to_thread(agents, "decoder", 1000),
                                  asyncio.to_thread(agents, "decoder", 1001))
    for d in (d1, d2):
        await asyncio.to_thread(d.post, "/v1/link", {"peers": [p1.peer(), p2.peer()]})
    async with httpx.AsyncClient(trust_env=False, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        fleet = Fleet(http, TOKEN, fixed_finder([p1.url, p2.url, d1.url, d2.url]))
        await fleet.refresh()
        assert len(fleet.prefills) == 2 and len(fleet.decoders) == 2
        await http.post(f"{p1.url}/v1/drain", json={"timeout_s": 0})
        await http.post(f"{d1.url}/v1/drain", json={"timeout_s": 0})
        results = await asyncio.gather(*(direct_request(fleet, 500 + i, 64, 2) for i in range(12)))
    s = summarize(list(results), 1.0, 1500, 80)
    assert s.failed == 0 and s.completed == 12, s
    assert s.retried >= 1 and s.refused_by_reason.get("DRAINING", 0) >= 1, s
    assert await asyncio.to_thread(lambda: p1.status()["load"]["pending_kv"]) == 0
