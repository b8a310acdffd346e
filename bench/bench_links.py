"""`make bench-links`: time from "all pods Ready" to "PDDeployment Ready" (every decoder
linked to every prefill and the KV path verified), on the local cluster with the operator
as a real process, as the operator itself measures it (pd_operator_pods_ready_to_ready_seconds);
then, with the deployment Ready and idle, the operator's agent calls per second and its CPU.
A size `PxD@T` runs T tensor-parallel ranks per pod (one engine each, on the device IPs the
local device plugin assigns): 4x4@8 is 64 rank engines and 128 rank links.
Goals: 8P+8D <= 0.5 s, 32P+32D <= 1.5 s, 64P+64D <= 3 s.

    python bench/bench_links.py [--sizes 2x2,8x8,32x32,64x64,4x4@8] [--idle-seconds 15]"""
from __future__ import annotations

import argparse
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import yaml  # noqa: E402
from common import REPO, Bench, cpu_seconds, metrics, pod_ready  # noqa: E402

SIZES = [(2, 2, 1), (8, 8, 1), (16, 16, 1), (32, 32, 1), (64, 64, 1), (4, 4, 8)]
GOALS = {(8, 8): 0.5, (32, 32): 1.5, (64, 64): 3.0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default=",".join(f"{p}x{d}" + (f"@{t}" if t > 1 else "") for p, d, t in SIZES))
    ap.add_argument("--idle-seconds", type=float, default=15)
    args = ap.parse_args()
    sizes = []
    for item in args.sizes.split(","):
        pd_, _, tp = item.partition("@")
        p_, d_ = (int(x) for x in pd_.split("x"))
        sizes.append((p_, d_, int(tp or 1)))
    bench = Bench()
    core, custom = bench.core, bench.custom
    rows = []
    for p, d, tp in sizes:
        label = f"{p}P+{d}D" + (f" TP {tp}" if tp > 1 else "")
        ns = f"bench-{p}p{d}d{tp}t-{uuid.uuid4().hex[:6]}"
        bench.namespace(ns)
        op, murl = bench.operator(ns, f"bench-links-operator-{p}p{d}d.log")
        try:
            doc = yaml.safe_load((REPO / "examples" / "sim-small.yaml").read_text())
            doc["spec"]["model"]["kvCache"]["tensorParallel"] = tp
            for group, n in (("prefill", p), ("decoder", d)):
                doc["spec"][group]["replicas"] = n
                if tp > 1:   # one NPU per rank: the local device plugin gives each its own device IP
                    doc["spec"][group]["resources"] = {"limits": {"huawei.com/Ascend910": tp}}
                else:
                    doc["spec"][group].pop("resources", None)  # more pods than the local nodes have NPUs
            links = p * d * tp
            t0 = time.monotonic()
            custom.create_namespaced_custom_object("pdoperator.io", "v1alpha1", ns, "pddeployments", doc)
            pods_ready = ready = None
            deadline = t0 + 300
            while time.monotonic() < deadline:
                now = time.monotonic()
                if pods_ready is None:
                    pods = core.list_namespaced_pod(ns).items
                    if len(pods) == p + d and all(pod_ready(x) for x in pods):
                        pods_ready = now
                obj = custom.get_namespaced_custom_object("pdoperator.io", "v1alpha1", ns, "pddeployments",
                                                          "sim-small")
                st = obj.get("status") or {}
                if st.get("phase") == "Ready" and st.get("linksSummary") == f"{links}/{links}":
                    ready = now
                    pods_ready = pods_ready or now
                    break
                time.sleep(0.05)
            if ready is None:
                rows.append((p, d, tp, None, None))
                print(f"{label}: did not become Ready within 300 s", flush=True)
                continue
            m = metrics(murl)
            measured = m.get("pd_operator_pods_ready_to_ready_seconds_sum", ready - pods_ready)
            # idle: the deployment is Ready and nothing changes
            time.sleep(2)
            m0, c0, t_idle = metrics(murl), cpu_seconds(op.pid), time.monotonic()
            time.sleep(args.idle_seconds)
            m1, c1, span = metrics(murl), cpu_seconds(op.pid), time.monotonic() - t_idle
            calls = (m1.get("pd_operator_agent_calls_total", 0) - m0.get("pd_operator_agent_calls_total", 0)) / span
            cpu = (c1 - c0) / span * 100
            rows.append((p, d, tp, pods_ready - t0, measured))
            rate = f"; {links / measured:.0f} rank links/s" if tp > 1 and measured > 0 else ""
            print(f"{label}: pods Ready {pods_ready - t0:6.2f} s after apply; links {links}/{links} up "
                  f"and KV path verified {measured:5.2f} s after that (bench poller saw {ready - pods_ready:.2f} s)"
                  f"{rate}; idle: {calls:.1f} agent calls/s, operator CPU {cpu:.1f}%", flush=True)
        finally:
            op.terminate()
            op.wait(20)
            core.delete_namespace(ns)
    for r in rows:
        goal = GOALS.get(r[:2]) if r[2] == 1 else None
        if goal is not None and r[4] is not None:
            print(f"goal {r[0]}P+{r[1]}D <= {goal} s: {'met' if r[4] <= goal else 'missed'} ({r[4]:.2f} s)")
    bench.close()


if __name__ == "__main__":
    main()
