"""Synthetic request traces in the Mooncake JSON-lines format (`timestamp` in ms,
`input_length`, `output_length`), which `python -m pd_agent.loadgen --trace FILE` replays.

Deterministic for a seed. Rates are set relative to the capacity of a fleet (prefill and
decoder engine counts) computed from the simulator's timing models (pd_agent.timing):

- sine:  Dynamo-style: the arrival rate follows a sine between `low` and `high` times the
         fleet's capacity for the mix, over `period` seconds; the prompt/output mix is constant.
- shift: a constant arrival rate (`high` times the capacity of the average mix) whose mix
         alternates every half period between prompt-heavy (long prompts, short outputs) and
         decode-heavy (short prompts, long outputs): the ratio a fixed fleet gets wrong half
         the time.
- step:  the rate steps from `low` to `high` times the capacity at the middle of the trace.

Arrivals are a non-homogeneous Poisson process (thinning); lengths are lognormal around the
phase's means (sigma 0.5), capped at --max-prompt / --max-output.

    python -m pd_agent.traces shift --fleet 2x2 --duration 480 --period 240 --out shift.jsonl"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
from dataclasses import dataclass

from .timing import TimingModel

PROMPT_HEAVY = (3000, 20)     # (prompt mean, output mean) tokens
DECODE_HEAVY = (300, 150)
BALANCED = (1500, 150)


@dataclass(frozen=True)
class Fleet:
    prefills: int
    decoders: int
    max_batch: int = 4


def prefill_rps(t: TimingModel, prompt: int, batch: int) -> float:
    """Requests per second one prefill engine computes, batching up to `batch` prompts."""
    return batch / (t.prefill_ms([prompt] * batch) / 1000)


def decode_rps(t: TimingModel, prompt: int, output: int, batch: int) -> float:
    """Requests per second one decoder completes with a full batch (context at mid-decode)."""
    step_ms = t.decode_step_ms([prompt + output // 2] * batch)
    return batch / (output * step_ms / 1000)


def capacity(t: TimingModel, fleet: Fleet, prompt: int, output: int) -> float:
    """The fleet's request rate for a mix: the slower of its two roles."""
    return min(fleet.prefills * prefill_rps(t, prompt, fleet.max_batch),
               fleet.decoders * decode_rps(t, prompt, output, fleet.max_batch))


def _length(mean: float, rng: random.Random, cap: int) -> int:
    sigma = 0.5
    return max(1, min(cap, int(rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma))))


def generate(kind: str, fleet: Fleet, duration: float, period: float = 240, low: float = 0.4, high: float = 0.9,
             seed: int = 1, timing: TimingModel | None = None, max_prompt: int = 4096,
             max_output: int = 1024) -> tuple[list[dict], dict]:
    """(trace rows, what was used: capacities and rates) for one of sine, shift, step."""
    t = timing or TimingModel()
    rng = random.Random(seed)
    if kind == "sine":
        cap = capacity(t, fleet, *BALANCED)
        rate = lambda x: cap * (low + (high - low) * (1 + math.sin(2 * math.pi * x / period)) / 2)  # noqa: E731
        mix = lambda x: BALANCED  # noqa: E731
        info = {"capacity_rps": cap, "rate_rps": [cap * low, cap * high]}
    elif kind == "shift":
        # a rate the fleet carries in both phases if its ratio follows the mix (the best ratio of
        # each phase), which the fixed ratio of the same fleet does not
        n = fleet.prefills + fleet.decoders
        best = {name: max((capacity(t, Fleet(p, n - p, fleet.max_batch), *m), p) for p in range(1, n))
                for name, m in (("prompt_heavy", PROMPT_HEAVY), ("decode_heavy", DECODE_HEAVY))}
        cap = min(c for c, _ in best.values())
        rate = lambda x: cap * high  # noqa: E731
        mix = lambda x: PROMPT_HEAVY if (x % period) < period / 2 else DECODE_HEAVY  # noqa: E731
        info = {"capacity_rps": cap, "rate_rps": cap * high,
                "phases": {"prompt_heavy": {"mix": PROMPT_HEAVY, "best_prefills": best["prompt_heavy"][1],
                                            "fixed_capacity_rps": capacity(t, fleet, *PROMPT_HEAVY)},
                           "decode_heavy": {"mix": DECODE_HEAVY, "best_prefills": best["decode_heavy"][1],
                                            "fixed_capacity_rps": capacity(t, fleet, *DECODE_HEAVY)}}}
    elif kind == "step":
        cap = capacity(t, fleet, *BALANCED)
        rate = lambda x: cap * (low if x < duration / 2 else high)  # noqa: E731
        mix = lambda x: BALANCED  # noqa: E731
        info = {"capacity_rps": cap, "rate_rps": [cap * low, cap * high]}
    else:
        raise ValueError(f"unknown trace kind {kind!r}: sine, shift or step")
    peak = max(rate(x) for x in [i * duration / 1000 for i in range(1001)])
    rows, x = [], 0.0
    while True:
        x += rng.expovariate(peak)
        if x >= duration:
            break
        if rng.random() <= rate(x) / peak:
            p_mean, o_mean = mix(x)
            rows.append({"timestamp": round(x * 1000), "input_length": _length(p_mean, rng, max_prompt),
                         "output_length": _length(o_mean, rng, max_output)})
    info.update(kind=kind, requests=len(rows), duration_s=duration, period_s=period, seed=seed,
                fleet=f"{fleet.prefills}P{fleet.decoders}D", time_scale=t.time_scale)
    return rows, info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pd_agent.traces", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=["sine", "shift", "step"])
    ap.add_argument("--fleet", default="2x2", help="prefills x decoders whose capacity sets the rates")
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--duration", type=float, default=480)
    ap.add_argument("--period", type=float, default=240)
    ap.add_argument("--low", type=float, default=0.4, help="low rate, as a fraction of capacity")
    ap.add_argument("--high", type=float, default=0.9, help="high rate, as a fraction of capacity")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="-")
    args = ap.parse_args(argv)
    p, d = (int(v) for v in args.fleet.split("x"))
    rows, info = generate(args.kind, Fleet(p, d, args.max_batch), args.duration, args.period, args.low, args.high,
                          args.seed, TimingModel.from_env())
    out = sys.stdout if args.out == "-" else open(args.out, "w")
    for r in rows:
        out.write(json.dumps(r) + "\n")
    if out is not sys.stdout:
        out.close()
    print(json.dumps(info), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
