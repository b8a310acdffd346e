"""Live role switching (pure): which pod to switch, and one switch as a state machine.

A switch moves one engine between the prefill and decoder roles without a restart:

    Drain -> Unlink -> SwitchRole -> Relink -> Verify -> Undrain

`advance(switch, view, now, drain_timeout)` looks at what is observed about the pod and
returns the switch as it should be recorded (possibly several steps further), the intents
to carry out, and the outcome once it ends. Every step ends on something observed (the
pod's label and assigned-role annotation, the agent's role, drain flag and in-flight
count, the links reported), so the reconcile records the step before acting and repeating
a step after a crash is harmless. Times are wall-clock seconds: they live in status and
must mean the same after an operator restart.

Only the Drain step can time out; the switch is then aborted, the pod keeps its old role
and is undrained. Past Drain the engine was taken out of service on purpose, so failures
are retried (with backoff, by the reconcile) rather than abandoned, except an engine that
cannot switch at all (LLM_FEATURE_NOT_ENABLED), which is aborted and never chosen again."""
from __future__ import annotations

import collections
import datetime as dt
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from pd_contract.names import DECODER, ENGINE_ROLE, PROMPT  # noqa: F401 (ENGINE_ROLE: act imports it from here)

STEPS = ("Drain", "Unlink", "SwitchRole", "Relink", "Verify", "Undrain")
ABORT = "Abort"
SWITCHING = "switching"     # the role label while a pod is out of both role Services
ROLE_OF_ENGINE = {PROMPT: "prefill", DECODER: "decoder"}
SERVING_STEPS = ("Relink", "Verify", "Undrain")   # the engine is in its new role, being brought in


def iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse_iso(s: str | None) -> float | None:
    if not s:
        return None
    try:
        return dt.datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


@dataclass(frozen=True)
class Switch:
    """One switch in flight, as recorded in status.switches."""
    pod: str
    uid: str
    from_: str                 # prefill | decoder
    to: str
    step: str
    started: float             # wall clock
    step_started: float
    reason: str = ""
    attempts: int = 0          # failed actions so far (retried with backoff)
    durations: tuple[tuple[str, float], ...] = ()   # (step, ms) of the steps done
    message: str = ""          # the last failure, or why it is being aborted
    unpooled: float = 0.0      # Drain: when its labels were first seen gone (wall clock; 0: not yet)

    @property
    def direction(self) -> str:
        return f"{self.from_}-to-{self.to}"

    def at(self, step: str, now: float, message: str | None = None) -> "Switch":
        done = self.durations + ((self.step, round((now - self.step_started) * 1000, 1)),)
        return replace(self, step=step, step_started=now, durations=done,
                       message=self.message if message is None else message)

    def to_status(self) -> dict:
        out = {"pod": self.pod, "uid": self.uid, "from": self.from_, "to": self.to, "step": self.step,
               "startedAt": iso(self.started), "stepStartedAt": iso(self.step_started), "reason": self.reason,
               "attempts": self.attempts}
        if self.durations:   # never `{}`: server-side apply turns an empty map into null (kubernetes#135841)
            out["stepsMs"] = {s: ms for s, ms in self.durations}
        if self.message:
            out["message"] = self.message
        if self.unpooled:
            out["unpooledAt"] = iso(self.unpooled)
        return out

    @classmethod
    def from_status(cls, d: dict) -> "Switch | None":
        started, step_started = parse_iso(d.get("startedAt")), parse_iso(d.get("stepStartedAt"))
        if d.get("step") not in STEPS + (ABORT,) or started is None or step_started is None:
            return None
        return cls(pod=d["pod"], uid=d.get("uid", ""), from_=d["from"], to=d["to"], step=d["step"],
                   started=started, step_started=step_started, reason=d.get("reason", ""),
                   attempts=int(d.get("attempts", 0)),
                   durations=tuple((s, float(ms)) for s, ms in (d.get("stepsMs") or {}).items()),
                   message=d.get("message", ""), unpooled=parse_iso(d.get("unpooledAt")) or 0.0)


