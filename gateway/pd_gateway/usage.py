"""Usage per key and model (requests, input and output tokens per UTC day) and requests per key
per minute, shared by every replica of a gateway through one object in the Kubernetes API.

Why the API and not a Redis: the gateway already talks to it, it survives restarts of every
gateway pod, and the chart needs nothing more to run. Each replica keeps what it counted since
its last sync and adds it to the shared document every few seconds with an optimistic write
(the object's resourceVersion; a conflict re-reads and adds again), so a quota holds across
replicas to within a sync interval. Counts survive a failed or interrupted write and a graceful
shutdown; a write the API server applied but whose answer never arrived is added again (usage
can be over-counted then, never lost). The document keeps DAYS_KEPT days and the last two
minutes: 100 keys x 4 models x 8 days is about 200 KB, below an object's 1 MiB."""
from __future__ import annotations

import asyncio
import copy
import json
import logging
import threading
from typing import Any, Protocol

from .policy import day_of, minute_of

log = logging.getLogger("pd_gateway.usage")
DAYS_KEPT = 8
SYNC_S = 3.0
DATA_KEY = "usage.json"
Doc = dict[str, Any]


class Conflict(Exception):
    """The shared document changed since it was read."""


class Store(Protocol):
    def load(self) -> tuple[Doc, str | None]: ...
    def save(self, doc: Doc, version: str | None) -> None: ...


def empty() -> Doc:
    return {"days": {}, "minutes": {}}


def add(a: Doc, b: Doc) -> Doc:
    """a + b, counter by counter (neither is changed)."""
    out = copy.deepcopy(a)
    out.setdefault("days", {})
    out.setdefault("minutes", {})
    for day, keys in b.get("days", {}).items():
        for key, models in keys.items():
            for model, counts in models.items():
                into = out["days"].setdefault(day, {}).setdefault(key, {}).setdefault(
                    model, {"requests": 0, "input": 0, "output": 0})
                for k, v in counts.items():
                    into[k] = into.get(k, 0) + v
    for minute, keys in b.get("minutes", {}).items():
        for key, n in keys.items():
            out["minutes"].setdefault(minute, {})[key] = out["minutes"].get(minute, {}).get(key, 0) + n
    return out


def prune(doc: Doc, now: float) -> Doc:
    days = sorted(doc.get("days", {}))[-DAYS_KEPT:]
    keep = {minute_of(now), minute_of(now - 60)}
    return {"days": {d: doc["days"][d] for d in days},
            "minutes": {m: v for m, v in doc.get("minutes", {}).items() if m in keep}}


