"""Per-key exponential backoff with jitter (pure; the clock is passed in)."""
from __future__ import annotations

import random
from typing import Callable, Generic, Hashable, TypeVar

K = TypeVar("K", bound=Hashable)


class Backoff(Generic[K]):
    def __init__(self, base: float = 0.5, cap: float = 30.0, rng: Callable[[], float] = random.random):
        self.base = base
        self.cap = cap
        self.rng = rng
        self._state: dict[K, tuple[int, float]] = {}  # key -> (failures, not before)

    def due(self, key: K, now: float) -> bool:
        s = self._state.get(key)
        return s is None or now >= s[1]

    def failures(self, key: K) -> int:
        return self._state.get(key, (0, 0.0))[0]

    def fail(self, key: K, now: float, base: float | None = None, cap: float | None = None) -> float:
        """Record a failure; returns the delay before the next attempt (full jitter on the upper half)."""
        n = self.failures(key) + 1
        delay = min(cap or self.cap, (base or self.base) * 2 ** (n - 1)) * (0.5 + 0.5 * self.rng())
        self._state[key] = (n, now + delay)
        return delay

    def succeed(self, key: K) -> None:
        self._state.pop(key, None)

    def next_in(self, now: float) -> float | None:
        if not self._state:
            return None
        return max(0.05, min(t for _, t in self._state.values()) - now)

    def copy(self) -> "Backoff[K]":
        other: Backoff[K] = Backoff(self.base, self.cap, self.rng)
        other._state = dict(self._state)
        return other

    def keys(self) -> list[K]:
        return list(self._state)

    def prune(self, keep: Callable[[K], bool]) -> None:
        """Forget keys that no longer matter (a pod that is gone, a link no longer wanted)."""
        self._state = {k: v for k, v in self._state.items() if keep(k)}
