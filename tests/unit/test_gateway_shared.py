"""A gateway shared by several deployments, in process: requests route by model (aliases too),
keys are scoped to models, limited per minute and per UTC day, expire, and their usage is
counted across replicas through one shared document."""
from __future__ import annotations

import asyncio
import datetime as dt
import json

import pytest
from aiohttp import web

from pd_contract import tokens
from pd_gateway import policy
from pd_gateway.keys import Keys
from pd_gateway.server import Config, Gateway, Route
from pd_gateway.usage import Conflict, MemoryStore, Usage, add
from tests.unit.test_gateway_hardening import DECODER, KEY, OTHER, PREFILL, FakeAgents, Served

ADMIN = "sk-admin-key-0123456789"
NOW = dt.datetime(2026, 12, 3, 23, 59, 0, tzinfo=dt.timezone.utc).timestamp()


class Clock:
    def __init__(self, t: float = NOW):
        self.t = t

    def __call__(self) -> float:
        return self.t


def second_fleet() -> FakeAgents:
    a = FakeAgents()
    a.status = {"10.0.1.1": {**PREFILL, "ip": "10.0.1.1"}, "10.0.1.2": {**DECODER, "ip": "10.0.1.2"}}
    return a


@pytest.fixture
async def shared():
    made: list[tuple[Served, web.AppRunner]] = []

    async def make(key_policy: dict | None = None, usage: Usage | None = None, clock: Clock | None = None,
                   empty_second: bool = False) -> Served:
        a, b = FakeAgents(), second_fleet()
        if empty_second:
            b.status = {}
        routes = [Route("llama-8b", a.fleet(), "sim-a", ("llama",)), Route("qwen-7b", b.fleet(), "sim-b")]
        keys = Keys(lambda: {"team-a": KEY, "team-b": OTHER, "ops": ADMIN})
        keys.refresh()
        cfg = Config(model="", namespace="t", key_policy=policy.parse(None) if key_policy is None else {
            k: policy.KeyPolicy.from_dict(v) for k, v in key_policy.items()}, routes=[])
        gw = Gateway(cfg, keys, routes=routes, usage=usage, clock=clock or Clock())
        for r in routes:
            await r.fleet.refresh()
        runner = gw.runner()
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        s = Served(gw, a, f"http://127.0.0.1:{port}", port)
        s.second = b
        made.append((s, runner))
        return s
    yield make
    for s, runner in made:
        await s.gw.stop()
        await s.http.aclose()
        for r in s.gw.routes:
            await r.fleet.http.aclose()
        await runner.cleanup()


def chat(model: str, n: int = 4) -> dict:
    return {"model": model, "max_tokens": n, "messages": [{"role": "user", "content": "x" * 40}]}


P = tokens.count("user: " + "x" * 40)   # chat()'s prompt tokens (9)


async def test_requests_route_by_model_and_alias(shared):
    s = await shared()
    for model, agents in (("llama-8b", s.agents), ("llama", s.agents), ("qwen-7b", s.second)):
        before = agents.calls["/v1/decode"]
        r = await s.post("/v1/chat/completions", chat(model))
        assert r.status_code == 200, r.text
        assert r.json()["model"] == ("qwen-7b" if model == "qwen-7b" else "llama-8b")
        assert agents.calls["/v1/decode"] == before + 1
    models = (await s.http.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})).json()
    assert [m["id"] for m in models["data"]] == ["llama-8b", "llama", "qwen-7b"]
    r = await s.post("/v1/chat/completions", chat("gpt-4o"))
    assert r.status_code == 404
    assert "'llama-8b' (aliases 'llama'), 'qwen-7b'" in r.json()["error"]["message"]


async def test_a_known_model_with_no_serving_pair_is_503_naming_it(shared):
    s = await shared(empty_second=True)
    r = await s.post("/v1/chat/completions", chat("qwen-7b"))
    assert r.status_code == 503
    assert "model 'qwen-7b' (deployment sim-b)" in r.json()["error"]["message"]
    assert (await s.post("/v1/chat/completions", chat("llama-8b"))).status_code == 200


async def test_a_key_scoped_to_one_model_gets_403_on_another(shared):
    s = await shared({"team-a": {"models": ["llama-8b"]}})
    assert (await s.post("/v1/chat/completions", chat("llama"))).status_code == 200   # its alias too
    r = await s.post("/v1/chat/completions", chat("qwen-7b"))
    assert r.status_code == 403
    assert r.json()["error"]["message"].startswith("model not allowed for this key")
    r = await s.post("/v1/messages", chat("qwen-7b"), api="anthropic")
    assert r.status_code == 403 and r.json()["type"] == "error"
    assert (await s.post("/v1/chat/completions", chat("qwen-7b"), key=OTHER)).status_code == 200


