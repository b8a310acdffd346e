"""decide's cost on a settled pass: one PDDeployment of P prefill and D decoder pods at tensor
parallel TP (64P+64D at TP 8 by default: 512+512 rank engines), every desired link up, the KV
path verified, nothing to apply and nothing to do. That pass runs every few seconds per
deployment for as long as it is up; its goal is a median of at most 20 ms (issue 36).

No cluster and no agents: the pods, the agents' reports (as the agent client hands them over,
the same AgentStatus object while an agent answers the same bytes) and the applied children are
built here, and what acting would have done (applying the children, one verification round) is
folded into the memory as the actor folds it. Each timed pass gets the memory the last one kept
and the status it recorded, as the reconcile loop passes them on, and is checked to be settled
before it counts. Also prints the status size of the same deployment with every rank link
failing (at most 256 KiB: etcd refuses objects over 1.5 MiB).

    python bench/bench_decide.py [--prefill 64 --decoder 64 --tp 8 --passes 50]"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from pd_contract.agent_api import AgentStatus, LinkState, RankInfo, RankLinkState, VerifyResult
from pd_contract.names import llmd_labels
from pd_operator import builders
from pd_operator import children as ch
from pd_operator.api import PDDeploymentSpec, parse_spec
from pd_operator.decide import SETTLED_POLL_S, Plan, Snapshot, decide
from pd_operator.members import member_of
from pd_operator.observe import to_ask
from pd_operator.reports import Report
from pd_operator.results import Results, fold
from pd_operator.state import Memory
from pd_operator.switch import iso

REPO = Path(__file__).resolve().parents[1]
KEY = ("ns", "x")
STATUS_LIMIT = 256 * 1024
FAILING = ("LLM_LINK_FAILED", "LLM_WAIT_PROCESS_TIMEOUT", "LLM_NOT_YET_LINK")
PASS_S = SETTLED_POLL_S   # the time between two timed passes: every member is due to be asked again


def spec_of(prefill: int, decoder: int, tp: int) -> dict:
    spec = yaml.safe_load((REPO / "examples" / "sim-small.yaml").read_text())["spec"]
    spec["model"]["kvCache"]["tensorParallel"] = tp
    for group, n in (("prefill", prefill), ("decoder", decoder)):
        spec[group] = {"replicas": n, "resources": {"limits": {"huawei.com/Ascend910": tp}}}
    spec["datadist"]["verifyIntervalSeconds"] = 86400   # no verification round falls due among the timed passes
    return spec


def pod(group: str, index: int, ip: str) -> dict:
    name = f"x-{group}-{index}"
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}",
                         "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": f"x-{group}",
                                              "uid": f"uid-StatefulSet-x-{group}", "controller": True}],
                         "labels": {"pdoperator.io/deployment": "x", "pdoperator.io/group": group,
                                    "pdoperator.io/role": group, "apps.kubernetes.io/pod-index": str(index),
                                    **{k: v for k, v in llmd_labels(group).items() if v}},
                         "annotations": {"pdoperator.io/assigned-role": group}},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}],
                       "containerStatuses": [{"state": {"running": {}}, "restartCount": 0}]}}


@dataclass
class Fleet:
    """One deployment, settled: what observing would hand decide, less the clocks and memory."""
    body: dict
    spec: PDDeploymentSpec
    pods: tuple[dict, ...]
    engines: tuple
    statuses: dict[str, AgentStatus]    # pod -> its agent's report (one object while it answers the same)
    children: dict


def _ranks(spec: PDDeploymentSpec, group: str, index: int, tp: int) -> list[RankInfo]:
    octet = 1 if group == "prefill" else 2
    return [RankInfo(rank=r, cluster_id=builders.cluster_id(spec, group, index, r), device_id=r,
                     ip=f"172.{16 + octet}.{index}.{r + 1}", port=26000,
                     initialized=True, registered=True) for r in range(tp)]


def _link(p: AgentStatus, codes: list[str] | None = None) -> LinkState:
    codes = codes or ["LLM_SUCCESS"] * len(p.ranks)
    bad = next((c for c in codes if c != "LLM_SUCCESS"), None)
    return LinkState(name=p.pod, cluster_id=p.cluster_id, ip=p.ip, port=p.port, code=bad or "LLM_SUCCESS",
                     since=1.0, healthy=bad is None, peer_boot_id=p.boot_id,
                     ranks=[RankLinkState(rank=r.rank, cluster_id=r.cluster_id, ip=r.ip, port=r.port, code=c,
                                          healthy=c == "LLM_SUCCESS") for r, c in zip(p.ranks, codes)])


def fleet(prefill: int, decoder: int, tp: int) -> Fleet:
    raw = spec_of(prefill, decoder, tp)
    spec = parse_spec(raw)
    body = {"apiVersion": "pdoperator.io/v1alpha1", "kind": "PDDeployment",
            "metadata": {"name": "x", "namespace": "ns", "uid": "uid-x", "generation": 1}, "spec": raw}
    pods, statuses = [], {}
    for group, n, role in (("prefill", prefill, "prompt"), ("decoder", decoder, "decoder")):
        for i in range(n):
            p = pod(group, i, f"10.{1 if group == 'prefill' else 2}.{i // 250}.{i % 250 + 1}")
            ranks = _ranks(spec, group, i, tp)
            name = p["metadata"]["name"]
            pods.append(p)
            statuses[name] = AgentStatus(
                pod=name, role=role, cluster_id=ranks[0].cluster_id, boot_id=f"boot-{name}", backend="sim",
                initialized=True, ip=ranks[0].ip, port=26000, model_id=0, cache_desc={"num_tensors": 8},
                tensor_parallel=tp, ranks=ranks, device_ips="annotation")
    prefills = [s for s in statuses.values() if s.role == "prompt"]
    decoders = [s for s in statuses.values() if s.role == "decoder"]
    for d in decoders:
        statuses[d.pod] = d.model_copy(update={"links": [_link(p) for p in prefills]})
    for p in prefills:
        statuses[p.pod] = p.model_copy(update={"incoming": [d.cluster_id for d in decoders]})
    engines = tuple(member_of(p, spec) for p in pods)
    return Fleet(body, spec, tuple(pods), engines, statuses, {})


def snapshot(f: Fleet, mem: Memory, now: float, wall: float) -> Snapshot:
    """The pass as observe would freeze it: the members due to be asked report."""
    asked = to_ask(mem, list(f.engines), now, set())
    return Snapshot(key=KEY, body=f.body, spec=f.spec, now=now, wall=wall, pods=f.pods,
                    children=f.children, engines=f.engines, problems=(), token="token",
                    reports={p: Report(status=f.statuses[p]) for p in asked}, gateway_stats=None,
                    gateway_read=False, asked=frozenset(asked), memory=mem)


def act(f: Fleet, plan: Plan, now: float, wall: float) -> Memory:
    """What recording and acting leave behind: the status stored, the children applied, the
    verification round's answers folded into the memory kept."""
    mem = plan.memory
    mem.last_status = plan.status
    f.body = {**f.body, "status": plan.status}   # the status write, back through the watch
    res = Results()
    for n, obj in enumerate(plan.to_apply):
        stored = copy.deepcopy(obj)
        stored["metadata"]["resourceVersion"] = str(n + 1)
        f.children = {**f.children, ch.child_key(obj): stored}
        res.applied[ch.child_key(obj)] = (ch.digest(obj), ch.marker(stored))
    if plan.verify:
        res.verified = [VerifyResult(ok=True, code="LLM_SUCCESS", prefill=p.pod, decoder=d.pod, bytes=4096,
                                     pull_ms=0.5).model_dump() for d, p in plan.verify]
        res.verified_at = iso(wall)
        res.next_verify = now + verify_interval(f)
    fold(mem, res, now)
    return mem


