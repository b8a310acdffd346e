"""Members (pure): who each engine pod is. Before its agent answers, a pod is known by its
labels (group, pod index); once it answers, the identity used for linking (cluster_id,
ip, port, CacheDesc) is what the agent reports about the engine it runs, not what today's
spec would compute: during a roll the two differ. A pod that cannot be read (no index, an
unknown group) becomes a Problem on that member, never an exception for the deployment."""
from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, replace

from pd_contract.agent_api import AgentStatus
from pd_contract.names import llmd_labels
from pd_contract.revisions import revision_of

from .api import PDDeploymentSpec
from .builders import (
    AGENT_PORT,
    ANNOTATION_ROLE,
    GROUPS,
    LABEL_GROUP,
    LABEL_ROLE,
    POD_INDEX_LABEL,
    cluster_id,
    sts_name,
)
from .links import Engine


@dataclass(frozen=True)
class Problem:
    pod: str
    group: str
    message: str


def pod_index(pod: dict) -> int | None:
    idx = pod["metadata"].get("labels", {}).get(POD_INDEX_LABEL)
    if idx is not None and str(idx).isdigit():
        return int(idx)
    tail = pod["metadata"]["name"].rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else None


def pod_ready(pod: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in pod.get("status", {}).get("conditions", []) or [])


def own_statefulsets(children: Iterable[dict], name: str, uid: str) -> set[str]:
    """The uids of the deployment's own StatefulSets: named as it names them and controlled by it
    (a StatefulSet anyone else made, labels or not, does not count)."""
    names = {sts_name(name, g) for g in GROUPS}
    return {o["metadata"].get("uid", "") for o in children if o.get("kind") == "StatefulSet"
            and o["metadata"]["name"] in names
            and any(r.get("uid") == uid and r.get("controller") for r in o["metadata"].get("ownerReferences") or [])}


def claimed_owner(pod: dict) -> str | None:
    """The uid of the StatefulSet the pod says controls it, if any."""
    for r in pod["metadata"].get("ownerReferences") or []:
        if r.get("controller") and r.get("kind") == "StatefulSet":
            return r.get("uid")
    return None


def foreign(pod: dict, own: set[str]) -> Problem | None:
    """Labels alone do not make a member: a pod counts only if one of the deployment's own
    StatefulSets controls it (by uid). Any other pod wearing the labels is reported and left
    alone: not asked (its agent would be sent the operator's token), not linked, not dialled."""
    if claimed_owner(pod) in own:
        return None
    meta = pod["metadata"]
    return Problem(meta["name"], meta.get("labels", {}).get(LABEL_GROUP, "") or "-",
                   "carries the deployment's labels but is not a pod of its StatefulSets: ignored (not asked, "
                   "not linked); delete it or remove the labels")


# pods that only wear a deployment's labels listed in its status, at most: anyone who can create
# pods in the namespace can make more, and status has a size
MAX_STRAYS_LISTED = 8


def listed_strays(pods: list[dict], own: set[str]) -> tuple[tuple[dict, ...], list[Problem]]:
    """The pods that wear the labels without being members (by name, at most MAX_STRAYS_LISTED),
    and their problems; the last one says how many more there are."""
    all_strays = sorted((p for p in pods if claimed_owner(p) not in own), key=lambda p: p["metadata"]["name"])
    shown = tuple(all_strays[:MAX_STRAYS_LISTED])
    problems = [pr for p in shown if (pr := foreign(p, own))]
    more = len(all_strays) - len(shown)
    if more and problems:
        last = problems[-1]
        problems[-1] = Problem(last.pod, last.group, f"{last.message} ({more} more pods carry the deployment's "
                                                     f"labels and are not listed)")
    return shown, problems


def member_of(pod: dict, spec: PDDeploymentSpec) -> Engine | Problem | None:
    """The member a pod is; None for a pod of an instance that another pod leads (it holds ranks only)."""
    meta = pod["metadata"]
    labels = meta.get("labels", {})
    group = labels.get(LABEL_GROUP, "")
    if group not in GROUPS:
        return Problem(meta["name"], group or "-", f"unknown {LABEL_GROUP} label {group!r}: expected prefill or "
                                                   f"decoder; this pod is not linked")
    index = pod_index(pod)
    if index is None:
        return Problem(meta["name"], group, f"no {POD_INDEX_LABEL} label and no ordinal in the name: not a pod of "
                                            f"the {group} StatefulSet; it is not linked")
    k = spec.pods_per_instance(group)
    if index % k:
        return None
    followers = tuple(f"{meta['name'].rsplit('-', 1)[0]}-{index + i}" for i in range(1, k))
    ip = pod.get("status", {}).get("podIP")
    statuses = pod.get("status", {}).get("containerStatuses") or [{}]
    starting = not pod_ready(pod) and "running" in (statuses[0].get("state") or {}) \
        and not statuses[0].get("restartCount")
    role = labels.get(LABEL_ROLE, group)
    llmd_ok = all(labels.get(k) == v for k, v in llmd_labels(role).items())
    return Engine(pod=meta["name"], group=group, role=role, label=role, llmd_ok=llmd_ok, uid=meta.get("uid", ""),
                  assigned=(meta.get("annotations") or {}).get(ANNOTATION_ROLE),
                  cluster_id=cluster_id(spec, group, index), ip=ip, port=spec.datadist.port,
                  tp=spec.instance_ranks(group),
                  ready=pod_ready(pod), agent_url=f"http://{ip}:{AGENT_PORT}" if ip else None,
                  terminating=bool(meta.get("deletionTimestamp")), starting=starting,
                  revision=revision_of(pod.get("spec")), followers=followers)


def canonical(desc: dict) -> str:
    return json.dumps(desc, sort_keys=True, separators=(",", ":"))


def with_report(e: Engine, s: AgentStatus) -> Engine:
    """The engine as its agent describes it."""
    return replace(e, agent_ok=s.initialized, boot_id=s.boot_id, cluster_id=s.cluster_id, ip=s.ip or e.ip,
                   port=s.port, cache_desc=canonical(s.cache_desc), draining=s.draining or s.terminating,
                   busy=s.load.in_flight > 0 or s.load.pending_kv > 0, in_flight=s.load.in_flight,
                   pending_kv=s.load.pending_kv, engine_role="prefill" if s.role == "prompt" else "decoder",
                   switchable=s.switchable, links_in=len(s.incoming), tp=max(1, s.tensor_parallel),
                   ranks=tuple((r.cluster_id, r.ip, r.port) for r in s.ranks),
                   superpod=s.preflight.superpod if s.preflight is not None else "")
