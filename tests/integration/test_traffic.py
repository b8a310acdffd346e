"""The fleet under traffic: the load generator runs while the operator verifies, scales
both groups, restarts, and pods are deleted. No request may fail, and no link whose peer
was alive may be torn down by force."""
from __future__ import annotations

import base64
import contextlib
import json
import re
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from tests.conftest import REPO, Cluster, wait_for
from tests.integration.conftest import agent_status, events, sample, wait_phase
from tests.procs import spawn

pytestmark = pytest.mark.integration

# 2k-token prompts; every pull is held 150 ms on the prompt side, so pulls overlap the
# operator's status polls and the agents' link checks all the time.
TRAFFIC_SPEC = {
    "model.kvCache.maxSeqLen": 2048,
    "datadist.verifyIntervalSeconds": 5,
    "datadist.syncKvTimeoutMs": 3000,
    "drainTimeoutSeconds": 30,
    "sim": {"timeScale": 0.5, "faults": {"pullDelayMs": 150}},
}


class Load:
    """`python -m pd_agent.loadgen` against the deployment, as a user runs it."""

    def __init__(self, cluster: Cluster, ns: str, duration: float, rate: float = 7, workload: str = "code",
                 max_output: int = 32, name: str = "sim-small", gateway: str | None = None, api_key: str = "",
                 max_prompt: int | None = None):
        if gateway:   # through pd-gateway, as a client would
            target = ["--gateway", gateway, f"--api-key={api_key}"]
        else:         # straight to the agents, with the routers' (data-scope) token
            token = base64.b64decode(cluster.get_json("secret", f"{name}-agent-data-token", "-n", ns)["data"][
                "token"]).decode()
            target = ["--kubeconfig", str(cluster.kubeconfig), "--namespace", ns, "--deployment", name,
                      f"--token={token}"]
        if max_prompt is None:
            # the engines hold 2048 positions: through the gateway, prompt (with the chat template's
            # few tokens) and output must fit them or the request is refused before any engine work;
            # straight to the agents, a longer prompt is cut at the cache's length
            max_prompt = 2048 - max_output - 16 if gateway else 2048
        # output to files, not pipes: a pipe nobody reads fills up and blocks the writer
        self.out, self.err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.requests_out = tempfile.NamedTemporaryFile("r", suffix=".jsonl")
        self.proc = spawn(
            [sys.executable, "-m", "pd_agent.loadgen", *target, "--rate", str(rate), "--duration", str(duration),
             "--workload", workload, "--max-prompt", str(max_prompt), "--max-output", str(max_output),
             "--requests-out", self.requests_out.name, "--json"],
            stdout=self.out, stderr=self.err, text=True, cwd=REPO)
        self.started = time.monotonic()
        self.duration = duration
        self.changes: dict[str, tuple[float, float]] = {}

    def stop(self) -> dict:
        """Stop sending; the requests in flight finish and count."""
        self.proc.send_signal(signal.SIGTERM)
        return self.result()

    def result(self) -> dict:
        self.proc.wait(timeout=max(0.0, self.started + self.duration - time.monotonic()) + 180)
        self.out.seek(0)
        self.err.seek(0)
        out, err = self.out.read(), self.err.read()
        assert self.proc.returncode in (0, 1), err[-3000:]
        summary = json.loads(out)
        print(f"\nloadgen: {json.dumps(summary)}")
        return summary

    def in_flight(self, t0: float, t1: float) -> int:
        """Requests (after `result`) that were in flight at some moment of [t0, t1] (Unix time):
        sent before t1 and not finished before t0."""
        self.requests_out.seek(0)
        n = 0
        for line in self.requests_out:
            r = json.loads(line)
            done = r["sent_at"] + (r["ttft_ms"] + r["tbt_ms"] * max(r["output"] - 1, 0)) / 1000
            n += r["sent_at"] <= t1 and done >= t0
        return n

    @contextlib.contextmanager
    def change(self, what: str):
        """A change made under this load, from the request for it until it is done."""
        t0 = time.time()
        yield
        self.changes[what] = (t0, time.time())

    def assert_traffic_through_changes(self) -> None:
        """Requests were in flight during every change, however fast the machine made them (a
        count of requests would only say how long the test took)."""
        during = {what: self.in_flight(*w) for what, w in self.changes.items()}
        print(f"requests in flight during each change: {during}")
        assert during and all(n > 0 for n in during.values()), during


