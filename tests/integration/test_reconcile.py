"""The one reconcile: drift repaired, no ghosts after a watch gap, no spinning on a failing
agent, bad members contained, deployments independent, and links only between engines
that run the same CacheDesc."""
from __future__ import annotations

import json
import threading
import time

import pytest
import yaml

from tests.conftest import Cluster, wait_for
from tests.integration.conftest import condition, events, pdd, sample, wait_phase

pytestmark = pytest.mark.integration
SMALL = {"prefill.replicas": 1, "decoder.replicas": 1}


def members(obj: dict) -> dict[str, dict]:
    return {m["pod"]: m for m in obj.get("status", {}).get("members", [])}


def stray_pod(cluster: Cluster, ns: str, name: str, labels: dict, env: dict | None = None,
              probe_port: int | None = None) -> dict:
    """A pod that carries the deployment's labels but is not one of its StatefulSets' pods:
    another controller owns it, so the StatefulSet controller does not adopt (and delete) it."""
    owner = cluster.get_json("configmap", "kube-root-ca.crt", "-n", ns)["metadata"]
    env = {"LLM_DATADIST_CLUSTER_ID": "77", **(env or {})}
    container = {"name": "agent", "image": "example.com/pd/pd-sim-agent:0.1",
                 "env": [{"name": k, "value": v} for k, v in env.items()]}
    if probe_port:
        container["readinessProbe"] = {"httpGet": {"path": "/healthz", "port": probe_port}, "periodSeconds": 1}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {"pdoperator.io/deployment": "sim-small", **labels},
                         "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": owner["name"],
                                              "uid": owner["uid"], "controller": True}]},
            "spec": {"containers": [container], "terminationGracePeriodSeconds": 1}}


def test_drift_is_repaired_within_one_resync(cluster: Cluster, namespace: str, operator) -> None:
    ns = namespace
    cluster.apply(sample(), ns)
    wait_phase(cluster, ns, "Ready", extra=lambda o: o["status"]["linksSummary"] == "4/4")
    cluster.kubectl("delete", "service", "sim-small-prefill", "-n", ns)
    cluster.kubectl("delete", "configmap", "sim-small-config", "-n", ns)
    cluster.kubectl("scale", "statefulset", "sim-small-decoder", "-n", ns, "--replicas=5")
    t0 = time.monotonic()
    wait_for("children back to the spec", lambda: (
        cluster.kubectl("get", "service", "sim-small-prefill", "-n", ns, check=False).returncode == 0
        and cluster.kubectl("get", "configmap", "sim-small-config", "-n", ns, check=False).returncode == 0
        and cluster.get_json("statefulset", "sim-small-decoder", "-n", ns)["spec"]["replicas"] == 2), timeout=15)
    print(f"\ndrift repaired in {time.monotonic() - t0:.2f}s")
    wait_phase(cluster, ns, "Ready", extra=lambda o: o["status"]["linksSummary"] == "4/4")
    wait_for("the extra decoders gone", lambda: len(cluster.get_json("pods", "-n", ns)["items"]) == 4, timeout=60)
    assert any(e["reason"] == "DriftRepaired" for e in events(cluster, ns))


