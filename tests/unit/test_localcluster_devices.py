"""The local node's device plugin stand-in and its downwardAPI volumes."""
from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from pd_localcluster.devices import (
    ASCEND_ANNOTATION,
    DEFAULT_RESOURCE,
    DeviceAllocator,
    NotEnoughDevices,
    annotation,
    device_ip,
    parse_annotation,
    requested,
    split,
)
from pd_localcluster.nodeagent import IPAllocator
from pd_localcluster.podspec import ConfigError, downward_api_files
from pd_localcluster.runtime import ROOT_ENV, ProcessRuntime, docker_args, volume_dir


def test_annotation_key_and_default_resource():
    assert ASCEND_ANNOTATION == "ascend.kubectl.kubernetes.io/ascend-910-configuration"
    assert DEFAULT_RESOURCE == "huawei.com/Ascend910"


def test_allocates_the_lowest_free_ids_and_releases_by_uid():
    a = DeviceAllocator(8)
    assert a.allocate("p1", 2) == [0, 1]
    assert a.allocate("p2", 3) == [2, 3, 4]
    a.release("p1")
    assert a.free == 5
    assert a.allocate("p3", 3) == [0, 1, 5]
    assert a.allocate("p3", 3) == [0, 1, 5]  # a pod keeps what it holds
    assert a.held("p2") == [2, 3, 4]
    a.release("absent")
    assert a.free == 2 and a.held("absent") == []


def test_exhaustion_is_an_error_that_takes_nothing():
    a = DeviceAllocator(4)
    a.allocate("p1", 3)
    with pytest.raises(NotEnoughDevices, match="2 requested, 1 of 4 free"):
        a.allocate("p2", 2)
    assert a.held("p2") == [] and a.free == 1
    assert a.allocate("p2", 1) == [3]


def test_restore_readopts_and_refuses_conflicts():
    a = DeviceAllocator(8)
    a.restore("old", [3, 5])
    assert a.held("old") == [3, 5]
    assert a.allocate("new", 4) == [0, 1, 2, 4]
    assert a.allocate("old", 2) == [3, 5]
    with pytest.raises(ValueError, match="held by pod old"):
        a.restore("other", [5])
    with pytest.raises(ValueError, match="not on this node"):
        a.restore("other", [8])
    assert a.held("other") == []


def test_device_ips_are_distinct_across_nodes_and_never_a_pod_ip():
    prefixes = [100 + i for i in range(3)]
    ips = [device_ip(p, d) for p in prefixes for d in range(600)]
    assert len(set(ips)) == len(ips)
    assert all(ip.startswith("127.") for ip in ips)
    assert device_ip(101, 0) == "127.101.200.1" and device_ip(101, 254) == "127.101.201.1"
    # the pod allocator walks its whole range before it wraps: none of it is a device IP
    pods = IPAllocator(1, 100)
    pod_ips = [pods.allocate() for _ in range(IPAllocator.LIMIT - 1)]
    assert len(set(pod_ips)) == len(pod_ips)
    assert not set(pod_ips) & {device_ip(101, d) for d in range(600)}
    assert max(int(ip.split(".")[2]) for ip in pod_ips) < 200
    pods.release(pod_ips[0])
    assert pods.allocate() == pod_ips[0]  # wrapped to the start, not into device addresses


def test_annotation_json_shape():
    value = annotation("prefill-0", "127.0.1.2", [5, 1], prefix=101, super_pod_id=1)
    assert json.loads(value) == {
        "pod_name": "prefill-0", "server_id": "127.0.1.2", "super_pod_id": 1,
        "devices": [{"device_id": "1", "device_ip": "127.101.200.2"},
                    {"device_id": "5", "device_ip": "127.101.200.6"}]}
    assert parse_annotation(value) == ("127.0.1.2", [1, 5])
    assert parse_annotation(None) is None and parse_annotation("{not json") is None
    assert parse_annotation('{"server_id": "x"}') is None


def test_requested_sums_limits_else_requests():
    pod = {"spec": {"containers": [
        {"name": "a", "resources": {"limits": {DEFAULT_RESOURCE: "2"}, "requests": {DEFAULT_RESOURCE: "9"}}},
        {"name": "b", "resources": {"requests": {DEFAULT_RESOURCE: 3}}},
        {"name": "c", "resources": {"limits": {"cpu": "1"}}},
        {"name": "d"},
    ]}}
    assert requested(pod, DEFAULT_RESOURCE) == 5
    assert requested(pod, "other.com/npu") == 0
    assert requested({"spec": {}}, DEFAULT_RESOURCE) == 0
    assert split(pod, DEFAULT_RESOURCE, [7, 2, 4, 9, 11]) == {"a": [2, 4], "b": [7, 9, 11]}


