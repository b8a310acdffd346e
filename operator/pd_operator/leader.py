"""Leader election on a coordination.k8s.io Lease, as client-go's leaderelection does it:
only the leader runs passes; every replica keeps watching, so a standby takes over with warm
caches.

- The record's times are never compared with this clock: a standby notes when it last saw
  the record change (holder, renew time, transitions) and takes the Lease only once it stayed
  the same for a whole lease duration.
- The leader renews every retry period; if it cannot renew for a renew deadline (the API
  server away, a write conflict it lost) it stops acting before any standby may take over
  (renew deadline < lease duration), then campaigns again. It never exits for that: an outage
  must not become a crash loop.
- Writes carry the resourceVersion read, so two candidates cannot both win one round.
- Stopping (SIGTERM) releases the Lease: the standby takes it at its next retry."""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone

from .kube import Kube, KubeError
from .runtime import SYSTEM_CLOCK, Clock

log = logging.getLogger("pd_operator.leader")
API = "coordination.k8s.io/v1"


def _micro(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def identity() -> str:
    """Pod name (or host) plus a random suffix, so two processes on one host differ."""
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}_{secrets.token_hex(4)}"


@dataclass
class LeaseSettings:
    name: str = "pd-operator-leader"
    namespace: str = "default"
    lease_duration: float = 15.0     # client-go's defaults
    renew_deadline: float = 10.0
    retry_period: float = 2.0
    identity: str = field(default_factory=identity)

    @classmethod
    def from_env(cls, env: dict[str, str] | os._Environ = os.environ) -> LeaseSettings | None:
        """PD_OPERATOR_LEADER_ELECTION=true turns it on (the chart does); the rest tunes it."""
        if env.get("PD_OPERATOR_LEADER_ELECTION", "").lower() not in ("1", "true", "yes"):
            return None
        s = cls(name=env.get("PD_OPERATOR_LEASE_NAME") or cls.name,
                namespace=env.get("PD_OPERATOR_LEASE_NAMESPACE") or env.get("POD_NAMESPACE") or cls.namespace,
                lease_duration=float(env.get("PD_OPERATOR_LEASE_DURATION_S") or cls.lease_duration),
                renew_deadline=float(env.get("PD_OPERATOR_RENEW_DEADLINE_S") or cls.renew_deadline),
                retry_period=float(env.get("PD_OPERATOR_RETRY_PERIOD_S") or cls.retry_period))
        if not s.retry_period < s.renew_deadline < s.lease_duration:
            raise ValueError("leader election needs retry period < renew deadline < lease duration "
                             f"(got {s.retry_period}, {s.renew_deadline}, {s.lease_duration})")
        return s


def held_for(written, configured: float) -> float:
    """How long a record another holder wrote keeps this candidate waiting: its duration, never
    more than this operator's own. Anyone who may update Leases here could otherwise write a
    duration of decades and stop every replica for good."""
    try:
        d = float(written)
    except (TypeError, ValueError):
        return configured
    return min(d, configured) if d > 0 else configured