def force_unlinks(cluster: Cluster, ns: str) -> list[str]:
    return [e["message"] for e in events(cluster, ns) if e["reason"] == "Unlinked" and "broken link" in e["message"]]


def scale(cluster: Cluster, ns: str, group: str, n: int) -> None:
    cluster.kubectl("patch", "pdd", "sim-small", "-n", ns, "--type=merge", "-p",
                    json.dumps({"spec": {group: {"replicas": n}}}))


def settled(cluster: Cluster, ns: str, links: str, pods: int, timeout: float = 120) -> dict:
    """Ready with the given links, and exactly `pods` engine pods left (leavers gone)."""
    obj = wait_phase(cluster, ns, "Ready", timeout=timeout, extra=lambda o: o["status"]["linksSummary"] == links)
    wait_for(f"{pods} engine pods", lambda: len(cluster.get_json(
        "pods", "-n", ns, "-l", "pdoperator.io/deployment=sim-small")["items"]) == pods, timeout=timeout)
    return obj


def probes_served(cluster: Cluster, ns: str, pod: str) -> int:
    import httpx
    ip = cluster.get_json("pod", pod, "-n", ns)["status"]["podIP"]
    text = httpx.get(f"http://{ip}:8080/metrics", trust_env=False, timeout=5).text
    m = re.search(r'pd_agent_api_calls_total\{code="200",op="probe"\} (\d+)', text)
    return int(m.group(1)) if m else 0


def test_scaling_and_operator_restart_under_load_fail_no_request(cluster: Cluster, namespace: str, operator):
    ns = namespace
    cluster.apply(sample(**TRAFFIC_SPEC), ns)
    settled(cluster, ns, "4/4", 4)
    load = Load(cluster, ns, duration=900)   # runs until stopped, after the last change
    steps = []

    def step(what, fn):
        with load.change(what):
            t0 = time.time()
            fn()
            steps.append(f"{what} {time.time() - t0:.1f}s")
        time.sleep(2)   # the new shape serves traffic before the next change

    time.sleep(5)
    step("prefill 2->3", lambda: (scale(cluster, ns, "prefill", 3), settled(cluster, ns, "6/6", 5)))
    step("prefill 3->2", lambda: (scale(cluster, ns, "prefill", 2), settled(cluster, ns, "4/4", 4)))
    step("decoder 2->3", lambda: (scale(cluster, ns, "decoder", 3), settled(cluster, ns, "6/6", 5)))
    step("decoder 3->2", lambda: (scale(cluster, ns, "decoder", 2), settled(cluster, ns, "4/4", 4)))

    def restart():
        operator.stop()
        operator.start()
        time.sleep(3)
        settled(cluster, ns, "4/4", 4)
    step("operator restart", restart)
    print("\nsteps: " + ", ".join(steps))
    s = load.stop()
    assert s["failed"] == 0, s["failed_by_reason"]
    assert s["completed"] == s["requests"], s
    load.assert_traffic_through_changes()
    assert force_unlinks(cluster, ns) == []
    # verify rounds ran against the serving prefills while requests flowed
    assert probes_served(cluster, ns, "sim-small-prefill-0") + probes_served(cluster, ns, "sim-small-prefill-1") >= 4
    # pulls and link checks overlapped: the agents saw the links busy and kept them
    for d in ("sim-small-decoder-0", "sim-small-decoder-1"):
        assert all(l["healthy"] for l in agent_status(cluster, ns, d)["links"])


