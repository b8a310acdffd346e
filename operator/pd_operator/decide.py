"""Decide (pure): one pass's Snapshot -> its Plan.

The Snapshot is what the pass observed, frozen: the resource and its spec, the cached pods and
children, the agents' reports of this pass, the clocks, and the memory as it was read. The
Plan is everything the pass will do, decided before any of it is done: the status to record,
the objects to apply, link and unlink operations, verification pairs (and those to verify once
links succeed, when they complete the mesh), switch intents, Events, metric increments, and
the memory to keep. `decide` changes none of its inputs (it works on a fork of the memory) and
reads no clock but the Snapshot's, so the same Snapshot gives the same Plan."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from pd_contract.names import FIELD_MANAGER, LABEL_DEPLOYMENT, NPU_RESOURCE

from . import children as ch
from . import gangs as gangs_
from . import links as lk
from . import policies, ranktable
from . import pools as pools_
from . import preflight as preflight_
from . import rebalance as rb
from . import replace as rp
from . import rollout as rollout_
from . import switch as sw_
from . import verification as vf
from .api import PDDeploymentSpec
from .builders import desired_children, npu_mismatch
from .config import OperatorConfig, not_allowed
from .diagnosis import Diagnosis
from .members import Problem, pod_ready, with_report
from .objmeta import owner_reference
from .reports import Report
from .state import RETRIED, Memory
from .status import Observed, build_status

SETTLED_POLL_S = 5.0      # a member that is linked and well is asked this often



@dataclass(frozen=True)
class Snapshot:
    key: tuple[str, str]
    body: dict
    spec: PDDeploymentSpec
    now: float                          # monotonic
    wall: float                         # epoch seconds (status times, the schedule, switches)
    pods: tuple[dict, ...]              # every engine pod, leaving ones included
    children: dict                      # ChildKey -> observed object
    engines: tuple[lk.Engine, ...]      # members as their pods describe them (before reports)
    problems: tuple[Problem, ...]
    token: str | None
    reports: dict[str, Report]          # this pass's answers, by pod
    gateway_stats: tuple[dict, float] | None
    gateway_read: bool                  # the gateway was asked this pass (None then: it did not answer)
    asked: frozenset[str]               # pods whose agents were asked (no longer dirty once recorded)
    memory: Memory                      # as read; decide forks it
    npu_resource: str = NPU_RESOURCE    # the extended resource that means NPUs (operator configuration)
    config: OperatorConfig = OperatorConfig()   # what the cluster admin allows
    token_problem: str | None = None    # a token Secret the operator did not make
    token_digests: tuple[tuple[str, str], ...] = ()   # status.tokenDigests (tokens.judge)
    keys: tuple[bool, str, str] | None = None   # the gateway's keys Secret: opted in, or why not
    strays: tuple[dict, ...] = ()       # pods with the deployment's labels that its StatefulSets do not own
    pool_api: bool | None = None        # the API server serves InferencePools (None: not asked)
    pools: tuple[dict, ...] | None = ()  # this deployment's InferencePools, as read (None: they could not be)
    pool_error: str = ""                 # why not, or why the last write of one was refused
    free_npus: dict[str, int] | None = None   # the nodes' free NPUs, read while an instance waits for room

    @property
    def generation(self) -> int:
        return self.body["metadata"].get("generation", 0)


@dataclass(frozen=True)
class Event:
    type: str
    reason: str
    message: str
    key: str | None = None


@dataclass
class Plan:
    memory: Memory
    status: dict
    engines: list[lk.Engine]                     # the mesh, as the link planner saw it
    reported: dict[str, list[dict]]
    want: dict[str, list[lk.Engine]]
    desired: list[dict]
    to_apply: list[dict]
    links: list[lk.DecoderPlan]
    verify: list[tuple[lk.Engine, lk.Engine]]
    verify_after_links: frozenset | None         # the link set once `links` succeed, if that completes the mesh
    switch_intents: list[sw_.Intent]
    switch_probes: dict[str, list[tuple[lk.Engine, lk.Engine]]]
    started: list[sw_.Switch]
    outcomes: list[sw_.Outcome]
    events: list[Event] = field(default_factory=list)
    decisions: list[tuple[str, str]] = field(default_factory=list)   # (policy, reason) evaluated
    clear_abort: bool = False   # the switch-abort annotation was dealt with: remove it
    pools: pools_.PoolPlan = pools_.PoolPlan()
    gangs: gangs_.Plan = field(default_factory=gangs_.Plan)

    @property
    def book(self) -> sw_.Book:
        assert self.memory.book is not None
        return self.memory.book


def decide(snap: Snapshot) -> Plan:
    ns, name = snap.key
    mem = snap.memory.fork()
    if mem.book is None:  # after a restart: the switches in flight, as recorded before their steps
        mem.book = sw_.Book.from_status(snap.body.get("status"))
    live = [p for p in snap.pods if not p["metadata"].get("deletionTimestamp")]
    events: list[Event] = []
    obs = Observed(generation=snap.generation, pods=live, engines=list(snap.engines), problems=list(snap.problems),
                   strays=list(snap.strays), model_id=snap.spec.model.model_id,
                   topology=snap.spec.datadist.topology, selector=f"{LABEL_DEPLOYMENT}={name}")
    engines = _take(snap, mem, obs, events)
    # a pod whose network preflight failed (or whose TLS switch differs) is linked to nothing
    obs.preflight, held = preflight_.verdict(live, mem.reports, snap.spec.datadist.preflight)
    engines = [replace(e, unfit=True) if e.pod in held else e for e in engines]
    alive = {e.pod for e in engines}
    gang = gangs_.plan(snap.spec, list(snap.pods), mem.reports, mem.gangs, snap.free_npus, snap.now)
    mem.gangs, obs.unplaced, obs.instance_of = gang.memos, gang.unplaced, gang.instance_of
    events += [Event(t, reason, msg, key=msg) for t, reason, msg in gang.events]
    sw = _rebalance(snap, mem, engines, obs, events)
    engines, book = sw.mesh, mem.book
    assert book is not None
    blocked, retry = _blocked(snap, mem)
    desired, to_apply = _children(snap, mem, book, engines, live, blocked, retry)
    obs.desired_pods = sum(snap.spec.pod_sizes(book.sizes).values())
    plans, pairs, complete_after = _links(snap, mem, engines, obs, sw, alive)
    obs.blocked = blocked
    obs.gateway_keys = snap.keys
    obs.superpod_pairs = preflight_.superpod_pairs(obs.reported, mem.reports)
    obs.revision_skew = rollout_.revision_skew(engines)
    pool_plan = pools_.plan(name, ns, owner_reference(name, snap.body["metadata"].get("uid", "")), snap.spec,
                            snap.pool_api, snap.pools, live, snap.pool_error)
    obs.inference_pool = pool_plan.verdict
    # observedGeneration moves only once the children of this generation were applied
    obs.observed_generation = snap.generation if not to_apply and not blocked else \
        (snap.body.get("status") or {}).get("observedGeneration")
    status = build_status(snap.spec, obs, snap.body.get("status"), at=sw_.iso(snap.wall)[:19] + "Z")
    if snap.token_digests:   # before any token Secret is created: what proves it is the operator's
        status["tokenDigests"] = dict(snap.token_digests)
    if mismatched := lk.mismatches(engines):
        pods = sorted({e.pod for pair in mismatched for e in pair})
        events.append(Event("Warning", "CacheDescMismatch", ", ".join(pods) + " run different CacheDescs; pairs "
                            "across them are not linked", key=",".join(pods)))
    by_pod = {e.pod: e for e in engines}
    probes = {s.pod: [(by_pod[d], by_pod[p]) for d, p in rb.switch_pairs(s, engines, sw.want)
                      if d in by_pod and p in by_pod] for s in book.switches if s.step == "Verify"}
    return Plan(memory=mem, status=status, engines=engines, reported=obs.reported, want=sw.want, desired=desired,
                to_apply=to_apply, links=plans, verify=pairs, verify_after_links=complete_after,
                switch_intents=sw.intents if snap.token else [], switch_probes=probes, started=sw.started,
                outcomes=sw.outcomes, events=events, decisions=sw.decisions, clear_abort=sw.clear_abort,
                pools=pool_plan, gangs=gang)


def _take(snap: Snapshot, mem: Memory, obs: Observed, events: list[Event]) -> list[lk.Engine]:
    """This pass's reports merged into the engines; what is remembered of pods gone, forgotten."""
    engines = take_reports(mem, list(snap.engines), snap.reports, obs, snap.now, events)
    obs.engines = engines
    if snap.gateway_read:
        mem.gateway_stats = snap.gateway_stats
    alive = {e.pod for e in engines}
    for pod in [p for p in set(mem.reports) | set(mem.next_poll) if p not in alive]:
        mem.reports.pop(pod, None)
        mem.reported_at.pop(pod, None)
        mem.links_dumped.pop(pod, None)
        mem.next_poll.pop(pod, None)
        mem.agent_errors.pop(pod, None)
    return engines