class Elector:
    def __init__(self, kube: Kube, settings: LeaseSettings, on_started: Callable[[], Awaitable[None]],
                 on_stopped: Callable[[], Awaitable[None]], clock: Clock = SYSTEM_CLOCK):
        self.kube = kube
        self.clock = clock
        self.s = settings
        self.on_started = on_started
        self.on_stopped = on_stopped
        self.leading = False
        self.transitions = 0
        self._observed: tuple | None = None     # the record as last seen (holder, renewTime, transitions)
        self._observed_at = 0.0                 # when it was first seen so, by this clock
        self._renewed_at = 0.0

    def _lease(self, prev: dict | None, now: float, acquire: bool) -> dict:
        spec = dict((prev or {}).get("spec") or {})
        if acquire:
            spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + (1 if prev else 0)
            spec["acquireTime"] = _micro(now)
        spec.update(holderIdentity=self.s.identity, leaseDurationSeconds=max(1, round(self.s.lease_duration)),
                    renewTime=_micro(now))
        meta = {"name": self.s.name, "namespace": self.s.namespace}
        if prev:
            meta["resourceVersion"] = prev["metadata"]["resourceVersion"]
        return {"apiVersion": API, "kind": "Lease", "metadata": meta, "spec": spec}

    @property
    def holder(self) -> str:
        """The holder as last read ("" if none or not read yet)."""
        return self._observed[0] if self._observed else ""

    async def try_acquire_or_renew(self, may_take: bool = True, extra_wait: float = 0.0) -> bool:
        """One round; True if this process holds the Lease after it. `may_take` False: renew only;
        `extra_wait`: a Lease free or expired is taken only once it stayed so that much longer
        (shards: a replica with its share leaves a free shard to one without)."""
        now_wall, now = self.clock.time(), self.clock.monotonic()
        lease = await self.kube.get(API, "Lease", self.s.namespace, self.s.name)
        if lease is None:
            if not may_take:
                return False
            got = await self.kube.create(self._lease(None, now_wall, acquire=True))
            return got is not None   # None: another candidate created it first
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        record = (holder, spec.get("renewTime"), spec.get("leaseTransitions"))
        if record != self._observed:
            self._observed, self._observed_at = record, now
        if not may_take and (holder != self.s.identity or not self.leading):
            return False    # (a Lease handed back whose release did not get through is not renewed)
        if holder != self.s.identity:
            duration = held_for(spec.get("leaseDurationSeconds"), self.s.lease_duration) if holder else 0.0
            if now - self._observed_at < duration + extra_wait:
                return False    # held, and renewed within its duration as far as this clock can tell
        try:
            await self.kube.replace(self._lease(lease, now_wall, acquire=holder != self.s.identity))
        except KubeError as e:
            if e.status == 409:
                return False    # someone wrote it since it was read: they won this round
            raise
        return True

    async def run(self) -> None:
        """Campaign, lead, lose, campaign again: until cancelled."""
        log.info("leader election on Lease %s/%s as %s", self.s.namespace, self.s.name, self.s.identity)
        while True:
            await self.round()
            await asyncio.sleep(self.s.retry_period)

    async def round(self, may_take: bool = True, extra_wait: float = 0.0) -> bool:
        """One round and what follows from it: acting starts when the Lease is won, stops when it
        could not be renewed for the renew deadline. True while leading."""
        try:
            held = await asyncio.wait_for(self.try_acquire_or_renew(may_take, extra_wait), self.s.retry_period * 2)
        except Exception as e:  # noqa: BLE001 - the API server may be away: not leading this round
            log.debug("lease round failed: %r", e)
            held = False
        if held:
            self._renewed_at = self.clock.monotonic()
            if not self.leading:
                self.leading = True
                self.transitions += 1
                log.info("became the leader on Lease %s (%s)", self.s.name, self.s.identity)
                await self.on_started()
        else:
            await self.check_deadline()
        return self.leading

    async def check_deadline(self) -> None:
        """Stop acting once the Lease could not be renewed for the renew deadline (before anyone
        else may take it: renew deadline < lease duration)."""
        if self.leading and self.clock.monotonic() - self._renewed_at > self.s.renew_deadline:
            self.leading = False
            log.warning("could not renew the Lease %s for %.0fs: stopped acting, campaigning again",
                        self.s.name, self.s.renew_deadline)
            await self.on_stopped()

    async def release(self) -> None:
        """Give the Lease up (on SIGTERM) so a standby need not wait out its duration."""
        if not self.leading:
            return
        self.leading = False
        try:
            lease = await self.kube.get(API, "Lease", self.s.namespace, self.s.name)
            if lease and (lease.get("spec") or {}).get("holderIdentity") == self.s.identity:
                spec = {**lease["spec"], "holderIdentity": "", "leaseDurationSeconds": 1,
                        "renewTime": _micro(self.clock.time())}
                await self.kube.replace({**lease, "spec": spec})
                log.info("released the Lease")
        except Exception as e:  # noqa: BLE001 - best effort: it expires anyway
            log.warning("could not release the Lease (%r); it expires in %.0fs", e, self.s.lease_duration)
