"""What a PDDeployment's author can and cannot cause (pure): host paths and the gateway image
only from the operator's configuration, a keys Secret only once it opted in, engines without a
ServiceAccount token, the operator admitted by namespace and labels together, members only by
their StatefulSet's uid."""
from __future__ import annotations

import copy
import re
from decimal import Decimal
from pathlib import Path

import pytest
import yaml

from pd_operator import builders, resources
from pd_operator.api import parse_spec
from pd_operator.config import DEFAULT_HOST_PATHS, OperatorConfig, not_allowed, path_allowed
from pd_operator.members import MAX_STRAYS_LISTED, foreign, listed_strays, own_statefulsets
from tests.unit.test_operator_pure import SPEC, by_kind_name

REPO = Path(__file__).resolve().parents[2]


def spec_with(**kw):
    return parse_spec({**copy.deepcopy(SPEC), **kw})


@pytest.mark.parametrize("path,ok", [
    ("/etc/hccn.conf", True), ("/usr/local/Ascend/driver", True), ("/usr/local/Ascend/driver/lib64", True),
    ("/usr/local/Ascend", False), ("/usr/local/Ascend/driver-evil", False), ("/etc", False), ("/", False),
    ("/usr/local/Ascend/driver/../../../../etc/shadow", False), ("/usr/local/Ascend/driver/./x", False),
])
def test_a_path_is_allowed_only_as_itself_or_under_an_allowed_directory(path, ok):
    assert path_allowed(path, DEFAULT_HOST_PATHS) is ok


def test_host_paths_outside_the_allow_list_are_refused_naming_field_and_list():
    spec = spec_with(backend="llm-datadist", ascend={"extraHostPaths": ["/usr/local/dcmi", "/var/run/docker.sock"]})
    why = not_allowed(spec, OperatorConfig())
    assert why is not None and "spec.ascend.extraHostPaths[1]" in why and "/var/run/docker.sock" in why
    assert "/usr/local/Ascend/driver" in why   # the allow-list is named
    assert not_allowed(spec, OperatorConfig(allowed_host_paths=(*DEFAULT_HOST_PATHS, "/var/run"))) is None
    # checked whatever the backend: the spec is what is refused
    assert not_allowed(spec_with(ascend={"driverPath": "/root"}), OperatorConfig()) is not None
    # the defaults, when an admin allows fewer paths than they need
    narrow = OperatorConfig(allowed_host_paths=("/etc/hccn.conf",))
    assert "spec.ascend (default)" in (not_allowed(spec_with(backend="llm-datadist"), narrow) or "")
    assert not_allowed(spec_with(), narrow) is None   # sim mounts nothing


def group_with(**kw) -> dict:
    return {**copy.deepcopy(SPEC["prefill"]), **kw}


CROSS = [
    {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"topologyKey": "kubernetes.io/hostname", "labelSelector": {}, "namespaceSelector": {}}]}},
    {"podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1, "podAffinityTerm": {
        "topologyKey": "kubernetes.io/hostname", "labelSelector": {}, "namespaces": ["t", "kube-system"]}}]}},
]


@pytest.mark.parametrize("affinity", CROSS)
def test_affinity_terms_across_namespaces_are_refused_unless_allowed(affinity):
    spec = spec_with(prefill=group_with(affinity=affinity))
    why = not_allowed(spec, OperatorConfig(), "t")
    assert why is not None and "spec.prefill.affinity.pod" in why and "scheduling.crossNamespaceAffinity" in why
    assert not_allowed(spec, OperatorConfig(cross_namespace_affinity=True), "t") is None
    own = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"topologyKey": "kubernetes.io/hostname", "labelSelector": {}, "namespaces": ["t"]}]}}
    assert not_allowed(spec_with(prefill=group_with(affinity=own)), OperatorConfig(), "t") is None


