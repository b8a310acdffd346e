"""The node agent's pure pod helpers."""
from __future__ import annotations

import base64

import pytest

from pd_localcluster.podspec import (
    ConfigError,
    ContainerState,
    UnknownImage,
    backoff_seconds,
    command_line,
    expand,
    pod_phase,
    referenced_objects,
    repository,
    resolve_env,
    should_restart,
)


@pytest.mark.parametrize("image,repo", [
    ("pd-sim-agent", "pd-sim-agent"),
    ("example.com/pd/pd-sim-agent:0.1", "example.com/pd/pd-sim-agent"),
    ("registry:5000/pd-operator@sha256:abc", "registry:5000/pd-operator"),
    ("registry:5000/x/pd-operator:v1@sha256:abc", "registry:5000/x/pd-operator"),
])
def test_repository(image, repo):
    assert repository(image) == repo


def test_command_line_maps_images_and_python():
    assert command_line({"image": "x/pd-sim-agent:1", "args": ["--a"]}, {}, python="/py") == \
        ["/py", "-m", "pd_agent", "--a"]
    assert command_line({"image": "x/pd-operator:1"}, {}, python="/py") == ["/py", "-m", "pd_operator"]
    assert command_line({"image": "x/pd-sim-agent", "command": ["python3", "-c", "$(X)"]},
                        {"X": "pass"}, python="/py") == ["/py", "-c", "pass"]


def test_unknown_image_is_rejected_with_known_list():
    with pytest.raises(UnknownImage, match="busybox.*pd-sim-agent"):
        command_line({"image": "busybox:1.36"}, {})
    with pytest.raises(UnknownImage):
        command_line({"image": "busybox", "command": ["python"]}, {})


def test_expand():
    env = {"A": "1", "B": "two"}
    assert expand("$(A)-$(B)-$(C)-$$(A)", env) == "1-two-$(C)-$(A)"


POD = {"metadata": {"name": "p", "namespace": "ns", "uid": "u",
                    "labels": {"pdoperator.io/role": "prefill"}, "annotations": {"a": "b"}},
       "spec": {"nodeName": "n1", "serviceAccountName": "sa"}}


def test_resolve_env_all_sources():
    container = {
        "envFrom": [{"configMapRef": {"name": "cm"}}, {"secretRef": {"name": "s"}, "prefix": "S_"}],
        "env": [
            {"name": "LIT", "value": "v"},
            {"name": "EXP", "value": "$(LIT)$(k)"},
            {"name": "NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}},
            {"name": "ROLE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['pdoperator.io/role']"}}},
            {"name": "ANN", "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['a']"}}},
            {"name": "CMK", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "k"}}},
            {"name": "SK", "valueFrom": {"secretKeyRef": {"name": "s", "key": "t"}}},
            {"name": "OPT", "valueFrom": {"secretKeyRef": {"name": "none", "key": "t", "optional": True}}},
            {"name": "NPU", "valueFrom": {"resourceFieldRef": {"resource": "limits.huawei.com/Ascend910"}}},
        ],
        "resources": {"limits": {"huawei.com/Ascend910": 8}},
    }
    cms = {"cm": {"data": {"k": "cmv"}}}
    secrets = {"s": {"data": {"t": base64.b64encode(b"sv").decode()}}, "none": None}
    env = resolve_env(POD, container, "127.100.0.2", "127.0.1.1", cms, secrets, {"BASE": "1"})
    assert env == {"BASE": "1", "k": "cmv", "S_t": "sv", "LIT": "v", "EXP": "vcmv", "NAME": "p",
                   "IP": "127.100.0.2", "HOST": "127.0.1.1", "ROLE": "prefill", "ANN": "b",
                   "CMK": "cmv", "SK": "sv", "NPU": "8"}


def test_resolve_env_missing_refs():
    c = {"env": [{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "nope"}}}]}
    with pytest.raises(ConfigError, match="nope"):
        resolve_env(POD, c, "", "", {"cm": {"data": {}}}, {})
    with pytest.raises(ConfigError, match='configmap "cm" not found'):
        resolve_env(POD, c, "", "", {"cm": None}, {})


