"""An engine pod as a real inference server needs it: weights on a PersistentVolumeClaim, shared
memory, a pull secret, a toleration, a custom command and env from a Secret; the deployment
becomes Ready, links, verifies the KV path and serves completions equal to one engine's. A
claim that is not bound keeps the pods from being scheduled, and the deployment says so."""
from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import Cluster
from tests.integration.conftest import condition, events, keys_secret, wait_phase
from tests.integration.test_content import (
    KEY,
    NPU,
    Checker,
    assert_all_match,
    gateway_url,
    one_engine,
    prompts,
    reference_doc,
)
from tests.integration.test_switching import REBALANCE, set_prefill, switched

pytestmark = pytest.mark.integration

TOLERATION = {"key": "huawei.com/Ascend910", "operator": "Exists", "effect": "NoSchedule"}


@pytest.fixture
def volumes(cluster: Cluster):
    """The PersistentVolumes a test made (cluster-scoped: the namespace's deletion leaves them)."""
    made: list[str] = []
    yield made
    for pv in made:
        cluster.kubectl("delete", "pv", pv, "--ignore-not-found", "--wait=false", check=False)


def weights_volume(cluster: Cluster, ns: str, tmp_path: Path, claim: str, made: list[str],
                   bind: bool = True) -> Path:
    """A statically provisioned PersistentVolume (a directory of this machine) and its claim."""
    store = tmp_path / f"store-{claim}"
    store.mkdir()
    (store / "weights.txt").write_text("seeded weights\n")
    pv = f"pv-{uuid.uuid4().hex[:8]}"
    if bind:
        made.append(pv)
        cluster.apply({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
                       "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadOnlyMany"],
                                "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
                                "claimRef": {"namespace": ns, "name": claim},
                                "hostPath": {"path": str(store), "type": "Directory"}}})
    cluster.apply({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim},
                   "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "",
                            "resources": {"requests": {"storage": "1Gi"}}, **({"volumeName": pv} if bind else {})}},
                  ns)
    return store


