"""The operator as a real process against the local control plane and real agent pods."""
from __future__ import annotations

import json

import pytest

from tests.conftest import Cluster, wait_for
from tests.integration.conftest import condition, events, pdd, sample, wait_phase

pytestmark = pytest.mark.integration


def statefulsets(cluster: Cluster, ns: str) -> dict[str, dict]:
    return {s["metadata"]["name"]: s for s in cluster.get_json("statefulsets", "-n", ns)["items"]}


def test_sim_small_lifecycle(cluster: Cluster, namespace: str, operator) -> None:
    ns = namespace
    cluster.apply(sample(), ns)
    obj = wait_phase(cluster, ns, "Ready", extra=lambda o: o["status"]["linksSummary"] == "4/4")

    # children and injected identity
    stss = statefulsets(cluster, ns)
    assert set(stss) == {"sim-small-prefill", "sim-small-decoder"}
    env = {e["name"]: e for e in stss["sim-small-decoder"]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["LLM_DATADIST_PORT"]["value"] == "26000"
    pod = cluster.get_json("pod", "sim-small-decoder-0", "-n", ns)
    assert pod["metadata"]["annotations"]["pdoperator.io/assigned-role"] == "decoder"
    cm = cluster.get_json("configmap", "sim-small-config", "-n", ns)
    assert json.loads(cm["data"]["cacheDesc"]) == {"num_tensors": 8, "shape": [4, 1024, 4, 64],
                                                   "data_type": "DT_FLOAT16"}
    svcs = {s["metadata"]["name"] for s in cluster.get_json("services", "-n", ns)["items"]}
    assert svcs == {"sim-small-prefill", "sim-small-decoder", "sim-small-prefill-role", "sim-small-decoder-role"}

    # status a user reads
    st = obj["status"]
    assert st["prefill"] == 2 and st["decoder"] == 2 and st["links"] == {"expected": 4, "up": 4}
    assert sorted(m["clusterId"] for m in st["members"]) == [0, 1, 1000, 1001]
    assert all(m["ip"].startswith("127.") and m["ready"] for m in st["members"])
    assert st["cacheDesc"]["bytesPerToken"] == 2 * 4 * 4 * 64 * 2
    assert condition(obj, "KVPathVerified")["status"] == "True"
    assert condition(obj, "Ready")["observedGeneration"] == obj["metadata"]["generation"]
    row = cluster.kubectl("get", "pdd", "-n", ns).stdout.splitlines()
    assert row[0].split() == ["NAME", "PHASE", "PREFILL", "DECODER", "LINKS", "AGE"]
    assert row[1].split()[:5] == ["sim-small", "Ready", "2", "2", "4/4"]
    reasons = {e["reason"] for e in events(cluster, ns)}
    assert {"Created", "Linked", "KVPathVerified"} <= reasons

    # a pod's engine reports the injected cluster id
    pod_env = cluster.kubectl("logs", "sim-small-decoder-1", "-n", ns).stdout
    assert "cluster_id 1001" in pod_env

    # scale the decoders and change the image: both roll through
    cluster.kubectl("patch", "pdd", "sim-small", "-n", ns, "--type=merge",
                    "-p", json.dumps({"spec": {"decoder": {"replicas": 3},
                                               "image": "example.com/pd/pd-sim-agent:0.2"}}))
    obj = wait_phase(cluster, ns, "Ready", timeout=150, extra=lambda o: o["status"]["linksSummary"] == "6/6"
                     and o["status"]["observedGeneration"] == o["metadata"]["generation"])
    pods = cluster.get_json("pods", "-n", ns)["items"]
    assert len(pods) == 5
    wait_for("every pod on the new image", lambda: all(
        p["spec"]["containers"][0]["image"].endswith(":0.2") for p in cluster.get_json("pods", "-n", ns)["items"]),
        timeout=120)
    wait_phase(cluster, ns, "Ready", timeout=120, extra=lambda o: o["status"]["linksSummary"] == "6/6")
    assert any(e["reason"] == "Updated" and "replicas" in e["message"] for e in events(cluster, ns))

    # delete: garbage collection removes every child
    cluster.kubectl("delete", "pdd", "sim-small", "-n", ns)
    wait_for("children to be garbage-collected", lambda: not cluster.get_json("statefulsets", "-n", ns)["items"]
             and not cluster.get_json("pods", "-n", ns)["items"]
             and not [s for s in cluster.get_json("services", "-n", ns)["items"]], timeout=90)


def test_image_that_never_starts_is_a_condition(cluster: Cluster, namespace: str, operator) -> None:
    cluster.apply(sample(image="registry.example/unknown-engine:1", **{"decoder.replicas": 1}), namespace)
    obj = wait_phase(cluster, namespace, "Degraded",
                     extra=lambda o: condition(o, "PodsReady").get("reason") == "ImagePullError")
    msg = condition(obj, "PodsReady")["message"]
    assert "unknown-engine" in msg and "sim-small-" in msg
    assert condition(obj, "Ready")["status"] == "False"
    assert operator.proc.poll() is None


def test_restart_mid_reconcile_converges_without_duplicates(cluster: Cluster, namespace: str, operator) -> None:
    ns = namespace
    cluster.apply(sample(), ns)
    wait_for("the first StatefulSet", lambda: statefulsets(cluster, ns))
    operator.kill()
    token_before = cluster.get_json("secret", "sim-small-agent-token", "-n", ns)["metadata"]["uid"]
    operator.start()
    wait_phase(cluster, ns, "Ready", extra=lambda o: o["status"]["linksSummary"] == "4/4")
    operator.kill()  # again, after Ready: a resume must change nothing
    operator.start()
    obj = wait_phase(cluster, ns, "Ready", extra=lambda o: o["status"]["linksSummary"] == "4/4")
    assert set(statefulsets(cluster, ns)) == {"sim-small-prefill", "sim-small-decoder"}
    assert len(cluster.get_json("pods", "-n", ns)["items"]) == 4
    cms = [c["metadata"]["name"] for c in cluster.get_json("configmaps", "-n", ns)["items"]]
    assert sorted(cms) == ["kube-root-ca.crt", "sim-small-config"]
    secrets = cluster.get_json("secret", "sim-small-agent-token", "-n", ns)
    assert secrets["metadata"]["uid"] == token_before
    # every decoder holds exactly the two desired links (no duplicates from the restarts)
    from tests.integration.conftest import agent_status
    for m in obj["status"]["members"]:
        if m["group"] == "decoder":
            assert m["links"] == {"expected": 2, "up": 2} and "failingLinks" not in m
            assert sorted(l["cluster_id"] for l in agent_status(cluster, ns, m["pod"])["links"]) == [0, 1]
    sts = cluster.get_json("statefulset", "sim-small-prefill", "-n", ns, "--show-managed-fields")
    managers = {f["manager"] for f in sts["metadata"]["managedFields"] if f["operation"] == "Apply"}
    assert managers == {"pd-operator"}


def test_model_change_rolls_pods_onto_the_new_cache_desc(cluster: Cluster, namespace: str, operator) -> None:
    from tests.integration.conftest import agent_status
    ns = namespace
    cluster.apply(sample(**{"prefill.replicas": 1, "decoder.replicas": 1}), ns)
    wait_phase(cluster, ns, "Ready", extra=lambda o: o["status"]["linksSummary"] == "1/1")
    cluster.kubectl("patch", "pdd", "sim-small", "-n", ns, "--type=merge",
                    "-p", '{"spec":{"model":{"kvCache":{"numLayers":8}}}}')
    obj = wait_phase(cluster, ns, "Ready", timeout=120, extra=lambda o: o["status"]["cacheDesc"]["numTensors"] == 16
                     and o["status"]["linksSummary"] == "1/1" and all(
                         agent_status(cluster, ns, m["pod"])["cache_desc"]["num_tensors"] == 16
                         for m in o["status"]["members"]))
    assert json.loads(cluster.get_json("configmap", "sim-small-config", "-n", ns)["data"]["cacheDesc"])[
        "num_tensors"] == 16
    assert condition(obj, "KVPathVerified")["status"] == "True"


def test_sigterm_shuts_down_cleanly(cluster: Cluster, namespace: str, operator) -> None:
    cluster.apply(sample(**{"prefill.replicas": 1, "decoder.replicas": 1}), namespace)
    wait_phase(cluster, namespace, "Ready", extra=lambda o: o["status"]["linksSummary"] == "1/1")
    assert operator.stop() == 0
    assert "pd-operator stopped" in operator.logs()
    # the engines keep serving without the operator: links are state in the agents, not in it
    obj = pdd(cluster, namespace)
    dec = next(m for m in obj["status"]["members"] if m["group"] == "decoder")
    from tests.integration.conftest import agent_status
    assert [l["code"] for l in agent_status(cluster, namespace, dec["pod"])["links"]] == ["LLM_SUCCESS"]
