"""Routing between refreshes (pd_router.routing.Fleet): the loads an engine reported a second
ago, plus what this router has sent it since. Without the tally every request of a second goes to
the engine that was least loaded at the refresh, and a fleet of two prefills queues on one at a time."""
from __future__ import annotations

import asyncio
import collections

import httpx

from pd_router.routing import Fleet, fixed_finder
from tests.unit.test_gateway_hardening import DECODER, LOAD, PREFILL

P1, P2, D = "10.0.0.1", "10.0.0.4", "10.0.0.2"


class Agents:
    def __init__(self, loads: dict[str, dict]):
        self.loads = loads
        linked = [{"name": "p0", "cluster_id": 1, "code": "LLM_SUCCESS"},
                  {"name": "p1", "cluster_id": 2, "code": "LLM_SUCCESS"}]
        self.status = {P1: PREFILL, P2: {**PREFILL, "pod": "p1", "cluster_id": 2, "ip": P2},
                       D: {**DECODER, "links": linked}}

    async def handle(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        return httpx.Response(200, json={**self.status[host], "load": {**LOAD, **self.loads.get(host, {})}})

    def fleet(self) -> Fleet:
        http = httpx.AsyncClient(transport=httpx.MockTransport(self.handle))
        return Fleet(http, None, fixed_finder([f"http://{h}:8080" for h in (P1, P2, D)]))


def test_requests_between_refreshes_spread_by_what_was_sent_not_all_to_the_least_loaded():
    agents = Agents({P1: {"queued_prompt_tokens": 0}, P2: {"queued_prompt_tokens": 3000, "queue_depth": 3}})
    fleet = agents.fleet()
    asyncio.run(fleet.refresh())
    picked = collections.Counter(fleet.pick_prefill(set(), 1000)["ip"] for _ in range(9))
    # p0 takes the first three (it then has what p1 reported), then they alternate
    assert picked == {P1: 6, P2: 3}


def test_a_refresh_keeps_only_what_was_sent_after_it_asked():
    agents = Agents({})
    fleet = agents.fleet()
    asyncio.run(fleet.refresh())
    for _ in range(4):
        fleet.pick_prefill(set(), 500)
    assert sum(n[1] for n in fleet.sent.values()) == 4
    # the engines' answers count what was sent before the refresh asked them
    agents.loads = {P1: {"queued_prompt_tokens": 1000, "queue_depth": 2},
                    P2: {"queued_prompt_tokens": 1000, "queue_depth": 2}}
    asyncio.run(fleet.refresh())
    assert fleet.sent == {}


def test_decoders_count_what_was_sent_them():
    agents = Agents({D: {"running": 2}})
    agents.status[P2] = {**agents.status[P1], "pod": "d1", "role": "decoder", "cluster_id": 1002, "ip": P2,
                         "links": agents.status[D]["links"]}
    fleet = agents.fleet()
    asyncio.run(fleet.refresh())
    p = fleet.pick_prefill(set(), 100)
    picked = collections.Counter(fleet.pick_decoder(p, set())["ip"] for _ in range(8))
    # d1 reported none running, d0 two: d1 takes two, then they alternate
    assert picked == {P2: 5, D: 3}
