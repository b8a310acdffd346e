"""Pure builders: a validated PDDeployment -> the objects it owns (no I/O).

Per group a StatefulSet and a headless Service; role Services selecting on the mutable
``pdoperator.io/role`` label; a ConfigMap with the derived CacheDesc and model settings.
StatefulSet selectors use only the immutable labels."""
from __future__ import annotations

import copy
import hashlib
import json

from pd_contract import engine_env as ev
from pd_contract import mooncake
from pd_contract.agent_api import AgentPath
from pd_contract.engine_env import TOKEN_DIGEST_ENV
from pd_contract.names import (  # noqa: F401 (re-exported: the operator's modules take names from here)
    AGENT_METRICS_PORT,
    AGENT_PORT,
    ANNOTATION_ROLE,
    ASCEND_ANNOTATION,
    ENGINE_ROLE,
    GANG_GATE,
    LABEL_DEPLOYMENT,
    LABEL_GROUP,
    LABEL_ROLE,
    NPU_RESOURCE,
    POD_INDEX_LABEL,
    PODINFO_ASCEND,
    PODINFO_DIR,
)
from pd_contract.vllm import render_vllm_args

from .api import Ascend, Group, PDDeploymentSpec
from .cachedesc import DerivedCache, derive
from .config import OperatorConfig
from .gateway import gateway_objects, network_policy
from .objmeta import common_labels, harden, liveness_probe, object_meta, owner_reference
from .ranktable import mindie_pod_patch
from .resources import per_ranks, with_defaults

# ANNOTATION_ROLE: the role a pod's engine starts in (prefill | decoder): the pod template sets
# the group's home role, the switcher changes it on the pod at its switch_role step, and the
# container reads it at every start through the downward API, so a restarted container keeps
# its switched role.
GROUPS = ("prefill", "decoder")
DEFAULT_BASE = {"prefill": 0, "decoder": 1000}
TERMINATION_MARGIN_S = 10
# for the Prometheus convention of scraping annotated pods (the chart's PodMonitor uses the port's name)
ENGINE_SCRAPE_ANNOTATIONS = {"prometheus.io/scrape": "true", "prometheus.io/port": str(AGENT_METRICS_PORT),
                             "prometheus.io/path": AgentPath.METRICS}


def sts_name(name: str, group: str) -> str:
    return f"{name}-{group}"


def role_service_name(name: str, role: str) -> str:
    return f"{name}-{role}-role"


def config_map_name(name: str) -> str:
    return f"{name}-config"


def token_secret_name(name: str) -> str:
    return f"{name}-agent-token"


def peer_token_secret_name(name: str) -> str:
    """Pull notices between the deployment's own agents: a scope that may call /v1/notify only."""
    return f"{name}-agent-peer-token"


def cluster_id_base(spec: PDDeploymentSpec, group: str) -> int:
    g = spec.prefill if group == "prefill" else spec.decoder
    return g.cluster_id_base if g.cluster_id_base is not None else DEFAULT_BASE[group]


def cluster_id(spec: PDDeploymentSpec, group: str, index: int, rank: int = 0) -> int:
    """Stable per rank and independent of the pod's current role: group base + pod index x the
    group's TP + rank (a pod's ranks take a consecutive block; rank 0's id names the pod)."""
    return ev.cluster_id(cluster_id_base(spec, group), index, spec.tp(group), rank)


def npu_request(spec: PDDeploymentSpec, group: str, resource: str) -> int | None:
    """The NPUs the group's spec asks for (limits, else requests), if it names the resource."""
    g = spec.prefill if group == "prefill" else spec.decoder
    for part in (g.resources.limits, g.resources.requests) if g.resources else ():
        if part and resource in part:
            try:
                return int(part[resource])
            except (TypeError, ValueError):
                return -1
    return None


