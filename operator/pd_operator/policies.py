"""Rebalancing policies (pure): how many engines should be in the prefill role.

Each policy is a chain of small checks over (signals, current prefill count, spec, clock)
returning a `Verdict`: a new prefill count, or None to keep the one recorded, with the
reason, a message and the numbers that drove it. The switcher (switch.py) decides which pod
and when; min counts are applied to every target here too (clamp_target).

- Manual: `manual.prefill`.
- Schedule: the entry whose cron fired last (in `timeZone`) sets the count. An entry or a
  time zone that does not parse freezes the ratio with a reason naming it.
- Load: prefill pressure (prefill busy fraction, queued requests per prefill) against decode
  pressure (running batch plus waiting decodes over the batch size): one more prefill when
  prefills are pressed and decoders have room, one fewer in the reverse case; a fleet of 16 or
  more moves up to an eighth of its engines at once, towards the count that shares them by
  each role's demand (`_step`). The high and
  low thresholds are apart (hysteresis), so a ratio that just moved does not move back.
- SLO: TTFT p90 over target while TBT has headroom -> one more prefill, unless the TTFT is
  spent waiting for a decode slot (decoders full with a queue, prefills not pressed: one fewer,
  since more prefills would only lengthen that queue) and holding when neither role queues
  now (the percentiles still cover the time before the last change); TBT over while TTFT has headroom -> one
  fewer; both over -> CapacityExhausted (add replicas).
- Goodput: demand in each role's units and each engine's capacity, measured from the reports
  (demand.py, capacity.py), the demand forecast for when a move would be done (forecast.py), and
  the prefill count of the highest predicted goodput, moved to only when the gain over the
  horizon (cooldown plus an evaluation, at least two moves and the dwell) exceeds what the drains
  cost (goodput.py). Each role's waits in that model are scaled by how much longer the queues its
  engines report ran than the model said for the same split (_calibrate: routing on loads a
  second old and the spread of the lengths are measured, not modelled). Until both roles'
  capacity is measured, it holds (Measuring). Against a
  demand it cannot foresee: each of the rate, prompt and output tokens is forecast from the
  samples since its last change point (a mean shift beyond the samples' noise), by the predictor
  or the level since the change, whichever forecast the recent samples better; that error (or
  the noise of counting the window's requests) is the forecast's measured error, and a move must
  still pay with the demand off by MARGIN_K times it, whichever way hurts (ForecastUnsure
  otherwise). Undoing the last move while the demand has not changed since needs REVERSE_K times
  that margin, and is not done within MIN_DWELL_S of it unless the split fails its demand (Dwell).
  The numbers of each decision (status.lastDecision) carry the errors, the margin and the
  robust gain.
Signals older than `signalMaxAgeSeconds`, or missing, freeze the ratio instead of guessing."""
from __future__ import annotations

import datetime as dt
import itertools
import math
import statistics
from dataclasses import dataclass, field, replace
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from . import demand as dm
from . import forecast as fc
from . import goodput as gp
from .api import PDDeploymentSpec, Rebalance
from .capacity import Capacity
from .signals import DecoderLoad, PrefillLoad, Signals
from .switch import Limits, clamp_target

# the signals live in signals.py; callers of the policies take them from here
__all__ = ["DecoderLoad", "PrefillLoad", "Signals", "Verdict", "evaluate", "next_fire"]

HEADROOM = 0.8   # SLO: "has headroom" means under 80% of its target


@dataclass(frozen=True)
class Verdict:
    target: int | None           # None: keep the prefill count recorded
    reason: str
    message: str
    numbers: dict = field(default_factory=dict)
    learned: dm.Learned | None = None   # Goodput: what it keeps for the next evaluation


def _bounded(want: int, total: int, limits: Limits, v: Verdict) -> Verdict:
    got = clamp_target(want, total, limits)
    if got != want:
        return replace(v, target=got, message=v.message + f"; held at {got} by the min counts")
    return replace(v, target=got)


def _rb(spec: PDDeploymentSpec) -> Rebalance:
    """The rebalance settings; the policies are evaluated only where they are set."""
    assert spec.rebalance is not None, "a policy is evaluated only with spec.rebalance set"
    return spec.rebalance


def manual(spec: PDDeploymentSpec, total: int, limits: Limits) -> Verdict:
    m = _rb(spec).manual
    assert m is not None, "admission requires manual with policy Manual"
    want = m.prefill
    return _bounded(want, total, limits, Verdict(want, "Manual", f"manual.prefill is {want}"))