class Usage:
    def __init__(self, store: Store | None = None):
        self.store = store
        self.remote: Doc = empty()      # the shared document as of the last sync
        self.pending: Doc = empty()     # counted here since
        self.syncing: Doc = empty()     # being added to the shared document right now
        self.synced_at: float | None = None
        self.error = ""
        self.reserved: dict[str, int] = {}   # key -> tokens its requests in flight here may still use

    def _both(self) -> list[Doc]:
        return [self.remote, self.syncing, self.pending]

    def reserve(self, key: str, tokens: int) -> None:
        """At admission: what a request may use (its prompt and max_tokens) counts against its key's
        quota until it is settled, so concurrent requests cannot all pass the same check."""
        self.reserved[key] = self.reserved.get(key, 0) + tokens

    def settle(self, key: str, tokens: int) -> None:
        """The request ended: its reservation goes (record() counts what it used)."""
        left = self.reserved.get(key, 0) - tokens
        if left > 0:
            self.reserved[key] = left
        else:
            self.reserved.pop(key, None)

    def admitted(self, key: str, now: float) -> None:
        m = self.pending["minutes"].setdefault(minute_of(now), {})
        m[key] = m.get(key, 0) + 1

    def record(self, key: str, model: str, input_tokens: int, output_tokens: int, now: float) -> None:
        c = self.pending["days"].setdefault(day_of(now), {}).setdefault(key, {}).setdefault(
            model, {"requests": 0, "input": 0, "output": 0})
        c["requests"] += 1
        c["input"] += input_tokens
        c["output"] += output_tokens

    def requests_this_minute(self, key: str, now: float) -> int:
        m = minute_of(now)
        return sum(d["minutes"].get(m, {}).get(key, 0) for d in self._both())

    def tokens_today(self, key: str, now: float) -> int:
        """Used today (every replica, as of the last sync) and reserved here by requests in flight."""
        day = day_of(now)
        return self.reserved.get(key, 0) + sum(c["input"] + c["output"] for d in self._both()
                                               for c in d["days"].get(day, {}).get(key, {}).values())

    def report(self, key: str | None = None) -> dict:
        """{key: {day: {model: {requests, input, output}}}}, one key's or everyone's."""
        docs = self._both()
        if key is not None:   # one key's share only, before any copying
            docs = [{"days": {day: {key: keys[key]} for day, keys in d["days"].items() if key in keys}} for d in docs]
        total = add(add(docs[0], docs[1]), docs[2])
        out: dict = {}
        for day, keys in sorted(total["days"].items()):
            for k, models in keys.items():
                if key is None or k == key:
                    out.setdefault(k, {})[day] = models
        return out

    async def sync(self, now: float) -> None:
        """Add what was counted here to the shared document; on failure keep it for the next sync."""
        if self.store is None:
            return
        if self.syncing != empty():
            return   # a sync is in flight (the final one at shutdown overlapping the loop's)
        if self.pending == empty():   # nothing counted here: read the others' counts, write nothing
            try:
                doc, _ = await asyncio.to_thread(self.store.load)
                self.remote, self.synced_at, self.error = prune(doc, now), now, ""
            except Exception as e:  # noqa: BLE001 - the next sync tries again
                self.error = str(e)
            return
        self.syncing, self.pending = self.pending, empty()
        try:
            for _ in range(5):
                doc, version = await asyncio.to_thread(self.store.load)
                merged = prune(add(doc, self.syncing), now)
                try:
                    await asyncio.to_thread(self.store.save, merged, version)
                except Conflict:
                    continue   # another replica wrote first: read again, add again
                self.remote, self.syncing, self.synced_at, self.error = merged, empty(), now, ""
                return
            raise Conflict("the usage document kept changing under five writes in a row")
        except BaseException as e:   # cancelled too: counted usage is kept for the next sync
            self.pending = add(self.syncing, self.pending)
            self.syncing = empty()
            if not isinstance(e, Exception):
                raise
            if str(e) != self.error:
                log.warning("usage not synced (kept for the next try): %s", e)
            self.error = str(e)


class MemoryStore:
    """One document in memory, with versions: replicas in one process (tests)."""

    def __init__(self) -> None:
        self.doc: Doc = empty()
        self.version = 0
        self.lock = threading.Lock()

    def load(self) -> tuple[Doc, str | None]:
        with self.lock:
            return copy.deepcopy(self.doc), str(self.version)

    def save(self, doc: Doc, version: str | None) -> None:
        with self.lock:
            if version != str(self.version):
                raise Conflict("changed since read")
            self.doc, self.version = copy.deepcopy(doc), self.version + 1


class ConfigMapStore:
    """The document in a ConfigMap the operator created for this gateway (the gateway may get and
    update that one object, nothing else)."""

    def __init__(self, namespace: str, name: str):
        from kubernetes import client, config
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        self.api, self.client = client.CoreV1Api(), client
        self.namespace, self.name = namespace, name

    def load(self) -> tuple[Doc, str | None]:
        cm = self.api.read_namespaced_config_map(self.name, self.namespace, _request_timeout=5)
        raw = (cm.data or {}).get(DATA_KEY)
        doc = json.loads(raw) if raw else empty()
        if not isinstance(doc, dict):
            doc = empty()
        return doc, cm.metadata.resource_version

    def save(self, doc: Doc, version: str | None) -> None:
        body = {"metadata": {"name": self.name, "resourceVersion": version},
                "data": {DATA_KEY: json.dumps(doc, sort_keys=True, separators=(",", ":"))}}
        try:
            self.api.patch_namespaced_config_map(self.name, self.namespace, body, _request_timeout=5)
        except self.client.ApiException as e:
            if e.status == 409:
                raise Conflict("changed since read") from None
            raise
