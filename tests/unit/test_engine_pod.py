"""The engine pod template a PDDeployment may open (pure): command and args, env from Secrets,
ConfigMaps and the pod, volumes and mounts, pull secrets, scheduling, a writable root as an
opt-out, extra egress; what the operator owns refused at admission (the CRD's rules) or, for
what only the operator's configuration decides (hostPath volumes), at reconcile."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from pd_operator import builders
from pd_operator.api import OPERATOR_ENV, OPERATOR_MOUNT_PATHS, parse_spec
from pd_operator.config import OperatorConfig, not_allowed
from tests.unit.test_operator_pure import SPEC, by_kind_name

REPO = Path(__file__).resolve().parents[2]

ENGINE = {
    "command": ["python3", "-m", "pd_agent"], "args": ["--verbose"],
    "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
            {"name": "MODEL_DIR", "valueFrom": {"configMapKeyRef": {"name": "model", "key": "dir", "optional": True}}},
            {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {"name": "MEM", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}}},
            {"name": "PLAIN", "value": "1"}, {"name": "EMPTY"}],
    "volumes": [{"name": "weights", "persistentVolumeClaim": {"claimName": "llama-weights", "readOnly": True}},
                {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}},
                {"name": "conf", "configMap": {"name": "engine-conf", "items": [{"key": "a", "path": "a.json"}]}},
                {"name": "creds", "secret": {"secretName": "store-creds"}}],
    "volumeMounts": [{"name": "weights", "mountPath": "/models", "readOnly": True},
                     {"name": "shm", "mountPath": "/dev/shm"},
                     {"name": "conf", "mountPath": "/etc/engine", "subPath": "a.json"}],
    "imagePullSecrets": [{"name": "regcred"}],
    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "accelerator", "operator": "In", "values": ["ascend"]}]}]}}},
    "schedulerName": "volcano", "priorityClassName": "inference-high",
    "tolerations": [{"key": "npu", "operator": "Exists", "effect": "NoSchedule"}],
    "readOnlyRootFilesystem": False,
    "egress": [{"to": [{"ipBlock": {"cidr": "10.20.0.0/16"}}], "ports": [{"protocol": "TCP", "port": 9000}]}],
}


def spec_with(**kw):
    return parse_spec({**copy.deepcopy(SPEC), **kw})


def pod_of(spec, group="prefill", config=None) -> dict:
    return builders.statefulset("llm", "ns", spec, group, {}, config=config)["spec"]["template"]["spec"]


def test_every_field_is_rendered_into_the_engine_pods():
    spec = spec_with(prefill={"replicas": 1, **ENGINE})
    pod = pod_of(spec)
    c = pod["containers"][0]
    assert c["name"] == "agent" and c["command"] == ["python3", "-m", "pd_agent"] and c["args"] == ["--verbose"]
    env = {e["name"]: e for e in c["env"]}
    assert env["HF_TOKEN"] == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    assert env["MODEL_DIR"]["valueFrom"]["configMapKeyRef"] == {"name": "model", "key": "dir", "optional": True}
    assert env["NODE"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["MEM"]["valueFrom"] == {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}}
    assert env["PLAIN"] == {"name": "PLAIN", "value": "1"} and env["EMPTY"] == {"name": "EMPTY", "value": ""}
    # the operator's identity env stays, once, before the spec's own
    assert [e["name"] for e in c["env"]].count("POD_NAME") == 1 and c["env"][0]["name"] == "POD_NAME"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["weights"] == {"name": "weights", "persistentVolumeClaim": {"claimName": "llama-weights",
                                                                               "readOnly": True}}
    assert volumes["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert volumes["conf"]["configMap"]["items"] == [{"key": "a", "path": "a.json"}]
    assert volumes["creds"]["secret"] == {"secretName": "store-creds"}
    assert volumes["tmp"] == {"name": "tmp", "emptyDir": {}}          # harden's, kept
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/dev/shm"] == {"name": "shm", "mountPath": "/dev/shm"}
    assert mounts["/etc/engine"]["subPath"] == "a.json" and mounts["/models"]["readOnly"] is True
    assert mounts["/tmp"]["name"] == "tmp"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["affinity"] == ENGINE["affinity"] and pod["schedulerName"] == "volcano"
    assert pod["priorityClassName"] == "inference-high" and pod["tolerations"] == ENGINE["tolerations"]
    # the opt-out drops the read-only root only
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": False,
                                    "capabilities": {"drop": ["ALL"]}}
    assert pod["securityContext"]["runAsNonRoot"] is True
    # the operator's own stay: ports, probes, labels
    assert [p["name"] for p in c["ports"]] == ["http", "datadist", "metrics"] and "readinessProbe" in c
    # the other group is untouched
    other = pod_of(spec, "decoder")
    oc = other["containers"][0]
    assert "command" not in oc and "imagePullSecrets" not in other and "affinity" not in other
    assert oc["securityContext"]["readOnlyRootFilesystem"] is True
    assert not {"weights", "shm", "conf", "creds"} & {v["name"] for v in other["volumes"]}


def test_without_the_new_fields_the_template_is_as_before():
    pod = pod_of(spec_with())
    c = pod["containers"][0]
    assert not {"command", "args"} & set(c) and not {"imagePullSecrets", "affinity", "schedulerName",
                                                      "priorityClassName"} & set(pod)
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    # an env entry with a value only renders as it always did (no roll of existing deployments)
    spec = spec_with(prefill={"env": [{"name": "A", "value": "x"}, {"name": "B"}]})
    assert pod_of(spec)["containers"][0]["env"][-2:] == [{"name": "A", "value": "x"}, {"name": "B", "value": ""}]


def test_ascend_volumes_and_user_volumes_sit_side_by_side():
    spec = spec_with(backend="llm-datadist", prefill={"volumes": ENGINE["volumes"],
                                                      "volumeMounts": ENGINE["volumeMounts"]})
    pod = pod_of(spec)
    names = [v["name"] for v in pod["volumes"]]
    assert names[:2] == ["ascend-0", "ascend-1"] and "podinfo" in names and "weights" in names
    assert len(names) == len(set(names))
    paths = [m["mountPath"] for m in pod["containers"][0]["volumeMounts"]]
    assert len(paths) == len(set(paths))


def test_egress_of_both_groups_is_added_to_the_engines_policy_once():
    store = ENGINE["egress"][0]
    dns_only = {"to": [{"ipBlock": {"cidr": "10.30.0.1/32"}}]}
    spec = spec_with(prefill={"egress": [store]}, decoder={"egress": [store, dns_only]})
    objs = by_kind_name(builders.desired_children("llm", "ns", "u", spec))
    egress = objs[("NetworkPolicy", "llm-engines")]["spec"]["egress"]
    assert egress[2:] == [store, dns_only]
    base = by_kind_name(builders.desired_children("llm", "ns", "u", spec_with()))
    assert base[("NetworkPolicy", "llm-engines")]["spec"]["egress"] == egress[:2]


@pytest.mark.parametrize("group", ["prefill", "decoder"])
def test_host_path_volumes_need_the_operators_allow_list(group):
    spec = spec_with(**{group: {"volumes": [{"name": "models", "hostPath": {"path": "/data/models/llama"}},
                                            {"name": "ok", "emptyDir": {}}]}})
    why = not_allowed(spec, OperatorConfig())
    assert why is not None and f"spec.{group}.volumes[0].hostPath.path" in why and "/data/models/llama" in why
    assert "allowed: none" in why and "engine.allowedHostPaths" in why
    assert not_allowed(spec, OperatorConfig(engine_host_paths=("/data/models",))) is None
    # the Ascend allow-list is another list: it does not open engine volumes
    assert not_allowed(spec, OperatorConfig(allowed_host_paths=("/data",))) is not None
    why = not_allowed(spec, OperatorConfig(engine_host_paths=("/data/model",)))
    assert why and "/data/model" in why   # a prefix of a name is not a directory


def test_a_host_directory_is_mounted_read_only_whatever_the_mount_says():
    """A writable allowed directory could hold a symlink that a later allowed hostPath follows out."""
    spec = spec_with(prefill={"volumes": [{"name": "models", "hostPath": {"path": "/data/models"}},
                                          {"name": "scratch", "emptyDir": {}}],
                              "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": False},
                                               {"name": "scratch", "mountPath": "/scratch"}]})
    sts = by_kind_name(builders.desired_children("llm", "ns", "u", spec))[("StatefulSet", "llm-prefill")]
    mounts = {m["mountPath"]: m for m in sts["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["/models"]["readOnly"] is True
    assert "readOnly" not in mounts["/scratch"]


def test_a_mount_over_an_ascend_host_path_is_refused():
    spec = spec_with(backend="llm-datadist", decoder={"volumes": [{"name": "x", "emptyDir": {}}],
                                                      "volumeMounts": [{"name": "x", "mountPath": "/etc/hccn.conf"}]})
    why = not_allowed(spec, OperatorConfig())
    assert why and "spec.decoder.volumeMounts[0].mountPath: /etc/hccn.conf is mounted by the operator" in why


def test_the_configuration_reads_the_engine_allow_list_and_pull_secrets():
    cfg = OperatorConfig.from_env({"PD_OPERATOR_ENGINE_ALLOWED_HOST_PATHS": "/data/models, /mnt/x",
                                   "PD_OPERATOR_GATEWAY_IMAGE_PULL_SECRETS": "regcred"})
    assert cfg.engine_host_paths == ("/data/models", "/mnt/x") and cfg.gateway_pull_secrets == ("regcred",)
    assert OperatorConfig.from_env({}).engine_host_paths == ()
    spec = spec_with(gateway={"enabled": True, "apiKeysSecret": "k"})
    objs = by_kind_name(builders.desired_children("llm", "ns", "u", spec, config=cfg))
    assert objs[("Deployment", "llm-gateway")]["spec"]["template"]["spec"]["imagePullSecrets"] == [
        {"name": "regcred"}]
    plain = by_kind_name(builders.desired_children("llm", "ns", "u", spec))
    assert "imagePullSecrets" not in plain[("Deployment", "llm-gateway")]["spec"]["template"]["spec"]


@pytest.mark.parametrize("bad", [
    {"volumes": [{"name": "Bad_Name", "emptyDir": {}}]},
    {"volumes": [{"name": "x", "emptyDir": {"medium": "HugePages"}}]},
    {"volumeMounts": [{"name": "x", "mountPath": "relative"}]},
    {"volumeMounts": [{"name": "x", "mountPath": "/a/"}]},
    {"volumeMounts": [{"name": "x", "mountPath": "/a", "subPath": "/abs"}]},
    {"env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "s"}}}]},            # no key
    {"imagePullSecrets": [{"name": "Not A Name"}]},
    {"schedulerName": "has space"},
    {"command": ["x"] * 65},
    {"egress": [{}] * 17},
    {"volumes": [{"name": "x", "hostPath": {"path": "relative"}}]},
])
def test_the_schema_refuses_malformed_fields(bad):
    with pytest.raises(ValueError):
        spec_with(prefill=bad)


def _group_schema(group: str) -> dict:
    crd = yaml.safe_load((REPO / "crds" / "pddeployment.yaml").read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][group]


@pytest.mark.parametrize("group", ["prefill", "decoder"])
def test_admission_names_the_field_for_what_the_operator_owns(group):
    g = _group_schema(group)
    rules = {r["message"]: r for r in g["x-kubernetes-validations"]}
    f = f"spec.{group}"
    for name in OPERATOR_ENV:
        r = rules[f"{f}.env[].name: {name} is set by the operator and cannot be overridden"]
        assert r["fieldPath"] == ".env" and f"e.name != '{name}'" in r["rule"]
    r = rules[f"{f}.env[].name: names starting with LLM_DATADIST_ or PD_ are set by the operator and cannot be "
              "overridden"]
    assert "startsWith('PD_')" in r["rule"] and "startsWith('LLM_DATADIST_')" in r["rule"]
    r = rules[f"{f}.volumes[].name: tmp, podinfo, mindie-rank-table and ascend-* are the operator's volumes and "
              "cannot be used"]
    assert r["fieldPath"] == ".volumes" and "v.name.startsWith('ascend-')" in r["rule"]
    r = rules[f"{f}.volumeMounts[].mountPath: /tmp, /etc/pd-podinfo, /etc/pd-mindie and what is under them are "
              "mounted by the operator and cannot be used"]
    assert all(f"m.mountPath.startsWith('{p}/')" in r["rule"] for p in OPERATOR_MOUNT_PATHS)
    assert r["fieldPath"] == ".volumeMounts"
    for where, ref in ((".env", "e.valueFrom.secretKeyRef.name"), (".volumes", "v.secret.secretName")):
        r = next(r for m, r in rules.items() if "agent token Secrets" in m and r["fieldPath"] == where)
        assert f"{ref}.endsWith(s)" in r["rule"] and "'-agent-data-token'" in r["rule"], r
    assert f"{f}.volumeMounts[].name must name one of {f}.volumes[]" in rules
    assert f"{f}.volumes[].hostPath.path may not contain . or .. segments" in rules
    # the container's name, ports, probes and labels are not fields at all
    props = g["properties"]
    assert not {"ports", "name", "readinessProbe", "livenessProbe", "labels", "containers", "envFrom"} & set(props)
    assert {"command", "args", "volumes", "volumeMounts", "imagePullSecrets", "affinity", "schedulerName",
            "priorityClassName", "readOnlyRootFilesystem", "egress"} <= set(props)
    assert props["volumes"]["x-kubernetes-list-map-keys"] == ["name"]
    assert props["volumeMounts"]["x-kubernetes-list-map-keys"] == ["mountPath"]
    assert props["affinity"].get("x-kubernetes-preserve-unknown-fields") is True
    assert props["egress"]["items"].get("x-kubernetes-preserve-unknown-fields") is True
    assert props["readOnlyRootFilesystem"]["default"] is True


def test_one_source_per_volume_and_per_env_value():
    g = _group_schema("prefill")["properties"]
    vol_rule = g["volumes"]["items"]["x-kubernetes-validations"][0]
    assert "size() == 1" in vol_rule["rule"] and "exactly one of persistentVolumeClaim" in vol_rule["message"]
    env = g["env"]["items"]
    assert env["x-kubernetes-validations"][0]["rule"] == "!(has(self.value) && has(self.valueFrom))"
    src = env["properties"]["valueFrom"]["x-kubernetes-validations"][0]
    assert "size() == 1" in src["rule"] and "secretKeyRef, configMapKeyRef, fieldRef, resourceFieldRef" in \
        src["message"]
    assert "default" not in env["properties"]["value"]   # a default would set value beside valueFrom


def test_an_inference_server_beside_the_agent_takes_the_groups_fields():
    """spec.engine: container `engine` runs the server's image with the group's command, env,
    mounts and resources and the identity env; the agent keeps the operator's and waits for ranks."""
    spec = spec_with(engine={"image": "registry.example.com/my-engine:2"},
                     prefill={"replicas": 1, **ENGINE, "resources": {"limits": {"huawei.com/Ascend910": 1}}})
    pod = pod_of(spec)
    agent, engine = pod["containers"]
    assert agent["name"] == "agent" and engine["name"] == "engine"
    assert engine["image"] == "registry.example.com/my-engine:2" and engine["command"] == ENGINE["command"]
    assert "command" not in agent and "args" not in agent
    names = lambda c: [e["name"] for e in c["env"]]  # noqa: E731
    assert "HF_TOKEN" in names(engine) and "HF_TOKEN" not in names(agent)
    assert "PD_RANKS_EXTERNAL" in names(agent) and "PD_RANKS_EXTERNAL" not in names(engine)
    # the identity the ranks read, and where they register (the pod IP is defined before its use)
    for n in ("LLM_DATADIST_CLUSTER_ID_BASE", "LLM_DATADIST_CACHE_DESC", "PD_AGENT_TOKEN", "PD_AGENT_URL"):
        assert n in names(engine)
    assert names(engine).index("LLM_DATADIST_IP") < names(engine).index("PD_AGENT_URL")
    assert {m["mountPath"] for m in engine["volumeMounts"]} >= {"/models", "/dev/shm", "/tmp"}
    assert "/models" not in {m["mountPath"] for m in agent["volumeMounts"]}
    assert engine["resources"]["limits"]["huawei.com/Ascend910"] == 1
    assert "huawei.com/Ascend910" not in agent["resources"]["limits"]
    # the writable-root opt-out is the engine's; the agent stays read-only
    assert engine["securityContext"]["readOnlyRootFilesystem"] is False
    assert agent["securityContext"]["readOnlyRootFilesystem"] is True
    assert [v["name"] for v in pod["volumes"]].count("tmp") == 1


