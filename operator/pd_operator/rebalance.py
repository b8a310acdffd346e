"""Rebalancing (pure): the prefill count a policy wants, and the glue between the switch
state machine (switch.py) and one pass's observation (engines, reported links, the mesh).

Who owns the counts: switching moves roles between the pods of the two groups and never
changes the groups' sizes (`prefill.replicas`, `decoder.replicas`). A pod's role is its own
(the assigned-role annotation, read at every container start). When `replicas` change, new
pods start in their group's home role and removed pods take their role with them (the
StatefulSet removes the highest ordinals, whatever their role); the policy then reconciles
the prefill count again, by switching, within the min counts."""
from __future__ import annotations

from dataclasses import replace

from . import links as lk
from .api import PDDeploymentSpec
from .switch import SWITCHING, Candidate, Intent, Limits, Switch, View, clamp_target, planning_role


def target(spec: PDDeploymentSpec) -> tuple[int | None, str]:
    """(prefill count wanted, why); None when no policy sets one (yet)."""
    rb = spec.rebalance
    if rb is None:
        return None, "no spec.rebalance"
    total = spec.prefill.replicas + spec.decoder.replicas
    if rb.policy == "Manual" and rb.manual is not None:
        return clamp_target(rb.manual.prefill, total, limits(spec, 0.0)), f"Manual: prefill {rb.manual.prefill}"
    return None, f"policy {rb.policy} has not decided"


def limits(spec: PDDeploymentSpec, cooldown_until: float) -> Limits:
    rb = spec.rebalance
    if rb is None:
        return Limits(cooldown_until=cooldown_until)
    return Limits(min_prefill=rb.min_prefill, min_decoder=rb.min_decoder,
                  max_in_flight=rb.max_concurrent_switches, cooldown_until=cooldown_until)


def drain_timeout(spec: PDDeploymentSpec) -> float:
    rb = spec.rebalance
    if rb is not None and rb.drain_timeout_seconds is not None:
        return float(rb.drain_timeout_seconds)
    return float(spec.drain_timeout_seconds)


def mesh(engines: list[lk.Engine], switches: list[Switch]) -> list[lk.Engine]:
    """The engines as the link planner must see them: a switching pod by its engine's role and
    step, not by its `switching` label."""
    by_pod = {s.pod: s for s in switches}
    out = []
    for e in engines:
        sw = by_pod.get(e.pod)
        if sw is None:
            out.append(e)
            continue
        role, draining = planning_role(sw, e.engine_role if e.agent_ok else None, e.draining, e.terminating)
        out.append(replace(e, role=role, draining=draining))
    return out


def switch_pairs(sw: Switch, engines: list[lk.Engine], want: dict[str, list[lk.Engine]]) -> list[tuple[str, str]]:
    """(decoder, prefill) pods whose KV path proves the switched engine in its new role."""
    if sw.to == "prefill":
        return [(d, sw.pod) for d, ps in sorted(want.items()) if any(p.pod == sw.pod for p in ps)]
    return [(sw.pod, p.pod) for p in want.get(sw.pod, [])]


def view(sw: Switch, pod: dict | None, e: lk.Engine | None, mesh_engines: list[lk.Engine],
         reported: dict[str, list[dict]], want: dict[str, list[lk.Engine]],
         per: dict[str, tuple[int, int, list]], verified: set[tuple[str, str]], refused: str | None,
         asked: bool) -> View:
    if pod is None or e is None:
        return View(exists=False)
    meta = pod["metadata"]
    labels = meta.get("labels", {})
    m = next((x for x in mesh_engines if x.pod == e.pod), e)
    links_in = e.links_in if e.engine_role == "prefill" else 0
    links_in += sum(1 for d, ls in reported.items() if d != e.pod
                    for link in ls if link["cluster_id"] == e.cluster_id)
    if sw.to == "prefill":
        holders = [d for d, ps in want.items() if any(p.pod == e.pod for p in ps)]
        serving_decoders = [x for x in mesh_engines if x.role == "decoder" and x.serving and x.cache_desc == m.cache_desc]
        relinked = m.serving and len(holders) == len(serving_decoders) and all(
            any(link["cluster_id"] == e.cluster_id and not lk.broken(link, m) for link in reported.get(d, []))
            for d in holders)
    else:
        expected, up, _ = per.get(e.pod, (0, 0, []))
        relinked = m.serving and e.pod in per and up == expected
    pairs = switch_pairs(sw, mesh_engines, want)
    return View(exists=True, uid=meta.get("uid", ""), terminating=bool(meta.get("deletionTimestamp")),
                label=labels.get("pdoperator.io/role", ""), assigned=e.assigned or e.group,
                agent_ok=e.agent_ok and asked, engine_role=e.engine_role if e.agent_ok else None,
                draining=e.draining if e.agent_ok else None, in_flight=e.in_flight, pending_kv=e.pending_kv,
                links_out=len(reported.get(e.pod, [])) if e.engine_role == "decoder" else 0,
                links_in=links_in, relinked=relinked, verified=set(pairs) <= verified, refused=refused)


def candidates(engines: list[lk.Engine], switches: list[Switch], refused: set[str]) -> list[Candidate]:
    """Live members by the role they serve in (a switching pod by its new role)."""
    by_pod = {s.pod: s for s in switches}
    out = []
    for e in engines:
        if e.terminating:
            continue
        sw = by_pod.get(e.pod)
        role = sw.to if sw else (e.engine_role if e.agent_ok else e.label)
        available = (sw is None and e.ready and e.agent_ok and not e.leaving and e.label == e.engine_role)
        out.append(Candidate(pod=e.pod, uid=e.uid, group=e.group, role=role, available=available,
                             switchable=bool(e.switchable) and e.pod not in refused, in_flight=e.in_flight))
    return out


def repairs(engines: list[lk.Engine], switches: list[Switch]) -> list[Intent]:
    """Pods not in a switch whose label or assigned role disagrees with their engine (a switch
    whose record was lost, a label edited by hand): follow the engine, and undrain a pod
    left in the `switching` label."""
    busy = {s.pod for s in switches}
    out = []
    for e in engines:
        if e.pod in busy or e.terminating or not e.agent_ok or e.engine_role is None:
            continue
        if e.label != e.engine_role:
            out.append(Intent("label", e.pod, e.engine_role))
        if e.assigned is not None and e.assigned != e.engine_role:
            out.append(Intent("annotate", e.pod, e.engine_role))
        if e.label == SWITCHING and e.draining:
            out.append(Intent("undrain", e.pod))
    return out