@dataclass(frozen=True)
class View:
    """What one pass observed about the switching pod."""
    exists: bool = True
    uid: str = ""
    terminating: bool = False
    label: str = ""                 # pdoperator.io/role
    assigned: str = ""              # pdoperator.io/assigned-role (prefill | decoder)
    agent_ok: bool = False          # this pass has the agent's word
    engine_role: str | None = None  # prefill | decoder, as the agent reports its engine
    draining: bool | None = None
    in_flight: int = 0
    pending_kv: int = 0
    links_out: int = 0              # links its engine reports (decoder side)
    links_in: int = 0               # links to it: decoders that report one, and its own engine's count
    relinked: bool = False          # every link it should have in its new role is up
    verified: bool = False          # a KV path through it was verified in its new role
    refused: str | None = None      # the engine cannot switch (LLM_FEATURE_NOT_ENABLED): why


IntentKind = Literal["label", "annotate", "drain", "undrain", "unlink_all", "switch_role", "verify"]


@dataclass(frozen=True)
class Intent:
    kind: IntentKind
    pod: str
    role: str | None = None


@dataclass(frozen=True)
class Outcome:
    result: str      # Completed | Aborted | Interrupted
    switch: Switch
    message: str
    ended: float

    def record(self) -> dict:
        """status.lastSwitch."""
        ms = dict(self.switch.durations)
        out = {"pod": self.switch.pod, "from": self.switch.from_, "to": self.switch.to,
               "reason": self.switch.reason, "result": self.result,
               "totalMs": round((self.ended - self.switch.started) * 1000), "at": iso(self.ended)}
        if "Drain" in ms:
            out["drainMs"] = round(ms["Drain"])
        if self.result == "Completed":
            out["switchMs"] = round(ms.get("Unlink", 0) + ms.get("SwitchRole", 0))
            out["relinkMs"] = round(ms.get("Relink", 0) + ms.get("Verify", 0))
            out["undrainMs"] = round(ms.get("Undrain", 0))
            out["durationMs"] = out["totalMs"]
        if self.message:
            out["message"] = self.message
        if self.switch.unpooled:   # the drain started leavePoolSeconds after this
            out["unpooledAt"] = iso(self.switch.unpooled)
        return out


def done(sw: Switch, v: View) -> bool:
    """Whether the switch's current step is over, by what is observed."""
    step = sw.step
    if step == "Drain":
        return (v.label == SWITCHING and v.draining is True and v.in_flight == 0 and v.pending_kv == 0
                and v.engine_role == sw.from_)
    if step == "Unlink":
        return v.engine_role == sw.to or (v.agent_ok and v.links_out == 0 and v.links_in == 0)
    if step == "SwitchRole":
        return v.engine_role == sw.to and v.assigned == sw.to
    if step == "Relink":
        return v.engine_role == sw.to and v.relinked
    if step == "Verify":
        return v.engine_role == sw.to and v.verified
    if step == "Undrain":
        return v.engine_role == sw.to and v.label == sw.to and v.draining is False
    if step == ABORT:
        return v.label == sw.from_ and v.assigned == sw.from_ and v.draining is False
    raise ValueError(f"unknown step {step!r}")


def _hold(sw: Switch, v: View, now: float, leave_pool_s: float) -> list[Intent]:
    """Out of the role Services and refusing new work, until the Undrain step. The labels go
    first; the drain follows once routers that select the labels from outside (an InferencePool's
    endpoint picker, llm-d's scheduler) had `leave_pool_s` to see them go, so none of them sends
    a request to an engine that refuses it."""
    out = []
    if v.label != SWITCHING:
        out.append(Intent("label", sw.pod, SWITCHING))
    left = leave_pool_s <= 0 or sw.step != "Drain" or (sw.unpooled > 0 and now - sw.unpooled >= leave_pool_s)
    if v.agent_ok and not v.draining and left:
        out.append(Intent("drain", sw.pod))
    return out


