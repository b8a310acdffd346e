"""What the watches told the PDDeployment controller, per deployment: the deployment, its pods and
children (each with when it was cached), when its pods last became Ready, which pods changed since
their agent was asked, and the check of the caches against a fresh list (an object deleted while a
watch was away leaves no ghost)."""
from __future__ import annotations

import logging
from typing import Any

from . import kinds
from .builders import LABEL_DEPLOYMENT
from .kube import Kube
from .members import own_statefulsets, pod_ready
from .runtime import SYSTEM_CLOCK, Clock
from .state import Seen

log = logging.getLogger("pd_operator.caches")
Key = tuple[str, str]


def lean(obj: dict) -> dict:
    """The object as cached: its managedFields keep who wrote it (children.adopt reads that) but
    not which fields, which is about half of a pod's bytes."""
    meta = obj.get("metadata") or {}
    if "managedFields" not in meta:
        return obj
    managers = [{k: v for k, v in m.items() if k != "fieldsV1"} for m in meta["managedFields"] or []]
    return {**obj, "metadata": {**meta, "managedFields": managers}}


WARM_S = 30.0   # a process up this long has had its watches' first lists: its caches are warm


class Caches:
    def __init__(self, clock: Clock = SYSTEM_CLOCK):
        self.clock = clock
        self.started = clock.monotonic()
        self.deployments: dict[Key, dict] = {}
        self.pods: dict[Key, dict[str, tuple[dict, float]]] = {}        # -> name -> (object, cached at)
        self.children: dict[Key, dict[tuple[str, str], tuple[dict, float]]] = {}
        self.relisted_at: dict[Key, float] = {}
        self.ready_since: dict[Key, dict[str, float]] = {}   # pod -> when its watch event said Ready
        self.dirty: dict[Key, set[str]] = {}   # pods whose object changed since their agent was asked
        self.seen: dict[Key, Seen] = {}        # observing's own bookkeeping (state.Seen)

    def seen_of(self, key: Key) -> Seen:
        return self.seen.setdefault(key, Seen())

    def took_over(self, key: Key) -> None:
        """Leadership of `key` taken: observing's bookkeeping starts afresh; caches that stood by
        warm count as listed now (checked against a list at their usual time, not a fleet's all at
        once); cold ones are listed at the first pass."""
        self.seen.pop(key, None)
        if self.clock.monotonic() - self.started > WARM_S:
            self.relisted_at[key] = self.clock.monotonic()
        else:
            self.relisted_at.pop(key, None)

    def forget(self, key: Key) -> None:
        self.seen.pop(key, None)
        self.deployments.pop(key, None)
        self.dirty.pop(key, None)
        self.ready_since.pop(key, None)

    def on_pod(self, etype: str | None, body: dict) -> Key:
        meta = body["metadata"]
        key = (meta["namespace"], meta.get("labels", {}).get(LABEL_DEPLOYMENT, ""))
        cache = self.pods.setdefault(key, {})
        was_ready = meta["name"] in cache and pod_ready(cache[meta["name"]][0])
        self._cache(cache, meta["name"], etype, body)
        if etype != "DELETED" and pod_ready(body) and not was_ready:
            self.ready_since.setdefault(key, {})[meta["name"]] = self.clock.monotonic()
        self.dirty.setdefault(key, set()).add(meta["name"])
        return key

    def on_child(self, etype: str | None, body: dict) -> Key:
        meta = body["metadata"]
        key = (meta["namespace"], meta.get("labels", {}).get(LABEL_DEPLOYMENT, ""))
        self._cache(self.children.setdefault(key, {}), (body.get("kind", ""), meta["name"]), etype, body)
        return key

    def _cache(self, cache: dict, name, etype: str | None, body: dict) -> None:
        if etype == "DELETED":
            cache.pop(name, None)
        else:
            cache[name] = (lean(body), self.clock.monotonic())

    def own_statefulsets(self, key: Key, uid: str) -> set[str]:
        return own_statefulsets((o for o, _ in self.children.get(key, {}).values()), key[1], uid)

    def cached_pods(self, key: Key) -> list[dict]:
        return [o for o, _ in self.pods.get(key, {}).values()]

    def child_objects(self, key: Key) -> dict:
        return {k: o for k, (o, _) in self.children.get(key, {}).items()}

    async def relist(self, kube: Kube, key: Key) -> None:
        """Check the caches against a fresh list: a watch that reconnects lists again but sends
        no DELETED for objects removed while it was away."""
        ns, name = key
        t0 = self.clock.monotonic()
        selector = f"{LABEL_DEPLOYMENT}={name}"
        pods = {p["metadata"]["name"]: p for p in await kube.list("v1", "Pod", ns, selector)}
        kids: dict[tuple[str, str], dict] = {}
        for kind in kinds.CHILDREN:
            for obj in await kube.list(kind.api_version, kind.kind, ns, selector):
                obj.setdefault("kind", kind.kind)
                kids[(kind.kind, obj["metadata"]["name"])] = obj
        self._take(key, self.pods.setdefault(key, {}), pods, t0)
        self._take(key, self.children.setdefault(key, {}), kids, t0)
        self.relisted_at[key] = t0

    @staticmethod
    def _take(key: Key, cache: dict[Any, tuple[dict, float]], fresh: dict[Any, dict], t0: float) -> None:
        for k, (_, cached_at) in list(cache.items()):
            if k not in fresh and cached_at < t0:
                log.info("%s/%s: %s is gone (not in a fresh list)", key[0], key[1], k)
                del cache[k]
        for k, obj in fresh.items():
            if k not in cache or cache[k][1] < t0:
                cache[k] = (lean(obj), t0)
