"""Demand in each role's own units, measured from the serving engines' reports (pure), and what
the Goodput policy keeps between its evaluations: the demand's history (for the forecast) and the
capacity it measured last (for when no engine was busy enough to measure it again).

- requests/s and their prompt tokens: what arrived at the prefills over the reports' window (what
  the clients ask for, whether or not the fleet keeps up), counted once for the fleet: what each
  engine took on as a prefill, in its role now or one it has left since, over the whole window;
- output tokens per request: the tokens the decoders generated over the decodes they finished
  (a request's output is known once it is done), counted the same way;
- backlogs: the prompt tokens queued at the prefills and the decodes waiting for a batch slot;
- capacity: capacity.measure over the prefills' (tokens computed, busy seconds) and the decoders'
  recent steps."""
from __future__ import annotations

import math
from dataclasses import dataclass

from . import capacity as cp
from .goodput import Demand
from .signals import Signals


@dataclass(frozen=True)
class Learned:
    history: tuple[tuple[float, float, float, float], ...] = ()   # (at, requests/s, prompt, output tokens)
    capacity: cp.Capacity | None = None


@dataclass(frozen=True)
class Measured:
    demand: Demand | None          # None: not measured yet (`missing` says what)
    learned: Learned
    max_batch: int = 1
    decode_concurrency: int = 0    # decodes running and waiting, now
    context_tokens: float = 0.0    # mean context a running decode holds
    missing: str = ""
    window_s: float = 0.0          # the longest window the demand's sample was measured over


def measure(sig: Signals, learned: Learned | None, now: float, keep_s: float) -> Measured:
    prev = learned or Learned()
    # what arrived and was done counts the engines draining or switching too (their windows saw
    # demand a moment ago); what runs and waits now, the serving ones
    pre, dec = sig.prefills + sig.idle_prefills, sig.decoders + sig.idle_decoders
    cap = cp.measure([(p.computed_tokens, p.busy_s) for p in pre], [s for d in dec for s in d.steps], prev.capacity)
    max_batch = max(1, max(d.max_batch for d in dec))
    running = sum(d.running for d in sig.decoders)
    context = sum(d.context_tokens for d in sig.decoders) / running if running else 0.0
    concurrency = running + sum(d.waiting for d in sig.decoders)
    if not _windows([p.window_s for p in pre]) or not _windows([d.window_s for d in dec]):
        return Measured(None, Learned(prev.history, cap), max_batch, concurrency, context,
                        "the engines report no load window (agents older than the Goodput policy)")
    # one window for the fleet, not each engine's own: one that took the prefill role a few seconds
    # ago is filled first (routing prefers the emptiest queue), and its count over its short window
    # would count those seconds at the rate of a whole one; one that left took its count with it
    # (what it reports as `earlier` now)
    every = [x.earlier for x in pre + dec]
    window = max(_windows([p.window_s for p in pre] + [e.full_window_s for e in every]))
    arrived = sum(p.arrived for p in pre) + sum(e.prompts for e in every)
    rps = arrived / window
    done = sum(d.completed for d in dec) + sum(e.completed for e in every)
    last = prev.history[-1] if prev.history else None
    prompt = (sum(p.arrived_tokens for p in pre) + sum(e.prompt_tokens for e in every)) / arrived if arrived \
        else (last[2] if last else None)
    output = (sum(d.output_tokens for d in dec) + sum(e.output_tokens for e in every)) / done if done \
        else (last[3] if last else None)
    if prompt is None or output is None:
        return Measured(None, Learned(prev.history, cap), max_batch, concurrency, context,
                        "no request has arrived yet" if prompt is None else "no decode has finished yet")
    history = tuple(h for h in prev.history if h[0] >= now - keep_s) + ((now, rps, prompt, output),)
    demand = Demand(requests_per_s=rps, prompt_tokens=prompt, output_tokens=output,
                    prompt_backlog=float(sum(p.queued_tokens for p in pre)),
                    decode_backlog=float(sum(d.waiting for d in sig.decoders)))
    missing = "" if cap.prefill_tokens_per_s is not None and cap.step is not None else \
        ("no prefill was busy long enough to time" if cap.prefill_tokens_per_s is None else
         "no decoder has reported a step")
    return Measured(demand, Learned(history, cap), max_batch, concurrency, context, missing,
                    max([window] + _windows([d.window_s for d in dec])))


def _windows(reported: list[float]) -> list[float]:
    """The windows an engine can have counted over: a report of NaN, infinity or none is no
    window (it would make the fleet's rate NaN or 0)."""
    return [w for w in reported if math.isfinite(w) and w > 0]
