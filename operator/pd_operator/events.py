"""Kubernetes Events on a PDDeployment, aggregated the way the kubelet does it: a repeat of
the same (type, reason, key) bumps the existing Event's count and lastTimestamp instead of
posting a new one, so a flapping link yields one counted Event. The key leaves out numbers
that change on every repeat (durations); callers pass it when the message carries some."""
from __future__ import annotations

import datetime as dt
import logging
import uuid

from .kube import Kube, KubeError
from .runtime import SYSTEM_CLOCK, Clock

log = logging.getLogger("pd_operator.events")
AGGREGATE_WINDOW_S = 600     # a repeat within this bumps the existing Event
PATCH_EVERY_S = 10           # at most one count update per Event in this time


def _ts(wall: float) -> str:
    return dt.datetime.fromtimestamp(wall, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class _Seen:
    __slots__ = ("name", "namespace", "count", "first", "last_post", "last_patch")

    def __init__(self, name: str, namespace: str, now: float, first: str):
        self.name, self.namespace = name, namespace
        self.count, self.first, self.last_post, self.last_patch = 1, first, now, now


class Events:
    def __init__(self, kube: Kube, clock: Clock = SYSTEM_CLOCK):
        self.kube = kube
        self.clock = clock
        self._seen: dict[tuple, _Seen] = {}

    async def post(self, body: dict, etype: str, reason: str, message: str, key: str | None = None) -> None:
        meta = body["metadata"]
        k = (meta.get("uid"), etype, reason, key if key is not None else message)
        now = self.clock.monotonic()
        seen = self._seen.get(k)
        if seen is not None and now - seen.last_post < AGGREGATE_WINDOW_S:
            seen.count += 1
            seen.last_post = now
            if now - seen.last_patch >= PATCH_EVERY_S:
                seen.last_patch = now
                await self._bump(seen, message)
            return
        self._gc(now)
        (log.warning if etype == "Warning" else log.info)("%s/%s %s: %s", meta["namespace"], meta["name"],
                                                          reason, message)
        name = f"{meta['name']}.{uuid.uuid4().hex[:16]}"
        ts = _ts(self.clock.time())
        self._seen[k] = _Seen(name, meta["namespace"], now, ts)
        event = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": name, "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": body.get("apiVersion", "pdoperator.io/v1alpha1"),
                               "kind": body.get("kind", "PDDeployment"), "name": meta["name"],
                               "namespace": meta["namespace"], "uid": meta.get("uid")},
            "type": etype, "reason": reason, "message": message[:1024],
            "source": {"component": "pd-operator"}, "reportingComponent": "pd-operator",
            "firstTimestamp": ts, "lastTimestamp": ts, "count": 1,
        }
        try:
            await self.kube.create(event)
        except KubeError as e:
            log.info("could not post event %s: %s", reason, e)

    async def _bump(self, seen: _Seen, message: str) -> None:
        try:
            await self.kube.patch("v1", "Event", seen.namespace, seen.name,
                                  {"count": seen.count, "lastTimestamp": _ts(self.clock.time()),
                                   "message": message[:1024]})
        except KubeError as e:
            log.info("could not update event %s: %s", seen.name, e)

    def _gc(self, now: float) -> None:
        if len(self._seen) > 5000:
            self._seen = {k: s for k, s in self._seen.items() if now - s.last_post < AGGREGATE_WINDOW_S}