def schedule(spec: PDDeploymentSpec, total: int, limits: Limits, now: float) -> Verdict:
    from cronsim import CronSim, CronSimError
    rb = _rb(spec)
    entries = rb.schedule or []
    try:
        tz = ZoneInfo(rb.time_zone)
    except (ZoneInfoNotFoundError, ValueError):
        return Verdict(None, "InvalidSchedule", f"spec.rebalance.timeZone {rb.time_zone!r} is not an IANA time "
                                                f"zone; the ratio is frozen")
    # a time that fires exactly now counts (reverse iteration starts strictly before its start),
    # one later than now does not: a pass half a second before the minute is not at the minute
    local = dt.datetime.fromtimestamp(now, tz)
    latest: tuple[dt.datetime, int, int] | None = None
    for i, entry in enumerate(entries):
        try:
            it = CronSim(entry.cron, local + dt.timedelta(seconds=1), reverse=True)
            fired = next(it)
            if fired > local:
                fired = next(it)
        except (CronSimError, StopIteration) as e:
            return Verdict(None, "InvalidSchedule", f"spec.rebalance.schedule[{i}].cron {entry.cron!r} does not "
                                                    f"parse ({e}); the ratio is frozen")
        if latest is None or fired > latest[0]:
            latest = (fired, i, entry.prefill)
    if latest is None:
        return Verdict(None, "InvalidSchedule", "spec.rebalance.schedule is empty")
    fired, i, want = latest
    return _bounded(want, total, limits, Verdict(want, "Schedule", f"schedule[{i}] ({entries[i].cron}, "
                                                                    f"{rb.time_zone}) fired at {fired.isoformat()}",
                                                 {"entry": i}))


def _fresh(sig: Signals, max_age: float) -> Verdict | None:
    if sig.age_s > max_age:
        return Verdict(None, "SignalsStale", f"the newest load signals are {sig.age_s:.0f}s old (over "
                                             f"{max_age:.0f}s); the ratio is frozen")
    return None


def load(spec: PDDeploymentSpec, sig: Signals, current: int, total: int, limits: Limits) -> Verdict:
    th = _rb(spec).load
    stale = _fresh(sig, _rb(spec).signal_max_age_seconds)
    if stale:
        return stale
    if not sig.prefills or not sig.decoders:
        return Verdict(None, "NoSignals", "no serving prefill or decoder reports its load; the ratio is frozen")
    p_busy = sum(p.busy for p in sig.prefills) / len(sig.prefills)
    p_queue = sum(p.queue for p in sig.prefills) / len(sig.prefills)
    d_busy = sum((d.running + d.waiting) / max(1, d.max_batch) for d in sig.decoders) / len(sig.decoders)
    nums = {"prefillBusy": round(p_busy, 3), "prefillQueue": round(p_queue, 2), "decodeBusy": round(d_busy, 3)}
    text = f"prefill busy {p_busy:.2f}, queue {p_queue:.1f}/prefill; decode batch use {d_busy:.2f}"
    prefill_pressed = p_busy >= th.prefill_busy_high or p_queue >= th.prefill_queue_high
    prefill_idle = p_busy <= th.prefill_busy_low and p_queue < 1
    decode_pressed = d_busy >= th.decode_busy_high
    decode_idle = d_busy <= th.decode_busy_low
    if prefill_pressed and decode_pressed:
        return Verdict(None, "CapacityExhausted", f"{text}: both roles are pressed; add replicas", nums)
    if prefill_pressed and decode_idle:
        n = _step(sig, current, total, +1)
        return _bounded(current + n, total, limits, Verdict(current + n, "PrefillBound", f"{text}: {_more(n)}",
                                                            nums))
    if decode_pressed and prefill_idle:
        n = _step(sig, current, total, -1)
        return _bounded(current - n, total, limits, Verdict(current - n, "DecodeBound", f"{text}: {_fewer(n)}",
                                                            nums))
    return Verdict(None, "Balanced", f"{text}: within thresholds", nums)


def _more(n: int) -> str:
    return "one more prefill" if n == 1 else f"{n} more prefills"


def _fewer(n: int) -> str:
    return "one fewer prefill" if n == 1 else f"{n} fewer prefills"


