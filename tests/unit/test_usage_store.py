"""The shared usage document against whoever else may write its ConfigMap (a tenant with edit
rights on ConfigMaps): a forged increase for another key, a reset to `{}`, a negative count, a
string count and a list for a day are ignored (the replica keeps its last good copy, counts the
rejection, says why) and the next sync writes the good copy back; counts never go down from
outside, except through an admin's signed reset; two replicas sharing one store count every
request once whatever a tenant does in between."""
from __future__ import annotations

import asyncio
import copy
import datetime as dt
import json
import random
import time
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest

from pd_gateway import usage as usage_mod
from pd_gateway.usage import DATA_KEY, ConfigMapStore, Conflict, MemoryStore, Usage
from tests.unit import test_gateway_shared
from tests.unit.test_gateway_hardening import KEY, OTHER
from tests.unit.test_gateway_shared import ADMIN, Clock, P, chat

shared = test_gateway_shared.shared   # the fixture: a gateway with two routes and three keys

DAY = "2026-12-03"
NOW = dt.datetime(2026, 12, 3, 12, 0, 30, tzinfo=dt.timezone.utc).timestamp()
SECRET = b"s" * 32


def c(requests: int, input_: int, output: int) -> dict:
    return {"requests": requests, "input": input_, "output": output}


GOOD = {"days": {DAY: {"team-a": {"m": c(10, 100, 50)}, "team-b": {"m": c(1, 10, 5)}}}, "minutes": {}}


def forge(store: MemoryStore, doc) -> None:
    """Another writer of the ConfigMap puts `doc` there (a new version, as the API server would)."""
    with store.lock:
        store.doc, store.version = doc, store.version + 1


def hostile(path: tuple, value) -> dict:
    doc = copy.deepcopy(GOOD)
    at = doc
    for k in path[:-1]:
        at = at[k]
    at[path[-1]] = value
    return doc


async def trusting(store: MemoryStore | None = None, **kw) -> tuple[MemoryStore, Usage]:
    """A replica that synced the good document: its last good copy."""
    store = store or MemoryStore()
    forge(store, copy.deepcopy(GOOD))
    u = Usage(store, **kw)
    await u.sync(NOW)
    assert u.tokens_today("team-a", NOW) == 150 and u.tokens_today("team-b", NOW) == 15
    return store, u


def stored(store: MemoryStore, key: str, model: str = "m") -> dict:
    return store.doc["days"][DAY][key][model]


# ---- a) to e): what a tenant with edit rights on the ConfigMap did --------------------------------

async def test_a_forged_increase_for_another_key_is_rejected_and_written_back():
    store, u = await trusting()
    forge(store, hostile(("days", DAY, "team-b", "m", "input"), 10**9))
    await u.sync(NOW + 3)
    assert u.tokens_today("team-b", NOW + 3) == 15, "the forged count reached team-b's quota"
    assert stored(store, "team-b") == c(1, 10, 5), "the forged document stayed"
    assert u.rejected["reason"] == "implausible_growth" and "team-b" in u.rejected["detail"]


@pytest.mark.parametrize("doc", [{}, {"days": {}, "minutes": {}}, hostile(("days", DAY, "team-a", "m", "input"), 1)],
                         ids=["empty", "no-days", "lowered"])
async def test_b_reset_or_lowered_count_gives_no_quota_back(doc):
    store, u = await trusting()
    forge(store, doc)
    await u.sync(NOW + 3)   # nothing counted here since: the repair is written all the same
    assert u.tokens_today("team-a", NOW + 3) == 150, "the reset gave quota back"
    assert stored(store, "team-a") == c(10, 100, 50) and stored(store, "team-b") == c(1, 10, 5)
    assert u.rejected["reason"] == "lowered" and "went from" in u.rejected["detail"]
    restarted = Usage(store)   # a replica started after the repair starts from the good counts
    await restarted.sync(NOW + 4)
    assert restarted.tokens_today("team-a", NOW + 4) == 150


async def test_c_negative_count_is_rejected():
    store, u = await trusting()
    forge(store, hostile(("days", DAY, "team-a", "m", "input"), -10**12))
    await u.sync(NOW + 3)
    assert u.tokens_today("team-a", NOW + 3) == 150, "a negative count went into the quota"
    assert stored(store, "team-a") == c(10, 100, 50)
    assert u.rejected["reason"] == "bad_count"


