"""Status as a pure function of what was observed: pods, agent reports, link attempts and
verification results -> members, counts, phase and conditions."""
from __future__ import annotations

from dataclasses import dataclass, field

from . import conditions as cond
from .api import PDDeploymentSpec
from .builders import AGENT_PORT, LABEL_GROUP, LABEL_ROLE, POD_INDEX_LABEL, cluster_id
from .cachedesc import derive
from .diagnosis import Diagnosis, proxy_warning, verify_failure
from .links import Engine

POD_PROBLEMS = {
    "ErrImagePull": "ImagePullError", "ImagePullBackOff": "ImagePullError", "InvalidImageName": "ImagePullError",
    "CrashLoopBackOff": "CrashLoopBackOff", "CreateContainerConfigError": "ConfigError",
    "CreateContainerError": "ConfigError", "RunContainerError": "CrashLoopBackOff",
}


def pod_index(pod: dict) -> int:
    idx = pod["metadata"].get("labels", {}).get(POD_INDEX_LABEL)
    if idx is not None and str(idx).isdigit():
        return int(idx)
    return int(pod["metadata"]["name"].rsplit("-", 1)[-1])


def pod_ready(pod: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in pod.get("status", {}).get("conditions", []) or [])


def pod_problem(pod: dict) -> Diagnosis | None:
    for cs in pod.get("status", {}).get("containerStatuses", []) or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        reason = POD_PROBLEMS.get(waiting.get("reason", ""))
        if reason:
            return Diagnosis(reason, f"{pod['metadata']['name']}: {waiting.get('reason')}: "
                                     f"{waiting.get('message', '')}".strip())
    return None


def engine_of(pod: dict, spec: PDDeploymentSpec, agent_ok: bool = False) -> Engine:
    labels = pod["metadata"].get("labels", {})
    group = labels.get(LABEL_GROUP, "prefill")
    ip = pod.get("status", {}).get("podIP")
    return Engine(pod=pod["metadata"]["name"], group=group, role=labels.get(LABEL_ROLE, group),
                  cluster_id=cluster_id(spec, group, pod_index(pod)), ip=ip, port=spec.datadist.port,
                  ready=pod_ready(pod), agent_ok=agent_ok,
                  agent_url=f"http://{ip}:{AGENT_PORT}" if ip else None,
                  terminating=bool(pod["metadata"].get("deletionTimestamp")))


@dataclass
class Observed:
    """Everything one pass of the controller saw or did."""
    generation: int
    pods: list[dict]
    engines: list[Engine]
    boot_ids: dict[str, str] = field(default_factory=dict)
    agent_errors: dict[str, tuple[str, str]] = field(default_factory=dict)   # pod -> (reason, message)
    reported: dict[str, list[dict]] = field(default_factory=dict)            # decoder -> link states
    link_failures: dict[tuple[str, int], tuple[str, Diagnosis]] = field(default_factory=dict)  # -> (code, diag)
    expected: int = 0
    up: int = 0
    verify: dict[str, dict] = field(default_factory=dict)  # decoder -> last VerifyResult dict
    proxy: dict[str, dict[str, str]] = field(default_factory=dict)
    model_id: int = 0


