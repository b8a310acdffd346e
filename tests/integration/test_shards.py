"""Two operator replicas, two shards: each replica leads one shard's PDDeployments; killing one
moves only its shard, and the other shard's deployment is reconciled meanwhile as before."""
from __future__ import annotations

import time

import pytest

from pd_operator.shards import shard_of
from tests.conftest import Cluster, wait_for
from tests.integration.conftest import OperatorProc, pdd, sample, wait_phase

pytestmark = pytest.mark.integration

ELECTION = {"PD_OPERATOR_LEADER_ELECTION": "true", "PD_OPERATOR_LEASE_DURATION_S": "4",
            "PD_OPERATOR_RENEW_DEADLINE_S": "3", "PD_OPERATOR_RETRY_PERIOD_S": "0.5", "PD_OPERATOR_SHARDS": "2"}


def holder(cluster: Cluster, ns: str, shard: int) -> str:
    lease = cluster.get_json("lease", f"pd-operator-leader-shard-{shard}", "-n", ns)
    return (lease.get("spec") or {}).get("holderIdentity") or ""


def names_per_shard(ns: str) -> dict[int, str]:
    """A deployment name for each shard (the hash decides which)."""
    out: dict[int, str] = {}
    for i in range(100):
        out.setdefault(shard_of((ns, f"sharded-{i}"), 2), f"sharded-{i}")
        if len(out) == 2:
            return out
    raise AssertionError("no name for one of the shards")


def bump(cluster: Cluster, ns: str, name: str) -> int:
    """A spec change the operator must carry into status.observedGeneration."""
    cluster.kubectl("patch", "pdd", name, "-n", ns, "--type=merge", "-p",
                    '{"spec":{"datadist":{"verifyIntervalSeconds":%d}}}' % (30 + int(time.time()) % 1000))
    return pdd(cluster, ns, name)["metadata"]["generation"]


def test_a_killed_replica_moves_only_its_shard(cluster: Cluster, namespace: str, operator, tmp_path) -> None:
    ns = namespace
    operator.stop()
    (tmp_path / "b").mkdir()
    other = OperatorProc(cluster, ns, tmp_path / "b")
    env = {**ELECTION, "PD_OPERATOR_LEASE_NAMESPACE": ns}
    try:
        operator.start(**env, POD_NAME="op-a")
        other.start(**env, POD_NAME="op-b")
        wait_for("each replica leads one shard", lambda: sorted(h.split("_")[0] for h in (
            holder(cluster, ns, 0), holder(cluster, ns, 1))) == ["op-a", "op-b"], timeout=60)
        names = names_per_shard(ns)
        for name in names.values():
            cluster.apply(sample(name), ns)
        for name in names.values():
            wait_phase(cluster, ns, "Ready", name=name, timeout=120)
        a_shard = next(i for i in (0, 1) if holder(cluster, ns, i).startswith("op-a"))
        b_shard = 1 - a_shard
        b_holder = holder(cluster, ns, b_shard)

        operator.kill()
        killed = time.monotonic()
        # the surviving replica's shard: reconciled at once, not after the dead one's Lease expires
        gen = bump(cluster, ns, names[b_shard])
        wait_for("op-b carries its shard's spec change", lambda: pdd(cluster, ns, names[b_shard])["status"].get(
            "observedGeneration") == gen, timeout=20)
        kept_s = time.monotonic() - killed
        assert holder(cluster, ns, b_shard) == b_holder, "the survivor's own shard did not move"
        wait_for("op-b takes the dead replica's shard",
                 lambda: holder(cluster, ns, a_shard).startswith("op-b"), timeout=30)
        moved_s = time.monotonic() - killed
        gen = bump(cluster, ns, names[a_shard])
        wait_for("the moved shard's deployment is reconciled by op-b", lambda: pdd(
            cluster, ns, names[a_shard])["status"].get("observedGeneration") == gen, timeout=30)
        print(f"\nshard {b_shard} reconciled {kept_s:.1f}s after the kill; shard {a_shard} moved "
              f"after {moved_s:.1f}s (lease duration 4 s)")
        assert "became the leader on Lease pd-operator-leader-shard-%d" % a_shard in other.logs()
    finally:
        other.stop()