def _step(sig: Signals, current: int, total: int, direction: int) -> int:
    """How many engines to move in `direction`: one in a small fleet; in a large one, towards the
    count that shares the engines by each role's demand (busy fraction plus queue per engine),
    at most an eighth of the fleet per evaluation so an estimate off by a lot cannot swing it."""
    cap = max(1, total // 8)
    if cap == 1 or not sig.prefills or not sig.decoders:
        return 1
    batch = max(1, sig.decoders[0].max_batch)
    p_dem = sum(min(2.0, p.busy + p.queue / batch) for p in sig.prefills)
    d_dem = sum((d.running + d.waiting) / max(1, d.max_batch) for d in sig.decoders)
    if p_dem + d_dem <= 0:
        return 1
    want = total * p_dem / (p_dem + d_dem)
    return max(1, min(cap, round((want - current) * direction)))


def slo(spec: PDDeploymentSpec, sig: Signals, current: int, total: int, limits: Limits) -> Verdict:
    t = _rb(spec).targets
    assert t is not None, "admission requires targets with policy SLO"
    stale = _fresh(sig, _rb(spec).signal_max_age_seconds)
    if stale:
        return stale
    if sig.ttft_p90_ms is None or sig.tbt_p90_ms is None:
        return Verdict(None, "NoSignals", "no TTFT/TBT percentiles yet; the ratio is frozen")
    ttft, tbt = sig.ttft_p90_ms, sig.tbt_p90_ms
    nums = {"ttftP90Ms": round(ttft, 1), "tbtP90Ms": round(tbt, 1), "source": sig.source}
    text = f"TTFT p90 {ttft:.0f} ms (target {t.ttft_p90_ms}), TBT p90 {tbt:.1f} ms (target {t.tbt_p90_ms})"
    if ttft > t.ttft_p90_ms and tbt > t.tbt_p90_ms:
        return Verdict(None, "CapacityExhausted", f"{text}: both over target; switching cannot help, add replicas",
                       nums)
    if ttft > t.ttft_p90_ms and tbt <= HEADROOM * t.tbt_p90_ms:
        queued = _decode_queueing(spec, sig)
        if queued:
            # TTFT includes the wait for a decode slot: more prefills would only feed that queue
            n = _step(sig, current, total, -1)
            return _bounded(current - n, total, limits, Verdict(current - n, "DecodeQueueing",
                                                                f"{text}, {queued}: {_fewer(n)}", nums))
        if sig.prefills and not _prefill_queueing(spec, sig):
            # the percentiles still hold requests from before the last change: wait for them to age out
            return Verdict(None, "Settling", f"{text}, but neither role queues now; holding", nums)
        n = _step(sig, current, total, +1)
        return _bounded(current + n, total, limits, Verdict(current + n, "TTFTOverTarget",
                                                            f"{text}: {_more(n)}", nums))
    if tbt > t.tbt_p90_ms and ttft <= HEADROOM * t.ttft_p90_ms:
        return _bounded(current - 1, total, limits, Verdict(current - 1, "TBTOverTarget",
                                                            f"{text}: one fewer prefill", nums))
    return Verdict(None, "WithinTargets", f"{text}", nums)


def _decode_queueing(spec: PDDeploymentSpec, sig: Signals) -> str | None:
    """Where TTFT goes to waiting for a decoder's batch slot (decoders full with a queue, the
    prefills not pressed), said in words; None if the prefills are the wait or signals lack."""
    if not sig.prefills or not sig.decoders:
        return None
    th = _rb(spec).load
    waiting = sum(d.waiting for d in sig.decoders) / len(sig.decoders)
    d_busy = sum((d.running + d.waiting) / max(1, d.max_batch) for d in sig.decoders) / len(sig.decoders)
    p_busy = sum(p.busy for p in sig.prefills) / len(sig.prefills)
    p_queue = sum(p.queue for p in sig.prefills) / len(sig.prefills)
    if waiting > 0 and d_busy >= th.decode_busy_high and p_busy < th.prefill_busy_high \
            and p_queue < th.prefill_queue_high:
        return f"{waiting:.1f} requests/decoder wait for a decode slot while prefills are {p_busy:.0%} busy"
    return None


def _prefill_queueing(spec: PDDeploymentSpec, sig: Signals) -> bool:
    th = _rb(spec).load
    p_busy = sum(p.busy for p in sig.prefills) / len(sig.prefills)
    p_queue = sum(p.queue for p in sig.prefills) / len(sig.prefills)
    return p_busy >= th.prefill_busy_high or p_queue >= 1


CONTROL_S = 1.0   # Goodput: a switch's control-plane seconds until one was measured (status.lastSwitch)


def goodput(spec: PDDeploymentSpec, sig: Signals, current: int, total: int, limits: Limits, now: float,
            learned: dm.Learned | None, last_switch: dict | None) -> Verdict:
    """The prefill count of the highest predicted goodput, if moving there pays (goodput.py), from
    the demand and capacity the engines report (demand.py), the demand forecast for when the move
    is done (forecast.py), with each role's waits as long as its queues showed (_calibrate)."""
    rb = _rb(spec)
    held = _goodput_guard(rb, sig, learned)
    if held is not None:
        return held
    g = rb.goodput
    period = float(g.seasonal_period_seconds or 0)
    m = dm.measure(sig, learned, now, keep_s=g.window_seconds + period)
    cap = m.learned.capacity
    if m.demand is None or m.missing or cap is None:
        return Verdict(None, "Measuring", f"{m.missing}; the ratio is frozen until it is measured",
                       learned=m.learned)
    d, hist = m.demand, m.learned.history
    prev = learned if isinstance(learned, Memory) else Memory()
    seen, model, evals, scaled = _calibrate(prev, sig, d, cap, current, total, m.max_batch, now)
    mem = Memory(hist, cap, prev.moved_at, prev.moved_dir, seen, model, evals)
    if d.requests_per_s <= 0 and not d.prompt_backlog and not d.decode_backlog:
        return Verdict(None, "Idle", "no request arrived in the last window; holding", learned=mem)
    replacing = rb.method == "Replace"
    round_s = None if replacing else {to: _control_s(last_switch) + gp.drain_seconds(
        to, d, cap, current, total - current, m.max_batch) for to in ("prefill", "decoder")}
    # one round of a move, either way: when the forecast is for (the gate times the move it weighs)
    move_s = float(g.replace_seconds) if round_s is None else max(round_s.values())
    # an agent's report sets the window; one no longer than the forecast's own (NaN: that) bounds it
    settle = m.window_s if m.window_s <= g.window_seconds else float(g.window_seconds)
    ahead = _forecast_demand(rb, sig, d, hist, now + move_s, period, settle)
    horizon, c = _choose(rb, limits, total, current, ahead.demand, scaled, m.max_batch, move_s, round_s)
    return _gate(Step(rb, limits, total, current, now, d, ahead, scaled, m, move_s, horizon, c, mem, round_s))


def _goodput_guard(rb: Rebalance, sig: Signals, learned: dm.Learned | None) -> Verdict | None:
    """Why Goodput cannot decide on these signals (it holds, keeping what it learned), or None."""
    if rb.targets is None:   # admission requires them; a spec stored before that rule may lack them
        return Verdict(None, "NoTargets", "policy Goodput needs spec.rebalance.targets (ttftP90Ms, tbtP90Ms); "
                                          "the ratio is frozen", learned=learned)
    stale = _fresh(sig, rb.signal_max_age_seconds)
    if stale:
        return replace(stale, learned=learned)
    if not sig.prefills or not sig.decoders:
        return Verdict(None, "NoSignals", "no serving prefill or decoder reports its load; the ratio is frozen",
                       learned=learned)
    return None


@dataclass(frozen=True)
class Ahead:
    """The demand forecast for when a move would be done, and how: per series (rate, prompt,
    output tokens) the predictor chosen, its measured error, and when it last changed."""
    demand: gp.Demand
    how: list[tuple[float, str]]
    err: list[float]
    changed: list[float]


def _forecast_demand(rb: Rebalance, sig: Signals, d: gp.Demand, hist: tuple, at: float, period: float,
                     settle: float = 0.0) -> Ahead:
    """Each of the rate and the mix (prompt, output tokens per request) forecast from the samples
    since its last change (so a turn is caught within an evaluation or two) by the predictor or the
    level since the change, whichever forecast its own past samples better; its error is that
    error, or the noise of counting the requests of the last window if larger."""
    g = rb.goodput
    series = [[(h[0], h[i]) for h in hist] for i in (1, 2, 3)]
    noise = [_counting(n) for n in (_arrived(sig), _arrived(sig), _completed(sig))]
    # the rate over the whole window: what arrives at the prefills wavers with the moves themselves
    # (requests held while no pair takes them), which a change point would follow
    floors = [None, noise[1], noise[2]]
    seasonal = g.predictor == "Seasonal" and period > 0   # measured over every sample: it knows the season
    # a sample whose window (`settle`: the longest a sample was measured over) straddles a change
    # is neither demand: the samples since one count from the first whose window starts at or
    # after the change point's sample (_settled)
    how = [(UNMEASURED, LATEST) if not seasonal and _unmeasured(x, f, settle) else
           min(((_error(p, x, g.window_seconds, period, f, settle), p) for p in (g.predictor, LEVEL)),
               key=lambda h: (h[0], h[1] != g.predictor)) for x, f in zip(series, floors)]
    ahead = [_forecast(p, x, at, g.window_seconds, period, f, settle) for (_, p), x, f in zip(how, series, floors)]
    err = [max(h, e) for (h, _), e in zip(how, noise)]
    # when the mix last changed (a change point; the start of the history is none)
    changed = [x[i][0] if i else -math.inf for x, i in ((x, _change_point(x, f)) for x, f in
                                                       zip(series[1:], floors[1:]) if f is not None)]
    fd = replace(d, requests_per_s=ahead[0], prompt_tokens=ahead[1] or d.prompt_tokens,
                 output_tokens=ahead[2] or d.output_tokens)
    return Ahead(fd, how, err, changed)


def _choose(rb: Rebalance, limits: Limits, total: int, current: int, fd: gp.Demand, cap: Capacity, max_batch: int,
            move_s: float, round_s: dict[str, float] | None) -> tuple[float, gp.Choice]:
    """(horizon, the model's choice over it). The split a move makes is held for the dwell at least
    (no reversal before): the gain is over that too; a move of several rounds is held at least as
    long as making it took (the whole move's, so the whole move is weighed over that horizon even
    if part of it pays)."""
    assert rb.targets is not None
    horizon = max(float(rb.cooldown_seconds + rb.evaluation_interval_seconds), 2 * move_s, MIN_DWELL_S)
    lo, hi = max(1, limits.min_prefill), total - max(1, limits.min_decoder)
    targets = gp.Targets(rb.targets.ttft_p90_ms, rb.targets.tbt_p90_ms)
    drains = rb.method != "Replace"
    c = gp.choose(total, current, lo, hi, fd, cap, max_batch, targets, horizon, move_s, drains=drains,
                  max_in_flight=limits.max_in_flight, round_s=round_s)
    if 2 * max(c.move_s, c.whole_s) > horizon:
        horizon = 2 * max(c.move_s, c.whole_s)
        c = gp.choose(total, current, lo, hi, fd, cap, max_batch, targets, horizon, move_s, drains=drains,
                      max_in_flight=limits.max_in_flight, round_s=round_s)
    return horizon, c


@dataclass(frozen=True)
class Step:
    """One Goodput evaluation, up to the gate: what it measured, forecast and chose."""
    rb: Rebalance
    limits: Limits
    total: int
    current: int
    now: float
    d: gp.Demand                  # the demand measured
    ahead: Ahead                  # ... and forecast
    cap: Capacity                 # the capacity measured, its waits scaled as the queues showed
    m: dm.Measured
    move_s: float
    horizon: float
    c: gp.Choice
    mem: "Memory"
    round_s: dict[str, float] | None = None


def _gate(s: Step) -> Verdict:
    """The move the model chose, if it pays under every demand the forecast's error allows (each of
    rate, prompt and output off by `k` times its error, either way). Undoing the last move while the
    demand has not changed since (a change point after it) needs REVERSE_K times the margin
    (hysteresis), and is not done within the dwell at all unless the split fails its demand. A move
    unsure the whole way is made part of the way if that much is sure (_part_way)."""
    c, mem, current, now = s.c, s.mem, s.current, s.now
    assert s.rb.targets is not None
    direction = 0 if c.target == current else (1 if c.target > current else -1)
    turned = max(s.ahead.changed) > (mem.moved_at or 0.0)
    reverse = direction != 0 and direction == -mem.moved_dir and mem.moved_at is not None and not turned
    k = MARGIN_K * (REVERSE_K if reverse else 1.0)
    targets = gp.Targets(s.rb.targets.ttft_p90_ms, s.rb.targets.tbt_p90_ms)
    robust = _robust_gain(c, current, s.total, s.ahead.demand, s.cap, s.m.max_batch, targets, s.horizon,
                          s.ahead.err, k)
    dwell_until = (mem.moved_at or 0.0) + s.horizon
    failing = c.now.goodput < FAILING * s.ahead.demand.requests_per_s
    if c.reason in ("Move", "Relieve") and reverse and now < dwell_until and not failing:
        return Verdict(None, "Dwell", f"{_text(s)}: would reverse the move made {now - (mem.moved_at or now):.0f}s "
                                      f"ago before its dwell ends and the demand has not changed since; holding",
                       _numbers(s, k, robust, dwell_until), learned=mem)
    whole = c
    if c.reason == "Move" and (robust <= c.cost or robust <= 0):
        c, robust = _part_way(s, c, robust, targets, k)
        s = replace(s, c=c)
    nums = _numbers(s, k, robust, dwell_until)
    text = _text(s)
    moved = replace(mem, moved_at=now, moved_dir=direction)
    if c.reason == "Move" and (robust <= c.cost or robust <= 0):
        return Verdict(None, "ForecastUnsure", f"{text}: gains {c.gain:.0f} requests over {s.horizon:.0f}s, but "
                                               f"{robust:.0f} if the demand is off by {k:g}x the forecast's error; "
                                               f"the drains cost {c.cost:.0f}; holding", nums, learned=mem)
    if c.reason == "Move":
        return _bounded(c.target, s.total, s.limits, Verdict(
            c.target, "GoodputGain", f"{text}: {_way(c, whole)}gains {c.gain:.0f} requests over "
                                     f"{s.horizon:.0f}s ({robust:.0f} at {k:g}x the forecast's error), the drains "
                                     f"cost {c.cost:.0f}", nums,
            learned=moved))
    if c.reason == "Relieve":
        return _bounded(c.target, s.total, s.limits, Verdict(
            c.target, "Relieve", f"{text}: a role is at capacity ({max(c.now.prefill_use, c.now.decode_use):.0%}); "
                                 f"{c.best.prefill} prefills leave the most headroom", nums, learned=moved))
    if c.reason == "AtBest":
        return Verdict(None, "AtBest", f"{text}: as good as it gets", nums, learned=mem)
    return Verdict(None, "MoveDoesNotPay", f"{text}: gains {c.gain:.0f} requests over {s.horizon:.0f}s, the drains "
                                           f"cost {c.cost:.0f}; holding", nums, learned=mem)


def _part_way(s: Step, c: gp.Choice, robust: float, targets: gp.Targets, k: float) -> tuple[gp.Choice, float]:
    """When the move the model chose is unsure, the largest part of the way (halving the distance)
    that pays under every demand the forecast's error allows; else the move as it was."""
    d = c.target - s.current
    while abs(d) > 1:
        d = int(d / 2)
        part = gp.move(s.current + d, s.current, s.total, s.ahead.demand, s.cap, s.m.max_batch, targets, s.horizon,
                       s.move_s, s.rb.method != "Replace", s.limits.max_in_flight, s.round_s)
        part = replace(part, whole_s=c.whole_s)
        if part.gain <= part.cost:
            continue
        r = _robust_gain(part, s.current, s.total, s.ahead.demand, s.cap, s.m.max_batch, targets, s.horizon,
                         s.ahead.err, k)
        if r > part.cost and r > 0:
            return replace(part, best=c.best), r
    return c, robust


def _way(c: gp.Choice, whole: gp.Choice) -> str:
    if c is whole:
        return ""
    return f"part of the way, to {c.target} prefills (the move to {whole.target} is unsure at the forecast's error), "


def _full_ms(s: Step) -> float:
    """The decode step time at a full batch of the forecast mix."""
    assert s.cap.step is not None
    fd = s.ahead.demand
    return s.cap.step.ms(s.m.max_batch, s.m.max_batch * (fd.prompt_tokens + fd.output_tokens / 2))


def _numbers(s: Step, k: float, robust: float, dwell_until: float) -> dict:
    """The numbers of the decision (status.lastDecision)."""
    d, fd, c, cap, m, now = s.d, s.ahead.demand, s.c, s.cap, s.m, s.now
    assert cap.step is not None and cap.prefill_tokens_per_s is not None
    nums = {"requestsPerS": round(d.requests_per_s, 3), "promptTokensPerS": round(d.requests_per_s * d.prompt_tokens),
            "promptBacklogTokens": round(d.prompt_backlog), "outputTokensPerS":
            round(d.requests_per_s * d.output_tokens), "decodeConcurrency": m.decode_concurrency,
            "decodeBacklog": round(d.decode_backlog), "contextTokens": round(m.context_tokens),
            "prefillTokensPerBusyS": round(cap.prefill_tokens_per_s), "decodeStepMs":
            f"{cap.step.a:.3g}*context+{cap.step.b:.3g}*batch+{cap.step.c:.3g}", "decodeStepMsFullBatch":
            round(_full_ms(s), 2), "waitScale": f"{cap.prefill_wait_scale:.2f}/{cap.decode_wait_scale:.2f}",
            "predictor": s.rb.goodput.predictor, "forecastRequestsPerS": round(fd.requests_per_s, 3),
            "forecastPromptTokens": round(fd.prompt_tokens), "forecastOutputTokens": round(fd.output_tokens),
            "moveS": round(c.move_s, 2), "wholeMoveS": round(max(c.move_s, c.whole_s), 2),
            "horizonS": round(s.horizon, 1), "goodputNow": round(c.now.goodput, 3),
            "bestPrefill": c.best.prefill, "goodputAtBest": round(c.best.goodput, 3), "gain": round(c.gain, 1),
            "cost": round(c.cost, 1),
            "forecastError": "/".join(f"{e:.3f}" for e in s.ahead.err),
            "forecastBy": "/".join(p for _, p in s.ahead.how), "marginK": round(k, 2),
            "margin": round(max(0.0, c.gain - robust), 1), "robustGain": round(robust, 1),
            "mixChangedSecondsAgo": "/".join(f"{now - t:.0f}" if t > -math.inf else "-" for t in s.ahead.changed)}
    if s.mem.moved_at is not None:
        nums["dwellUntilS"] = round(dwell_until - now, 1)
    return nums


def _text(s: Step) -> str:
    d, fd, c, cap = s.d, s.ahead.demand, s.c, s.cap
    assert cap.prefill_tokens_per_s is not None
    return (f"demand {d.requests_per_s:.2f} req/s ({d.prompt_tokens:.0f} prompt, {d.output_tokens:.0f} output "
            f"tokens), {s.rb.goodput.predictor} forecast {fd.requests_per_s:.2f} in {s.move_s:.0f}s; prefill "
            f"{cap.prefill_tokens_per_s:.0f} tokens/s busy, decode step {_full_ms(s):.1f} ms at batch "
            f"{s.m.max_batch}; goodput {c.now.goodput:.2f} req/s at {s.current} prefills, {c.best.goodput:.2f} at "
            f"{c.best.prefill}")


@dataclass(frozen=True)
class Memory(dm.Learned):
    """What Goodput keeps between evaluations besides the demand and capacity: when it last asked
    for a move, and which way (+1 more prefills, -1 fewer); and, per role (prefill, decoder), the
    requests its engines reported waiting and the ones the model said would wait, each summed over
    the evaluations with a decay (_calibrate). In memory only, as the rest: a restart forgets the
    last move, so the first evaluation after it may undo it sooner than the dwell."""
    moved_at: float | None = None
    moved_dir: int = 0
    queued_seen: tuple[float, ...] = (0.0, 0.0)
    queued_model: tuple[float, ...] = (0.0, 0.0)
    queued_evals: tuple[float, ...] = (0.0, 0.0)


def _calibrate(prev: Memory, sig: Signals, d: gp.Demand, cap: Capacity, current: int, total: int,
               max_batch: int, now: float) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...], Capacity]:
    """Each role's waits as long as its queues showed: the requests its serving engines report
    waiting (a prefill's queue, a decoder's decodes waiting for a slot), per engine, against what
    the model says of the same split and demand (goodput.queues), each summed over the evaluations
    with a decay of QUEUE_DECAY. The scale is their ratio with QUEUE_PRIOR_EVALS evaluations at
    the model's own waits added (and QUEUE_FLOOR requests on both sides), so one evaluation, or
    queues too short to say, keep about the model's waits. A role the model has at
    CALIBRATE_MAX_USE or beyond is not compared: its queue grows, whatever the model's steady
    state; nor are the queues while a move is under way or within SETTLE_S of one (what the
    engines that left queued is still being served). Returns the sums (seen, model, evaluations)
    and the capacity with the scales set."""
    moving = sig.idle_prefills or sig.idle_decoders or prev.moved_at is not None and now - prev.moved_at < SETTLE_S
    q = None if moving else gp.queues(current, total - current, d, cap, max_batch)
    seen = [x * QUEUE_DECAY for x in prev.queued_seen]
    model = [x * QUEUE_DECAY for x in prev.queued_model]
    evals = [x * QUEUE_DECAY for x in prev.queued_evals]
    if q is not None:
        observed = (statistics.fmean(p.queue for p in sig.prefills), statistics.fmean(x.waiting for x in sig.decoders))
        for i, (want, use) in enumerate(((q[0], q[2]), (q[1], q[3]))):
            if use < CALIBRATE_MAX_USE:
                seen[i] += observed[i]
                model[i] += want
                evals[i] += 1.0
    scale = []
    for s, m, n in zip(seen, model, evals):
        prior = QUEUE_PRIOR_EVALS * m / n + QUEUE_FLOOR if n > 0 else 1.0
        scale.append(min(MAX_WAIT_SCALE, max(1 / MAX_WAIT_SCALE, (s + prior) / (m + prior))))
    return tuple(seen), tuple(model), tuple(evals), replace(cap, prefill_wait_scale=scale[0],
                                                            decode_wait_scale=scale[1])


