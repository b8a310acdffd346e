"""Two operators, one leader: the standby runs no pass until the Lease is its own, and takes
over a switch the leader was killed in the middle of, under load, with no failed request."""
from __future__ import annotations

import time

import pytest

from tests.conftest import Cluster, wait_for
from tests.integration.conftest import OperatorProc, pdd, sample, wait_phase
from tests.integration.test_switching import REBALANCE, set_prefill, switched
from tests.integration.test_traffic import TRAFFIC_SPEC, Load, force_unlinks

pytestmark = pytest.mark.integration


def lease(cluster: Cluster, ns: str) -> dict:
    return cluster.get_json("lease", "pd-operator-leader", "-n", ns)["spec"]


def leader_to_kill_and_standby(cluster: Cluster, ns: str, operator, tmp_path) -> tuple[OperatorProc, str]:
    """The test's operator restarted as the Lease's holder that dies (SIGKILL) once a prefill-ward
    switch recorded that switch_role is done, and a standby started after it leads: (standby, leader)."""
    election = {"PD_OPERATOR_LEADER_ELECTION": "true", "PD_OPERATOR_LEASE_NAMESPACE": ns,
                "PD_OPERATOR_LEASE_DURATION_S": "4", "PD_OPERATOR_RENEW_DEADLINE_S": "3",
                "PD_OPERATOR_RETRY_PERIOD_S": "0.5"}
    operator.stop()
    (tmp_path / "standby").mkdir()
    standby = OperatorProc(cluster, ns, tmp_path / "standby")
    operator.start(**election, PD_OPERATOR_FAULT_POINT="decoder-to-prefill:Relink", PD_OPERATOR_FAULT_SIGNAL="KILL")
    first = wait_for("a leader", lambda: lease(cluster, ns).get("holderIdentity"), timeout=30)
    standby.start(**election)
    return standby, first


def test_the_standby_takes_over_a_switch_the_leader_was_killed_in(cluster: Cluster, namespace: str, operator,
                                                                    tmp_path) -> None:
    ns = namespace
    standby, first = leader_to_kill_and_standby(cluster, ns, operator, tmp_path)
    try:
        cluster.apply(sample(**TRAFFIC_SPEC, rebalance=REBALANCE), ns)
        wait_phase(cluster, ns, "Ready", timeout=120, extra=lambda o: o["status"]["linksSummary"] == "4/4")
        assert lease(cluster, ns)["holderIdentity"] == first   # the standby never took it
        assert "became the leader" not in standby.logs()

        load = Load(cluster, ns, duration=600)
        time.sleep(3)
        set_prefill(cluster, ns, 3)
        assert operator.wait_exit(180) == -9
        killed_at = time.monotonic()
        st = pdd(cluster, ns)["status"]
        assert st["switches"][0]["step"] in ("Relink", "Verify", "Undrain"), st["switches"]
        pod = st["switches"][0]["pod"]
        second = wait_for("the Lease moved", lambda: (h := lease(cluster, ns).get("holderIdentity")) != first and h,
                          timeout=30)
        took_s = time.monotonic() - killed_at
        obj = switched(cluster, ns, "prefill", None, "3/3")
        assert obj["status"]["lastSwitch"]["pod"] == pod
        s = load.stop()
        print(f"\nLease {first} -> {second} {took_s:.1f}s after the kill (lease duration 4 s); "
              f"switch of {pod} completed by the new leader; loadgen {s['completed']}/{s['requests']}")
        assert "became the leader" in standby.logs()
        assert lease(cluster, ns)["leaseTransitions"] >= 1
        assert s["failed"] == 0, s["failed_by_reason"]
        assert s["completed"] == s["requests"] > 0
        assert force_unlinks(cluster, ns) == []

        # SIGTERM releases the Lease: no one waits out its duration
        standby.stop()
        wait_for("the Lease released", lambda: not lease(cluster, ns).get("holderIdentity"), timeout=10)
    finally:
        standby.stop()
        if standby.proc is not None and standby.proc.returncode not in (0, None, -15):
            print("---- standby log ----\n" + standby.logs()[-4000:])
