"""Whatever answers the operator on an agent's port is the tenant's code: its answers are read with a
size cap and a total deadline, its strings bounded before they are kept, codes it invents folded into
one metric label, and a body nested too deep is a bad reply, never an error that fails the pass."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from pd_operator import agentclient
from pd_operator.agentclient import AgentClient
from pd_operator.reports import AgentCallError
from tests.unit.test_agentclient_cache import STATUS


def client(answer) -> AgentClient:
    return AgentClient(transport=httpx.MockTransport(answer))


async def test_an_answer_over_the_cap_is_refused_before_it_is_held(monkeypatch):
    monkeypatch.setattr(agentclient, "MAX_REPLY_BYTES", 1 << 20)
    sent = []

    async def chunks():
        for _ in range(64):          # 64 MiB, a MiB at a time: reading stops past the cap
            sent.append(1)
            yield b" " * (1 << 20)
    c = client(lambda request: httpx.Response(200, content=chunks()))
    with pytest.raises(AgentCallError) as e:
        await c.status("http://agent", "t")
    assert e.value.kind == "AgentBadReply" and "bytes" in str(e.value)
    assert len(sent) <= 3
    await c.close()


async def test_a_dripping_answer_meets_a_total_deadline(monkeypatch):
    monkeypatch.setattr(agentclient, "STATUS_TIMEOUT_S", 0.5)

    async def drip():
        for _ in range(100):
            await asyncio.sleep(0.1)   # never slow enough for a per-read timeout
            yield b" "
    c = client(lambda request: httpx.Response(200, content=drip()))
    t0 = time.monotonic()
    with pytest.raises(AgentCallError) as e:
        await c.status("http://agent", "t")
    assert e.value.kind == "AgentUnreachable" and "deadline" in str(e.value)
    assert time.monotonic() - t0 < 5
    await c.close()


async def test_nesting_too_deep_is_a_bad_reply():
    c = client(lambda request: httpx.Response(200, content=b"[" * 100000 + b"]" * 100000))
    with pytest.raises(AgentCallError) as e:
        await c.status("http://agent", "t")
    assert e.value.kind == "AgentBadReply"
    c2 = client(lambda request: httpx.Response(500, content=b'{"a":' * 50000))
    with pytest.raises(AgentCallError) as e:
        await c2.status("http://agent", "t")
    assert e.value.kind == "AgentError"
    await c.close()
    await c2.close()


async def test_long_strings_are_bounded_before_they_are_kept():
    big = {**STATUS, "last_error": "x" * (2 << 20), "device_error": "y" * 100000, "pod": "p" * 5000,
           "links": [{"name": "n" * 9000, "cluster_id": 1, "ip": "1.2.3.4", "port": 1, "code": "c" * 100000}],
           "ranks": [{"rank": 0, "cluster_id": 1, "last_error": "e" * 100000}], "proxy_env": {"k" * 9000: "v"}}
    c = client(lambda request: httpx.Response(200, content=json.dumps(big).encode()))
    st = await c.status("http://agent", "t")
    assert len(st.last_error) <= agentclient.MAX_STRING and len(st.device_error) <= agentclient.MAX_STRING
    assert st.last_error.endswith("(cut)")
    nested = [st.links[0].name, st.links[0].code, st.ranks[0].last_error, *st.proxy_env]
    assert all(len(x) <= agentclient.MAX_STRING for x in nested), [len(x) for x in nested]
    assert all(len(body) <= agentclient.MAX_CACHED_BODY for body, _ in c._statuses.values())
    await c.close()


def test_link_codes_an_agent_invents_are_one_label():
    assert agentclient.code_label("LLM_LINK_FAILED") == "LLM_LINK_FAILED"
    assert agentclient.code_label("LLM_SUCCESS") == "LLM_SUCCESS"
    assert {agentclient.code_label(f"MADE_UP_{i}") for i in range(1000)} == {"OTHER"}


async def test_a_status_listing_more_links_than_a_pod_can_hold_is_a_bad_reply():
    from pd_contract.agent_api import MAX_STATUS_LINKS
    links = [{"name": f"p{i}", "cluster_id": i, "code": "LLM_SUCCESS"} for i in range(MAX_STATUS_LINKS + 1)]
    c = client(lambda request: httpx.Response(200, json={**STATUS, "links": links}))
    with pytest.raises(AgentCallError) as e:
        await c.status("http://agent", "t")
    assert e.value.kind == "AgentBadReply"
    await c.close()
