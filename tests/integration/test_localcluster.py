"""The local control plane and node agent behave like a small real cluster."""
from __future__ import annotations

import ipaddress
import json
import os
import textwrap

import httpx
import pytest

from tests.conftest import Cluster, wait_for

pytestmark = pytest.mark.integration

AGENT_IMAGE = "example.com/pd/pd-sim-agent:dev"
NPU = "huawei.com/Ascend910"
NPUS_PER_NODE = os.environ.get("PD_LOCAL_NPUS_PER_NODE", "32")
ASCEND_ANNOTATION = "ascend.kubectl.kubernetes.io/ascend-910-configuration"


def statefulset(name: str, replicas: int) -> dict:
    return {
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas, "serviceName": name, "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "terminationGracePeriodSeconds": 5,
                    "containers": [{
                        "name": "agent", "image": AGENT_IMAGE,
                        "env": [{"name": "LLM_DATADIST_CLUSTER_ID", "value": "0"}],
                        "ports": [{"name": "http", "containerPort": 8080}],
                        "readinessProbe": {"httpGet": {"path": "/healthz", "port": "http"},
                                           "periodSeconds": 1},
                    }],
                },
            },
        },
    }


def pods(cluster: Cluster, ns: str, selector: str) -> list[dict]:
    return cluster.get_json("pods", "-n", ns, "-l", selector)["items"]


def ready(pod: dict) -> bool:
    return pod["status"].get("phase") == "Running" and any(
        c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))


def answers(ip: str) -> bool:
    try:
        return httpx.get(f"http://{ip}:8080/healthz", timeout=2, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def test_version_and_nodes(cluster: Cluster) -> None:
    version = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == "v1.36.3"
    assert version["clientVersion"]["gitVersion"] == "v1.36.3"
    nodes = cluster.get_json("nodes")["items"]
    assert len(nodes) >= 3
    for n in nodes:
        assert n["status"]["capacity"][NPU] == NPUS_PER_NODE
        assert any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"]["conditions"])


def test_statefulset_pods_scale_and_gc(cluster: Cluster, namespace: str) -> None:
    cluster.apply(statefulset("web", 3), namespace)
    running = wait_for("3 Running+Ready pods", lambda: (
        p if len(p := pods(cluster, namespace, "app=web")) == 3 and all(map(ready, p)) else None),
        timeout=90)
    ips = {p["status"]["podIP"] for p in running}
    assert len(ips) == 3, ips
    assert all(ip.startswith("127.") for ip in ips)
    for ip in ips:
        assert answers(ip), f"pod at {ip} does not answer HTTP"

    cluster.kubectl("scale", "statefulset/web", "-n", namespace, "--replicas=1")
    left = wait_for("one pod left", lambda: (
        p if len(p := pods(cluster, namespace, "app=web")) == 1 else None), timeout=60)
    gone = ips - {left[0]["status"]["podIP"]}
    assert len(gone) == 2
    wait_for("the two scaled-down processes to stop", lambda: not any(answers(ip) for ip in gone))
    assert answers(left[0]["status"]["podIP"])

    cluster.kubectl("delete", "statefulset/web", "-n", namespace, "--cascade=background")
    wait_for("garbage collection of the pods", lambda: pods(cluster, namespace, "app=web") == [],
             timeout=60)
    wait_for("the last process to stop", lambda: not answers(left[0]["status"]["podIP"]))


def test_a_pod_marked_not_ready_by_someone_else_is_reported_ready_again(cluster: Cluster, namespace: str) -> None:
    """After an API-server outage the node lifecycle controller marks the pods of nodes whose
    heartbeats it missed not Ready; the node agent, like the kubelet, writes its own view back."""
    cluster.apply(statefulset("web", 1), namespace)
    wait_for("a Ready pod", lambda: (p if len(p := pods(cluster, namespace, "app=web")) == 1 and ready(p[0])
                                     else None), timeout=90)
    cluster.kubectl("patch", "pod", "web-0", "-n", namespace, "--subresource=status", "--type=strategic", "-p",
                    json.dumps({"status": {"conditions": [{"type": "Ready", "status": "False",
                                                           "reason": "NodeNotReady"}]}}))
    wait_for("the pod Ready again", lambda: ready(cluster.get_json("pod", "web-0", "-n", namespace)), timeout=30)


def test_crashing_container_is_restarted(cluster: Cluster, namespace: str) -> None:
    cluster.apply({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "crasher"},
        "spec": {"containers": [{
            "name": "main", "image": AGENT_IMAGE,
            "command": ["python", "-c", "import sys; print('about to fail'); sys.exit(3)"],
        }]},
    }, namespace)

    def restarted():
        st = cluster.get_json("pod", "crasher", "-n", namespace)["status"]
        cs = (st.get("containerStatuses") or [{}])[0]
        return cs if cs.get("restartCount", 0) >= 2 else None

    cs = wait_for("restartCount to reach 2", restarted, timeout=60)
    assert cs["lastState"]["terminated"]["exitCode"] == 3
    assert cs["lastState"]["terminated"]["reason"] == "Error"
    out = cluster.kubectl("logs", "crasher", "-n", namespace, "--previous").stdout
    assert "about to fail" in out


