"""The goodput model (pure): for a split of the engines into prefills and decoders, the requests
per second predicted to meet both targets (their own TTFT within ttftP90Ms, their mean TBT within
tbtP90Ms), from the demand measured in each role's own units and each engine's measured capacity.

Each engine is modelled as its own queue, as routing on loads a second old (plus what one router
sent since) makes it:
- a prefill as one server whose service time is a prompt's tokens over its measured tokens per
  busy second; the wait beyond a time x is rho * exp(-(mu - lambda) x) (M/M/1);
- a decoder as max_batch slots, each request holding one for its output tokens times the step
  time at the batch the load keeps (the step-time fit of capacity.py); the wait is Erlang C's;
- what queues now (prompt tokens, decodes waiting for a slot) drains at the spare capacity, and a
  role loaded past its capacity builds a queue over the horizon (fluid); the requests whose wait
  stays within the TTFT budget are the ones counted;
- the TTFT budget is shared by both waits (their sum is what a request sees);
- the mean TBT is the step time at that batch;
- what the queues miss (how prompt and output lengths spread, routing on loads a second old, by
  several routers that do not see what the others sent) is measured, not modelled: each
  role's waits are scaled by how much longer its queues ran than the model said (Capacity's
  prefill_wait_scale, decode_wait_scale; `queues` is the model's side of that comparison).

`choose` picks the prefill count of the highest predicted goodput (among near ties, the one
with the most headroom in its busier role), and moves only if what the move gains over its
horizon exceeds what its drains cost: engines that drain serve nothing for the time the move
takes, which the model prices as the goodput lost by the split without them. Of the moves
towards that split (a move of more engines than may switch at once takes more rounds), it makes
the one whose gain most exceeds its cost: all the way, or part of the way when the rest would
not pay within the horizon. When every split
predicts the same (a backlog none clears within the horizon predicts nothing anywhere), a
split whose busier role is at capacity moves to the one with the most headroom (Relieve)."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .capacity import Capacity

TIE = 0.002          # goodputs within this fraction of the best count as equal
MIN_GAIN = 0.01      # a move must gain at least this fraction of the current goodput (noise)
SATURATED = 0.98     # the utilisation whose waits stand for any beyond it
PRESSED = 0.1        # a split whose busier role has less headroom than this moves to relieve it


@dataclass(frozen=True)
class Demand:
    requests_per_s: float
    prompt_tokens: float           # mean per request
    output_tokens: float           # mean per request
    prompt_backlog: float = 0.0    # prompt tokens queued at the prefills now
    decode_backlog: float = 0.0    # decodes waiting for a batch slot now


@dataclass(frozen=True)
class Targets:
    ttft_ms: float
    tbt_ms: float


@dataclass(frozen=True)
class Prediction:
    prefill: int
    goodput: float                 # requests/s meeting both targets
    ttft_ok: float                 # fraction of requests within the TTFT target
    tbt_ms: float                  # the step time at the batch the load keeps
    prefill_use: float             # utilisation of each role (1: at capacity), its backlog spread over
    decode_use: float              # the horizon counted in

    @property
    def headroom(self) -> float:
        return 1.0 - max(self.prefill_use, self.decode_use)


@dataclass(frozen=True)
class _Wait:
    """One role's wait: P(W > x) = p * exp(-rate x) once the backlog's `w0` seconds drained (at
    `drain` per second), or, overloaded, while it grows by `growth` seconds per second."""
    p: float = 0.0
    rate: float = math.inf
    w0: float = 0.0
    drain: float = 0.0             # steady: the backlog's wait falls by this per second
    growth: float = 0.0            # overloaded

    @property
    def overloaded(self) -> bool:
        return self.growth > 0

    @property
    def mean(self) -> float:
        """The steady wait's mean, seconds."""
        return self.p / self.rate if 0 < self.rate < math.inf else 0.0


def _erlang_c(c: int, a: float) -> float:
    """Probability that a request waits, c servers offered a erlangs (a < c)."""
    b = 1.0
    for k in range(1, c + 1):
        b = a * b / (k + a * b)
    rho = a / c
    return b / (1 - rho + rho * b)


