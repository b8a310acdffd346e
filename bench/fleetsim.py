"""A discrete-event model of a P-D fleet of N engines, driven by the operator's own policy and
switch functions (pd_operator.policies, .switch, .replace), so a trace runs in seconds at
fleet sizes this machine cannot run.

It models what the simulated serving (pd_agent.inference) does, with the same timing models:
- prefill: a FIFO per engine, batches of up to max_batch prompts, each batch costs
  TimingModel.prefill_ms; the cache waits on the prefill until a decoder pulled it.
- decode: continuous batching of up to max_batch requests; each step costs
  TimingModel.decode_step_ms of the running contexts and gives every running request a token;
  the KV pull costs kv_transfer_ms before the request joins the decoder's queue.
- the load report: each engine feeds the agent's own load meter (pd_agent.loadmeter) on the
  model's clock, and the policies read it through the operator's own mapping (rebalance.
  prefill_load, decoder_load), so Goodput measures demand and capacity as on a cluster;
- routing as pd-gateway routes (pd_router.routing): engine loads as of the last refresh (every
  second) plus what the router sent each engine since, the prefill with the least queued prompt
  tokens, then the decoder with the least running + queued, ties broken at random; draining
  engines are not chosen. `routers` senders each route their share on their own refreshes.
- switching as the operator does it: the policy is evaluated every pass (Manual, Schedule) or
  every evaluationIntervalSeconds (the others) on signals read from the engines (rebalance.
  decide_target, with its cooldown between decisions); switch.retarget stops what still drains
  and overshoots a new target (at once, here); switch.choose starts the move's switches; Drain
  ends when the engine holds no request and no unpulled cache, then the control-plane steps cost
  `switch_s` (what `make bench-switch` measures). Replace (replace.plan) adds engines that serve
  after `engine_start_s`, then drains and removes as many of the other role.

Between two events that change a decoder's batch, its steps are summed in closed form (the
step time grows linearly with the contexts), so the cost is per request, not per token."""
from __future__ import annotations

import collections
import heapq
import itertools
import math
import random
from dataclasses import dataclass, field

from pd_agent.inference import LATENCY_WINDOW_S
from pd_agent.loadmeter import LoadMeter
from pd_agent.timing import TimingModel
from pd_contract.agent_api import Load
from pd_operator import policies
from pd_operator import replace as rp
from pd_operator import switch as sw
from pd_operator.api import PDDeploymentSpec
from pd_operator.rebalance import PERIODIC, decide_target, decoder_load, limits, prefill_load

BUSY_WINDOW_S = 10.0
REFRESH_S = 1.0
PASS_S = 1.0           # the operator's pass while something is in motion


@dataclass
class Req:
    id: int
    arrival: float
    prompt: int
    output: int
    first: float | None = None
    last: float | None = None
    ctx: int = 0
    remaining: int = 0


@dataclass
class Engine:
    name: str
    group: str
    role: str
    serving_at: float = 0.0           # a new engine (Replace) serves from then
    draining: bool = False
    leaving: bool = False             # Replace: drains, then goes
    gone: bool = False
    # prefill
    queue: collections.deque = field(default_factory=collections.deque)
    busy_until: float = 0.0
    batch_n: int = 0
    busy: list = field(default_factory=list)     # (start, end) of prefill batches
    unpulled: int = 0
    # decode
    wait: collections.deque = field(default_factory=collections.deque)
    running: list = field(default_factory=list)
    pulling: int = 0
    seg: tuple | None = None          # (t0, S0, B, steps planned, version)
    version: int = 0
    ttft: collections.deque = field(default_factory=lambda: collections.deque(maxlen=2000))   # (at, ms)
    tbt: collections.deque = field(default_factory=lambda: collections.deque(maxlen=8000))
    # the agent's load report window, on the model's clock; the first engines' started long before
    # the traffic, as on a cluster (their first windows hold the seconds before it arrived)
    meter: LoadMeter = field(default_factory=LoadMeter)

    def serving(self, now: float) -> bool:
        return not self.gone and not self.draining and not self.leaving and now >= self.serving_at

    def idle(self) -> bool:
        return not (self.queue or self.batch_n or self.unpulled or self.wait or self.running or self.pulling)

    def in_flight(self) -> int:
        return len(self.queue) + self.batch_n + len(self.wait) + len(self.running) + self.pulling


@dataclass
class Result:
    requests: list[Req]
    duration_s: float
    timeline: list[dict]
    switches: int
    replacements: int
    decisions: list[dict]