@dataclass
class _Switching:
    """What the rebalance part of a pass decided: the mesh as the link planner sees it, and the switches."""
    mesh: list[lk.Engine]
    want: dict[str, list[lk.Engine]]
    per: dict
    intents: list[sw_.Intent]
    started: list[sw_.Switch]
    outcomes: list[sw_.Outcome]
    decisions: list[tuple[str, str]]
    clear_abort: bool


def _rebalance(snap: Snapshot, mem: Memory, engines: list[lk.Engine], obs: Observed,
               events: list[Event]) -> _Switching:
    """Switches in flight advance on what this pass observed; maybe one starts."""
    book = mem.book
    assert book is not None
    wall = snap.wall
    steps = [(s.pod, s.step) for s in book.switches]
    mesh, want_map, per = _mesh(engines, book, obs, snap.spec)
    abort_pod = (snap.body["metadata"].get("annotations") or {}).get(sw_.ANNOTATION_ABORT)
    intents, started, outcomes, decisions = advance_switches(
        snap.spec, mem, book, list(snap.pods), engines, obs, snap.reports, wall, snap.now, mesh, want_map, per,
        events, abort_pod)
    book = mem.book   # the policy's evaluation recorded its target and decision in a new Book
    assert book is not None
    stuck_after = snap.spec.rebalance.stuck_after_seconds if snap.spec.rebalance is not None else 300
    obs.stuck = sw_.stuck(book.switches, wall, stuck_after)
    for s in book.switches:
        if wall - s.step_started > stuck_after:
            events.append(Event("Warning", "SwitchStuck", f"{s.pod}: in step {s.step} for more than {stuck_after}s: "
                                f"{sw_.STUCK_HINTS.get(s.step, '')}", key=f"stuck {s.pod} {s.step} {s.started}"))
    # the link planner sees switching pods by their engine's role and step: the mesh is
    # worked out again only if a switch moved (most passes have none)
    if [(s.pod, s.step) for s in book.switches] != steps:
        mesh, want_map, per = _mesh(engines, book, obs, snap.spec)
    obs.per_decoder = per
    obs.switches, obs.last_switch, obs.last_decision = list(book.switches), book.last, book.decision
    obs.cooldown_until = sw_.iso(book.cooldown_until) if book.cooldown_until else None
    obs.retry_after = sw_.iso(book.retry_after) if book.retry_after > wall else None
    replacing = snap.spec.rebalance is not None and snap.spec.rebalance.method == "Replace"
    obs.group_sizes = book.sizes if replacing else None
    for e in mesh:
        if e.pod in snap.reports and snap.reports[e.pod].error is None:
            settled = e.agent_ok and not e.leaving and (e.pod not in per or per[e.pod][0] == per[e.pod][1])
            mem.next_poll[e.pod] = snap.now + SETTLED_POLL_S if settled else 0.0
    # the abort asked for is done (or there was nothing to abort): the annotation goes
    clear_abort = abort_pod is not None and all(s.pod != abort_pod for s in book.switches)
    return _Switching(mesh, want_map, per, intents, started, outcomes, decisions, clear_abort)


