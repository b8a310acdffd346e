"""Kubernetes Events on a PDDeployment, de-duplicated: the same reason and message within
the window bumps nothing and posts nothing."""
from __future__ import annotations

import datetime as dt
import logging
import time
import uuid

from .kube import Kube, KubeError

log = logging.getLogger("pd_operator.events")
DEDUP_WINDOW_S = 300


class Events:
    def __init__(self, kube: Kube):
        self.kube = kube
        self._recent: dict[tuple, float] = {}

    async def post(self, body: dict, etype: str, reason: str, message: str) -> None:
        meta = body["metadata"]
        key = (meta.get("uid"), etype, reason, message)
        now = time.monotonic()
        if now - self._recent.get(key, -1e9) < DEDUP_WINDOW_S:
            return
        self._recent[key] = now
        if len(self._recent) > 5000:
            self._recent = {k: t for k, t in self._recent.items() if now - t < DEDUP_WINDOW_S}
        (log.warning if etype == "Warning" else log.info)("%s/%s %s: %s", meta["namespace"], meta["name"],
                                                          reason, message)
        ts = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:16]}", "namespace": meta["namespace"]},
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
