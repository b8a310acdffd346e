"""API keys and per-key request limits.

Keys live in a Secret, one data key per API key (its name -> the key). The name is what
metrics and logs carry; the key itself is never logged. The Secret is re-read now and then,
so adding or rotating a key needs no restart. A Secret that can no longer be read (deleted,
access taken back) revokes its keys after a grace: the last good set is kept for
KEYS_GRACE_S after the first failed read, then every key is refused."""
from __future__ import annotations

import base64
import collections
import hashlib
import hmac
import json
import logging
import os
import time
from typing import Callable

log = logging.getLogger("pd_gateway.keys")
REFRESH_S = 10.0
# two reload intervals: one failed read (an API server restarting) keeps the keys, a second
# one in a row does not
KEYS_GRACE_S = 2 * REFRESH_S
# a shorter key is guessable or a placeholder ("changeme"): ignored, with a warning naming it
MIN_KEY_LENGTH = 16


def _bytes(s: str) -> bytes:
    """Headers arrive decoded with surrogateescape: this gives back the bytes sent. Never raises
    (any other lone surrogate, from a JSON escape, is passed through)."""
    try:
        return s.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return s.encode("utf-8", "surrogatepass")


class Keys:
    def __init__(self, load: Callable[[], dict[str, str]], min_length: int = MIN_KEY_LENGTH,
                 grace_s: float = KEYS_GRACE_S, clock: Callable[[], float] = time.monotonic):
        self._load = load
        self._keys: dict[str, bytes] = {}   # name -> key
        self.min_length = min_length
        self.grace_s = grace_s
        self.clock = clock
        self.loaded_at = 0.0
        self.failing_since: float | None = None   # when reads started failing
        self.error = ""
        self._ignored: set[str] = set()

    def refresh(self) -> None:
        try:
            loaded = self._load()
            if not isinstance(loaded, dict):
                raise ValueError(f"expected {{name: key}}, got {type(loaded).__name__}")
        except Exception as e:  # noqa: BLE001 - keep the last good set for a grace; say why in /healthz
            self._failed(f"reading API keys: {e}")
            return
        keys, ignored = {}, set()
        for name, key in loaded.items():
            if not isinstance(name, str) or not isinstance(key, str) or not key:
                continue
            if len(key) < self.min_length:
                ignored.add(name)
                continue
            keys[name] = _bytes(key)
        if ignored != self._ignored:   # once per change, not at every reload
            for name in sorted(ignored - self._ignored):
                log.warning("API key %r is shorter than %d characters: ignored", name, self.min_length)
            self._ignored = ignored
        if set(keys) != set(self._keys) or self.failing_since is not None:
            log.info("API keys: %s", ", ".join(sorted(keys)) or "none")
        self._keys, self.error, self.loaded_at, self.failing_since = keys, "", self.clock(), None

    def _failed(self, error: str) -> None:
        now = self.clock()
        if self.failing_since is None:
            self.failing_since = now
        if error != self.error:
            log.warning("%s; keeping %d keys for up to %.0fs", error, len(self._keys), self.grace_s)
        self.error = error
        if self._keys and self.revoked:
            log.error("API keys could not be read for %.0fs: refusing all %d keys until they can",
                      now - self.failing_since, len(self._keys))
            self._keys = {}

    @property
    def revoked(self) -> bool:
        """Reads have failed for longer than the grace: no key is valid, whatever was read before."""
        return self.failing_since is not None and self.clock() - self.failing_since >= self.grace_s

    def due(self) -> bool:
        return self.clock() - self.loaded_at > REFRESH_S

    def __len__(self) -> int:
        return 0 if self.revoked else len(self._keys)

    def names(self) -> list[str]:
        return sorted(self._keys)

    def digest_of(self, names: list[str], purpose: bytes) -> bytes | None:
        """A secret derived from the named keys' values (for `purpose`), for whoever holds them
        and no one else; None if none of them is held."""
        values = sorted(self._keys[n] for n in names if n in self._keys)
        if not values:
            return None
        return hashlib.sha256(purpose + b"\0" + b"".join(hashlib.sha256(v).digest() for v in values)).digest()

    def name_of(self, presented: str) -> str | None:
        """The key's name, comparing against every key in constant time each."""
        if self.revoked:
            return None
        got = _bytes(presented)
        found = None
        for name, key in self._keys.items():
            if hmac.compare_digest(got, key):
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
        # not UTF-8: kept as the bytes a client would send (one odd key must not fail the others)
        return {k: base64.b64decode(v).decode("utf-8", "surrogateescape").strip() for k, v in (sec.data or {}).items()}
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