def intents(sw: Switch, v: View, now: float = 0.0, leave_pool_s: float = 0.0) -> list[Intent]:
    """What to do for the current step (each idempotent, each checked again next pass)."""
    if sw.step in (ABORT, "Undrain"):
        # serving first, labelled second: whatever the labels bring back (the role Services,
        # llm-d's pools) finds an engine that takes requests
        role = sw.from_ if sw.step == ABORT else sw.to
        out = []
        if sw.step == ABORT and v.assigned != sw.from_:
            out.append(Intent("annotate", sw.pod, sw.from_))
        undrain = bool(v.agent_ok and v.draining)
        if undrain:
            out.append(Intent("undrain", sw.pod))
        if v.label != role and (undrain or v.draining is False):   # (None: its agent was not heard)
            out.append(Intent("label", sw.pod, role))
        return out
    out = _hold(sw, v, now, leave_pool_s)
    if sw.step in ("Unlink", "SwitchRole") and v.engine_role == sw.from_ and v.links_out:
        out.append(Intent("unlink_all", sw.pod))   # a decoder's own links (prefills' are the planner's)
    if sw.step == "SwitchRole":
        if v.assigned != sw.to:
            out.append(Intent("annotate", sw.pod, sw.to))   # a restart from here on comes back in the new role
        if v.agent_ok and v.engine_role == sw.from_ and not v.links_out and not v.links_in:
            out.append(Intent("switch_role", sw.pod, sw.to))
    if sw.step == "Verify":
        out.append(Intent("verify", sw.pod))
    return out


def advance(sw: Switch, v: View, now: float, drain_timeout_s: float, leave_pool_s: float = 0.0
            ) -> tuple[Switch | None, list[Intent], Outcome | None]:
    """`leave_pool_s`: how long the Drain step waits between taking the pod's labels and draining it."""
    if not v.exists or v.uid != sw.uid or v.terminating:
        return None, [], Outcome("Interrupted", sw, f"{sw.pod} was deleted or replaced during step {sw.step}; "
                                                    f"a new pod starts in its group's home role", now)
    for _ in range(len(STEPS) + 2):
        if sw.step != ABORT and v.refused:
            sw = sw.at(ABORT, now, f"the engine cannot switch roles: {v.refused}")
            continue
        if done(sw, v):
            if sw.step == ABORT:
                return None, [], Outcome("Aborted", sw.at(ABORT, now), sw.message, now)
            if sw.step == "Undrain":
                return None, [], Outcome("Completed", sw.at("Undrain", now), "", now)
            sw = sw.at(STEPS[STEPS.index(sw.step) + 1], now)
            continue
        if sw.step == "Drain" and leave_pool_s > 0 and not sw.unpooled and v.label == SWITCHING:
            sw = replace(sw, unpooled=now)   # the wait before the drain counts from here
        # the drain's own time: from the end of that wait (from the step's start while the labels stay)
        began = sw.unpooled + leave_pool_s if sw.unpooled and leave_pool_s > 0 else sw.step_started
        if sw.step == "Drain" and now - began >= drain_timeout_s:
            sw = sw.at(ABORT, now, f"drain timed out after {drain_timeout_s:g}s with {v.in_flight} requests in "
                                   f"flight and {v.pending_kv} KV caches waiting to be pulled; {sw.pod} stays "
                                   f"{sw.from_}")
            continue
        break
    return sw, intents(sw, v, now, leave_pool_s), None


def planning_role(sw: Switch, engine_role: str | None, draining: bool, terminating: bool) -> tuple[str, bool]:
    """(role, draining) the link planner should see for the switching pod: its engine's role,
    and from Relink on the switch's own drain does not keep it out of the mesh."""
    role = engine_role or SWITCHING
    if sw.step in SERVING_STEPS and engine_role == sw.to and not terminating:
        return role, False
    return role, draining


# ---- which pod ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Candidate:
    pod: str
    uid: str
    group: str                 # home role
    role: str                  # the role it serves in now (or is switching to)
    available: bool            # ready, answering, not leaving, label and engine agree
    switchable: bool
    in_flight: int = 0
    superpod: str = ""         # its node's A3 superpod ("" unknown)


@dataclass(frozen=True)
class Decision:
    # Switching | AtTarget | SwitchInFlight | Cooldown | WaitingForFleet | MinCount | NoCandidate | NoPolicy
    reason: str
    message: str
    starts: tuple[Switch, ...] = ()     # the switches to start in this pass (a move starts whole)
    target: int | None = None
    current: int | None = None

    @property
    def start(self) -> Switch | None:
        return self.starts[0] if self.starts else None


@dataclass(frozen=True)
class Limits:
    min_prefill: int = 1
    min_decoder: int = 1
    max_in_flight: int = 1
    cooldown_until: float = 0.0