def test_referenced_objects():
    c = {"env": [{"name": "a", "valueFrom": {"configMapKeyRef": {"name": "c1", "key": "k"}}},
                 {"name": "b", "valueFrom": {"secretKeyRef": {"name": "s1", "key": "k"}}}],
         "envFrom": [{"configMapRef": {"name": "c2"}}, {"secretRef": {"name": "s2"}}]}
    assert referenced_objects(c) == ({"c1", "c2"}, {"s1", "s2"})


def test_restart_policy_and_backoff():
    assert should_restart("Always", 0) and should_restart("Always", 1)
    assert should_restart("OnFailure", 2) and not should_restart("OnFailure", 0)
    assert not should_restart("Never", 1)
    assert [backoff_seconds(n) for n in range(7)] == [1, 2, 4, 8, 16, 20, 20]


def test_pod_phase():
    c = ContainerState(name="a", image="i")
    assert pod_phase([c]) == "Pending"
    c.state = {"running": {}}
    assert pod_phase([c]) == "Running"
    c.state, c.restart_count = {"waiting": {"reason": "CrashLoopBackOff"}}, 1
    assert pod_phase([c]) == "Running"
    c.state, c.done = {"terminated": {"exitCode": 0}}, True
    assert pod_phase([c]) == "Succeeded"
    c.state = {"terminated": {"exitCode": 2}}
    assert pod_phase([c]) == "Failed"


def test_unsupported_value_from_is_a_config_error():
    c = {"env": [{"name": "X", "valueFrom": {"fileKeyRef": {"path": "a", "key": "b"}}}]}
    with pytest.raises(ConfigError, match="X: unsupported valueFrom"):
        resolve_env(POD, c, "", "", {}, {})


def test_docker_args_carry_the_pods_security_context_volumes_and_limits():
    from pathlib import Path

    import yaml

    from pd_localcluster.runtime import docker_args
    from pd_operator import builders
    from pd_operator.api import parse_spec
    from tests.conftest import REPO
    doc = yaml.safe_load((REPO / "examples" / "sim-small.yaml").read_text())
    doc["spec"]["decoder"]["resources"] = {"limits": {"memory": "512Mi", "cpu": "500m"}}
    sts = builders.statefulset("x", "ns", parse_spec(doc["spec"]), "decoder", builders.owner_reference("x", "u"))
    pod = sts["spec"]["template"]["spec"]
    c = pod["containers"][0]
    args = docker_args(cname="pd-1-agent-0", root_label="/r", spec=c, pod_spec=pod,
                       env={"A": "1", "PATH": "/host/bin", "HOME": "/pods/x"}, mounts=[Path("/pods/x/sa")])
    joined = " ".join(args)
    assert args[:2] == ["run", "--rm"] and "--network host" in joined
    assert "--user 10001:10001" in joined and "--read-only" in args
    assert "--cap-drop ALL" in joined and "--security-opt no-new-privileges" in joined
    assert "--tmpfs /tmp:rw,exec,mode=1777" in joined
    assert "-v /pods/x/sa:/pods/x/sa:ro" in joined
    assert "--memory 512m" in joined and "--cpus 0.5" in joined
    # the image's own PATH and HOME apply inside it, not the node's
    assert "-e A=1" in joined and "PATH=" not in joined and "HOME=" not in joined
    assert args[-1] == c["image"] and "--entrypoint" not in args


def test_docker_args_command_replaces_the_entrypoint():
    from pd_localcluster.runtime import docker_args
    spec = {"name": "m", "image": "img:1", "command": ["python", "-m", "pd_agent.loadgen"], "args": ["--json"]}
    args = docker_args(cname="c", root_label="/r", spec=spec, pod_spec={}, env={}, mounts=[])
    assert args[args.index("--entrypoint"):] == ["--entrypoint", "python", "img:1", "-m", "pd_agent.loadgen", "--json"]
    assert "--user" not in args and "--read-only" not in args