QUEUE_DECAY = 0.9     # the queues compared weigh this much less each evaluation (about the last ten count)
QUEUE_PRIOR_EVALS = 5.0    # evaluations at the model's own waits the comparison starts from
QUEUE_FLOOR = 0.5     # requests waiting added to both sides (queues the model has at about none)
CALIBRATE_MAX_USE = 0.95   # a role run this close to its capacity is not compared (its queue grows)
SETTLE_S = 20.0       # ... nor the queues this soon after a move was asked for (two report windows)
MAX_WAIT_SCALE = 8.0  # the waits are scaled by at most this, either way


MARGIN_K = 1.0        # a move must pay with the demand off by this many times the forecast's error
REVERSE_K = 2.0       # ... and by this many times more to undo the last move (hysteresis)
MIN_DWELL_S = 30.0    # no reversal sooner than this (or the horizon) after a move, unless the demand changed
FAILING = 0.5         # ... or the split serves less than this fraction of the demand
LEVEL = "Level"       # the forecast that the demand stays at its mean since it last changed
LATEST = "Latest"     # ... at its latest sample: the mix until the errors since its change are measured
CHANGE_Z = 4.0        # a change: the recent samples' mean this many standard errors from the earlier ones'
MIN_ERRORS = 3        # one-step errors needed to measure the forecast's error
MAX_ERROR = 0.5       # an error beyond this counts as this (the margin is wide enough by then)
UNMEASURED = 0.1      # the error assumed until MIN_ERRORS were measured (after a change, at the start)
NOTHING = 0.01        # a goodput under this fraction of the demand counts as serving nothing