async def test_d_string_count_does_not_stop_the_sync():
    store, u = await trusting()
    forge(store, hostile(("days", DAY, "team-a", "m", "input"), "lots"))
    u.record("team-a", "m", 1, 1, NOW + 1)
    await u.sync(NOW + 3)
    assert stored(store, "team-a") == c(10, 100, 50), "the sync stopped at the string"
    assert u.error == "" and u.tokens_today("team-a", NOW + 3) == 152   # still counted here
    assert u.rejected["reason"] == "bad_count"
    assert any("usage document rejected" in p for p in u.problems(NOW + 3))
    await u.sync(NOW + 6)   # what was counted here goes onto the repaired document
    assert stored(store, "team-a") == c(11, 101, 51) and u.tokens_today("team-a", NOW + 6) == 152


async def test_e_list_for_today_neither_fails_a_restarted_replica_nor_loses_counts():
    store, u = await trusting()
    forge(store, hostile(("days", DAY), ["x"]))
    restarted = Usage(store)
    await restarted.sync(NOW + 1)
    assert restarted.tokens_today("team-a", NOW + 1) == 0   # no good copy yet: nothing, not a 500
    await u.sync(NOW + 2)       # the replica with a good copy writes it back
    assert stored(store, "team-a") == c(10, 100, 50)
    await restarted.sync(NOW + 3)
    assert restarted.tokens_today("team-a", NOW + 3) == 150


async def test_e_through_the_gateway_a_key_with_a_policy_is_served_and_healthz_stays_200(shared):
    store = MemoryStore()
    forge(store, {"days": {"2026-12-03": ["x"]}, "minutes": {}})
    s = await shared({"team-a": {"tokensPerDay": 1000}, "ops": {"admin": True}}, usage=Usage(store))
    await s.gw.usage.sync(s.gw.clock())   # as the gateway's start does
    r = await s.post("/v1/chat/completions", chat("llama-8b"))
    assert r.status_code == 200, r.text
    h = await s.http.get("/healthz")
    assert h.status_code == 200 and h.json()["ok"] is True
    assert any("usage document rejected" in e and "bad_shape" in e for e in h.json()["errors"]), h.json()
    metrics = generate_latest(s.gw.m.registry).decode()
    assert 'pd_gateway_usage_store_rejected_total{reason="bad_shape"} 1.0' in metrics
    report = (await s.http.get("/v1/usage", headers={"Authorization": f"Bearer {ADMIN}"})).json()
    assert report["store"]["rejected"]["reason"] == "bad_shape"


# ---- the schema ---------------------------------------------------------------------------------

@pytest.mark.parametrize("doc, reason", [
    ([], "bad_shape"),
    ({"days": {DAY: {"k": {"m": c(1, 1, 1)}}}, "extra": 1}, "bad_shape"),
    ({"days": {"2026-12-3": {}}}, "bad_shape"),
    ({"days": {"٢٠٢٦-١٢-٠٣": {}}}, "bad_shape"),            # digits, but not ASCII ones
    ({"days": {DAY: {"k": {"m": {"requests": 1, "input": 1}}}}}, "bad_shape"),
    ({"days": {DAY: {"k": {"m": {**c(1, 1, 1), "cached": 1}}}}}, "bad_shape"),
    ({"days": {DAY: {"k": {"m": c(1, True, 1)}}}}, "bad_count"),
    ({"days": {DAY: {"k": {"m": c(1, 1.5, 1)}}}}, "bad_count"),
    ({"days": {DAY: {"k": {"m": c(1, 2**60, 1)}}}}, "bad_count"),
    ({"days": {DAY: {"k" * 300: {"m": c(1, 1, 1)}}}}, "bad_shape"),
    ({"minutes": {"2026-12-03T12:00": {"k": -1}}}, "bad_count"),
    ({"minutes": {"noon": {"k": 1}}}, "bad_shape"),
    ({"days": {f"2026-11-{d:02}": {} for d in range(1, 30)}}, "too_large"),
    ({"days": {DAY: {f"k{i}": {"m": c(1, 1, 1)} for i in range(30_000)}}}, "too_large"),
    ({"resets": {DAY: {"k": {"at": 1, "mac": "not hex"}}}}, "bad_shape"),
])
def test_the_schema_rejects(doc, reason):
    with pytest.raises(usage_mod.Invalid) as e:
        usage_mod.check(doc)
    assert e.value.reason == reason


