"""Instances of several pods (spec.<group>.podsPerInstance > 1), as gangs: decide (pure).

A group's StatefulSet holds its instances' pods in order: instance n is pods n x k ... n x k + k - 1
(k pods per instance), and its pod n x k leads (its agent fronts every rank of the instance; the
operator's members, links, verification, routing and switches are the leading pods'). Here, for
each instance:

- Placement, all or none. Its pods start behind a scheduling gate; the gate is lifted from all of
  them at once. If they are not all placed within spec.<group>.gangScheduleSeconds, every pod of
  the instance is deleted (they come back behind the gate and hold no NPUs), the scheduler's reason
  is kept, and the gate is lifted again only once the nodes' free NPUs (from their allocatable
  and the pods bound to them) hold every pod of the instance.
- One incarnation. Once every pod runs, the instance's pods (uid and restarts) are its
  incarnation; a pod replaced or restarted ends it: its other pods are deleted, so they all start
  again together (the leading pod leaves routing at once, being deleted) and the links of the new
  incarnation are made and verified as for any new pod.
- Membership. The leading pod's agent is told the other pods and their agents (POST /v1/gang)
  whenever what it reports differs from the pods that run.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace

from pd_contract.agent_api import GangMember, GangRequest
from pd_contract.names import AGENT_PORT, GANG_GATE

from .api import PDDeploymentSpec
from .members import pod_index
from .status import unschedulable

TELL_EVERY_S = 2.0      # a leading pod that still reports other members is told again this often
RETRY_UNREAD_X = 4      # nodes that cannot be read (watchNamespaces): placing whole is tried again after 4 deadlines


@dataclass(frozen=True)
class Memo:
    """What the operator keeps of one instance between passes."""
    incarnation: frozenset[str] = frozenset()   # "uid:restarts" of its pods, once every one ran
    ungated_at: float | None = None             # when its pods' gate was lifted (the placement deadline's start)
    unplaced: str = ""                          # why placing it whole timed out (the scheduler's word)
    told: str = ""                              # the members last told to its leading pod
    told_at: float = float("-inf")
    restarting: frozenset[str] = frozenset()    # uids of its pods still to delete (a restart under way)
    unplaced_at: float = 0.0                    # when placing it whole timed out


@dataclass
class Plan:
    ungate: list[tuple[str, str, list[dict]]] = field(default_factory=list)   # (pod, uid, the gates it keeps)
    delete: list[tuple[str, str, str]] = field(default_factory=list)   # (pod, uid, why)
    tell: list[tuple[str, str, GangRequest]] = field(default_factory=list)   # (leading pod, its agent, members)
    unplaced: list[str] = field(default_factory=list)                  # PodsReady's word, per instance
    events: list[tuple[str, str, str]] = field(default_factory=list)   # (type, reason, message)
    memos: dict[str, Memo] = field(default_factory=dict)
    instance_of: dict[str, tuple[str, str]] = field(default_factory=dict)   # pod -> (instance, its leading pod)


def gated(pod: dict) -> bool:
    return any(g.get("name") == GANG_GATE for g in (pod.get("spec") or {}).get("schedulingGates") or [])


def _sig(pod: dict) -> str:
    restarts = sum(c.get("restartCount", 0) for c in (pod.get("status") or {}).get("containerStatuses") or [])
    return f"{pod['metadata'].get('uid', '')}:{restarts}"


def _running(pod: dict) -> bool:
    return bool((pod.get("spec") or {}).get("nodeName")) and (pod.get("status") or {}).get("phase") == "Running"


def instances(spec: PDDeploymentSpec, pods: list[dict]) -> dict[str, tuple[str, int, dict[int, dict]]]:
    """Instance name (<group>-<n>) -> (group, n, its pods by place in the instance)."""
    out: dict[str, tuple[str, int, dict[int, dict]]] = {}
    for p in pods:
        group = p["metadata"].get("labels", {}).get("pdoperator.io/group", "")
        idx = pod_index(p)
        if group not in ("prefill", "decoder") or idx is None:
            continue
        k = spec.pods_per_instance(group)
        if k > 1:
            out.setdefault(f"{group}-{idx // k}", (group, idx // k, {}))[2][idx % k] = p
    return out


def fits(free: dict[str, int], pods: int, npus: int) -> bool:
    """Whether `pods` pods of `npus` NPUs each fit the nodes' free NPUs (fullest node first)."""
    left = sorted(free.values(), reverse=True)
    for _ in range(pods):
        i = next((j for j, n in enumerate(left) if n >= npus), None)
        if i is None:
            return False
        left[i] -= npus
    return True