def _arrived(sig: Signals) -> int:
    return sum(p.arrived for p in sig.prefills + sig.idle_prefills)


def _completed(sig: Signals) -> int:
    return sum(d.completed for d in sig.decoders + sig.idle_decoders)


def _counting(n: int) -> float:
    """The relative error of a mean over n requests (lengths spread about as widely as their mean)."""
    return min(MAX_ERROR, 1.0 / math.sqrt(n)) if n > 0 else MAX_ERROR


def _change_point(series: list[tuple[float, float]], floor: float = 0.01) -> int:
    """The index of the first sample since the demand last changed (0: no change seen): the latest
    split whose two sides' means differ by more than CHANGE_Z standard errors of the samples' noise
    (measured from their successive differences about their median, less the largest, so neither
    a drift nor the step itself counts as noise; at least `floor` of their mean, the noise of
    counting the requests they were measured over)."""
    start = 0
    while len(series) - start >= 3:
        vals = [v for _, v in series[start:]]
        diffs = [b - a for a, b in zip(vals, vals[1:])]
        mid = statistics.median(diffs)
        # the spread of the differences about their median (a drift), less the largest (a step)
        dev = sorted((x - mid) ** 2 for x in diffs)[:-1]
        noise = math.sqrt(statistics.fmean(dev) / 2)
        noise = max(noise, floor * abs(statistics.fmean(vals)), 1e-9)
        best, at = CHANGE_Z, 0
        for i in range(1, len(vals)):
            before, after = vals[:i], vals[i:]
            z = abs(statistics.fmean(after) - statistics.fmean(before)) / (
                noise * math.sqrt(1 / len(before) + 1 / len(after)))
            if z > best:
                best, at = z, i
        if not at:
            break
        start += at
    return start


