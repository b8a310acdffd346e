"""A PDGateway (pure): which PDDeployments it serves, the model each one serves, and the
objects that run pd-gateway in front of them all (ServiceAccount, Role, RoleBinding,
Deployment, Service `<name>` on port 8000, PodDisruptionBudget, NetworkPolicy, the usage
ConfigMap), and its status.

Least privilege, as for a deployment's own gateway: the Role reads pods, gets the selected
deployments' StatefulSets by name (membership is by controller, not labels), the keys Secret
only once it opted in (label pdoperator.io/keys: "true"), and gets and patches the one usage
ConfigMap. The gateway holds each deployment's data-scope token only (from its Secret, by
reference). Of deployments claiming one model name (or alias), the one that serves (the oldest
claim, if several or none do) gets it, and the others are named in a condition: a deployment
scaled to zero cannot take a served model offline."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from pd_contract import gateway_env as gwenv
from pd_contract.names import GATEWAY_PORT, LABEL_DEPLOYMENT, LABEL_KEYS, LABEL_PDGATEWAY

from .api import GROUP, VERSION, parse_spec
from .api_gateway import KIND, PDGatewaySpec, Selector
from .conditions import set_condition
from .config import OperatorConfig
from .gateway import (
    POD_IP_ENV,
    data_token_secret_name,
    decoder_first,
    gateway_network_policy,
    tokenizer_mount,
    vllm_port,
    workload,
)
from .resources import with_defaults


def usage_configmap_name(name: str) -> str:
    return f"{name}-usage"


def matches(labels: dict[str, str], selector: Selector | None) -> bool:
    """A Kubernetes label selector; none (or an empty one) selects everything."""
    if selector is None:
        return True
    for k, v in (selector.match_labels or {}).items():
        if labels.get(k) != v:
            return False
    for r in selector.match_expressions or []:
        has, value = r.key in labels, labels.get(r.key)
        ok = {"In": has and value in (r.values or []), "NotIn": not has or value not in (r.values or []),
              "Exists": has, "DoesNotExist": not has}[r.operator]
        if not ok:
            return False
    return True


@dataclass
class Served:
    model: str
    deployment: str
    aliases: list[str] = field(default_factory=list)
    engine_port: int | None = None            # vLLM engines: their OpenAI port (vLLM's P-D protocol)
    tokenizer: tuple[dict, dict, dict] | None = None   # spec.model.tokenizer: volume, mount, route settings
    decoder_first: bool = False               # vllm-ascend's layerwise Mooncake: the decoder first


@dataclass
class Routing:
    served: list[Served]                      # what the gateway routes
    conflicts: dict[str, list[str]]           # model name -> the deployments claiming it, the one routed first
    invalid: dict[str, str]                   # deployment -> why its spec cannot be used
    waiting: list[str] = field(default_factory=list)   # selected, its data token not there yet


def serving(deployment: dict) -> bool:
    """Ready engine pods in both roles (status.prefill and status.decoder, as the operator wrote)."""
    st = deployment.get("status") or {}
    return (st.get("prefill") or 0) > 0 and (st.get("decoder") or 0) > 0


# how long a model's owner keeps its name while it has no ready engines in a role (a restart, a
# roll): another deployment claiming the name takes it only past this
OWNER_OUTAGE_GRACE_S = 300.0


def current_owners(gw_status: dict | None) -> dict[str, str]:
    """Model name or alias -> the deployment the gateway routes it to now (its status.models)."""
    out: dict[str, str] = {}
    for m in (gw_status or {}).get("models") or []:
        for n in [m.get("model"), *(m.get("aliases") or [])]:
            if isinstance(n, str) and isinstance(m.get("deployment"), str):
                out[n] = m["deployment"]
    return out


def routing(deployments: list[dict], selector: Selector | None, tokens: set[str] | None = None,
            current: dict[str, str] | None = None, outage: dict[str, float] | None = None,
            grace: float = OWNER_OUTAGE_GRACE_S) -> Routing:
    """`tokens`: the deployments whose data-token Secret exists (None: all). A gateway pod reads
    the token at its start, so a deployment is routed once its token exists (the routes change,
    and the gateway rolls). A name (model or alias) claimed by several deployments goes to one
    that serves; among several (or none) that serve, to the oldest claim: a deployment scaled to
    zero, or one made later, cannot take a served model offline. `current`: the name's owner now
    (current_owners), which keeps it while it claims it and has not been out of service
    (`outage`: seconds without serving, by deployment) for `grace`: a brief outage of the owner
    does not hand its model to another claim."""
    claims: dict[str, list[dict]] = {}
    picked: list[tuple[str, str, list[str], int | None, tuple | None, bool]] = []
    invalid: dict[str, str] = {}
    for d in sorted(deployments, key=lambda d: d["metadata"]["name"]):
        meta = d["metadata"]
        if meta.get("deletionTimestamp") or not matches(meta.get("labels") or {}, selector):
            continue
        try:
            spec = parse_spec(d.get("spec") or {})
        except ValueError as e:
            invalid[meta["name"]] = str(e).splitlines()[0]
            continue
        names = [spec.model.name, *(spec.model.aliases or [])]
        for n in dict.fromkeys(names):
            claims.setdefault(n, []).append(d)
        picked.append((meta["name"], spec.model.name, list(spec.model.aliases or []), vllm_port(spec),
                       tokenizer_mount(meta["name"], spec), decoder_first(spec)))
    owner: dict[str, str] = {}
    conflicts: dict[str, list[str]] = {}
    for n, ds in claims.items():
        held = [d for d in ds if d["metadata"]["name"] == (current or {}).get(n)
                and (serving(d) or (outage or {}).get(d["metadata"]["name"], 0.0) < grace)]
        candidates = held or [d for d in ds if serving(d)] or ds
        win = min(candidates, key=lambda d: (d["metadata"].get("creationTimestamp") or "", d["metadata"]["name"]))
        owner[n] = win["metadata"]["name"]
        if len(ds) > 1:
            conflicts[n] = [owner[n], *(d["metadata"]["name"] for d in ds if d is not win)]
    served, waiting = [], []
    for dep, model, aliases, port, tok, first in picked:
        names = [n for n in dict.fromkeys([model, *aliases]) if owner.get(n) == dep]
        if not names:
            continue
        if tokens is not None and dep not in tokens:
            waiting.append(dep)
            continue
        served.append(Served(names[0], dep, names[1:], port, tok, first))
    return Routing(served, conflicts, invalid, waiting)


def owner_reference(name: str, uid: str) -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": name, "uid": uid,
            "controller": True, "blockOwnerDeletion": True}


def _meta(name: str, namespace: str, owner: dict, gateway: str) -> dict:
    labels = {"app.kubernetes.io/name": "pd-gateway", "app.kubernetes.io/instance": gateway,
              "app.kubernetes.io/managed-by": "pd-operator", LABEL_PDGATEWAY: gateway}
    return {"name": name, "namespace": namespace, "labels": labels, "ownerReferences": [owner]}


def key_policy_env(spec: PDGatewaySpec) -> str:
    return json.dumps({k: p.model_dump(by_alias=True, exclude_none=True, exclude_defaults=True)
                       for k, p in sorted((spec.keys or {}).items())}, sort_keys=True)


def objects(name: str, namespace: str, spec: PDGatewaySpec, owner: dict, r: Routing, image: str,
            keys_allowed: bool, config: OperatorConfig | None = None) -> list[dict]:
    """The gateway's objects. `keys_allowed` False: the Role does not name the Secret and no
    gateway pod runs (as for a deployment's own gateway). Its NetworkPolicy lets it reach the
    agents of the deployments it routes to, no others."""
    rules = [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
             {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "patch"],
              "resourceNames": [usage_configmap_name(name)]}]
    sts = [f"{s.deployment}-{g}" for s in r.served for g in ("prefill", "decoder")]
    if sts:
        rules.append({"apiGroups": ["apps"], "resources": ["statefulsets"], "verbs": ["get"], "resourceNames": sts})
    if keys_allowed:
        rules.append({"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"],
                      "resourceNames": [spec.api_keys_secret]})
    routes, env = [], [
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": gwenv.PD_GATEWAY_KEYS_SECRET, "value": spec.api_keys_secret},
        {"name": gwenv.PD_GATEWAY_KEY_POLICY, "value": key_policy_env(spec)},
        {"name": gwenv.PD_GATEWAY_USAGE_CONFIGMAP, "value": usage_configmap_name(name)},
    ]
    for s in r.served:
        # named after the deployment, so another deployment joining does not rename the others'
        token_env = gwenv.route_token_env(s.deployment)
        route: dict = {"model": s.model, "aliases": s.aliases, "deployment": s.deployment, "tokenEnv": token_env}
        if s.engine_port:
            route["enginePort"] = s.engine_port
        if s.decoder_first:
            route["decoderFirst"] = True
        if s.tokenizer:
            settings = dict(s.tokenizer[2])
            if "chatTemplate" in settings:   # in a variable of its own: one variable holds at most 128 KiB
                route["chatTemplateEnv"] = gwenv.route_template_env(s.deployment)
                env.append({"name": route["chatTemplateEnv"], "value": settings.pop("chatTemplate")})
            route.update(settings)
        routes.append(route)
        # optional: a deployment just selected may not have its token yet; its requests wait for it
        env.append({"name": token_env, "valueFrom": {"secretKeyRef": {
            "name": data_token_secret_name(s.deployment), "key": "token", "optional": True}}})
    env.insert(1, {"name": gwenv.PD_GATEWAY_ROUTES, "value": json.dumps(routes, sort_keys=True)})
    if any(s.decoder_first for s in r.served):
        env.append(POD_IP_ENV)      # where those engines post to the metaserver
    pod_labels = {"app.kubernetes.io/name": "pd-gateway", "app.kubernetes.io/instance": name, LABEL_PDGATEWAY: name}
    config = config or OperatorConfig()
    meta = _meta(name, namespace, owner, name)
    resources = with_defaults(spec.resources.model_dump(exclude_none=True) if spec.resources else None,
                              config.gateway_resources)
    agents = {"matchExpressions": [{"key": LABEL_DEPLOYMENT, "operator": "In",
                                    "values": sorted({s.deployment for s in r.served})}]} if r.served else None
    return workload(name, meta, rules, env, image, spec.replicas if keys_allowed else 0, {LABEL_PDGATEWAY: name},
                    pod_labels, resources, pull_secrets=config.gateway_pull_secrets,
                    volumes=[s.tokenizer[:2] for s in r.served if s.tokenizer]) + \
        [gateway_network_policy(meta, {LABEL_PDGATEWAY: name}, agents, config,
                                sorted({s.engine_port for s in r.served if s.engine_port}))]


def usage_configmap(name: str, namespace: str, owner: dict) -> dict:
    """Created once, never applied again: the gateway replicas own its data."""
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(usage_configmap_name(name), namespace,
                                                                       owner, name), "data": {}}


def keys_state(secret: dict | None, name: str) -> tuple[bool, str, str]:
    """(usable, reason, message) for the keys Secret."""
    if secret is None:
        return False, "KeysSecretNotFound", f"Secret {name} does not exist; create it with one data key per API key"
    if (secret["metadata"].get("labels") or {}).get(LABEL_KEYS) != "true":
        return False, "KeysSecretNotOptedIn", (f"Secret {name} is not labelled {LABEL_KEYS}=true; the gateway uses "
                                               f"a Secret only once it opted in (no pod runs until then)")
    return True, "KeysSecretReady", f"Secret {name} holds {len(secret.get('data') or {})} keys"


def status(gw: dict, r: Routing, keys: tuple[bool, str, str], dep_obj: dict | None, at: str) -> dict:
    """`at`: the time a condition that flips records (the pass's clock)."""
    meta, prev = gw["metadata"], gw.get("status") or {}
    gen = meta.get("generation")
    conds = prev.get("conditions") or []
    ok, reason, message = keys
    conds = set_condition(conds, "GatewayKeys", ok, reason, message, gen, at=at)
    if r.conflicts:
        msg = "; ".join(f"model {m!r} is claimed by {', '.join(ds)}: routed to {ds[0]}, {', '.join(ds[1:])} left "
                        f"out" for m, ds in sorted(r.conflicts.items()))
        conds = set_condition(conds, "ModelsServed", False, "ModelConflict",
                              f"{msg} (a claim that serves wins, else the oldest; rename a model or an alias, or "
                              f"narrow spec.selector)", gen, at=at)
    elif r.invalid:
        conds = set_condition(conds, "ModelsServed", False, "InvalidDeployment", "; ".join(
            f"{d}: {why}" for d, why in sorted(r.invalid.items())), gen, at=at)
    elif not r.served and r.waiting:
        conds = set_condition(conds, "ModelsServed", False, "WaitingForDeployments",
                              f"{', '.join(r.waiting)}: their data-scope token does not exist yet", gen, at=at)
    elif not r.served:
        conds = set_condition(conds, "ModelsServed", False, "NoDeployments",
                              "spec.selector selects no PDDeployment in this namespace", gen, at=at)
    else:
        conds = set_condition(conds, "ModelsServed", True, "Serving", ", ".join(
            f"{s.model} ({s.deployment})" for s in r.served), gen, at=at)
    st = (dep_obj or {}).get("status") or {}
    ready = st.get("readyReplicas") or 0
    want = (dep_obj or {}).get("spec", {}).get("replicas", 0)
    if not ok:
        conds = set_condition(conds, "Ready", False, reason, message, gen, at=at)
    elif ready < 1:
        conds = set_condition(conds, "Ready", False, "NoReadyReplica",
                              f"0/{want} gateway pods ready (see the pods labelled {LABEL_PDGATEWAY}={meta['name']})",
                              gen, at=at)
    else:
        conds = set_condition(conds, "Ready", True, "Serving", f"{ready}/{want} gateway pods ready", gen, at=at)
    healthy = ok and ready >= 1 and not r.conflicts and bool(r.served)
    phase = "Ready" if healthy else ("Degraded" if ready >= 1 or r.conflicts else "Pending")
    return {"phase": phase, "url": f"http://{meta['name']}.{meta['namespace']}.svc:{GATEWAY_PORT}/v1",
            "models": [{"model": s.model, "deployment": s.deployment, **({"aliases": s.aliases} if s.aliases else {})}
                       for s in r.served],
            "replicas": want, "readyReplicas": ready, "conditions": conds, "observedGeneration": gen}
