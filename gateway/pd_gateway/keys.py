"""API keys and per-key request limits.

Keys live in a Secret, one data key per API key (its name -> the key). The name is what
metrics and logs carry; the key itself is never logged. The Secret is re-read now and then,
so adding or rotating a key needs no restart."""
from __future__ import annotations

import base64
import collections
import hmac
import json
import logging
import os
import time
from typing import Callable

log = logging.getLogger("pd_gateway.keys")
REFRESH_S = 10.0


class Keys:
    def __init__(self, load: Callable[[], dict[str, str]]):
        self._load = load
        self._keys: dict[str, str] = {}   # name -> key
        self.loaded_at = 0.0
        self.error = ""

    def refresh(self) -> None:
        try:
            keys = {n: k for n, k in self._load().items() if k}
        except Exception as e:  # noqa: BLE001 - keep the last good set; say why in /healthz
            self.error = f"reading API keys: {e}"
            log.warning("%s; keeping %d keys", self.error, len(self._keys))
            return
        if set(keys) != set(self._keys):
            log.info("API keys: %s", ", ".join(sorted(keys)) or "none")
        self._keys, self.error, self.loaded_at = keys, "", time.monotonic()

    def due(self) -> bool:
        return time.monotonic() - self.loaded_at > REFRESH_S

    def __len__(self) -> int:
        return len(self._keys)

    def name_of(self, presented: str) -> str | None:
        """The key's name, comparing against every key in constant time each."""
        found = None
        for name, key in self._keys.items():
            if hmac.compare_digest(presented.encode(), key.encode()):
                found = name
        return found


def from_secret(namespace: str, name: str) -> Callable[[], dict[str, str]]:
    from kubernetes import client, config
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    api = client.CoreV1Api()

    def load() -> dict[str, str]:
        sec = api.read_namespaced_secret(name, namespace, _request_timeout=5)
        return {k: base64.b64decode(v).decode().strip() for k, v in (sec.data or {}).items()}
    return load


def from_env(env: dict[str, str] | None = None) -> Callable[[], dict[str, str]]:
    """PD_GATEWAY_API_KEYS as JSON {name: key}, for a gateway run outside a cluster."""
    raw = (env if env is not None else os.environ).get("PD_GATEWAY_API_KEYS", "{}")
    keys = json.loads(raw)
    return lambda: dict(keys)


class RateLimits:
    """Requests per minute per key name, over a sliding 60 s window."""

    def __init__(self, rpm: dict[str, int]):
        self.rpm = rpm
        self._seen: dict[str, collections.deque[float]] = {}

    def admit(self, name: str, now: float | None = None) -> float | None:
        """None if admitted, else seconds until it would be."""
        limit = self.rpm.get(name)
        if not limit:
            return None
        now = time.monotonic() if now is None else now
        q = self._seen.setdefault(name, collections.deque())
        while q and now - q[0] >= 60:
            q.popleft()
        if len(q) >= limit:
            return max(0.001, 60 - (now - q[0]))
        q.append(now)
        return None
