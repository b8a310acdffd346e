"""What one engine of each role can do, measured online from the engines' own reports (pure).

- Prefill: prompt tokens computed per second of busy time, the median over the prefills busy
  long enough in the report's window to say (an idle engine says nothing about its speed, and a
  median ignores one that was slowed by something else); under a light load, all the prefills'
  busy time pooled.
- Decode: the step time as a function of the batch and the context it holds,
  T = a * context + b * batch + c ms (the simulator's decode-step form), fitted over the recent steps
  the decoders report, pooled (they run the same model on the same hardware). The fit is least
  squares reweighted to discount outliers (Huber weights), so a few slow steps do not tilt it,
  and pulled gently towards the previous fit, so steps that all share one batch size (which
  cannot tell b from c) keep what was learned before instead of swinging.

Nothing here is a constant of the simulator: the same code reads what a real engine reports."""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

MIN_BUSY_S = 0.5          # a prefill busy less than this in the window is not measured on its own
MIN_POOLED_S = 0.05       # ... but pooled with the others, if together they were busy this long
MAX_SAMPLES = 600         # steps the fit reads (evenly thinned beyond this)
HUBER_K = 1.5             # residuals beyond 1.5 robust standard deviations weigh less
PRIOR_WEIGHT = 1e-4       # the previous fit's pull, per sample (it settles only what the steps leave open)


@dataclass(frozen=True)
class StepFit:
    """Decode step time in ms: a * context tokens + b * batch + c."""
    a: float
    b: float
    c: float
    samples: int = 0

    def ms(self, batch: float, context: float) -> float:
        return self.a * context + self.b * batch + self.c


@dataclass(frozen=True)
class Capacity:
    prefill_tokens_per_s: float | None    # one prefill, while busy
    step: StepFit | None
    prefills_measured: int = 0
    # how much longer each role's queue waits than the goodput model's queue says (1: as it says),
    # as the queues the engines report showed (policies.Goodput calibrates them; see goodput.queues)
    prefill_wait_scale: float = 1.0
    decode_wait_scale: float = 1.0


def prefill_rate(busy: Sequence[tuple[float, float]], previous: float | None = None) -> tuple[float | None, int]:
    """(prompt tokens per busy second, engines measured) from each prefill's (tokens computed,
    busy seconds) in the window; the previous estimate when none was busy enough."""
    rates = [tokens / s for tokens, s in busy if s >= MIN_BUSY_S and tokens > 0]
    if rates:
        return statistics.median(rates), len(rates)
    # a light load keeps every prefill mostly idle: their busy time together still says it
    tokens, seconds = sum(t for t, s in busy if t > 0), sum(s for t, s in busy if t > 0)
    if seconds >= MIN_POOLED_S:
        return tokens / seconds, sum(1 for t, s in busy if t > 0 and s > 0)
    return previous, 0


def fit_steps(steps: Sequence[tuple[int, int, float]], previous: StepFit | None = None) -> StepFit | None:
    """Fit T = a*context + b*batch + c over (batch, context tokens, ms) steps. None without steps
    and without a previous fit."""
    steps = [s for s in steps if s[0] > 0 and s[2] > 0]
    if len(steps) > MAX_SAMPLES:
        stride = len(steps) / MAX_SAMPLES
        steps = [steps[int(i * stride)] for i in range(MAX_SAMPLES)]
    if not steps:
        return previous
    ms = [s[2] for s in steps]
    prior = previous or StepFit(0.0, 0.0, statistics.median(ms))
    rows = [(float(ctx), float(b), 1.0) for b, ctx, _ in steps]
    # the prior's pull is scaled per feature, so it means the same whatever the units
    scale = [max(1e-9, sum(r[j] * r[j] for r in rows) / len(rows)) for j in range(3)]
    lam = [PRIOR_WEIGHT * len(rows) * s for s in scale]
    w = [1.0] * len(rows)
    coef = [prior.a, prior.b, prior.c]
    for _ in range(8):
        coef = _weighted_ridge(rows, ms, w, lam, [prior.a, prior.b, prior.c])
        res = [y - sum(c * x for c, x in zip(coef, r)) for r, y in zip(rows, ms)]
        spread = 1.4826 * statistics.median(abs(r) for r in res) or 1e-9
        w = [1.0 if abs(r) <= HUBER_K * spread else HUBER_K * spread / abs(r) for r in res]
    a, b, c = (max(0.0, x) for x in coef)
    if (a, b) != (coef[0], coef[1]):   # a slope clipped at zero: the intercept takes the rest
        c = max(0.0, statistics.median(y - a * r[0] - b * r[1] for r, y in zip(rows, ms)))
    return StepFit(a, b, c, samples=len(rows))


def _weighted_ridge(rows: list[tuple[float, float, float]], y: list[float], w: list[float], lam: list[float],
                    prior: list[float]) -> list[float]:
    """argmin sum w (y - x.beta)^2 + sum lam (beta - prior)^2, by the 3x3 normal equations."""
    m = [[sum(wi * r[i] * r[j] for wi, r in zip(w, rows)) + (lam[i] if i == j else 0.0) for j in range(3)]
         for i in range(3)]
    v = [sum(wi * r[i] * yi for wi, r, yi in zip(w, rows, y)) + lam[i] * prior[i] for i in range(3)]
    return _solve3(m, v)


def _solve3(m: list[list[float]], v: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (the matrix is positive definite by the ridge)."""
    a = [row[:] + [x] for row, x in zip(m, v)]
    for col in range(3):
        piv = max(range(col, 3), key=lambda r: abs(a[r][col]))
        a[col], a[piv] = a[piv], a[col]
        for r in range(col + 1, 3):
            f = a[r][col] / a[col][col]
            for k in range(col, 4):
                a[r][k] -= f * a[col][k]
    out = [0.0, 0.0, 0.0]
    for r in (2, 1, 0):
        out[r] = (a[r][3] - sum(a[r][k] * out[k] for k in range(r + 1, 3))) / a[r][r]
    return out


def measure(prefill_busy: Sequence[tuple[float, float]], steps: Sequence[tuple[int, int, float]],
            previous: Capacity | None = None) -> Capacity:
    """Both roles' capacity from one evaluation's reports, falling back on the previous one's."""
    rate, n = prefill_rate(prefill_busy, previous.prefill_tokens_per_s if previous else None)
    return Capacity(prefill_tokens_per_s=rate, step=fit_steps(steps, previous.step if previous else None),
                    prefills_measured=n)