def test_the_schema_takes_what_the_gateway_writes():
    assert usage_mod.check({}) == usage_mod.empty()
    assert usage_mod.check(copy.deepcopy(GOOD))["days"] == GOOD["days"]
    mac = usage_mod.sign(SECRET, DAY, "k", 5)
    ok = {"days": {}, "minutes": {"2026-12-03T12:00": {"k": 3}}, "resets": {DAY: {"k": {"at": 5, "mac": mac}}},
          "reserved": {"r1": {"at": 7, "keys": {"k": 100}}}}
    assert usage_mod.check(ok) == ok


class FakeApi:
    """A CoreV1Api with one ConfigMap, whose data anyone may have edited."""

    def __init__(self, raw: str):
        self.raw, self.patched = raw, []

    def read_namespaced_config_map(self, name, namespace, **kw):
        return SimpleNamespace(data={DATA_KEY: self.raw}, metadata=SimpleNamespace(resource_version="7"))

    def patch_namespaced_config_map(self, name, namespace, body, **kw):
        self.patched.append(body)
        self.raw = body["data"][DATA_KEY]


def configmap_store(raw: str) -> ConfigMapStore:
    store = object.__new__(ConfigMapStore)
    store.api, store.client, store.namespace, store.name = FakeApi(raw), SimpleNamespace(), "t", "gw-usage"
    return store


@pytest.mark.parametrize("raw, reason", [("{", "not_json"), ("[" * 100000 + "]" * 100000, "not_json"),
                                         (json.dumps({"days": {}, "pad": "x" * (1 << 20)}), "too_large"),
                                         ("[1]", "bad_shape")])
async def test_the_configmap_store_rejects_what_is_not_a_document_and_writes_the_good_copy(raw, reason):
    store = configmap_store(json.dumps(GOOD))
    u = Usage(store)
    await u.sync(NOW)
    store.api.raw = raw
    u.record("team-a", "m", 1, 1, NOW + 1)
    await u.sync(NOW + 3)
    assert u.rejected["reason"] == reason and u.error == ""
    assert store.api.patched[-1]["metadata"]["resourceVersion"] == "7"   # over the bad one, not blindly
    assert json.loads(store.api.raw)["days"][DAY]["team-a"]["m"] == c(10, 100, 50)
    await u.sync(NOW + 6)
    assert json.loads(store.api.raw)["days"][DAY]["team-a"]["m"] == c(11, 101, 51)


# ---- growth bound: a forged increase is bounded, an honest one only delayed --------------------------

async def test_a_large_honest_flush_from_another_replica_is_at_worst_delayed():
    """Another replica could not write for a while and adds many tokens at once: over the bound
    it is rejected (and written over) until the time since the last good copy allows it; the
    other replica writes its counts again meanwhile, so nothing is lost."""
    store, a = await trusting()
    b = Usage(store)
    await b.sync(NOW)
    big = 10**8   # more than the bound allows within a minute
    b.record("team-a", "m", big, 0, NOW)
    await b.sync(NOW + 1)
    await a.sync(NOW + 3)
    assert a.rejected["reason"] == "implausible_growth" and a.tokens_today("team-a", NOW) == 150
    t = NOW + 3
    while a.tokens_today("team-a", t) == 150:
        t += 30
        await b.sync(t)   # b's counts are its own: it writes them back
        await a.sync(t)
        assert t < NOW + 3600
    assert a.tokens_today("team-a", t) == b.tokens_today("team-a", t) == 150 + big
    assert stored(store, "team-a")["input"] == 100 + big


# ---- an admin's reset ---------------------------------------------------------------------------