def test_deleted_pods_drain_and_fail_no_request(cluster: Cluster, namespace: str, operator):
    ns = namespace
    # chat: long outputs, so a deleted decoder has decodes in flight to finish
    cluster.apply(sample(**TRAFFIC_SPEC, **{"model.kvCache.maxBatch": 8}), ns)
    settled(cluster, ns, "4/4", 4)
    load = Load(cluster, ns, duration=45, rate=3, workload="chat", max_output=256)
    time.sleep(5)
    drains = {}
    for pod in ("sim-small-prefill-0", "sim-small-decoder-1"):
        old_uid = cluster.get_json("pod", pod, "-n", ns)["metadata"]["uid"]
        logs = spawn([str(cluster.bin_dir / "kubectl"), f"--kubeconfig={cluster.kubeconfig}", "logs",
                                 "-f", pod, "-n", ns], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        t0 = time.monotonic()
        cluster.kubectl("delete", "pod", pod, "-n", ns, timeout=90)   # waits until the pod is gone
        gone_s = time.monotonic() - t0
        out = logs.communicate(timeout=30)[0]
        line = next((l for l in out.splitlines() if "drained: " in l), None)
        assert line, f"{pod} did not drain on SIGTERM:\n{out[-2000:]}"
        drains[pod] = {**json.loads(line.split("drained: ", 1)[1]), "deleted_in_s": round(gone_s, 2)}
        assert drains[pod]["drained"], drains[pod]
        wait_for(f"{pod} replaced", lambda: cluster.get_json("pod", pod, "-n", ns)["metadata"]["uid"] != old_uid,
                 timeout=60)
        settled(cluster, ns, "4/4", 4)
    print(f"\ndrains: {json.dumps(drains)}")
    assert drains["sim-small-prefill-0"]["still_linked"] == []  # decoders let go of it before it exited
    s = load.result()
    assert s["failed"] == 0, s["failed_by_reason"]
    assert force_unlinks(cluster, ns) == []


def clear_leftovers(cluster: Cluster, ns: str, node: str) -> None:
    """Pods of earlier tests' namespaces (deleted, their operators gone: an engine without its
    operator may take its whole grace period to go) still on `node` are not this test's to wait
    for (`kubectl drain` would wait on them): given a while to go, then removed."""
    def foreign() -> list[str]:
        items = cluster.get_json("pods", "-A", "--field-selector", f"spec.nodeName={node}")["items"]
        return [f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in items
                if p["metadata"]["namespace"] != ns and p["metadata"]["namespace"].startswith("t-")]
    deadline = time.monotonic() + 60
    while (left := foreign()) and time.monotonic() < deadline:
        time.sleep(2)
    for ref in left:
        pns, name = ref.split("/", 1)
        print(f"\n{ref}: an earlier test's pod still terminating on {node}; removed")
        cluster.kubectl("delete", "pod", name, "-n", pns, "--grace-period=0", "--force", check=False)


def test_node_drain_respects_the_budgets_and_fails_no_request(cluster: Cluster, namespace: str, operator):
    """`kubectl drain` of a node holding a prefill and a decoder, under load: each role's
    PodDisruptionBudget lets one pod go at a time, the evicted engines drain as on SIGTERM and
    come back on the other nodes, and no request fails."""
    ns = namespace
    cluster.apply(sample(**TRAFFIC_SPEC), ns)
    settled(cluster, ns, "4/4", 4)
    pods = cluster.get_json("pods", "-n", ns, "-l", "pdoperator.io/deployment=sim-small")["items"]
    by_node: dict[str, set[str]] = {}
    for p in pods:
        by_node.setdefault(p["spec"]["nodeName"], set()).add(p["metadata"]["labels"]["pdoperator.io/role"])
    # each group spreads over nodes: 2 prefills and 2 decoders on 3 nodes share at least one
    node = next(n for n, roles in sorted(by_node.items()) if roles == {"prefill", "decoder"})
    for role in ("prefill", "decoder"):
        pdb = wait_for(f"the {role} budget observed", lambda: (o := cluster.get_json(
            "pdb", f"sim-small-{role}", "-n", ns)).get("status", {}).get("currentHealthy") == 2 and o, timeout=30)
        assert pdb["spec"]["minAvailable"] == 1 and pdb["status"]["disruptionsAllowed"] == 1
    leaving = sorted(p["metadata"]["name"] for p in pods if p["spec"]["nodeName"] == node)
    clear_leftovers(cluster, ns, node)
    load = Load(cluster, ns, duration=900)
    try:
        time.sleep(5)
        t0 = time.monotonic()
        r = cluster.kubectl("drain", node, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=180s",
                            timeout=200, check=False)
        assert r.returncode == 0, r.stdout + r.stderr
        drained_s = time.monotonic() - t0
        settled(cluster, ns, "4/4", 4)
        moved = {p["metadata"]["name"]: p["spec"]["nodeName"] for p in cluster.get_json(
            "pods", "-n", ns, "-l", "pdoperator.io/deployment=sim-small")["items"]}
        print(f"\ndrained {node} ({', '.join(leaving)}) in {drained_s:.1f}s; now {json.dumps(moved)}")
        assert all(moved[p] != node for p in leaving)
        s = load.stop()
    finally:
        cluster.kubectl("uncordon", node, check=False)
    assert s["failed"] == 0, s["failed_by_reason"]
    assert s["completed"] == s["requests"] >= 30, s
    assert force_unlinks(cluster, ns) == []
