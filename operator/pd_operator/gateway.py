"""Pure builders for the way in: pd-gateway (ServiceAccount, Role, RoleBinding, Deployment,
Service, PodDisruptionBudget, NetworkPolicy) when `spec.gateway.enabled`, and the
NetworkPolicy every deployment's engines get.

Least privilege: the gateway's Role reads the deployment's pods and its API-keys Secret,
nothing else, and the Secret only once it opted in (label pdoperator.io/keys: "true"): a
PDDeployment must not be a way to hand some other Secret of the namespace to a pod. The
gateway holds only the agents' data-scope token (status, prefill, decode), so it cannot link,
unlink, drain or switch an engine; its image is the operator's configured one. The
NetworkPolicy admits the agent port from the operator (its namespace and labels together),
the gateway, the namespace's PDGateways and the deployment's own pods (verify probes and pull
notices go agent to agent), the datadist port from the deployment's own pods only, and the
agent's metrics port (its /metrics alone, not the API) from the operator and the configured
monitoring namespaces; egress from the engines goes to
the deployment's own pods (agent and datadist ports), DNS, and the rules spec.prefill.egress and
spec.decoder.egress add (a model store).

A gateway's pods serve the public API on GATEWAY_PORT (from anywhere) and /metrics and /stats,
which name every key and its usage, on GATEWAY_METRICS_PORT: their NetworkPolicy admits that
port from the operator and the configured monitoring namespaces only, and lets the pods reach
the engines' agent port, the API server (pods, StatefulSets, the keys Secret, the usage
ConfigMap) and DNS, nothing else."""
from __future__ import annotations

import copy
import hashlib
import json

from pd_contract import engine_env as ev
from pd_contract import gateway_env as gwenv
from pd_contract import mooncake
from pd_contract.names import (
    AGENT_METRICS_PORT,
    AGENT_PORT,
    GATEWAY_METRICS_PORT,
    GATEWAY_PORT,
    LABEL_DEPLOYMENT,
    LABEL_GATEWAY,
    LABEL_KEYS,
    LABEL_PDGATEWAY,
)

from .api import PDDeploymentSpec
from .config import OperatorConfig
from .objmeta import common_labels, harden, liveness_probe, object_meta
from .resources import with_defaults

# LABEL_GATEWAY is on gateway pods (not the engines' deployment label)
__all__ = ["AGENT_METRICS_PORT", "GATEWAY_METRICS_PORT", "GATEWAY_PORT", "LABEL_GATEWAY", "LABEL_KEYS",
           "gateway_network_policy", "gateway_objects", "metrics_scrapers", "network_policy"]
OPERATOR_POD_LABELS = {"app.kubernetes.io/name": "pd-operator"}
DNS_PORTS = [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]
# for the Prometheus convention of scraping annotated pods (a PodMonitor may use the port's name)
SCRAPE_ANNOTATIONS = {"prometheus.io/scrape": "true", "prometheus.io/port": str(GATEWAY_METRICS_PORT),
                      "prometheus.io/path": "/metrics"}


def gateway_name(name: str) -> str:
    return f"{name}-gateway"


def data_token_secret_name(name: str) -> str:
    return f"{name}-agent-data-token"


def gateway_image(spec: PDDeploymentSpec, configured: str | None = None) -> str:
    """spec.gateway.image (admission and the operator check it is allowed), else the operator's
    configured image, else (an install without one) spec.image's repository renamed pd-gateway
    with the same tag."""
    if spec.gateway and spec.gateway.image:
        return spec.gateway.image
    if configured:
        return configured
    head, _, last = spec.image.rpartition("/")
    tag = last.split("@", 1)[0].partition(":")[2]
    return f"{head + '/' if head else ''}pd-gateway{':' + tag if tag else ''}"


def vllm_port(spec: PDDeploymentSpec) -> int | None:
    """The port a gateway sends a deployment's requests to with vLLM's P-D protocol: spec.engine.port
    when the engines are vLLM's (None: the agents' API)."""
    e = spec.engine
    return e.port if e is not None and e.adapter == "vLLM" and e.port else None


def decoder_first(spec: PDDeploymentSpec) -> bool:
    """vLLM engines with vllm-ascend's layerwise Mooncake connector: a gateway sends each request to a
    decoder first, which posts its blocks to the gateway's metaserver."""
    return vllm_port(spec) is not None and spec.engine is not None and mooncake.decoder_first(spec.engine.kv_transfer)


# where the engines reach a gateway's pod (its metaserver)
POD_IP_ENV = {"name": gwenv.POD_IP, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}