def verify_interval(f: Fleet) -> float:
    return float(f.body["spec"]["datadist"]["verifyIntervalSeconds"])


def settled(plan: Plan) -> bool:
    return (plan.status["phase"] == "Ready" and not plan.links and not plan.verify and not plan.to_apply
            and plan.verify_after_links is None and not plan.switch_intents and not plan.events)


def check_settled(plan: Plan, f: Fleet) -> None:
    links = plan.status["links"]
    assert plan.status["phase"] == "Ready", plan.status["conditions"]
    assert not plan.links, f"{len(plan.links)} decoders have links to make"
    assert not plan.verify, "verification pairs planned"
    assert not plan.to_apply, [o["metadata"]["name"] for o in plan.to_apply]
    assert not plan.switch_intents and not plan.events, (plan.switch_intents, plan.events)
    assert links["expected"] == links["up"] > 0, links
    assert plan.status == plan.memory.last_status, "a settled pass writes no status"
    d, p = (sum(1 for e in f.engines if e.group == g) for g in ("decoder", "prefill"))
    assert links["expected"] == d * p * f.engines[0].tp, links


def settle(f: Fleet, passes: int = 6) -> tuple[Memory, float, float]:
    """Passes, acting on each, until one has nothing to do; then one more with the memory it kept."""
    mem, now, wall = Memory(), 1000.0, 1_790_000_000.0
    for _ in range(passes):
        plan = decide(snapshot(f, mem, now, wall))
        done = settled(plan) and plan.status == mem.last_status
        mem = act(f, plan, now, wall)
        now, wall = now + PASS_S, wall + PASS_S
        if done:
            return mem, now, wall
    raise AssertionError(f"not settled in {passes} passes: phase {plan.status['phase']}, {len(plan.links)} link "
                         f"plans, {len(plan.verify)} verify pairs, {len(plan.to_apply)} to apply")