async def test_an_admin_reset_reaches_every_replica_despite_the_max_rule():
    store = MemoryStore()
    a, b = Usage(store, lambda: SECRET), Usage(store, lambda: SECRET)
    a.record("team-a", "m", 100, 50, NOW)
    b.record("team-a", "m", 10, 5, NOW)
    b.record("team-b", "m", 7, 7, NOW)
    for u in (a, b, a):
        await u.sync(NOW)
    assert a.tokens_today("team-a", NOW) == b.tokens_today("team-a", NOW) == 165
    a.reset("team-a", DAY, NOW + 1)
    assert a.tokens_today("team-a", NOW + 1) == 0    # here at once
    b.record("team-a", "m", 1, 1, NOW + 1)           # counted on b before it hears of it: kept
    await a.sync(NOW + 2)
    await b.sync(NOW + 3)
    assert b.tokens_today("team-a", NOW + 3) == 2, "b's last good copy undid the reset"
    await a.sync(NOW + 4)
    assert a.tokens_today("team-a", NOW + 4) == 2 and stored(store, "team-a") == c(1, 1, 1)
    assert a.tokens_today("team-b", NOW + 4) == b.tokens_today("team-b", NOW + 4) == 14
    # later syncs keep it (the marker is the same on both sides: counts merge as usual)
    a.record("team-a", "m", 3, 3, NOW + 5)
    for u in (a, b, a):
        await u.sync(NOW + 6)
    assert a.tokens_today("team-a", NOW + 6) == b.tokens_today("team-a", NOW + 6) == 8


async def test_a_reset_marker_a_tenant_wrote_is_ignored():
    store, u = await trusting(secret=lambda: SECRET)
    for mac in ("0" * 64, usage_mod.sign(b"guessed" * 5, DAY, "team-a", int(NOW * 1000) + 5)):
        doc = hostile(("days", DAY), {"team-b": {"m": c(1, 10, 5)}})   # team-a's counts gone...
        doc["resets"] = {DAY: {"team-a": {"at": int(NOW * 1000) + 5, "mac": mac}}}   # ...by a "reset"
        forge(store, doc)
        await u.sync(NOW + 3)
        assert u.tokens_today("team-a", NOW + 3) == 150
        assert stored(store, "team-a") == c(10, 100, 50) and not store.doc.get("resets")


async def test_a_replayed_genuine_marker_gives_nothing_back():
    store, u = await trusting(secret=lambda: SECRET)
    u.reset("team-a", DAY, NOW + 1)
    await u.sync(NOW + 1)
    replay = copy.deepcopy(store.doc)
    u.record("team-a", "m", 40, 2, NOW + 2)
    await u.sync(NOW + 2)
    forge(store, replay)   # the document as it was right after the reset: team-a's new counts gone
    await u.sync(NOW + 3)
    assert u.tokens_today("team-a", NOW + 3) == 42 and stored(store, "team-a") == c(1, 40, 2)


# ---- two replicas ------------------------------------------------------------------------------------

class SlowLoad(MemoryStore):
    """Reads take a moment: two replicas syncing at once read the same version, one conflicts."""

    conflicts = 0

    def load(self):
        got = super().load()
        time.sleep(0.002)
        return got

    def save(self, doc, version):
        try:
            super().save(doc, version)
        except Conflict:
            self.conflicts += 1
            raise


async def test_two_replicas_count_every_request_once_whatever_a_tenant_does_in_between():
    """Each replica adds only its own pending counts; max() is against its own last good copy,
    which is never above what the document held, so it cannot add another replica's counts twice.
    A tenant's reset or lowering in between is undone by the replicas' copies."""
    store = SlowLoad()
    a, b = Usage(store, lambda: SECRET), Usage(store, lambda: SECRET)
    rng = random.Random(3)
    want = {"team-a": 0, "team-b": 0}
    for i in range(40):
        for u in (a, b):
            for _ in range(rng.randrange(3)):
                key, n = rng.choice(sorted(want)), rng.randrange(1, 50)
                u.record(key, rng.choice(("m", "n")), n, 1, NOW)
                want[key] += n + 1
        if i == 15:
            forge(store, {})
        if i == 25:
            lowered = copy.deepcopy(store.doc)
            for models in lowered["days"][DAY].values():
                for counts in models.values():
                    counts.update(c(0, 0, 0))
            forge(store, lowered)
        await asyncio.gather(a.sync(NOW), b.sync(NOW))
        assert a.error == b.error == ""
    for u in (a, b, a):
        await u.sync(NOW)
    for key, n in want.items():
        assert a.tokens_today(key, NOW) == b.tokens_today(key, NOW) == n, key
        assert sum(m["input"] + m["output"] for m in store.doc["days"][DAY][key].values()) == n, key
    assert store.conflicts >= 10 and {a.rejected["reason"], b.rejected["reason"]} == {"lowered"}


# ---- through the gateway: DELETE /v1/usage/{key} ------------------------------------------------------