def gateway_objects(name: str, namespace: str, spec: PDDeploymentSpec, owner: dict,
                    image: str | None = None, keys_allowed: bool = True,
                    config: OperatorConfig | None = None) -> list[dict]:
    """`keys_allowed` False (the Secret has not opted in): the objects stay, but the Role no
    longer names the Secret and no gateway pod runs, so access granted before is taken back
    without the operator needing delete rights."""
    gw = spec.gateway
    if gw is None or not gw.enabled:
        return []
    n = gateway_name(name)
    labels = {**common_labels(name), "app.kubernetes.io/component": "gateway"}
    pod_labels = {"app.kubernetes.io/name": "pd-gateway", "app.kubernetes.io/instance": name, LABEL_GATEWAY: name}
    rules = [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
             # a pod counts only if one of these controls it (labels alone do not make a member)
             {"apiGroups": ["apps"], "resources": ["statefulsets"], "verbs": ["get"],
              "resourceNames": [f"{name}-prefill", f"{name}-decoder"]}] + \
        ([{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"],
           "resourceNames": [gw.api_keys_secret]}] if keys_allowed else [])
    env = [
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": gwenv.PD_GATEWAY_DEPLOYMENT, "value": name},
        {"name": ev.PD_MODEL_NAME, "value": spec.model.name},
        {"name": gwenv.PD_MODEL_ALIASES, "value": json.dumps(spec.model.aliases or [])},
        {"name": gwenv.PD_GATEWAY_KEYS_SECRET, "value": gw.api_keys_secret},
        {"name": ev.PD_AGENT_DATA_TOKEN, "valueFrom": {"secretKeyRef": {"name": data_token_secret_name(name),
                                                                       "key": "token"}}},
        {"name": gwenv.PD_GATEWAY_RPM, "value": json.dumps(gw.rate_limits or {}, sort_keys=True)},
    ]
    port = vllm_port(spec)
    if port:
        env.append({"name": gwenv.PD_GATEWAY_ENGINE_PORT, "value": str(port)})
    if decoder_first(spec):
        env += [{"name": gwenv.PD_GATEWAY_DECODER_FIRST, "value": "1"}, POD_IP_ENV]
    tok = tokenizer_mount(name, spec)
    if tok is not None:
        for k, var in (("tokenizer", gwenv.PD_GATEWAY_TOKENIZER), ("chatTemplate", gwenv.PD_GATEWAY_CHAT_TEMPLATE),
                       ("bosToken", gwenv.PD_GATEWAY_BOS_TOKEN), ("eosToken", gwenv.PD_GATEWAY_EOS_TOKEN)):
            if k in tok[2]:
                env.append({"name": var, "value": tok[2][k]})
    config = config or OperatorConfig()
    meta = object_meta(n, namespace, owner, labels)
    resources = with_defaults(gw.resources.model_dump(exclude_none=True) if gw.resources else None,
                              config.gateway_resources)
    return workload(n, meta, rules, env, gateway_image(spec, image), gw.replicas if keys_allowed else 0,
                    {LABEL_GATEWAY: name}, pod_labels, resources, spec.image_pull_policy,
                    config.gateway_pull_secrets, [tok[:2]] if tok else []) + \
        [gateway_network_policy(meta, {LABEL_GATEWAY: name}, {"matchLabels": {LABEL_DEPLOYMENT: name}}, config,
                                [port] if port else None)]


TOKENIZERS_DIR = "/etc/pd-gateway/tokenizers"


def tokenizer_mount(deployment: str, spec: PDDeploymentSpec) -> tuple[dict, dict, dict] | None:
    """(volume, volumeMount, route settings) for a deployment's spec.model.tokenizer, mounted
    read-only in the gateway at TOKENIZERS_DIR/<deployment>; None without one."""
    t = spec.model.tokenizer
    if t is None:
        return None
    vol = f"tok-{hashlib.sha256(deployment.encode()).hexdigest()[:12]}"
    where = f"{TOKENIZERS_DIR}/{deployment}"
    if t.config_map is not None:   # optional: a missing one is the gateway's to report, not a pod that never starts
        volume = {"name": vol, "configMap": {"name": t.config_map.name, "optional": True,
                                             "items": [{"key": t.config_map.key, "path": "tokenizer.json"}]}}
        path = f"{where}/tokenizer.json"
    else:
        assert t.persistent_volume_claim is not None
        volume = {"name": vol, "persistentVolumeClaim": {"claimName": t.persistent_volume_claim.claim_name,
                                                         "readOnly": True}}
        path = f"{where}/{t.persistent_volume_claim.path}"
    route = {"tokenizer": path, **{k: v for k, v in (("chatTemplate", t.chat_template), ("bosToken", t.bos_token),
                                                      ("eosToken", t.eos_token)) if v}}
    return volume, {"name": vol, "mountPath": where, "readOnly": True}, route