def test_priority_classes_and_schedulers_come_from_the_admins_lists():
    system = spec_with(decoder={**copy.deepcopy(SPEC["decoder"]), "priorityClassName": "system-node-critical"})
    why = not_allowed(system, OperatorConfig(), "t")
    assert why and "spec.decoder.priorityClassName: system-node-critical is not allowed (allowed: any but system-*" \
        in why
    assert not_allowed(spec_with(prefill=group_with(priorityClassName="batch-high")), OperatorConfig(), "t") is None
    listed = OperatorConfig(allowed_priority_classes=("inference",))
    assert "allowed: inference" in (not_allowed(spec_with(prefill=group_with(priorityClassName="batch-high")),
                                                listed, "t") or "")
    evil = spec_with(prefill=group_with(schedulerName="my-scheduler"))
    assert "spec.prefill.schedulerName: my-scheduler is not allowed (allowed: default-scheduler" in \
        (not_allowed(evil, OperatorConfig(), "t") or "")
    assert not_allowed(evil, OperatorConfig(allowed_scheduler_names=("my-scheduler",)), "t") is None
    cfg = OperatorConfig.from_env({"PD_OPERATOR_ALLOWED_PRIORITY_CLASSES": "a,b", "PD_OPERATOR_ALLOWED_SCHEDULER_NAMES":
                                   "volcano", "PD_OPERATOR_CROSS_NAMESPACE_AFFINITY": "true"})
    assert cfg.allowed_priority_classes == ("a", "b") and cfg.allowed_scheduler_names == ("volcano",)
    assert cfg.cross_namespace_affinity
    default = OperatorConfig.from_env({"PD_OPERATOR_ALLOWED_PRIORITY_CLASSES": "",
                                       "PD_OPERATOR_ALLOWED_SCHEDULER_NAMES": ""})
    assert default.allowed_priority_classes is None and default.allowed_scheduler_names == ("default-scheduler",)


def test_host_path_types_that_create_paths_are_refused():
    vol = {"name": "models", "hostPath": {"path": "/data/models", "type": "DirectoryOrCreate"}}
    spec = spec_with(prefill=group_with(volumes=[vol]))
    why = not_allowed(spec, OperatorConfig(engine_host_paths=("/data",)), "t")
    assert why and "spec.prefill.volumes[0].hostPath.type: DirectoryOrCreate" in why
    vol["hostPath"]["type"] = "Directory"
    assert not_allowed(spec_with(prefill=group_with(volumes=[vol])), OperatorConfig(engine_host_paths=("/data",)),
                       "t") is None


def test_dot_segments_are_refused_by_the_schema():
    with pytest.raises(ValueError):
        spec_with(ascend={"hccnConf": "etc/hccn.conf"})   # relative
    crd = yaml.safe_load((REPO / "crds" / "pddeployment.yaml").read_text())
    ascend = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["ascend"]
    rules = " ".join(r["rule"] for r in ascend["x-kubernetes-validations"])
    assert rules.count("'/../'") == 3 and rules.count("'/./'") == 3


def test_the_gateway_image_comes_from_the_operator():
    cfg = OperatorConfig(gateway_image="reg/pd-gateway:1", allowed_gateway_images=("reg/pd-gateway:2",))
    keys = {"enabled": True, "apiKeysSecret": "k"}
    assert not_allowed(spec_with(gateway=keys), cfg) is None
    assert not_allowed(spec_with(gateway={**keys, "image": "reg/pd-gateway:2"}), cfg) is None
    why = not_allowed(spec_with(gateway={**keys, "image": "evil/reads-secrets:1"}), cfg)
    assert why and "spec.gateway.image" in why and "reg/pd-gateway:1, reg/pd-gateway:2" in why
    objs = by_kind_name(builders.desired_children("llm", "ns", "u", spec_with(gateway=keys), config=cfg))
    assert objs[("Deployment", "llm-gateway")]["spec"]["template"]["spec"]["containers"][0]["image"] == \
        "reg/pd-gateway:1"


def test_a_keys_secret_that_did_not_opt_in_is_not_handed_to_the_gateway():
    spec = spec_with(gateway={"enabled": True, "apiKeysSecret": "team-keys"})
    objs = by_kind_name(builders.desired_children("llm", "ns", "u", spec, keys_allowed=False))
    rules = objs[("Role", "llm-gateway")]["rules"]
    assert not any("secrets" in r["resources"] for r in rules)
    assert objs[("Deployment", "llm-gateway")]["spec"]["replicas"] == 0
    allowed = by_kind_name(builders.desired_children("llm", "ns", "u", spec))
    assert any(r.get("resourceNames") == ["team-keys"] for r in allowed[("Role", "llm-gateway")]["rules"])


def test_engines_hold_no_serviceaccount_token_and_run_as_the_configured_user():
    objs = by_kind_name(builders.desired_children("llm", "ns", "u", spec_with(backend="llm-datadist"),
                                                  config=OperatorConfig(engine_user=1000, engine_group=1000)))
    pod = objs[("StatefulSet", "llm-prefill")]["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsUser"] == 1000 and pod["securityContext"]["runAsNonRoot"] is True