def test_a_vllm_engine_gets_the_connector_arguments_unless_it_has_them():
    import json
    vllm = {"replicas": 1, "command": ["vllm", "serve", "/models/qwen"], "tensorParallel": 2}
    spec = spec_with(engine={"image": "vllm-ascend:0.9", "adapter": "vLLM"},
                     model={**SPEC["model"], "kvCache": {**SPEC["model"]["kvCache"], "numKvHeads": 8}},
                     prefill=vllm, decoder={**vllm, "args": ["--kv-transfer-config", "{}"]})
    p = pod_of(spec, "prefill")["containers"][1]
    args = p["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    cfg = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert cfg["kv_connector_module_path"] == "pd_engine.vllm_connector" and cfg["kv_role"] == "kv_both"
    env = {e["name"]: e.get("value") for e in p["env"]}
    assert env["HCCL_IF_IP"] == "$(LLM_DATADIST_IP)" and env["ASCEND_RT_VISIBLE_DEVICES"] == "0,1"
    d = pod_of(spec, "decoder")["containers"][1]
    assert d["args"].count("--kv-transfer-config") == 1 and d["args"][:2] == ["--kv-transfer-config", "{}"]


def test_without_spec_engine_the_pod_has_one_container():
    assert [c["name"] for c in pod_of(spec_with(prefill={"replicas": 1, **ENGINE}))["containers"]] == ["agent"]


def test_a_name_the_group_sets_itself_is_the_groups_never_twice():
    """vLLM's HCCL_IF_IP or the reference engine's OPENBLAS_NUM_THREADS, set by the group too: the
    group's value, one entry (a name twice breaks the StatefulSet's apply)."""
    vllm = {"replicas": 1, "command": ["vllm", "serve", "/m"], "args": ["-tp", "2"], "tensorParallel": 2,
            "env": [{"name": "HCCL_IF_IP", "value": "10.9.9.9"}, {"name": "GLOO_SOCKET_IFNAME", "value": "ib0"}]}
    spec = spec_with(engine={"image": "vllm-ascend:0.9", "adapter": "vLLM", "port": 8000},
                     model={**SPEC["model"], "kvCache": {**SPEC["model"]["kvCache"], "numKvHeads": 8,
                                                         "paged": {"blockSize": 16, "numBlocks": 64}}},
                     prefill=vllm, decoder=vllm)
    pod = pod_of(spec)
    engine = pod["containers"][1]
    names = [e["name"] for e in engine["env"]]
    assert len(names) == len(set(names)), names
    env = {e["name"]: e.get("value") for e in engine["env"]}
    assert env["HCCL_IF_IP"] == "10.9.9.9" and env["GLOO_SOCKET_IFNAME"] == "ib0"
    assert "--tensor-parallel-size" not in engine["args"]      # -tp is the same flag
    assert engine["ports"] == [{"name": "serving", "containerPort": 8000, "protocol": "TCP"}]
    ref = spec_with(sim={"engine": "reference"}, prefill={"replicas": 1, "env": [
        {"name": "OPENBLAS_NUM_THREADS", "value": "4"}]})
    agent = pod_of(ref)["containers"][0]
    threads = [e for e in agent["env"] if e["name"] == "OPENBLAS_NUM_THREADS"]
    assert threads == [{"name": "OPENBLAS_NUM_THREADS", "value": "4"}]


def test_the_servers_own_port_is_admitted_from_the_namespace_only_when_set():
    from pd_operator.gateway import network_policy
    with_port = spec_with(engine={"image": "e:1", "port": 8000})
    rules = network_policy("llm", "ns", with_port, {})["spec"]["ingress"]
    assert {"from": [{"podSelector": {}}], "ports": [{"protocol": "TCP", "port": 8000}]} in rules
    plain = network_policy("llm", "ns", spec_with(engine={"image": "e:1"}), {})["spec"]["ingress"]
    assert not any(r["from"] == [{"podSelector": {}}] for r in plain)


@pytest.mark.parametrize("kind", ["mooncake", "mooncake-layerwise"])
def test_a_mooncake_engine_runs_under_the_launcher_with_its_ports_admitted(kind):
    import json

    from pd_operator.gateway import gateway_objects, network_policy
    vllm = {"replicas": 1, "command": ["vllm", "serve", "/models/qwen"], "args": ["--port", "8001"],
            "tensorParallel": 2}
    spec = spec_with(engine={"image": "vllm-ascend:0.23", "adapter": "vLLM", "port": 8001, "kvTransfer": kind,
                             "kvPort": 36000},
                     ascend={"npusPerNode": 16},
                     model={**SPEC["model"], "kvCache": {**SPEC["model"]["kvCache"], "numKvHeads": 8}},
                     prefill=vllm, decoder=vllm, gateway={"enabled": True, "apiKeysSecret": "k"})
    c = pod_of(spec, "decoder")["containers"][1]
    assert c["command"] == ["python3", "-m", "pd_engine.launch", "--", "vllm", "serve", "/models/qwen"]
    assert c["args"] == ["--port", "8001", "--tensor-parallel-size", "2"]     # kv-transfer-config: the launcher's
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["PD_KV_TRANSFER"] == kind and env["PD_KV_PORT"] == "36000" and env["PD_ENGINE_PORT"] == "8001"
    assert json.loads(env["PD_KV_PARALLEL"]) == {"prefill": {"tp_size": 2, "dp_size": 1},
                                                 "decode": {"tp_size": 2, "dp_size": 1}}
    pol = network_policy("llm", "ns", spec, {})["spec"]
    kv = [{"protocol": "TCP", "port": 36000, "endPort": 36001}, {"protocol": "TCP", "port": 20000, "endPort": 35999}]
    assert {"from": [{"podSelector": {"matchLabels": {"pdoperator.io/deployment": "llm"}}}], "ports": kv} \
        in pol["ingress"]
    to_gateway = [r for r in pol["egress"] if r.get("ports") == [{"protocol": "TCP", "port": 8000}]]
    gw_env = {e["name"] for o in gateway_objects("llm", "ns", spec, {}) if o["kind"] == "Deployment"
              for e in o["spec"]["template"]["spec"]["containers"][0]["env"]}
    if kind == "mooncake-layerwise":    # decoder first: the engines post to the gateway's metaserver
        assert to_gateway and {"PD_GATEWAY_DECODER_FIRST", "POD_IP"} <= gw_env
    else:
        assert not to_gateway and "PD_GATEWAY_DECODER_FIRST" not in gw_env
    plain = pod_of(spec_with(engine={"image": "e:1", "adapter": "vLLM"}, prefill=vllm), "prefill")["containers"][1]
    assert plain["command"] == ["vllm", "serve", "/models/qwen"]      # pd-operator's connector: as before
