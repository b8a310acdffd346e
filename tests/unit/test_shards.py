"""Sharding: a consistent hash spreads deployments over shards, and replicas share the shards'
Leases fairly without a coordinator; a replica that dies moves only its shards."""
from __future__ import annotations

import collections
import copy

from pd_operator.kube import KubeError
from pd_operator.leader import LeaseSettings
from pd_operator.shards import ShardElection, lease_name, shard_of


class Leases:
    """get/create/replace/list/delete over the Leases of one namespace, resourceVersion checked."""

    def __init__(self):
        self.items: dict[str, dict] = {}
        self.rv = 0

    def _stored(self, body: dict) -> dict:
        self.rv += 1
        obj = copy.deepcopy(body)
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self.items[obj["metadata"]["name"]] = obj
        return copy.deepcopy(obj)

    async def get(self, api, kind, ns, name):
        return copy.deepcopy(self.items.get(name))

    async def create(self, body):
        return None if body["metadata"]["name"] in self.items else self._stored(body)

    async def replace(self, body):
        cur = self.items.get(body["metadata"]["name"])
        if cur is None or cur["metadata"]["resourceVersion"] != body["metadata"].get("resourceVersion"):
            raise KubeError(409, "conflict", "replace Lease")
        return self._stored(body)

    async def list(self, api, kind, ns, selector=""):
        k, _, v = selector.partition("=")
        return [copy.deepcopy(o) for o in self.items.values() if (o["metadata"].get("labels") or {}).get(k) == v]

    async def delete(self, api, kind, ns, name):
        self.items.pop(name, None)

    def holders(self, shards: int) -> list[str]:
        return [(self.items.get(lease_name("op", i, shards)) or {}).get("spec", {}).get("holderIdentity", "")
                for i in range(shards)]


class Clock:
    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return 1.8e9 + self.now


class Replica:
    def __init__(self, kube: Leases, clock: Clock, name: str, shards: int):
        self.led: set[int] = set()

        async def started(i: int) -> None:
            self.led.add(i)

        async def stopped(i: int) -> None:
            self.led.discard(i)
        self.election = ShardElection(kube, LeaseSettings(name="op", namespace="ns", identity=name), shards,
                                      started, stopped, clock=clock)   # type: ignore[arg-type]


async def rounds(replicas: list[Replica], clock: Clock, n: int) -> None:
    for _ in range(n):
        for r in replicas:
            await r.election.round()
        clock.now += 2.0      # the retry period


def test_shard_of_is_stable_spread_and_moves_little_when_shards_are_added():
    keys = [("ns", f"d{i}") for i in range(2000)]
    four = [shard_of(k, 4) for k in keys]
    assert four == [shard_of(k, 4) for k in keys] and set(four) == {0, 1, 2, 3}
    assert min(collections.Counter(four).values()) > 400, "about a quarter each"
    moved = sum(a != shard_of(k, 5) for a, k in zip(four, keys))
    assert 300 < moved < 500, f"about a fifth move from 4 to 5 shards, not most: {moved}"
    assert all(shard_of(k, 1) == 0 for k in keys[:10])
    assert lease_name("op", 0, 1) == "op" and lease_name("op", 2, 4) == "op-shard-2"


async def test_four_replicas_take_a_shard_each_and_a_dead_ones_shard_alone_moves():
    kube, clock = Leases(), Clock()
    reps = [Replica(kube, clock, f"r{i}", 4) for i in range(4)]
    await rounds(reps, clock, 20)
    assert sorted(len(r.led) for r in reps) == [1, 1, 1, 1], [r.led for r in reps]
    before = kube.holders(4)
    assert sorted(before) == ["r0", "r1", "r2", "r3"]
    dead = reps.pop(1)                       # killed: it renews nothing any more
    await rounds(reps, clock, 20)            # 40 s: its Leases (15 s) expire
    after = kube.holders(4)
    moved = [i for i in range(4) if before[i] != after[i]]
    assert moved == sorted(dead.led), f"only the dead replica's shard moves: {before} -> {after}"
    assert all(h != "r1" for h in after) and sorted(len(r.led) for r in reps) == [1, 1, 2]


async def test_a_replica_that_joins_gets_its_share_handed_back_to_it():
    kube, clock = Leases(), Clock()
    reps = [Replica(kube, clock, f"r{i}", 4) for i in range(2)]
    await rounds(reps, clock, 20)
    assert sorted(len(r.led) for r in reps) == [2, 2]
    reps += [Replica(kube, clock, f"r{i}", 4) for i in (2, 3)]
    await rounds(reps, clock, 30)
    assert sorted(len(r.led) for r in reps) == [1, 1, 1, 1], [r.led for r in reps]
    assert sorted(kube.holders(4)) == ["r0", "r1", "r2", "r3"]
    held = [set(r.led) for r in reps]
    await rounds(reps, clock, 30)
    assert [set(r.led) for r in reps] == held, "settled: nothing moves while nothing changes"


async def test_a_stopping_replica_hands_its_shards_back_at_once():
    kube, clock = Leases(), Clock()
    reps = [Replica(kube, clock, f"r{i}", 2) for i in range(2)]
    await rounds(reps, clock, 10)
    gone = reps.pop(0)
    await gone.election.release()
    assert not any(n.startswith("op-member") and n.endswith(gone.election.member[-10:]) for n in kube.items)
    await rounds(reps, clock, 2)            # not a lease duration: it was released, not expired
    assert reps[0].led == {0, 1}


async def test_a_shard_handed_back_is_not_renewed_even_if_its_release_failed():
    kube, clock = Leases(), Clock()
    reps = [Replica(kube, clock, "r0", 2)]
    await rounds(reps, clock, 5)
    assert reps[0].led == {0, 1}

    async def failing_replace(body):
        raise KubeError(500, "away", "replace Lease")
    e = reps[0].election
    good, kube.replace = kube.replace, failing_replace
    await e._hand_back(1, fair=1)               # stops acting; the release's write fails
    kube.replace = good
    await rounds(reps, clock, 3)
    assert reps[0].led == {0}, "not taken back at once"
    await rounds(reps, clock, 30)               # no one else: after the hold it is taken again
    assert reps[0].led == {0, 1}