@pytest.mark.parametrize("limits, first_n, status, says", [
    ({"requestsPerMinute": 2}, 2, 429, "requestsPerMinute 2"),
    # each request: P (9) prompt tokens + 4 output tokens, reserved at admission: the third needs 39 > 26
    ({"tokensPerDay": 26}, 2, 429, "tokensPerDay 26"),
])
async def test_quotas_refuse_with_the_limit_and_retry_after(shared, limits, first_n, status, says):
    s = await shared({"team-a": limits})
    for _ in range(first_n):
        assert (await s.post("/v1/chat/completions", chat("llama-8b"))).status_code == 200
    r = await s.post("/v1/chat/completions", chat("llama-8b"))
    assert r.status_code == status
    assert says in r.json()["error"]["message"]
    assert int(r.headers["Retry-After"]) == 60   # NOW is 23:59:00 UTC: the minute and the day end together
    if "tokensPerDay" in limits:
        assert "resets at 2026-12-04T00:00:00Z" in r.json()["error"]["message"]
    assert (await s.post("/v1/chat/completions", chat("llama-8b"), key=OTHER)).status_code == 200


async def test_the_day_quota_resets_at_utc_midnight(shared):
    clock = Clock()
    s = await shared({"team-a": {"tokensPerDay": P + 4}}, clock=clock)
    assert (await s.post("/v1/chat/completions", chat("llama-8b"))).status_code == 200
    assert (await s.post("/v1/chat/completions", chat("llama-8b"))).status_code == 429
    clock.t += 61
    assert (await s.post("/v1/chat/completions", chat("llama-8b"))).status_code == 200


async def test_a_day_quota_holds_under_concurrent_requests(shared):
    """Each request reserves its prompt and max_tokens at admission: of ten sent at once with room
    for two, two are served and eight refused before any engine work, however the engines pace them."""
    s = await shared({"team-a": {"tokensPerDay": 2 * (P + 4) + 1}})
    hold = s.agents.hold = asyncio.Event()
    sent = [asyncio.create_task(s.post("/v1/chat/completions", chat("llama-8b"))) for _ in range(10)]
    await asyncio.sleep(0.3)
    hold.set()
    codes = sorted(r.status_code for r in await asyncio.gather(*sent))
    assert codes == [200] * 2 + [429] * 8, codes
    assert s.gw.usage.tokens_today("team-a", NOW) == 2 * (P + 4) and not s.gw.usage.reserved


async def test_an_expired_key_is_401_saying_so(shared):
    s = await shared({"team-a": {"expires": "2026-12-01T00:00:00Z"}})
    r = await s.post("/v1/chat/completions", chat("llama-8b"))
    assert r.status_code == 401
    assert "expired at 2026-12-01T00:00:00+00:00" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "expired_api_key"


async def test_usage_own_for_a_key_everyone_for_an_admin(shared):
    s = await shared({"ops": {"admin": True}})
    for model in ("llama-8b", "llama-8b", "qwen-7b"):
        assert (await s.post("/v1/chat/completions", chat(model))).status_code == 200
    assert (await s.post("/v1/chat/completions", chat("qwen-7b", 2), key=OTHER)).status_code == 200
    own = (await s.http.get("/v1/usage", headers={"Authorization": f"Bearer {KEY}"})).json()
    assert own["usage"] == {"team-a": {"2026-12-03": {
        "llama-8b": {"requests": 2, "input": 2 * P, "output": 8}, "qwen-7b": {"requests": 1, "input": P, "output": 4}}}}
    everyone = (await s.http.get("/v1/usage", headers={"Authorization": f"Bearer {ADMIN}"})).json()
    assert set(everyone["usage"]) == {"team-a", "team-b"} and everyone["admin"] is True
    assert everyone["usage"]["team-b"]["2026-12-03"]["qwen-7b"] == {"requests": 1, "input": P, "output": 2}


# ---- the shared document ----------------------------------------------------------------------

async def test_two_replicas_hold_one_quota_after_a_sync():
    store = MemoryStore()
    a, b = Usage(store), Usage(store)
    a.record("team-a", "m", 10, 5, NOW)
    b.record("team-a", "m", 20, 5, NOW)
    assert a.tokens_today("team-a", NOW) == 15
    await a.sync(NOW)
    await b.sync(NOW)
    await a.sync(NOW)
    assert a.tokens_today("team-a", NOW) == b.tokens_today("team-a", NOW) == 40
    assert store.doc["days"]["2026-12-03"]["team-a"]["m"] == {"requests": 2, "input": 30, "output": 10}
    # a restarted replica starts from the shared counts
    c = Usage(store)
    await c.sync(NOW)
    assert c.tokens_today("team-a", NOW) == 40


class Flaky(MemoryStore):
    """Conflicts `conflicts` times (another replica wrote first), then fails `failures` times."""

    def __init__(self, conflicts: int = 0, failures: int = 0):
        super().__init__()
        self.conflicts, self.failures = conflicts, failures

    def save(self, doc, version):
        if self.conflicts:
            self.conflicts -= 1
            self.doc = add(self.doc, {"days": {"2026-12-03": {"team-b": {"m": {"requests": 1, "input": 1,
                                                                              "output": 1}}}}})
            self.version += 1
            raise Conflict("changed")
        if self.failures:
            self.failures -= 1
            raise OSError("API server away")
        super().save(doc, version)


