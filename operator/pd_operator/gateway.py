"""Pure builders for the way in: pd-gateway (ServiceAccount, Role, RoleBinding, Deployment,
Service) when `spec.gateway.enabled`, and the NetworkPolicy every deployment gets.

Least privilege: the gateway's Role reads the deployment's pods and its API-keys Secret,
nothing else, and the Secret only once it opted in (label pdoperator.io/keys: "true"): a
PDDeployment must not be a way to hand some other Secret of the namespace to a pod. The
gateway holds only the agents' data-scope token (status, prefill, decode), so it cannot link,
unlink, drain or switch an engine; its image is the operator's configured one. The
NetworkPolicy admits the agent port from the operator (its namespace and labels together),
the gateway, the namespace's PDGateways and the deployment's own pods (verify probes and pull
notices go agent to agent), and the datadist port from the deployment's own pods only; egress from the engines goes to
the deployment's own pods (agent and datadist ports) and DNS only."""
from __future__ import annotations

import json

from pd_contract.names import AGENT_PORT, GATEWAY_PORT, LABEL_DEPLOYMENT, LABEL_GATEWAY, LABEL_KEYS, LABEL_PDGATEWAY

from .api import PDDeploymentSpec
from .objmeta import common_labels, harden, object_meta

# LABEL_GATEWAY is on gateway pods (not the engines' deployment label)
__all__ = ["GATEWAY_PORT", "LABEL_GATEWAY", "LABEL_KEYS", "gateway_objects", "network_policy"]
OPERATOR_POD_LABELS = {"app.kubernetes.io/name": "pd-operator"}


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


def gateway_objects(name: str, namespace: str, spec: PDDeploymentSpec, owner: dict,
                    image: str | None = None, keys_allowed: bool = True) -> list[dict]:
    """`keys_allowed` False (the Secret has not opted in): the objects stay, but the Role no
    longer names the Secret and no gateway pod runs, so access granted before is taken back
    without the operator needing delete rights."""
    gw = spec.gateway
    if gw is None or not gw.enabled:
        return []
    n = gateway_name(name)
    labels = {**common_labels(name), "app.kubernetes.io/component": "gateway"}
    pod_labels = {"app.kubernetes.io/name": "pd-gateway", "app.kubernetes.io/instance": name, LABEL_GATEWAY: name}
    sa = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": object_meta(n, namespace, owner, labels)}
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": object_meta(n, namespace, owner, labels),
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
                      # a pod counts only if one of these controls it (labels alone do not make a member)
                      {"apiGroups": ["apps"], "resources": ["statefulsets"], "verbs": ["get"],
                       "resourceNames": [f"{name}-prefill", f"{name}-decoder"]}]
            + ([{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"],
                 "resourceNames": [gw.api_keys_secret]}] if keys_allowed else [])}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": object_meta(n, namespace, owner, labels),
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": n},
               "subjects": [{"kind": "ServiceAccount", "name": n, "namespace": namespace}]}
    env = [
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "PD_GATEWAY_DEPLOYMENT", "value": name},
        {"name": "PD_MODEL_NAME", "value": spec.model.name},
        {"name": "PD_MODEL_ALIASES", "value": json.dumps(spec.model.aliases or [])},
        {"name": "PD_GATEWAY_KEYS_SECRET", "value": gw.api_keys_secret},
        {"name": "PD_AGENT_DATA_TOKEN", "valueFrom": {"secretKeyRef": {"name": data_token_secret_name(name),
                                                                       "key": "token"}}},
        {"name": "PD_GATEWAY_RPM", "value": json.dumps(gw.rate_limits or {}, sort_keys=True)},
    ]
    container = {"name": "gateway", "image": gateway_image(spec, image), "imagePullPolicy": spec.image_pull_policy,
                 "env": env, "ports": [{"name": "http", "containerPort": GATEWAY_PORT, "protocol": "TCP"}],
                 "readinessProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 2,
                                    "failureThreshold": 3, "timeoutSeconds": 2}}
    if gw.resources:
        container["resources"] = gw.resources.model_dump(exclude_none=True)
    pod_spec = {"serviceAccountName": n, "containers": [container], "terminationGracePeriodSeconds": 30,
                "enableServiceLinks": False, "automountServiceAccountToken": True}
    harden(pod_spec, container)
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": object_meta(n, namespace, owner, labels),
        "spec": {"replicas": gw.replicas if keys_allowed else 0, "selector": {"matchLabels": {LABEL_GATEWAY: name}},
                 "template": {"metadata": {"labels": pod_labels}, "spec": pod_spec}},
    }
    service = {"apiVersion": "v1", "kind": "Service", "metadata": object_meta(n, namespace, owner, labels),
               "spec": {"selector": {LABEL_GATEWAY: name},
                        "ports": [{"name": "http", "port": GATEWAY_PORT, "targetPort": "http"}]}}
    return [sa, role, binding, deployment, service]


def network_policy(name: str, namespace: str, spec: PDDeploymentSpec, owner: dict,
                   operator_namespace: str | None = None) -> dict:
    """The operator is admitted by its namespace and its labels together (labels alone would
    admit any pod that wears them, in any namespace); an operator whose namespace is unknown
    (run outside the cluster) is not a pod and needs no rule."""
    own = {"podSelector": {"matchLabels": {LABEL_DEPLOYMENT: name}}}
    # a PDGateway of the namespace may serve this deployment (it still needs the data token)
    agent_from = [own, {"podSelector": {"matchLabels": {LABEL_GATEWAY: name}}},
                  {"podSelector": {"matchExpressions": [{"key": LABEL_PDGATEWAY, "operator": "Exists"}]}}]
    if operator_namespace:
        agent_from.append({"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": operator_namespace}},
                           "podSelector": {"matchLabels": OPERATOR_POD_LABELS}})
    ports = [{"protocol": "TCP", "port": AGENT_PORT}, {"protocol": "TCP", "port": spec.datadist.port}]
    dns = [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": object_meta(f"{name}-engines", namespace, owner, common_labels(name)),
        "spec": {"podSelector": {"matchLabels": {LABEL_DEPLOYMENT: name}}, "policyTypes": ["Ingress", "Egress"],
                 "ingress": [
                     {"from": agent_from, "ports": [{"protocol": "TCP", "port": AGENT_PORT}]},
                     {"from": [own], "ports": [{"protocol": "TCP", "port": spec.datadist.port}]},
                 ],
                 # links, pulls, verify probes and pull notices go to the deployment's own pods
                 "egress": [{"to": [own], "ports": ports}, {"ports": dns}]},
    }
