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

from pd_contract.agent_api import Load
from pd_contract.names import LABEL_ROLE

from . import links as lk
from . import policies
from .api import PDDeploymentSpec
from .signals import Earlier
from .switch import ABORT, SWITCHING, Book, Candidate, Decision, Intent, Limits, Switch, View, iso, planning_role

# Verdicts that freeze the ratio say so in the Rebalancing condition while nothing switches.
FREEZES = ("CapacityExhausted", "SignalsStale", "NoSignals", "InvalidSchedule")
PERIODIC = ("Load", "SLO", "Goodput")   # evaluated every evaluationIntervalSeconds, on the engines' signals


def signals(engines: list[lk.Engine], reports: dict, reported_at: dict[str, float], now: float,
            gateway: tuple[dict, float] | None = None) -> policies.Signals:
    """Load signals from the serving engines' last reports (`reports[pod]` is an AgentStatus);
    TTFT/TBT from the gateway's client-side percentiles where it answered, else the decoders'."""
    prefills, decoders, ttft, tbt, ages = [], [], [], [], []
    idle_p, idle_d = [], []
    for e in engines:
        s = reports.get(e.pod)
        if s is None or e.role not in ("prefill", "decoder"):
            continue
        ld = s.load
        if not e.serving:
            (idle_p.append(prefill_load(ld)) if e.role == "prefill" else idle_d.append(decoder_load(ld)))
            continue
        ages.append(now - reported_at.get(e.pod, now))
        if e.role == "prefill":
            prefills.append(prefill_load(ld))
        else:
            decoders.append(decoder_load(ld))
            if ld.ttft_p90_ms is not None:
                ttft.append(ld.ttft_p90_ms)
            if ld.tbt_p90_ms is not None:
                tbt.append(ld.tbt_p90_ms)
    age = max(ages) if ages else 0.0
    if gateway is not None and gateway[0].get("requests"):
        stats, at = gateway
        return policies.Signals(prefills=prefills, decoders=decoders, idle_prefills=idle_p, idle_decoders=idle_d,
                                ttft_p90_ms=stats["ttft_ms"].get("p90"), tbt_p90_ms=stats["tbt_ms"].get("p90"),
                                age_s=max(age, now - at), source="gateway")
    # the worst decoder's percentiles: percentiles of different engines do not average
    return policies.Signals(prefills=prefills, decoders=decoders, idle_prefills=idle_p, idle_decoders=idle_d,
                            ttft_p90_ms=max(ttft) if ttft else None, tbt_p90_ms=max(tbt) if tbt else None, age_s=age)


def prefill_load(ld: Load) -> policies.PrefillLoad:
    """What a prefill's load report says, as the policies read it."""
    return policies.PrefillLoad(busy=ld.prefill_busy, queue=ld.queue_depth, queued_tokens=ld.queued_prompt_tokens,
                                window_s=ld.window_s, arrived=ld.requests_arrived,
                                arrived_tokens=ld.prompt_tokens_arrived, computed_tokens=ld.prefill_tokens,
                                busy_s=ld.prefill_busy_s, earlier=earlier(ld))


def decoder_load(ld: Load) -> policies.DecoderLoad:
    """What a decoder's load report says, as the policies read it."""
    return policies.DecoderLoad(running=ld.running, waiting=ld.decode_queue, max_batch=max(1, ld.max_batch),
                                kv_used=ld.kv_used_bytes, kv_capacity=ld.kv_capacity_bytes, window_s=ld.window_s,
                                output_tokens=ld.output_tokens, completed=ld.decodes_completed,
                                context_tokens=ld.context_tokens,
                                steps=tuple((x.batch, x.context_tokens, x.ms) for x in ld.steps),
                                earlier=earlier(ld))


def earlier(ld: Load) -> Earlier:
    """What a load report says the engine took on in a role it has since left."""
    return Earlier(full_window_s=ld.full_window_s, prompts=ld.earlier_prompts_arrived,
                   prompt_tokens=ld.earlier_prompt_tokens_arrived, output_tokens=ld.earlier_output_tokens,
                   completed=ld.earlier_decodes_completed)


