"""`make bench-scale`: one leader for many rank engines, in the style of kwok.

N PDDeployments x (P prefill + D decoder pods) x TP ranks on a local control plane of its own,
their pods API objects on a fake Node served by one process (scale_agents.py: the real agent
API, answers scripted per rank, no process per pod), the operator as a real process with a
standby replica. It measures:
- pass latency p50/p99/max at idle, from the leader's trace (PD_OPERATOR_TRACE: a line per pass);
- operator CPU (% of a core at idle, seconds in all) and RSS, from /proc;
- API calls per second at idle, by replica (the API server's priority-and-fairness counters:
  each replica authenticates as its own user, matched by a FlowSchema of its own), and agent
  calls per second (counted by the fake agents, and by the operator's own metric);
- the time from killing the leader (SIGKILL) to every deployment settled again as the new
  leader sees it (phase Ready, every link up, KV path verified by its own probe), and the
  passes meanwhile;
- requests failed on a few deployments of real agents (the simulator's, on the cluster's own
  node) that carry load from `pd_agent.loadgen` across the takeover (--loaded);
- the size of each PDDeployment's .status.
It prints a table and writes bench/results/scale.json.

    python bench/bench_scale.py [--deployments 100 --prefill 4 --decoder 4 --tp 8] [--idle-seconds 30]

The cluster is the one in $PD_LOCALCLUSTER_DIR (started if it is not up, with one node of its
own besides the fake one, and stopped again at the end); unset, a directory of its own under
/tmp, never the shared .localcluster."""
from __future__ import annotations

import argparse
import base64
import datetime as dt
import json
import math
import os
import re
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
import yaml  # noqa: E402
from common import REPO, cpu_seconds  # noqa: E402
from kubernetes import client, config  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from scale_agents import FAKE_LABEL, FAKE_TAINT  # noqa: E402

from pd_localcluster.__main__ import bin_dir_default  # noqa: E402
from pd_localcluster.cluster import LocalCluster, free_port, write_kubeconfig  # noqa: E402
from pd_localcluster.devices import DEFAULT_RESOURCE  # noqa: E402
from pd_localcluster.pki import PKI, _name  # noqa: E402
from pd_operator.shards import shard_of  # noqa: E402

GROUP, VERSION, PLURAL = "pdoperator.io", "v1alpha1", "pddeployments"
NODE = "scale-fake-node"
DEFAULT_DIR = "/tmp/pd-scale-cluster"
TRACE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) DEBUG pd_operator\.reconcile: (\S+?)/(\S+) pass: "
                   r"asked (\d+) in (\d+) ms")
REPLICAS = ("a", "b")