def npu_mismatch(spec: PDDeploymentSpec, resource: str) -> str | None:
    """A spec whose NPU request disagrees with its TP (one NPU per rank): the field, named."""
    for group in GROUPS:
        n = npu_request(spec, group, resource)
        if n is not None and n != spec.tp(group):
            return (f"spec.{group}.resources[{resource!r}] is {n} but a {group} pod runs {spec.tp(group)} "
                    f"tensor-parallel rank(s) (spec.{group}.tensorParallel, default "
                    f"spec.model.kvCache.tensorParallel): one NPU per rank; set it to {spec.tp(group)} or leave it out")
    return None


def ranked(spec: PDDeploymentSpec, group: str, resource: str) -> bool:
    """Pods whose engines run on NPUs (device IPs) or as several ranks: the agent resolves each
    rank's device from the device plugin's annotation. A single-rank simulator pod without NPUs
    keeps the pod IP and today's pod spec."""
    return spec.backend == "llm-datadist" or spec.tp(group) > 1 or spec.gang(group) \
        or bool(npu_request(spec, group, resource))


def selector_labels(name: str, group: str) -> dict[str, str]:
    return {LABEL_DEPLOYMENT: name, LABEL_GROUP: group}


def config_data(spec: PDDeploymentSpec, derived: DerivedCache) -> dict[str, str]:
    return {
        "cacheDesc": json.dumps(derived.agent_json(), sort_keys=True),
        "model": json.dumps(spec.model.model_dump(by_alias=True, exclude_none=True), sort_keys=True),
        "bytesPerToken": str(derived.bytes_per_token),
        "cacheBytes": str(derived.cache_bytes),
    }


def config_map(name: str, namespace: str, spec: PDDeploymentSpec, owner: dict) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": object_meta(config_map_name(name), namespace, owner, common_labels(name)),
            "data": config_data(spec, derive(spec.kv_cache_for("prefill")))}