def _settled(series: list[tuple[float, float]], floor: float, settle: float) -> int:
    """The index of the first sample measured wholly since the demand last changed: the first whose
    window (`settle` seconds, the reports') starts at or after the change point's sample, by when
    the change had happened; the change point's sample and the ones whose windows began before it
    may still hold some of the old demand (0: no change seen)."""
    i = _change_point(series, floor)
    if i == 0:
        return 0
    return next((j for j in range(i, len(series)) if series[j][0] - settle >= series[i][0]), len(series))


def _unmeasured(series: list[tuple[float, float]], floor: float | None, settle: float = 0.0) -> bool:
    """Too few samples of the mix since it last changed to measure a forecast's error (MIN_ERRORS
    one-step errors need MIN_ERRORS + 1 samples): the latest is the forecast then. A trend fitted
    to the two or three windows since a change extrapolates how far each of them still held the
    old mix (outputs of 80, 46, 43 tokens after a jump from 150 to 44 were forecast at 23), and
    with no error measured the gate cannot tell."""
    return floor is not None and len(series) - _settled(series, floor, settle) <= MIN_ERRORS


def _forecast(predictor: str, series: list[tuple[float, float]], at: float, window: float, period: float,
              floor: float | None = 0.01, settle: float = 0.0) -> float:
    """The forecast over the samples since the last change (none looked for with floor None;
    Seasonal: over all, it knows the season; LEVEL: their mean over the window)."""
    if not series:
        return 0.0
    if predictor == LATEST:
        return series[-1][1]
    since = series if floor is None or predictor == "Seasonal" and period > 0 else \
        series[_settled(series, floor, settle):] or series[-1:]
    if predictor == LEVEL:
        return statistics.fmean(v for t, v in since if t >= since[-1][0] - window)
    return fc.forecast(predictor, since, at, window, period)