async def test_an_admin_key_resets_a_keys_day_and_another_key_may_not(shared):
    clock = Clock()
    s = await shared({"team-a": {"tokensPerDay": P + 4}, "ops": {"admin": True}}, clock=clock)
    assert (await s.post("/v1/chat/completions", chat("llama-8b"))).status_code == 200
    assert (await s.post("/v1/chat/completions", chat("llama-8b"))).status_code == 429
    for key in (KEY, OTHER):
        r = await s.http.delete("/v1/usage/team-a", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    admin = {"Authorization": f"Bearer {ADMIN}"}
    r = await s.http.delete("/v1/usage/team-a?day=yesterday", headers=admin)
    assert r.status_code == 400 and "YYYY-MM-DD" in r.json()["error"]["message"]
    assert (await s.http.delete("/v1/usage/" + "k" * 300, headers=admin)).status_code == 400
    r = await s.http.delete("/v1/usage/team-a", headers=admin)
    assert r.status_code == 200 and r.json()["day"] == "2026-12-03" and r.json()["key"] == "team-a"
    assert (await s.post("/v1/chat/completions", chat("llama-8b"))).status_code == 200
    report = (await s.http.get("/v1/usage", headers=admin)).json()
    assert report["usage"]["team-a"]["2026-12-03"]["llama-8b"]["requests"] == 1
    assert report["store"]["rejected"] is None
    assert "store" not in (await s.http.get("/v1/usage", headers={"Authorization": f"Bearer {KEY}"})).json()


async def test_a_reset_on_one_gateway_replica_frees_the_quota_on_the_other(shared):
    store = MemoryStore()
    policy = {"team-a": {"tokensPerDay": P + 4}, "ops": {"admin": True}}
    one, two = await shared(policy, usage=Usage(store)), await shared(policy, usage=Usage(store))
    assert (await one.post("/v1/chat/completions", chat("llama-8b"))).status_code == 200
    for gw in (one.gw, two.gw):
        await gw.usage.sync(gw.clock())
    assert (await two.post("/v1/chat/completions", chat("llama-8b"))).status_code == 429
    r = await one.http.delete("/v1/usage/team-a", headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200 and r.json()["error"] is None   # written before the answer
    await two.gw.usage.sync(two.gw.clock())
    assert (await two.post("/v1/chat/completions", chat("llama-8b"))).status_code == 200


# ---- replicas share their reservations; the whole document is signed --------------------------------

DOC_SECRET, ROTATED = b"d" * 32, b"r" * 32


async def test_reservations_of_requests_in_flight_are_shared_across_replicas():
    """Two replicas must not each admit a key's whole tokensPerDay for requests that outlast a sync."""
    store = MemoryStore()
    a, b = Usage(store, replica="a"), Usage(store, replica="b")
    a.reserve("team-a", 900)
    await a.sync(NOW)
    await b.sync(NOW + 1)
    assert b.tokens_today("team-a", NOW + 1) == 900, "replica b does not see a's request in flight"
    assert policy_refuses(b, 200, NOW + 1), "b admitted past the day's budget"
    assert b.tokens_today("team-b", NOW + 1) == 0
    # a long request: a writes its reservation again while it lasts, so b keeps counting it
    await a.sync(NOW + usage_mod.RESERVATION_REFRESH_S + 1)
    await b.sync(NOW + usage_mod.RESERVATION_TTL_S)
    assert b.tokens_today("team-a", NOW + usage_mod.RESERVATION_TTL_S) == 900
    # the request ends: a counts what it used and its reservation goes
    a.settle("team-a", 900)
    a.record("team-a", "m", 100, 50, NOW + 32)
    await a.sync(NOW + 32)
    await b.sync(NOW + 33)
    assert b.tokens_today("team-a", NOW + 33) == 150 and "a" not in store.doc["reserved"]
    # a replica that stopped writing (gone) is forgotten
    a.reserve("team-a", 500)
    await a.sync(NOW + 40)
    await b.sync(NOW + 41)
    assert b.tokens_today("team-a", NOW + 41) == 650
    assert b.tokens_today("team-a", NOW + 41 + usage_mod.RESERVATION_TTL_S) == 150


def policy_refuses(u: Usage, need: int, now: float) -> bool:
    from pd_gateway import policy
    p = policy.parse(json.dumps({"team-a": {"tokensPerDay": 1000}}))["team-a"]
    return policy.tokens_fit("team-a", p, now, u.tokens_today("team-a", now), need) is not None


async def test_a_forged_document_is_rejected_even_within_the_growth_bound():
    """An editor of the ConfigMap adds 50M tokens to a key 60 s later (within what the fleet could
    serve): without the gateway's keys they cannot sign it."""
    store = MemoryStore()
    a = Usage(store, doc_secret=lambda: DOC_SECRET, replica="a")
    a.record("team-b", "m", 10, 5, NOW)
    await a.sync(NOW)
    assert "mac" in store.doc
    doc = copy.deepcopy(store.doc)
    doc["days"][DAY]["team-b"]["m"]["input"] += 50_000_000
    forge(store, doc)
    await a.sync(NOW + 60)
    assert a.tokens_today("team-b", NOW + 60) == 15, "the forged count reached team-b's quota"
    assert a.rejected["reason"] == "bad_signature"
    assert stored(store, "team-b") == c(1, 10, 5) and usage_mod.verified(
        store.doc, usage_mod.check(store.doc), [DOC_SECRET], first=False) is None, "written back, signed"
    # reservations cannot be forged to lock a key out either
    doc = copy.deepcopy(store.doc)
    doc["reserved"]["x"] = {"at": int((NOW + 61) * 1000), "keys": {"team-b": 10**9}}
    forge(store, doc)
    await a.sync(NOW + 61)
    assert a.tokens_today("team-b", NOW + 61) == 15
    # an unsigned document is taken only at a replica's first load
    forge(store, {"days": {DAY: {"team-b": {"m": c(1, 10, 5)}}}, "minutes": {}})
    fresh = Usage(store, doc_secret=lambda: DOC_SECRET, replica="c")
    await fresh.sync(NOW + 62)
    assert fresh.tokens_today("team-b", NOW + 62) == 15 and fresh.rejected is None and "mac" in store.doc
    forge(store, {"days": {DAY: {"team-b": {"m": c(1, 10, 5)}}}, "minutes": {}})
    await fresh.sync(NOW + 63)
    assert fresh.rejected["reason"] == "unsigned"
    # a minute's count cannot be forged unsigned either (it would lock a key out of its requests per minute)
    fresh.rejected = None
    forge(store, {"minutes": {"2026-12-03T12:01": {"team-b": 600_000}}})
    await fresh.sync(NOW + 64)
    assert fresh.rejected["reason"] == "unsigned" and fresh.requests_this_minute("team-b", NOW + 64) == 0


async def test_a_key_rotation_keeps_the_counts_of_replicas_not_yet_reloaded():
    store = MemoryStore()
    secret = {"a": DOC_SECRET, "b": DOC_SECRET}
    a = Usage(store, doc_secret=lambda: secret["a"], replica="a")
    b = Usage(store, doc_secret=lambda: secret["b"], replica="b")
    a.record("team-a", "m", 100, 50, NOW)
    await a.sync(NOW)
    await b.sync(NOW + 1)
    secret["b"] = ROTATED   # b reloaded the keys first
    b.record("team-a", "m", 10, 5, NOW + 2)
    await b.sync(NOW + 2)   # b takes a's document (the previous keys') and signs with the new
    assert b.rejected is None and b.tokens_today("team-a", NOW + 2) == 165
    secret["a"] = ROTATED
    await a.sync(NOW + 3)
    assert a.rejected is None and a.tokens_today("team-a", NOW + 3) == 165


async def test_a_quiet_document_is_signed_again_after_a_rotation_and_a_new_replica_never_wipes_it():
    store = MemoryStore()
    secret = [DOC_SECRET]
    a = Usage(store, doc_secret=lambda: secret[0], replica="a")
    a.record("team-a", "m", 100, 50, NOW)
    await a.sync(NOW)
    secret[0] = ROTATED   # keys rotated; nothing counted since
    await a.sync(NOW + 3)
    assert usage_mod.verified(store.doc, usage_mod.check(store.doc), [ROTATED], first=False) is None, \
        "not signed again with the new keys"
    # a replica that never held the keys the document is signed with takes it at its first load
    forge(store, {**copy.deepcopy(store.doc), "mac": usage_mod.doc_mac(b"x" * 32, store.doc)})
    b = Usage(store, doc_secret=lambda: ROTATED, replica="b")
    await b.sync(NOW + 4)
    assert b.rejected is None and b.tokens_today("team-a", NOW + 4) == 150 and stored(store, "team-a") == c(1, 100, 50)
