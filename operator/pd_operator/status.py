"""Status as a pure function of one pass's observation: members, counts, phase and
conditions. Linear in members plus failures: healthy links are counted, failing ones are
listed. Condition messages carry no number that changes from pass to pass (durations go to
`lastVerified`), so a pass that changes nothing writes nothing."""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

from pd_contract.names import MAX_LINKS_PER_ENGINE

from . import conditions as cond
from . import links as lk
from .api import PDDeploymentSpec
from .builders import LABEL_GROUP, LABEL_ROLE
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
# a member's failing links named in status (beyond these, failingLinkCounts counts them all per code): with
# every link down at 128P+128D TP 8 the list alone was 10 MiB, over what etcd stores, so the status
# write failed exactly when it mattered
MAX_FAILING_NAMED = 5
MAX_ERROR_CHARS = 256   # a member's lastError, cut (an agent's exception text can be long)


def pod_problem(pod: dict) -> Diagnosis | None:
    for cs in pod.get("status", {}).get("containerStatuses", []) or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        reason = POD_PROBLEMS.get(waiting.get("reason", ""))
        if reason:
            return Diagnosis(reason, f"{pod['metadata']['name']}: {waiting.get('reason')}: "
                                     f"{waiting.get('message', '')}".strip())
    return None


Verdict = tuple[bool | str, str, str]   # a condition's (status, reason, message)


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
    verify_digest: str | None = None      # verification.link_digest of what the last round verified
    last_verified: dict | None = None     # status.lastVerified as recorded, while that round stands (a takeover)
    proxy: dict[str, dict[str, str]] = field(default_factory=dict)
    model_id: int = 0
    topology: str = "FullMesh"
    blocked: Diagnosis | None = None      # a terminal error (rejected apply): reported, not retried hot
    strays: list[dict] = field(default_factory=list)   # pods that only wear the labels: listed, never members
    gateway_keys: Verdict | None = None   # the gateway's keys Secret opted in, or why not (gateway enabled)
    inference_pool: Verdict | None = None  # InferencePoolReady (spec.routing.inferencePool)
    preflight: Verdict | None = None      # NetworkPreflight (preflight.py); None: the condition goes
    superpod_pairs: dict | None = None    # status.superpodPairs (preflight.superpod_pairs)
    revision_skew: Verdict | None = None  # RevisionSkew (rollout.py), present while revisions coexist
    per_decoder: dict[str, tuple[int, int, list[dict]]] | None = None  # links.per_decoder, if computed already
    switches: list = field(default_factory=list)        # switch.Switch in flight
    last_switch: dict | None = None                     # status.lastSwitch
    decision: Decision | None = None                    # this pass's switch decision (None: no rebalance)
    cooldown_until: str | None = None
    retry_after: str | None = None
    last_decision: dict | None = None                   # status.lastDecision
    selector: str | None = None                         # the engine pods' label selector (scale subresource)
    desired_pods: int | None = None                     # what the StatefulSets were sized to
    group_sizes: dict | None = None                     # method Replace: status.rebalance.groupSizes
    rank_reports: dict[str, tuple[int, int, str]] = field(default_factory=dict)  # pod -> (TP, initialised, source)
    abort_refused: str | None = None    # a switch asked to abort that is past switch_role: why not
    stuck: str | None = None            # switches in one step longer than stuckAfterSeconds
    unplaced: list[str] = field(default_factory=list)   # instances of several pods that cannot be placed whole
    instance_of: dict[str, tuple[str, str]] = field(default_factory=dict)   # pod -> (instance, its leading pod)


def _listed(messages: list[str]) -> str:
    shown = " | ".join(messages[:MAX_LISTED])
    return shown + (f" | and {len(messages) - MAX_LISTED} more" if len(messages) > MAX_LISTED else "")


