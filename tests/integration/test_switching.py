"""Live role switching under load: Manual ratio changes, the operator killed at every step of
both directions, the switching pod's container killed mid-switch, and a drain that times out.
The load generator runs throughout; no request may fail except those in flight on a
container the test kills."""
from __future__ import annotations

import json
import threading
import time

import pytest

from tests.conftest import Cluster, wait_for
from tests.integration.conftest import agent_post, agent_status, events, pdd, sample, wait_phase
from tests.integration.test_traffic import TRAFFIC_SPEC, Load, force_unlinks

pytestmark = pytest.mark.integration

STEPS = ("Drain", "Unlink", "SwitchRole", "Relink", "Verify", "Undrain")
REBALANCE = {"policy": "Manual", "manual": {"prefill": 2}, "cooldownSeconds": 0}


def set_prefill(cluster: Cluster, ns: str, n: int) -> None:
    cluster.kubectl("patch", "pdd", "sim-small", "-n", ns, "--type=merge", "-p",
                    json.dumps({"spec": {"rebalance": {"manual": {"prefill": n}}}}))


def switched(cluster: Cluster, ns: str, to: str, after: str | None, links: str, result: str = "Completed",
             timeout: float = 90, name: str = "sim-small") -> dict:
    """Wait for a switch to `to` that ended after `after` (status.lastSwitch.at), and Ready."""
    def ok():
        o = pdd(cluster, ns, name)
        st = o.get("status", {})
        last = st.get("lastSwitch") or {}
        return (last.get("to") == to and last.get("result") == result and (after is None or last["at"] > after)
                and st.get("phase") == "Ready" and st.get("linksSummary") == links and not st.get("switches")) and o
    return wait_for(f"a switch to {to} ({result}) and Ready {links}", ok, timeout=timeout)


def roles(cluster: Cluster, ns: str) -> dict[str, tuple[str, str, str, int]]:
    """pod -> (role label, assigned role, uid, restarts)."""
    out = {}
    for p in cluster.get_json("pods", "-n", ns, "-l", "pdoperator.io/deployment=sim-small")["items"]:
        m = p["metadata"]
        cs = (p["status"].get("containerStatuses") or [{}])[0]
        out[m["name"]] = (m["labels"]["pdoperator.io/role"], m["annotations"]["pdoperator.io/assigned-role"],
                          m["uid"], cs.get("restartCount", 0))
    return out


def engine_roles(cluster: Cluster, ns: str) -> dict[str, str]:
    return {pod: agent_status(cluster, ns, pod)["role"] for pod in roles(cluster, ns)}


def links_match_roles(cluster: Cluster, ns: str) -> None:
    """Every decoder-role engine is linked to every prefill-role engine, and to nothing else."""
    st = {pod: agent_status(cluster, ns, pod) for pod in roles(cluster, ns)}
    prefills = {s["cluster_id"] for s in st.values() if s["role"] == "prompt"}
    for pod, s in st.items():
        assert not s["draining"], pod
        if s["role"] == "decoder":
            assert {l["cluster_id"] for l in s["links"] if l["healthy"]} == prefills, (pod, s["links"])
    for pod, (label, assigned, _, _) in roles(cluster, ns).items():
        assert label == assigned == ("prefill" if st[pod]["role"] == "prompt" else "decoder"), pod


@pytest.fixture
def fleet(cluster: Cluster, namespace: str, operator):
    cluster.apply(sample(**TRAFFIC_SPEC, rebalance=REBALANCE), namespace)
    wait_phase(cluster, namespace, "Ready", timeout=120, extra=lambda o: o["status"]["linksSummary"] == "4/4")
    return namespace


def test_manual_switch_both_ways_under_load(cluster: Cluster, fleet: str, operator):
    ns = fleet
    before = roles(cluster, ns)
    assert {r[0] for r in before.values()} == {"prefill", "decoder"}
    load = Load(cluster, ns, duration=300)
    time.sleep(3)

    with load.change("decoder -> prefill"):
        t0 = time.monotonic()
        set_prefill(cluster, ns, 3)
        obj = switched(cluster, ns, "prefill", None, "3/3")
        up = time.monotonic() - t0
        last = obj["status"]["lastSwitch"]
        pod = last["pod"]
        assert pod.startswith("sim-small-decoder-"), last
        after = roles(cluster, ns)
        assert after[pod][0] == "prefill" and after[pod][1] == "prefill"
        assert after[pod][2] == before[pod][2] and after[pod][3] == 0, "same pod, no restart"
        assert agent_status(cluster, ns, pod)["role"] == "prompt"
        assert obj["status"]["prefill"] == 3 and obj["status"]["decoder"] == 1
        links_match_roles(cluster, ns)
        print(f"\ndecoder->prefill: {json.dumps(last)} (patch to Ready {up:.1f}s)")
    time.sleep(3)

    with load.change("prefill -> decoder"):
        t0 = time.monotonic()
        set_prefill(cluster, ns, 2)
        obj = switched(cluster, ns, "decoder", last["at"], "4/4")
        down = time.monotonic() - t0
        back = obj["status"]["lastSwitch"]
        assert back["pod"] == pod, "the pod away from its home group goes back first"
        assert roles(cluster, ns)[pod][:3] == before[pod][:3]
        links_match_roles(cluster, ns)
        print(f"prefill->decoder: {json.dumps(back)} (patch to Ready {down:.1f}s)")
    time.sleep(3)

    s = load.stop()
    assert s["failed"] == 0, s["failed_by_reason"]
    assert s["completed"] == s["requests"], s
    load.assert_traffic_through_changes()
    assert force_unlinks(cluster, ns) == []
    reasons = [e["reason"] for e in events(cluster, ns)]
    assert reasons.count("Switched") >= 2 and "SwitchStarted" in reasons
    assert operator.metric("pd_operator_switches_total", direction="decoder-to-prefill", result="Completed") == 1
    assert operator.metric("pd_operator_switches_total", direction="prefill-to-decoder", result="Completed") == 1
    # kubectl shows it
    out = cluster.kubectl("describe", "pdd", "sim-small", "-n", ns).stdout
    assert "Last Switch" in out and "Rebalancing" in out