def workload(n: str, meta: dict, rules: list[dict], env: list, image: str, replicas: int,
             select: dict[str, str], pod_labels: dict[str, str], resources: dict | None = None,
             pull_policy: str | None = None, pull_secrets: tuple[str, ...] = (),
             volumes: list[tuple[dict, dict]] | None = None) -> list[dict]:
    """A gateway's objects, whichever kind it serves (a deployment's own, or a PDGateway's): its
    ServiceAccount with `rules`, the Deployment of hardened pods selected by `select`, the Service,
    the PodDisruptionBudget."""
    namespace = meta["namespace"]
    m = lambda: copy.deepcopy(meta)  # noqa: E731 - each object its own metadata
    sa = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": m()}
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": m(), "rules": rules}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": m(),
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": n},
               "subjects": [{"kind": "ServiceAccount", "name": n, "namespace": namespace}]}
    container: dict = {"name": "gateway", "image": image}
    if pull_policy:
        container["imagePullPolicy"] = pull_policy
    ports = [{"name": "http", "containerPort": GATEWAY_PORT, "protocol": "TCP"},
             {"name": "metrics", "containerPort": GATEWAY_METRICS_PORT, "protocol": "TCP"}]
    # ready: keys loaded and engines seen (/healthz); alive: its loops run (/livez)
    container.update({"env": env, "ports": ports,
                      "readinessProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 2,
                                         "failureThreshold": 3, "timeoutSeconds": 2},
                      "livenessProbe": liveness_probe()})
    if resources:
        container["resources"] = resources
    pod_spec: dict = {"serviceAccountName": n, "containers": [container], "terminationGracePeriodSeconds": 30,
                      "enableServiceLinks": False, "automountServiceAccountToken": True}
    if pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in pull_secrets]
    harden(pod_spec, container)
    for volume, mount in volumes or []:   # the models' tokenizers
        pod_spec["volumes"].append(volume)
        container["volumeMounts"].append(mount)
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": m(),
                  "spec": {"replicas": replicas, "selector": {"matchLabels": select},
                           "template": {"metadata": {"labels": pod_labels, "annotations": dict(SCRAPE_ANNOTATIONS)},
                                        "spec": pod_spec}}}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": m(),
               "spec": {"selector": dict(select), "ports": [{"name": "http", "port": GATEWAY_PORT,
                                                             "targetPort": "http"}]}}
    # a node drain evicts one replica at a time (a single replica may still go: no drain blocks)
    budget = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": m(),
              "spec": {"selector": {"matchLabels": dict(select)}, "maxUnavailable": 1,
                       "unhealthyPodEvictionPolicy": "AlwaysAllow"}}
    return [sa, role, binding, deployment, service, budget]


def operator_peer(namespace: str) -> dict:
    """The operator's pods: its namespace and its labels together (labels alone would admit any
    pod that wears them, in any namespace)."""
    return {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
            "podSelector": {"matchLabels": OPERATOR_POD_LABELS}}


def metrics_scrapers(operator_namespace: str | None, metrics_namespaces: dict | None) -> list[dict]:
    """Who may reach a metrics port (the gateways' and the agents'): the operator's pods, and the
    pods of the namespaces the chart's networkPolicy.metricsNamespaceSelector selects."""
    return ([operator_peer(operator_namespace)] if operator_namespace else []) + \
        ([{"namespaceSelector": copy.deepcopy(metrics_namespaces)}] if metrics_namespaces else [])


def gateway_network_policy(meta: dict, select: dict[str, str], agents: dict | None,
                           config: OperatorConfig, engine_ports: list[int] | None = None) -> dict:
    """The gateway pods selected by `select`: the API port from anywhere (it is the public
    API), the metrics port from the operator (it reads /stats) and the monitoring namespaces;
    egress to the agent port of the pods `agents` selects (None: no engine yet), the API server,
    DNS; and to `engine_ports` of those pods (vLLM engines' own OpenAI API). Named after the gateway."""
    scrapers = metrics_scrapers(config.namespace, config.metrics_namespaces)
    ingress: list[dict] = [{"ports": [{"protocol": "TCP", "port": GATEWAY_PORT}]}]
    if scrapers:
        ingress.append({"from": scrapers, "ports": [{"protocol": "TCP", "port": GATEWAY_METRICS_PORT}]})
    api_server: dict = {"ports": [{"protocol": "TCP", "port": p} for p in config.api_server_ports]}
    if config.api_server_cidrs:
        api_server["to"] = [{"ipBlock": {"cidr": c}} for c in config.api_server_cidrs]
    ports = [{"protocol": "TCP", "port": p} for p in [AGENT_PORT, *(engine_ports or [])]]
    egress = ([{"to": [{"podSelector": agents}], "ports": ports}] if agents
              else []) + [api_server, {"ports": copy.deepcopy(DNS_PORTS)}]
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": copy.deepcopy(meta),
            "spec": {"podSelector": {"matchLabels": dict(select)}, "policyTypes": ["Ingress", "Egress"],
                     "ingress": ingress, "egress": egress}}


