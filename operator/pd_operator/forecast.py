"""Demand forecasts over the time a move takes (pure), by a named predictor over the demand
measured at each evaluation: a list of (time s, value), oldest first.

- Trend: a straight line fitted to the recent samples (least squares over `window` seconds),
  followed to the time asked; with fewer than three samples, the last one.
- Kalman: a local linear trend (level and slope) filtered over every sample, the noise of the
  measurements estimated from the samples themselves (the spread of their differences), so a
  steady signal is followed closely and a noisy one smoothly.
- Seasonal: the value one period before the time asked, shifted by how much the level moved since
  then (the mean of the last `window` against the same window a period earlier); Trend until the
  history covers a period.

A forecast is never negative; none extrapolates further than the history it read."""
from __future__ import annotations

import statistics
from typing import Sequence

PREDICTORS = ("Trend", "Kalman", "Seasonal")

Series = Sequence[tuple[float, float]]


def forecast(predictor: str, history: Series, at: float, window: float = 60.0, period: float = 0.0) -> float:
    """The demand expected at time `at` (at or after the last sample)."""
    if not history:
        return 0.0
    if predictor == "Kalman":
        out = kalman(history, at)
    elif predictor == "Seasonal" and period > 0 and history[-1][0] - history[0][0] >= period:
        out = seasonal(history, at, window, period)
    else:
        out = trend(history, at, window)
    return max(0.0, out)


def _reach(history: Series, at: float) -> float:
    """How far ahead a forecast may go: no further than the span the history covers."""
    last = history[-1][0]
    return min(at, last + max(0.0, last - history[0][0]))


def trend(history: Series, at: float, window: float = 60.0) -> float:
    recent = [(t, v) for t, v in history if t >= history[-1][0] - window]
    if len(recent) < 3:
        return history[-1][1]
    tm = statistics.fmean(t for t, _ in recent)
    vm = statistics.fmean(v for _, v in recent)
    var = sum((t - tm) ** 2 for t, _ in recent)
    slope = sum((t - tm) * (v - vm) for t, v in recent) / var if var > 0 else 0.0
    return vm + slope * (_reach(recent, at) - tm)


def kalman(history: Series, at: float) -> float:
    """Local linear trend: state (level, slope), each sample a noisy look at the level."""
    if len(history) < 3:
        return history[-1][1]
    diffs = [b - a for (_, a), (_, b) in zip(history, history[1:])]
    noise = (1.4826 * statistics.median(abs(d - statistics.median(diffs)) for d in diffs)) ** 2 / 2 or 1e-9
    r = noise                        # measurement variance
    q_level, q_slope = noise * 0.05, noise * 0.002   # how fast level and slope may wander, per second
    level, slope = history[0][1], 0.0
    p = [[r, 0.0], [0.0, noise]]
    t_prev = history[0][0]
    for t, v in history[1:]:
        dt = max(1e-6, t - t_prev)
        t_prev = t
        level += slope * dt
        p = [[p[0][0] + dt * (p[1][0] + p[0][1]) + dt * dt * p[1][1] + q_level * dt, p[0][1] + dt * p[1][1]],
             [p[1][0] + dt * p[1][1], p[1][1] + q_slope * dt]]
        s = p[0][0] + r
        k0, k1 = p[0][0] / s, p[1][0] / s
        innov = v - level
        level += k0 * innov
        slope += k1 * innov
        p = [[(1 - k0) * p[0][0], (1 - k0) * p[0][1]], [p[1][0] - k1 * p[0][0], p[1][1] - k1 * p[0][1]]]
    return level + slope * (_reach(history, at) - history[-1][0])


def _at(history: Series, t: float) -> float:
    """The history's value at time t, linearly between the samples around it."""
    prev = history[0]
    for cur in history:
        if cur[0] >= t:
            if cur[0] == prev[0]:
                return cur[1]
            f = (t - prev[0]) / (cur[0] - prev[0])
            return prev[1] + f * (cur[1] - prev[1])
        prev = cur
    return history[-1][1]


def seasonal(history: Series, at: float, window: float, period: float) -> float:
    last = history[-1][0]
    now = [v for t, v in history if t >= last - window]
    then = [v for t, v in history if last - period - window <= t <= last - period]
    shift = statistics.fmean(now) - statistics.fmean(then) if now and then else 0.0
    return _at(history, min(at, last + period) - period) + shift