def open_template(claim: str) -> dict:
    return {
        "command": ["python3", "-m", "pd_agent"],
        "env": [{"name": "ENGINE_API_KEY", "valueFrom": {"secretKeyRef": {"name": "engine-env", "key": "apiKey"}}},
                {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
        "volumes": [{"name": "weights", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}},
                    {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Mi"}}],
        "volumeMounts": [{"name": "weights", "mountPath": "/models", "readOnly": True},
                         {"name": "shm", "mountPath": "/dev/shm"}],
        "imagePullSecrets": [{"name": "registry-pull"}],
        "tolerations": [TOLERATION],
        "priorityClassName": "",
    }


def secrets(cluster: Cluster, ns: str) -> None:
    cluster.kubectl("create", "secret", "generic", "engine-env", "-n", ns, "--from-literal=apiKey=k-123")
    auth = {"auths": {"registry.example.com": {"auth": "dXNlcjpwYXNz"}}}
    cluster.kubectl("create", "secret", "generic", "registry-pull", "-n", ns, "--type=kubernetes.io/dockerconfigjson",
                    f"--from-literal=.dockerconfigjson={json.dumps(auth)}")


def test_an_engine_with_weights_on_a_claim_shm_a_pull_secret_and_its_own_command_serves(
        cluster: Cluster, namespace: str, operator, tmp_path: Path, volumes: list[str]) -> None:
    ns = namespace
    secrets(cluster, ns)
    weights_volume(cluster, ns, tmp_path, "weights", volumes)
    keys_secret(cluster, ns, **{"team-a": KEY})
    doc = reference_doc(1, 1)
    for g in ("prefill", "decoder"):
        tpl = open_template("weights")
        tpl.pop("priorityClassName")
        doc["spec"][g].update(tpl)
    cluster.apply(doc, ns)
    wait_phase(cluster, ns, "Ready", timeout=180, extra=lambda o: o["status"]["linksSummary"] == "4/4"
               and condition(o, "KVContentMismatch").get("status") == "False")

    # what the pods were given, as a user would check it
    pod = cluster.get_json("pod", "sim-small-decoder-0", "-n", ns)
    spec = pod["spec"]
    engine = spec["containers"][0]
    assert engine["command"] == ["python3", "-m", "pd_agent"]
    assert {"name": "registry-pull"} in spec["imagePullSecrets"]
    assert TOLERATION in spec["tolerations"]
    assert {"name": "weights", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in spec["volumes"]
    assert any(v["name"] == "shm" and v["emptyDir"].get("medium") == "Memory" for v in spec["volumes"])
    mounts = {m["mountPath"]: m["name"] for m in engine["volumeMounts"]}
    assert mounts["/models"] == "weights" and mounts["/dev/shm"] == "shm"
    assert {"name": "ENGINE_API_KEY", "valueFrom": {"secretKeyRef": {"name": "engine-env", "key": "apiKey"}}} \
        in engine["env"]
    # the operator's own env is still there, after the user's
    names = [e["name"] for e in engine["env"]]
    assert "LLM_DATADIST_CLUSTER_ID_BASE" in names and "PD_AGENT_TOKEN" in names

    # serves: completions through pd-gateway equal one engine's decode
    check = Checker(gateway_url(cluster, ns), one_engine(doc))
    assert_all_match(check.run(prompts(12, seed=5), workers=4))


def test_an_inference_server_image_beside_the_agent_links_verifies_serves_and_switches_live(
        cluster: Cluster, namespace: str, operator, tmp_path: Path, volumes: list[str]) -> None:
    """spec.engine: the reference engine packaged as an ordinary inference server (its ranks call
    serve_rank and know nothing else of pd-operator) runs in container `engine` beside the agent,
    with the weights claim, shm, pull secret, toleration and a command of its own; MLA at TP 2, so
    its two rank processes register with the agent, are linked rank to rank and verified by content.
    A live switch of one of its engines (prefill -> decoder, through the adapter's switch hooks)
    fails and changes no answer while completions are checked against one engine's."""
    ns = namespace
    secrets(cluster, ns)
    weights_volume(cluster, ns, tmp_path, "weights", volumes)
    keys_secret(cluster, ns, **{"team-a": KEY})
    doc = reference_doc(2, 2, attention="MLA", rebalance=REBALANCE)
    doc["spec"]["engine"] = {"image": "registry.example.com/pd/pd-reference-engine:0.1"}
    for g, n in (("prefill", 2), ("decoder", 1)):
        tpl = open_template("weights")
        tpl.pop("priorityClassName")
        tpl["command"] = ["python3", "-m", "pd_engine.reference_server", "--tensor-parallel", "2"]
        doc["spec"][g].update(tpl, replicas=n)
    cluster.apply(doc, ns)
    # one decoder x two prefills x two ranks
    wait_phase(cluster, ns, "Ready", timeout=240, extra=lambda o: o["status"]["linksSummary"] == "4/4"
               and condition(o, "KVContentMismatch").get("status") == "False"
               and condition(o, "KVPathVerified").get("status") == "True")

    spec = cluster.get_json("pod", "sim-small-decoder-0", "-n", ns)["spec"]
    agent, engine = spec["containers"]
    assert (agent["name"], engine["name"]) == ("agent", "engine")
    assert engine["image"].endswith("/pd-reference-engine:0.1") and engine["command"][2] == "pd_engine.reference_server"
    assert "command" not in agent and {"name": "PD_RANKS_EXTERNAL", "value": "1"} in agent["env"]
    # the group's env, mounts and NPUs are the engine's; the agent keeps the operator's
    assert any(e["name"] == "ENGINE_API_KEY" for e in engine["env"])
    assert not any(e["name"] == "ENGINE_API_KEY" for e in agent["env"])
    assert {m["mountPath"] for m in engine["volumeMounts"]} >= {"/models", "/dev/shm"}
    assert "/models" not in {m["mountPath"] for m in agent["volumeMounts"]}
    assert str(engine["resources"]["limits"][NPU]) == "2" and NPU not in agent["resources"]["limits"]
    assert {"name": "registry-pull"} in spec["imagePullSecrets"] and TOLERATION in spec["tolerations"]
    # both rank processes of each pod are the engine container's, registered with the agent
    st = cluster.get_json("pddeployment", "sim-small", "-n", ns)["status"]
    for m in st["members"]:
        assert m["ranks"]["tensorParallel"] == 2 and m["ranks"]["initialized"] == 2, m

    check = Checker(gateway_url(cluster, ns, decoders=1), one_engine(doc))
    assert_all_match(check.run(prompts(12, seed=7), workers=4))

    # a live switch, completions checked all along
    window: list[float] = []
    with check.running(seed=2000):
        time.sleep(2)
        window.append(time.time())
        set_prefill(cluster, ns, 1)
        switched(cluster, ns, "decoder", None, "4/4", timeout=150)   # two decoders x one prefill x two ranks
        window.append(time.time())
        time.sleep(2)
    c = check.summary()
    print(f"\nthrough the switch of an engine beside the agent: {c['requests']} content checks, {c}")
    assert c["failed"] == 0 and c["mismatched"] == 0, c
    assert [r for r in check.results if r["sent_at"] <= window[1] and r["done_at"] >= window[0]], \
        "no content check ran during the switch"


def test_an_unbound_claim_keeps_the_pods_from_starting_and_says_so(
        cluster: Cluster, namespace: str, operator, tmp_path: Path, volumes: list[str]) -> None:
    ns = namespace
    secrets(cluster, ns)
    weights_volume(cluster, ns, tmp_path, "nothing-bound", volumes, bind=False)
    doc = reference_doc(1, 1)
    doc["spec"].pop("gateway")
    for g in ("prefill", "decoder"):
        doc["spec"][g].update({k: v for k, v in open_template("nothing-bound").items() if k != "priorityClassName"})
    cluster.apply(doc, ns)
    # the scheduler holds the pods back; the deployment says why, in the scheduler's words
    obj = wait_phase(cluster, ns, "Pending", timeout=120, extra=lambda o: condition(o, "PodsReady").get(
        "reason") == "Unschedulable")
    assert "unbound" in condition(obj, "PodsReady")["message"], condition(obj, "PodsReady")
    pod = cluster.get_json("pod", "sim-small-prefill-0", "-n", ns)
    assert not any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))
    assert operator.proc.poll() is None
    assert not any(e["reason"] == "Linked" for e in events(cluster, ns))
