"""`make bench-rebalance`: what live switching buys, side by side with fixed ratios and with
the peers' way (replacing pods), on the local cluster with the operator as a process.

For each trace (bench/traces, bench/scenarios.py says how they are made) eight PDDeployments
of 4 engines serve the same trace at the same time, each with its own load generator:
fixed 1P3D, 2P2D and 3P1D; Schedule (entries written for the trace); Load; SLO; Goodput; Load
with `method: Replace` (a new engine pays ENGINE_START_S before it serves). Time is compressed by
--compress: the simulator's time scale, the trace, the policies' intervals and cooldowns and
the engine start-up are all divided by it, and every number is printed back in trace time.

Prints one table per trace with the goals met or not, writes the numbers to
bench/results/rebalance[-xN].json and a plot per trace (prefill count, arrival rate, TTFT
and TBT p90 over time) to bench/results/rebalance-<trace>[-xN].png. --compare FILE prints
each run's goodput beside another result's (compressed against uncompressed: goal 10%).

    python bench/bench_rebalance.py [--compress 1] [--traces sine,shift,step] [--quick]
    python bench/bench_rebalance.py --compress 2 --compare bench/results/rebalance.json  # the compression check
    python bench/bench_rebalance.py --engines 16 --traces shift --runs best-fixed,Goodput,Load+Replace --one-at-a-time
    python bench/bench_rebalance.py --engines 16 --workload steps:101 --runs Goodput --one-at-a-time [--dry-run]

--engines N runs fleets of N engines on the same generator's trace for N (rates scaled, as
bench-policy-sim makes it), sent by N/4 load generator processes (each every (N/4)-th request:
one Python process carries only so many streams; each reports how late its own timers fired,
and a result whose load generators lagged measures them, not the fleet); --one-at-a-time runs
the fleets one after another when the machine cannot carry them side by side. Each run reports
the machine's CPU use while it ran.

--workload FAMILY:SEED runs one workload of bench/workloads.py (the generator bench-policy-sim
reports Goodput on, its held-out seeds among them) for the fleet instead of the traces, Goodput
only unless --runs names others, and prints each run's goodput beside what bench/fleetsim.py's
model predicts for the same workload, fleet and policy (goal: within 10%). --dry-run writes the
workload's requests and prints the model's prediction without starting a cluster."""
from __future__ import annotations

import argparse
import base64
import json
import math
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import scenarios as sc  # noqa: E402
from common import REPO, Bench  # noqa: E402
from fleetsim import timeline  # noqa: E402

RESULTS = sc.BENCH / "results"
QUICK_RUNS = ["fixed-2P2D", "Load", "Goodput", "Load+Replace"]
MODEL_ONLY = ["Goodput+Replace"]   # bench-policy-sim's; on the cluster only when named (--runs): CPU


def kname(run: str) -> str:
    return run.lower().replace("+", "-")


