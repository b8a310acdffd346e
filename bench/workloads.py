"""A family of request workloads the Goodput policy was not tuned on (pure, seeded): the mix of
long-prompt and long-output requests and the arrival rate change by continuous drift, steps,
bursts and a diurnal shape, each with noise, at any fleet size.

A workload is two curves over the trace: the mix m(t) in [0, 1] (0: prompt-heavy, 3000 prompt
and 20 output tokens on average; 1: decode-heavy, 300 and 150; between, the means interpolated
geometrically) and the load u(t), a fraction of what the fleet carries at that mix with its best
split (so a fleet that follows the mix carries every u < 1; a fixed split does not). Arrivals are
a non-homogeneous Poisson process (thinning), lengths lognormal around the means (sigma 0.5), as
pd_agent.traces makes them. Every random choice (the family's parameters, the times of steps and
bursts, the noise) comes from the seed: the same (family, seed, fleet) gives the same rows.

Families:
- steady:  one mix and one load all along, with noise only (a fixed ratio is right here);
- drift:   the mix drifts continuously (a sum of slow random sinusoids), the load with noise;
- steps:   the mix jumps to a new level at random times (minutes apart), the load now and then;
- bursts:  a slowly drifting mix under a moderate load, with bursts (tens of seconds) of up to
           half as much again, some of them of a different mix;
- diurnal: a day compressed into the trace: the load rises and falls, the mix follows it
           (more decode-heavy at the peak), with noise.

Seeds: TUNE_SEEDS are the ones the policy's constants were chosen on; HELD_OUT_SEEDS are never
used for that, only to report (bench_policy_sim.py --workloads)."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable

from pd_agent import traces
from pd_agent.timing import TimingModel

FAMILIES = ("steady", "drift", "steps", "bursts", "diurnal")
SHIFTING = ("drift", "steps", "diurnal")     # the families whose mix moves far: a fixed ratio is wrong part of the time
STEADY = ("steady",)
TUNE_SEEDS = (1, 2, 3)
HELD_OUT_SEEDS = (101, 102, 103, 104, 105)
PROMPT_HEAVY, DECODE_HEAVY = traces.PROMPT_HEAVY, traces.DECODE_HEAVY
NOISE_STEP_S = 5.0       # the noise changes this often (AR(1) between)


def mix_means(m: float) -> tuple[float, float]:
    """(prompt, output) mean tokens at mix m: geometric between prompt-heavy (0) and decode-heavy (1)."""
    m = min(1.0, max(0.0, m))
    return (PROMPT_HEAVY[0] ** (1 - m) * DECODE_HEAVY[0] ** m, PROMPT_HEAVY[1] ** (1 - m) * DECODE_HEAVY[1] ** m)


class Capacity:
    """The request rate a fleet of n carries at mix m with its best split, on a grid of mixes."""

    def __init__(self, n: int, max_batch: int = 4, timing: TimingModel | None = None, points: int = 41):
        t = timing or TimingModel()
        self.grid = []
        for i in range(points):
            p, o = mix_means(i / (points - 1))
            pre = traces.prefill_rps(t, round(p), max_batch)
            dec = traces.decode_rps(t, round(p), round(o), max_batch)
            self.grid.append(max(min(k * pre, (n - k) * dec) for k in range(1, n)))

    def __call__(self, m: float) -> float:
        x = min(1.0, max(0.0, m)) * (len(self.grid) - 1)
        i = min(len(self.grid) - 2, int(x))
        f = x - i
        return self.grid[i] * (1 - f) + self.grid[i + 1] * f


@dataclass(frozen=True)
class Shape:
    family: str
    seed: int
    mix: Callable[[float], float]       # m(t) in [0, 1]
    load: Callable[[float], float]      # u(t): a fraction of the best split's capacity at m(t)


def _noise(rng: random.Random, duration: float, sd: float, keep: float = 0.8) -> Callable[[float], float]:
    """AR(1) noise sampled every NOISE_STEP_S, linear between: mean 0, standard deviation sd."""
    n = int(duration / NOISE_STEP_S) + 2
    xs, x = [], rng.gauss(0, sd)
    for _ in range(n):
        xs.append(x)
        x = keep * x + math.sqrt(1 - keep * keep) * rng.gauss(0, sd)

    def at(t: float) -> float:
        i = min(n - 2, max(0, int(t / NOISE_STEP_S)))
        f = min(1.0, max(0.0, t / NOISE_STEP_S - i))
        return xs[i] * (1 - f) + xs[i + 1] * f
    return at


def _clip(lo: float, hi: float, f: Callable[[float], float]) -> Callable[[float], float]:
    return lambda t: min(hi, max(lo, f(t)))


def _steps(rng: random.Random, duration: float, mean_hold: float, level: Callable[[float], float],
           min_jump: float = 0.0) -> Callable[[float], float]:
    """A piecewise-constant curve: a new level (at least min_jump from the last) after an
    exponential holding time of mean `mean_hold` (at least a fifth of it)."""
    times, levels = [0.0], [level(-1.0)]
    t = 0.0
    while True:
        t += max(mean_hold / 5, rng.expovariate(1 / mean_hold))
        if t >= duration:
            break
        for _ in range(20):
            v = level(levels[-1])
            if abs(v - levels[-1]) >= min_jump:
                break
        times.append(t)
        levels.append(v)

    def at(x: float) -> float:
        i = 0
        while i + 1 < len(times) and times[i + 1] <= x:
            i += 1
        return levels[i]
    return at


def shape(family: str, seed: int, duration: float) -> Shape:
    """The mix and load curves of one workload (family, seed)."""
    rng = random.Random(f"{family}:{seed}")
    mix_noise = _noise(rng, duration, 0.04)
    load_noise = _noise(rng, duration, 0.04)
    if family == "steady":
        m0, u0 = rng.uniform(0.15, 0.85), rng.uniform(0.6, 0.8)
        mix, load = (lambda t: m0 + mix_noise(t)), (lambda t: u0 + load_noise(t))
    elif family == "drift":
        # one slow wave that carries the mix most of the way across, one faster and smaller on it
        waves = [(rng.uniform(0.3, 0.45), rng.uniform(duration / 2, duration * 1.2), rng.uniform(0, 2 * math.pi)),
                 (rng.uniform(0.05, 0.15), rng.uniform(duration / 6, duration / 3), rng.uniform(0, 2 * math.pi))]
        m0, u0 = rng.uniform(0.4, 0.6), rng.uniform(0.7, 0.85)
        mix = lambda t: m0 + sum(a * math.sin(2 * math.pi * t / p + ph) for a, p, ph in waves) + mix_noise(t)  # noqa: E731
        load = lambda t: u0 + load_noise(t)  # noqa: E731
    elif family == "steps":
        level = _steps(rng, duration, rng.uniform(90, 160), lambda prev: rng.uniform(0.0, 1.0), min_jump=0.35)
        rate = _steps(rng, duration, duration / 2, lambda prev: rng.uniform(0.6, 0.85))
        mix, load = (lambda t: level(t) + mix_noise(t)), (lambda t: rate(t) + load_noise(t))
    elif family == "bursts":
        m0, a, p, ph = rng.uniform(0.3, 0.7), rng.uniform(0.1, 0.2), rng.uniform(duration, 2 * duration), \
            rng.uniform(0, 2 * math.pi)
        u0 = rng.uniform(0.5, 0.6)
        bursts, t = [], 0.0
        while True:
            t += rng.expovariate(1 / rng.uniform(60, 120))
            if t >= duration:
                break
            shift = rng.choice((0.0, 0.0, rng.uniform(-0.4, 0.4)))
            bursts.append((t, t + rng.uniform(10, 40), rng.uniform(1.3, 1.6), shift))

        def burst(t: float) -> tuple[float, float]:
            for s, e, k, dm in bursts:
                if s <= t < e:
                    return k, dm
            return 1.0, 0.0
        mix = lambda t: m0 + a * math.sin(2 * math.pi * t / p + ph) + burst(t)[1] + mix_noise(t)  # noqa: E731
        load = lambda t: u0 * burst(t)[0] + load_noise(t)  # noqa: E731
    elif family == "diurnal":
        lo, hi = rng.uniform(0.3, 0.45), rng.uniform(0.75, 0.9)
        m_lo, m_hi = rng.uniform(0.0, 0.3), rng.uniform(0.7, 1.0)
        if rng.random() < 0.5:
            m_lo, m_hi = m_hi, m_lo
        ph = rng.uniform(0, 2 * math.pi)
        day = lambda t: 0.5 - 0.5 * math.cos(2 * math.pi * t / duration + ph)  # noqa: E731
        mix = lambda t: m_lo + (m_hi - m_lo) * day(t) + mix_noise(t)  # noqa: E731
        load = lambda t: lo + (hi - lo) * day(t) + load_noise(t)  # noqa: E731
    else:
        raise ValueError(f"unknown workload family {family!r}: {', '.join(FAMILIES)}")
    return Shape(family, seed, _clip(0.0, 1.0, mix), _clip(0.05, 0.95, load))


def generate(family: str, seed: int, engines: int, duration: float, max_batch: int = 4,
             timing: TimingModel | None = None, max_prompt: int = 4096, max_output: int = 1024,
             cap: Capacity | None = None) -> list[tuple[float, int, int]]:
    """(arrival s, prompt tokens, output tokens) of one workload for a fleet of `engines`."""
    sh = shape(family, seed, duration)
    cap = cap or Capacity(engines, max_batch, timing)
    rate = lambda t: sh.load(t) * cap(sh.mix(t))  # noqa: E731
    peak = max(rate(i * duration / 2000) for i in range(2001)) * 1.05
    rng = random.Random(f"arrivals:{family}:{seed}:{engines}")
    rows, t = [], 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= duration:
            break
        if rng.random() * peak <= rate(t):
            p, o = mix_means(sh.mix(t))
            rows.append((t, _length(p, rng, max_prompt), _length(o, rng, max_output)))
    return rows


def _length(mean: float, rng: random.Random, cap: int) -> int:
    sigma = 0.5
    return max(1, min(cap, int(rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma))))