def test_default_resources_scale_with_the_ranks_and_yield_to_the_spec():
    assert builders.default_resources("sim", 4) == {
        "requests": {"cpu": "400m", "memory": "1024Mi", "ephemeral-storage": "256Mi"},
        "limits": {"cpu": "4", "memory": "4096Mi", "ephemeral-storage": "1024Mi"}}
    # a request above the default limit raises the limit; a limit below the default request
    # lowers the request (the API server refuses a request above its limit)
    spec = spec_with(decoder={**SPEC["decoder"], "resources": {"requests": {"memory": "8Gi"},
                                                               "limits": {"cpu": "50m"}}})
    c = by_kind_name(builders.desired_children("llm", "ns", "u", spec))[("StatefulSet", "llm-decoder")][
        "spec"]["template"]["spec"]["containers"][0]
    assert c["resources"]["requests"]["memory"] == c["resources"]["limits"]["memory"] == "8Gi"
    assert c["resources"]["requests"]["cpu"] == c["resources"]["limits"]["cpu"] == "50m"
    # the chart's defaults, through the operator's configuration
    cfg = OperatorConfig(engine_resources={"sim": {"requests": {"cpu": "250m"}, "limits": {"cpu": "1.5"}}})
    assert builders.default_resources("sim", 2, cfg) == {"requests": {"cpu": "500m"}, "limits": {"cpu": "3"}}


def test_network_policy_admits_the_operator_by_namespace_and_labels_together():
    np = builders.desired_children("llm", "ns", "u", spec_with(), config=OperatorConfig(namespace="pd-system"))
    np = next(o for o in np if o["kind"] == "NetworkPolicy")["spec"]
    agent_from = np["ingress"][0]["from"]
    op = [f for f in agent_from if "namespaceSelector" in f]
    assert op == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "pd-system"}},
                   "podSelector": {"matchLabels": {"app.kubernetes.io/name": "pd-operator"}}}]
    assert not any(f.get("namespaceSelector") == {} for f in agent_from)
    assert np["policyTypes"] == ["Ingress", "Egress"]
    own = {"podSelector": {"matchLabels": {"pdoperator.io/deployment": "llm"}}}
    assert np["egress"][0] == {"to": [own], "ports": [{"protocol": "TCP", "port": 8080},
                                                      {"protocol": "TCP", "port": 26000}]}
    # an operator outside the cluster is not a pod: no rule at all rather than any namespace
    np = next(o for o in builders.desired_children("llm", "ns", "u", spec_with()) if o["kind"] == "NetworkPolicy")
    assert not any("namespaceSelector" in f for f in np["spec"]["ingress"][0]["from"])


def gateway_of(config: OperatorConfig, **gateway) -> dict:
    spec = spec_with(gateway={"enabled": True, "apiKeysSecret": "keys", **gateway})
    return by_kind_name(builders.desired_children("llm", "ns", "u", spec, config=config))


def test_gateway_metrics_port_is_closed_to_the_public_and_its_egress_bounded():
    objs = gateway_of(OperatorConfig(namespace="pd-system", api_server_cidrs=("10.0.0.1/32",)))
    np = objs[("NetworkPolicy", "llm-gateway")]["spec"]
    assert np["podSelector"] == {"matchLabels": {"pdoperator.io/gateway": "llm"}}
    assert np["policyTypes"] == ["Ingress", "Egress"]
    api, metrics = np["ingress"]
    assert api == {"ports": [{"protocol": "TCP", "port": 8000}]}   # the public API: from anywhere
    assert metrics["ports"] == [{"protocol": "TCP", "port": 9090}]
    assert metrics["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "pd-system"}},
         "podSelector": {"matchLabels": {"app.kubernetes.io/name": "pd-operator"}}},
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    agents, api_server, dns = np["egress"]
    assert agents == {"to": [{"podSelector": {"matchLabels": {"pdoperator.io/deployment": "llm"}}}],
                      "ports": [{"protocol": "TCP", "port": 8080}]}
    assert api_server == {"to": [{"ipBlock": {"cidr": "10.0.0.1/32"}}],
                          "ports": [{"protocol": "TCP", "port": 443}, {"protocol": "TCP", "port": 6443}]}
    assert {p["port"] for p in dns["ports"]} == {53} and "to" not in dns
    # no monitoring namespaces and an operator outside the cluster: nobody may scrape it
    np = gateway_of(OperatorConfig(metrics_namespaces=None))[("NetworkPolicy", "llm-gateway")]["spec"]
    assert len(np["ingress"]) == 1 and "to" not in np["egress"][1]
    # the Service is the public API's only: the metrics port is not behind it
    svc = objs[("Service", "llm-gateway")]["spec"]
    assert [p["port"] for p in svc["ports"]] == [8000]