def test_no_ghost_after_a_watch_gap(cluster: Cluster, namespace: str, operator, tmp_path) -> None:
    """The operator's connection to the API server is cut while a pod is deleted, and the API
    server restarts meanwhile (its watch cache starts over): the operator's watches cannot
    resume, they list again, and no DELETED ever comes for that pod."""
    from urllib.parse import urlparse

    from pd_localcluster.cluster import LocalCluster
    from tests.netproxy import TcpProxy
    ns = namespace
    kc = yaml.safe_load(cluster.kubeconfig.read_text())
    server = urlparse(kc["clusters"][0]["cluster"]["server"])
    proxy = TcpProxy(server.hostname, server.port)
    try:
        kc["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{proxy.port}"
        (tmp_path / "kubeconfig").write_text(yaml.safe_dump(kc))
        operator.stop()
        operator.kubeconfig = tmp_path / "kubeconfig"
        operator.start()
        cluster.apply(sample(**SMALL), ns)
        cluster.apply(stray_pod(cluster, ns, "sim-small-extra", {"pdoperator.io/group": "decoder"}), ns)
        wait_for("the stray pod as a member", lambda: "sim-small-extra" in members(pdd(cluster, ns)), timeout=90)
        wait_phase(cluster, ns, "Ready", extra=lambda o: o["status"]["linksSummary"] == "1/1")

        proxy.cut()
        cluster.kubectl("delete", "pod", "sim-small-extra", "-n", ns, "--grace-period=0", "--force")
        LocalCluster(cluster.kubeconfig.parent).restart_apiserver()
        proxy.restore()
        t0 = time.monotonic()
        wait_for("the deleted pod to leave status", lambda: "sim-small-extra" not in members(pdd(cluster, ns)),
                 timeout=75)
        print(f"\nghost gone {time.monotonic() - t0:.1f}s after the connection came back")
        wait_phase(cluster, ns, "Ready", extra=lambda o: o["status"]["linksSummary"] == "1/1", timeout=60)
    finally:
        proxy.close()


def test_a_crash_looping_agent_is_backed_off(cluster: Cluster, namespace: str, operator) -> None:
    ns = namespace
    # a decoder whose interpreter cannot start (a bad PYTHONHOME): CrashLoopBackOff, address kept
    cluster.apply(sample(**SMALL, **{"decoder.env": [{"name": "PYTHONHOME", "value": "/nonexistent"}]}), ns)
    wait_for("a crash loop", lambda: (p := cluster.get_json("pod", "sim-small-decoder-0", "-n", ns))["status"].get(
        "podIP") and p["status"]["containerStatuses"][0]["restartCount"] >= 1, timeout=60)
    unreachable = lambda: operator.metric("pd_operator_agent_calls_total", op="status",  # noqa: E731
                                          result="AgentUnreachable")
    wait_for("the operator to have tried the pod", lambda: unreachable() >= 1, timeout=30)
    c0 = unreachable()
    time.sleep(32)
    calls = unreachable() - c0
    print(f"\nagent calls to the crash-looping pod in 32 s: {calls:.0f}")
    # backoff 1, 2, 4, 8, 16, 30 s (each with jitter down to half): at most one call per step
    assert 1 <= calls <= 8
    assert condition(pdd(cluster, ns), "PodsReady")["reason"] == "CrashLoopBackOff"


def _fake_agent(ip: str, seen: list):
    """An HTTP server on a stray pod's agent address: healthy, and it records every call (and
    whether it carried a bearer token) so the test sees what the operator sent it."""
    import asyncio

    from aiohttp import web

    async def any_call(request):
        seen.append((request.method, request.path, request.headers.get("Authorization", "")))
        if request.path == "/healthz":
            return web.json_response({"ok": True})
        return web.Response(text="<html>proxy error</html>", status=200)
    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", any_call)
    runner = web.AppRunner(app)

    async def start():
        await runner.setup()
        await web.TCPSite(runner, ip, 8080).start()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    return lambda: asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)


def test_pods_that_only_wear_the_labels_are_reported_and_never_asked(cluster: Cluster, namespace: str,
                                                                     operator) -> None:
    """Labels alone do not make a member: pods another controller owns that carry the
    deployment's labels (one without a pod index, one in an unknown group, two prefill-looking
    ones with an agent on 8080) are listed as problems, their agents never get a call (so never
    the operator's token) and no decoder dials them; the real pair converges and verifies."""
    ns = namespace
    cluster.apply(sample(**SMALL), ns)
    wait_phase(cluster, ns, "Ready", extra=lambda o: o["status"]["linksSummary"] == "1/1")
    cluster.apply(stray_pod(cluster, ns, "sim-small-noindex", {"pdoperator.io/group": "decoder"}), ns)
    cluster.apply(stray_pod(cluster, ns, "sim-small-router-0", {"pdoperator.io/group": "router"}), ns)
    stops, seen = [], []
    strays = ("sim-small-noindex", "sim-small-router-0", "sim-small-prefill-8", "sim-small-prefill-9")
    try:
        for name in strays[2:]:
            labels = {"pdoperator.io/group": "prefill", "apps.kubernetes.io/pod-index": name[-1]}
            cluster.apply(stray_pod(cluster, ns, name, labels, env={"PD_AGENT_PORT": "18080"}, probe_port=8080), ns)
            ip = wait_for(f"{name} address", lambda: cluster.get_json("pod", name, "-n", ns)["status"].get("podIP"))
            stops.append(_fake_agent(ip, seen))

        def reported(o):
            m = members(o)
            errs = {k: m.get(k, {}).get("lastError", "") for k in strays}
            return errs if all("not a pod of its StatefulSets" in e for e in errs.values()) else None
        errs = wait_for("each stray pod reported", lambda: reported(pdd(cluster, ns)), timeout=90)
        print("\n" + json.dumps(errs, indent=1))
        time.sleep(6)   # past a settled member's poll and a verification round
        obj = pdd(cluster, ns)
        assert obj["status"]["linksSummary"] == "1/1"
        assert condition(obj, "KVPathVerified")["status"] == "True"
        assert [c for c in seen if c[1] != "/healthz"] == [], "the operator called a stray pod's agent"
        assert not any(auth for _, _, auth in seen)
        assert operator.proc.poll() is None
    finally:
        for stop in stops:
            stop()