POD = {"metadata": {"name": "p", "namespace": "ns", "uid": "u-1", "labels": {"b": "2", "a": "1"},
                    "annotations": {ASCEND_ANNOTATION: '{"devices": []}'}},
       "spec": {"containers": [{"name": "main", "resources": {"limits": {"cpu": "2"}}}]}}


def test_downward_api_files():
    vol = {"name": "info", "downwardAPI": {"items": [
        {"path": "npu", "fieldRef": {"fieldPath": f"metadata.annotations['{ASCEND_ANNOTATION}']"}},
        {"path": "sub/name", "fieldRef": {"fieldPath": "metadata.name"}},
        {"path": "ns", "fieldRef": {"fieldPath": "metadata.namespace"}},
        {"path": "uid", "fieldRef": {"fieldPath": "metadata.uid"}},
        {"path": "a", "fieldRef": {"fieldPath": "metadata.labels['a']"}},
        {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}},
        {"path": "cpu", "resourceFieldRef": {"containerName": "main", "resource": "limits.cpu"}},
    ]}}
    assert downward_api_files(POD, vol) == {
        "npu": '{"devices": []}', "sub/name": "p", "ns": "ns", "uid": "u-1", "a": "1",
        "labels": 'a="1"\nb="2"', "cpu": "2"}
    with pytest.raises(ConfigError, match="stay in the volume"):
        downward_api_files(POD, {"downwardAPI": {"items": [
            {"path": "../x", "fieldRef": {"fieldPath": "metadata.name"}}]}})


MOUNTING_POD = {"volumes": [{"name": "info", "downwardAPI": {"items": []}}, {"name": "tmp", "emptyDir": {}}]}
MOUNTING = {"name": "main", "image": "img:1", "volumeMounts": [
    {"name": "info", "mountPath": "/etc/ascend"}, {"name": "tmp", "mountPath": "/tmp"},
    {"name": "info", "mountPath": "/etc/npu-only", "subPath": "npu"}]}


def test_docker_bind_mounts_a_downward_api_volume_read_only():
    args = docker_args(cname="c", root_label="/r", spec=MOUNTING, pod_spec=MOUNTING_POD, env={}, mounts=[],
                       pod_dir=Path("/pods/x"))
    pairs = [args[i + 1] for i, a in enumerate(args) if a == "-v"]
    assert pairs == ["/pods/x/volumes/info:/etc/ascend:ro", "/pods/x/volumes/info/npu:/etc/npu-only:ro"]
    assert "--tmpfs" in args
    assert volume_dir(Path("/pods/x"), "info") == Path("/pods/x/volumes/info")


def test_process_runtime_resolves_mounts_under_its_local_root(tmp_path: Path):
    vol = volume_dir(tmp_path, "info")
    vol.mkdir(parents=True)
    (vol / "npu").write_text("first")
    script = ("import os, sys; r = os.environ['PD_LOCAL_ROOT']; "
              "print(open(r + '/etc/ascend/npu').read(), open(r + '/etc/npu-only').read())")
    spec = dict(MOUNTING, image="x/pd-sim-agent:1", command=["python", "-c", script])
    log = tmp_path / "main.log"

    async def run() -> int:
        r = await ProcessRuntime().start(pod_uid="u", pod_dir=tmp_path, name="main", restart=0, spec=spec,
                                         pod_spec=MOUNTING_POD, env=dict(os.environ), log_path=log)
        return await r.wait()

    assert asyncio.run(run()) == 0, log.read_text()
    assert log.read_text().strip() == "first first"
    assert (tmp_path / "root" / "etc" / "ascend").resolve() == vol.resolve()
    # a restart links again over the old links
    (vol / "npu").write_text("second")
    log.write_text("")
    assert asyncio.run(run()) == 0, log.read_text()
    assert log.read_text().strip() == "second second"
    assert ROOT_ENV == "PD_LOCAL_ROOT"


def test_nodes_split_into_contiguous_superpods():
    from pd_localcluster.devices import superpod
    assert [superpod(i, 3, 2) for i in range(3)] == [0, 0, 1]
    assert [superpod(i, 4, 2) for i in range(4)] == [0, 0, 1, 1]
    assert [superpod(i, 3, 1) for i in range(3)] == [0, 0, 0]
    assert [superpod(i, 2, 5) for i in range(2)] == [0, 1]   # no more superpods than nodes