def test_unknown_image_reports_waiting_reason(cluster: Cluster, namespace: str) -> None:
    cluster.apply({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "unknown"},
        "spec": {"containers": [{"name": "main", "image": "docker.io/library/busybox:1.36"}]},
    }, namespace)

    def waiting():
        st = cluster.get_json("pod", "unknown", "-n", namespace)["status"]
        return ((st.get("containerStatuses") or [{}])[0].get("state") or {}).get("waiting")

    w = wait_for("a waiting reason", lambda: (w if (w := waiting()) and "message" in w else None))
    assert w["reason"] in ("ErrImagePull", "ImagePullBackOff")
    assert "busybox" in w["message"] and "not available" in w["message"]
    assert cluster.get_json("pod", "unknown", "-n", namespace)["status"]["phase"] == "Pending"
    events = cluster.get_json("events", "-n", namespace, "--field-selector",
                              "involvedObject.name=unknown")["items"]
    assert any(e["reason"] == "Failed" and "busybox" in e["message"] for e in events)


ENV_DUMP = textwrap.dedent("""
    import json, os, time
    keys = ["LITERAL", "EXPANDED", "POD_NAME", "POD_NS", "POD_IP", "ROLE", "FROM_CM", "FROM_SECRET",
            "PD_LOCAL_POD_IP", "CM_PREFIX_a"]
    print(json.dumps({k: os.environ.get(k) for k in keys}), flush=True)
    time.sleep(3600)
""")


def test_env_resolution_and_logs(cluster: Cluster, namespace: str) -> None:
    cluster.kubectl("create", "configmap", "cfg", "-n", namespace, "--from-literal=k=from-configmap",
                    "--from-literal=a=1")
    cluster.kubectl("create", "secret", "generic", "sec", "-n", namespace, "--from-literal=s=s3cret")
    cluster.apply({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "envpod", "labels": {"pdoperator.io/role": "decoder"}},
        "spec": {"containers": [{
            "name": "main", "image": AGENT_IMAGE, "command": ["python", "-c", ENV_DUMP],
            "envFrom": [{"configMapRef": {"name": "cfg"}, "prefix": "CM_PREFIX_"}],
            "env": [
                {"name": "LITERAL", "value": "plain"},
                {"name": "EXPANDED", "value": "$(LITERAL)-x"},
                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "POD_NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "ROLE", "valueFrom": {"fieldRef": {
                    "fieldPath": "metadata.labels['pdoperator.io/role']"}}},
                {"name": "FROM_CM", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "k"}}},
                {"name": "FROM_SECRET", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "s"}}},
            ],
        }]},
    }, namespace)
    pod = wait_for("envpod running", lambda: (
        p if (p := cluster.get_json("pod", "envpod", "-n", namespace))["status"].get("phase") == "Running"
        else None))
    line = wait_for("the env dump in kubectl logs", lambda: cluster.kubectl(
        "logs", "envpod", "-n", namespace).stdout.strip())
    env = json.loads(line.splitlines()[0])
    assert env == {
        "LITERAL": "plain", "EXPANDED": "plain-x", "POD_NAME": "envpod", "POD_NS": namespace,
        "POD_IP": pod["status"]["podIP"], "ROLE": "decoder", "FROM_CM": "from-configmap",
        "FROM_SECRET": "s3cret", "PD_LOCAL_POD_IP": pod["status"]["podIP"], "CM_PREFIX_a": "1",
    }


def test_missing_configmap_is_a_config_error(cluster: Cluster, namespace: str) -> None:
    cluster.apply({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "nocm"},
        "spec": {"containers": [{"name": "main", "image": AGENT_IMAGE, "env": [
            {"name": "X", "valueFrom": {"configMapKeyRef": {"name": "absent", "key": "k"}}}]}]},
    }, namespace)
    # The first status the node writes is ContainerCreating; wait past it for the config error.
    def waiting() -> dict | None:
        cs = cluster.get_json("pod", "nocm", "-n", namespace)["status"].get("containerStatuses") or [{}]
        w = cs[0].get("state", {}).get("waiting") or {}
        return w if w.get("reason") not in (None, "ContainerCreating") else None

    w = wait_for("CreateContainerConfigError", waiting)
    assert w["reason"] == "CreateContainerConfigError"
    assert "absent" in w["message"]


RBAC_PROBE = textwrap.dedent("""
    from kubernetes import client, config
    config.load_kube_config()
    try:
        n = len(client.CoreV1Api().list_namespaced_pod("{ns}").items)
        print("LISTED", n, flush=True)
    except client.ApiException as e:
        print("DENIED", e.status, flush=True)
""")


