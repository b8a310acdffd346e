"""Horizontal sharding: PDDeployments are spread over operator replicas by a consistent hash of
namespace/name into `shards` shards, each led through a Lease of its own (leader.Elector), so a
replica that dies moves only its shards and the others' passes go on undisturbed.

Balance without a coordinator: every replica renews a membership Lease (labelled with the
shards' Lease name), so each can count the live replicas and its fair share,
ceil(shards / live). Below its share a replica takes a free or expired shard at once; at its
share it waits a further lease duration (one below takes it first); above it, it hands its
newest shard back (stops acting, releases the Lease) for a replica below its share to take."""
from __future__ import annotations

import asyncio
import hashlib
import logging
import math
from collections.abc import Awaitable, Callable

from .kube import Kube, KubeError
from .leader import API, Elector, LeaseSettings, _micro
from .runtime import SYSTEM_CLOCK, Clock

log = logging.getLogger("pd_operator.shards")
Key = tuple[str, str]
LABEL_MEMBER_OF = "pdoperator.io/member-of"     # on membership Leases: the shards' Lease name


def shard_of(key: Key, shards: int) -> int:
    """Jump consistent hash (Lamping and Veach) of namespace/name: when the shard count changes
    from n to n+1 only 1/(n+1) of the deployments move."""
    if shards <= 1:
        return 0
    h = int.from_bytes(hashlib.sha256(f"{key[0]}/{key[1]}".encode()).digest()[:8], "big")
    b, j = -1, 0
    while j < shards:
        b = j
        h = (h * 2862933555777941757 + 1) % 2**64
        j = int((b + 1) * (2**31 / ((h >> 33) + 1)))
    return b


def lease_name(base: str, shard: int, shards: int) -> str:
    """One shard keeps the single leader's Lease name: turning sharding on or off is a rename."""
    return base if shards <= 1 else f"{base}-shard-{shard}"


class ShardElection:
    def __init__(self, kube: Kube, settings: LeaseSettings, shards: int,
                 on_started: Callable[[int], Awaitable[None]], on_stopped: Callable[[int], Awaitable[None]],
                 clock: Clock = SYSTEM_CLOCK):
        self.kube, self.s, self.shards, self.clock = kube, settings, shards, clock
        self.electors = [
            Elector(kube, LeaseSettings(name=lease_name(settings.name, i, shards), namespace=settings.namespace,
                                        lease_duration=settings.lease_duration,
                                        renew_deadline=settings.renew_deadline, retry_period=settings.retry_period,
                                        identity=settings.identity),
                    _bind(on_started, i), _bind(on_stopped, i), clock)
            for i in range(shards)]
        self.member = f"{settings.name}-member-{hashlib.sha256(settings.identity.encode()).hexdigest()[:10]}"
        self._seen: dict[str, tuple[str | None, float]] = {}   # member Lease -> (renewTime, first seen so)
        self._won: list[int] = []      # shards in the order this replica took them
        self._handed_back: dict[int, float] = {}   # shard -> not taken back before (monotonic)
        # replicas start campaigning at different shards, so simultaneous starts spread out
        self.offset = int(hashlib.sha256(settings.identity.encode()).hexdigest(), 16) % max(1, shards)

    def held(self) -> list[int]:
        return [i for i, e in enumerate(self.electors) if e.leading]

    async def run(self) -> None:
        log.info("%d shards on Leases %s-shard-*, as %s", self.shards, self.s.name, self.s.identity)
        while True:
            await self.round()
            await asyncio.sleep(self.s.retry_period)

    async def round(self) -> None:
        try:
            live = await asyncio.wait_for(self._members(), self.s.retry_period * 2)
        except Exception as err:  # noqa: BLE001 - the API server away: the shards' own rounds decide
            log.debug("membership round failed: %r", err)
            live = max(1, len(self.held()))
        fair = math.ceil(self.shards / max(1, live))
        now = self.clock.monotonic()
        # the shards held are renewed at once: one after another, a slow API server made a round
        # of four longer than the renew deadline, and shards were lost that nobody else wanted
        await asyncio.gather(*(e.round() for e in self.electors if e.leading))
        for j in range(self.shards):
            i = (self.offset + j) % self.shards
            e = self.electors[i]
            if e.leading:
                continue
            mine = len(self.held())
            await e.round(may_take=e.leading or (mine <= fair and now >= self._handed_back.get(i, 0.0)),
                          extra_wait=0.0 if mine < fair else self.s.lease_duration)
            if e.leading and i not in self._won:
                self._won.append(i)
            # a slow round (the API server away) must not keep any shard acting past its deadline
            for other in self.electors:
                await other.check_deadline()
        self._won = [i for i in self._won if self.electors[i].leading]
        if len(self._won) > fair:
            await self._hand_back(self._won[-1], fair)

    async def _hand_back(self, shard: int, fair: int) -> None:
        e = self.electors[shard]
        log.info("holding %d shards, a fair share is %d: shard %d handed back", len(self._won), fair, shard)
        await e.on_stopped()
        await e.release()
        # not taken back at once if the release failed or the count was off: a replica below its
        # share has time to take it
        self._handed_back[shard] = self.clock.monotonic() + 3 * self.s.lease_duration

    async def _members(self) -> int:
        """Renew this replica's membership Lease; the live replicas (membership renewed within a
        lease duration, by this clock: the records' times are not compared with it)."""
        now_wall, now = self.clock.time(), self.clock.monotonic()
        meta: dict = {"name": self.member, "namespace": self.s.namespace, "labels": {LABEL_MEMBER_OF: self.s.name}}
        body = {"apiVersion": API, "kind": "Lease", "metadata": meta,
                "spec": {"holderIdentity": self.s.identity, "renewTime": _micro(now_wall),
                         "leaseDurationSeconds": max(1, round(self.s.lease_duration))}}
        got = await self.kube.get(API, "Lease", self.s.namespace, self.member)
        if got is None:
            await self.kube.create(body)
        else:
            meta["resourceVersion"] = got["metadata"]["resourceVersion"]
            try:
                await self.kube.replace(body)
            except KubeError as err:
                if err.status != 409:
                    raise
        live = 0
        for lease in await self.kube.list(API, "Lease", self.s.namespace, f"{LABEL_MEMBER_OF}={self.s.name}"):
            name, renewed = lease["metadata"]["name"], (lease.get("spec") or {}).get("renewTime")
            seen = self._seen.get(name)
            if seen is None or seen[0] != renewed:
                self._seen[name] = seen = (renewed, now)
            if name == self.member or now - seen[1] < self.s.lease_duration:
                live += 1
            elif now - seen[1] > 10 * self.s.lease_duration:   # a replica long gone: its record goes
                await self.kube.delete(API, "Lease", self.s.namespace, name)
        return max(1, live)

    async def release(self) -> None:
        """On SIGTERM: every shard held handed back, and the membership withdrawn."""
        for e in self.electors:
            await e.release()
        try:
            await self.kube.delete(API, "Lease", self.s.namespace, self.member)
        except Exception as err:  # noqa: BLE001 - best effort: it stops counting after a lease duration
            log.warning("could not remove the membership Lease %s: %r", self.member, err)


def _bind(f: Callable[[int], Awaitable[None]], shard: int) -> Callable[[], Awaitable[None]]:
    async def call() -> None:
        await f(shard)
    return call