def log(msg: str) -> None:
    print(f"[bench-scale {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def percentile(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile (None: no samples)."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def summary(ms: list[float]) -> dict:
    return {"passes": len(ms), "p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99),
            "max_ms": max(ms) if ms else None}


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def scrape(url: str) -> list:
    """Prometheus samples of a /metrics endpoint."""
    text = httpx.get(url, trust_env=False, timeout=10).text
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def safe_scrape(url: str) -> list:
    try:
        return scrape(url)
    except (httpx.HTTPError, ValueError):
        return []


def total(samples: list, name: str, **labels: str) -> float:
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def settled(obj: dict) -> bool:
    """Phase Ready, every desired link up, the KV path verified, the current generation observed."""
    st = obj.get("status") or {}
    links = st.get("links") or {}
    verified = any(c.get("type") == "KVPathVerified" and c.get("status") == "True" for c in st.get("conditions") or [])
    return st.get("phase") == "Ready" and verified and links.get("expected", 0) > 0 \
        and links.get("up") == links.get("expected") \
        and st.get("observedGeneration") == obj["metadata"].get("generation")


def settled_by(samples: list, names: list[str]) -> set[str]:
    """Deployments the operator behind `samples` itself found settled: its own pass set its phase gauge
    Ready, its links gauges equal and KVPathVerified True. (A new leader probes the KV path at once
    unless the round recorded in status verified these same links, engine processes included,
    within the interval: verification.py.)"""
    by: dict[str, dict] = {n: {} for n in names}
    for s in samples:
        n = s.labels.get("name")
        if n not in by:
            continue
        if s.name == "pd_operator_deployment_phase" and s.labels.get("phase") == "Ready":
            by[n]["ready"] = s.value == 1
        elif s.name == "pd_operator_deployment_links":
            by[n][s.labels["state"]] = s.value
        elif s.name == "pd_operator_deployment_condition" and s.labels.get("condition") == "KVPathVerified" \
                and s.labels.get("status") == "True":
            by[n]["verified"] = s.value == 1
    return {n for n, d in by.items() if d.get("ready") and d.get("verified")
            and d.get("expected", 0) > 0 and d.get("up") == d.get("expected")}


def traced(path: Path, since: float, until: float) -> list[tuple[float, str, float]]:
    """(wall time, deployment name, ms) of every pass the operator traced between two wall-clock times."""
    out: list[tuple[float, str, float]] = []
    if not path.exists():
        return out
    for line in path.read_text(errors="replace").splitlines():
        m = TRACE.match(line)
        if m:
            t = dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            if since <= t <= until:
                out.append((t, m.group(3), float(m.group(5))))
    return out


def read_passes(path: Path, since: float, until: float) -> list[float]:
    """Pass durations (ms) the operator traced between two wall-clock times."""
    return [ms for _, _, ms in traced(path, since, until)]


def longest_gap(passes: list[tuple[float, str, float]], names: set[str], since: float, until: float) -> float:
    """The longest time (s) any of `names` went without a pass between `since` and `until`."""
    times: dict[str, list[float]] = {n: [since] for n in names}
    for t, n, _ in sorted(passes):
        if n in times:
            times[n].append(t)
    return max((max(b - a for a, b in zip(ts, [*ts[1:], until])) for ts in times.values()), default=0.0)


@dataclass
class Operator:
    """One operator replica: its process, its own API identity, its metrics and log."""
    name: str
    kubeconfig: Path
    log_path: Path
    env: dict
    proc: subprocess.Popen | None = None
    metrics_url: str = ""
    cpu0: float = 0.0
    profile: Path | None = None

    def start(self) -> None:
        port = free_port()
        self.metrics_url = f"http://127.0.0.1:{port}/metrics"
        env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
        env.update(self.env, KUBECONFIG=str(self.kubeconfig), PD_OPERATOR_METRICS_ADDR=f"127.0.0.1:{port}",
                   PD_OPERATOR_TRACE="1")
        cmd = [sys.executable, "-m", "pd_operator"]
        if self.profile is not None:
            cmd = [sys.executable, "-m", "cProfile", "-o", str(self.profile), "-m", "pd_operator"]
        self.proc = subprocess.Popen(cmd, env=env, stdout=open(self.log_path, "wb"), stderr=subprocess.STDOUT)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(sig)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Harness:
    args: argparse.Namespace
    lc: LocalCluster = field(init=False)
    started_cluster: bool = False
    ns: str = ""
    operators: dict[str, Operator] = field(default_factory=dict)
    fleet: subprocess.Popen | None = None
    fleet_stats: str = ""
    names: list[str] = field(default_factory=list)
    loaded: list[str] = field(default_factory=list)   # deployments of real agents, under load at the takeover

    def __post_init__(self) -> None:
        root = Path(self.args.cluster_dir or os.environ.get("PD_LOCALCLUSTER_DIR") or DEFAULT_DIR).resolve()
        self.lc = LocalCluster(root)
        # not under the cluster's directory: a cluster this run starts is removed with it, logs are not
        self.work = Path(self.args.work_dir or Path(tempfile.gettempdir()) / "pd-bench-scale")

    # ---- the cluster and the identities --------------------------------------------------------
    def cluster(self) -> None:
        self.bin_dir = bin_dir_default()
        if not self.lc.is_up():
            log(f"starting a local cluster in {self.lc.paths.root}")
            self.lc.up(self.bin_dir, nodes=1)
            self.started_cluster = True
        self.work.mkdir(parents=True, exist_ok=True)
        self.kubectl("apply", "-f", str(REPO / "crds"))
        for _ in range(60):
            if self.kubectl("wait", "--for=condition=Established", f"crd/{PLURAL}.{GROUP}", "--timeout=10s",
                            check=False).returncode == 0:
                break
            time.sleep(1)
        api = config.new_client_from_config(config_file=str(self.lc.paths.kubeconfig))
        self.core, self.custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
        state = self.lc.load_state() or {}
        self.apiserver = f"https://127.0.0.1:{state['ports']['apiserver']}"

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.bin_dir / "kubectl"), f"--kubeconfig={self.lc.paths.kubeconfig}", *args],
                              input=input, capture_output=True, text=True, check=check, timeout=120)

    def identity(self, replica: str) -> Path:
        """A kubeconfig of the replica's own user (cluster-admin), whose requests a FlowSchema of
        its own matches, so the API server counts them apart from everyone else's."""
        user = f"pd-operator-scale-{replica}"
        pki = PKI(self.lc.paths.pki)
        pki._leaf(user, _name(user))
        kc = self.work / f"{user}.kubeconfig"
        write_kubeconfig(kc, self.apiserver, pki.path("ca.crt"), pki.path(f"{user}.crt"), pki.path(f"{user}.key"), user)
        docs = [
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
             "metadata": {"name": user}, "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                                     "name": "cluster-admin"},
             "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]},
            # exempt, as the admin identity the tests give the operator is: counted, never queued
            {"apiVersion": "flowcontrol.apiserver.k8s.io/v1", "kind": "FlowSchema", "metadata": {"name": user},
             "spec": {"priorityLevelConfiguration": {"name": "exempt"}, "matchingPrecedence": 100,
                      "rules": [{"subjects": [{"kind": "User", "user": {"name": user}}],
                                 "resourceRules": [{"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"],
                                                    "clusterScope": True, "namespaces": ["*"]}],
                                 "nonResourceRules": [{"verbs": ["*"], "nonResourceURLs": ["*"]}]}]}},
        ]
        self.kubectl("apply", "-f", "-", input="\n---\n".join(json.dumps(d) for d in docs))
        return kc

    def api_calls(self) -> dict[str, float]:
        """Requests the API server dispatched per replica (its FlowSchema), since it started."""
        pki = self.lc.paths.pki
        ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        ctx.load_cert_chain(pki / "admin.crt", pki / "admin.key")
        try:
            text = httpx.get(f"{self.apiserver}/metrics", verify=ctx, timeout=20, trust_env=False).text
        except httpx.HTTPError:
            return {}
        out = {r: 0.0 for r in self.replicas}
        for line in text.splitlines():
            if line.startswith("apiserver_flowcontrol_dispatched_requests_total{"):
                m = re.search(r'flow_schema="pd-operator-scale-(\w+)"', line)
                if m and m.group(1) in out:
                    out[m.group(1)] += float(line.rsplit(" ", 1)[1])
        return out

    # ---- the fleet and the operators ---------------------------------------------------------------
    def start_fleet(self) -> None:
        a = self.args
        port = free_port()
        self.fleet_stats = f"http://127.0.0.1:{port}/stats"
        npus = a.deployments * (a.prefill + a.decoder) * a.tp
        self.fleet = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("scale_agents.py")), "--kubeconfig",
             str(self.lc.paths.kubeconfig), "--node", NODE, "--npus", str(npus), "--npu-resource", DEFAULT_RESOURCE,
             "--stats-addr", f"127.0.0.1:{port}"],
            stdout=open(self.work / "scale-agents.log", "wb"), stderr=subprocess.STDOUT)
        self.wait("the fake node", lambda: self.stats() is not None, 60)

    def stats(self) -> dict | None:
        try:
            return httpx.get(self.fleet_stats, trust_env=False, timeout=10).json()
        except (httpx.HTTPError, ValueError):
            return None

    def start_operators(self) -> None:
        a = self.args
        election = {"PD_OPERATOR_NAMESPACES": self.ns, "PD_OPERATOR_LEADER_ELECTION": "true",
                    "PD_OPERATOR_LEASE_NAMESPACE": self.ns, "PD_OPERATOR_LEASE_DURATION_S": str(a.lease_duration),
                    "PD_OPERATOR_RENEW_DEADLINE_S": str(a.renew_deadline),
                    "PD_OPERATOR_RETRY_PERIOD_S": str(a.retry_period)}
        if a.shards > 1:
            election.update(PD_OPERATOR_SHARDS=str(a.shards))
        for r in self.replicas:
            self.operators[r] = Operator(r, self.identity(r), self.work / f"operator-{r}.log",
                                         {**election, "POD_NAME": f"scale-{r}"},
                                         profile=self.work / "operator-b.prof" if a.profile and r == "b" else None)
        if a.shards > 1:   # every replica at once; they share the shards out between them
            for op in self.operators.values():
                op.start()
            self.wait("every shard led, each replica its share",
                      lambda: None not in (h := self.shard_holders()).values()
                      and set(h.values()) == set(self.replicas[:a.shards]), 180)
            log(f"shards: {self.shard_holders()}")
            return
        lead, standby = self.operators["a"], self.operators["b"]
        lead.start()
        self.wait("operator a leading", lambda: self.leader(lead), 60)
        standby.start()
        self.wait("operator b up", lambda: self.leader(standby) is False, 60)

    @property
    def replicas(self) -> tuple[str, ...]:
        return REPLICAS if self.args.shards <= 1 else tuple(f"r{i}" for i in range(self.args.replicas))

    def shard_holders(self) -> dict[int, str | None]:
        """shard -> the replica that holds its Lease (its identity starts with the replica's POD_NAME)."""
        try:
            leases = self.kubectl_json("get", "lease", "-n", self.ns)["items"]
        except (subprocess.CalledProcessError, KeyError, ValueError):
            return {i: None for i in range(self.args.shards)}
        by = {o["metadata"]["name"]: (o.get("spec") or {}).get("holderIdentity") or "" for o in leases}
        out: dict[int, str | None] = {}
        for i in range(self.args.shards):
            h = by.get(f"pd-operator-leader-shard-{i}", "")
            out[i] = h.split("_")[0].removeprefix("scale-") if h else None
        return out

    def idle_sharded(self) -> dict:
        """At rest with every replica leading its shards: passes of them all, CPU and RSS of each."""
        a = self.args
        ops = list(self.operators.values())
        cpu0, w0, m0 = {op.name: cpu_seconds(op.proc.pid) for op in ops}, time.time(), time.monotonic()
        time.sleep(a.idle_seconds)
        span = time.monotonic() - m0
        passes = [ms for op in ops for ms in read_passes(op.log_path, w0, time.time())]
        return {"seconds": round(span, 1), "shards": self.shard_holders(), "pass": summary(passes),
                "operator_cpu_percent": {op.name: round((cpu_seconds(op.proc.pid) - cpu0[op.name]) / span * 100, 1)
                                         for op in ops},
                "operator_rss_bytes": {op.name: rss_bytes(op.proc.pid) for op in ops}}

    def shard_takeover(self) -> dict:
        """SIGKILL the replica that holds shard 0: its shards move to the others, the others' shards
        stay where they are, and the deployments of the shards that did not move go on being passed
        as before (their passes and the longest time one went without a pass, before and during)."""
        a = self.args
        holders0 = self.shard_holders()
        victim = self.operators[str(holders0[0])]
        moved = {i for i, r in holders0.items() if r == victim.name}
        everyone = self.names + self.loaded
        theirs = [n for n in everyone if shard_of((self.ns, n), a.shards) in moved]
        others = set(everyone) - set(theirs)
        survivors = [op for op in self.operators.values() if op is not victim]
        loads = {n: self.load(n) for n in self.loaded}
        time.sleep(max(30.0, a.load_lead_seconds))   # a baseline of the others' passes, with traffic flowing
        w_kill, t_kill = time.time(), time.monotonic()
        victim.stop(signal.SIGKILL)
        t_taken, done = None, set()
        while time.monotonic() < t_kill + a.takeover_timeout:
            if t_taken is None:
                now_held = self.shard_holders()
                if all(now_held[i] not in (victim.name, None) for i in moved):
                    t_taken = time.monotonic()
            if t_taken is not None:
                done = set().union(*(settled_by(safe_scrape(op.metrics_url), theirs) for op in survivors))
                if len(done) == len(theirs):
                    break
            time.sleep(0.25)
        t_settled, w_settled = time.monotonic(), time.time()
        time.sleep(max(2.0, (t_settled - t_kill) if loads else 0))
        load = self.load_results(loads) if loads else None
        holders1 = self.shard_holders()
        before = [p for op in survivors for p in traced(op.log_path, w_kill - 30, w_kill)]
        during = [p for op in survivors for p in traced(op.log_path, w_kill, w_settled)]
        out = {"killed": victim.name, "shards_moved": sorted(moved), "shards_before": holders0,
               "shards_after": holders1,
               "other_shards_moved": sorted(i for i in holders0 if i not in moved and holders1[i] != holders0[i]),
               "leader_killed_to_shard_taken_s": round(t_taken - t_kill, 2) if t_taken else None,
               "leader_killed_to_all_settled_s": round(t_settled - t_kill, 2) if len(done) == len(theirs) else None,
               "settled": f"{len(done)}/{len(theirs)}", "status_settled_in_api": self.all_settled(), "load": load,
               "moved_deployments": len(theirs),
               "moved_pass": summary([ms for _, n, ms in during if n not in others]),
               "other_pass_before": summary([ms for _, n, ms in before if n in others]),
               "other_pass_during": summary([ms for _, n, ms in during if n in others]),
               "other_longest_gap_before_s": round(longest_gap(before, others, w_kill - 30, w_kill), 2),
               "other_longest_gap_during_s": round(longest_gap(during, others, w_kill, w_settled), 2)}
        log(f"shard takeover: {json.dumps(out)}")
        return out

    def roles(self) -> tuple[Operator, Operator]:
        """(leader, standby), as their own metrics say once exactly one leads."""
        def one() -> tuple[Operator, Operator] | None:
            leading = [op for op in self.operators.values() if op.alive() and self.leader(op)]
            if len(leading) != 1:
                return None
            return leading[0], next(op for op in self.operators.values() if op is not leading[0])
        return self.wait("exactly one leader", one, 60)

    def lease(self) -> dict:
        try:
            return self.kubectl_json("get", "lease", "pd-operator-leader", "-n", self.ns)["spec"]
        except (subprocess.CalledProcessError, KeyError, ValueError):
            return {}

    def kubectl_json(self, *args: str):
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    @staticmethod
    def leader(op: Operator) -> bool | None:
        try:
            return total(scrape(op.metrics_url), "pd_operator_leader") == 1
        except (httpx.HTTPError, ValueError):
            return None

    def wait(self, what: str, fn, timeout: float, interval: float = 0.5):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = fn()
            if got:
                return got
            time.sleep(interval)
        raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")

    # ---- the deployments ----------------------------------------------------------------------------
    def deployment(self, name: str) -> dict:
        a = self.args
        doc = yaml.safe_load((REPO / "examples" / "sim-small.yaml").read_text())
        doc["metadata"] = {"name": name}
        spec = doc["spec"]
        spec["model"]["kvCache"]["tensorParallel"] = a.tp
        for group, n in (("prefill", a.prefill), ("decoder", a.decoder)):
            spec[group]["replicas"] = n
            spec[group]["resources"] = {"limits": {DEFAULT_RESOURCE: a.tp}}   # one NPU (device IP) per rank
            spec[group]["nodeSelector"] = {FAKE_LABEL: "true"}
            spec[group]["tolerations"] = [{"key": FAKE_TAINT["key"], "operator": "Equal",
                                           "value": FAKE_TAINT["value"], "effect": FAKE_TAINT["effect"]}]
        return doc

    def real_deployment(self, name: str) -> dict:
        """examples/sim-small.yaml as it is: real agents (pods as processes) on the cluster's own node."""
        doc = yaml.safe_load((REPO / "examples" / "sim-small.yaml").read_text())
        doc["metadata"] = {"name": name}
        return doc

    def load(self, name: str) -> subprocess.Popen:
        """`pd_agent.loadgen` on one loaded deployment, as a user runs it (the routers' data token)."""
        sec = self.core.read_namespaced_secret(f"{name}-agent-data-token", self.ns)
        token = base64.b64decode(sec.data["token"]).decode()
        env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
        return subprocess.Popen(
            [sys.executable, "-m", "pd_agent.loadgen", "--kubeconfig", str(self.lc.paths.kubeconfig), "--namespace",
             self.ns, "--deployment", name, f"--token={token}", "--rate", str(self.args.load_rate), "--duration",
             "3600", "--workload", "code", "--max-output", "32", "--json"],
            env=env, stdout=open(self.work / f"loadgen-{name}.json", "wb"),
            stderr=open(self.work / f"loadgen-{name}.log", "wb"))

    def load_results(self, procs: dict[str, subprocess.Popen]) -> dict:
        """Stop every load generator (the requests in flight finish and count) and sum their reports."""
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
        out: dict = {"requests": 0, "completed": 0, "failed": 0, "retried": 0, "failed_by_reason": {}}
        for name, p in procs.items():
            try:
                p.wait(120)
                r = json.loads((self.work / f"loadgen-{name}.json").read_text())
            except (subprocess.TimeoutExpired, ValueError) as e:
                p.kill()
                out["failed_by_reason"][f"{name}: no report ({e})"] = 1
                continue
            for k in ("requests", "completed", "failed", "retried"):
                out[k] += r[k]
            for reason, n in (r.get("failed_by_reason") or {}).items():
                out["failed_by_reason"][reason] = out["failed_by_reason"].get(reason, 0) + n
        return out

    def deployments(self) -> list[dict]:
        return self.custom.list_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL)["items"]

    def create(self) -> None:
        self.names = [f"scale-{i:03d}" for i in range(self.args.deployments)]
        for n in self.names:
            self.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, self.deployment(n))
        self.loaded = [f"loaded-{i}" for i in range(self.args.loaded)]
        for n in self.loaded:
            self.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, self.real_deployment(n))

    def all_settled(self) -> bool:
        items = self.deployments()
        return len(items) == len(self.names) + len(self.loaded) and all(settled(o) for o in items)

    def progress(self) -> str:
        items = self.deployments()
        st = self.stats() or {}
        return f"{sum(settled(o) for o in items)}/{len(self.names) + len(self.loaded)} settled, " \
               f"{st.get('pods', '?')} fake pods running"

    # ---- the run ----------------------------------------------------------------------------------------
    def run(self) -> dict:
        a = self.args
        report: dict = {"size": {"deployments": a.deployments, "prefill": a.prefill, "decoder": a.decoder,
                                 "tp": a.tp, "pods": a.deployments * (a.prefill + a.decoder),
                                 "rank_engines": a.deployments * (a.prefill + a.decoder) * a.tp,
                                 "rank_links": a.deployments * a.prefill * a.decoder * a.tp},
                        "lease": {"duration_s": a.lease_duration, "renew_deadline_s": a.renew_deadline,
                                  "retry_period_s": a.retry_period}}
        self.cluster()
        self.ns = f"scale-{uuid.uuid4().hex[:6]}"
        self.core.create_namespace({"metadata": {"name": self.ns}})
        self.wait("the default ServiceAccount", lambda: self.core.list_namespaced_service_account(self.ns).items, 60)
        self.start_fleet()
        self.start_operators()
        t0 = time.monotonic()
        self.create()
        report["loaded"] = self.loaded
        log(f"{a.deployments} deployments of {a.prefill}P+{a.decoder}D at TP {a.tp} created in {self.ns}"
            f"{f', and {len(self.loaded)} of real agents' if self.loaded else ''}")
        last = 0.0
        deadline = t0 + a.settle_timeout
        while not self.all_settled():
            if time.monotonic() > deadline:
                raise TimeoutError(f"not every deployment settled within {a.settle_timeout:.0f}s: {self.progress()}")
            for op in self.operators.values():
                if not op.alive():
                    raise RuntimeError(f"operator {op.name} exited ({op.proc.returncode if op.proc else '?'}); "
                                       f"see {op.log_path}")
            if time.monotonic() - last > 15:
                log(self.progress())
                last = time.monotonic()
            time.sleep(2)
        report["bring_up_s"] = round(time.monotonic() - t0, 1)
        log(f"every deployment settled {report['bring_up_s']} s after they were created")
        # the Lease may have moved meanwhile (a leader that misses its renew deadline steps down)
        report["lease_transitions_during_bring_up"] = self.lease().get("leaseTransitions", 0)
        time.sleep(a.warmup_seconds)
        report["idle"] = self.idle_sharded() if a.shards > 1 else self.idle()
        sizes = {o["metadata"]["name"]: len(json.dumps(o.get("status") or {}, separators=(",", ":")))
                 for o in self.deployments() if o["metadata"]["name"] in self.names}
        report["status_bytes"] = {"min": min(sizes.values()), "median": int(statistics.median(sizes.values())),
                                  "max": max(sizes.values()), "total": sum(sizes.values()), "each": sizes}
        log(f"idle: {json.dumps({k: v for k, v in report['idle'].items() if k != 'agent_calls_per_s_by_op'})}")

        if a.takeover:
            report["takeover"] = self.shard_takeover() if a.shards > 1 else self.takeover()
        report["operator_cpu_seconds"] = {r: round(cpu_seconds(op.proc.pid), 1) for r, op in self.operators.items()
                                          if op.alive()}
        report["fleet_errors"] = (self.stats() or {}).get("errors", {})
        return report

    def idle(self) -> dict:
        """Everything settled, nothing changes, no polling of ours meanwhile: the leader at rest."""
        a = self.args
        lead, standby = self.roles()
        samples0, api0, calls0 = scrape(lead.metrics_url), self.api_calls(), (self.stats() or {}).get("calls", {})
        cpu0, fcpu0, w0, m0 = cpu_seconds(lead.proc.pid), cpu_seconds(self.fleet.pid), time.time(), time.monotonic()
        time.sleep(a.idle_seconds)
        samples1, api1, calls1 = scrape(lead.metrics_url), self.api_calls(), (self.stats() or {}).get("calls", {})
        cpu1, fcpu1, w1, span = cpu_seconds(lead.proc.pid), cpu_seconds(self.fleet.pid), time.time(), \
            time.monotonic() - m0
        agent_calls = {op: round((calls1.get(op, 0) - calls0.get(op, 0)) / span, 2) for op in calls1
                       if calls1.get(op, 0) != calls0.get(op, 0)}
        return {
            "seconds": round(span, 1),
            "leader": lead.name,
            "pass": summary(read_passes(lead.log_path, w0, w1)),
            "operator_cpu_percent": round((cpu1 - cpu0) / span * 100, 1),
            "operator_cpu_seconds_total": round(cpu1, 1),
            "operator_rss_bytes": rss_bytes(lead.proc.pid),
            "standby_rss_bytes": rss_bytes(standby.proc.pid),
            "api_calls_per_s": {role: round((api1.get(op.name, 0) - api0.get(op.name, 0)) / span, 2)
                                for role, op in (("leader", lead), ("standby", standby))} if api1 else None,
            "agent_calls_per_s": round(sum(agent_calls.values()), 2),
            "agent_calls_per_s_by_op": agent_calls,
            "agent_calls_per_s_operator_metric": round((total(samples1, "pd_operator_agent_calls_total")
                                                        - total(samples0, "pd_operator_agent_calls_total")) / span, 2),
            "passes_per_s": round((total(samples1, "pd_operator_reconcile_duration_seconds_count")
                                   - total(samples0, "pd_operator_reconcile_duration_seconds_count")) / span, 2),
            "fake_agents_cpu_percent": round((fcpu1 - fcpu0) / span * 100, 1),
        }

    def takeover(self) -> dict:
        """SIGKILL the leader; time until the standby leads, and until every deployment is settled
        as the new leader itself sees it (its own pass found it Ready, links up, probe passed)."""
        a = self.args
        lead, standby = self.roles()
        cpu0 = cpu_seconds(standby.proc.pid)
        transitions0 = self.lease().get("leaseTransitions", 0)
        loads = {n: self.load(n) for n in self.loaded}
        time.sleep(a.load_lead_seconds if loads else 0)   # traffic flowing before the kill
        everyone = self.names + self.loaded
        w_kill, t_kill = time.time(), time.monotonic()
        lead.stop(signal.SIGKILL)
        t_lead = None
        done: set[str] = set()
        deadline = t_kill + a.takeover_timeout
        while time.monotonic() < deadline:
            try:
                samples = scrape(standby.metrics_url)
            except (httpx.HTTPError, ValueError):
                samples = []
            if t_lead is None and total(samples, "pd_operator_leader") == 1:
                t_lead = time.monotonic()
            if t_lead is not None:
                done = settled_by(samples, everyone)
                if len(done) == len(everyone):
                    break
            time.sleep(0.25)
        t_settled, w_settled = time.monotonic(), time.time()
        ok = len(done) == len(everyone)
        api_ok = self.all_settled()
        # the passes of the new leader from its first until every deployment settled, and a little after;
        # the load goes on as long again as the takeover took, then stops (the requests in flight finish)
        time.sleep(max(2.0, (t_settled - t_kill) if loads else 0))
        load = self.load_results(loads) if loads else None
        passes = read_passes(standby.log_path, w_kill, w_settled + 2)
        out = {"leader_killed_to_new_leader_s": round(t_lead - t_kill, 2) if t_lead else None,
               "leader_killed_to_all_settled_s": round(t_settled - t_kill, 2) if ok else None,
               "new_leader_to_all_settled_s": round(t_settled - t_lead, 2) if ok and t_lead else None,
               "settled": f"{len(done)}/{len(everyone)}", "status_settled_in_api": api_ok,
               # traffic on the real-agent deployments from before the kill until after every one settled
               "load": load,
               "killed": lead.name,
               # 1 is the takeover itself; more: the new leader missed its renew deadline and stepped down
               "lease_transitions": self.lease().get("leaseTransitions", 0) - transitions0,
               "pass": summary(passes),
               # probes it made meanwhile (a round recorded over the same links stands: verification.py)
               "kv_probes": total(samples, "pd_operator_kv_verifications_total"),
               "new_leader_cpu_seconds": round(cpu_seconds(standby.proc.pid) - cpu0, 1),
               "new_leader_rss_bytes": rss_bytes(standby.proc.pid)}
        log(f"takeover: {json.dumps(out)}")
        if a.profile:
            time.sleep(a.idle_seconds)   # the profile covers the takeover and an idle stretch after it
        return out

    def close(self) -> None:
        for op in self.operators.values():
            op.stop()
        if self.ns and not (self.started_cluster and not self.args.keep_cluster):
            # the fake kubelet completes the pods' deletion: it goes only once they are gone
            self.kubectl("delete", "namespace", self.ns, "--wait=false", check=False)
            try:
                self.wait("the fake pods gone", lambda: (self.stats() or {}).get("pods", 0) == 0, 300, 2)
            except TimeoutError as e:
                log(str(e))
        if self.fleet is not None and self.fleet.poll() is None:
            self.fleet.terminate()
            try:
                self.fleet.wait(30)
            except subprocess.TimeoutExpired:
                self.fleet.kill()
        if self.started_cluster and not self.args.keep_cluster:
            self.lc.down()