class FleetSim:
    def __init__(self, spec: PDDeploymentSpec, rows: list[tuple[float, int, int]], timing: TimingModel,
                 max_batch: int, bytes_per_token: int, duration: float, seed: int = 1, switch_s: float = 0.4,
                 engine_start_s: float = 60.0, wall_start: float = 0.0, routers: int = 1):
        self.spec, self.t, self.mb = spec, timing, max_batch
        # senders routing on their own view of the loads, refreshed a second apart each but not
        # together (bench-rebalance's load generators: request i is sent by generator i % routers)
        self.routers = max(1, routers)
        self.bpt, self.duration, self.switch_s, self.start_s = bytes_per_token, duration, switch_s, engine_start_s
        self.wall0 = wall_start
        self.rng = random.Random(seed)
        self.ev: list = []
        self.seq = itertools.count()
        self.now = 0.0
        sizes = spec.group_sizes()
        self.engines = [Engine(f"prefill-{i}", "prefill", "prefill") for i in range(sizes["prefill"])] + \
                       [Engine(f"decoder-{i}", "decoder", "decoder") for i in range(sizes["decoder"])]
        self.reqs = [Req(i, a, p, o) for i, (a, p, o) in enumerate(rows) if a < duration]
        self.ranked: list[dict[str, list[tuple]]] = [{} for _ in range(self.routers)]   # heaps per router
        self.book = sw.Book()
        self.switching: dict[str, tuple[sw.Switch, float | None]] = {}   # pod -> (switch, drained at)
        self.sizes: dict | None = None
        self.n_switches = self.n_replaced = 0
        self.timeline: list[dict] = []
        self.decisions: list[dict] = []
        self.pending: list[list[Req]] = [[] for _ in range(self.routers)]   # no pair yet: retried every refresh

    # ---- the event queue ----------------------------------------------------------------------
    def at(self, when: float, kind: str, *args) -> None:
        heapq.heappush(self.ev, (when, next(self.seq), kind, args))

    def run(self) -> Result:
        for r in self.reqs:
            self.at(r.arrival, "arrive", r)
        for k in range(self.routers):
            self.at(k * REFRESH_S / self.routers, "refresh", k)
        self.at(0.0, "pass")
        self.at(0.0, "sample")
        horizon = self.duration * 4 + 600      # requests admitted before the end may finish after it
        while self.ev:
            when, _, kind, args = heapq.heappop(self.ev)
            if when > horizon:
                break
            self.now = when
            getattr(self, "_" + kind)(*args)
            if kind in ("refresh", "pass", "sample") and when >= self.duration and self._all_done():
                break
        return Result(self.reqs, self.duration, self.timeline, self.n_switches, self.n_replaced, self.decisions)

    def _all_done(self) -> bool:
        return all(r.last is not None for r in self.reqs)

    # ---- routing ------------------------------------------------------------------------------
    def _refresh(self, k: int = 0) -> None:
        # the loads as the agents report them, plus what this sender has sent each engine since
        # (pd_router.routing.Fleet's tally): a heap per role, the least loaded on top
        heaps = self.ranked[k] = {"prefill": [], "decoder": []}
        for e in self.engines:
            if e.serving(self.now) and e.role in heaps:
                load = (sum(r.prompt for r in e.queue), len(e.queue) + len(e.wait)) if e.role == "prefill" \
                    else (len(e.running) + e.batch_n + len(e.queue) + len(e.wait), 0)
                heaps[e.role].append((load, self.rng.random(), e.name, e))
        for h in heaps.values():
            heapq.heapify(h)
        retry, self.pending[k] = self.pending[k], []
        for r in retry:
            self._arrive(r)
        if self.now < self.duration or not self._all_done():
            self.at(self.now + REFRESH_S, "refresh", k)

    def _pick(self, role: str, r: Req, take: bool = True) -> Engine | None:
        h = self.ranked[r.id % self.routers].get(role, [])
        while h:
            load, _, _, e = h[0]
            if e.role != role or not e.serving(self.now):
                heapq.heappop(h)    # switched or draining since the refresh: not until the next
                continue
            if take:
                sent = (load[0] + r.prompt, load[1] + 1) if role == "prefill" else (load[0] + 1, 0)
                heapq.heapreplace(h, (sent, self.rng.random(), e.name, e))
            return e
        return None

    def _arrive(self, r: Req) -> None:
        p = self._pick("prefill", r) if self._pick("decoder", r, take=False) is not None else None
        if p is None:
            self.pending[r.id % self.routers].append(r)
            return
        p.queue.append(r)
        p.meter.arrived(r.prompt, self.now)
        self._prefill_next(p)

    # ---- prefill ------------------------------------------------------------------------------
    def _prefill_next(self, e: Engine) -> None:
        if e.batch_n or not e.queue:
            return
        batch = [e.queue.popleft() for _ in range(min(self.mb, len(e.queue)))]
        e.batch_n = len(batch)
        dt = self.t.prefill_ms([r.prompt for r in batch]) / 1000
        e.busy.append((self.now, self.now + dt))
        if len(e.busy) > 256:
            del e.busy[:128]
        self.at(self.now + dt, "prefilled", e, batch, dt)

    def _prefilled(self, e: Engine, batch: list[Req], dt: float) -> None:
        e.batch_n = 0
        e.meter.prefilled(sum(r.prompt for r in batch), dt, self.now)
        for r in batch:
            d = self._pick("decoder", r)
            if d is None:      # every decoder went away meanwhile: the cache waits for the next refresh
                d = min((x for x in self.engines if x.role == "decoder" and not x.gone), key=Engine.in_flight)
            e.unpulled += 1
            d.pulling += 1
            self.at(self.now + self.t.kv_transfer_ms(r.prompt * self.bpt) / 1000, "pulled", e, d, r)
        self._prefill_next(e)

    def _pulled(self, p: Engine, d: Engine, r: Req) -> None:
        p.unpulled -= 1
        d.pulling -= 1
        r.ctx, r.remaining = r.prompt, r.output
        d.wait.append(r)
        d.meter.arrived(r.prompt, self.now)
        if len(d.running) < self.mb:
            self._decode_replan(d)

    # ---- decode: steps summed between batch changes ---------------------------------------------
    def _cum(self, s0: int, b: int, k: int) -> float:
        """Seconds of k decode steps from context sum s0 with b running (each step adds b)."""
        tm = self.t
        per = tm.decode_a * s0 + tm.decode_b * b + tm.decode_c
        return (k * per + tm.decode_a * b * k * (k - 1) / 2) * tm.time_scale / 1000

    def _decode_replan(self, d: Engine) -> None:
        """Settle the steps done so far (the one in progress completes first), admit, plan on."""
        if d.seg is not None:
            t0, s0, b, k, _ = d.seg
            # steps completed by now, and the one in progress: it ends at the next boundary
            lo, hi = 0, k
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if t0 + self._cum(s0, b, mid) <= self.now + 1e-12:
                    lo = mid
                else:
                    hi = mid - 1
            # a step that began this very instant takes the newcomers in (the engine batches what
            # is waiting when it starts a step)
            done = 0 if self.now - t0 <= 1e-12 else (min(k, lo + 1) if lo < k else k)
            end = t0 + self._cum(s0, b, done)
            self._apply_steps(d, t0, s0, b, done)
            d.seg = None
            if end > self.now + 1e-12:
                d.version += 1
                d.seg = (end, 0, 0, 0, d.version)      # a resume marker: replan at `end`
                self.at(end, "decode_resume", d, d.version)
                return
        while d.wait and len(d.running) < self.mb:
            d.running.append(d.wait.popleft())
        if not d.running:
            return
        b = len(d.running)
        s0 = sum(r.ctx for r in d.running)
        k = min(r.remaining for r in d.running)
        d.version += 1
        d.seg = (self.now, s0, b, k, d.version)
        self.at(self.now + self._cum(s0, b, k), "decode_end", d, d.version)

    def _apply_steps(self, d: Engine, t0: float, s0: int, b: int, k: int) -> None:
        if k <= 0 or b == 0:
            return
        first = t0 + self._cum(s0, b, 1)
        end = t0 + self._cum(s0, b, k)
        mean_step = (end - t0) / k * 1000
        # the report's steps: the first and the last of the run (the rest only count their tokens)
        d.meter.step(b, s0, self._cum(s0, b, 1) * 1000, first)
        if k > 1:
            d.meter.step(b, s0 + b * (k - 1), (end - t0 - self._cum(s0, b, k - 1)) * 1000, end)
        d.meter.generated(b * max(0, k - 2), end)
        still = []
        for r in d.running:
            if r.first is None:
                r.first = first
            r.ctx += k
            r.remaining -= k
            if r.remaining <= 0:
                r.last = end
                d.meter.completed(end)
                d.ttft.append((end, (r.first - r.arrival) * 1000))
            else:
                still.append(r)
        d.tbt.extend([(end, mean_step)] * b)
        d.running = still

    def _decode_end(self, d: Engine, version: int) -> None:
        if d.seg is None or d.seg[4] != version:
            return
        t0, s0, b, k, _ = d.seg
        self._apply_steps(d, t0, s0, b, k)
        d.seg = None
        self._decode_replan(d)

    def _decode_resume(self, d: Engine, version: int) -> None:
        if d.seg is None or d.seg[4] != version:
            return
        d.seg = None
        self._decode_replan(d)

    # ---- the operator -------------------------------------------------------------------------
    def signals(self) -> policies.Signals:
        now = self.now
        pre, dec, ttft, tbt = [], [], [], []
        idle_p, idle_d = [], []   # draining or switching: their windows count in demand (as the operator's)
        for e in self.engines:
            serving = e.serving(now)
            if e.gone or not serving and not (e.draining or e.leaving or e.name in self.switching):
                continue
            if e.role == "prefill":
                busy = sum(min(b, now) - max(a, now - BUSY_WINDOW_S) for a, b in e.busy if b > now - BUSY_WINDOW_S
                           and a < now)
                (pre if serving else idle_p).append(prefill_load(e.meter.fill(Load(
                    prefill_busy=min(1.0, busy / BUSY_WINDOW_S), queue_depth=len(e.queue),
                    queued_prompt_tokens=sum(r.prompt for r in e.queue)), now)))
            else:
                e.meter.context_tokens = sum(r.ctx for r in e.running)
                (dec if serving else idle_d).append(decoder_load(e.meter.fill(Load(
                    running=len(e.running), decode_queue=len(e.wait), max_batch=self.mb), now)))
                if not serving:
                    continue
                for window, into in ((e.ttft, ttft), (e.tbt, tbt)):
                    while window and window[0][0] < now - LATENCY_WINDOW_S:
                        window.popleft()
                    recent = [v for at, v in window if at <= now]
                    if recent:
                        into.append(_p90(recent))
        return policies.Signals(prefills=pre, decoders=dec, idle_prefills=idle_p, idle_decoders=idle_d,
                                ttft_p90_ms=max(ttft) if ttft else None, tbt_p90_ms=max(tbt) if tbt else None)

    def _candidates(self) -> list[sw.Candidate]:
        out = []
        for e in self.engines:
            if e.gone or e.leaving:
                continue
            s = self.switching.get(e.name)
            out.append(sw.Candidate(pod=e.name, uid=e.name, group=e.group, role=s[0].to if s else e.role,
                                    available=s is None and e.serving(self.now), switchable=True,
                                    in_flight=e.in_flight()))
        return out

    def _engine(self, name: str) -> Engine:
        return next(x for x in self.engines if x.name == name)

    def _pass(self) -> None:
        spec, rb = self.spec, self.spec.rebalance
        wall = self.wall0 + self.now
        if rb is not None:
            self._advance(wall)
            cands = self._candidates()
            current = sw.prefill_count(cands)
            sig = self.signals() if rb.policy in PERIODIC else policies.Signals()
            v, _, self.book = decide_target(spec, self.book, sig, current, wall)
            if v is not None and (not self.decisions or self.decisions[-1]["reason"] != v.reason
                                  or self.decisions[-1].get("target") != v.target):
                self.decisions.append({"t": round(self.now, 1), "reason": v.reason, "target": v.target})
            lim = limits(spec, self.book.retry_after)
            target = sw.clamp_target(self.book.target, spec.total, lim) if self.book.target is not None else None
            if rb.method == "Replace":
                self._replace(target, lim, wall)
            else:
                # a move in progress follows the target: what still drains and overshoots it stops at once
                for s in sw.retarget([s for s, _ in self.switching.values()], cands, target, wall):
                    if s.step == sw.ABORT:
                        self._engine(s.pod).draining = False
                        del self.switching[s.pod]
                d = sw.choose(self._candidates(), [s for s, _ in self.switching.values()], target, lim, wall,
                              "policy")
                for s in d.starts:
                    self._engine(s.pod).draining = True
                    self.switching[s.pod] = (s, None)
        if self.now < self.duration or not self._all_done():
            self.at(self.now + PASS_S, "pass")

    def _advance(self, wall: float) -> None:
        for name, (s, drained) in list(self.switching.items()):
            e = self._engine(name)
            if drained is None:
                if e.idle():
                    self.switching[name] = (s, self.now)
            elif self.now >= drained + self.switch_s:
                old, e.role, e.draining = e.role, s.to, False
                e.meter.reset(self.now, left=old)   # as the agent's: the new role's window starts empty
                del self.switching[name]
                self.n_switches += 1
                started = s.started - self.wall0
                self.book.last = {"pod": name, "from": s.from_, "to": s.to, "result": "Completed",
                                  "drainMs": round((drained - started) * 1000),
                                  "totalMs": round((self.now - started) * 1000)}

    def _replace(self, target: int | None, lim: sw.Limits, wall: float) -> None:
        live = [e for e in self.engines if not e.gone and not e.leaving]
        starting = [e for e in live if e.serving_at > self.now]
        sizes = self.sizes or {"prefill": sum(e.role == "prefill" for e in live),
                               "decoder": sum(e.role == "decoder" for e in live)}
        unsettled = "new pods are starting" if starting else None
        new, _ = rp.plan(sizes, target, lim, wall, unsettled, "policy", self.spec.total)
        if new is None:
            return
        if new.get("growing"):
            g = new["growing"]
            for _ in range(new["prefill"] + new["decoder"] - self.spec.total):
                e = Engine(f"{g}-r{len(self.engines)}", g, g, serving_at=self.now + self.start_s)
                e.meter = LoadMeter(started=e.serving_at)   # no window before it serves (its peers' are longer)
                self.engines.append(e)
        else:
            shrink = "decoder" if sizes.get("growing") == "prefill" else "prefill"
            k = sizes["prefill"] + sizes["decoder"] - self.spec.total
            for victim in [e for e in live if e.role == shrink][-k:]:
                victim.leaving = True
                self.n_replaced += 1
        self.sizes = new

    def _sample(self) -> None:
        for e in self.engines:
            if e.leaving and not e.gone and e.idle():
                e.gone = True
        live = [e for e in self.engines if not e.gone and self.now >= e.serving_at]
        self.timeline.append({"t": round(self.now, 1), "prefill": sum(e.role == "prefill" for e in live),
                              "decoder": sum(e.role == "decoder" for e in live),
                              "switching": len(self.switching)})
        if self.now < self.duration or not self._all_done():
            self.at(self.now + 1.0, "sample")


