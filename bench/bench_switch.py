"""`make bench-switch`: what one live role switch costs, per direction, under load.

A 2P+2D simulated deployment (Manual policy, no cooldown) serves the load generator's
requests while the prefill count goes 2 -> 3 -> 2 again and again. For each switch the
operator's own record (status.lastSwitch) gives the drain time and the total; the
control-plane cost is the total without the drain (unlink, switch_role, relink, KV-path
check, undrain, and the passes between them). Goal: control-plane cost <= 0.5 s.
`--tp 8` runs instances of 8 tensor-parallel ranks (one engine each, on the local device plugin's
device IPs): a switch moves all 8 engines of the instance.
`--kv-transfer mooncake` (or `mooncake-layerwise`) runs vLLM stand-ins with vllm-ascend's Mooncake
connector (spec.engine.kvTransfer), the load through pd-gateway: a switch there is a drained restart
of the server in place with the flipped kv_role, and its cost is the server's restart.

    python bench/bench_switch.py [--switches 5] [--rate 7] [--workload code] [--max-output 32] [--tp 1]
                                 [--kv-transfer pd-operator|mooncake|mooncake-layerwise]"""
from __future__ import annotations

import argparse
import base64
import json
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import yaml  # noqa: E402
from common import REPO, Bench  # noqa: E402

