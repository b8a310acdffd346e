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
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import scenarios as sc  # noqa: E402
import workloads as wl  # noqa: E402
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


def simulate(kind: str, n: int, only: list[str] | None = None, switch_s: float = 0.4, routers: int = 1
             ) -> dict[str, dict]:
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
                       engine_start_s=sc.ENGINE_START_S, wall_start=WALL0, routers=routers).run()
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
        # a fixed ratio's timeline is not kept past 4 engines: its prefill count is its name's
        tl = rows[name].get("timeline") or [{"t": b["t"], "prefill": int(name[6:].split("P")[0])} for b in first]
        label = f"{name} ({rows[name]['goodput_rps']:.1f} req/s)"
        ax[1].step([b["t"] for b in tl], [b["prefill"] for b in tl], "--" if name == best else "-", where="post",
                   label=label)
    ax[1].set_ylabel("prefill engines")
    ax[1].set_xlabel("trace time, s")
    ax[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ---- the workload family (bench/workloads.py): held-out seeds, against the grid in hindsight ----------------

WINDOW_S = 60.0        # the per-window best: the best fixed ratio of each window, as if switching were free
WORKLOAD_RUNS = ("Goodput", "Load")


def _source_key() -> str:
    """What the cached runs depend on besides the policy under test: the model and the generator."""
    import hashlib
    h = hashlib.sha256()
    for f in ("fleetsim.py", "workloads.py", "scenarios.py"):
        h.update((sc.BENCH / f).read_bytes())
    return h.hexdigest()[:12]


class _UntilGoodputKnown(FleetSim):
    """A fixed ratio's run, stopped once no request of the trace can still meet both SLOs (the last
    arrival, its TTFT target, the longest output at the TBT target): its goodput is then known, and
    the overloaded splits do not spend minutes draining queues that count for nothing."""
    cut = 0.0

    def _all_done(self) -> bool:
        return self.now >= self.cut or super()._all_done()


def _wl_run(job: tuple) -> tuple[str, dict]:
    """One run of one workload: goodput, moves and the requests meeting both SLOs per window."""
    n, family, seed, duration, name, switch_s, *more = job
    routers = more[0] if more else 1   # senders, each routing on its own view (bench-rebalance's load generators)
    rows = wl.generate(family, seed, n, duration, sc.MAX_BATCH)
    run = next(r for r in sc.runs(n, 0, 1.0, "sine") if r.name == name)
    doc = sc.pddeployment(run, "sim", "bench")
    spec = PDDeploymentSpec.model_validate(doc["spec"])
    bpt = derive(spec.model.kv_cache).bytes_per_token
    sim = (_UntilGoodputKnown if run.rebalance is None else FleetSim)(
        spec, rows, TimingModel(), sc.MAX_BATCH, bpt, duration, seed=seed, switch_s=switch_s,
        engine_start_s=sc.ENGINE_START_S, wall_start=WALL0, routers=routers)
    sim.cut = duration + (sc.SLO_TTFT_MS + 1024 * sc.SLO_TBT_MS) / 1000 + 1
    res = sim.run()
    windows = [0] * max(1, math.ceil(duration / WINDOW_S))
    good = failed = 0
    for r in res.requests:
        if r.last is None:
            failed += 1
            continue
        tbt = (r.last - r.first) / (r.output - 1) * 1000 if r.output > 1 else 0.0
        if (r.first - r.arrival) * 1000 <= sc.SLO_TTFT_MS and tbt <= sc.SLO_TBT_MS:
            good += 1
            windows[min(len(windows) - 1, int(r.arrival / WINDOW_S))] += 1
    decided = [d for d in res.decisions if d.get("target") is not None]
    return f"{n}/{family}/{seed}/{duration:g}/{name}", {
        "goodput_rps": good / duration, "requests": len(res.requests), "failed": failed,
        "moves": res.switches + res.replacements, "windows": windows, "decisions": len(decided)}


@dataclass(frozen=True)
class Big:
    """From 128 engines up a workload costs its fleet size in model time: the first `seeds` of
    them, each `duration` seconds long."""
    seeds: int = 5
    duration: float = 240.0


def plan(n: int, seeds: list[int], duration: float, big: Big) -> tuple[list[int], float]:
    """The seeds a fleet of n runs and for how long each."""
    return (seeds, duration) if n < 128 else (seeds[:big.seeds], big.duration)


def workloads(sizes: list[int], families: list[str], all_seeds: list[int], all_duration: float, jobs: int,
              switch_s: float, cache_path: Path, big: Big = Big()) -> dict:
    """Every (size, family, seed): the fixed grid (cached: it does not depend on the policies), Load
    and Goodput, and how Goodput compares."""
    cache = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    key = _source_key()
    if cache.get("source") != key:
        cache = {"source": key, "runs": {}}
    todo, out = [], {}
    for n in sizes:
        names = [sc.fixed_name(p, n) for p in sc.fixed_splits(n)] + list(WORKLOAD_RUNS)
        seeds, duration = plan(n, all_seeds, all_duration, big)
        for family in families:
            for seed in seeds:
                for name in names:
                    k = f"{n}/{family}/{seed}/{duration:g}/{name}"
                    if name == "Goodput" or k not in cache["runs"]:
                        todo.append((n, family, seed, duration, name, switch_s))
    # the longest first (the largest fleets), so the workers finish together
    todo.sort(key=lambda j: -j[0])
    t0 = time.monotonic()
    if jobs > 1:
        import multiprocessing as mp
        with mp.get_context("fork").Pool(jobs) as pool:
            done = pool.imap_unordered(_wl_run, todo)
            for i, (k, v) in enumerate(done):
                cache["runs"][k] = v
                if i % 20 == 0:
                    cache_path.write_text(json.dumps(cache))
    else:
        for k, v in map(_wl_run, todo):
            cache["runs"][k] = v
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    cache_path.write_text(json.dumps(cache))
    print(f"({len(todo)} runs modelled in {time.monotonic() - t0:.0f} s; the fixed grid and Load cached in "
          f"{cache_path})")
    for n in sizes:
        seeds, duration = plan(n, all_seeds, all_duration, big)
        for family in families:
            for seed in seeds:
                names = [sc.fixed_name(p, n) for p in sc.fixed_splits(n)] + list(WORKLOAD_RUNS)
                out[(n, family, seed)] = {name: cache["runs"][f"{n}/{family}/{seed}/{duration:g}/{name}"]
                                          for name in names}
    return out


def compare(rows: dict[str, dict], n: int, duration: float) -> dict:
    """Goodput against the best fixed ratio in hindsight, the per-window best, and half/half."""
    fixed = {k: v for k, v in rows.items() if k.startswith("fixed-")}
    best = max(fixed, key=lambda k: fixed[k]["goodput_rps"])
    per_window = sum(max(v["windows"][i] for v in fixed.values()) for i in range(len(rows["Goodput"]["windows"])))
    half = fixed.get(sc.fixed_name(n // 2, n))
    g = rows["Goodput"]["goodput_rps"]
    per_h = 3600 / duration
    # what no policy can beat: every request of the workload meeting both targets
    offered = fixed[best]["requests"] / duration
    return {"goodput": g, "best_fixed": best, "vs_best_fixed": g / max(1e-9, fixed[best]["goodput_rps"]),
            "ceiling": offered / max(1e-9, fixed[best]["goodput_rps"]),
            "vs_per_window": g / max(1e-9, per_window / duration),
            "vs_half": g / max(1e-9, half["goodput_rps"]) if half else None,
            "load_vs_best_fixed": rows["Load"]["goodput_rps"] / max(1e-9, fixed[best]["goodput_rps"]),
            "moves_per_h": rows["Goodput"]["moves"] * per_h, "load_moves_per_h": rows["Load"]["moves"] * per_h,
            "failed": rows["Goodput"]["failed"]}


def report(result: dict, sizes: list[int], families: list[str], all_seeds: list[int], all_duration: float,
           big: Big = Big()) -> dict:
    """Per size: each workload's numbers, then the median and worst over the seeds, and the goals."""
    summary: dict = {}
    for n in sizes:
        seeds, duration = plan(n, all_seeds, all_duration, big)
        print(f"workloads at {n} engines, {duration:g} s each, seeds {','.join(map(str, seeds))} "
              f"({'held out' if not set(seeds) & set(wl.TUNE_SEEDS) else 'INCLUDES TUNING SEEDS'})")
        print(f"{'family':8s} {'seed':>4s} {'Goodput':>8s} {'best fixed':>16s} {'xbest':>6s} {'xwindow':>7s} "
              f"{'xhalf':>6s} {'Load xbest':>10s} {'moves/h':>8s} {'Load m/h':>8s} {'failed':>6s}")
        cs = {}
        for family in families:
            for seed in seeds:
                c = cs[(family, seed)] = compare(result[(n, family, seed)], n, duration)
                print(f"{family:8s} {seed:4d} {c['goodput']:8.3f} {c['best_fixed']:>16s} {c['vs_best_fixed']:6.3f} "
                      f"{c['vs_per_window']:7.3f} {c['vs_half'] or 0:6.2f} {c['load_vs_best_fixed']:10.3f} "
                      f"{c['moves_per_h']:8.0f} {c['load_moves_per_h']:8.0f} {c['failed']:6d}")
        allc = list(cs.values())

        def stat(vals: list[float]) -> str:
            return f"median {statistics.median(vals):.3f}, worst {min(vals):.3f}" if vals else "-"
        xb = [c["vs_best_fixed"] for c in allc]
        xw = [c["vs_per_window"] for c in allc]
        mh = [c["moves_per_h"] for c in allc]
        lmh = [c["load_moves_per_h"] for c in allc]
        print(f"  Goodput / best fixed in hindsight: {stat(xb)} (the shifting families "
              f"{', '.join(f for f in families if f in wl.SHIFTING)}: "
              f"{stat([cs[(f, s)]['vs_best_fixed'] for f in families if f in wl.SHIFTING for s in seeds])})")
        print(f"  Goodput / per-window best ({WINDOW_S:g} s windows): {stat(xw)}")
        print(f"  moves per hour: Goodput median {statistics.median(mh):.0f} (max {max(mh):.0f}), "
              f"Load median {statistics.median(lmh):.0f}")
        for family in families:
            f = [cs[(family, s)] for s in seeds]
            print(f"  {family:8s} x best fixed {stat([c['vs_best_fixed'] for c in f])}; x half/half "
                  f"{stat([c['vs_half'] for c in f if c['vs_half']])}; moves/h "
                  f"{statistics.median([c['moves_per_h'] for c in f]):.0f}")
        ceil = [c["ceiling"] for c in allc]
        print(f"  the most any policy can have (every request within both targets) / best fixed: median "
              f"{statistics.median(ceil):.3f}; under 1.01x on {sum(x < 1.01 for x in ceil)} and under 1.05x on "
              f"{sum(x < 1.05 for x in ceil)} of {len(ceil)} workloads")
        goals = [("median >= 1.05x best fixed", statistics.median(xb) >= 1.05,
                  f"{statistics.median(xb):.3f}; at most {statistics.median(ceil):.3f} for any policy"),
                 ("worst seed >= 0.97x best fixed", min(xb) >= 0.97, f"{min(xb):.3f}")]
        shifting = [cs[(f, s)]["vs_half"] for f in families if f in wl.SHIFTING for s in seeds
                    if cs[(f, s)]["vs_half"]]
        if shifting:
            goals.append((">= 1.5x half/half on the shifting families (median)", statistics.median(shifting) >= 1.5,
                          f"median {statistics.median(shifting):.2f}, worst {min(shifting):.2f}"))
        steady = [cs[(f, s)]["vs_best_fixed"] for f in families if f in wl.STEADY for s in seeds]
        if steady:
            goals.append(("steady >= 0.97x best fixed", min(steady) >= 0.97, f"worst {min(steady):.3f}"))
        failed = sum(c["failed"] for c in allc)
        goals.append(("0 failed requests (Goodput)", failed == 0, f"{failed} failed"))
        for goal, met, why in goals:
            print(f"  goal: {goal}: {'met' if met else 'NOT met'} ({why})")
        print(flush=True)
        summary[str(n)] = {"duration_s": duration, "seeds": seeds,
                           "workloads": {f"{f}/{s}": c for (f, s), c in cs.items()},
                           "vs_best_fixed": {"median": statistics.median(xb), "worst": min(xb)},
                           "vs_per_window": {"median": statistics.median(xw), "worst": min(xw)},
                           "ceiling": {"median": statistics.median(ceil),
                                       "under_1_05": sum(x < 1.05 for x in ceil), "of": len(ceil)},
                           "moves_per_h": {"median": statistics.median(mh), "max": max(mh)},
                           "goals": [{"goal": g, "met": m, "numbers": w} for g, m, w in goals]}
    return summary


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
    ap.add_argument("--workloads", default=",".join(wl.FAMILIES),
                    help="the workload families (bench/workloads.py) to run after the traces ('' for none)")
    ap.add_argument("--seeds", default=",".join(map(str, wl.HELD_OUT_SEEDS)),
                    help="workload seeds (default: the held-out ones, never used for tuning)")
    ap.add_argument("--duration", type=float, default=480.0, help="seconds of each workload (below 128 engines)")
    ap.add_argument("--big-seeds", type=int, default=Big.seeds, help="seeds run from 128 engines up (the first ones)")
    ap.add_argument("--big-duration", type=float, default=Big.duration,
                    help="seconds of each workload from 128 engines up")
    ap.add_argument("--jobs", type=int, default=2, help="workload runs modelled at once")
    ap.add_argument("--routers", type=int, default=1,
                    help="senders routing the traces (not the workloads), each its share on its own refreshes "
                         "(a gateway: 1; bench-rebalance's load generators: one per 4 engines)")
    ap.add_argument("--workload-sizes", default=None, help="fleet sizes of the workloads (default: --sizes)")
    args = ap.parse_args()
    cluster = json.loads(Path(args.compare).read_text()) if args.compare else {}
    only = args.runs.split(",") if args.runs else None
    result: dict = {}
    for kind in filter(None, args.traces.split(",")):
        for n in (int(x) for x in args.sizes.split(",")):
            t0 = time.monotonic()
            rows = simulate(kind, n, only, args.switch_s, args.routers)
            result.setdefault(kind, {})[str(n)] = rows
            print(sc.table(f"trace {kind} {sc.TRACES[kind]}, {n} engines (model)", rows,
                           cluster.get("traces", {}).get(kind, {}).get("runs") if cluster.get("engines", 4) == n
                           else None, "cluster goodput", within=0.15 if n == 4 else 0.10))
            for goal, met, why in sc.goodput_goals(rows, kind):
                print(f"  goal: {goal}: {'met' if met else 'NOT met'} ({why})")
            print(f"  ({time.monotonic() - t0:.1f} s to model)\n", flush=True)
    largest = max(int(x) for x in args.sizes.split(","))
    traced = list(result)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for kind in traced:
        if not args.no_plot and largest > 4:
            png = Path(args.out).parent / f"policy-sim-{kind}-{largest}.png"
            plot(kind, largest, result[kind][str(largest)], png)
            print(f"plot: {png}")
        for n in result[kind]:
            for name, r in result[kind][n].items():
                if n != "4" and name.startswith("fixed-"):
                    r.pop("timeline", None)
    if args.workloads:
        sizes = [int(x) for x in (args.workload_sizes or args.sizes).split(",")]
        families, seeds = args.workloads.split(","), [int(x) for x in args.seeds.split(",")]
        big = Big(args.big_seeds, args.big_duration)
        runs = workloads(sizes, families, seeds, args.duration, args.jobs, args.switch_s,
                         Path(args.out).parent / "workloads-cache.json", big)
        result["workloads"] = report(runs, sizes, families, seeds, args.duration, big)
        result["workloads"]["about"] = "; ".join(
            f"{n} engines: {'held-out' if not set(v['seeds']) & set(wl.TUNE_SEEDS) else 'with tuning'} seeds "
            f"{','.join(map(str, v['seeds']))}, {v['duration_s']:g} s each"
            for n, v in result["workloads"].items()) + \
            "; see docs/benchmarks.md, 'Goodput on workloads it was not tuned on'"
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