def test_one_deployment_timing_out_does_not_hold_up_another(cluster: Cluster, namespace: str, operator) -> None:
    ns = namespace
    slow = sample("slow", **{**SMALL, "decoder.replicas": 2, "datadist.linkTimeoutMs": 20000,
                             "sim": {"faults": {"linkDelayMs": 60000}}})   # a black-holed datadist port
    cluster.apply(slow, ns)
    time.sleep(1)
    cluster.apply(sample("fast", **SMALL), ns)
    fast = wait_phase(cluster, ns, "Ready", name="fast", timeout=60,
                      extra=lambda o: o["status"]["linksSummary"] == "1/1")
    still = pdd(cluster, ns, "slow")
    print(f"\nfast Ready while slow is {still['status'].get('phase')} {still['status'].get('linksSummary')}")
    assert still["status"].get("phase") != "Ready" and still["status"].get("linksSummary") != "2/2"
    assert condition(fast, "KVPathVerified")["status"] == "True"
    wait_phase(cluster, ns, "Degraded", name="slow", timeout=90,
               extra=lambda o: condition(o, "LinksReady").get("reason") == "LinkTimeout")


def _fleet(cluster: Cluster, ns: str) -> dict[str, dict]:
    """Every engine's own report, read straight from the agents."""
    import base64

    import httpx
    token = base64.b64decode(cluster.get_json("secret", "sim-small-agent-token", "-n", ns)["data"]["token"]).decode()
    out = {}
    for p in cluster.get_json("pods", "-n", ns, "-l", "pdoperator.io/deployment=sim-small")["items"]:
        ip = p["status"].get("podIP")
        try:
            out[p["metadata"]["name"]] = httpx.get(f"http://{ip}:8080/v1/status", trust_env=False, timeout=2,
                                                   headers={"Authorization": f"Bearer {token}"}).json()
        except (httpx.HTTPError, ValueError):
            pass  # a pod mid-restart
    return out


def test_a_model_roll_links_only_identical_cache_descs(cluster: Cluster, namespace: str, operator) -> None:
    ns = namespace
    cluster.apply(sample(sim={"engineStartSeconds": 4}), ns)
    wait_phase(cluster, ns, "Ready", extra=lambda o: o["status"]["linksSummary"] == "4/4")
    cluster.kubectl("patch", "pdd", "sim-small", "-n", ns, "--type=merge",
                    "-p", '{"spec":{"model":{"kvCache":{"numLayers":8}}}}')
    mismatch_seen, polls = None, 0
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline:
        obj = pdd(cluster, ns)
        c = condition(obj, "LinksReady")
        if c.get("reason") == "CacheDescMismatch":
            mismatch_seen = c["message"]
        fleet = _fleet(cluster, ns)
        polls += 1
        by_cid = {s["cluster_id"]: s for s in fleet.values() if s.get("initialized")}
        for s in fleet.values():
            for link in s.get("links", []):
                peer = by_cid.get(link["cluster_id"])
                assert peer is None or peer["cache_desc"] == s["cache_desc"], \
                    f"{s['pod']} is linked to {peer['pod']} across CacheDescs"
        if obj["status"].get("phase") == "Ready" and obj["status"]["linksSummary"] == "4/4" and len(fleet) == 4 \
                and all(s["cache_desc"]["num_tensors"] == 16 for s in fleet.values()):
            break
        time.sleep(0.1)
    else:
        pytest.fail("the roll did not finish")
    print(f"\n{polls} polls during the roll; mismatch condition seen: {mismatch_seen}")
    warned = [e["message"] for e in events(cluster, ns) if e["reason"] == "CacheDescMismatch"]
    assert warned and all("sim-small-" in m for m in warned), warned