@pytest.mark.timeout(1800)   # twelve stops, restarts and switches: minutes more on a loaded machine
def test_operator_killed_at_every_step_of_both_directions(cluster: Cluster, fleet: str, operator):
    """The operator exits right after recording each step (a test-only fault point); after a
    restart the switch completes, the links match the roles, and no request fails."""
    ns = fleet
    load = Load(cluster, ns, duration=600)
    time.sleep(2)
    last_at = None
    timings = []
    for step in STEPS:
        for target, direction, to, links in ((3, "decoder-to-prefill", "prefill", "3/3"),
                                             (2, "prefill-to-decoder", "decoder", "4/4")):
            operator.stop()
            operator.start(PD_OPERATOR_FAULT_POINT=f"{direction}:{step}")
            t0 = time.monotonic()
            set_prefill(cluster, ns, target)
            assert operator.wait_exit(180) == 17, f"the operator did not stop at {direction}:{step}"
            rec = pdd(cluster, ns)["status"]["switches"][0]
            # the status it left names the step, or a later one with this one done (a step can be
            # over when it begins: the decoders may let go of a draining prefill before Unlink)
            assert f"{rec['from']}-to-{rec['to']}" == direction, rec
            assert rec["step"] == step or step in rec.get("stepsMs", {}), rec
            operator.start()
            obj = switched(cluster, ns, to, last_at, links, timeout=180)
            last_at = obj["status"]["lastSwitch"]["at"]
            timings.append(f"{direction}@{step}" + (f" (stopped at {rec['step']})" if rec["step"] != step else "")
                           + f" {time.monotonic() - t0:.1f}s")
            links_match_roles(cluster, ns)
    print("\nkilled at, then completed in: " + ", ".join(timings))
    s = load.stop()
    assert s["failed"] == 0, s["failed_by_reason"]
    assert force_unlinks(cluster, ns) == []


def crash_container(cluster: Cluster, ns: str, pod: str) -> None:
    try:
        agent_post(cluster, ns, pod, "/v1/admin/faults", {"crash": True})
    except Exception:  # noqa: BLE001 - the process may die before it answers
        pass
    wait_for(f"{pod} restarted", lambda: roles(cluster, ns)[pod][3] >= 1, timeout=120)