def _blocked(snap: Snapshot, mem: Memory) -> tuple[Diagnosis | None, bool]:
    """What refuses this generation whatever else happened, else what the last pass ran into;
    and whether a refused apply is due to be tried again."""
    blocked: Diagnosis | None = None
    if mismatch := npu_mismatch(snap.spec, snap.npu_resource):
        blocked = Diagnosis("NPURequestMismatch", mismatch)   # admission cannot see which resource means NPUs
    elif refused := not_allowed(snap.spec, snap.config, snap.key[0]):
        # the admission policy refuses these; an install without it is refused here
        blocked = Diagnosis("NotAllowed", f"{refused}; nothing of this generation is applied")
    elif snap.token_problem:
        blocked = Diagnosis("TokenSecretNotOwned", snap.token_problem)
    elif taken := ch.taken(snap.children, snap.body["metadata"]["uid"]):
        blocked = Diagnosis("NameTaken", f"{'; '.join(taken)}: applying this deployment's object of that name would "
                            f"replace it; rename one of them (nothing of this generation is applied)")
    elif mem.blocked_generation == snap.generation:
        blocked = mem.blocked
    # a refused apply is tried again when due (and nothing above refuses), still reported until taken
    retry = blocked is not None and blocked is mem.blocked and blocked.reason in RETRIED \
        and mem.blocked_retry_at is not None and snap.now >= mem.blocked_retry_at
    return blocked, retry