def _count(v: object) -> int:
    try:
        return int(str(v))
    except ValueError:
        return 0


def free_npus(nodes: list[dict], pods: list[dict], resource: str) -> dict[str, int]:
    """Each schedulable node's NPUs that no bound pod requests."""
    free = {n["metadata"]["name"]: _count(((n.get("status") or {}).get("allocatable") or {}).get(resource, 0))
            for n in nodes if not (n.get("spec") or {}).get("unschedulable")}
    for p in pods:
        node = (p.get("spec") or {}).get("nodeName")
        if node in free:
            for c in (p.get("spec") or {}).get("containers") or []:
                r = c.get("resources") or {}
                free[node] -= _count((r.get("requests") or r.get("limits") or {}).get(resource, 0))
    return free


@dataclass(frozen=True)
class _Seen:
    spec: PDDeploymentSpec
    reports: dict                       # the agents' last statuses, by pod
    free: dict[str, int] | None         # the nodes' free NPUs, when they were read
    now: float


def plan(spec: PDDeploymentSpec, pods: list[dict], reports: dict, memos: dict[str, Memo],
         free: dict[str, int] | None, now: float) -> Plan:
    """This pass's gang actions. `pods` includes leaving ones; `reports` are the agents' last
    statuses by pod; `free` the nodes' free NPUs when they were read (None: not read)."""
    out, seen = Plan(), _Seen(spec, reports, free, now)
    for name, (group, _n, by_place) in sorted(instances(spec, pods).items()):
        lead = by_place[0]["metadata"]["name"] if 0 in by_place else ""
        out.instance_of.update({p["metadata"]["name"]: (name, lead) for p in by_place.values()})
        memo = _instance(seen, name, group, by_place, memos.get(name, Memo()), out)
        if memo != Memo():
            out.memos[name] = memo
    return out


def _instance(seen: _Seen, name: str, group: str, by_place: dict[int, dict], memo: Memo, out: Plan) -> Memo:
    spec, now = seen.spec, seen.now
    k = spec.pods_per_instance(group)
    live = {i: p for i, p in by_place.items() if not p["metadata"].get("deletionTimestamp")}
    if memo.restarting:   # a restart under way: its pods are deleted until none is left
        left = [p for p in live.values() if p["metadata"].get("uid") in memo.restarting]
        out.delete += [(p["metadata"]["name"], p["metadata"]["uid"], f"instance {name}: restarting whole")
                       for p in left]
        return Memo(restarting=frozenset(p["metadata"]["uid"] for p in left))
    sigs = {_sig(p) for p in live.values()}
    if memo.incarnation and not memo.incarnation <= sigs:
        # a pod of it is going, gone, replaced or restarted: the rest go at once (no request is sent
        # to a part of it), and it starts again whole
        old = {s.split(":")[0] for s in memo.incarnation}
        lost = sorted(p["metadata"]["name"] for i, p in by_place.items() if i not in live or _sig(p) not in
                      memo.incarnation) or [f"{k - len(live)} pod(s)"]
        why = (f"instance {name}: {', '.join(lost)} lost (deleted, replaced or restarted); its pods start again "
               "together as a new incarnation")
        victims = [p for p in live.values() if p["metadata"].get("uid") in old]
        out.delete += [(p["metadata"]["name"], p["metadata"]["uid"], why) for p in victims]
        out.events.append(("Warning", "GangRestarted", why))
        return Memo(restarting=frozenset(p["metadata"]["uid"] for p in victims))
    if len(live) < len(by_place):
        return memo             # some of it is going: the rest waits until the StatefulSet made it whole
    if len(live) == k and all(_running(p) for p in live.values()):
        memo = replace(memo, incarnation=frozenset(sigs), unplaced="", ungated_at=None)
        return _tell(spec, group, live, seen.reports, memo, now, out)
    return _place(seen, name, group, live, memo, out)


