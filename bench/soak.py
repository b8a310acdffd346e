"""`make soak`: the fleet under load for a long time while things break, as they do in a month.

A 2P+2D simulated deployment behind its pd-gateway, two operator processes electing a leader,
and the load generator sending streamed chat completions through the gateway the whole time.
Every 8-20 s one of these happens, at random:
  pod-kill        an engine pod deleted (graceful: it drains, its StatefulSet recreates it)
  container-kill  an engine's container SIGKILLed (it restarts in place; requests in flight on
                  it may fail, and only those)
  operator-kill   the leading operator SIGKILLed (the standby takes over; the killed one is
                  started again, as its Deployment would)
  switch          rebalance.manual.prefill set to another count (a live role switch)
  scale           a group's replicas changed (2 <-> 3)
Malformed requests go to the gateway all along (bad JSON, wrong types, bad keys, unknown
models, wrong methods, oversized max_tokens): each must get a 4xx.

At the end it prints the failed requests by cause (a failure not explained by a container kill
while it was in flight is a defect), the malformed requests by answer, the operators' and the
gateway's memory at the start and at the end, and exits 1 if anything failed unexplained.

    python bench/soak.py [--minutes 30] [--rate 5] [--seed 1]"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
import yaml  # noqa: E402
from common import REPO, Bench, free_port, pod_ready  # noqa: E402

KEY = "sk-soak-0001-team-a"
GROUP = ("pdoperator.io", "v1alpha1")
IN_FLIGHT_S = 30   # a request sent this long before a container kill may have been on it


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class Operators:
    """Two operator processes with leader election; a killed one is started again."""

    def __init__(self, bench: Bench, ns: str, logs: Path):
        self.bench, self.ns, self.logs = bench, ns, logs
        self.procs: dict[str, subprocess.Popen] = {}
        self.kills = 0
        for name in ("pd-operator-a", "pd-operator-b"):
            self.start(name)

    def start(self, name: str) -> None:
        env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
        env.update(KUBECONFIG=self.bench.kubeconfig, PD_OPERATOR_NAMESPACES=self.ns, POD_NAME=name,
                   PD_OPERATOR_METRICS_ADDR=f"127.0.0.1:{free_port()}", PD_OPERATOR_LEADER_ELECTION="true",
                   PD_OPERATOR_LEASE_NAMESPACE=self.ns, PD_OPERATOR_LEASE_DURATION_S="6",
                   PD_OPERATOR_RENEW_DEADLINE_S="4", PD_OPERATOR_RETRY_PERIOD_S="1")
        self.procs[name] = subprocess.Popen([sys.executable, "-m", "pd_operator"], env=env,
                                            stdout=open(self.logs / f"{name}.log", "ab"), stderr=subprocess.STDOUT)

    def leader(self) -> str | None:
        from kubernetes import client
        try:
            lease = client.CoordinationV1Api(self.bench.core.api_client).read_namespaced_lease(
                "pd-operator-leader", self.ns)
            holder = lease.spec.holder_identity or ""
        except client.ApiException:
            holder = ""
        return next((n for n in self.procs if holder.startswith(n + "_")), None)

    def kill_leader(self) -> str:
        name = self.leader() or random.choice(list(self.procs))
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait()
        self.kills += 1
        time.sleep(2)   # the restart a Deployment's pod gets
        self.start(name)
        return name

    def stop(self) -> None:
        for p in self.procs.values():
            p.terminate()
        for p in self.procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


def malformed(url: str, model: str) -> list[tuple[str, dict]]:
    """(what, httpx request kwargs): requests a careless or hostile client sends."""
    auth = {"Authorization": f"Bearer {KEY}"}
    chat = f"{url}/v1/chat/completions"
    nested = "[" * 5000 + "]" * 5000
    return [
        ("not JSON", dict(method="POST", url=chat, headers=auth, content=b"{not json")),
        ("not UTF-8", dict(method="POST", url=chat, headers=auth, content=b"\xff\xfe\xfa")),
        ("nested too deeply", dict(method="POST", url=chat, headers=auth, content=nested.encode())),
        ("messages not a list", dict(method="POST", url=chat, headers=auth, json={"model": model, "messages": "hi"})),
        ("max_tokens beyond the context", dict(method="POST", url=chat, headers=auth, json={
            "model": model, "max_tokens": 10**9, "messages": [{"role": "user", "content": "hi"}]})),
        ("unknown model", dict(method="POST", url=chat, headers=auth, json={
            "model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]})),
        ("no key", dict(method="POST", url=chat,
                        json={"model": model, "messages": [{"role": "user", "content": "x"}]})),
        ("wrong key", dict(method="POST", url=chat, headers={"Authorization": "Bearer sk-wrong-key-0000000"},
                           json={"model": model, "messages": [{"role": "user", "content": "x"}]})),
        ("wrong method", dict(method="GET", url=chat, headers=auth)),
        ("anthropic without max_tokens", dict(method="POST", url=f"{url}/v1/messages",
                                              headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
                                              json={"model": model, "messages": [{"role": "user", "content": "x"}]})),
    ]


class Malformed(threading.Thread):
    def __init__(self, url: str, model: str, stop: threading.Event):
        super().__init__(daemon=True)
        self.cases, self.stop = malformed(url, model), stop
        self.answers: Counter = Counter()
        self.bad: list[str] = []

    def run(self) -> None:
        with httpx.Client(trust_env=False, timeout=10) as http:
            i = 0
            while not self.stop.wait(0.5):
                what, kw = self.cases[i % len(self.cases)]
                i += 1
                try:
                    status = http.request(**kw).status_code
                except httpx.HTTPError as e:
                    status = type(e).__name__
                self.answers[(what, status)] += 1
                if not (isinstance(status, int) and 400 <= status < 500):
                    self.bad.append(f"{what}: {status}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--rate", type=float, default=5, help="load generator req/s")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    bench = Bench()
    ns = f"soak-{uuid.uuid4().hex[:6]}"
    bench.namespace(ns)
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / ns
    logs.mkdir(parents=True, exist_ok=True)
    print(f"[soak] namespace {ns}, logs in {logs}, {args.minutes:g} min", flush=True)
    bench.core.create_namespaced_secret(ns, {"metadata": {"name": "sim-small-keys",
                                                          "labels": {"pdoperator.io/keys": "true"}},
                                             "stringData": {"team-a": KEY}})
    ops = Operators(bench, ns, logs)
    stop_malformed = threading.Event()
    load = bad = None
    try:
        doc = yaml.safe_load((REPO / "examples" / "sim-small.yaml").read_text())
        doc["metadata"]["namespace"] = ns
        spec = doc["spec"]
        spec["model"]["kvCache"]["maxSeqLen"] = 2048
        spec.update(drainTimeoutSeconds=30, sim={"timeScale": 0.5},
                    gateway={"enabled": True, "apiKeysSecret": "sim-small-keys"},
                    rebalance={"policy": "Manual", "manual": {"prefill": 2}, "cooldownSeconds": 0})
        spec["datadist"].update(verifyIntervalSeconds=5, syncKvTimeoutMs=3000)
        bench.custom.create_namespaced_custom_object(*GROUP, ns, "pddeployments", doc)
        settle(bench, ns, 300)
        gw = wait_gateway(bench, ns)
        url = f"http://{gw.status.pod_ip}:8000"
        model = spec["model"]["name"]
        gw_pid = int(gw.status.container_statuses[0].container_id.rsplit("/", 1)[1])
        mem0 = {**{n: rss_mib(p.pid) for n, p in ops.procs.items()}, "gateway": rss_mib(gw_pid)}

        requests_out = logs / "requests.jsonl"
        load = subprocess.Popen(
            [sys.executable, "-m", "pd_agent.loadgen", "--gateway", url, f"--api-key={KEY}", "--rate", str(args.rate),
             "--duration", str(args.minutes * 60 + 600), "--workload", "code", "--max-prompt", "2000",
             "--max-output", "32", "--requests-out", str(requests_out), "--json"],
            stdout=open(logs / "loadgen.json", "w"), stderr=open(logs / "loadgen.err", "w"), cwd=REPO)
        t0 = time.monotonic()
        bad = Malformed(url, model, stop_malformed)
        bad.start()
        events: list[tuple[float, str, str]] = []
        end = t0 + args.minutes * 60
        while time.monotonic() < end:
            time.sleep(rng.uniform(8, 20))
            action = rng.choice(["pod-kill", "container-kill", "operator-kill", "switch", "scale"])
            at = time.monotonic() - t0
            target = act(bench, ns, ops, rng, action)
            events.append((at, action, target))
            print(f"[soak] {at:7.1f}s {action:15s} {target}", flush=True)
            if not settle(bench, ns, 180, quiet=True):
                print(f"[soak] {time.monotonic() - t0:7.1f}s not settled within 180 s: "
                      f"{json.dumps(bench.pdd(ns).get('status', {}).get('conditions', []))[:600]}", flush=True)
        # the last action settles, then the load stops and its requests in flight finish
        final = settle(bench, ns, 300, quiet=True) or bench.pdd(ns).get("status", {})
        mem1 = {**{n: rss_mib(p.pid) for n, p in ops.procs.items()}, "gateway": rss_mib(gw_pid)}
        load.send_signal(signal.SIGTERM)
        load.wait(120)
        stop_malformed.set()
        bad.join(15)
        summary = json.loads((logs / "loadgen.json").read_text())
        return report(summary, requests_out, events, bad, ops, mem0, mem1, final)
    finally:
        stop_malformed.set()
        if load and load.poll() is None:
            load.kill()
        ops.stop()
        subprocess.run(bench.kubectl + ["delete", "namespace", ns, "--wait=false"], capture_output=True)
        bench.close()


def engine_pods(bench: Bench, ns: str) -> list:
    return [p for p in bench.core.list_namespaced_pod(ns, label_selector="pdoperator.io/deployment=sim-small").items
            if not p.metadata.deletion_timestamp]


def act(bench: Bench, ns: str, ops: Operators, rng: random.Random, action: str) -> str:
    if action == "operator-kill":
        return ops.kill_leader()
    spec = bench.pdd(ns)["spec"]
    if action in ("pod-kill", "container-kill"):
        pods = engine_pods(bench, ns)
        if not pods:
            return "(no pod)"
        pod = rng.choice(pods)
        if action == "pod-kill":
            bench.core.delete_namespaced_pod(pod.metadata.name, ns)
        else:
            cs = (pod.status.container_statuses or [None])[0]
            if not (cs and cs.container_id and cs.state.running):
                return f"{pod.metadata.name} (not running)"
            try:
                os.kill(int(cs.container_id.rsplit("/", 1)[1]), signal.SIGKILL)
            except ProcessLookupError:
                return f"{pod.metadata.name} (already gone)"
        return pod.metadata.name
    total = spec["prefill"]["replicas"] + spec["decoder"]["replicas"]
    if action == "switch":
        now = (spec.get("rebalance", {}).get("manual") or {}).get("prefill", 2)
        target = rng.choice([n for n in range(1, total) if n != now] or [now])
        patch = {"spec": {"rebalance": {"manual": {"prefill": target}}}}
        what = f"manual.prefill {now} -> {target}"
    else:
        group = rng.choice(["prefill", "decoder"])
        n = 3 if spec[group]["replicas"] == 2 else 2
        patch = {"spec": {group: {"replicas": n}}}
        # keep the manual count possible with the new total
        manual = (spec.get("rebalance", {}).get("manual") or {}).get("prefill", 2)
        new_total = total - spec[group]["replicas"] + n
        if manual > new_total - 1:
            patch["spec"]["rebalance"] = {"manual": {"prefill": new_total - 1}}
        what = f"{group}.replicas -> {n}"
    bench.custom.patch_namespaced_custom_object(*GROUP, ns, "pddeployments", "sim-small", patch)
    return what


def settle(bench: Bench, ns: str, timeout: float, quiet: bool = False, stable_s: float = 10) -> dict | None:
    """The deployment Ready, every engine pod Ready, for `stable_s` in a row (right after a kill,
    status may still say Ready until the operator has seen it): its status, else None."""
    deadline = time.monotonic() + timeout
    since = None
    while time.monotonic() < deadline:
        try:
            obj = bench.pdd(ns)
            pods = engine_pods(bench, ns)
        except Exception:  # noqa: BLE001 - the API may be briefly busy; keep waiting
            obj, pods = {}, []
        st = obj.get("status", {})
        up, _, expected = st.get("linksSummary", "").partition("/")
        ok = (st.get("phase") == "Ready" and not st.get("switches") and up and up == expected
              and st.get("observedGeneration") == obj["metadata"]["generation"] and pods
              and all(pod_ready(p) for p in pods))
        if not ok:
            since = None
        elif since is None:
            since = time.monotonic()
        elif time.monotonic() - since >= stable_s:
            return st
        time.sleep(1)
    if not quiet:
        raise TimeoutError(f"{ns}/sim-small not Ready within {timeout}s: {json.dumps(st)[:800]}")
    return None


def wait_gateway(bench: Bench, ns: str):
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        pods = [p for p in bench.core.list_namespaced_pod(ns, label_selector="pdoperator.io/gateway=sim-small").items
                if pod_ready(p)]
        if pods:
            try:
                if httpx.get(f"http://{pods[0].status.pod_ip}:8000/healthz", trust_env=False,
                             timeout=5).json().get("decoders", 0) >= 1:
                    return pods[0]
            except (httpx.HTTPError, ValueError):
                pass
        time.sleep(1)
    raise TimeoutError("the gateway did not become Ready")


def report(summary: dict, requests_out: Path, events, bad: Malformed, ops: Operators, mem0, mem1, status) -> int:
    kills = [at for at, action, _ in events if action == "container-kill"]
    causes: Counter = Counter()
    for line in requests_out.read_text().splitlines():
        r = json.loads(line)
        if r["ok"]:
            continue
        # sent up to IN_FLIGHT_S before a kill, or (clock slack) just after it
        explained = any(r["t"] - 2 <= k <= r["t"] + IN_FLIGHT_S for k in kills)
        causes[("in flight on a killed container" if explained else "UNEXPLAINED", r["reason"])] += 1
    actions = Counter(action for _, action, _ in events)
    print("\n==== soak ====")
    print(f"actions: {dict(actions)} (operator kills {ops.kills})")
    print(f"requests {summary['requests']}, completed {summary['completed']}, failed {summary['failed']}; "
          f"retried {summary['retried']} {summary['refused_by_reason']}; TTFT p90 {summary['ttft_ms']['p90']} ms")
    print("failed by cause:" + ("" if causes else " none"))
    for (cause, reason), n in sorted(causes.items()):
        print(f"  {n:5d}  {cause}: {reason}")
    print(f"malformed requests: {sum(bad.answers.values())}, not answered with a 4xx: {len(bad.bad)}")
    for (what, code), n in sorted(bad.answers.items(), key=lambda x: str(x)):
        print(f"  {n:5d}  {what} -> {code}")
    print("memory (RSS MiB) start -> end:")
    for name in mem0:
        a, b = mem0[name], mem1.get(name)
        print(f"  {name:14s} {a:7.1f} -> {b:7.1f}" if a and b else f"  {name:14s} {a} -> {b}")
    print(f"final: phase {status.get('phase')}, links {status.get('linksSummary')}, "
          f"prefill/decoder {status.get('prefill')}/{status.get('decoder')}")
    unexplained = sum(n for (cause, _), n in causes.items() if cause == "UNEXPLAINED")
    ok = unexplained == 0 and not bad.bad and status.get("phase") == "Ready"
    print("soak: " + ("PASS" if ok else f"FAIL ({unexplained} unexplained failures, {len(bad.bad)} malformed not 4xx)"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
