"""Owned objects (pure): which desired children must be (re-)applied. A child is applied
when it is missing, when the operator's desired form of it changed, or when someone else
changed it since the operator's last apply (drift): its generation moved for objects that
have one (a StatefulSet's status updates do not move it, `kubectl scale` does), its
resourceVersion for the rest."""
from __future__ import annotations

import hashlib
import json

ChildKey = tuple[str, str]   # (kind, name)
Applied = tuple[str, str]    # (digest of the desired object, marker of the object after the apply)


def child_key(obj: dict) -> ChildKey:
    return obj["kind"], obj["metadata"]["name"]


def digest(obj: dict) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def marker(obj: dict) -> str:
    meta = obj.get("metadata", {})
    if meta.get("generation") is not None:
        return f"g{meta['generation']}"
    return f"rv{meta.get('resourceVersion', '')}"


def to_apply(desired: list[dict], observed: dict[ChildKey, dict], applied: dict[ChildKey, Applied]) -> list[dict]:
    out = []
    for obj in desired:
        k = child_key(obj)
        have = observed.get(k)
        last = applied.get(k)
        if have is None or last is None or last[0] != digest(obj) or last[1] != marker(have):
            out.append(obj)
    return out