def _children(snap: Snapshot, mem: Memory, book: sw_.Book, engines: list[lk.Engine], live: list[dict],
              blocked: Diagnosis | None, retry: bool) -> tuple[list[dict], list[dict]]:
    """The desired children, and those that differ from what was applied (none while blocked)."""
    ns, name = snap.key
    uid = snap.body["metadata"]["uid"]
    serving = {role: sum(1 for e in engines if e.label == role and not e.terminating)
               for role in ("prefill", "decoder")}
    desired = desired_children(name, ns, uid, snap.spec, book.sizes, snap.npu_resource, snap.config,
                               keys_allowed=snap.keys is None or snap.keys[0], serving=serving,
                               token_digests=dict(snap.token_digests))
    # MindIE's rank table follows the pods (their roles and devices): rendered from what was observed
    desired += ranktable.desired(name, ns, uid, snap.spec, live)
    parts = rollout_.partitions(name, snap.spec, snap.children, live, snap.spec.pod_sizes(book.sizes))
    desired = rollout_.with_partitions(desired, name, parts)
    desired = [ch.stamped(o) for o in desired]
    if adopted := ch.adopt(desired, snap.children, mem.applied, FIELD_MANAGER):
        mem.applied = {**mem.applied, **adopted}   # a new dict: the memory read is not decide's
    to_apply = [] if blocked and not retry else ch.to_apply(desired, snap.children, mem.applied)
    return desired, to_apply


def _links(snap: Snapshot, mem: Memory, engines: list[lk.Engine], obs: Observed, sw: _Switching,
           alive: set[str]) -> tuple[list[lk.DecoderPlan], list[tuple[lk.Engine, lk.Engine]], frozenset | None]:
    """Links to make and break, pairs to verify, and the link set once the links succeed if
    that completes the mesh (verified in the same pass)."""
    now, topo = snap.now, snap.spec.datadist.topology
    plans = lk.plan(engines, obs.reported, topo, due=lambda d, c: mem.link_backoff.due((d, c), now)) \
        if snap.token else []
    want = {(d, e.cluster_id) for d, es in sw.want.items() for e in es}
    # failures are reported for wanted links only; backoff also covers links still to unlink
    reported_keys = {(d, link["cluster_id"]) for d, ls in obs.reported.items() for link in ls}
    mem.failures = {k: v for k, v in mem.failures.items() if k in want}
    mem.link_backoff.prune(lambda k: k in want or k in reported_keys)
    obs.link_failures = dict(mem.failures)
    pairs: list[tuple[lk.Engine, lk.Engine]] = []
    if snap.token:
        pairs, mem.verified_links = verify_due(engines, obs.reported, sw.per, mem, now, snap)
        if pairs or (mem.verify_digest is None and mem.verify and mem.verified_links == _link_set(obs.reported)):
            # what this round verifies (or, after a round run as the links were made, did)
            mem.verify_digest = vf.link_digest(obs.reported, _boots(engines))
    complete_after = lk.completes(engines, obs.reported, plans, topo) if plans else None
    if not want:
        mem.verify = {}
    obs.verify = {d: r for d, r in mem.verify.items() if d in alive}
    obs.verified_at, obs.verify_digest = mem.verified_at, mem.verify_digest
    if mem.verify_carried and not mem.verify:   # a recorded round stands: its fields stay in status
        obs.last_verified = (snap.body.get("status") or {}).get("lastVerified")
    return plans, pairs, complete_after


