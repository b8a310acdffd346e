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
from dataclasses import dataclass

from .api import PDDeploymentSpec
from .builders import sts_name
from .members import pod_ready
from .status import Verdict

GROUPS = ("prefill", "decoder")
REVISION_LABEL = "controller-revision-hash"


@dataclass(frozen=True)
class Progress:
    n: int          # the replicas the operator applies (a scale in the same pass counts)
    updated: int    # pods at the StatefulSet's update revision (not leaving)
    ready: int      # of those, Ready

    @property
    def done(self) -> bool:
        return self.updated >= self.n


def _progress(sts: dict, pods: list[dict], n: int) -> Progress | None:
    """The group's roll, or None while the StatefulSet's status is not of its generation."""
    meta, st = sts.get("metadata") or {}, sts.get("status") or {}
    update = st.get("updateRevision")
    if not update or st.get("observedGeneration") != meta.get("generation"):
        return None
    new = [p for p in pods if not p["metadata"].get("deletionTimestamp")
           and (p["metadata"].get("labels") or {}).get(REVISION_LABEL) == update]
    return Progress(n, len(new), sum(1 for p in new if pod_ready(p)))


def _applied(sts: dict, n: int) -> int:
    """The partition the StatefulSet has now (a new one: held at n)."""
    rolling = ((sts.get("spec") or {}).get("updateStrategy") or {}).get("rollingUpdate") or {}
    return int(rolling["partition"]) if "partition" in rolling else n


def partitions(name: str, spec: PDDeploymentSpec, children: Mapping[tuple[str, str], dict],
               pods: list[dict], sizes: Mapping[str, int]) -> dict[str, int]:
    """Each StatefulSet's partition (empty without spec.rollout: the StatefulSets roll freely).
    `children`: the observed children by (kind, name); `sizes`: the replicas applied this pass.

    A group may hold at most maxSkew more pods at its update revision than the other group has
    Ready there, so the new revision never runs ahead of what serves. Two exceptions, both to
    keep the roll moving: the old revision's last decoder stays until its last prefill is gone
    (a prefilled cache needs a decoder), and while the decoders wait on that, the prefills roll
    without the bound (with more prefills than decoders the bound could otherwise never be met)."""
    if spec.rollout is None:
        return {}
    by_name = {n: c for (kind, n), c in children.items() if kind == "StatefulSet"}
    seen: dict[str, Progress | None] = {}
    for g in GROUPS:
        if (sts := by_name.get(sts_name(name, g))) is not None:
            mine = [p for p in pods if (p["metadata"].get("labels") or {}).get("pdoperator.io/group") == g]
            seen[g] = _progress(sts, mine, int(sizes.get(g, 0)))
    out = {}
    for g, got in seen.items():
        o = "decoder" if g == "prefill" else "prefill"
        other = seen.get(o)
        n = int(sizes.get(g, 0))
        if got is None:   # the controller has not seen the last write: keep it (a new one: held)
            out[g] = min(n, _applied(by_name[sts_name(name, g)], n))
        elif got.done:
            out[g] = n                                       # nothing to roll: held for the next change
        elif o not in seen or (other is not None and other.done):
            out[g] = 0                                       # no other group, or it is done: free
        elif other is None:
            out[g] = n - got.updated                         # the other's progress unknown: no further step
        else:
            allowed = min(n, other.ready + spec.rollout.max_skew)
            if g == "decoder":   # the old revision's last decoder stays while old prefills do
                allowed = min(allowed, n - 1)
            elif other.ready >= other.n - 1:   # the decoders wait on the prefills: they go first
                allowed = n
            out[g] = max(0, n - allowed)
    return out


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