def build_status(spec: PDDeploymentSpec, obs: Observed, previous: dict | None) -> dict:
    prev_conds = (previous or {}).get("conditions")
    gen = obs.generation
    desired_pods = spec.prefill.replicas + spec.decoder.replicas
    live = [p for p in obs.pods if not p["metadata"].get("deletionTimestamp")]
    ready = [p for p in live if pod_ready(p)]
    by_pod = {e.pod: e for e in obs.engines}

    members = []
    for p in sorted(live, key=lambda p: (p["metadata"].get("labels", {}).get(LABEL_GROUP, ""), pod_index(p))):
        e = by_pod[p["metadata"]["name"]]
        m = {"pod": e.pod, "group": e.group, "role": e.role, "clusterId": e.cluster_id, "ip": e.ip,
             "port": e.port, "ready": e.ready}
        if e.pod in obs.boot_ids:
            m["bootId"] = obs.boot_ids[e.pod]
        if e.role == "decoder":
            links = [{"peer": l["name"], "clusterId": l["cluster_id"], "code": l["code"]}
                     for l in obs.reported.get(e.pod, [])]
            seen = {l["clusterId"] for l in links}
            for (dpod, cid), (code, _) in sorted(obs.link_failures.items()):
                if dpod == e.pod and cid not in seen:
                    peer = next((x.pod for x in obs.engines if x.cluster_id == cid), str(cid))
                    links.append({"peer": peer, "clusterId": cid, "code": code})
            m["links"] = links
        members.append({k: v for k, v in m.items() if v is not None})

    conds = prev_conds
    # PodsReady
    problems = [d for d in (pod_problem(p) for p in live) if d]
    if problems:
        conds = cond.set_condition(conds, "PodsReady", False, problems[0].reason,
                                   "; ".join(d.message for d in problems), gen)
    elif len(ready) >= desired_pods and len(live) == desired_pods:
        conds = cond.set_condition(conds, "PodsReady", True, "AllPodsReady",
                                   f"{len(ready)}/{desired_pods} pods ready", gen)
    else:
        waiting = sorted(p["metadata"]["name"] for p in live if not pod_ready(p))
        conds = cond.set_condition(conds, "PodsReady", False, "PodsNotReady",
                                   f"{len(ready)}/{desired_pods} pods ready"
                                   + (f"; waiting for {', '.join(waiting)}" if waiting else ""), gen)
    # AgentsReady
    if obs.agent_errors:
        first = sorted(obs.agent_errors.items())[0][1][0]
        conds = cond.set_condition(conds, "AgentsReady", False, first, "; ".join(
            f"{pod}: {msg}" for pod, (_, msg) in sorted(obs.agent_errors.items())), gen)
    else:
        conds = cond.set_condition(conds, "AgentsReady", True, "AgentsReachable",
                                   f"{len(obs.boot_ids)} agents answer", gen)
    # LinksReady
    failures = sorted(obs.link_failures.items())
    if failures:
        diag = failures[0][1][1]
        conds = cond.set_condition(conds, "LinksReady", False, diag.reason,
                                   " | ".join(d.message for _, (_, d) in failures), gen)
    elif obs.expected == 0:
        conds = cond.set_condition(conds, "LinksReady", False, "NoPeers",
                                   "need at least one ready prefill and one ready decoder to link", gen)
    elif obs.up < obs.expected:
        conds = cond.set_condition(conds, "LinksReady", False, "Linking",
                                   f"{obs.up}/{obs.expected} links up", gen)
    else:
        conds = cond.set_condition(conds, "LinksReady", True, "AllLinksUp",
                                   f"{obs.up}/{obs.expected} links up", gen)
    # KVPathVerified
    results = [obs.verify[d] for d in sorted(obs.verify)]
    bad = [r for r in results if not r["ok"]]
    if bad:
        diags = [verify_failure(r["code"], r["decoder"], r["prefill"], r.get("message", ""), obs.model_id)
                 for r in bad]
        conds = cond.set_condition(conds, "KVPathVerified", False, diags[0].reason,
                                   " | ".join(d.message for d in diags), gen)
    elif results and obs.expected and obs.up == obs.expected:
        conds = cond.set_condition(conds, "KVPathVerified", True, "Verified", "; ".join(
            f"{r['decoder']} <- {r['prefill']}: {r['bytes']} B in {r['pull_ms']:.2f} ms" for r in results), gen)
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
    degraded = bool(problems or obs.agent_errors or failures or bad)
    pods_ok = cond.is_true(conds, "PodsReady")
    links_ok = cond.is_true(conds, "LinksReady")
    verified = cond.is_true(conds, "KVPathVerified")
    if degraded:
        phase = "Degraded"
    elif not pods_ok:
        phase = "Pending"
    elif not (links_ok and verified):
        phase = "Linking"
    else:
        phase = "Ready"
    not_ok = [c for c in (conds or []) if c["type"] in ("PodsReady", "AgentsReady", "LinksReady", "KVPathVerified")
              and c["status"] != "True"]
    if phase == "Ready":
        conds = cond.set_condition(conds, "Ready", True, "Ready",
                                   f"{obs.up}/{obs.expected} links up and KV path verified", gen)
    else:
        first = not_ok[0] if not_ok else {"reason": phase, "message": ""}
        conds = cond.set_condition(conds, "Ready", False, first["reason"], first["message"], gen)

    derived = derive(spec.model.kv_cache)
    cache = {"numTensors": derived.num_tensors, "shape": derived.shape, "dataType": derived.data_type,
             "bytesPerToken": derived.bytes_per_token, "cacheBytes": derived.cache_bytes}
    if derived.blocks_shape:
        cache["blocksShape"] = derived.blocks_shape
    if spec.backend == "sim":
        cache["simMemoryScale"] = derived.sim_memory_scale()
    ready_names = {p["metadata"]["name"] for p in ready}
    return {
        "phase": phase,
        "prefill": sum(1 for e in obs.engines if e.role == "prefill" and e.pod in ready_names),
        "decoder": sum(1 for e in obs.engines if e.role == "decoder" and e.pod in ready_names),
        "links": {"expected": obs.expected, "up": obs.up},
        "linksSummary": f"{obs.up}/{obs.expected}",
        "members": members,
        "conditions": conds,
        "cacheDesc": cache,
        "observedGeneration": gen,
    }