def timed(f: Fleet, mem: Memory, now: float, wall: float, passes: int) -> list[float]:
    """Seconds per settled pass, each fed the memory the last one kept (and checked settled)."""
    out = []
    for _ in range(passes):
        snap = snapshot(f, mem, now, wall)
        assert len(snap.reports) == len(f.engines), "every member is due to be asked"
        t0 = time.perf_counter()
        plan = decide(snap)
        out.append(time.perf_counter() - t0)
        check_settled(plan, f)
        mem = act(f, plan, now, wall)
        now, wall = now + PASS_S, wall + PASS_S
    return out


def failing_status_size(f: Fleet, mem: Memory, now: float, wall: float) -> int:
    """Bytes of the status when every rank link of every decoder reports failing."""
    bad = replace(f, statuses=dict(f.statuses))
    prefills = [s for s in f.statuses.values() if s.role == "prompt"]
    for s in f.statuses.values():
        if s.role == "decoder":
            bad.statuses[s.pod] = s.model_copy(update={"links": [
                _link(p, [FAILING[(i + r) % len(FAILING)] for r in range(len(p.ranks))])
                for i, p in enumerate(prefills)]})
    plan = decide(snapshot(bad, mem, now, wall))
    assert plan.status["links"]["up"] == 0 and plan.status["phase"] != "Ready", plan.status["links"]
    return len(json.dumps(plan.status))


def run(prefill: int = 64, decoder: int = 64, tp: int = 8, passes: int = 50) -> dict:
    f = fleet(prefill, decoder, tp)
    mem, now, wall = settle(f)
    times = timed(f, mem, now, wall, passes)
    size = failing_status_size(f, mem.fork(), now, wall)
    ms = sorted(t * 1000 for t in times)
    return {"median_ms": statistics.median(ms), "p90_ms": ms[min(len(ms) - 1, int(0.9 * len(ms)))],
            "max_ms": ms[-1], "failing_status_bytes": size, "passes": passes}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", type=int, default=64)
    ap.add_argument("--decoder", type=int, default=64)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--passes", type=int, default=50)
    a = ap.parse_args(argv)
    r = run(a.prefill, a.decoder, a.tp, a.passes)
    print(f"settled decide, {a.prefill}P+{a.decoder}D at TP {a.tp}, {a.passes} passes: median {r['median_ms']:.1f} "
          f"ms, p90 {r['p90_ms']:.1f} ms, max {r['max_ms']:.1f} ms")
    size = r["failing_status_bytes"]
    print(f"status with every link failing: {size / 1024:.1f} KiB (limit {STATUS_LIMIT // 1024} KiB)")
    assert size <= STATUS_LIMIT, size


if __name__ == "__main__":
    main()