def _cut(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _members(obs: Observed, per: dict[str, tuple[int, int, list[dict]]],
             failures_by_decoder: dict[str, list[tuple[int, str]]]) -> list[dict]:
    by_pod: dict[str, Engine | Problem] = {e.pod: e for e in obs.engines}
    by_pod.update({p.pod: p for p in obs.problems})
    names = {e.pod: e for e in obs.engines}
    by_cid = {e.cluster_id: e.pod for e in obs.engines}
    out = []
    for p in sorted(obs.pods + obs.strays, key=lambda p: (p["metadata"].get("labels", {}).get(LABEL_GROUP, ""),
                                             pod_index(p) or 0, p["metadata"]["name"])):
        name = p["metadata"]["name"]
        m, inst = by_pod.get(name), obs.instance_of.get(name)
        if m is None and inst is not None:   # it holds ranks of an instance its leading pod is the member for
            out.append({"pod": name, "group": p["metadata"].get("labels", {}).get(LABEL_GROUP, "-"),
                        "role": p["metadata"].get("labels", {}).get(LABEL_ROLE, "-"), "ready": pod_ready(p),
                        "instance": inst[0], "leader": inst[1]})
            continue
        if isinstance(m, Problem) or m is None:
            out.append({"pod": name, "group": m.group if m else "-", "role": "-", "ready": pod_ready(p),
                        "lastError": m.message if m else "not a member"})
            continue
        e = names[name]
        row = {"pod": e.pod, "group": e.group, "role": e.label or e.role, "clusterId": e.cluster_id, "ip": e.ip,
               "port": e.port, "ready": e.ready, "bootId": obs.boot_ids.get(e.pod),
               "assignedRole": e.assigned, "instance": inst[0] if inst else None}
        if e.pod in per:
            expected, up, down = per[e.pod]
            row["links"] = {"expected": expected, "up": up}
            failing: dict[tuple[int, int], str] = {}
            for l in down:
                bad = [r for r in l.get("ranks") or []
                       if not r.get("healthy", True) or r.get("code") != "LLM_SUCCESS"]
                for r in bad:
                    failing[(l["cluster_id"], r["rank"])] = r["code"]
                if not bad:
                    failing[(l["cluster_id"], -1)] = l["code"]
            for cid, code in failures_by_decoder.get(e.pod, []):
                if not any(k[0] == cid for k in failing):
                    failing[(cid, -1)] = code
            if failing:
                named = sorted(failing.items())[:MAX_FAILING_NAMED]
                row["failingLinks"] = [{"peer": by_cid.get(cid, str(cid)), "clusterId": cid, "code": code,
                                        **({"rank": rank} if rank >= 0 else {})} for (cid, rank), code in named]
                if len(failing) > len(named):
                    counts: dict[str, int] = {}
                    for code in failing.values():
                        counts[code] = counts.get(code, 0) + 1
                    row["failingLinkCounts"] = dict(sorted(counts.items()))
        rep = obs.rank_reports.get(e.pod)
        if rep is not None and (rep[0] > 1 or rep[2] not in ("", "pod-ip")):
            row["ranks"] = {"tensorParallel": rep[0], "initialized": rep[1],
                            **({"deviceIps": rep[2]} if rep[2] else {})}
        problem = pod_problem(p)
        err = obs.agent_errors.get(e.pod)
        if err or problem:
            row["lastError"] = _cut(err[1] if err else problem.message if problem else "")
        out.append({k: v for k, v in row.items() if v is not None})
    return out




def unschedulable(pod: dict) -> str | None:
    """The scheduler's word on a pod it cannot place (which resource is short, taints), or None."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable":
            return (c.get("message") or "no reason given").strip()[:400]
    return None


def _requests(pod: dict) -> str:
    """What the pod's containers request, summed (the numbers the scheduler compared)."""
    total: dict[str, list[str]] = {}
    for ctr in (pod.get("spec") or {}).get("containers") or []:
        for k, v in ((ctr.get("resources") or {}).get("requests") or {}).items():
            total.setdefault(k, []).append(str(v))
    return ", ".join(f"{k}={'+'.join(v)}" for k, v in sorted(total.items()))


def pods_ready(obs: Observed, desired_pods: int) -> Verdict:
    live = obs.pods
    ready = [p for p in live if pod_ready(p)]
    problems = [d for d in (pod_problem(p) for p in live) if d]
    strays = [p for p in obs.problems if any(x["metadata"]["name"] == p.pod for x in live)]
    if problems:
        return False, problems[0].reason, _listed([d.message for d in problems])
    if obs.unplaced:
        return False, "Unschedulable", _listed(obs.unplaced)
    if len(ready) >= desired_pods and len(live) - len(strays) == desired_pods:
        return True, "AllPodsReady", f"{len(ready) - len(strays)}/{desired_pods} pods ready"
    waiting = sorted(p["metadata"]["name"] for p in live if not pod_ready(p))
    stuck = [(p["metadata"]["name"], why, _requests(p)) for p in live if (why := unschedulable(p))]
    if stuck:
        pod, why, req = stuck[0]
        more = f" ({len(stuck) - 1} more pods likewise)" if len(stuck) > 1 else ""
        return (False, "Unschedulable", f"{len(ready)}/{desired_pods} pods ready; {pod} cannot be scheduled: {why}"
                + (f" It requests {req}." if req else "") + more)
    return (False, "PodsNotReady", f"{len(ready)}/{desired_pods} pods ready"
            + (f"; waiting for {', '.join(waiting[:MAX_LISTED])}" if waiting else "")
            + (f" and {len(waiting) - MAX_LISTED} more" if len(waiting) > MAX_LISTED else ""))


def agents_ready(obs: Observed) -> Verdict:
    if obs.agent_errors:
        errors = sorted(obs.agent_errors.items())
        return False, errors[0][1][0], _listed([f"{pod}: {msg}" for pod, (_, msg) in errors])
    return True, "AgentsReachable", "every ready pod's agent answers"


def links_ready(obs: Observed, expected: int, up: int) -> Verdict:
    failures = sorted(obs.link_failures.items())
    mismatched = lk.mismatches(obs.engines)
    if failures:
        return False, failures[0][1][1].reason, _listed([d.message for _, (_, d) in failures])
    if mismatched:
        return (False, "CacheDescMismatch", _listed(
            [f"{d.pod} and {p.pod} run different CacheDescs and are not linked" for d, p in mismatched])
            + "; expected while a model change rolls out, otherwise check spec.model.kvCache")
    if expected == 0:
        return False, "NoPeers", "need at least one ready prefill and one ready decoder to link"
    for role, other in (("prefill", "decoder"), ("decoder", "prefill")):
        n = sum(1 for e in obs.engines if e.role == other and e.serving)
        if n > MAX_LINKS_PER_ENGINE:
            return (False, "LinkLimit", f"each {role} engine would hold {n} links (one per {other} pod's matching "
                    f"rank); llm_datadist allows {MAX_LINKS_PER_ENGINE} per engine: fewer {other} pods, or more "
                    f"tensor parallelism per pod")
    if up < expected:
        return False, "Linking", f"{up}/{expected} links up"
    return True, "AllLinksUp", f"{up}/{expected} links up"


def kv_path_verified(obs: Observed, expected: int, up: int, prev: dict | None) -> Verdict | None:
    """None: what it said stands (a failure is not forgotten while links come and go)."""
    results = [obs.verify[d] for d in sorted(obs.verify)]
    bad = [r for r in results if not r["ok"]]
    if bad:
        diags = [verify_failure(r["code"], *_rank_pair(r), r.get("message", ""), obs.model_id) for r in bad]
        return False, diags[0].reason, _listed([d.message for d in diags])
    if results and expected and up == expected:
        return True, "Verified", "every decoder pulled a probe cache from a prefill and the bytes matched"
    if obs.last_verified and expected and up == expected:
        return None   # a round recorded before a takeover stands (verification.py)
    if not prev or prev["status"] == "True":
        return "Unknown", "NotYetVerified", "waiting for every link to be up"
    return None


def kv_content(obs: Observed) -> Verdict | None:
    """The reference engine's content probe. Negative polarity: True names the pairs and ranks
    whose pulled KV is not the model's. None: no probe answered yet."""
    results = [obs.verify[d] for d in sorted(obs.verify)]
    bad = [r for r in results if r["code"] == "KV_CONTENT_MISMATCH"]
    if bad:
        return True, "KVContentMismatch", _listed([
            verify_failure(r["code"], *_rank_pair(r), r.get("message", ""), obs.model_id).message for r in bad])
    if results and all(r["ok"] for r in results):
        return False, "ContentMatches", ("every decoder's KV of the probe prompt, as pulled, is what the model "
                                         "computes, and decodes as one engine alone does")
    return None   # no answer yet, or other failures (KVPathVerified names them): what it said stands


def _rank_pair(r: dict) -> tuple[str, str]:
    """(decoder, prefill) of a verification, naming the first rank pair that failed."""
    bad = next((x for x in r.get("ranks") or [] if not x["ok"]), None)
    if bad is None:
        return r["decoder"], r["prefill"]
    peer_rank = bad["rank"] if bad.get("peer_rank") is None else bad["peer_rank"]
    return f"{r['decoder']} rank {bad['rank']}", f"{r['prefill']} rank {peer_rank}"


def proxy_environment(obs: Observed) -> Verdict:
    """Negative polarity: True is the warning."""
    if obs.proxy:
        d = proxy_warning(obs.proxy)
        return True, d.reason, d.message
    return False, "NoProxyVariables", "no agent reports proxy variables"


LISTED_SWITCHES = 4   # more switches in flight than this are counted, not listed, in the Rebalancing condition


def rebalancing(obs: Observed) -> Verdict | None:
    """True while a switch is in flight; otherwise why no switch is started (None: no policy)."""
    if obs.abort_refused:
        return True, "AbortRefused", obs.abort_refused
    if obs.stuck:
        return True, "SwitchStuck", obs.stuck
    if len(obs.switches) > LISTED_SWITCHES:
        # a whole move of a large fleet: counted by direction and step, so the message stays short
        counts = collections.Counter((s.from_, s.to, s.step) for s in obs.switches)
        return True, "Switching", f"{len(obs.switches)} switches: " + "; ".join(
            f"{n} {frm} -> {to} at {step}" for (frm, to, step), n in sorted(counts.items()))
    if obs.switches:
        return True, "Switching", "; ".join(f"{s.pod}: {s.from_} -> {s.to}, step {s.step}"
                                            + (f" ({s.message})" if s.message else "") for s in obs.switches)
    if obs.decision is not None:
        return False, obs.decision.reason, obs.decision.message
    return None


def degraded(obs: Observed) -> bool:
    """Something failed (as opposed to something still coming up)."""
    return bool(any(pod_problem(p) for p in obs.pods) or obs.agent_errors or obs.link_failures
                or any(not r["ok"] for r in obs.verify.values()) or obs.blocked
                or (obs.gateway_keys is not None and not obs.gateway_keys[0]))


def phase_of(obs: Observed, conds: list[dict]) -> str:
    if degraded(obs):
        return "Degraded"
    if obs.switches:
        return "Switching"
    if not cond.is_true(conds, "PodsReady"):
        return "Pending"
    if not (cond.is_true(conds, "LinksReady") and cond.is_true(conds, "KVPathVerified")):
        return "Linking"
    return "Ready"


def ready(obs: Observed, phase: str, conds: list[dict]) -> Verdict:
    """The summary: the first summarised condition not in its good state explains it."""
    if obs.blocked:
        return False, obs.blocked.reason, obs.blocked.message
    if phase == "Ready":
        return True, "Ready", "links up and KV path verified"
    why = cond.first_unhealthy(conds) or {"reason": phase, "message": ""}
    return False, why["reason"], why["message"]


def build_status(spec: PDDeploymentSpec, obs: Observed, previous: dict | None, at: str) -> dict:
    """`at`: the time a condition that flips records (the pass's clock)."""
    conds: list[dict] = list((previous or {}).get("conditions") or [])
    gen = obs.generation
    desired_pods = obs.desired_pods if obs.desired_pods is not None else spec.total
    live = obs.pods
    per = obs.per_decoder if obs.per_decoder is not None else lk.per_decoder(obs.engines, obs.reported, obs.topology)
    expected, up = lk.totals(per)
    failures_by_decoder: dict[str, list[tuple[int, str]]] = {}
    for (dpod, cid), (code, _) in obs.link_failures.items():
        failures_by_decoder.setdefault(dpod, []).append((cid, code))
    members = _members(obs, per, failures_by_decoder)

    for ctype, verdict in (("PodsReady", pods_ready(obs, desired_pods)), ("AgentsReady", agents_ready(obs)),
                           ("LinksReady", links_ready(obs, expected, up)),
                           ("KVPathVerified", kv_path_verified(obs, expected, up, cond.get(conds, "KVPathVerified"))),
                           ("ProxyEnvironment", proxy_environment(obs))):
        if verdict is not None:
            conds = cond.set_condition(conds, ctype, *verdict, gen, at=at)
    if spec.backend == "sim" and spec.sim is not None and spec.sim.engine == "reference":
        content = kv_content(obs)
        if content is not None:
            conds = cond.set_condition(conds, "KVContentMismatch", *content, gen, at=at)
    else:
        conds = [c for c in conds if c["type"] != "KVContentMismatch"]
    phase = phase_of(obs, conds)
    conds = cond.set_condition(conds, "Ready", *ready(obs, phase, conds), gen, at=at)
    conds = cond.set_condition(conds, "GatewayKeys", *obs.gateway_keys, gen, at=at) \
        if obs.gateway_keys is not None else [c for c in conds if c["type"] != "GatewayKeys"]
    for ctype, verdict in (("InferencePoolReady", obs.inference_pool), ("NetworkPreflight", obs.preflight),
                           ("RevisionSkew", obs.revision_skew)):
        conds = cond.set_condition(conds, ctype, *verdict, gen, at=at) if verdict is not None \
            else [c for c in conds if c["type"] != ctype]
    reb = rebalancing(obs)
    conds = cond.set_condition(conds, "Rebalancing", *reb, gen, at=at) if reb is not None \
        else [c for c in conds if c["type"] != "Rebalancing"]
    results = [obs.verify[d] for d in sorted(obs.verify)]
    ready_pods = [p for p in live if pod_ready(p)]

    ready_names = {p["metadata"]["name"] for p in ready_pods}
    out = {
        "phase": phase,
        "prefill": sum(1 for e in obs.engines if e.role == "prefill" and e.pod in ready_names),
        "decoder": sum(1 for e in obs.engines if e.role == "decoder" and e.pod in ready_names),
        "links": {"expected": expected, "up": up},
        "linksSummary": f"{up}/{expected}",
        **({"superpodPairs": obs.superpod_pairs} if obs.superpod_pairs is not None else {}),
        "members": members,
        "conditions": conds,
        "cacheDesc": cache_desc_status(spec),
        # the scale subresource's: instances (an instance of several pods counts once)
        "replicas": sum(1 for p in live if obs.instance_of.get(p["metadata"]["name"], ("", p["metadata"]["name"]))[1]
                        == p["metadata"]["name"]),
    }
    return _with_rounds(out, obs, results)


def cache_desc_status(spec: PDDeploymentSpec) -> dict:
    """status.cacheDesc: the CacheDesc the engines run with, and what it costs."""
    derived = derive(spec.kv_cache_for("prefill"))
    cache = {"numTensors": derived.num_tensors, "shape": derived.shape, "dataType": derived.data_type,
             "bytesPerToken": derived.bytes_per_token, "cacheBytes": derived.cache_bytes}
    if derived.blocks_shape:
        cache["blocksShape"] = derived.blocks_shape
    if spec.backend == "sim":
        cache["simMemoryScale"] = derived.sim_memory_scale()
    return cache


def _with_rounds(out: dict, obs: Observed, results: list[dict]) -> dict:
    """The fields of the last verification round, the switches and the rebalancing, when set."""
    good = [r for r in results if r["ok"]]
    if good:
        pairs = lambda r: f" ({len(r['ranks'])} rank pairs)" if r.get("ranks") else ""  # noqa: E731
        out["lastVerified"] = {"paths": [f"{r['decoder']} <- {r['prefill']}{pairs(r)}" for r in good],
                               "bytes": sum(r["bytes"] for r in good),
                               "slowestPullMs": round(max(r["pull_ms"] for r in good), 2),
                               **({"at": obs.verified_at} if obs.verified_at else {}),
                               **({"links": obs.verify_digest} if obs.verify_digest else {})}
    elif obs.last_verified:
        out["lastVerified"] = obs.last_verified
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
        if obs.retry_after:
            rb["retryAfter"] = obs.retry_after
        rb = {k: v for k, v in rb.items() if v is not None}
        if rb:   # never `{}`: server-side apply turns an empty map into null (kubernetes#135841)
            out["rebalance"] = rb
    if obs.observed_generation is not None:
        out["observedGeneration"] = obs.observed_generation
    return out
