"""What `make bench-rebalance` (the cluster) and `make bench-policy-sim` (the discrete-event
model) both run: the traces, the SLOs, and the seven ways to size the fleet, as PDDeployments.

Everything is written in trace time. `compress` > 1 runs the same thing faster on the
cluster: the simulator's time scale is 1/compress and the trace timestamps, the policy's
intervals and cooldown and the engine start-up delay are all divided by `compress`."""
from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
TRACES = {"sine": "(a) sinusoidal rate, constant mix", "shift": "(b) mix shifts prompt-heavy <-> decode-heavy",
          "step": "(c) rate steps up at the middle"}
PERIOD_S = 240           # the traces' period; the mix of `shift` changes every half period
DURATION_S = 480
SLO_TTFT_MS = 3000       # a request counts towards goodput when its TTFT and mean TBT are within these
SLO_TBT_MS = 60
ENGINE_START_S = 60      # what a new engine pays before it serves (weights loading): Replace pays it
EVAL_S = 10              # Load and SLO re-decide this often
GOODPUT_EVAL_S = 5       # Goodput re-decides this often, with this cooldown
COOLDOWN_S = 20
MAX_BATCH = 4
MAX_SEQ = 4096

POLICY_RUNS = ["Schedule", "Load", "SLO", "Goodput", "Load+Replace", "Goodput+Replace"]
RUNS = ["fixed-<P>P<D>D"] + POLICY_RUNS


def fixed_splits(total: int) -> list[int]:
    """The prefill counts of the fixed-ratio runs: every split of a small fleet, sixteenths of a
    large one (15 splits), so the best fixed ratio in hindsight is one the grid holds."""
    if total <= 16:
        return list(range(1, total))
    return sorted({min(total - 1, max(1, round(total * k / 16))) for k in range(1, 16)})


def fixed_name(prefill: int, total: int) -> str:
    return f"fixed-{prefill}P{total - prefill}D"


def trace_path(kind: str) -> Path:
    return BENCH / "traces" / f"{kind}.jsonl"


def read(kind: str) -> list[dict]:
    return [json.loads(x) for x in trace_path(kind).read_text().splitlines() if x.strip()]


def best_prefills(total: int, mix: tuple[int, int], rate: float | None = None, fewest: bool = True) -> int:
    """A prefill count for a mix, from the timing models: of the counts that carry `rate` with
    20% to spare, the fewest (or the most) prefills, so the next phase is the fewest switches
    away; without such a count (or a rate), the count with the most capacity."""
    from pd_agent import traces
    from pd_agent.timing import TimingModel
    t = TimingModel()
    cap = {p: traces.capacity(t, traces.Fleet(p, total - p, MAX_BATCH), *mix) for p in range(1, total)}
    enough = [p for p, c in cap.items() if rate is not None and c >= 1.2 * rate]
    if enough:
        return min(enough) if fewest else max(enough)
    return max(cap, key=cap.get)


