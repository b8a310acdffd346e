"""The scale harness (make bench-scale) at a small size: every deployment settles on fake agents,
again after the leader is killed, with no request failed on a deployment of real agents under load
meanwhile, and the report carries every figure. Figures are reported,
never asserted: this checks the harness, not the operator's speed.

The harness runs its own local cluster ($PD_LOCALCLUSTER_DIR if set, else one in the test's
temporary directory, stopped at the end), never the shared .localcluster: its fake Node and
hundreds of fake pods would weigh on everyone else's tests."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

pytestmark = pytest.mark.integration

DEPLOYMENTS = 20
FIGURES = [
    ("bring_up_s",),
    ("idle", "pass", "p50_ms"), ("idle", "pass", "p99_ms"), ("idle", "pass", "max_ms"),
    ("idle", "operator_cpu_percent"), ("idle", "operator_cpu_seconds_total"), ("idle", "operator_rss_bytes"),
    ("idle", "standby_rss_bytes"), ("idle", "api_calls_per_s", "leader"), ("idle", "api_calls_per_s", "standby"),
    ("idle", "agent_calls_per_s"), ("idle", "agent_calls_per_s_operator_metric"),
    ("status_bytes", "min"), ("status_bytes", "median"), ("status_bytes", "max"), ("status_bytes", "total"),
    ("takeover", "leader_killed_to_new_leader_s"), ("takeover", "leader_killed_to_all_settled_s"),
    ("takeover", "new_leader_to_all_settled_s"), ("takeover", "pass", "p50_ms"), ("takeover", "pass", "p99_ms"),
    ("takeover", "pass", "max_ms"), ("takeover", "new_leader_rss_bytes"),
]


def figure(report: dict, path: tuple[str, ...]):
    node = report
    for k in path:
        node = node.get(k) if isinstance(node, dict) else None
    return node


# above the harness's own settle (600 s) and takeover (300 s) timeouts, so that on a loaded machine
# the harness says which deployment did not settle and why, rather than pytest cutting it short
@pytest.mark.timeout(1200)
def test_every_deployment_settles_on_fake_agents_and_the_report_has_every_figure(tmp_path: Path) -> None:
    import bench_scale

    out = tmp_path / "scale.json"
    report = bench_scale.main([
        "--deployments", str(DEPLOYMENTS), "--prefill", "1", "--decoder", "1", "--tp", "2",
        "--loaded", "1", "--idle-seconds", "6", "--warmup-seconds", "1", "--settle-timeout", "600",
        "--takeover-timeout", "300",
        "--cluster-dir", os.environ.get("PD_LOCALCLUSTER_DIR") or str(tmp_path / "cluster"),
        "--work-dir", str(tmp_path / "work"), "--out", str(out)])

    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["size"] == {"deployments": DEPLOYMENTS, "prefill": 1, "decoder": 1, "tp": 2,
                              "pods": 2 * DEPLOYMENTS, "rank_engines": 4 * DEPLOYMENTS, "rank_links": 2 * DEPLOYMENTS}
    missing = [".".join(p) for p in FIGURES if figure(report, p) is None]
    assert not missing, f"the report lacks {missing}: {json.dumps(report, indent=1)[:3000]}"
    # every deployment settled after the takeover, as the new leader saw it and in the API
    assert report["takeover"]["settled"] == f"{DEPLOYMENTS + 1}/{DEPLOYMENTS + 1}"
    # the deployment of real agents carried load across the takeover, and none of it failed
    load = report["takeover"]["load"]
    assert load["requests"] > 0 and load["failed"] == 0, load
    assert report["takeover"]["status_settled_in_api"] is True
    assert len(report["status_bytes"]["each"]) == DEPLOYMENTS
    assert report["idle"]["pass"]["passes"] > 0 and report["takeover"]["pass"]["passes"] > 0
    # the fake agents answered the operator's calls at idle (settled members are still asked)
    assert report["idle"]["agent_calls_per_s"] > 0