def _place(seen: _Seen, name: str, group: str, live: dict[int, dict], memo: Memo, out: Plan) -> Memo:
    spec, now, free = seen.spec, seen.now, seen.free
    names = ", ".join(p["metadata"]["name"] for _, p in sorted(live.items()))
    k, npus = spec.pods_per_instance(group), spec.tp(group)
    waiting = [p for p in live.values() if gated(p)]
    if waiting:
        if len(live) < k:
            return memo          # the StatefulSet is still making its pods
        # room for all of it, or (the nodes cannot be read) a while after it timed out: its gate is lifted again
        room = fits(free, k, npus) if free is not None else now - memo.unplaced_at > RETRY_UNREAD_X * \
            spec.group(group).gang_schedule_seconds
        if len(waiting) == k and memo.unplaced and not room:
            out.unplaced.append(f"instance {name} ({names}) cannot be placed whole: {memo.unplaced}; its {k} pods "
                                f"of {npus} NPUs wait behind their scheduling gate holding none, until the nodes "
                                "have room for all of them")
            return memo
        out.ungate += [(p["metadata"]["name"], p["metadata"].get("uid", ""),
                        [g for g in p["spec"]["schedulingGates"] if g.get("name") != GANG_GATE]) for p in waiting]
        return replace(memo, ungated_at=now)
    stuck = [(p["metadata"]["name"], why) for p in live.values() if (why := unschedulable(p))]
    if not stuck:
        return memo
    at = memo.ungated_at if memo.ungated_at is not None else now
    deadline = spec.group(group).gang_schedule_seconds
    if now - at < deadline:
        return replace(memo, ungated_at=at)
    pod, why = stuck[0]
    reason = f"{pod}: {why}"
    msg = (f"instance {name}: not every pod was placed within {deadline}s ({reason}); all {k} pods give their "
           "NPUs back and wait until the nodes have room for every one of them")
    out.delete += [(p["metadata"]["name"], p["metadata"].get("uid", ""), msg) for p in live.values()]
    out.events.append(("Warning", "GangUnplaced", msg))
    out.unplaced.append(f"instance {name} ({names}) cannot be placed whole: {reason}")
    return Memo(unplaced=reason, unplaced_at=now)


def _tell(spec: PDDeploymentSpec, group: str, live: dict[int, dict], reports: dict, memo: Memo, now: float,
          out: Plan) -> Memo:
    """The leading pod learns its instance's other pods, when what it reports differs."""
    per = spec.tp(group)
    leader = live[0]
    ips = {i: (p.get("status") or {}).get("podIP") for i, p in live.items()}
    if not all(ips.values()):
        return memo
    members = [GangMember(pod=p["metadata"]["name"], agent_url=f"http://{ips[i]}:{AGENT_PORT}", first_rank=i * per)
               for i, p in sorted(live.items()) if i]
    want = {m.pod: m.agent_url for m in members}
    rep = reports.get(leader["metadata"]["name"])
    said = rep.gang.members if rep is not None and rep.gang is not None else None
    if said == want:
        return memo
    digest = hashlib.sha256(repr(sorted(want.items())).encode()).hexdigest()[:16]
    if digest == memo.told and now - memo.told_at < TELL_EVERY_S:
        return memo
    out.tell.append((leader["metadata"]["name"], f"http://{ips[0]}:{AGENT_PORT}", GangRequest(members=members)))
    return replace(memo, told=digest, told_at=now)
