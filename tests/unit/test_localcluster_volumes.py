"""The local node's volumes (pure mappings): configMap and secret files, the directory behind a
claim (hostPath or local PersistentVolume), and how each runtime mounts emptyDir, hostPath and
claims."""
from __future__ import annotations

import base64
from pathlib import Path

import pytest

from pd_localcluster.podspec import ConfigError, claim_path, object_volume_files, with_claims
from pd_localcluster.runtime import docker_args, file_mounts, link_mounts, local_mounts, volume_dir

POD_DIR = Path("/pods/ns_p_uid")


def _b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


def test_configmap_and_secret_volumes_are_files_of_their_data():
    cm = {"data": {"a.json": "{}", "b": "x"}, "binaryData": {"bin": _b64("\x00\x01")}}
    assert object_volume_files({"name": "v", "configMap": {"name": "c"}}, cm) == {
        "a.json": b"{}", "b": b"x", "bin": b"\x00\x01"}
    items = {"name": "v", "configMap": {"name": "c", "items": [{"key": "b", "path": "sub/b.txt"}]}}
    assert object_volume_files(items, cm) == {"sub/b.txt": b"x"}
    secret = {"data": {"token": _b64("s3cret")}}
    assert object_volume_files({"name": "v", "secret": {"secretName": "s"}}, secret) == {"token": b"s3cret"}


def test_a_missing_object_or_key_fails_the_mount_unless_optional():
    with pytest.raises(ConfigError, match='configMap "c" not found'):
        object_volume_files({"name": "v", "configMap": {"name": "c"}}, None)
    assert object_volume_files({"name": "v", "secret": {"secretName": "s", "optional": True}}, None) == {}
    with pytest.raises(ConfigError, match="no key 'z'"):
        object_volume_files({"name": "v", "configMap": {"name": "c", "items": [{"key": "z", "path": "z"}]}},
                            {"data": {}})
    with pytest.raises(ConfigError, match="stay in the volume"):
        object_volume_files({"name": "v", "configMap": {"name": "c", "items": [{"key": "a", "path": "../x"}]}},
                            {"data": {"a": "1"}})


def _pvc(volume: str | None = "pv-1", phase: str = "Bound") -> dict:
    return {"spec": {"volumeName": volume} if volume else {}, "status": {"phase": phase}}


@pytest.mark.parametrize("pv_spec,path", [
    ({"hostPath": {"path": "/srv/weights"}, "capacity": {"storage": "1Gi"}}, "/srv/weights"),
    ({"local": {"path": "/mnt/disk1"}, "nodeAffinity": {}}, "/mnt/disk1"),
])
def test_a_bound_hostpath_or_local_claim_is_its_volumes_directory(pv_spec, path):
    assert claim_path("ns", "w", _pvc(), {"spec": pv_spec}) == path


@pytest.mark.parametrize("pvc,pv,why", [
    (None, None, 'persistentvolumeclaim "ns/w" not found'),
    (_pvc(None, "Pending"), None, 'persistentvolumeclaim "ns/w" is not bound (phase Pending)'),
    (_pvc(), None, 'persistentvolume "pv-1" of claim "ns/w" not found'),
    (_pvc(), {"spec": {"nfs": {"server": "x", "path": "/"}, "capacity": {}}}, "cannot mount (nfs)"),
])
def test_a_claim_that_cannot_be_mounted_says_why(pvc, pv, why):
    with pytest.raises(ConfigError) as e:
        claim_path("ns", "w", pvc, pv)
    assert why in str(e.value)


POD_SPEC = {"volumes": [
    {"name": "podinfo", "downwardAPI": {"items": []}},
    {"name": "weights", "persistentVolumeClaim": {"claimName": "w", "readOnly": True}},
    {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}},
    {"name": "tmp", "emptyDir": {}},
    {"name": "conf", "configMap": {"name": "c"}},
    {"name": "host", "hostPath": {"path": "/opt/cache"}},
]}
CONTAINER = {"name": "agent", "image": "reg/pd-sim-agent:1", "volumeMounts": [
    {"name": "podinfo", "mountPath": "/etc/pd-podinfo", "readOnly": True},
    {"name": "weights", "mountPath": "/models"},
    {"name": "shm", "mountPath": "/dev/shm"},
    {"name": "tmp", "mountPath": "/tmp"},
    {"name": "conf", "mountPath": "/etc/engine/a.json", "subPath": "a.json"},
    {"name": "host", "mountPath": "/cache"},
]}


def test_claims_are_handed_to_the_runtimes_as_the_directory_behind_them():
    resolved = with_claims(POD_SPEC, {"w": "/srv/weights"})
    weights = next(v for v in resolved["volumes"] if v["name"] == "weights")
    assert weights == {"name": "weights", "hostPath": {"path": "/srv/weights"}, "readOnly": True}
    assert "persistentVolumeClaim" in POD_SPEC["volumes"][1]   # the pod's own spec is not changed
    assert with_claims({"volumes": [{"name": "x", "emptyDir": {}}]}, {}) == {"volumes": [{"name": "x", "emptyDir": {}}]}


def test_a_process_sees_every_mount_under_its_local_root(tmp_path):
    spec = with_claims(POD_SPEC, {"w": "/srv/weights"})
    mounts = dict((m, src) for src, m in local_mounts(CONTAINER, spec, POD_DIR))
    assert mounts == {"/etc/pd-podinfo": volume_dir(POD_DIR, "podinfo"), "/models": Path("/srv/weights"),
                      "/dev/shm": volume_dir(POD_DIR, "shm"), "/tmp": volume_dir(POD_DIR, "tmp"),
                      "/etc/engine/a.json": volume_dir(POD_DIR, "conf") / "a.json", "/cache": Path("/opt/cache")}
    # Docker bind-mounts only the files the node writes; the rest are its own mounts
    assert [m for _, m in file_mounts(CONTAINER, spec, POD_DIR)] == ["/etc/pd-podinfo", "/etc/engine/a.json"]
    # the links a process resolves mounted paths through
    shm = tmp_path / "shm"
    shm.mkdir()
    link_mounts(tmp_path / "root", [(shm, "/dev/shm")])
    (shm / "seg").write_text("x")
    assert (tmp_path / "root" / "dev" / "shm" / "seg").read_text() == "x"


def test_docker_binds_a_claims_directory_and_sizes_shared_memory():
    spec = with_claims(POD_SPEC, {"w": "/srv/weights"})
    args = docker_args(cname="c", root_label="r", spec=CONTAINER, pod_spec=spec, env={}, mounts=[], pod_dir=POD_DIR)
    joined = " ".join(args)
    assert "-v /srv/weights:/models:ro" in joined      # the claim was readOnly
    assert "-v /opt/cache:/cache" in joined and "/opt/cache:/cache:ro" not in joined
    assert "--shm-size 2g" in joined and "--tmpfs /dev/shm" not in joined
    assert "--tmpfs /tmp:rw,exec,mode=1777" in joined
    assert f"-v {volume_dir(POD_DIR, 'conf') / 'a.json'}:/etc/engine/a.json:ro" in joined
