"""Owned objects (pure): which desired children must be (re-)applied. A child is applied
when it is missing, when the operator's desired form of it changed, or when someone else
changed it since the operator's last apply (drift): its generation moved for objects that
have one (a StatefulSet's status updates do not move it, `kubectl scale` does), its
resourceVersion for the rest."""
from __future__ import annotations

import hashlib
import json

ANNOTATION_DIGEST = "pdoperator.io/desired-digest"   # on each child: the digest of the form applied
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


def taken(observed: dict[ChildKey, dict], uid: str) -> list[str]:
    """Children's names another owner controls (a controller ownerReference to another uid), each
    as `<kind> <name> is controlled by <kind> <name>`: never applied over (server-side apply with
    force would take the object from its owner, and the owner would take it back)."""
    out = []
    for (kind, name), obj in sorted(observed.items()):
        ctl = next((o for o in (obj.get("metadata") or {}).get("ownerReferences") or [] if o.get("controller")),
                   None)
        if ctl is not None and ctl.get("uid") != uid:
            out.append(f"{kind} {name} is controlled by {ctl.get('kind', '?')} {ctl.get('name', '?')}")
    return out


def to_apply(desired: list[dict], observed: dict[ChildKey, dict], applied: dict[ChildKey, Applied]) -> list[dict]:
    out = []
    for obj in desired:
        k = child_key(obj)
        have = observed.get(k)
        last = applied.get(k)
        if have is None or last is None or last[0] != digest(obj) or last[1] != marker(have):
            out.append(obj)
    return out


def stamped(obj: dict) -> dict:
    """The desired object carrying the digest of its own form (without the stamp)."""
    meta = obj["metadata"]
    return {**obj, "metadata": {**meta, "annotations": {**(meta.get("annotations") or {}),
                                                         ANNOTATION_DIGEST: digest(obj)}}}


def written_by_others(obj: dict, manager: str) -> bool:
    """Whether anyone but `manager` wrote the object's spec or metadata (status writers aside)."""
    return any(m.get("manager") != manager and m.get("subresource") != "status"
               for m in (obj.get("metadata") or {}).get("managedFields") or [])


def adopt(desired: list[dict], observed: dict[ChildKey, dict], applied: dict[ChildKey, Applied],
          manager: str) -> dict[ChildKey, Applied]:
    """After a start or a takeover nothing is remembered of what was applied: a child whose
    stamp is the desired one's and that no one but the operator (`manager`) wrote is taken as
    applied, as it stands, instead of applied again (a fleet's takeover would otherwise re-apply
    every child). One someone else changed, even while no operator was leading, is applied."""
    out = {}
    for obj in desired:
        k = child_key(obj)
        have = observed.get(k)
        want = obj["metadata"]["annotations"][ANNOTATION_DIGEST]
        if k not in applied and have is not None and not written_by_others(have, manager) and \
                ((have.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_DIGEST) == want:
            out[k] = (digest(obj), marker(have))
    return out