def test_pod_api_access_is_its_service_account_rbac(cluster: Cluster, namespace: str) -> None:
    cluster.kubectl("create", "serviceaccount", "op", "-n", namespace)
    pod = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "probe-denied"},
        "spec": {"serviceAccountName": "op", "restartPolicy": "Never", "containers": [{
            "name": "main", "image": "example.com/pd/pd-operator:dev",
            "command": ["python", "-c", RBAC_PROBE.replace("{ns}", namespace)]}]},
    }
    cluster.apply(pod, namespace)
    wait_for("probe-denied to finish", lambda: cluster.get_json(
        "pod", "probe-denied", "-n", namespace)["status"].get("phase") == "Succeeded")
    assert "DENIED 403" in cluster.kubectl("logs", "probe-denied", "-n", namespace).stdout

    cluster.kubectl("create", "role", "pod-reader", "-n", namespace, "--verb=list", "--resource=pods")
    cluster.kubectl("create", "rolebinding", "op-reader", "-n", namespace, "--role=pod-reader",
                    f"--serviceaccount={namespace}:op")
    pod["metadata"]["name"] = "probe-allowed"
    cluster.apply(pod, namespace)
    wait_for("probe-allowed to finish", lambda: cluster.get_json(
        "pod", "probe-allowed", "-n", namespace)["status"].get("phase") == "Succeeded")
    assert "LISTED" in cluster.kubectl("logs", "probe-allowed", "-n", namespace).stdout


def test_logs_follow_ends_with_the_container(cluster: Cluster, namespace: str) -> None:
    cluster.apply({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "talker"},
        "spec": {"restartPolicy": "Never", "containers": [{
            "name": "main", "image": AGENT_IMAGE,
            "command": ["python", "-c", "import time\nfor i in range(5):\n print('line', i, flush=True)\n"
                                        " time.sleep(0.4)"]}]},
    }, namespace)
    wait_for("talker running", lambda: cluster.get_json("pod", "talker", "-n", namespace)["status"].get("phase")
             in ("Running", "Succeeded"))
    out = cluster.kubectl("logs", "-f", "talker", "-n", namespace, timeout=30).stdout
    assert out.splitlines() == [f"line {i}" for i in range(5)]
    assert cluster.kubectl("logs", "talker", "-n", namespace, "--tail=2").stdout.splitlines() == ["line 3", "line 4"]


NPU_WATCHER = textwrap.dedent("""
    import json, os, time
    # a mounted path resolves under PD_LOCAL_ROOT when the pod runs as a local process
    path = os.environ.get("PD_LOCAL_ROOT", "") + "/etc/ascend/npu"
    last = None
    while True:
        with open(path) as f:
            text = f.read()
        if text != last:
            print(json.dumps({"visible": os.environ.get("ASCEND_VISIBLE_DEVICES"), "npu": text}), flush=True)
            last = text
        time.sleep(0.2)
""")


def test_npus_are_allocated_annotated_and_follow_a_downward_api_volume(cluster: Cluster, namespace: str) -> None:
    cluster.apply({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "npu"},
        "spec": {
            "terminationGracePeriodSeconds": 2,
            "volumes": [{"name": "ascend", "downwardAPI": {"items": [
                {"path": "npu", "fieldRef": {"fieldPath": f"metadata.annotations['{ASCEND_ANNOTATION}']"}}]}}],
            "containers": [{
                "name": "main", "image": AGENT_IMAGE, "command": ["python", "-c", NPU_WATCHER],
                "resources": {"limits": {NPU: 2}},
                "volumeMounts": [{"name": "ascend", "mountPath": "/etc/ascend", "readOnly": True}],
            }],
        },
    }, namespace)
    pod = wait_for("the pod to run with its NPU annotation", lambda: (
        p if (p := cluster.get_json("pod", "npu", "-n", namespace))["status"].get("phase") == "Running"
        and ASCEND_ANNOTATION in p["metadata"].get("annotations", {}) else None))
    value = pod["metadata"]["annotations"][ASCEND_ANNOTATION]
    conf = json.loads(value)
    assert conf["pod_name"] == "npu" and conf["server_id"] == pod["status"]["hostIP"]
    ids = [d["device_id"] for d in conf["devices"]]
    assert len(ids) == 2 and all(isinstance(i, str) for i in ids)
    assert ids == sorted(ids, key=int)
    ips = [d["device_ip"] for d in conf["devices"]]
    assert len(set(ips)) == 2 and all(ipaddress.ip_address(ip).is_loopback for ip in ips)
    assert pod["status"]["podIP"] not in ips

    node = cluster.get_json("node", pod["spec"]["nodeName"])
    assert node["status"]["capacity"][NPU] == NPUS_PER_NODE
    assert node["status"]["allocatable"][NPU] == NPUS_PER_NODE

    def seen() -> list[dict]:
        return [json.loads(line) for line in cluster.kubectl("logs", "npu", "-n", namespace).stdout.splitlines()]

    first = wait_for("the container to print the annotation from its volume",
                     lambda: (s[0] if (s := seen()) else None))
    assert first == {"visible": ",".join(ids), "npu": value}

    changed = json.dumps({"pod_name": "npu", "server_id": conf["server_id"], "devices": conf["devices"][:1]})
    cluster.kubectl("annotate", "--overwrite", "pod/npu", "-n", namespace, f"{ASCEND_ANNOTATION}={changed}")
    wait_for("the volume file to follow the annotation", lambda: seen()[-1]["npu"] == changed, timeout=10)