GOAL_CONTROL_S = 0.5


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--switches", type=int, default=5, help="switches per direction")
    ap.add_argument("--rate", type=float, default=7, help="load generator req/s")
    ap.add_argument("--workload", default="code")
    ap.add_argument("--max-output", type=int, default=32)
    ap.add_argument("--time-scale", type=float, default=0.5, help="the simulator's time scale")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per instance")
    ap.add_argument("--pods-per-instance", type=int, default=1, help="pods one instance spans (tp / this NPUs each)")
    ap.add_argument("--kv-transfer", choices=("pd-operator", "mooncake", "mooncake-layerwise"),
                    default="pd-operator", help="mooncake(-layerwise): vLLM stand-ins with vllm-ascend's Mooncake "
                    "connector, through pd-gateway")
    args = ap.parse_args()
    mooncake = args.kv_transfer != "pd-operator"
    bench = Bench()
    ns = f"bench-switch-{uuid.uuid4().hex[:6]}"
    bench.namespace(ns)
    op, _ = bench.operator(ns, "bench-switch-operator.log")
    load = None
    rows: dict[str, list[dict]] = {"decoder-to-prefill": [], "prefill-to-decoder": []}
    try:
        doc = yaml.safe_load((REPO / "examples" / "sim-small.yaml").read_text())
        doc["metadata"]["namespace"] = ns
        doc["spec"]["model"]["kvCache"]["maxSeqLen"] = 2048
        doc["spec"]["sim"] = {"timeScale": args.time_scale}
        doc["spec"]["rebalance"] = {"policy": "Manual", "manual": {"prefill": 2}, "cooldownSeconds": 0}
        tp = args.tp
        doc["spec"]["model"]["kvCache"]["tensorParallel"] = tp
        if tp > 1:
            doc["spec"]["model"]["kvCache"]["numKvHeads"] = max(tp, doc["spec"]["model"]["kvCache"]["numKvHeads"])
            for g in ("prefill", "decoder"):
                doc["spec"][g]["resources"] = {"limits": {"huawei.com/Ascend910": tp // args.pods_per_instance}}
                if args.pods_per_instance > 1:
                    doc["spec"][g]["podsPerInstance"] = args.pods_per_instance
        if mooncake:
            mooncake_engines(bench, ns, doc, args.kv_transfer)
        applied = time.monotonic()
        bench.custom.create_namespaced_custom_object("pdoperator.io", "v1alpha1", ns, "pddeployments", doc)
        wait(bench, ns, lambda st: st.get("phase") == "Ready" and st.get("linksSummary") == f"{4 * tp}/{4 * tp}", 300)
        ready_s = time.monotonic() - applied
        if mooncake:
            target_args = ["--gateway", gateway_url(bench, ns), "--api-key", API_KEY]
        else:
            token = base64.b64decode(bench.core.read_namespaced_secret("sim-small-agent-token", ns).data["token"])
            target_args = ["--kubeconfig", bench.kubeconfig, "--namespace", ns, "--deployment", "sim-small",
                           f"--token={token.decode()}"]
        load = subprocess.Popen(
            [sys.executable, "-m", "pd_agent.loadgen", *target_args, "--rate", str(args.rate), "--duration", "3600",
             "--workload", args.workload, "--max-prompt", str(MOONCAKE_MAX_PROMPT if mooncake else 2048),
             "--max-output", str(args.max_output), "--json"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        time.sleep(3)
        last_at = None
        for i in range(2 * args.switches):
            target, to, n = (3, "prefill", 3 * tp) if i % 2 == 0 else (2, "decoder", 4 * tp)
            links = f"{n}/{n}"
            t0 = time.monotonic()
            bench.custom.patch_namespaced_custom_object(
                "pdoperator.io", "v1alpha1", ns, "pddeployments", "sim-small",
                {"spec": {"rebalance": {"manual": {"prefill": target}}}})
            st = wait(bench, ns, lambda st: (st.get("lastSwitch") or {}).get("at", "") > (last_at or "")
                      and st["lastSwitch"]["to"] == to and st.get("phase") == "Ready"
                      and st.get("linksSummary") == links, 120)
            last = st["lastSwitch"]
            last_at = last["at"]
            last["patchToReadyMs"] = round((time.monotonic() - t0) * 1000)
            direction = f"{last['from']}-to-{last['to']}"
            rows[direction].append(last)
            print(f"{direction:20s} {last['pod']:22s} {last['result']:9s} drain {last.get('drainMs', 0):5d} ms  "
                  f"control {last['totalMs'] - last.get('drainMs', 0):5d} ms (unlink+switch {last.get('switchMs')}, "
                  f"relink+verify {last.get('relinkMs')}, undrain {last.get('undrainMs')})  "
                  f"patch->Ready {last['patchToReadyMs']} ms", flush=True)
            time.sleep(1)
        load.send_signal(signal.SIGTERM)
        out, _ = load.communicate(timeout=120)
        summary = json.loads(out)
        load = None
    finally:
        if load is not None:
            load.kill()
        op.terminate()
        op.wait(20)
        bench.core.delete_namespace(ns)
        bench.close()
    print(f"\nTP {args.tp} over {args.pods_per_instance} pod(s) per instance, KV transfer {args.kv_transfer}; new "
          f"pods to Ready, linked and verified: {ready_s:.1f} s; load during the switches: {args.rate} req/s "
          f"{args.workload}: "
          f"{summary['requests']} requests, "
          f"{summary['completed']} completed, {summary['failed']} failed {summary['failed_by_reason'] or ''}, "
          f"{summary['retried']} retried elsewhere {summary['refused_by_reason'] or ''}; "
          f"TTFT p90 {summary['ttft_ms']['p90']:.0f} ms")
    for direction, rs in rows.items():
        done = [r for r in rs if r["result"] == "Completed"]
        if not done:
            continue
        control = [(r["totalMs"] - r.get("drainMs", 0)) / 1000 for r in done]
        drain = [r.get("drainMs", 0) / 1000 for r in done]
        met = "met" if statistics.median(control) <= GOAL_CONTROL_S else "missed"
        goal = "a drained restart of the server, not a live switch" if mooncake else \
            f"goal <= {GOAL_CONTROL_S} s: {met}"
        print(f"{direction}: {len(done)} switches; control plane (drain excluded) median "
              f"{statistics.median(control):.3f} s max {max(control):.3f} s ({goal}); "
              f"drain median {statistics.median(drain):.3f} s max {max(drain):.3f} s")


API_KEY = "bench-switch-key"
MOONCAKE_MAX_PROMPT = 200      # the reference model the vLLM stand-in computes is small
STANDIN_PORT = 8001


def mooncake_engines(bench: Bench, ns: str, doc: dict, kind: str) -> None:
    """The vLLM stand-in (the reference model) with vllm-ascend's Mooncake connector, pd-gateway in front."""
    from kubernetes import client
    bench.core.create_namespaced_secret(ns, client.V1Secret(
        metadata=client.V1ObjectMeta(name="sim-small-keys", labels={"pdoperator.io/keys": "true"}),
        string_data={"bench": API_KEY}))
    spec = doc["spec"]
    spec.pop("sim", None)
    spec["gateway"] = {"enabled": True, "apiKeysSecret": "sim-small-keys"}
    spec["engine"] = {"image": "example.com/pd/pd-reference-engine:0.1.0", "adapter": "vLLM", "port": STANDIN_PORT,
                      "kvTransfer": kind, "kvPort": 30000}
    kv = spec["model"]["kvCache"]
    kv.update(attention="GQA", numLayers=2, numKvHeads=2, headDim=16, dtype="float16", maxSeqLen=512,
              tensorParallel=1, paged={"blockSize": 16, "numBlocks": 256})
    kv.pop("latentDim", None)
    profile = {k: kv[k] for k in ("attention", "numLayers", "numKvHeads", "headDim", "dtype", "maxSeqLen")}
    for g in ("prefill", "decoder"):
        spec[g].update(resources={"limits": {"huawei.com/Ascend910": 1}},
                       command=["python3", "-m", "pd_engine.vllm_standin", "--port", str(STANDIN_PORT),
                                "--reference-model", json.dumps({**profile, "seed": 1})])


def gateway_url(bench: Bench, ns: str) -> str:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for p in bench.core.list_namespaced_pod(ns, label_selector="pdoperator.io/gateway=sim-small").items:
            if p.status.pod_ip and any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or []):
                return f"http://{p.status.pod_ip}:8000"
        time.sleep(0.5)
    raise SystemExit("the gateway did not become Ready in 120 s")


def wait(bench: Bench, ns: str, ok, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = bench.pdd(ns).get("status") or {}
        if ok(st):
            return st
        time.sleep(0.05)
    raise SystemExit(f"timed out after {timeout} s; status: {json.dumps(bench.pdd(ns).get('status'))[:2000]}")


if __name__ == "__main__":
    main()