def prefill_count(members: list[Candidate]) -> int:
    return sum(1 for m in members if m.role == "prefill")


def choose(members: list[Candidate], switches: list[Switch], target: int | None, limits: Limits, now: float,
           reason: str, unsettled: str | None = None) -> Decision:
    """Start the switches that bring the prefill count to the target (a switching pod counts in
    its new role), as many at once as `max_in_flight` allows: a move starts whole, not a switch per
    cooldown. Which pods: those whose switch returns them to their home group first, then the
    fewest requests in flight, then one whose A3 superpod keeps the most of its role. A switching
    pod, and one not Ready, counts as unavailable against the min counts, and at least one engine
    of each role stays serving. `limits.cooldown_until` holds every start (set after a switch gave
    up on its drain)."""
    current = prefill_count(members)
    if target is None:
        return Decision("NoPolicy", "no rebalancing policy sets a prefill count", current=current)
    base: dict = dict(target=target, current=current)
    if current == target:
        return Decision("AtTarget", f"{current} pods in the prefill role, as wanted", **base)
    room = limits.max_in_flight - len(switches)
    if room <= 0:
        return Decision("SwitchInFlight", f"{len(switches)} switch(es) in flight; at most {limits.max_in_flight}",
                        **base)
    if now < limits.cooldown_until:
        return Decision("Cooldown", f"want {target} prefills, have {current}; next switch after "
                                    f"{iso(limits.cooldown_until)} (cooldownSeconds)", **base)
    if unsettled:
        return Decision("WaitingForFleet", f"want {target} prefills, have {current}; waiting: {unsettled}", **base)
    to = "prefill" if current < target else "decoder"
    frm = "decoder" if to == "prefill" else "prefill"
    available = [m for m in members if m.role == frm and m.available]
    floor = max(1, limits.min_decoder if frm == "decoder" else limits.min_prefill)
    if len(available) - 1 < floor:
        return Decision("MinCount", f"want {target} prefills, have {current}; switching a {frm} would leave "
                                    f"{len(available) - 1} available {frm}s, below {floor}", **base)
    pickable = [m for m in available if m.switchable]
    if not pickable:
        return Decision("NoCandidate", f"want {target} prefills, have {current}; no available {frm} can switch "
                                       f"roles (engines initialised without llm.EnableSwitchRole)", **base)
    n = min(abs(target - current), room, len(available) - floor, len(pickable))
    # then, at no cost in flight, from the superpod with the most frm over to: each superpod keeps
    # both roles, so its decoders pull over its own fabric
    spare = collections.Counter(m.superpod for m in members if m.role == frm)
    spare.subtract(m.superpod for m in members if m.role == to)
    picks = sorted(pickable, key=lambda m: (m.group != to, m.in_flight, -spare[m.superpod] if m.superpod else 0,
                                            m.pod))[:n]
    starts = tuple(Switch(pod=m.pod, uid=m.uid, from_=frm, to=to, step="Drain", started=now, step_started=now,
                          reason=reason) for m in picks)
    names = ", ".join(m.pod for m in picks[:5]) + (f" and {n - 5} more" if n > 5 else "")
    what = f"{names}: {frm} -> {to}" if n == 1 else f"{n} {frm}s -> {to} ({names})"
    return Decision("Switching", f"{what} ({reason})", starts=starts, **base)


RETARGETED = "no longer wanted"   # an abort the policy asked for (not a drain that timed out)
PAUSED = "withdrawn: spec.rebalance.paused"
REQUESTED = "aborted on request"   # kubectl pdd switch abort (the annotation below)
ANNOTATION_ABORT = "pdoperator.io/switch-abort"
ABORTABLE = ("Drain", "Unlink")     # before switch_role: the engine is still in its old role
ABORT_HOLD_S = 300.0   # after an abort someone asked for, no switch starts for this long (or the cooldown)


def abort_on_request(sw: Switch, now: float) -> tuple[Switch, str | None]:
    """`kubectl pdd switch abort`: a switch before switch_role goes back (the pod keeps its role,
    undrained, relinked by the planner); past it, the refusal says what finishing requires."""
    if sw.step == ABORT:
        return sw, None
    if sw.step in ABORTABLE:
        return sw.at(ABORT, now, f"{REQUESTED} ({ANNOTATION_ABORT}); {sw.pod} stays {sw.from_}"), None
    return sw, (f"{sw.pod} cannot be aborted: it is past switch_role (step {sw.step}), its engine is a {sw.to} now; "
                f"the switch finishes once {', '.join(STEPS[STEPS.index(sw.step):])} complete (see LinksReady and "
                f"KVPathVerified); to move it back, change the target once it has")


