"""An agent that answers the same status body is not validated again: the same report comes back."""
from __future__ import annotations

import json

import httpx

from pd_operator.agentclient import AgentClient

STATUS = {"pod": "d0", "role": "decoder", "cluster_id": 1000, "boot_id": "b", "backend": "sim",
          "initialized": True, "ip": "127.0.0.1", "port": 26000, "model_id": 0}


async def test_an_unchanged_status_body_gives_the_same_report_and_a_changed_one_a_new_one():
    bodies = [STATUS, STATUS, {**STATUS, "draining": True}]

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=json.dumps(bodies.pop(0)).encode())
    client = AgentClient(transport=httpx.MockTransport(answer))
    a = await client.status("http://agent", "t")
    b = await client.status("http://agent", "t")
    c = await client.status("http://agent", "t")
    assert a is b, "the same bytes: the report already validated"
    assert c is not b and c.draining and not b.draining
    await client.close()