def take_reports(mem: Memory, engines: list[lk.Engine], reports: dict[str, Report], obs: Observed, now: float,
                 events: list[Event]) -> list[lk.Engine]:
    """Merge this pass's reports (and the last good ones of members not asked) into the engines."""
    out = []
    for e in engines:
        rep = reports.get(e.pod)
        if rep is not None and rep.error is not None:
            mem.reports.pop(e.pod, None)
            if e.ready and not e.terminating:  # a pod that is not Ready, or leaving, may well not answer
                mem.agent_errors[e.pod] = (rep.error.kind, str(rep.error))
            else:
                mem.agent_errors.pop(e.pod, None)
        elif rep is not None and rep.status is not None:
            s = rep.status
            mem.agent_errors.pop(e.pod, None)
            prev = mem.boot_ids.get(e.pod)
            if prev and prev != s.boot_id:
                events.append(Event("Normal", "AgentRestarted", f"{e.pod} restarted (boot id {s.boot_id[:8]}); "
                                    f"relinking", key=f"{e.pod} restarted"))
            mem.boot_ids[e.pod] = s.boot_id
            mem.reports[e.pod] = s
            mem.reported_at[e.pod] = now
            if s.proxy_env and f"{e.pod}/{s.boot_id}" not in mem.proxy_warned:
                mem.proxy_warned.add(f"{e.pod}/{s.boot_id}")
                events.append(Event("Warning", "ProxyEnvironment", f"{e.pod} has {', '.join(sorted(s.proxy_env))} "
                                    f"set; datadist links can be rerouted. Unset them or list peers in no_proxy"))
        if e.pod in mem.agent_errors and e.ready and not e.terminating:
            obs.agent_errors[e.pod] = mem.agent_errors[e.pod]
        dev = mem.reports[e.pod].device_error if e.pod in mem.reports else ""
        if dev and not e.terminating:
            obs.agent_errors[e.pod] = ("DeviceIPUnknown", f"{e.pod}: {dev}")
        st = mem.reports.get(e.pod)
        if st is not None:
            e = with_report(e, st)
            obs.boot_ids[e.pod] = st.boot_id
            if st.role == "decoder":   # dumped once per report, not once per pass (read only after)
                dumped = mem.links_dumped.get(e.pod)
                if dumped is None or dumped[0] is not st:
                    dumped = mem.links_dumped[e.pod] = (st, lk.Reported(link.model_dump() for link in st.links))
                obs.reported[e.pod] = dumped[1]
            if st.proxy_env:
                obs.proxy[e.pod] = st.proxy_env
            obs.rank_reports[e.pod] = (max(1, st.tensor_parallel), sum(1 for r in st.ranks if r.initialized)
                                       if st.ranks else int(st.initialized), st.device_ips)
        out.append(e)
    return out


def _boots(engines: list[lk.Engine]) -> dict[str, str]:
    return {e.pod: e.boot_id or "" for e in engines}


def _link_set(reported: dict[str, list[dict]]) -> frozenset:
    return frozenset((d, link["cluster_id"]) for d, ls in reported.items() for link in ls)


def verify_due(engines: list[lk.Engine], reported: dict[str, list[dict]], per: dict[str, tuple[int, int, list]],
               mem: Memory, now: float, snap: Snapshot | None = None) -> tuple[list[tuple[lk.Engine, lk.Engine]],
                                                                             frozenset]:
    """Verify when every desired link is up and either the link set changed or the interval
    passed. Returns the pairs and the link set they verify. A fresh memory (a start, a takeover)
    first takes the round recorded in status if it verified these very links (verification.py)."""
    expected, up = lk.totals(per)
    if not expected or up != expected:
        return [], mem.verified_links
    link_set = _link_set(reported)
    if snap is not None and vf.fresh(mem):
        vf.carry(mem, snap.body.get("status"), reported, _boots(engines), link_set, snap.wall, now,
                 snap.spec.datadist.verify_interval_seconds)
    if link_set == mem.verified_links and now < mem.next_verify:
        return [], mem.verified_links
    return lk.verify_pairs(engines, mem.verify_round), link_set


def _mesh(engines: list[lk.Engine], book: sw_.Book, obs: Observed, spec: PDDeploymentSpec
          ) -> tuple[list[lk.Engine], dict, dict]:
    """The engines as the link planner sees them, the desired links and per-decoder counts."""
    mesh = rb.mesh(engines, book.switches)
    topo = spec.datadist.topology
    return mesh, lk.desired(mesh, topo), lk.per_decoder(mesh, obs.reported, topo)