def _p90(values) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(0.9 * len(s)))]


def summarize(res: Result, slo_ttft_ms: float, slo_tbt_ms: float, bucket_s: float = 10.0) -> dict:
    """The loadgen's numbers (pd_agent.loadgen.summarize) for the model's requests, plus a
    timeline per bucket: arrivals/s, TTFT and TBT p90 of the requests that arrived in it."""
    from pd_agent.loadgen import Result as LR
    from pd_agent.loadgen import summarize as ls
    out = []
    for r in res.requests:
        if r.last is None:
            out.append(LR(ok=False, reason="Unfinished"))
            continue
        tbt = (r.last - r.first) / (r.output - 1) * 1000 if r.output > 1 else 0.0
        out.append(LR(ok=True, ttft_ms=(r.first - r.arrival) * 1000, tbt_ms=tbt))
    s = ls(out, res.duration_s, slo_ttft_ms, slo_tbt_ms)
    series = timeline(res.timeline, [(r.arrival, o.ttft_ms if o.ok else None, o.tbt_ms if o.ok else None)
                                     for r, o in zip(res.requests, out)], res.duration_s, bucket_s)
    return {**s.__dict__, "switches": res.switches, "replacements": res.replacements, "timeline": series}


def timeline(counts: list[dict], reqs: list[tuple[float, float | None, float | None]], duration: float,
             bucket_s: float) -> list[dict]:
    """Per bucket of the trace: prefill count (last sample in it), arrivals/s, TTFT and TBT p90."""
    n = max(1, math.ceil(duration / bucket_s))
    by = [[] for _ in range(n)]
    for a, ttft, tbt in reqs:
        i = min(n - 1, int(a / bucket_s))
        by[i].append((ttft, tbt))
    out, ci = [], 0
    for i in range(n):
        end = (i + 1) * bucket_s
        while ci + 1 < len(counts) and counts[ci + 1]["t"] <= end:
            ci += 1
        ttfts = [x for x, _ in by[i] if x is not None]
        tbts = [y for _, y in by[i] if y is not None]
        out.append({"t": i * bucket_s, "prefill": counts[ci]["prefill"] if counts else None,
                    "rate": len(by[i]) / bucket_s, "ttft_p90": _p90(ttfts) if ttfts else None,
                    "tbt_p90": _p90(tbts) if tbts else None})
    return out