def mib(n: int | None) -> str:
    return f"{n / 2**20:.0f} MiB" if n is not None else "-"


def ms(x: float | None) -> str:
    return f"{x:.0f} ms" if x is not None else "-"


def table(r: dict) -> str:
    s, idle = r["size"], r["idle"]
    rows = [("size", f"{s['deployments']} x ({s['prefill']}P+{s['decoder']}D) x TP {s['tp']}: {s['pods']} pods, "
                     f"{s['rank_engines']} rank engines, {s['rank_links']} rank links"),
            ("bring-up (create -> all settled)", f"{r['bring_up_s']} s (Lease transitions meanwhile: "
                                                 f"{r['lease_transitions_during_bring_up']})"),
            ("idle pass p50 / p99 / max", f"{ms(idle['pass']['p50_ms'])} / {ms(idle['pass']['p99_ms'])} / "
                                          f"{ms(idle['pass']['max_ms'])} ({idle['pass']['passes']} passes)"),
            ("status bytes min / median / max", f"{r['status_bytes']['min']} / {r['status_bytes']['median']} / "
                                                f"{r['status_bytes']['max']}")]
    if "shards" in idle:
        rows += [("shards (shard: replica)", ", ".join(f"{k}: {v}" for k, v in idle["shards"].items())),
                 ("idle CPU by replica", ", ".join(f"{k} {v}%" for k, v in idle["operator_cpu_percent"].items())),
                 ("RSS by replica", ", ".join(f"{k} {mib(v)}" for k, v in idle["operator_rss_bytes"].items()))]
    else:
        rows += [("idle operator CPU", f"{idle['operator_cpu_percent']}% of a core"),
                 ("operator RSS (leader / standby)",
                  f"{mib(idle['operator_rss_bytes'])} / {mib(idle['standby_rss_bytes'])}"),
                 ("idle API calls/s (leader / standby)",
                  "-" if idle["api_calls_per_s"] is None else
                  f"{idle['api_calls_per_s']['leader']} / {idle['api_calls_per_s']['standby']}"),
                 ("idle agent calls/s", f"{idle['agent_calls_per_s']} (operator's count: "
                                        f"{idle['agent_calls_per_s_operator_metric']})")]
    t = r.get("takeover")
    if t and "shards_moved" in t:
        rows += [("replica killed (SIGKILL)", f"{t['killed']}: shards {t['shards_moved']} moved "
                                              f"({t['moved_deployments']} deployments); other shards moved: "
                                              f"{t['other_shards_moved'] or 'none'}"),
                 ("killed -> its shards taken / settled", f"{t['leader_killed_to_shard_taken_s']} s / "
                                                          f"{t['leader_killed_to_all_settled_s']} s ({t['settled']})"),
                 ("requests across the takeover", "-" if not t.get("load") else
                  f"{t['load']['completed']}/{t['load']['requests']} completed, {t['load']['failed']} failed"),
                 ("other shards' pass max, before / during",
                  f"{ms(t['other_pass_before']['max_ms'])} / {ms(t['other_pass_during']['max_ms'])}"),
                 ("other shards' longest gap, before / during", f"{t['other_longest_gap_before_s']} s / "
                                                                f"{t['other_longest_gap_during_s']} s"),
                 ("moved deployments' pass p50 / max", f"{ms(t['moved_pass']['p50_ms'])} / "
                                                       f"{ms(t['moved_pass']['max_ms'])}")]
    elif t:
        rows += [("leader killed -> standby leads", f"{t['leader_killed_to_new_leader_s']} s (Lease transitions: "
                                                    f"{t['lease_transitions']})"),
                 ("leader killed -> all settled", f"{t['leader_killed_to_all_settled_s']} s ({t['settled']})"),
                 ("requests across the takeover", "-" if not t.get("load") else
                  f"{t['load']['completed']}/{t['load']['requests']} completed, {t['load']['failed']} failed "
                  f"{t['load']['failed_by_reason'] or ''} ({len(r['loaded'])} loaded deployments)"),
                 ("takeover pass p50 / p99 / max", f"{ms(t['pass']['p50_ms'])} / {ms(t['pass']['p99_ms'])} / "
                                                   f"{ms(t['pass']['max_ms'])} ({t['pass']['passes']} passes)")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--deployments", type=int, default=100)
    ap.add_argument("--prefill", type=int, default=4)
    ap.add_argument("--decoder", type=int, default=4)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--idle-seconds", type=float, default=30)
    ap.add_argument("--warmup-seconds", type=float, default=10, help="settled, before the idle window")
    ap.add_argument("--settle-timeout", type=float, default=1800)
    ap.add_argument("--takeover-timeout", type=float, default=300)
    ap.add_argument("--no-takeover", dest="takeover", action="store_false")
    ap.add_argument("--loaded", type=int, default=2, help="deployments of real agents (examples/sim-small.yaml on "
                    "the cluster's own node) carrying load across the takeover")
    ap.add_argument("--load-rate", type=float, default=3, help="requests/s on each loaded deployment")
    ap.add_argument("--load-lead-seconds", type=float, default=5, help="traffic flowing before the leader is killed")
    # the chart's leader election timings (values.yaml leaderElection)
    ap.add_argument("--lease-duration", type=float, default=15)
    ap.add_argument("--renew-deadline", type=float, default=10)
    ap.add_argument("--retry-period", type=float, default=2)
    ap.add_argument("--shards", type=int, default=1, help="shards (the chart's `shards`); with more than one, "
                    "--replicas replicas share them and the takeover kills the one holding shard 0")
    ap.add_argument("--replicas", type=int, default=4, help="operator replicas when sharded")
    ap.add_argument("--profile", action="store_true", help="run the standby under cProfile (it leads after the "
                    "takeover): operator-b.prof in the work directory")
    ap.add_argument("--cluster-dir", default=None, help=f"default $PD_LOCALCLUSTER_DIR, else {DEFAULT_DIR}")
    ap.add_argument("--work-dir", default=None, help="logs and identities (default $TMPDIR/pd-bench-scale)")
    ap.add_argument("--keep-cluster", action="store_true", help="leave a cluster this run started up")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "scale.json"))
    return ap


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    h = Harness(args)
    try:
        report = h.run()
    finally:
        h.close()
    report["logs"] = str(h.work)
    print(table(report), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    log(f"wrote {out}")
    return report


if __name__ == "__main__":
    # SIGTERM (and SIGINT, which a background job ignores) end the run through its cleanup
    for _sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(_sig, lambda *_: sys.exit(1))
    main()
