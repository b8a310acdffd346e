"""The control plane changes under the operator while traffic runs: its token is rotated and
the old one revoked, the API server is away for a minute, etcd restarts. The data path does
not need the API server, so no request fails; the operator keeps running (no restart) and
converges when the API answers again."""
from __future__ import annotations

import os
import subprocess
import time

import pytest
import yaml

from tests.conftest import Cluster, wait_for
from tests.integration.conftest import pdd, sample, wait_phase
from tests.integration.test_switching import REBALANCE, set_prefill, switched
from tests.integration.test_traffic import TRAFFIC_SPEC, Load, force_unlinks

pytestmark = pytest.mark.integration
SA = "rotating-operator"


def bound_token(cluster: Cluster, ns: str, anchor: str) -> str:
    """A TokenRequest for the operator's ServiceAccount, valid while the Secret `anchor` exists."""
    cluster.kubectl("create", "secret", "generic", anchor, "-n", ns)
    return cluster.kubectl("create", "token", SA, "-n", ns, "--bound-object-kind=Secret",
                           f"--bound-object-name={anchor}", "--duration=1h").stdout.strip()


def token_kubeconfig(cluster: Cluster, path, user: dict):
    """The cluster's kubeconfig with its user replaced (no client certificate left to fall back on)."""
    kc = yaml.safe_load(cluster.kubeconfig.read_text())
    kc["users"] = [{"name": SA, "user": user}]
    kc["contexts"] = kc["contexts"][:1]
    kc["contexts"][0]["context"]["user"] = SA
    kc["current-context"] = kc["contexts"][0]["name"]
    path.write_text(yaml.safe_dump(kc))
    return path


def accepted(cluster: Cluster, token: str, tmp_path) -> bool:
    kc = token_kubeconfig(cluster, tmp_path / "check-kubeconfig", {"token": token})
    return subprocess.run([str(cluster.bin_dir / "kubectl"), f"--kubeconfig={kc}", "get", "--raw", "/api"],
                          capture_output=True, timeout=30).returncode == 0


def write_atomically(path, text: str) -> None:
    """As the kubelet updates a projected token: the new file appears whole."""
    tmp = path.with_suffix(".new")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_a_rotated_token_keeps_the_operator_reconciling(cluster: Cluster, namespace: str, operator,
                                                        tmp_path) -> None:
    ns = namespace
    binding = f"{SA}-{ns}"
    cluster.kubectl("create", "serviceaccount", SA, "-n", ns)
    cluster.kubectl("create", "clusterrolebinding", binding, "--clusterrole=cluster-admin",
                    f"--serviceaccount={ns}:{SA}")
    try:
        token_file = tmp_path / "token"
        old = bound_token(cluster, ns, "token-anchor-1")
        token_file.write_text(old)
        assert accepted(cluster, old, tmp_path)
        operator.stop()
        operator.kubeconfig = token_kubeconfig(cluster, tmp_path / "kubeconfig", {"tokenFile": str(token_file)})
        # watches end every 10 s here (300 s by default), so the revoked token's watches are resumed in the test
        operator.start(PD_OPERATOR_WATCH_TIMEOUT_S="10")
        cluster.apply(sample(**TRAFFIC_SPEC, rebalance=REBALANCE), ns)
        wait_phase(cluster, ns, "Ready", timeout=120, extra=lambda o: o["status"]["linksSummary"] == "4/4")
        load = Load(cluster, ns, duration=600)
        time.sleep(3)

        # the token rotates, then the old one stops working (its bound object is deleted)
        write_atomically(token_file, bound_token(cluster, ns, "token-anchor-2"))
        cluster.kubectl("delete", "secret", "token-anchor-1", "-n", ns)
        wait_for("the old token refused", lambda: not accepted(cluster, old, tmp_path), timeout=30)
        rotated_at = time.monotonic()
        time.sleep(15)   # every watch has been resumed since: with the old token it would be refused

        # the operator still acts on changes: a switch towards prefill and one back
        t0 = time.monotonic()
        set_prefill(cluster, ns, 3)
        first = switched(cluster, ns, "prefill", None, "3/3")
        set_prefill(cluster, ns, 2)
        switched(cluster, ns, "decoder", first["status"]["lastSwitch"]["at"], "4/4")
        s = load.stop()
        logs = operator.logs()
        print(f"\nold token refused; two switches completed {time.monotonic() - t0:.1f}s after the change "
              f"({t0 - rotated_at:.0f}s after the revocation); operator reloads: "
              f"{logs.count('credentials read again after a 401')}, Kopf re-logins: "
              f"{logs.count('Re-authentication has finished')}; loadgen {s['completed']}/{s['requests']}")
        assert "credentials read again after a 401" in logs
        assert "Re-authentication has finished" in logs
        assert "Ran out of valid credentials" not in logs
        assert operator.starts == 1 + 1 and operator.proc.poll() is None   # the one restart is the test's own
        assert s["failed"] == 0, s["failed_by_reason"]
        assert s["completed"] == s["requests"] > 0
        assert force_unlinks(cluster, ns) == []
    finally:
        cluster.kubectl("delete", "clusterrolebinding", binding, check=False)


def test_the_api_server_away_and_etcd_restarting_under_load(cluster: Cluster, namespace: str, operator) -> None:
    from pd_localcluster.cluster import LocalCluster
    ns = namespace
    lc = LocalCluster(cluster.kubeconfig.parent)
    # with leader election: a leader that cannot renew stops acting, and leads again after
    operator.stop()
    operator.start(PD_OPERATOR_LEADER_ELECTION="true", PD_OPERATOR_LEASE_NAMESPACE=ns,
                   PD_OPERATOR_LEASE_DURATION_S="4", PD_OPERATOR_RENEW_DEADLINE_S="3",
                   PD_OPERATOR_RETRY_PERIOD_S="0.5")
    cluster.apply(sample(**TRAFFIC_SPEC, rebalance=REBALANCE), ns)
    wait_phase(cluster, ns, "Ready", timeout=120, extra=lambda o: o["status"]["linksSummary"] == "4/4")
    load = Load(cluster, ns, duration=900)
    time.sleep(3)

    t0 = time.monotonic()
    lc.restart("kube-apiserver", down_seconds=60)
    back = time.monotonic()
    assert operator.proc.poll() is None, "the operator exited while the API server was away"
    # converges: a change made after the outage is carried out
    set_prefill(cluster, ns, 3)
    first = switched(cluster, ns, "prefill", None, "3/3", timeout=120)
    converged = time.monotonic() - back

    lc.restart("etcd", down_seconds=10)
    set_prefill(cluster, ns, 2)
    switched(cluster, ns, "decoder", first["status"]["lastSwitch"]["at"], "4/4", timeout=120)
    s = load.stop()
    print(f"\nAPI server away {back - t0:.0f}s (incl. its start); a switch after it done in {converged:.1f}s; "
          f"etcd restarted; loadgen {s['completed']}/{s['requests']}, {s['failed']} failed")
    logs = operator.logs()
    assert operator.starts == 2 and operator.proc.poll() is None   # the one restart is the test's own
    assert "stopped acting, campaigning again" in logs
    assert logs.count("became the leader") >= 2
    assert s["failed"] == 0, s["failed_by_reason"]
    assert s["completed"] == s["requests"] > 0
    assert force_unlinks(cluster, ns) == []
    assert pdd(cluster, ns)["status"]["phase"] == "Ready"