def config_hash(spec: PDDeploymentSpec) -> str:
    data = config_data(spec, derive(spec.kv_cache_for("prefill")))
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def _env(name: str, spec: PDDeploymentSpec, group: str, resource: str = NPU_RESOURCE,
         token_digests: dict[str, str] | None = None, user: bool = True) -> list[dict]:
    field = lambda path: {"valueFrom": {"fieldRef": {"fieldPath": path}}}  # noqa: E731
    env: list[dict] = [
        {"name": ev.POD_NAME, **field("metadata.name")},
        {"name": ev.POD_NAMESPACE, **field("metadata.namespace")},
        {"name": ev.LLM_DATADIST_ROLE, **field(f"metadata.annotations['{ANNOTATION_ROLE}']")},
        # cluster_id = base + pod index x TP (+ rank); the agent computes LLM_DATADIST_CLUSTER_ID
        # from these (the downward API cannot add) and exports it to the engine's process.
        {"name": ev.LLM_DATADIST_CLUSTER_ID_BASE, "value": str(cluster_id_base(spec, group))},
        {"name": ev.LLM_DATADIST_POD_INDEX, **field(f"metadata.labels['{POD_INDEX_LABEL}']")},
        {"name": ev.LLM_DATADIST_IP, **field("status.podIP")},
        {"name": ev.LLM_DATADIST_PORT, "value": str(spec.datadist.port)},
        {"name": ev.LLM_DATADIST_MODEL_ID, "value": str(spec.model.model_id)},
        {"name": ev.LLM_DATADIST_CACHE_DESC, "valueFrom": {"configMapKeyRef": {
            "name": config_map_name(name), "key": "cacheDesc"}}},
        {"name": ev.LLM_DATADIST_LINK_TIMEOUT_MS, "value": str(spec.datadist.link_timeout_ms)},
        {"name": ev.LLM_DATADIST_SYNC_KV_TIMEOUT_MS, "value": str(spec.datadist.sync_kv_timeout_ms)},
        {"name": ev.PD_MODEL_NAME, "value": spec.model.name},
        {"name": ev.PD_BACKEND, "value": spec.backend},
        {"name": ev.PD_AGENT_PORT, "value": str(AGENT_PORT)},
        # /metrics alone: what monitoring is admitted to (the engines' NetworkPolicy), not the API
        {"name": ev.PD_AGENT_METRICS_PORT, "value": str(AGENT_METRICS_PORT)},
        {"name": ev.PD_AGENT_TOKEN, "valueFrom": {"secretKeyRef": {
            "name": token_secret_name(name), "key": "token"}}},
        {"name": ev.PD_AGENT_DATA_TOKEN, "valueFrom": {"secretKeyRef": {
            "name": f"{name}-agent-data-token", "key": "token"}}},
        # optional: pods of a deployment made before the peer scope existed start without it
        {"name": ev.PD_AGENT_PEER_TOKEN, "valueFrom": {"secretKeyRef": {
            "name": peer_token_secret_name(name), "key": "token", "optional": True}}},
    ]
    # the tokens' digests as the operator recorded them: an agent refuses to start with a token
    # someone else put in the Secret (deleted to rotate it, then made again by another party
    # first); a new token (a rotation) changes the template, so the pods roll onto it
    env += [{"name": TOKEN_DIGEST_ENV[role], "value": d} for role, d in sorted((token_digests or {}).items())
            if role in TOKEN_DIGEST_ENV]
    if ranked(spec, group, resource):
        env += [{"name": ev.PD_TENSOR_PARALLEL, "value": str(spec.tp(group))},
                {"name": ev.PD_DEVICE_ANNOTATION_FILE, "value": f"{PODINFO_DIR}/{PODINFO_ASCEND}"}]
        if spec.gang(group):   # only then: a spec without the layout fields renders as before
            env += [{"name": ev.PD_PODS_PER_INSTANCE, "value": str(spec.pods_per_instance(group))},
                    {"name": ev.PD_DATA_PARALLEL, "value": str(spec.group(group).data_parallel)},
                    {"name": ev.PD_TP_SIZE, "value": str(spec.tp_size(group))}]
        if spec.backend == "llm-datadist":
            env.append({"name": ev.PD_HCCN_CONF, "value": (spec.ascend or Ascend()).hccn_conf})
        if spec.datadist.preflight != "Enforce":   # the agent's default: no env, no roll for the default
            env.append({"name": ev.PD_PREFLIGHT, "value": spec.datadist.preflight.lower()})
    env.append({"name": ev.PD_DRAIN_TIMEOUT_S, "value": str(spec.drain_timeout_seconds)})
    # switch_role needs llm.EnableSwitchRole at init; set it only where the spec may switch
    switching = spec.rebalance is not None and spec.rebalance.method == "Switch"
    env.append({"name": ev.PD_ENABLE_SWITCH_ROLE, "value": "1" if switching else "0"})
    if spec.backend == "sim":
        reference = spec.sim is not None and spec.sim.engine == "reference"
        # the reference engine's caches hold its real KV: never scaled down
        scale = 1 if reference else derive(spec.kv_cache_for("prefill")).sim_memory_scale()
        env.append({"name": ev.PD_SIM_MEMORY_SCALE, "value": str(scale)})
        env += sim_env(spec)
    g = spec.prefill if group == "prefill" else spec.decoder
    return with_user_env(env, g) if user else env


def with_user_env(env: list[dict], g: Group) -> list[dict]:
    """The operator's env and then the group's: a name the group sets itself (a setting the operator
    only defaults, such as OPENBLAS_NUM_THREADS or vLLM's HCCL_IF_IP) is the group's, never twice (a
    name twice breaks the StatefulSet's apply). What the operator owns is refused at admission."""
    mine = user_env(g)
    names = {u["name"] for u in mine}
    return [x for x in env if x["name"] not in names] + mine


def user_env(g: Group) -> list[dict]:
    """spec.<group>.env as the container's: a literal (empty when neither is given) or a valueFrom.
    Admission refuses the operator's names (PD_*, LLM_DATADIST_*, POD_NAME, POD_NAMESPACE)."""
    return [{"name": e.name, "valueFrom": e.value_from.model_dump(by_alias=True, exclude_none=True)}
            if e.value_from is not None else {"name": e.name, "value": e.value or ""} for e in g.env or []]


