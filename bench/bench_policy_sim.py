"""`make bench-policy-sim`: the rebalancing policies on a discrete-event model of the fleet
(bench/fleetsim.py: the simulator's timing models, batching, routing and drain rules, driven
by the operator's own policy and switch functions) at 4, 32 and 256 engines, each trace, the
runs of `make bench-rebalance` with a grid of fixed ratios (every split of 4 engines, sixteenths
of a larger fleet), in seconds to minutes. With --compare RESULT.json (what `make bench-rebalance`
wrote) the 4-engine goodputs are printed beside the cluster's (goal: within 15%).

    python bench/bench_policy_sim.py [--sizes 4,32,256] [--traces shift] [--compare bench/results/rebalance.json]"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import scenarios as sc  # noqa: E402
from fleetsim import FleetSim, summarize  # noqa: E402

from pd_agent import traces  # noqa: E402
from pd_agent.timing import TimingModel  # noqa: E402
from pd_operator.api import PDDeploymentSpec  # noqa: E402
from pd_operator.cachedesc import derive  # noqa: E402

WALL0 = 1_800_000_000 - 1_800_000_000 % 3600     # an hour boundary: the schedule's minutes count from it


def trace_rows(kind: str, n: int) -> list[tuple[float, int, int]]:
    """The shipped 4-engine trace, or the same generator's trace for a fleet of n (rates scaled)."""
    if n == 4:
        rows = sc.read(kind)
    else:
        rows, _ = traces.generate(kind, traces.Fleet(n // 2, n // 2, sc.MAX_BATCH), sc.DURATION_S, sc.PERIOD_S, seed=1)
    return [(r["timestamp"] / 1000, r["input_length"], r["output_length"]) for r in rows]


def simulate(kind: str, n: int, only: list[str] | None = None, switch_s: float = 0.4) -> dict[str, dict]:
    rows = trace_rows(kind, n)
    out = {}
    for run in sc.runs(n, 0, 1.0, kind):
        if only and run.name not in only and not ("fixed" in only and run.rebalance is None):
            continue
        doc = sc.pddeployment(run, "sim", "bench")
        spec = PDDeploymentSpec.model_validate(doc["spec"])
        bpt = derive(spec.model.kv_cache).bytes_per_token
        t0 = time.monotonic()
        res = FleetSim(spec, rows, TimingModel(), sc.MAX_BATCH, bpt, sc.DURATION_S, seed=1, switch_s=switch_s,
                       engine_start_s=sc.ENGINE_START_S, wall_start=WALL0).run()
        s = summarize(res, sc.SLO_TTFT_MS, sc.SLO_TBT_MS)
        s["model_s"] = round(time.monotonic() - t0, 2)
        out[run.name] = s
    return out


def plot(kind: str, n: int, rows: dict[str, dict], path: Path) -> None:
    """Arrivals and the prefill count over the trace: the policies and the best fixed ratio."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fixed = [r for r in rows if r.startswith("fixed-")]
    best = max(fixed, key=lambda r: rows[r]["goodput_rps"]) if fixed else None
    shown = [r for r in ("Goodput", "Load", "Schedule", "Load+Replace") if r in rows] + ([best] if best else [])
    fig, ax = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True, gridspec_kw={"height_ratios": [1, 2]})
    first = rows[shown[0]]["timeline"]
    ax[0].plot([b["t"] for b in first], [b["rate"] for b in first], color="black")
    ax[0].set_ylabel("arrivals / s")
    ax[0].set_title(f"trace {kind}: {sc.TRACES[kind]} ({n} engines, model)")
    for name in shown:
        tl = rows[name]["timeline"]
        label = f"{name} ({rows[name]['goodput_rps']:.1f} req/s)"
        ax[1].step([b["t"] for b in tl], [b["prefill"] for b in tl], "--" if name == best else "-", where="post",
                   label=label)
    ax[1].set_ylabel("prefill engines")
    ax[1].set_xlabel("trace time, s")
    ax[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4,32,256")
    ap.add_argument("--traces", default=",".join(sc.TRACES))
    ap.add_argument("--runs", default=None, help="comma-separated subset of " + ",".join(sc.RUNS)
                    + " (fixed: every fixed ratio)")
    ap.add_argument("--switch-s", type=float, default=0.4, help="control-plane seconds of a switch (bench-switch)")
    ap.add_argument("--compare", default=None, help="a bench-rebalance result JSON: print its goodput beside")
    ap.add_argument("--out", default=str(sc.BENCH / "results" / "policy-sim.json"))
    ap.add_argument("--no-plot", action="store_true", help="no plot of the largest fleet (needs matplotlib)")
    args = ap.parse_args()
    cluster = json.loads(Path(args.compare).read_text()) if args.compare else {}
    only = args.runs.split(",") if args.runs else None
    result: dict = {}
    for kind in args.traces.split(","):
        for n in (int(x) for x in args.sizes.split(",")):
            t0 = time.monotonic()
            rows = simulate(kind, n, only, args.switch_s)
            result.setdefault(kind, {})[str(n)] = rows
            print(sc.table(f"trace {kind} {sc.TRACES[kind]}, {n} engines (model)", rows,
                           cluster.get("traces", {}).get(kind, {}).get("runs") if cluster.get("engines", 4) == n
                           else None, "cluster goodput", within=0.15 if n == 4 else 0.10))
            for goal, met, why in sc.goodput_goals(rows, kind):
                print(f"  goal: {goal}: {'met' if met else 'NOT met'} ({why})")
            print(f"  ({time.monotonic() - t0:.1f} s to model)\n", flush=True)
    big = max(int(x) for x in args.sizes.split(","))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for kind in result:
        if not args.no_plot and big > 4:
            png = Path(args.out).parent / f"policy-sim-{kind}-{big}.png"
            plot(kind, big, result[kind][str(big)], png)
            print(f"plot: {png}")
        for n in result[kind]:
            for name, r in result[kind][n].items():
                if n != "4" and name.startswith("fixed-"):
                    r.pop("timeline", None)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