def test_switching_pod_restarted_mid_switch_comes_back_in_the_right_role(cluster: Cluster, fleet: str, operator):
    """Killed before the switch_role step: back in the old role, the switch resumes. Killed
    after it: back in the new role. A decoder-group pod in the prefill role survives a
    container restart in the prefill role."""
    ns = fleet
    load = Load(cluster, ns, duration=600)
    time.sleep(2)
    # before switch_role: the engine comes back a decoder and the switch carries on
    operator.stop()
    operator.start(PD_OPERATOR_FAULT_POINT="decoder-to-prefill:Unlink")
    set_prefill(cluster, ns, 3)
    assert operator.wait_exit(180) == 17
    pod = pdd(cluster, ns)["status"]["switches"][0]["pod"]
    crash_container(cluster, ns, pod)
    wait_for(f"{pod} back as a decoder", lambda: agent_status(cluster, ns, pod)["role"] == "decoder", timeout=120)
    operator.start()
    obj = switched(cluster, ns, "prefill", None, "3/3", timeout=180)
    assert obj["status"]["lastSwitch"]["pod"] == pod
    links_match_roles(cluster, ns)

    # a prefill-role pod of the decoder group survives a container restart as a prefill. This
    # kill is not drained: requests whose KV cache waits on it when it dies may fail
    before = agent_status(cluster, ns, pod)["load"]
    kill_from = time.time()
    try:
        agent_post(cluster, ns, pod, "/v1/admin/faults", {"crash": True})
    except Exception:  # noqa: BLE001 - the process may die before it answers
        pass
    kill_to = time.time()
    wait_for(f"{pod} restarted", lambda: roles(cluster, ns)[pod][3] >= 2, timeout=120)
    wait_for(f"{pod} back", lambda: agent_status(cluster, ns, pod)["initialized"], timeout=120)
    assert agent_status(cluster, ns, pod)["role"] == "prompt"
    wait_phase(cluster, ns, "Ready", timeout=180, extra=lambda o: o["status"]["linksSummary"] == "3/3")
    links_match_roles(cluster, ns)
    assert roles(cluster, ns)[pod][0] == "prefill"

    # after switch_role (recorded Relink): the engine comes back in its new role, a decoder
    last_at = pdd(cluster, ns)["status"]["lastSwitch"]["at"]
    operator.stop()
    operator.start(PD_OPERATOR_FAULT_POINT="prefill-to-decoder:Relink")
    set_prefill(cluster, ns, 2)
    assert operator.wait_exit(180) == 17
    pod2 = pdd(cluster, ns)["status"]["switches"][0]["pod"]
    assert pod2 == pod
    restarts = roles(cluster, ns)[pod][3]
    try:
        agent_post(cluster, ns, pod, "/v1/admin/faults", {"crash": True})
    except Exception:  # noqa: BLE001
        pass
    wait_for(f"{pod} restarted", lambda: roles(cluster, ns)[pod][3] > restarts, timeout=120)
    wait_for(f"{pod} back as a decoder", lambda: agent_status(cluster, ns, pod)["role"] == "decoder", timeout=120)
    operator.start()
    switched(cluster, ns, "decoder", last_at, "4/4", timeout=180)
    links_match_roles(cluster, ns)
    s = load.stop()
    # the kills mid-switch hit drained containers: nothing in flight there. The one undrained kill
    # (a serving prefill) may fail the requests whose caches waited on it, and nothing else: only
    # pulls from that prefill, at most what it held when it died (plus what arrived while the
    # kill was being sent: on a loaded machine that can take seconds, so the bound is every request
    # in flight at some moment of the kill, as the load generator timed them)
    racing = load.in_flight(kill_from, kill_to)
    print(f"\ncontainer kills: failed {s['failed']} {s['failed_by_reason']}; the undrained prefill held "
          f"{before['in_flight']} in flight and {before['pending_kv']} caches when killed; {racing} requests were "
          f"in flight while the kill was sent")
    assert set(s["failed_by_reason"]) <= {"LLM_WAIT_PROCESS_TIMEOUT", "LLM_LINK_FAILED", "LLM_NOT_YET_LINK",
                                          "LLM_KV_CACHE_NOT_EXIST"}, s["failed_by_reason"]
    assert s["failed"] <= max(before["in_flight"] + before["pending_kv"] + 2, racing), s


def test_drain_timeout_aborts_the_switch_and_fails_nothing(cluster: Cluster, namespace: str, operator):
    ns = namespace
    rebalance = {**REBALANCE, "drainTimeoutSeconds": 2, "cooldownSeconds": 600}
    cluster.apply(sample(**TRAFFIC_SPEC, rebalance=rebalance), ns)
    wait_phase(cluster, ns, "Ready", timeout=120, extra=lambda o: o["status"]["linksSummary"] == "4/4")
    # one long decode on each decoder, so whichever is chosen cannot drain in 2 s
    results = []

    def long_request(i: int, decoder: str) -> None:
        req = 7000 + i
        p = agent_post(cluster, ns, "sim-small-prefill-0", "/v1/prefill", {"req_id": req, "prompt_tokens": 64})
        results.append(agent_post(cluster, ns, decoder, "/v1/decode", {
            "req_id": req, "prompt_cluster_id": p["prompt_cluster_id"], "prompt_tokens": 64,
            "output_tokens": 600}))
    threads = [threading.Thread(target=long_request, args=(i, f"sim-small-decoder-{i}")) for i in range(2)]
    for t in threads:
        t.start()
    wait_for("both decoders busy", lambda: all(agent_status(cluster, ns, f"sim-small-decoder-{i}")["load"]["in_flight"]
                                               for i in range(2)), timeout=20)
    set_prefill(cluster, ns, 3)
    obj = wait_for("the switch aborted", lambda: (o := pdd(cluster, ns))["status"].get("lastSwitch", {}).get(
        "result") == "Aborted" and o, timeout=30)
    last = obj["status"]["lastSwitch"]
    assert "drain timed out after 2s with 1 requests in flight" in last["message"], last
    wait_phase(cluster, ns, "Ready", timeout=30, extra=lambda o: o["status"]["linksSummary"] == "4/4")
    links_match_roles(cluster, ns)
    rb = wait_for("cooldown recorded", lambda: pdd(cluster, ns)["status"]["conditions"], timeout=5)
    reb = next(c for c in rb if c["type"] == "Rebalancing")
    assert reb["status"] == "False" and reb["reason"] == "Cooldown", reb
    aborted = [e for e in events(cluster, ns) if e["reason"] == "SwitchAborted"]
    assert aborted and "1 requests in flight" in aborted[0]["message"]
    for t in threads:
        t.join(60)
    assert len(results) == 2 and all(r["tokens"] == 600 for r in results), "the drained requests finished"