def phases(kind: str, total: int = 4) -> list[tuple[float, float, int]]:
    """(start s, end s, prefill count) as the trace's generator knows is best: the schedule
    written for the trace. sine and step keep the balanced mix (one ratio all along); shift
    alternates the prompt-heavy and the decode-heavy mix every half period."""
    from pd_agent import traces
    if kind != "shift":
        return [(0, DURATION_S, best_prefills(total, traces.BALANCED))]
    _, info = traces.generate("shift", traces.Fleet(total // 2, total // 2, MAX_BATCH), 1, PERIOD_S)
    half = PERIOD_S / 2
    counts = (best_prefills(total, traces.PROMPT_HEAVY, info["rate_rps"], fewest=True),
              best_prefills(total, traces.DECODE_HEAVY, info["rate_rps"], fewest=False))
    return [(i * half, (i + 1) * half, counts[i % 2]) for i in range(int(DURATION_S / half))]


@dataclass(frozen=True)
class Run:
    name: str
    prefill: int        # pods in the prefill group at the start (of `total`)
    total: int
    rebalance: dict | None


def runs(total: int = 4, start_minute: int = 0, compress: float = 1.0, kind: str = "shift") -> list[Run]:
    """The seven runs for a fleet of `total` engines. Schedule entries fire at the minutes of the
    trace's phase boundaries, counted from `start_minute` (the wall-clock minute the trace
    starts at); a phase must last whole minutes of wall time."""
    half = total // 2
    sc = lambda s: max(1, round(s / compress))  # noqa: E731
    common = {"minPrefill": 1, "minDecoder": 1, "cooldownSeconds": sc(COOLDOWN_S), "signalMaxAgeSeconds": sc(30),
              "evaluationIntervalSeconds": sc(EVAL_S), "maxConcurrentSwitches": "25%"}
    targets = {"ttftP90Ms": round(SLO_TTFT_MS / compress), "tbtP90Ms": round(SLO_TBT_MS / compress)}
    entries = []
    for start, _, count in phases(kind, total):
        minute = start / compress / 60
        if abs(minute - round(minute)) > 1e-9:
            raise ValueError(f"a phase of {kind} starts at {start / compress:.0f} s of wall time, not on a minute")
        entries.append({"cron": f"{(start_minute + round(minute)) % 60} * * * *", "prefill": count})
    return [Run(fixed_name(p, total), p, total, None) for p in fixed_splits(total)] + [
        Run("Schedule", half, total, {**common, "policy": "Schedule", "schedule": entries}),
        Run("Load", half, total, {**common, "policy": "Load"}),
        Run("SLO", half, total, {**common, "policy": "SLO", "targets": targets}),
        # Goodput's gate, not a cooldown, keeps it from flapping: it evaluates twice as often
        Run("Goodput", half, total, {**common, "policy": "Goodput", "targets": targets,
                                     "evaluationIntervalSeconds": sc(GOODPUT_EVAL_S),
                                     "cooldownSeconds": sc(GOODPUT_EVAL_S)}),
        Run("Load+Replace", half, total, {**common, "policy": "Load", "method": "Replace"}),
        Run("Goodput+Replace", half, total, {**common, "policy": "Goodput", "targets": targets, "method": "Replace",
                                             "evaluationIntervalSeconds": sc(GOODPUT_EVAL_S),
                                             "cooldownSeconds": sc(GOODPUT_EVAL_S),
                                             "goodput": {"replaceSeconds": sc(ENGINE_START_S)}}),
    ]


MODEL = {"name": "tiny-llama", "modelId": 0,
         # a small KV footprint (64 B/token) so that many fleets' pulls fit on two cores
         "kvCache": {"attention": "GQA", "numLayers": 1, "numKvHeads": 1, "headDim": 16, "dtype": "float16",
                     "tensorParallel": 1, "maxBatch": MAX_BATCH, "maxSeqLen": MAX_SEQ}}


def pddeployment(run: Run, name: str, namespace: str, compress: float = 1.0) -> dict:
    """The PDDeployment of one run (lowercase `name`)."""
    spec = {
        "backend": "sim", "image": "example.com/pd/pd-sim-agent:0.1.0", "model": copy.deepcopy(MODEL),
        "datadist": {"port": 26000, "linkTimeoutMs": 2000, "topology": "FullMesh"},
        "prefill": {"replicas": run.prefill}, "decoder": {"replicas": run.total - run.prefill},
        "sim": {"timeScale": 1 / compress, "engineStartSeconds": math.ceil(ENGINE_START_S / compress)},
    }
    if run.rebalance is not None:
        spec["rebalance"] = copy.deepcopy(run.rebalance)
    return {"apiVersion": "pdoperator.io/v1alpha1", "kind": "PDDeployment",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}


def goodput_goals(table: dict[str, dict], kind: str) -> list[tuple[str, bool, str]]:
    """The goals for one trace's table (run -> numbers): (goal, met, the numbers). Goodput against
    the best fixed ratio of the grid in hindsight and, on the shifting trace, against half/half;
    every policy against Replace."""
    g = {r: v["goodput_rps"] for r, v in table.items()}
    fixed = [r for r in g if r.startswith("fixed-")]
    out = []
    if "Goodput" in g and fixed:
        bf = max(fixed, key=g.get)
        want = 1.0 if kind == "shift" else 0.97
        out.append((f"Goodput >= {want:g}x the best fixed in hindsight", g["Goodput"] >= want * g[bf] * 0.9995,
                    f"{g['Goodput']:.3f} vs {bf} {g[bf]:.3f} req/s, {g['Goodput'] / g[bf]:.3f}x"))
        halves = [r for r in fixed if table_split(r) is not None and table_split(r)[0] == table_split(r)[1]]
        if kind == "shift" and halves:
            h = halves[0]
            ratio = g["Goodput"] / g[h] if g[h] else math.inf
            out.append(("Goodput >= 1.5x fixed half/half", ratio >= 1.5, f"{ratio:.2f}x {h}"))
    if "Load+Replace" in g:
        for r in (x for x in ("Goodput", "Schedule", "Load", "SLO") if x in g):
            out.append((f"{r} > Load+Replace", g[r] > g["Load+Replace"],
                        f"{g[r]:.3f} vs {g['Load+Replace']:.3f} req/s"))
    failed = sum(v["failed"] for r, v in table.items() if not r.startswith("fixed-"))
    out.append(("0 failed requests (policies)", failed == 0, f"{failed} failed"))
    return out


def table_split(name: str) -> tuple[int, int] | None:
    """(prefills, decoders) of a fixed run's name."""
    if not name.startswith("fixed-"):
        return None
    p, d = name[len("fixed-"):].rstrip("D").split("P")
    return int(p), int(d)


def table(title: str, rows: dict[str, dict], other: dict[str, dict] | None = None, other_name: str = "",
          within: float | None = None) -> str:
    """One table per trace: goodput (req/s of trace time), SLO attainment, TTFT and TBT
    percentiles, failures, ratio moves; with `other`, its goodput beside and the difference
    (met or not against `within`)."""
    f = lambda d: "/".join(f"{d[k]:.0f}" if d.get(k) is not None else "-" for k in ("p50", "p90", "p99"))  # noqa: E731
    head = (f"{'run':16s} {'goodput':>8s} {'SLO att':>8s} {'TTFT p50/p90/p99 ms':>22s} {'TBT p50/p90/p99 ms':>20s} "
            f"{'failed':>6s} {'moves':>6s}" + (f" {other_name:>16s} {'diff':>6s}" if other else ""))
    lines = [title, head]
    for name, s in rows.items():
        moves = s["switches"] + s.get("replacements", 0)
        line = (f"{name:16s} {s['goodput_rps']:8.3f} {s['slo_attainment']:8.1%} {f(s['ttft_ms']):>22s} "
                f"{f(s['tbt_ms']):>20s} {s['failed']:6d} {moves:6d}")
        if other and name in other:
            c = other[name]["goodput_rps"]
            d = (s["goodput_rps"] - c) / c if c else float("inf")
            line += f" {c:16.3f} {d:+6.1%}" + ("" if within is None else f" {'met' if abs(d) <= within else 'NOT met'}")
        lines.append(line)
    return "\n".join(lines)