async def test_a_conflict_re_reads_and_adds_again_nothing_lost_or_doubled():
    store = Flaky(conflicts=2)
    u = Usage(store)
    u.record("team-a", "m", 10, 5, NOW)
    await u.sync(NOW)
    days = store.doc["days"]["2026-12-03"]
    assert days["team-a"]["m"] == {"requests": 1, "input": 10, "output": 5}
    assert days["team-b"]["m"]["requests"] == 2


async def test_a_failed_sync_keeps_the_counts_for_the_next():
    store = Flaky(failures=1)
    u = Usage(store)
    u.record("team-a", "m", 10, 5, NOW)
    await u.sync(NOW)
    assert "API server away" in u.error and store.doc["days"] == {}
    assert u.tokens_today("team-a", NOW) == 15     # still counted for quotas meanwhile
    u.record("team-a", "m", 1, 1, NOW)
    await u.sync(NOW)
    assert store.doc["days"]["2026-12-03"]["team-a"]["m"] == {"requests": 2, "input": 11, "output": 6}
    assert u.error == ""


async def test_nothing_counted_nothing_written_and_a_cancelled_sync_keeps_its_counts():
    class Counting(MemoryStore):
        saves = 0

        def save(self, doc, version):
            import time
            time.sleep(0.05)
            Counting.saves += 1
            super().save(doc, version)
    store = Counting()
    u = Usage(store)
    await u.sync(NOW)
    assert Counting.saves == 0 and u.synced_at == NOW
    u.record("team-a", "m", 5, 5, NOW)
    task = asyncio.create_task(u.sync(NOW))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert u.tokens_today("team-a", NOW) == 10 and u.pending["days"]


async def test_counts_recorded_during_a_sync_are_kept():
    class Slow(MemoryStore):
        def save(self, doc, version):
            import time
            time.sleep(0.05)
            super().save(doc, version)
    u = Usage(Slow())
    u.record("team-a", "m", 1, 1, NOW)
    task = asyncio.create_task(u.sync(NOW))
    await asyncio.sleep(0.01)
    u.record("team-a", "m", 1, 1, NOW)
    assert u.tokens_today("team-a", NOW) == 4
    await task
    assert u.tokens_today("team-a", NOW) == 4
    await u.sync(NOW)
    assert u.store.doc["days"]["2026-12-03"]["team-a"]["m"]["requests"] == 2


def test_a_bad_key_policy_is_an_error_but_a_bad_expiry_only_refuses_that_key():
    with pytest.raises(ValueError, match="must be a JSON object"):
        policy.parse('["a"]')
    for expires in ("tomorrow", "0000-01-01T00:00:00Z"):
        p = policy.parse(json.dumps({"k": {"expires": expires}}))["k"]
        assert policy.expired("k", p, NOW).status == 401


async def test_quotas_count_completions_only_and_a_cut_stream_counts_its_tokens(shared):
    s = await shared({"team-a": {"tokensPerDay": 40, "requestsPerMinute": 3}})
    for _ in range(5):   # reading models and usage is free
        assert (await s.http.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})).status_code == 200
    async with s.http.stream("POST", "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                             json={**chat("llama-8b", 30), "stream": True}) as r:
        async for line in r.aiter_lines():
            if '"content":"' in line and '"content":""' not in line:
                break   # the client leaves after its first token
    await asyncio.sleep(0.2)
    assert s.gw.usage.tokens_today("team-a", NOW) >= P + 1
    r = await s.http.get("/v1/usage", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.json()["usage"]["team-a"]["2026-12-03"]["llama-8b"]["requests"] == 1


async def test_a_key_may_list_an_alias_and_an_empty_list_allows_nothing(shared):
    s = await shared({"team-a": {"models": ["llama"]}, "team-b": {"models": []}})
    assert (await s.post("/v1/chat/completions", chat("llama-8b"))).status_code == 200
    assert (await s.post("/v1/chat/completions", chat("qwen-7b"))).status_code == 403
    r = await s.post("/v1/chat/completions", chat("llama-8b"), key=OTHER)
    assert r.status_code == 403 and "may use no model" in r.json()["error"]["message"]


async def test_the_responses_api_as_codex_and_the_sdk_use_it(shared):
    """Codex speaks only the Responses API: the text streams as output_text deltas, and the
    message item and `response.completed` (with usage) close it."""
    import httpx
    import openai
    s = await shared()
    async with httpx.AsyncClient(trust_env=False) as http:
        c = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key=KEY, http_client=http)
        r = await c.responses.create(model="qwen-7b", input="hello", max_output_tokens=5)
        assert r.output_text and r.usage.output_tokens == 5 and r.model == "qwen-7b"
        stream = await c.responses.create(
            model="llama", instructions="be brief", max_output_tokens=3, stream=True,
            input=[{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}])
        events = [e async for e in stream]
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert types.count("response.output_text.delta") == 3
    done = next(e for e in events if e.type == "response.output_item.done")
    assert done.item.content[0].text == "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].response.usage.output_tokens == 3
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))
    bad = await s.post("/v1/responses", {"model": "qwen-7b", "input": 5})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"
