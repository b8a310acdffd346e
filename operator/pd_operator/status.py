"""Status as a pure function of one pass's observation: members, counts, phase and
conditions. Linear in members plus failures: healthy links are counted, failing ones are
listed. Condition messages carry no number that changes from pass to pass (durations go to
`lastVerified`), so a pass that changes nothing writes nothing."""
from __future__ import annotations

from dataclasses import dataclass, field

from . import conditions as cond
from . import links as lk
from .api import PDDeploymentSpec
from .builders import LABEL_GROUP
from .cachedesc import derive
from .diagnosis import Diagnosis, proxy_warning, verify_failure
from .links import Engine
from .members import Problem, pod_index, pod_ready
from .switch import Decision

POD_PROBLEMS = {
    "ErrImagePull": "ImagePullError", "ImagePullBackOff": "ImagePullError", "InvalidImageName": "ImagePullError",
    "CrashLoopBackOff": "CrashLoopBackOff", "CreateContainerConfigError": "ConfigError",
    "CreateContainerError": "ConfigError", "RunContainerError": "CrashLoopBackOff",
}
MAX_LISTED = 5   # failures named in one condition message; the rest are counted


def pod_problem(pod: dict) -> Diagnosis | None:
    for cs in pod.get("status", {}).get("containerStatuses", []) or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        reason = POD_PROBLEMS.get(waiting.get("reason", ""))
        if reason:
            return Diagnosis(reason, f"{pod['metadata']['name']}: {waiting.get('reason')}: "
                                     f"{waiting.get('message', '')}".strip())
    return None


@dataclass
class Observed:
    """Everything one pass saw, and what the operator remembers of earlier passes."""
    generation: int
    pods: list[dict]                      # live engine pods (no deletionTimestamp)
    engines: list[Engine]                 # readable members, leaving ones included, with agents' reports
    problems: list[Problem] = field(default_factory=list)   # members that cannot be read
    observed_generation: int | None = None  # the generation whose children were applied
    boot_ids: dict[str, str] = field(default_factory=dict)
    agent_errors: dict[str, tuple[str, str]] = field(default_factory=dict)   # pod -> (reason, message)
    reported: dict[str, list[dict]] = field(default_factory=dict)            # decoder -> link states
    link_failures: dict[tuple[str, int], tuple[str, Diagnosis]] = field(default_factory=dict)  # -> (code, diag)
    verify: dict[str, dict] = field(default_factory=dict)  # decoder -> last VerifyResult dict
    verified_at: str | None = None
    proxy: dict[str, dict[str, str]] = field(default_factory=dict)
    model_id: int = 0
    topology: str = "FullMesh"
    blocked: Diagnosis | None = None      # a terminal error (rejected apply): reported, not retried hot
    per_decoder: dict[str, tuple[int, int, list[dict]]] | None = None  # links.per_decoder, if computed already
    switches: list = field(default_factory=list)        # switch.Switch in flight
    last_switch: dict | None = None                     # status.lastSwitch
    decision: Decision | None = None                    # this pass's switch decision (None: no rebalance)
    cooldown_until: str | None = None
    last_decision: dict | None = None                   # status.lastDecision
    selector: str | None = None                         # the engine pods' label selector (scale subresource)
    desired_pods: int | None = None                     # what the StatefulSets were sized to
    group_sizes: dict | None = None                     # method Replace: status.rebalance.groupSizes


def _listed(messages: list[str]) -> str:
    shown = " | ".join(messages[:MAX_LISTED])
    return shown + (f" | and {len(messages) - MAX_LISTED} more" if len(messages) > MAX_LISTED else "")


def _members(obs: Observed, per: dict[str, tuple[int, int, list[dict]]],
             failures_by_decoder: dict[str, list[tuple[int, str]]]) -> list[dict]:
    by_pod: dict[str, Engine | Problem] = {e.pod: e for e in obs.engines}
    by_pod.update({p.pod: p for p in obs.problems})
    names = {e.pod: e for e in obs.engines}
    by_cid = {e.cluster_id: e.pod for e in obs.engines}
    out = []
    for p in sorted(obs.pods, key=lambda p: (p["metadata"].get("labels", {}).get(LABEL_GROUP, ""),
                                             pod_index(p) or 0, p["metadata"]["name"])):
        name = p["metadata"]["name"]
        m = by_pod.get(name)
        if isinstance(m, Problem) or m is None:
            out.append({"pod": name, "group": m.group if m else "-", "role": "-", "ready": pod_ready(p),
                        "lastError": m.message if m else "not a member"})
            continue
        e = names[name]
        row = {"pod": e.pod, "group": e.group, "role": e.label or e.role, "clusterId": e.cluster_id, "ip": e.ip,
               "port": e.port, "ready": e.ready, "bootId": obs.boot_ids.get(e.pod),
               "assignedRole": e.assigned}
        if e.pod in per:
            expected, up, down = per[e.pod]
            row["links"] = {"expected": expected, "up": up}
            failing = {l["cluster_id"]: l["code"] for l in down}
            for cid, code in failures_by_decoder.get(e.pod, []):
                failing.setdefault(cid, code)
            if failing:
                row["failingLinks"] = [{"peer": by_cid.get(cid, str(cid)), "clusterId": cid, "code": code}
                                       for cid, code in sorted(failing.items())]
        problem = pod_problem(p)
        err = obs.agent_errors.get(e.pod)
        if err or problem:
            row["lastError"] = err[1] if err else problem.message if problem else ""
        out.append({k: v for k, v in row.items() if v is not None})
    return out