def advance_switches(spec: PDDeploymentSpec, mem: Memory, book: sw_.Book, pods: list[dict],
                     engines: list[lk.Engine], obs: Observed, reports: dict, wall: float, now: float,
                     mesh: list[lk.Engine], want: dict, per: dict, events: list[Event], abort_pod: str | None = None
                     ) -> tuple[list[sw_.Intent], list[sw_.Switch], list[sw_.Outcome], list[tuple[str, str]]]:
    """Advance each switch in flight, start one if the policy wants a different prefill count,
    and repair pods whose label disagrees with their engine. Changes `mem` and `book`, which
    are decide's own fork. `abort_pod`: the switch `kubectl pdd switch abort` asked to abort."""
    pods_by_name = {p["metadata"]["name"]: p for p in pods}
    by_pod = {e.pod: e for e in engines}

    def view(s: sw_.Switch) -> sw_.View:
        e = by_pod.get(s.pod)
        asked = s.pod in reports and reports[s.pod].error is None
        verified = mem.switch_verified.get((s.pod, e.boot_id or ""), set()) if e else set()
        return rb.view(s, pods_by_name.get(s.pod), e, mesh, obs.reported, want, per, verified,
                       mem.switch_refused.get(s.pod), asked)

    paused = spec.rebalance is not None and spec.rebalance.paused
    kept, intents, outcomes = _in_flight(spec, mem, book, view, obs, wall, abort_pod, paused)
    book.switches = kept
    obs.decision = None
    started: list[sw_.Switch] = []
    decisions: list[tuple[str, str]] = []
    if spec.rebalance is not None:
        more, started, decisions = _policy(spec, mem, book, view, engines, mesh, obs, per, wall, now, events, paused)
        intents += more
    for s in started:
        events.append(Event("Normal", "SwitchStarted", f"{s.pod}: {s.from_} -> {s.to} ({s.reason})",
                            key=f"start {s.pod} {s.started}"))
    assert mem.book is not None
    intents += rb.repairs(engines, mem.book.switches)
    return intents, started, outcomes, decisions


def _in_flight(spec: PDDeploymentSpec, mem: Memory, book: sw_.Book, view: Callable[[sw_.Switch], sw_.View],
               obs: Observed, wall: float, abort_pod: str | None, paused: bool
               ) -> tuple[list[sw_.Switch], list[sw_.Intent], list[sw_.Outcome]]:
    """Each switch in flight one step further (or ended): those kept, their intents, the ends."""
    intents: list[sw_.Intent] = []
    outcomes: list[sw_.Outcome] = []
    kept: list[sw_.Switch] = []
    timeout, leave_s = rb.drain_timeout(spec), rb.leave_pool_s(spec)
    for s in book.switches:
        if s.step != sw_.ABORT:
            s = replace(s, attempts=mem.switch_fails.get(s.pod, 0), message=mem.switch_errors.get(s.pod, ""))
        if s.pod == abort_pod:
            s, obs.abort_refused = sw_.abort_on_request(s, wall)
        if paused and s.step == "Drain":
            s = s.at(sw_.ABORT, wall, f"{sw_.PAUSED}; {s.pod} stays {s.from_}")
        new, its, out = sw_.advance(s, view(s), wall, timeout, leave_s)
        if out is not None:
            outcomes.append(out)
            _forget_switch(mem, s.pod, interrupted=out.result == "Interrupted")
            book.last = out.record()
            if out.result == "Aborted" and not out.switch.message.startswith((sw_.RETARGETED, sw_.PAUSED)):
                # the drain gave up, the engine cannot switch, or someone aborted it: no switch starts
                # for a cooldown
                hold = float(spec.rebalance.cooldown_seconds if spec.rebalance else 0)
                if out.switch.message.startswith(sw_.REQUESTED):   # time to look before the policy moves again
                    hold = max(hold, sw_.ABORT_HOLD_S)
                book.retry_after = wall + hold
        elif new is not None:
            kept.append(new)
            intents += its
    return kept, intents, outcomes


def _forget_switch(mem: Memory, pod: str, interrupted: bool) -> None:
    """A switch ended: what its steps remembered goes (new dicts: the memory read is not decide's)."""
    mem.switch_errors = {k: v for k, v in mem.switch_errors.items() if k != pod}
    mem.switch_fails = {k: v for k, v in mem.switch_fails.items() if k != pod}
    if interrupted:
        mem.switch_refused = {k: v for k, v in mem.switch_refused.items() if k != pod}
    mem.switch_verified = {k: v for k, v in mem.switch_verified.items() if k[0] != pod}