def _error(predictor: str, series: list[tuple[float, float]], window: float, period: float,
           floor: float | None = 0.01, settle: float = 0.0) -> float:
    """The forecast's relative error, as measured: the root mean square of what it said of each
    recent sample from the ones before, over the sample; 0 until MIN_ERRORS were measured."""
    last = series[-1][0] if series else 0.0
    # of the samples since the last change only (Seasonal: all): a forecast that missed the change
    # itself says nothing of how well it follows the demand since
    since = 0 if floor is None or predictor == "Seasonal" and period > 0 else _settled(series, floor, settle)
    errs = []
    for j in range(since + 1, len(series)):
        if series[j][0] < last - window:
            continue
        f = _forecast(predictor, series[:j], series[j][0], window, period, floor, settle)
        if f > 0:
            errs.append(((series[j][1] - f) / f) ** 2)
    return min(MAX_ERROR, math.sqrt(statistics.fmean(errs))) if len(errs) >= MIN_ERRORS else UNMEASURED


def _robust_gain(c: gp.Choice, current: int, total: int, fd: gp.Demand, cap, max_batch: int, targets: gp.Targets,
                 horizon: float, err: list[float], k: float) -> float:
    """The gain of the move `c` chose should the demand be off by k times each error, whichever way
    hurts it most: the gain scaled by the worst case's goodput difference over the forecast's."""
    if c.target == current or c.gain <= 0:
        return c.gain
    base = gp.predict(c.target, total - c.target, fd, cap, max_batch, targets, horizon).goodput - c.now.goodput
    if base <= 0:
        return 0.0
    worst = base
    for fr, fp, fo in itertools.product((-1, 1), repeat=3):
        x = replace(fd, requests_per_s=fd.requests_per_s * max(0.0, 1 + fr * k * err[0]),
                    prompt_tokens=fd.prompt_tokens * max(0.05, 1 + fp * k * err[1]),
                    output_tokens=fd.output_tokens * max(0.05, 1 + fo * k * err[2]))
        to = gp.predict(c.target, total - c.target, x, cap, max_batch, targets, horizon).goodput
        stay = gp.predict(current, total - current, x, cap, max_batch, targets, horizon).goodput
        if max(to, stay) < NOTHING * fd.requests_per_s:
            continue   # a demand neither split serves says nothing of which is better
        worst = min(worst, to - stay)
    if worst < gp.MIN_GAIN * c.now.goodput:
        return 0.0   # within the model's own noise in the worst case: no gain to count on
    return c.gain * worst / base