def user_pod_fields(g: Group) -> tuple[dict, dict]:
    """What spec.<group> adds to the engine pods: (container fields, pod spec fields). The
    operator's own (container name, ports, probes, identity env, its volumes) are not among them."""
    dump = lambda items: [i.model_dump(by_alias=True, exclude_none=True) for i in items]  # noqa: E731
    container: dict = {}
    if g.command:
        container["command"] = list(g.command)
    if g.args:
        container["args"] = list(g.args)
    if g.volume_mounts:
        # a host directory is mounted read-only whatever the mount says: a writable one could hold
        # a symlink that a later hostPath under the allow-list follows out of it
        host = {v.name for v in g.volumes or [] if v.host_path is not None}
        container["volumeMounts"] = [{**m, "readOnly": True} if m["name"] in host else m
                                     for m in dump(g.volume_mounts)]
    pod: dict = {}
    if g.volumes:
        pod["volumes"] = dump(g.volumes)
    if g.image_pull_secrets:
        pod["imagePullSecrets"] = dump(g.image_pull_secrets)
    if g.affinity:
        pod["affinity"] = copy.deepcopy(g.affinity)
    if g.scheduler_name:
        pod["schedulerName"] = g.scheduler_name
    if g.priority_class_name:
        pod["priorityClassName"] = g.priority_class_name
    return container, pod


def sim_env(spec: PDDeploymentSpec) -> list[dict]:
    """spec.sim as the simulator's own settings (PD_SIM_*, PD_SIM_FAULT_*)."""
    if spec.sim is None:
        return []
    sim = spec.sim
    values: dict[str, object] = {ev.PD_SIM_TIME_SCALE: sim.time_scale,
                                 ev.PD_SIM_ENGINE_START_S: sim.engine_start_seconds}
    if sim.engine == "reference":
        values[ev.PD_SIM_ENGINE] = "reference"
        values[ev.PD_REFERENCE_MODEL] = json.dumps(reference_profile(spec), sort_keys=True)
        # small matrices: one BLAS thread per rank process, so ranks do not fight over the cores
        values["OPENBLAS_NUM_THREADS"] = 1
    for k, v in (sim.timing.model_dump(exclude_none=True) if sim.timing else {}).items():
        values[ev.PD_SIM_ + k.upper()] = v
    for k, v in (sim.faults.model_dump(exclude_none=True) if sim.faults else {}).items():
        values[ev.PD_SIM_FAULT_ + k.upper()] = int(v) if isinstance(v, bool) else \
            ",".join(map(str, v)) if isinstance(v, list) else v
    return [{"name": k, "value": str(v)} for k, v in values.items()]


def reference_profile(spec: PDDeploymentSpec) -> dict:
    """What the reference engine builds its model from (llm_datadist_sim.refmodel.Profile): the model
    profile, whole (every rank computes the whole model and keeps its own heads' shard)."""
    kv = spec.model.kv_cache
    out: dict[str, object] = {"attention": kv.attention, "numLayers": kv.num_layers, "numKvHeads": kv.num_kv_heads,
                              "headDim": kv.head_dim, "dtype": kv.dtype, "maxSeqLen": kv.max_seq_len,
                              "seed": spec.sim.seed if spec.sim else 0}
    if kv.latent_dim is not None:
        out["latentDim"] = kv.latent_dim
    return out


VLLM_SHORT_FLAGS = {"--tensor-parallel-size": "-tp"}   # what vLLM also accepts for a flag the operator adds

# the agent beside an inference server only relays: the engine container gets the group's resources
AGENT_BESIDE_RESOURCES = {"requests": {"cpu": "100m", "memory": "128Mi", "ephemeral-storage": "64Mi"},
                          "limits": {"cpu": "1", "memory": "512Mi", "ephemeral-storage": "256Mi"}}