def test_gateway_pods_have_default_resources_and_distinct_probes():
    c = gateway_of(OperatorConfig())[("Deployment", "llm-gateway")]["spec"]["template"]["spec"]["containers"][0]
    assert c["resources"] == {"requests": {"cpu": "100m", "memory": "256Mi", "ephemeral-storage": "64Mi"},
                              "limits": {"cpu": "2", "memory": "1Gi", "ephemeral-storage": "256Mi"}}
    assert c["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "http"}
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": 8000, "metrics": 9090}
    # the spec's own resources win, and the configured defaults fill the rest
    cfg = OperatorConfig(gateway_resources={"requests": {"cpu": "1"}, "limits": {"memory": "4Gi"}})
    c = gateway_of(cfg, resources={"limits": {"cpu": "500m"}})[("Deployment", "llm-gateway")]["spec"]["template"][
        "spec"]["containers"][0]
    assert c["resources"] == {"requests": {"cpu": "500m"}, "limits": {"cpu": "500m", "memory": "4Gi"}}


def test_resource_quantities():
    assert [resources.quantity(q) for q in ("500m", "1Gi", "2", "1.5k", "1e3", "x", "")] == [
        Decimal("0.5"), 2 ** 30, 2, 1500, 1000, None, None]
    assert [resources.scaled(q, 4) for q in ("100m", "256Mi", "1", "0.5", 3)] == ["400m", "1024Mi", "4", "2", "12"]
    with pytest.raises(ValueError):
        resources.scaled("lots", 2)


def test_members_are_pods_of_the_deployments_own_statefulsets():
    def sts(name, owner_uid, uid):
        return {"kind": "StatefulSet", "metadata": {"name": name, "uid": uid, "ownerReferences": [
            {"uid": owner_uid, "controller": True}]}}
    own = own_statefulsets([sts("llm-prefill", "u", "s1"), sts("llm-decoder", "u", "s2"),
                            sts("llm-extra", "u", "s3"), sts("llm-prefill", "other", "s4")], "llm", "u")
    assert own == {"s1", "s2"}

    def pod(owner_uid, kind="StatefulSet"):
        return {"metadata": {"name": "p", "labels": {"pdoperator.io/group": "prefill"},
                             "ownerReferences": [{"kind": kind, "uid": owner_uid, "controller": True}]}}
    assert foreign(pod("s1"), own) is None
    for stray in (pod("s4"), pod("s1", kind="ReplicaSet"), {"metadata": {"name": "p"}}):
        problem = foreign(stray, own)
        assert problem is not None and "not a pod of its StatefulSets" in problem.message


def test_pods_that_only_wear_the_labels_are_listed_within_a_bound():
    pods = [{"metadata": {"name": f"stray-{i:04d}", "labels": {"pdoperator.io/group": "decoder"}}}
            for i in range(1000)]
    pods.append({"metadata": {"name": "llm-prefill-0", "labels": {"pdoperator.io/group": "prefill"},
                              "ownerReferences": [{"kind": "StatefulSet", "uid": "s1", "controller": True}]}})
    shown, problems = listed_strays(pods, {"s1"})
    assert len(shown) == len(problems) == MAX_STRAYS_LISTED
    assert [p.pod for p in problems] == [f"stray-{i:04d}" for i in range(MAX_STRAYS_LISTED)]
    assert f"{1000 - MAX_STRAYS_LISTED} more pods" in problems[-1].message
    shown, problems = listed_strays(pods[:3], set())
    assert len(problems) == 3 and "more pods" not in problems[-1].message


def test_config_from_env():
    cfg = OperatorConfig.from_env({"PD_OPERATOR_ALLOWED_HOST_PATHS": "/a, /b/c", "PD_OPERATOR_GATEWAY_IMAGE": "g:1",
                                   "PD_OPERATOR_ALLOWED_GATEWAY_IMAGES": "", "PD_OPERATOR_ENGINE_USER": "",
                                   "POD_NAMESPACE": "ops"})
    assert cfg.allowed_host_paths == ("/a", "/b/c") and cfg.gateway_image == "g:1"
    assert cfg.allowed_gateway_images == () and cfg.engine_user is None and cfg.namespace == "ops"
    assert OperatorConfig.from_env({}).allowed_host_paths == DEFAULT_HOST_PATHS
    assert OperatorConfig.from_env({"PD_OPERATOR_ALLOWED_HOST_PATHS": ""}).allowed_host_paths == ()
    # the chart's JSON values (toJson): resources, the monitoring namespaces, the API server
    cfg = OperatorConfig.from_env({"PD_OPERATOR_GATEWAY_RESOURCES": '{"limits": {"memory": "2Gi"}}',
                                   "PD_OPERATOR_ENGINE_RESOURCES": '{"sim": {"requests": {"cpu": "1"}}}',
                                   "PD_OPERATOR_METRICS_NAMESPACE_SELECTOR": "null",
                                   "PD_OPERATOR_API_SERVER_CIDRS": "10.0.0.1/32,10.0.0.2/32",
                                   "PD_OPERATOR_API_SERVER_PORTS": "6443"})
    assert cfg.gateway_resources == {"limits": {"memory": "2Gi"}} and cfg.engine_resources["sim"]["requests"]
    assert cfg.metrics_namespaces is None and cfg.api_server_ports == (6443,)
    assert cfg.api_server_cidrs == ("10.0.0.1/32", "10.0.0.2/32")
    assert OperatorConfig.from_env({"PD_OPERATOR_METRICS_NAMESPACE_SELECTOR": "{}"}).metrics_namespaces is None
    with pytest.raises(SystemExit, match="PD_OPERATOR_GATEWAY_RESOURCES"):
        OperatorConfig.from_env({"PD_OPERATOR_GATEWAY_RESOURCES": "{limits"})


def test_the_admission_policy_knows_the_operators_default_paths():
    text = (REPO / "charts" / "pd-operator" / "templates" / "admissionpolicy.yaml").read_text()
    listed = re.search(r'\$defaults := "\[(.*?)\]"', text)
    assert listed and tuple(p.strip(" '") for p in listed.group(1).split(",")) == DEFAULT_HOST_PATHS
    values = yaml.safe_load((REPO / "charts" / "pd-operator" / "values.yaml").read_text())
    assert tuple(values["allowedHostPaths"]) == DEFAULT_HOST_PATHS


@pytest.mark.parametrize("rebalance,serving,want", [
    (None, {"prefill": 2, "decoder": 4}, {"prefill": 1, "decoder": 3}),      # one at a time
    (None, {"prefill": 1, "decoder": 1}, {"prefill": 1, "decoder": 1}),      # never the last one
    ({"policy": "Manual", "manual": {"prefill": 2}, "minPrefill": 2, "minDecoder": 0},
     {"prefill": 2, "decoder": 1}, {"prefill": 2, "decoder": 0}),            # the role minimums rule
    (None, {"prefill": 0, "decoder": 0}, {"prefill": 1, "decoder": 1}),      # before any pod: the floor
])
def test_disruption_budgets_by_role_evict_one_at_a_time_above_the_minimums(rebalance, serving, want):
    spec = spec_with(**({"rebalance": rebalance} if rebalance else {}))
    objs = by_kind_name(builders.desired_children("llm", "ns", "u", spec, serving=serving))
    for role in ("prefill", "decoder"):
        pdb = objs[("PodDisruptionBudget", f"llm-{role}")]["spec"]
        assert pdb["selector"]["matchLabels"] == {"pdoperator.io/deployment": "llm", "pdoperator.io/role": role}
        assert pdb["minAvailable"] == want[role]


def test_groups_spread_over_nodes_unless_the_spec_says_otherwise():
    sts = by_kind_name(builders.desired_children("llm", "ns", "u", spec_with()))[("StatefulSet", "llm-decoder")]
    (c,) = sts["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert c["topologyKey"] == "kubernetes.io/hostname" and c["whenUnsatisfiable"] == "ScheduleAnyway"
    assert c["labelSelector"]["matchLabels"] == sts["spec"]["selector"]["matchLabels"]
    zone = [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "DoNotSchedule",
             "labelSelector": {"matchLabels": {"pdoperator.io/group": "decoder"}}}]
    spec = spec_with(decoder={**SPEC["decoder"], "topologySpreadConstraints": zone})
    sts = by_kind_name(builders.desired_children("llm", "ns", "u", spec))[("StatefulSet", "llm-decoder")]
    assert sts["spec"]["template"]["spec"]["topologySpreadConstraints"] == zone
