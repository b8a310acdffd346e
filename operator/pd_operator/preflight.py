"""Condition NetworkPreflight from the engine pods' own network preflight (pure).

Each pod's agent checks its NPUs' network before its engines start and again while they serve
(pd_agent.preflight: link, net health, detect address, gateway, device IP, TLS switch). Here the
operator names every failure by pod, node, device and check, compares the TLS switch across nodes
(a difference makes link_clusters time out, so the common setting wins and the pods off it are
named), and returns the pods it must not link: those whose preflight failed or whose TLS differs.
With spec.datadist.preflight Report, failures are named and nothing is held back."""
from __future__ import annotations

from collections.abc import Mapping

from pd_contract import preflight as pf
from pd_contract.agent_api import AgentStatus, PreflightReport

from .status import MAX_LISTED, Verdict

RUNBOOK = f"runbook: {pf.RUNBOOK}"


def _node(pod: dict) -> str:
    return (pod.get("spec") or {}).get("nodeName") or "(unscheduled)"


def common_tls(tls: Mapping[str, str], nodes: Mapping[str, str]) -> str:
    """The TLS switch most nodes run (then most pods; then "0", the driver's default), given each
    pod's switch and node."""
    by_value: dict[str, tuple[set[str], int]] = {}
    for pod, value in tls.items():
        seen, n = by_value.get(value, (set(), 0))
        by_value[value] = (seen | {nodes[pod]}, n + 1)
    return min(by_value, key=lambda v: (-len(by_value[v][0]), -by_value[v][1], v))


def verdict(pods: list[dict], reports: Mapping[str, AgentStatus], mode: str) -> tuple[Verdict | None, frozenset]:
    """(NetworkPreflight, the pods not to link). None: the condition goes (preflight Off)."""
    if mode == "Off":
        return None, frozenset()
    nodes = {p["metadata"]["name"]: _node(p) for p in pods}
    reps: dict[str, PreflightReport] = {pod: r.preflight for pod, r in reports.items()
                                        if pod in nodes and r.preflight is not None}
    if not reps:   # pods without NPUs (a simulator run without device requests) run none
        return (None if any(pod in nodes for pod in reports) else
                ("Unknown", "Pending", "no engine pod has reported its network preflight yet")), frozenset()
    failed = sorted(pod for pod, r in reps.items() if r.state == "failed")
    tls = {pod: r.tls_switch for pod, r in reps.items() if r.state == "passed" and r.tls_switch}
    common = common_tls(tls, nodes) if tls else ""
    odd = sorted(pod for pod, value in tls.items() if value != common)
    enforced = mode == "Enforce"
    held = frozenset(failed + odd) if enforced else frozenset()
    tail = "" if enforced else " (spec.datadist.preflight Report: reported only, still linked)"
    if failed:
        named = [_failure(pod, nodes[pod], reps[pod]) for pod in failed[:MAX_LISTED]]
        more = f"; and {len(failed) - MAX_LISTED} more pods" if len(failed) > MAX_LISTED else ""
        what = "not linked until it passes" if enforced else tail.strip(" ()")
        return (False, "CheckFailed", "; ".join(named) + more + f"; {what}; {RUNBOOK}"), held
    if odd:
        values = sorted({tls[p] for p in odd})
        where = "; ".join(f"TLS switch {v} on {', '.join(sorted({nodes[p] for p in odd if tls[p] == v}))} "
                          f"({', '.join(p for p in odd if tls[p] == v)})" for v in values)
        what = "those pods are not linked until it is equal" if enforced else tail.strip(" ()")
        return (False, "TLSDiffers", f"{where}; the other nodes run {common}: {pf.HINTS['tls']}; {what}; "
                f"{RUNBOOK}"), held
    pending = sorted(pod for pod, r in reps.items() if r.state == "pending")
    if pending:
        return ("Unknown", "Pending", f"{len(pending)} pods still checking ({', '.join(pending[:MAX_LISTED])})"), held
    on = sorted(set(nodes[p] for p in reps))
    return (True, "Passed", f"{len(reps)} pods on {len(on)} nodes passed"
            + (f" (TLS switch {common} everywhere)" if common else "")), held


def _failure(pod: str, node: str, rep: PreflightReport) -> str:
    checks = rep.failures[:3]
    text = ", ".join(f"device {f.device_id} {f.check}: {f.message}" for f in checks)
    more = f" (+{len(rep.failures) - 3} more)" if len(rep.failures) > 3 else ""
    hint = pf.HINTS.get(checks[0].check, "") if checks else ""
    return f"{pod} on node {node}: {text}{more} ({hint})"


def superpod_pairs(reported: Mapping[str, list[dict]], reports: Mapping[str, AgentStatus]) -> dict | None:
    """status.superpodPairs: linked (decoder, prefill) pod pairs whose superpods are both known,
    within one superpod and across; None when no pod reports one."""
    sp = {pod: r.preflight.superpod for pod, r in reports.items() if r.preflight is not None and r.preflight.superpod}
    if not sp:
        return None
    pairs = {(d, link["name"]) for d, links in reported.items() for link in links
             if link.get("name") and link.get("healthy", True)}
    known = [(d, p) for d, p in pairs if d in sp and p in sp]
    within = sum(1 for d, p in known if sp[d] == sp[p])
    return {"within": within, "across": len(known) - within}