def _role(arrivals: float, service: float, servers: int, backlog_s: float, scale: float = 1.0
          ) -> tuple[_Wait, float]:
    """(wait, utilisation) of one engine: `arrivals`/s, each needing `service` s of one of
    `servers`, with `backlog_s` seconds of queued work per server. Past capacity the wait is the
    one just short of it (where waits already run long) and it grows besides, so a split that
    overloads a role never looks as good as one that does not. `scale`: the queue's waits are
    that many times the model's (a wait is scale times as long, as often)."""
    use = arrivals * service / servers
    steady = min(use, SATURATED)
    a = steady * servers
    p = _erlang_c(servers, a) if servers > 1 else steady
    rate = servers * (1 - steady) / service / scale if service > 0 else math.inf
    return _Wait(p=p, rate=rate, w0=backlog_s, drain=max(0.0, 1.0 - use), growth=max(0.0, use - 1.0)), use


def _tail(w: _Wait, x: float) -> float:
    """P(W > x) for a steady wait."""
    if x <= 0:
        return 1.0 if w.p > 0 else 0.0
    return w.p * math.exp(-w.rate * x) if w.rate < math.inf else 0.0


def _sum_tail(a: _Wait, b: _Wait, x: float) -> float:
    """P(Wa + Wb > x), each wait 0 or exponential (independent)."""
    if x <= 0:
        return 1.0
    both = a.p * b.p
    if both <= 0:
        return _tail(a, x) + _tail(b, x)
    ra, rb = a.rate, b.rate
    if abs(ra - rb) < 1e-9 * max(ra, rb):
        conv = (1 + ra * x) * math.exp(-ra * x)
    else:
        conv = (rb * math.exp(-ra * x) - ra * math.exp(-rb * x)) / (rb - ra)
    return a.p * (1 - b.p) * math.exp(-ra * x) + b.p * (1 - a.p) * math.exp(-rb * x) + both * conv


def _transient_ok(w: _Wait, budget: float, horizon: float) -> float:
    """The fraction of the horizon in which the queue this role has now, or builds, keeps its
    wait within the budget: a backlog drains at the spare capacity, an overload grows it."""
    if horizon <= 0:
        return 1.0
    if w.overloaded:
        return min(1.0, max(0.0, budget - w.w0) / (w.growth * horizon))
    if w.w0 <= budget:
        return 1.0
    if w.drain <= 0:   # at capacity exactly: a backlog past the budget never drains
        return 0.0
    return 1.0 - min(1.0, (w.w0 - budget) / w.drain / horizon)


@dataclass(frozen=True)
class _Split:
    """Both roles of one split: each one's wait and utilisation, a prompt's prefill seconds and
    the decode step time at the batch the load keeps."""
    prefill: _Wait
    prefill_use: float
    decode: _Wait
    decode_use: float
    prompt_s: float
    step_ms: float


def _split(prefills: int, decoders: int, demand: Demand, cap: Capacity, max_batch: int) -> _Split:
    assert cap.prefill_tokens_per_s is not None and cap.step is not None
    lam = demand.requests_per_s
    mu = cap.prefill_tokens_per_s
    s_p = demand.prompt_tokens / mu
    wp, use_p = _role(lam / prefills, s_p, 1, demand.prompt_backlog / (prefills * mu), cap.prefill_wait_scale)
    # the batch a decoder keeps: B = lambda_d * output * T(B), T linear in B
    ctx = demand.prompt_tokens + demand.output_tokens / 2
    lam_d = lam / decoders
    r = lam_d * demand.output_tokens / 1000.0
    slope = cap.step.a * ctx + cap.step.b
    batch = r * cap.step.c / (1 - r * slope) if r * slope < 1 else math.inf
    batch = min(float(max_batch), max(1.0, batch))
    step_ms = cap.step.ms(batch, batch * ctx)
    s_d = demand.output_tokens * step_ms / 1000.0
    wd, use_d = _role(lam_d, s_d, max_batch, demand.decode_backlog * s_d / (decoders * max_batch),
                      cap.decode_wait_scale)
    return _Split(wp, use_p, wd, use_d, s_p, step_ms)