def build_status(spec: PDDeploymentSpec, obs: Observed, previous: dict | None) -> dict:
    conds = (previous or {}).get("conditions")
    gen = obs.generation
    desired_pods = obs.desired_pods if obs.desired_pods is not None else spec.total
    live = obs.pods
    ready = [p for p in live if pod_ready(p)]
    per = obs.per_decoder if obs.per_decoder is not None else lk.per_decoder(obs.engines, obs.reported, obs.topology)
    expected, up = lk.totals(per)
    failures_by_decoder: dict[str, list[tuple[int, str]]] = {}
    for (dpod, cid), (code, _) in obs.link_failures.items():
        failures_by_decoder.setdefault(dpod, []).append((cid, code))
    members = _members(obs, per, failures_by_decoder)

    # PodsReady
    problems = [d for d in (pod_problem(p) for p in live) if d]
    strays = [p for p in obs.problems if any(x["metadata"]["name"] == p.pod for x in live)]
    if problems:
        conds = cond.set_condition(conds, "PodsReady", False, problems[0].reason,
                                   _listed([d.message for d in problems]), gen)
    elif len(ready) >= desired_pods and len(live) - len(strays) == desired_pods:
        conds = cond.set_condition(conds, "PodsReady", True, "AllPodsReady",
                                   f"{len(ready) - len(strays)}/{desired_pods} pods ready", gen)
    else:
        waiting = sorted(p["metadata"]["name"] for p in live if not pod_ready(p))
        conds = cond.set_condition(conds, "PodsReady", False, "PodsNotReady",
                                   f"{len(ready)}/{desired_pods} pods ready"
                                   + (f"; waiting for {', '.join(waiting[:MAX_LISTED])}" if waiting else "")
                                   + (f" and {len(waiting) - MAX_LISTED} more" if len(waiting) > MAX_LISTED else ""),
                                   gen)
    # AgentsReady
    if obs.agent_errors:
        first = sorted(obs.agent_errors.items())[0][1][0]
        conds = cond.set_condition(conds, "AgentsReady", False, first, _listed(
            [f"{pod}: {msg}" for pod, (_, msg) in sorted(obs.agent_errors.items())]), gen)
    else:
        conds = cond.set_condition(conds, "AgentsReady", True, "AgentsReachable", "every ready pod's agent answers",
                                   gen)
    # LinksReady
    failures = sorted(obs.link_failures.items())
    mismatched = lk.mismatches(obs.engines)
    if failures:
        diag = failures[0][1][1]
        conds = cond.set_condition(conds, "LinksReady", False, diag.reason,
                                   _listed([d.message for _, (_, d) in failures]), gen)
    elif mismatched:
        conds = cond.set_condition(conds, "LinksReady", False, "CacheDescMismatch", _listed(
            [f"{d.pod} and {p.pod} run different CacheDescs and are not linked" for d, p in mismatched])
            + "; expected while a model change rolls out, otherwise check spec.model.kvCache", gen)
    elif expected == 0:
        conds = cond.set_condition(conds, "LinksReady", False, "NoPeers",
                                   "need at least one ready prefill and one ready decoder to link", gen)
    elif up < expected:
        conds = cond.set_condition(conds, "LinksReady", False, "Linking", f"{up}/{expected} links up", gen)
    else:
        conds = cond.set_condition(conds, "LinksReady", True, "AllLinksUp", f"{up}/{expected} links up", gen)
    # KVPathVerified
    results = [obs.verify[d] for d in sorted(obs.verify)]
    bad = [r for r in results if not r["ok"]]
    if bad:
        diags = [verify_failure(r["code"], r["decoder"], r["prefill"], r.get("message", ""), obs.model_id)
                 for r in bad]
        conds = cond.set_condition(conds, "KVPathVerified", False, diags[0].reason,
                                   _listed([d.message for d in diags]), gen)
    elif results and expected and up == expected:
        conds = cond.set_condition(conds, "KVPathVerified", True, "Verified",
                                   "every decoder pulled a probe cache from a prefill and the bytes matched", gen)
    else:
        prev = cond.get(conds, "KVPathVerified")
        if not prev or prev["status"] == "True":
            conds = cond.set_condition(conds, "KVPathVerified", "Unknown", "NotYetVerified",
                                       "waiting for every link to be up", gen)
    # ProxyEnvironment
    if obs.proxy:
        d = proxy_warning(obs.proxy)
        conds = cond.set_condition(conds, "ProxyEnvironment", True, d.reason, d.message, gen)
    else:
        conds = cond.set_condition(conds, "ProxyEnvironment", False, "NoProxyVariables",
                                   "no agent reports proxy variables", gen)

    # phase and summary
    degraded = bool(problems or obs.agent_errors or failures or bad or obs.blocked)
    pods_ok = cond.is_true(conds, "PodsReady")
    links_ok = cond.is_true(conds, "LinksReady")
    verified = cond.is_true(conds, "KVPathVerified")
    if degraded:
        phase = "Degraded"
    elif obs.switches:
        phase = "Switching"
    elif not pods_ok:
        phase = "Pending"
    elif not (links_ok and verified):
        phase = "Linking"
    else:
        phase = "Ready"
    not_ok = [c for c in (conds or []) if c["type"] in ("PodsReady", "AgentsReady", "LinksReady", "KVPathVerified")
              and c["status"] != "True"]
    if obs.blocked:
        conds = cond.set_condition(conds, "Ready", False, obs.blocked.reason, obs.blocked.message, gen)
    elif phase == "Ready":
        conds = cond.set_condition(conds, "Ready", True, "Ready", "links up and KV path verified", gen)
    else:
        why = not_ok[0] if not_ok else {"reason": phase, "message": ""}
        conds = cond.set_condition(conds, "Ready", False, why["reason"], why["message"], gen)

    # Rebalancing: True while a switch is in flight; otherwise why no switch is started
    if obs.switches:
        conds = cond.set_condition(conds, "Rebalancing", True, "Switching", "; ".join(
            f"{s.pod}: {s.from_} -> {s.to}, step {s.step}" + (f" ({s.message})" if s.message else "")
            for s in obs.switches), gen)
    elif obs.decision is not None:
        conds = cond.set_condition(conds, "Rebalancing", False, obs.decision.reason, obs.decision.message, gen)
    else:
        conds = [c for c in conds or [] if c["type"] != "Rebalancing"]

    derived = derive(spec.model.kv_cache)
    cache = {"numTensors": derived.num_tensors, "shape": derived.shape, "dataType": derived.data_type,
             "bytesPerToken": derived.bytes_per_token, "cacheBytes": derived.cache_bytes}
    if derived.blocks_shape:
        cache["blocksShape"] = derived.blocks_shape
    if spec.backend == "sim":
        cache["simMemoryScale"] = derived.sim_memory_scale()
    ready_names = {p["metadata"]["name"] for p in ready}
    out = {
        "phase": phase,
        "prefill": sum(1 for e in obs.engines if e.role == "prefill" and e.pod in ready_names),
        "decoder": sum(1 for e in obs.engines if e.role == "decoder" and e.pod in ready_names),
        "links": {"expected": expected, "up": up},
        "linksSummary": f"{up}/{expected}",
        "members": members,
        "conditions": conds,
        "cacheDesc": cache,
        "replicas": len(live),
    }
    good = [r for r in results if r["ok"]]
    if good:
        out["lastVerified"] = {"paths": [f"{r['decoder']} <- {r['prefill']}" for r in good],
                               "bytes": sum(r["bytes"] for r in good),
                               "slowestPullMs": round(max(r["pull_ms"] for r in good), 2),
                               **({"at": obs.verified_at} if obs.verified_at else {})}
    if obs.switches:
        out["switches"] = [s.to_status() for s in obs.switches]
    if obs.last_switch:
        out["lastSwitch"] = obs.last_switch
    if obs.last_decision:
        out["lastDecision"] = obs.last_decision
    if obs.selector:
        out["selector"] = obs.selector
    if obs.decision is not None:
        rb: dict[str, object] = {"targetPrefill": obs.decision.target, "groupSizes": obs.group_sizes}
        if obs.cooldown_until:
            rb["cooldownUntil"] = obs.cooldown_until
        rb = {k: v for k, v in rb.items() if v is not None}
        if rb:   # never `{}`: server-side apply turns an empty map into null (kubernetes#135841)
            out["rebalance"] = rb
    if obs.observed_generation is not None:
        out["observedGeneration"] = obs.observed_generation
    return out