def engine_container(name: str, spec: PDDeploymentSpec, group: str, resource: str,
                     token_digests: dict[str, str] | None, user: dict, mounts: list[dict],
                     resources: dict | None) -> dict:
    """spec.engine's container: the inference server's image with the group's command, args, env and
    mounts, the identity env the agent has (its rank processes read their identity from it and
    register with the agent at PD_AGENT_URL) and the group's resources (the NPUs are its). For
    adapter vLLM, the arguments and env that load pd_engine's KV connector (pd_contract.vllm)."""
    assert spec.engine is not None
    e = spec.engine
    g = spec.prefill if group == "prefill" else spec.decoder
    env = _env(name, spec, group, resource, token_digests, user=False)
    # $(LLM_DATADIST_IP) is the pod IP (defined above it): the agent listens there
    env.append({"name": ev.PD_AGENT_URL, "value": f"http://$({ev.LLM_DATADIST_IP}):{AGENT_PORT}"})
    args = list(user.get("args") or [])
    command = list(user.get("command") or [])
    if e.adapter == "vLLM":
        given = command + args
        vargs, venv = render_vllm_args(tensor_parallel=spec.tp(group), host_ip=f"$({ev.LLM_DATADIST_IP})")
        if mooncake.is_mooncake(e.kv_transfer):   # pd_engine.launch adds the role's --kv-transfer-config at each start
            vargs = vargs[:2]
            env += mooncake_env(spec)
            command = [*LAUNCHER, *(command or VLLM_SERVE)]
        for flag, value in zip(vargs[::2], vargs[1::2]):
            short = VLLM_SHORT_FLAGS.get(flag, flag)
            if not any(a in (flag, short) or a.startswith((flag + "=", short + "=")) for a in given):
                args += [flag, value]
        env += [{"name": k, "value": v} for k, v in venv.items() if k != ev.PD_RANKS_EXTERNAL]
    env = with_user_env(env, g)
    c: dict = {"name": "engine", "image": e.image, "imagePullPolicy": e.image_pull_policy or spec.image_pull_policy,
               "env": env}
    if e.port:
        c["ports"] = [{"name": "serving", "containerPort": e.port, "protocol": "TCP"}]
    if command:
        c["command"] = command
    if args:
        c["args"] = args
    c["volumeMounts"] = list(mounts) + list(user.get("volumeMounts") or [])
    if resources:
        c["resources"] = resources
    return c


# spec.engine.kvTransfer mooncake: the server runs under pd_engine's launcher (the image's vllm
# serve when the group names no command), which renders the role's --kv-transfer-config
LAUNCHER = ("python3", "-m", "pd_engine.launch", "--")
VLLM_HOST_IP = "VLLM_HOST_IP"        # vLLM's get_ip() reads it
VLLM_SERVE = ("vllm", "serve")


def mooncake_env(spec: PDDeploymentSpec) -> list[dict]:
    """What pd_engine.launch renders vllm-ascend's MooncakeConnectorV1 config from."""
    assert spec.engine is not None
    parallel = mooncake.extra_config(spec.tp("prefill"), spec.tp("decoder"))
    return [{"name": ev.PD_KV_TRANSFER, "value": spec.engine.kv_transfer},
            {"name": ev.PD_KV_PORT, "value": str(spec.engine.kv_port)},
            {"name": ev.PD_KV_PARALLEL, "value": json.dumps(parallel, separators=(",", ":"), sort_keys=True)},
            {"name": ev.PD_ENGINE_PORT, "value": str(spec.engine.port or "")},
            # the address vLLM names as the side channel's host (remote_host): the pod's, not a guess
            {"name": VLLM_HOST_IP, "value": f"$({ev.LLM_DATADIST_IP})"}]


def unique_by_name(items: list[dict]) -> list[dict]:
    seen: set[str] = set()
    out = []
    for i in items:
        if i["name"] not in seen:
            seen.add(i["name"])
            out.append(i)
    return out


def termination_grace_seconds(spec: PDDeploymentSpec) -> int:
    """The agent drains for at most drainTimeoutSeconds after SIGTERM; the rest is shutdown."""
    return spec.drain_timeout_seconds + TERMINATION_MARGIN_S