def predict(prefills: int, decoders: int, demand: Demand, cap: Capacity, max_batch: int, targets: Targets,
            horizon: float) -> Prediction:
    """The goodput of `prefills` + `decoders` engines over the next `horizon` seconds."""
    lam = demand.requests_per_s
    if prefills < 1 or decoders < 1 or cap.prefill_tokens_per_s is None or cap.step is None:
        return Prediction(prefills, 0.0, 0.0, math.inf, math.inf, math.inf)
    x = _split(prefills, decoders, demand, cap, max_batch)
    wp, wd, step_ms = x.prefill, x.decode, x.step_ms
    budget = targets.ttft_ms / 1000.0 - x.prompt_s - step_ms / 1000.0
    ttft_ok = (1.0 - min(1.0, _sum_tail(wp, wd, budget))) * _transient_ok(wp, budget / 2, horizon) * \
        _transient_ok(wd, budget / 2, horizon)
    tbt_ok = 1.0 if step_ms <= targets.tbt_ms else max(0.0, 1.0 - (step_ms - targets.tbt_ms) / (0.2 * targets.tbt_ms))
    spread = (lambda w: w.w0 / horizon) if horizon > 0 else (lambda w: 0.0)
    return Prediction(prefills, lam * ttft_ok * tbt_ok, ttft_ok, step_ms, x.prefill_use + spread(wp),
                      x.decode_use + spread(wd))


def queues(prefills: int, decoders: int, demand: Demand, cap: Capacity, max_batch: int
           ) -> tuple[float, float, float, float] | None:
    """(requests waiting at a prefill, decodes waiting at a decoder, each role's utilisation) on
    average, as the model has it in the steady state of this split (Little: arrivals times the mean
    wait), with the waits unscaled: what the queues the engines report are compared with. None
    while a capacity is unmeasured."""
    if prefills < 1 or decoders < 1 or cap.prefill_tokens_per_s is None or cap.step is None:
        return None
    x = _split(prefills, decoders, replace(demand, prompt_backlog=0.0, decode_backlog=0.0),
               replace(cap, prefill_wait_scale=1.0, decode_wait_scale=1.0), max_batch)
    lam = demand.requests_per_s
    return lam / prefills * x.prefill.mean, lam / decoders * x.decode.mean, x.prefill_use, x.decode_use


@dataclass(frozen=True)
class Choice:
    now: Prediction                # the current split
    best: Prediction               # the split of the highest goodput
    target: int                    # the split the move that pays most goes to, else the current count
    gain: float                    # requests that move gains over the horizon (each round's split from then on)
    cost: float                    # requests its drains lose while it is made
    move_s: float                  # how long that move takes
    reason: str                    # Move | Relieve | NoGain | AtBest
    whole_s: float = 0.0           # how long the whole move to `best` takes (what the horizon must cover)


def choose(total: int, current: int, lo: int, hi: int, demand: Demand, cap: Capacity, max_batch: int,
           targets: Targets, horizon: float, move_s: float, drains: bool = True, max_in_flight: int | None = None,
           round_s: dict[str, float] | None = None) -> Choice:
    """The prefill count to have for the next `horizon` seconds, and whether moving there pays.
    `move_s`: what one round of a move takes; `round_s`, if known, per direction (the role the
    engines move to). A move of k engines, `max_in_flight` at a time, takes ceil(k / max_in_flight)
    rounds. `drains`: the engines that move drain first (a switch); otherwise (a replacement: the
    new ones serve before the old go) the move costs nothing but the time until it is done."""
    preds = [predict(p, total - p, demand, cap, max_batch, targets, horizon) for p in range(lo, hi + 1)]
    now = predict(current, total - current, demand, cap, max_batch, targets, horizon)
    top = max(x.goodput for x in preds)
    near = [x for x in preds if x.goodput >= top * (1 - TIE)]
    best = max(near, key=lambda x: (x.headroom, -abs(x.prefill - current)))
    if best.prefill == current:
        return Choice(now, best, current, 0.0, 0.0, move_s, "AtBest")
    if now.goodput >= top * (1 - TIE):
        # as good as the best over the horizon; but a role run past what it can carry (a backlog no
        # split clears within the horizon predicts nothing anywhere) needs the capacity all the same
        if now.headroom < PRESSED and best.headroom > now.headroom + PRESSED:
            return Choice(now, best, best.prefill, 0.0, 0.0, move_s, "Relieve")
        return Choice(now, best, current, 0.0, 0.0, move_s, "AtBest")
    # of the moves towards the best split, the one whose gain over the horizon most exceeds its
    # cost: the whole way if that pays most, else only as far as pays
    step = 1 if best.prefill > current else -1
    moves = [_move(x, current, now, total, demand, cap, max_batch, targets, horizon, move_s, drains,
                   max_in_flight, round_s)
             for x in preds if (x.prefill - current) * step > 0 and (x.prefill - best.prefill) * step <= 0]
    paying = [m for m in moves if m.gain > m.cost and m.best.goodput - now.goodput >= MIN_GAIN * max(now.goodput, 1e-9)]
    if not paying:
        whole = next(m for m in moves if m.best.prefill == best.prefill)
        return Choice(now, best, current, whole.gain, whole.cost, whole.move_s, "NoGain", whole.move_s)
    m = max(paying, key=lambda m: (m.gain - m.cost, -abs(m.best.prefill - best.prefill)))
    whole_s = next(x.move_s for x in moves if x.best.prefill == best.prefill)
    return Choice(now, best, m.best.prefill, m.gain, m.cost, m.move_s, "Move", whole_s)