def network_policy(name: str, namespace: str, spec: PDDeploymentSpec, owner: dict,
                   operator_namespace: str | None = None, metrics_namespaces: dict | None = None) -> dict:
    """The operator is admitted by its namespace and its labels together (labels alone would
    admit any pod that wears them, in any namespace); an operator whose namespace is unknown
    (run outside the cluster) is not a pod and needs no rule. `metrics_namespaces` (a namespace
    selector) and the operator may reach the agents' metrics port, and only that port."""
    own = {"podSelector": {"matchLabels": {LABEL_DEPLOYMENT: name}}}
    # a PDGateway of the namespace may serve this deployment (it still needs the data token)
    agent_from = [own, {"podSelector": {"matchLabels": {LABEL_GATEWAY: name}}},
                  {"podSelector": {"matchExpressions": [{"key": LABEL_PDGATEWAY, "operator": "Exists"}]}}]
    if operator_namespace:
        agent_from.append(operator_peer(operator_namespace))
    ports = [{"protocol": "TCP", "port": AGENT_PORT}, {"protocol": "TCP", "port": spec.datadist.port}]
    ingress = [{"from": agent_from, "ports": [{"protocol": "TCP", "port": AGENT_PORT}]},
               {"from": [own], "ports": [{"protocol": "TCP", "port": spec.datadist.port}]}]
    if spec.engine is not None and spec.engine.port:
        # the server's own API (spec.engine.port): a router of its own, in this namespace
        ingress.append({"from": [{"podSelector": {}}], "ports": [{"protocol": "TCP", "port": spec.engine.port}]})
    if spec.engine is not None and mooncake.is_mooncake(spec.engine.kv_transfer):
        # Mooncake between the engines: the side channels (kvPort + rank), the transport's own ports
        # and the pair verification's requests to the other engine's OpenAI port
        lo, hi = mooncake.random_port_range(spec.ascend.npus_per_node if spec.ascend else
                                            mooncake.DEFAULT_NPUS_PER_NODE)
        kv = [{"protocol": "TCP", "port": spec.engine.kv_port,
               "endPort": spec.engine.kv_port + max(spec.tp("prefill"), spec.tp("decoder")) - 1},
              {"protocol": "TCP", "port": lo, "endPort": hi - 1}]
        ingress.append({"from": [own], "ports": kv})
        ports += kv + ([{"protocol": "TCP", "port": spec.engine.port}] if spec.engine.port else [])
    scrapers = metrics_scrapers(operator_namespace, metrics_namespaces)
    if scrapers:
        ingress.append({"from": scrapers, "ports": [{"protocol": "TCP", "port": AGENT_METRICS_PORT}]})
    egress = [{"to": [own], "ports": ports}, {"ports": copy.deepcopy(DNS_PORTS)}]
    if spec.engine is not None and mooncake.decoder_first(spec.engine.kv_transfer):
        # a decoder posts its blocks to the metaserver of the pd-gateway that sent it the request
        egress.append({"to": agent_from[1:3], "ports": [{"protocol": "TCP", "port": GATEWAY_PORT}]})
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": object_meta(f"{name}-engines", namespace, owner, common_labels(name)),
        "spec": {"podSelector": {"matchLabels": {LABEL_DEPLOYMENT: name}}, "policyTypes": ["Ingress", "Egress"],
                 "ingress": ingress,
                 # links, pulls, verify probes and pull notices go to the deployment's own pods
                 "egress": egress + extra_egress(spec)},
    }


def extra_egress(spec: PDDeploymentSpec) -> list[dict]:
    """spec.prefill.egress and spec.decoder.egress (e.g. a model store), once each: the one policy
    selects both groups' pods, so it allows the union."""
    out: list[dict] = []
    for rule in (spec.prefill.egress or []) + (spec.decoder.egress or []):
        if rule not in out:
            out.append(copy.deepcopy(rule))
    return out