def _ascend_volumes(spec: PDDeploymentSpec) -> tuple[list[dict], list[dict]]:
    """Host paths the real library needs: /etc/hccn.conf (device IPs) and the driver."""
    if spec.backend != "llm-datadist":
        return [], []
    a = spec.ascend or Ascend()
    paths = [(a.hccn_conf, "File"), (a.driver_path, "Directory")] + [(p, "") for p in a.extra_host_paths]
    volumes, mounts = [], []
    for i, (path, typ) in enumerate(paths):
        vol = {"name": f"ascend-{i}", "hostPath": {"path": path, **({"type": typ} if typ else {})}}
        volumes.append(vol)
        mounts.append({"name": f"ascend-{i}", "mountPath": path, "readOnly": True})
    return volumes, mounts


def _podinfo_volume() -> tuple[dict, dict]:
    """The device plugin's annotation as a file that follows it (a downwardAPI volume)."""
    vol = {"name": "podinfo", "downwardAPI": {"items": [
        {"path": PODINFO_ASCEND, "fieldRef": {"fieldPath": f"metadata.annotations['{ASCEND_ANNOTATION}']"}}]}}
    return vol, {"name": "podinfo", "mountPath": PODINFO_DIR, "readOnly": True}


def default_resources(backend: str, tp: int, config: OperatorConfig | None = None) -> dict:
    """The configured per-rank defaults of the backend (config.DEFAULT_ENGINE_RESOURCES unless
    the chart says), times the ranks the agent container runs."""
    per_rank = (config or OperatorConfig()).engine_resources.get(backend) or {}
    return per_ranks(per_rank, tp)


def _resources(spec: PDDeploymentSpec, group: str, resource: str, config: OperatorConfig | None = None) -> dict | None:
    """The group's resources, each request and limit defaulted per rank where the spec leaves it
    unset; on the real backend, one NPU per rank unless the spec says."""
    g = spec.prefill if group == "prefill" else spec.decoder
    given = g.resources.model_dump(exclude_none=True) if g.resources else {}
    out = with_defaults(given, default_resources(spec.backend, spec.tp(group), config)) or {}
    if spec.backend == "llm-datadist" and npu_request(spec, group, resource) is None:
        n = spec.tp(group)
        out = {**out, "limits": {**out.get("limits", {}), resource: n},
               "requests": {**out.get("requests", {}), resource: n}}
    return out or None


def statefulset(name: str, namespace: str, spec: PDDeploymentSpec, group: str, owner: dict,
                decided: dict | None = None, resource: str = NPU_RESOURCE,
                config: OperatorConfig | None = None, token_digests: dict[str, str] | None = None) -> dict:
    labels = {**common_labels(name), **selector_labels(name, group)}
    return {
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": object_meta(sts_name(name, group), namespace, owner, labels),
        "spec": {
            "replicas": spec.pod_sizes(decided)[group],
            "serviceName": sts_name(name, group),
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector_labels(name, group)},
            "template": {
                "metadata": {"labels": {**labels, LABEL_ROLE: group},
                             "annotations": {"pdoperator.io/config-hash": config_hash(spec),
                                             ANNOTATION_ROLE: group, **ENGINE_SCRAPE_ANNOTATIONS}},
                "spec": engine_pod_spec(name, spec, group, resource, config or OperatorConfig(npu_resource=resource),
                                        token_digests),
            },
        },
    }