def decide_target(spec: PDDeploymentSpec, book: Book, sig: policies.Signals, current: int, wall: float
                  ) -> tuple[policies.Verdict | None, bool, Book]:
    """Evaluate the policy when due (Manual and Schedule every pass, the others every
    evaluationIntervalSeconds). Returns the verdict of this evaluation (None: not due), whether
    the target changed, and the book with the target and the decision recorded (a new Book:
    the one given is not changed). The cooldown runs between decisions: a periodic policy that
    changed the target does not change it again for cooldownSeconds (the move's switches meanwhile
    run back to back); Manual and Schedule apply at once."""
    rb = spec.rebalance
    assert rb is not None, "decided only with spec.rebalance set"
    periodic = rb.policy in PERIODIC
    if periodic and wall < book.next_evaluation:
        return None, False, book
    v = policies.evaluate(spec, sig, current, limits(spec, 0.0), wall, book.learned, book.last)
    # a verdict that holds keeps the target recorded (or none: no switching)
    target = v.target if v.target is not None else book.target
    cooldown_until = book.cooldown_until
    if periodic and target != book.target and book.target is not None and wall < book.cooldown_until:
        v = replace(v, message=f"{v.message}; held at {book.target} until {iso(book.cooldown_until)} "
                               f"(cooldownSeconds)")
        target = book.target
    elif periodic and target != book.target:
        cooldown_until = wall + rb.cooldown_seconds
    record = {"policy": rb.policy, "reason": v.reason, "message": v.message, "currentPrefill": current,
              **({"targetPrefill": target} if target is not None else {}),
              **({"numbers": {k: str(x) for k, x in v.numbers.items()}} if v.numbers else {})}
    old = {k: x for k, x in (book.decision or {}).items() if k != "at"}
    new = replace(book, switches=list(book.switches), target=target, cooldown_until=cooldown_until,
                  learned=v.learned if v.learned is not None else book.learned,
                  next_evaluation=wall + rb.evaluation_interval_seconds if periodic else book.next_evaluation,
                  decision={**record, "at": iso(wall)} if periodic or old != record else book.decision)
    return v, target != book.target, new


def condition_for(decision: Decision, verdict_reason: str | None, verdict_message: str | None) -> Decision:
    """A freezing verdict explains the Rebalancing condition when no switch is needed or running."""
    if decision.reason == "AtTarget" and verdict_reason in FREEZES:
        return Decision(verdict_reason, verdict_message or "", target=decision.target, current=decision.current)
    return decision


def limits(spec: PDDeploymentSpec, hold_until: float) -> Limits:
    """The switcher's limits; no switch starts before `hold_until` (Book.retry_after)."""
    rb = spec.rebalance
    if rb is None:
        return Limits(cooldown_until=hold_until)
    return Limits(min_prefill=rb.min_prefill, min_decoder=rb.min_decoder,
                  max_in_flight=rb.max_in_flight(spec.total), cooldown_until=hold_until)


def drain_timeout(spec: PDDeploymentSpec) -> float:
    rb = spec.rebalance
    if rb is not None and rb.drain_timeout_seconds is not None:
        return float(rb.drain_timeout_seconds)
    return float(spec.drain_timeout_seconds)


def leave_pool_s(spec: PDDeploymentSpec) -> float:
    """How long a switch waits between taking the pod's labels and draining it: only where
    spec.routing says routers outside the operator select them (else at once, as always)."""
    return float(spec.routing.leave_pool_seconds) if spec.routing is not None else 0.0


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
        serving_decoders = [x for x in mesh_engines
                            if x.role == "decoder" and x.serving and x.cache_desc == m.cache_desc]
        relinked = m.serving and len(holders) == len(serving_decoders) and all(
            any(link["cluster_id"] == e.cluster_id and not lk.broken(link, m) for link in reported.get(d, []))
            for d in holders)
    else:
        expected, up, _ = per.get(e.pod, (0, 0, []))
        relinked = m.serving and e.pod in per and up == expected
    pairs = switch_pairs(sw, mesh_engines, want)
    return View(exists=True, uid=meta.get("uid", ""), terminating=bool(meta.get("deletionTimestamp")),
                label=labels.get(LABEL_ROLE, ""), assigned=e.assigned or e.group,
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
        role = (sw.from_ if sw.step == ABORT else sw.to) if sw else ((e.engine_role if e.agent_ok else None) or e.label)
        available = (sw is None and e.ready and e.agent_ok and not e.leaving and not e.unfit
                     and e.label == e.engine_role)
        out.append(Candidate(pod=e.pod, uid=e.uid, group=e.group, role=role, available=available,
                             switchable=bool(e.switchable) and e.pod not in refused, in_flight=e.in_flight,
                             superpod=e.superpod))
    return out


def repairs(engines: list[lk.Engine], switches: list[Switch]) -> list[Intent]:
    """Pods not in a switch whose label or assigned role disagrees with their engine (a switch
    whose record was lost, a label edited by hand), or whose llm-d labels disagree with their
    role label (a pod the StatefulSet just made, an operator upgrade): follow the engine, and
    undrain a pod left in the `switching` label."""
    busy = {s.pod for s in switches}
    out = []
    for e in engines:
        if e.pod in busy or e.terminating or not e.agent_ok or e.engine_role is None:
            continue
        undrain = e.label == SWITCHING and e.draining
        if undrain:   # serving first, labelled (back into the role Services and pools) second
            out.append(Intent("undrain", e.pod))
        if (e.label != e.engine_role or not e.llmd_ok) and (undrain or not e.draining):
            out.append(Intent("label", e.pod, e.engine_role))   # (the label intent sets llm-d's labels too)
        if e.assigned is not None and e.assigned != e.engine_role:
            out.append(Intent("annotate", e.pod, e.engine_role))
    return out