def move(to: int, current: int, total: int, demand: Demand, cap: Capacity, max_batch: int, targets: Targets,
         horizon: float, move_s: float, drains: bool = True, max_in_flight: int | None = None,
         round_s: dict[str, float] | None = None) -> Choice:
    """The move from `current` prefills to `to` (its gain and cost over the horizon, as choose
    weighs the moves it considers; none to the current count)."""
    now = predict(current, total - current, demand, cap, max_batch, targets, horizon)
    if to == current:
        return Choice(now, now, current, 0.0, 0.0, 0.0, "AtBest")
    to_x = predict(to, total - to, demand, cap, max_batch, targets, horizon)
    return _move(to_x, current, now, total, demand, cap, max_batch, targets, horizon, move_s, drains,
                 max_in_flight, round_s)


def _move(to_x: Prediction, current: int, now: Prediction, total: int, demand: Demand, cap: Capacity,
          max_batch: int, targets: Targets, horizon: float, move_s: float, drains: bool,
          max_in_flight: int | None, round_s: dict[str, float] | None) -> Choice:
    """The move from `current` to `to_x`'s split, round by round: each round's engines serve
    neither role while they move (the cost, against staying where that round starts), and the
    split each round reaches serves the rest of the horizon until the next one (the gain)."""
    k = abs(to_x.prefill - current)
    at_once = min(k, max_in_flight or k)
    to = "prefill" if to_x.prefill > current else "decoder"
    step = 1 if to == "prefill" else -1
    d = round_s[to] if round_s else move_s
    rounds = math.ceil(k / at_once)
    took = rounds * d
    gain = cost = 0.0
    at = current
    for i in range(1, rounds + 1):
        n = min(at_once, k - (i - 1) * at_once)
        if drains:
            stay = predict(at, total - at, demand, cap, max_batch, targets, took)
            during = predict(at - n if to == "decoder" else at, total - at - (n if to == "prefill" else 0),
                             demand, cap, max_batch, targets, took)
            cost += max(0.0, stay.goodput - during.goodput) * d
        at += step * n
        reached = to_x if at == to_x.prefill else predict(at, total - at, demand, cap, max_batch, targets, horizon)
        until = horizon if i == rounds else min(horizon, (i + 1) * d)
        gain += (reached.goodput - now.goodput) * max(0.0, until - i * d)
    return Choice(now, to_x, to_x.prefill, gain, cost, took, "Move")


def drain_seconds(to: str, demand: Demand, cap: Capacity, prefills: int, decoders: int, max_batch: int) -> float:
    """How long the engines leaving a role take to drain: a decoder finishes its decodes (half an
    output on average at the batch the load keeps; the longest of a batch, about a whole one), a
    prefill its share of the queue and the prompt it computes."""
    if cap.prefill_tokens_per_s is None or cap.step is None:
        return 0.0
    if to == "prefill":   # decoders leave
        ctx = demand.prompt_tokens + demand.output_tokens / 2
        return demand.output_tokens * cap.step.ms(max_batch, max_batch * ctx) / 1000.0
    queued = demand.prompt_backlog / max(1, prefills) + demand.prompt_tokens
    return queued / cap.prefill_tokens_per_s