def agent_container(name: str, spec: PDDeploymentSpec, group: str, resource: str,
                    token_digests: dict[str, str] | None, extra_env: list[dict], beside: bool) -> dict:
    """The agent's container: the operator's identity env, ports and probes (and, with an inference
    server beside it, no user field: it waits for that server's ranks)."""
    return {
        "name": "agent",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "env": _env(name, spec, group, resource, token_digests, user=not beside) + extra_env
        + ([{"name": ev.PD_RANKS_EXTERNAL, "value": "1"}] if beside else []),
        "ports": [{"name": "http", "containerPort": AGENT_PORT, "protocol": "TCP"},
                  {"name": "datadist", "containerPort": spec.datadist.port, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": AGENT_METRICS_PORT, "protocol": "TCP"}],
        # ready: the engine is initialised; alive: the agent answers (an engine that cannot init
        # yet is retried in place, a restart would not help it)
        "readinessProbe": {"httpGet": {"path": AgentPath.HEALTHZ, "port": "http"},
                           "periodSeconds": 2, "failureThreshold": 3, "timeoutSeconds": 2},
        "livenessProbe": liveness_probe(path=None),
    }


def engine_pod_spec(name: str, spec: PDDeploymentSpec, group: str, resource: str, config: OperatorConfig,
                    token_digests: dict[str, str] | None) -> dict:
    g = spec.prefill if group == "prefill" else spec.decoder
    volumes, mounts = _ascend_volumes(spec)
    if ranked(spec, group, resource):
        vol, mount = _podinfo_volume()
        volumes, mounts = volumes + [vol], mounts + [mount]
    mindie_env, mindie_volumes, mindie_mounts = mindie_pod_patch(spec, name)   # spec.mindie: ranktable.py
    volumes, mounts = volumes + mindie_volumes, mounts + mindie_mounts
    beside = spec.engine is not None    # the inference server runs in a container of its own
    container = agent_container(name, spec, group, resource, token_digests, mindie_env, beside)
    resources = _resources(spec, group, resource, config)
    user_container, user_pod = user_pod_fields(g)
    volumes = volumes + user_pod.pop("volumes", [])
    containers = [container]
    if beside:
        containers.append(engine_container(name, spec, group, resource, token_digests, user_container, mounts,
                                           resources))
        container["resources"] = AGENT_BESIDE_RESOURCES
    else:
        if resources:
            container["resources"] = resources
        # a command of the spec's own (it starts the agent, which starts the engine) and its mounts
        container.update({k: v for k, v in user_container.items() if k in ("command", "args")})
        mounts = mounts + user_container.get("volumeMounts", [])
    if mounts:
        container["volumeMounts"] = mounts
    # engines never call the API server: no ServiceAccount token in them
    pod_spec: dict = {"containers": containers, "terminationGracePeriodSeconds": termination_grace_seconds(spec),
                      "enableServiceLinks": False, "automountServiceAccountToken": False}
    if volumes:
        pod_spec["volumes"] = volumes
    for c in containers:
        if spec.backend == "llm-datadist":
            harden(pod_spec, c, non_root=False, user=config.engine_user, group=config.engine_group)
        else:
            harden(pod_spec, c)
    pod_spec["volumes"] = unique_by_name(pod_spec["volumes"])   # harden adds /tmp's emptyDir per container
    if not g.read_only_root_filesystem:   # the opt-out: a writable root, the rest of the hardening stays
        containers[-1]["securityContext"]["readOnlyRootFilesystem"] = False
    pod_spec.update(user_pod)
    # one node's failure must not take a whole group: spread it (soft, so a small cluster still fits)
    pod_spec["topologySpreadConstraints"] = g.topology_spread_constraints or [
        {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway",
         "labelSelector": {"matchLabels": selector_labels(name, group)}}]
    if g.pods_per_instance > 1:   # placed all or none: the operator lifts the gate from an instance's pods at once
        pod_spec["schedulingGates"] = [{"name": GANG_GATE}]
    if g.node_selector:
        pod_spec["nodeSelector"] = g.node_selector
    if g.tolerations:
        pod_spec["tolerations"] = g.tolerations
    return pod_spec


def headless_service(name: str, namespace: str, spec: PDDeploymentSpec, group: str, owner: dict) -> dict:
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": object_meta(sts_name(name, group), namespace, owner,
                          {**common_labels(name), **selector_labels(name, group)}),
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                 "selector": selector_labels(name, group),
                 "ports": [{"name": "http", "port": AGENT_PORT, "targetPort": "http"},
                           {"name": "datadist", "port": spec.datadist.port, "targetPort": "datadist"}]},
    }