def _control_s(last_switch: dict | None) -> float:
    """A switch's seconds besides its drain, as the last one that completed took."""
    if last_switch and last_switch.get("result") == "Completed" and "totalMs" in last_switch:
        return max(0.0, (last_switch["totalMs"] - last_switch.get("drainMs", 0)) / 1000)
    return CONTROL_S


def evaluate(spec: PDDeploymentSpec, sig: Signals, current: int, limits: Limits, now: float,
             learned: dm.Learned | None = None, last_switch: dict | None = None) -> Verdict:
    total = spec.total
    policy = _rb(spec).policy
    if policy == "Manual":
        return manual(spec, total, limits)
    if policy == "Schedule":
        return schedule(spec, total, limits, now)
    if policy == "Load":
        return load(spec, sig, current, total, limits)
    if policy == "Goodput":
        return goodput(spec, sig, current, total, limits, now, learned, last_switch)
    return slo(spec, sig, current, total, limits)


def next_fire(spec: PDDeploymentSpec, now: float) -> float | None:
    """Schedule: seconds until the next entry fires (so the pass that acts on it runs then)."""
    from cronsim import CronSim, CronSimError
    rb = spec.rebalance
    if rb is None or rb.policy != "Schedule" or not rb.schedule:
        return None
    try:
        tz = ZoneInfo(rb.time_zone)
        local = dt.datetime.fromtimestamp(now, tz)
        nxt = min(next(CronSim(e.cron, local)) for e in rb.schedule)
    except (ZoneInfoNotFoundError, ValueError, CronSimError, StopIteration):
        return None
    return max(0.0, nxt.timestamp() - now)