def wait_ready(bench: Bench, ns: str, names: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = set(names)
    while pending and time.monotonic() < deadline:
        for n in list(pending):
            st = bench.pdd(ns, n).get("status") or {}
            links = st.get("links") or {}
            if st.get("phase") == "Ready" and links.get("expected") and links.get("up") == links.get("expected"):
                pending.discard(n)
        time.sleep(1)
    if pending:
        raise SystemExit(f"not Ready after {timeout:.0f} s: {sorted(pending)}")


def cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    f = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = f[3] + (f[4] if len(f) > 4 else 0.0)
    return sum(f) - idle, sum(f)


def parse_workload(kind: str) -> tuple[str, int] | None:
    """(family, seed) of a workload named FAMILY:SEED (bench/workloads.py), None for a trace."""
    if ":" not in kind:
        return None
    import workloads as wl
    family, seed = kind.split(":", 1)
    if family not in wl.FAMILIES or not seed.isdigit():
        raise SystemExit(f"--workload {kind!r}: FAMILY:SEED with FAMILY one of {', '.join(wl.FAMILIES)}")
    return family, int(seed)


def title(kind: str) -> str:
    return sc.TRACES.get(kind) or f"workload {kind} (bench/workloads.py)"


def workload_rows(family: str, seed: int, engines: int) -> list[dict]:
    """The requests of one generated workload for a fleet of `engines`, as a trace's rows (what
    bench-policy-sim models for the same family, seed and fleet, over the traces' duration)."""
    import workloads as wl
    return [{"timestamp": round(t * 1000), "input_length": p, "output_length": o}
            for t, p, o in wl.generate(family, seed, engines, sc.DURATION_S, sc.MAX_BATCH)]


def model_goodput(kind: str, engines: int, names: list[str], switch_s: float = 0.4) -> dict[str, float]:
    """Each run's goodput (req/s) as bench/fleetsim.py's model predicts it for this workload and fleet,
    sent as the run sends it (a load generator per 4 engines, each routing its share)."""
    from bench_policy_sim import _wl_run
    family, seed = parse_workload(kind) or ("", 0)
    job = (engines, family, seed, float(sc.DURATION_S))
    return {name: _wl_run((*job, name, switch_s, load_generators(engines)))[1]["goodput_rps"]
            for name in names}


def load_generators(engines: int) -> int:
    """One load generator per 4 engines: one process carries only so many streams."""
    return max(1, engines // 4)


def trace_file(kind: str, engines: int) -> Path:
    """The shipped 4-engine trace, or the same generator's trace for `engines` (what bench-policy-sim
    models), or a generated workload (FAMILY:SEED)."""
    wl = parse_workload(kind)
    if wl is None and engines == 4:
        return sc.trace_path(kind)
    if wl is not None:
        rows = workload_rows(wl[0], wl[1], engines)
    else:
        from pd_agent import traces
        rows, _ = traces.generate(kind, traces.Fleet(engines // 2, engines // 2, sc.MAX_BATCH), sc.DURATION_S,
                                  sc.PERIOD_S, seed=1)
    path = RESULTS / "work" / f"{kind.replace(':', '-')}-{engines}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_trace(bench: Bench, kind: str, compress: float, only: list[str] | None, token_of,
              engines: int = 4) -> dict:
    ns = f"bench-rb-{kind.replace(':', '-')}-{uuid.uuid4().hex[:5]}"
    bench.namespace(ns)
    op, _ = bench.operator(ns, f"bench-rebalance-{kind}-operator.log")
    loads: dict[str, list[subprocess.Popen]] = {}
    outputs: list = []   # the load generators' stdout/stderr files, closed at the end
    shards = load_generators(engines)
    samples: dict[str, list[dict]] = {}
    work = RESULTS / "work"
    work.mkdir(parents=True, exist_ok=True)
    try:
        runs = [r for r in sc.runs(engines, 0, compress, kind)
                if (r.name in only if only else r.name not in MODEL_ONLY)]
        if not runs:
            raise SystemExit(f"none of {only} is a run at {engines} engines: "
                             f"{[r.name for r in sc.runs(engines, 0, compress, kind)]}")
        trace = trace_file(kind, engines)
        for r in runs:
            doc = sc.pddeployment(r, kname(r.name), ns, compress)
            if r.rebalance and r.rebalance["policy"] == "Schedule":
                # hold the ratio until the trace starts; the entries are written for its start minute
                doc["spec"]["rebalance"] = {**r.rebalance, "policy": "Manual", "manual": {"prefill": r.prefill}}
            bench.custom.create_namespaced_custom_object("pdoperator.io", "v1alpha1", ns, "pddeployments", doc)
        wait_ready(bench, ns, [kname(r.name) for r in runs], 300 + sc.ENGINE_START_S / compress + 10 * engines)
        # the trace starts on a minute, so the schedule's entries fire at its phase boundaries
        start = (int(time.time()) // 60 + 1) * 60
        if start - time.time() < 8:
            start += 60
        minute = time.gmtime(start).tm_min
        env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
        time.sleep(max(0.0, start - time.time() - 1.5))   # the load generators take about that to start
        for r in runs:
            name = kname(r.name)
            loads[r.name] = [subprocess.Popen(
                [sys.executable, "-m", "pd_agent.loadgen", "--kubeconfig", bench.kubeconfig, "--namespace", ns,
                 "--deployment", name, f"--token={token_of(ns, name)}", "--trace", str(trace),
                 "--trace-speed", str(compress), "--duration", "0", "--max-prompt", str(sc.MAX_SEQ),
                 "--max-output", "4096", "--slo-ttft-ms", str(sc.SLO_TTFT_MS / compress),
                 "--slo-tbt-ms", str(sc.SLO_TBT_MS / compress), "--shard", f"{k}/{shards}",
                 "--requests-out", str(work / f"{kind}-{name}-{k}.jsonl"), "--json"],
                # files, not pipes: nobody reads a pipe while the run goes, and a full one blocks
                stdout=_opened(outputs, work / f"{kind}-{name}-{k}.out"),
                stderr=_opened(outputs, work / f"{kind}-{name}-{k}.err"), text=True, cwd=REPO, env=env)
                for k in range(shards)]
        time.sleep(max(0.0, start - time.time()))
        cpu0 = cpu_times()
        for r in runs:
            if r.rebalance and r.rebalance["policy"] == "Schedule":
                entries = next(x for x in sc.runs(engines, minute, compress, kind) if x.name == "Schedule").rebalance[
                    "schedule"]
                bench.custom.patch_namespaced_custom_object(
                    "pdoperator.io", "v1alpha1", ns, "pddeployments", kname(r.name),
                    {"spec": {"rebalance": {"policy": "Schedule", "schedule": entries, "manual": None}}})
        t0 = time.time()
        while any(p.poll() is None for ps in loads.values() for p in ps):
            t = (time.time() - t0) * compress
            for r in runs:
                st = bench.pdd(ns, kname(r.name)).get("status") or {}
                samples.setdefault(r.name, []).append({"t": round(t, 1), "prefill": st.get("prefill"),
                                                       "decoder": st.get("decoder")})
            time.sleep(1)
        cpu1 = cpu_times()
        cpu = (cpu1[0] - cpu0[0]) / max(1.0, cpu1[1] - cpu0[1])
        out = {}
        for r in runs:
            parts, reqs = [], []
            for k, p in enumerate(loads[r.name]):
                p.wait()
                stdout = (work / f"{kind}-{kname(r.name)}-{k}.out").read_text()
                stderr = (work / f"{kind}-{kname(r.name)}-{k}.err").read_text()
                if p.returncode not in (0, 1) or not stdout.strip():
                    raise SystemExit(f"load generator {k} of {r.name} failed: {stderr[-2000:]}")
                parts.append(json.loads(stdout))
                reqs += [json.loads(x) for x in (work / f"{kind}-{kname(r.name)}-{k}.jsonl").read_text().splitlines()]
            s = combine(parts, reqs, sc.SLO_TTFT_MS / compress, sc.SLO_TBT_MS / compress)
            out[r.name] = in_trace_time(s, reqs, samples[r.name], compress)
            out[r.name]["cpu_busy"] = round(cpu, 3)   # the machine's, over the runs that ran together
        return out
    finally:
        for p in (p for ps in loads.values() for p in ps):
            if p.poll() is None:
                p.kill()
        for f in outputs:
            f.close()
        op.send_signal(signal.SIGTERM)
        try:
            op.wait(30)
        except subprocess.TimeoutExpired:
            op.kill()
        bench.core.delete_namespace(ns)


def _opened(files: list, path: Path):
    f = open(path, "w")
    files.append(f)
    return f


def combine(parts: list[dict], reqs: list[dict], slo_ttft_ms: float, slo_tbt_ms: float) -> dict:
    """The summaries of the load generators that shared a run, as one: counts from the requests
    each wrote, the longest duration, the worst loop lag."""
    from pd_agent.loadgen import Result, summarize
    results = [Result(ok=q["ok"], ttft_ms=q["ttft_ms"], tbt_ms=q["tbt_ms"], reason=q["reason"]) for q in reqs]
    s = vars(summarize(results, max(p["duration_s"] for p in parts), slo_ttft_ms, slo_tbt_ms))
    s["retried"] = sum(p["retried"] for p in parts)
    s["refused_by_reason"] = {}
    for p in parts:
        for k, v in p["refused_by_reason"].items():
            s["refused_by_reason"][k] = s["refused_by_reason"].get(k, 0) + v
    s["loop_lag_ms"] = {k: max(p.get("loop_lag_ms", {}).get(k, 0.0) for p in parts) for k in ("p99", "max")}
    return s


def in_trace_time(s: dict, reqs: list[dict], samples: list[dict], compress: float) -> dict:
    """The load generator's summary with times back in trace time; ratio moves counted from
    the sampled prefill counts; the timeline per 10 s of trace."""
    good = round(s["goodput_rps"] * s["duration_s"])
    dur = sc.DURATION_S
    moves = sum(1 for a, b in zip(samples, samples[1:])
                if a["prefill"] is not None and b["prefill"] is not None and a["prefill"] != b["prefill"])
    scale = lambda d: {k: (v * compress if v is not None else None) for k, v in d.items()}  # noqa: E731
    tl = timeline(samples, [(q["t"] * compress, q["ttft_ms"] * compress if q["ok"] else None,
                             q["tbt_ms"] * compress if q["ok"] else None) for q in reqs], dur, 10.0)
    return {"requests": s["requests"], "completed": s["completed"], "failed": s["failed"],
            "failed_by_reason": s["failed_by_reason"], "retried": s["retried"],
            "goodput_rps": good / dur, "slo_attainment": s["slo_attainment"],
            "ttft_ms": scale(s["ttft_ms"]), "tbt_ms": scale(s["tbt_ms"]), "switches": moves,
            "wall_s": s["duration_s"], "loop_lag_ms": s["loop_lag_ms"], "timeline": tl}


def plot(kind: str, rows: dict[str, dict], path: Path, compress: float, engines: int = 4) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    first = next(iter(rows.values()))["timeline"]
    ax[0].plot([b["t"] for b in first], [b["rate"] for b in first], color="black")
    ax[0].set_ylabel("arrivals / s")
    ax[0].set_title(f"trace {kind}: {title(kind)} ({engines} engines, compressed x{compress:g}, trace time)")
    for name, s in rows.items():
        tl = s["timeline"]
        ts = [b["t"] for b in tl]
        style = "--" if name.startswith("fixed") else "-"
        ax[1].step(ts, [b["prefill"] for b in tl], style, where="post", label=name)
        ax[2].plot(ts, [b["ttft_p90"] for b in tl], style, label=name)
        ax[3].plot(ts, [b["tbt_p90"] for b in tl], style, label=name)
    ax[1].set_ylabel("prefill engines")
    ax[2].set_ylabel("TTFT p90 ms")
    ax[2].set_yscale("log")
    ax[2].axhline(sc.SLO_TTFT_MS, color="grey", lw=0.8)
    ax[3].set_ylabel("TBT p90 ms")
    ax[3].axhline(sc.SLO_TBT_MS, color="grey", lw=0.8)
    ax[3].set_xlabel("trace time, s")
    ax[1].legend(fontsize=8, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def run_names(names: list[str], engines: int, kind: str) -> list[str]:
    """The runs named (any case, as `make bench-rebalance RUNS=goodput` spells them) as the scenarios do."""
    known = {r.name.lower(): r.name for r in sc.runs(engines, 0, 1.0, kind)}
    unknown = [n for n in names if n.lower() not in known]
    if unknown:
        raise SystemExit(f"no run {unknown} at {engines} engines: {', '.join(known.values())}")
    return [known[n.lower()] for n in names]


def beside_model(kind: str, engines: int, rows: dict[str, dict]) -> dict[str, dict]:
    """Each run's cluster goodput beside the model's for the same workload, fleet and policy (goal: 10%)."""
    model = model_goodput(kind, engines, list(rows))
    out = {}
    for name, m in model.items():
        got = rows[name]["goodput_rps"]
        diff = abs(got - m) / m if m else math.inf
        out[name] = {"cluster_goodput_rps": got, "model_goodput_rps": m, "diff": diff}
        print(f"  {name}: cluster {got:.3f} req/s, model {m:.3f} req/s ({diff:.1%}); goal: within 10% of the "
              f"model: {'met' if diff <= 0.10 else 'NOT met'}")
    return out


def dry_run(kind: str, engines: int, names: list[str]) -> dict[str, float]:
    """What a --workload run would send and what the model predicts of it, without a cluster."""
    path = trace_file(kind, engines)
    n = sum(1 for _ in path.open())
    print(f"workload {kind}, {engines} engines: {n} requests over {sc.DURATION_S} s in {path}")
    model = model_goodput(kind, engines, names)
    for name, m in model.items():
        print(f"  {name}: the model predicts {m:.3f} req/s goodput")
    return model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compress", type=float, default=1.0,
                    help="run this many times faster than the trace (x2 costs fidelity: see the README)")
    ap.add_argument("--traces", default=",".join(sc.TRACES))
    ap.add_argument("--runs", default=None, help="comma-separated subset of " + ",".join(sc.RUNS)
                    + " (best-fixed: the fixed split the model finds best on the first trace)")
    ap.add_argument("--quick", action="store_true", help=f"trace shift only, runs {', '.join(QUICK_RUNS)}")
    ap.add_argument("--compare", default=None, help="another result JSON: print its goodput beside")
    ap.add_argument("--out", default=None)
    ap.add_argument("--engines", type=int, default=4, help="engines per fleet (the trace's rates scale with it)")
    ap.add_argument("--one-at-a-time", action="store_true",
                    help="the fleets one after another (each alone on the machine), not side by side")
    ap.add_argument("--workload", default=None,
                    help="FAMILY:SEED: one generated workload (bench/workloads.py) instead of the traces; "
                         "Goodput only unless --runs says otherwise; the model's goodput printed beside")
    ap.add_argument("--dry-run", action="store_true",
                    help="with --workload: write its requests and print the model's prediction; no cluster")
    args = ap.parse_args()
    kinds = [args.workload] if args.workload else ["shift"] if args.quick else args.traces.split(",")
    only = QUICK_RUNS if args.quick else (args.runs.split(",") if args.runs else None)
    if args.workload:
        if only and "best-fixed" in only:
            raise SystemExit("--workload: name the fixed split (bench-policy-sim's workload table has the best)")
        only = run_names(only or ["Goodput"], args.engines, args.workload)
        if args.dry_run:
            dry_run(args.workload, args.engines, only)
            return
    if only and "best-fixed" in only:
        # every fixed split of a large fleet is too many fleets for this machine: the one the model
        # finds best in hindsight stands for them (bench-policy-sim shows the whole grid)
        from bench_policy_sim import simulate
        fixed = simulate(kinds[0], args.engines, ["fixed"])
        best = max((r for r in fixed if r.startswith("fixed-")), key=lambda r: fixed[r]["goodput_rps"])
        print(f"best fixed split of {args.engines} engines on trace {kinds[0]} (model): {best}", flush=True)
        only = [best if r == "best-fixed" else r for r in only]
    suffix = ("" if args.engines == 4 else f"-{args.engines}") + ("" if args.compress == 1 else f"-x{args.compress:g}")
    suffix += f"-{args.workload.replace(':', '-')}" if args.workload else ""
    out_path = Path(args.out) if args.out else RESULTS / f"rebalance{suffix}.json"
    other = json.loads(Path(args.compare).read_text()) if args.compare else None
    bench = Bench()

    def token_of(ns: str, name: str) -> str:
        for _ in range(100):
            try:
                sec = bench.core.read_namespaced_secret(f"{name}-agent-data-token", ns)
                return base64.b64decode(sec.data["token"]).decode()
            except Exception:  # noqa: BLE001 - created by the operator shortly after the PDDeployment
                time.sleep(0.2)
        raise SystemExit(f"no data token Secret for {name}")

    result = {"compress": args.compress, "engines": args.engines,
              "slo": {"ttft_ms": sc.SLO_TTFT_MS, "tbt_ms": sc.SLO_TBT_MS}, "traces": {}}
    t_all = time.monotonic()
    try:
        for kind in kinds:
            t0 = time.monotonic()
            if args.one_at_a_time:
                rows = {}
                for name in only or [r.name for r in sc.runs(args.engines, 0, 1.0, kind) if r.name not in MODEL_ONLY]:
                    rows.update(run_trace(bench, kind, args.compress, [name], token_of, args.engines))
                    print(f"  {name}: {rows[name]['goodput_rps']:.3f} req/s, machine CPU busy "
                          f"{rows[name]['cpu_busy']:.0%}, load generators' loop lag p99/max "
                          f"{rows[name]['loop_lag_ms']['p99']:.0f}/{rows[name]['loop_lag_ms']['max']:.0f} ms",
                          flush=True)
            else:
                rows = run_trace(bench, kind, args.compress, only, token_of, args.engines)
            result["traces"][kind] = {"runs": rows, "wall_s": round(time.monotonic() - t0)}
            o = other["traces"].get(kind, {}).get("runs") if other else None
            print(sc.table(f"trace {kind} {title(kind)}: {args.engines} engines, compressed x{args.compress:g}, "
                           "in trace time",
                           rows, o, f"x{other['compress']:g} goodput" if other else ""))
            for goal, met, why in sc.goodput_goals(rows, kind):
                print(f"  goal: {goal}: {'met' if met else 'NOT met'} ({why})")
            if parse_workload(kind):
                result["traces"][kind]["model"] = beside_model(kind, args.engines, rows)
            if o:
                diffs = [abs(rows[n]["goodput_rps"] - o[n]["goodput_rps"]) / o[n]["goodput_rps"]
                         for n in rows if n in o and o[n]["goodput_rps"]]
                worst = max(diffs) if diffs else float("nan")
                print(f"  goal: goodput within 10% of x{other['compress']:g} for every run: "
                      f"{'met' if worst <= 0.10 else 'NOT met'} (worst {worst:.1%})")
            png = RESULTS / (f"rebalance{suffix}.png" if parse_workload(kind) else f"rebalance-{kind}{suffix}.png")
            plot(kind, rows, png, args.compress, args.engines)
            print(f"  plot: {png.relative_to(REPO)}  ({time.monotonic() - t0:.0f} s)\n", flush=True)
            out_path.write_text(json.dumps(result, indent=1))
    finally:
        bench.close()
    print(f"wrote {out_path} in {time.monotonic() - t_all:.0f} s")


if __name__ == "__main__":
    main()