def _policy(spec: PDDeploymentSpec, mem: Memory, book: sw_.Book, view: Callable[[sw_.Switch], sw_.View],
            engines: list[lk.Engine], mesh: list[lk.Engine], obs: Observed, per: dict, wall: float, now: float,
            events: list[Event], paused: bool) -> tuple[list[sw_.Intent], list[sw_.Switch], list[tuple[str, str]]]:
    """The policy's target, switches retargeted to it, and the switch (or resize) it starts."""
    assert spec.rebalance is not None
    policy = spec.rebalance.policy
    intents: list[sw_.Intent] = []
    decisions: list[tuple[str, str]] = []
    decision_event = None
    kept = book.switches
    cands = rb.candidates(engines, kept, set(mem.switch_refused))
    current = sw_.prefill_count(cands)
    sig = rb.signals(mesh, mem.reports, mem.reported_at, now, mem.gateway_stats) \
        if policy in rb.PERIODIC else policies.Signals()
    verdict, changed, evaluated = rb.decide_target(spec, book, sig, current, wall)
    mem.book = book = evaluated
    if verdict is not None:
        decisions.append((policy, verdict.reason))
        if changed and book.target != current:
            decision_event = f"{policy}: prefill {current} -> {book.target}: {verdict.message}"
    last = book.decision or {}
    lim = rb.limits(spec, book.retry_after)
    target = sw_.clamp_target(book.target, spec.total, lim) if book.target is not None else None
    if spec.rebalance.method == "Switch":
        # a move in progress follows the new target: switches still draining that overshoot it stop
        moved = sw_.retarget(kept, cands, target, wall)
        for s in (s for s, old in zip(moved, kept) if s is not old):
            intents += sw_.intents(s, view(s))
        if moved != kept:
            book.switches = kept = moved
            cands = rb.candidates(engines, kept, set(mem.switch_refused))
    why = f"{policy}: {last.get('message', '')}"
    unsettled = _unsettled(spec, engines, obs, per, mem, book.sizes)
    if spec.rebalance.method == "Replace":
        decision, resized = _replace(spec, book, target, lim, wall, unsettled, why, paused)
        if resized:
            decision_event = (decision_event + "; " if decision_event else "") + resized
    else:
        decision = sw_.choose(cands, kept, target, lim, wall, why, unsettled=unsettled)
    decision = rb.condition_for(decision, last.get("reason"), last.get("message"))
    if paused:
        decision = replace(decision, starts=(), reason="Paused", message=(
            f"spec.rebalance.paused: no switch starts; unpaused, {decision.message[:1].lower()}"
            f"{decision.message[1:]}"))
    for s in decision.starts:
        book.switches = kept = kept + [s]
        intents += sw_.intents(s, view(s))
    obs.decision = decision
    if decision_event:
        events.append(Event("Normal", "RebalanceDecision", decision_event))
    return intents, list(decision.starts), decisions


def _replace(spec: PDDeploymentSpec, book: sw_.Book, target: int | None, lim: sw_.Limits, wall: float,
             unsettled: str | None, why: str, paused: bool) -> tuple[sw_.Decision, str | None]:
    """Replace resizes the groups instead of switching: the decision, and the Event's words if it resized."""
    sizes = spec.group_sizes(book.sizes)
    if book.sizes and book.sizes.get("growing") and sizes == {g: book.sizes[g] for g in sizes}:
        sizes = {**sizes, "growing": book.sizes["growing"], "moving": book.sizes.get("moving") or 1}
    new_sizes, decision = rp.plan(sizes, target, lim, wall, unsettled, why, spec.total)
    if new_sizes is None or paused:
        return decision, None
    book.sizes = new_sizes
    return decision, f"Replace: prefill {new_sizes['prefill']}, decoder {new_sizes['decoder']}: {decision.message}"


def _unsettled(spec: PDDeploymentSpec, engines: list[lk.Engine], obs: Observed, per: dict, mem: Memory,
               decided: dict | None = None) -> str | None:
    """Why the fleet is not steady enough to start a switch (None: it is)."""
    want = sum(spec.pod_sizes(decided).values())
    if len(obs.pods) != want:
        return f"{len(obs.pods)}/{want} engine pods exist"
    waiting = sorted(p["metadata"]["name"] for p in obs.pods if not pod_ready(p))
    if waiting:
        return f"pods not ready: {', '.join(waiting[:5])}"
    if obs.agent_errors:
        return f"agents not answering: {', '.join(sorted(obs.agent_errors)[:5])}"
    expected, up = lk.totals(per)
    if up < expected or mem.failures:
        return f"links {up}/{expected} up"
    return None
