"""Rolling prefill and decoder together (spec.rollout.maxSkew), and condition RevisionSkew (pure).

An image upgrade changes both StatefulSets' templates. Rolled independently, one group can be
all new while the other is all old, and since a decoder and a prefill of different revisions are
never linked (links.compatible) the deployment would serve nothing. With spec.rollout the
operator holds each StatefulSet's RollingUpdate partition so that the pods at each group's update
revision never differ by more than maxSkew between the groups (while both still have old pods):
the new revision gains prefills and decoders together, the old keeps both until it is gone (its
last decoder leaves after its last prefill, so no prefilled cache is left without a decoder).

The partition is a pure function of what is observed, so a restarted operator carries on: a
group whose StatefulSet status is not yet of its generation is held (partition = replicas), a
group with nothing to roll is held too (a template change then arrives held, and the next pass
releases pods one skew step at a time); the StatefulSet controller rolls the released ordinals,
highest first, each once the one before is Ready."""
from __future__ import annotations

from collections.abc import Iterable, Mapping

from .api import PDDeploymentSpec
from .builders import sts_name
from .status import Verdict

GROUPS = ("prefill", "decoder")
REVISION_LABEL = "controller-revision-hash"


def _progress(sts: dict, pods: list[dict]) -> tuple[int, int] | None:
    """(replicas, pods at the update revision), or None while the status is not of this generation."""
    meta, spec, st = sts.get("metadata") or {}, sts.get("spec") or {}, sts.get("status") or {}
    update = st.get("updateRevision")
    if not update or st.get("observedGeneration") != meta.get("generation"):
        return None
    updated = sum(1 for p in pods if not p["metadata"].get("deletionTimestamp")
                  and (p["metadata"].get("labels") or {}).get(REVISION_LABEL) == update)
    return int(spec.get("replicas") or 0), updated


def partitions(name: str, spec: PDDeploymentSpec, children: Mapping[tuple[str, str], dict],
               pods: list[dict]) -> dict[str, int]:
    """Each StatefulSet's partition (empty without spec.rollout: the StatefulSets roll freely).
    `children`: the observed children by (kind, name)."""
    if spec.rollout is None:
        return {}
    by_name = {n: c for (kind, n), c in children.items() if kind == "StatefulSet"}
    seen: dict[str, tuple[int, int] | None] = {}
    for g in GROUPS:
        if (sts := by_name.get(sts_name(name, g))) is not None:
            mine = [p for p in pods if (p["metadata"].get("labels") or {}).get("pdoperator.io/group") == g]
            seen[g] = _progress(sts, mine)
    out = {}
    for g, got in seen.items():
        o = "decoder" if g == "prefill" else "prefill"
        other = seen.get(o)
        if got is None:
            out[g] = _replicas(by_name[sts_name(name, g)])   # not yet observed: hold
            continue
        n, updated = got
        if updated >= n:
            out[g] = n                                       # nothing to roll: held for the next change
        elif o not in seen or (other is not None and other[1] >= other[0]):
            out[g] = 0                                       # no other group, or it is done: free
        elif other is None:
            out[g] = n - updated                             # the other's progress unknown: no further step
        else:
            allowed = min(n, other[1] + spec.rollout.max_skew)
            if g == "decoder" and other[1] < other[0]:
                # the old revision's last decoder stays while old prefills do: their caches need it
                allowed = min(allowed, n - 1)
            out[g] = max(0, n - allowed)
    return out


def _replicas(sts: dict) -> int:
    return int((sts.get("spec") or {}).get("replicas") or 0)


def with_partitions(desired: list[dict], name: str, parts: dict[str, int]) -> list[dict]:
    """The desired StatefulSets with their partitions set (new objects; the others unchanged)."""
    names = {sts_name(name, g): p for g, p in parts.items()}
    out = []
    for o in desired:
        if o.get("kind") == "StatefulSet" and o["metadata"]["name"] in names:
            o = {**o, "spec": {**o["spec"], "updateStrategy": {
                "type": "RollingUpdate", "rollingUpdate": {"partition": names[o["metadata"]["name"]]}}}}
        out.append(o)
    return out


def revision_skew(engines: Iterable) -> Verdict | None:
    """Condition RevisionSkew, present (True) while engine pods of more than one revision exist."""
    counts: dict[str, dict[str, int]] = {}
    for e in engines:
        if e.revision and not e.terminating:
            role = "prefill" if (e.engine_role or e.role) == "prefill" else "decoder"
            c = counts.setdefault(e.revision, {"prefill": 0, "decoder": 0})
            c[role] += 1
    if len(counts) <= 1:
        return None
    parts = "; ".join(f"{rev}: {c['prefill']} prefill, {c['decoder']} decoder" for rev, c in sorted(counts.items()))
    return True, "RevisionsCoexist", (f"{len(counts)} revisions ({parts}): a decoder and a prefill are linked and "
                                      "paired only within one revision")