STUCK_HINTS = {
    "Drain": "requests still in flight on it, or KV caches not yet pulled from it (the drain times out)",
    "Unlink": "decoders still report links to it: check AgentsReady and the decoders' agents",
    "SwitchRole": "switch_role has not taken effect: check the pod's agent (AgentsReady) and the last error below",
    "Relink": "its links in the new role are not all up: check LinksReady",
    "Verify": "no KV path through it has been verified in its new role: check KVPathVerified",
    "Undrain": "its role label or its agent's undrain has not taken effect: check the pod and AgentsReady",
    ABORT: "its role label, assigned-role annotation or undrain has not taken effect: check the pod and AgentsReady",
}


def stuck(switches: list[Switch], now: float, after_s: float) -> str | None:
    """Switches in one step longer than `after_s`, with what to check (None: none)."""
    late = [s for s in switches if now - s.step_started > after_s]
    if not late:
        return None
    # the step's start, not the time since: a condition's message changes only when something does
    return "; ".join(f"{s.pod} in step {s.step} since {iso(s.step_started)} (more than {after_s:g}s): "
                     f"{STUCK_HINTS.get(s.step, '')}"
                     + (f" (last error: {s.message})" if s.message else "") for s in late[:5]) \
        + (f"; and {len(late) - 5} more" if len(late) > 5 else "")


def retarget(switches: list[Switch], members: list[Candidate], target: int | None, now: float) -> list[Switch]:
    """A move in progress follows a new target: switches still in Drain that now overshoot it are
    aborted (the busiest first, being furthest from done); those past Drain complete, and the
    switcher moves back what overshoots once they have."""
    if target is None:
        return switches
    excess = prefill_count(members) - target
    direction = "prefill" if excess > 0 else "decoder"
    busy = {m.pod: m.in_flight for m in members}
    draining = sorted((s for s in switches if s.step == "Drain" and s.to == direction),
                      key=lambda s: (-busy.get(s.pod, 0), s.pod))
    drop = {s.pod for s in draining[:abs(excess)]}
    return [s.at(ABORT, now, f"{RETARGETED}: the target became {target} prefills; {s.pod} stays {s.from_}")
            if s.pod in drop else s for s in switches]


def clamp_target(want: int, total: int, limits: Limits) -> int:
    """A prefill count the fleet can have: min counts hold, one of each role stays."""
    lo = max(1, limits.min_prefill)
    hi = total - max(1, limits.min_decoder)
    return max(lo, min(hi, want)) if hi >= lo else want


@dataclass
class Book:
    """The switches in flight and the cooldown, as recorded in status (the operator's own
    copy, so a pass does not wait for its status write to come back through the watch)."""
    switches: list[Switch] = field(default_factory=list)
    cooldown_until: float = 0.0        # a periodic policy changes the target again from then
    retry_after: float = 0.0           # after a switch gave up on its drain: no switch starts before
    last: dict | None = None
    target: int | None = None          # the prefill count the policy decided last
    decision: dict | None = None       # status.lastDecision
    next_evaluation: float = 0.0       # Load and SLO: when to decide again
    sizes: dict | None = None          # method Replace: the groups' decided sizes
    learned: Any = None                # policy Goodput: demand history and capacity (memory only)

    def copy(self) -> "Book":
        return replace(self, switches=list(self.switches))

    @classmethod
    def from_status(cls, status: dict | None) -> "Book":
        status = status or {}
        rb = status.get("rebalance") or {}
        sws = [s for s in (Switch.from_status(d) for d in status.get("switches") or []) if s is not None]
        return cls(switches=sws, cooldown_until=parse_iso(rb.get("cooldownUntil")) or 0.0,
                   retry_after=parse_iso(rb.get("retryAfter")) or 0.0,
                   last=status.get("lastSwitch"), target=rb.get("targetPrefill"),
                   decision=status.get("lastDecision"), sizes=rb.get("groupSizes"))