def role_service(name: str, namespace: str, role: str, owner: dict, engine_port: int | None = None) -> dict:
    """Routes by *current* role, so traffic follows a live switch with no restart; with an
    inference server of its own (spec.engine.port), its API port too."""
    ports = [{"name": "http", "port": AGENT_PORT, "targetPort": "http"}]
    if engine_port:
        ports.append({"name": "serving", "port": engine_port, "targetPort": "serving"})
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": object_meta(role_service_name(name, role), namespace, owner, common_labels(name)),
        "spec": {"selector": {LABEL_DEPLOYMENT: name, LABEL_ROLE: role}, "ports": ports},
    }


def min_available(spec: PDDeploymentSpec, role: str, serving: int) -> int:
    """A role's PodDisruptionBudget: evictions one at a time, and never below the role's
    minimum (rebalance.minPrefill/minDecoder, else 1). `serving`: the pods labelled with the role
    now; a switching pod carries neither role label, so it already counts as unavailable."""
    rb = spec.rebalance
    floor = (rb.min_prefill if role == "prefill" else rb.min_decoder) if rb is not None else 1
    k = spec.pods_per_instance(role)   # an instance of several pods: evicting one takes all of it
    return max(floor * k, (serving - 1) * k, 0)


def disruption_budget(name: str, namespace: str, spec: PDDeploymentSpec, role: str, owner: dict,
                      serving: int) -> dict:
    """By role, not by group: what must survive a drain is serving capacity per role, and a pod
    that switched serves its new role."""
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": object_meta(f"{name}-{role}", namespace, owner, common_labels(name)),
            "spec": {"selector": {"matchLabels": {LABEL_DEPLOYMENT: name, LABEL_ROLE: role}},
                     "minAvailable": min_available(spec, role, serving),
                     # a pod that is not Ready (starting, crash-looping) may be evicted regardless
                     "unhealthyPodEvictionPolicy": "AlwaysAllow"}}


def token_secret(name: str, namespace: str, token: str, owner: dict, secret_name: str | None = None) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": object_meta(secret_name or token_secret_name(name), namespace, owner, common_labels(name)),
            "stringData": {"token": token}}


def desired_children(name: str, namespace: str, uid: str, spec: PDDeploymentSpec,
                     decided: dict | None = None, resource: str = NPU_RESOURCE,
                     config: OperatorConfig | None = None, keys_allowed: bool = True,
                     serving: dict[str, int] | None = None, token_digests: dict[str, str] | None = None
                     ) -> list[dict]:
    """Everything the operator applies for one PDDeployment, in apply order: a pure function of
    the spec, the operator's configuration and the group sizes the operator decided (method
    Replace), so drift repair keeps the decision. `keys_allowed`: the gateway's keys Secret
    opted in (else the gateway is not given it). `serving`: pods per role label now (the
    disruption budgets; default the groups' sizes). `token_digests`: status.tokenDigests, which
    the agents check their tokens against."""
    config = config or OperatorConfig(npu_resource=resource)
    owner = owner_reference(name, uid)
    out = [config_map(name, namespace, spec, owner)]
    for group in GROUPS:
        out.append(headless_service(name, namespace, spec, group, owner))
    for role in GROUPS:
        out.append(role_service(name, namespace, role, owner, spec.engine.port if spec.engine else None))
    for group in GROUPS:
        out.append(statefulset(name, namespace, spec, group, owner, decided, resource, config, token_digests))
    serving = serving if serving is not None else spec.group_sizes(decided)
    for role in GROUPS:
        out.append(disruption_budget(name, namespace, spec, role, owner, serving.get(role, 0)))
    out.append(network_policy(name, namespace, spec, owner, config.namespace, config.metrics_namespaces))
    return out + gateway_objects(name, namespace, spec, owner, config.gateway_image, keys_allowed, config)
