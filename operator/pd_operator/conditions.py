"""Condition helpers in the Cluster API style: set (keeping lastTransitionTime when the
status does not change), get, and summarise by declared polarity."""
from __future__ import annotations

import datetime as dt


def iso(wall: float) -> str:
    """A condition's lastTransitionTime, from the caller's clock (the controller's, injected)."""
    return dt.datetime.fromtimestamp(wall, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def get(conditions: list[dict] | None, ctype: str) -> dict | None:
    return next((c for c in conditions or [] if c.get("type") == ctype), None)


def is_true(conditions: list[dict] | None, ctype: str) -> bool:
    c = get(conditions, ctype)
    return c is not None and c.get("status") == "True"


def set_condition(conditions: list[dict] | None, ctype: str, status: bool | str, reason: str,
                  message: str, generation: int | None, at: str) -> list[dict]:
    """Return a new list with `ctype` set. lastTransitionTime moves only when status flips."""
    s = status if isinstance(status, str) else ("True" if status else "False")
    prev = get(conditions, ctype)
    ltt = prev["lastTransitionTime"] if prev and prev.get("status") == s and prev.get("lastTransitionTime") \
        else at
    new = {"type": ctype, "status": s, "reason": reason, "message": message[:2000],
           "lastTransitionTime": ltt, "observedGeneration": generation}
    out = [c for c in conditions or [] if c.get("type") != ctype]
    out.append(new)
    order = {t: i for i, t in enumerate(ORDER)}
    return sorted(out, key=lambda c: order.get(c["type"], len(order)))


ORDER = ("Ready", "PodsReady", "AgentsReady", "LinksReady", "KVPathVerified", "KVContentMismatch", "ProxyEnvironment",
         "Rebalancing")
# Ready summarises these, all of positive polarity (good when True), in this order.
SUMMARISED = ("PodsReady", "AgentsReady", "LinksReady", "KVPathVerified")
# Negative polarity: the condition is bad when True (a warning, not summarised into Ready).
NEGATIVE = frozenset({"ProxyEnvironment", "KVContentMismatch", "RevisionSkew"})
# Informational: neither good nor bad (True while a switch runs; otherwise why none runs).
INFORMATIONAL = frozenset({"Rebalancing"})


def polarity(ctype: str) -> str:
    return "negative" if ctype in NEGATIVE else "informational" if ctype in INFORMATIONAL else "positive"


def healthy(c: dict) -> bool:
    """Whether a condition is in its good state, by its type's polarity."""
    p = polarity(c["type"])
    return p == "informational" or (c["status"] == "True") == (p == "positive")


def first_unhealthy(conditions: list[dict] | None, types: tuple[str, ...] = SUMMARISED) -> dict | None:
    """The first of `types` (in that order) that is not in its good state."""
    for t in types:
        c = get(conditions, t)
        if c is not None and not healthy(c):
            return c
    return None
