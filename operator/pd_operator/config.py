"""The operator's configuration (pure once read): what the cluster admin allows, set by the
chart's values, never by a PDDeployment. A PDDeployment's author may ask for host paths and a
gateway image; what they may get is this allow-list. The chart passes the same values to a
ValidatingAdmissionPolicy (its ConfigMap is the policy's params), so a spec outside them is
refused at admission; the operator checks again, for installs without the policy."""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from pd_contract.names import NPU_RESOURCE

from .api import Ascend, PDDeploymentSpec

# the paths the real llm_datadist needs by default (Ascend's defaults); an admin may list others
DEFAULT_HOST_PATHS = (Ascend().hccn_conf, Ascend().driver_path, *Ascend().extra_host_paths)

# What a container gets where its spec leaves a resource unset (the chart's values
# engine.resources and gateway.resources; these are their defaults, for installs without it).
# Engines: per tensor-parallel rank, by backend. The simulator's engine holds at most 64 MiB of
# cache bytes plus an interpreter and one BLAS thread; a real engine's host memory depends on
# the model, so its limits are a ceiling for a large one, to be set per deployment.
DEFAULT_ENGINE_RESOURCES: dict[str, dict[str, dict[str, str]]] = {
    "sim": {"requests": {"cpu": "100m", "memory": "256Mi", "ephemeral-storage": "64Mi"},
            "limits": {"cpu": "1", "memory": "1024Mi", "ephemeral-storage": "256Mi"}},
    "llm-datadist": {"requests": {"cpu": "1000m", "memory": "8192Mi", "ephemeral-storage": "1Gi"},
                     "limits": {"cpu": "8", "memory": "64Gi", "ephemeral-storage": "8Gi"}},
}
# pd-gateway: its memory is bounded by the body bytes it holds (pd_gateway.server
# MAX_BODY_BYTES_IN_FLIGHT, at most about 650 MiB with their parses) plus about 150 MiB of its own
DEFAULT_GATEWAY_RESOURCES: dict[str, dict[str, str]] = {
    "requests": {"cpu": "100m", "memory": "256Mi", "ephemeral-storage": "64Mi"},
    "limits": {"cpu": "2", "memory": "1Gi", "ephemeral-storage": "256Mi"},
}
# the namespaces whose pods may scrape the gateways' metrics port (besides the operator)
DEFAULT_METRICS_NAMESPACES: dict = {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
# where the gateways reach the API server: its Service's port and the usual ports it listens on
# (NetworkPolicies see the address after the Service's translation); no CIDRs: any address
DEFAULT_API_SERVER_PORTS = (443, 6443)
# scheduling a PDDeployment's author may ask for (chart values scheduling.*): any priority class
# but the system ones (which preempt everything); the default scheduler only
SYSTEM_PRIORITY_PREFIX = "system-"
DEFAULT_SCHEDULER_NAMES = ("default-scheduler",)
# hostPath types that create what they name on the node: refused, an admin makes host paths
CREATING_HOST_PATH_TYPES = ("DirectoryOrCreate", "FileOrCreate")


def _list(raw: str | None) -> tuple[str, ...] | None:
    if raw is None:
        return None
    return tuple(p.strip() for p in raw.replace("\n", ",").split(",") if p.strip())


def _int(raw: str | None) -> int | None:
    return int(raw) if raw and raw.strip().lstrip("-").isdigit() else None


def _json(env: Mapping[str, str], name: str, default):
    """A JSON value of the configuration (the chart writes them with toJson); unset or empty:
    the default. A bad one stops the operator, naming it, rather than run with a guess."""
    raw = (env.get(name) or "").strip()
    if not raw:
        return default
    try:
        return json.loads(raw)
    except ValueError as e:
        raise SystemExit(f"pd_operator: {name} is not JSON ({e}): {raw[:200]!r}") from None


@dataclass(frozen=True)
class OperatorConfig:
    npu_resource: str = NPU_RESOURCE
    allowed_host_paths: tuple[str, ...] = DEFAULT_HOST_PATHS
    # the gateway's image; None: spec.image's repository renamed pd-gateway (an install without
    # the chart). spec.gateway.image must be one of allowed_gateway_images (or the configured one).
    gateway_image: str | None = None
    allowed_gateway_images: tuple[str, ...] = ()
    # host paths spec.prefill/decoder.volumes[].hostPath may name (chart value engine.allowedHostPaths):
    # none unless the admin lists some; a PersistentVolume is the way that needs no allow-list
    engine_host_paths: tuple[str, ...] = ()
    # Secrets the gateways' pods pull their image with (chart value imagePullSecrets): names, each in
    # the gateway's own namespace
    gateway_pull_secrets: tuple[str, ...] = ()
    namespace: str | None = None          # where the operator runs: its NetworkPolicy peer
    # the user and group real-backend engines run as (the NPU driver's, HwHiAiUser); None keeps
    # the image's user, which only an admin may choose
    engine_user: int | None = None
    engine_group: int | None = None
    engine_resources: dict = field(default_factory=lambda: DEFAULT_ENGINE_RESOURCES, hash=False)
    gateway_resources: dict = field(default_factory=lambda: DEFAULT_GATEWAY_RESOURCES, hash=False)
    # the gateways' NetworkPolicy: who may scrape the metrics port (a namespace selector; None:
    # the operator only), and where the API server is (CIDRs; none: any address on its ports)
    metrics_namespaces: dict | None = field(default_factory=lambda: DEFAULT_METRICS_NAMESPACES, hash=False)
    api_server_cidrs: tuple[str, ...] = ()
    api_server_ports: tuple[int, ...] = DEFAULT_API_SERVER_PORTS
    # priority classes spec.*.priorityClassName may name (None: any but system-*), scheduler names
    # spec.*.schedulerName may name, and whether affinity terms may select pods of other namespaces
    allowed_priority_classes: tuple[str, ...] | None = None
    allowed_scheduler_names: tuple[str, ...] = DEFAULT_SCHEDULER_NAMES
    cross_namespace_affinity: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> OperatorConfig:
        paths = _list(env.get("PD_OPERATOR_ALLOWED_HOST_PATHS"))
        return cls(npu_resource=env.get("PD_OPERATOR_NPU_RESOURCE") or NPU_RESOURCE,
                   allowed_host_paths=DEFAULT_HOST_PATHS if paths is None else paths,
                   gateway_image=env.get("PD_OPERATOR_GATEWAY_IMAGE") or None,
                   allowed_gateway_images=_list(env.get("PD_OPERATOR_ALLOWED_GATEWAY_IMAGES")) or (),
                   engine_host_paths=_list(env.get("PD_OPERATOR_ENGINE_ALLOWED_HOST_PATHS")) or (),
                   gateway_pull_secrets=_list(env.get("PD_OPERATOR_GATEWAY_IMAGE_PULL_SECRETS")) or (),
                   namespace=env.get("PD_OPERATOR_NAMESPACE") or env.get("POD_NAMESPACE") or None,
                   engine_user=_int(env.get("PD_OPERATOR_ENGINE_USER")),
                   engine_group=_int(env.get("PD_OPERATOR_ENGINE_GROUP")),
                   engine_resources=_json(env, "PD_OPERATOR_ENGINE_RESOURCES", DEFAULT_ENGINE_RESOURCES),
                   gateway_resources=_json(env, "PD_OPERATOR_GATEWAY_RESOURCES", DEFAULT_GATEWAY_RESOURCES),
                   metrics_namespaces=_json(env, "PD_OPERATOR_METRICS_NAMESPACE_SELECTOR", DEFAULT_METRICS_NAMESPACES)
                   or None,
                   api_server_cidrs=_list(env.get("PD_OPERATOR_API_SERVER_CIDRS")) or (),
                   api_server_ports=tuple(int(p) for p in _list(env.get("PD_OPERATOR_API_SERVER_PORTS")) or ())
                   or DEFAULT_API_SERVER_PORTS,
                   allowed_priority_classes=_list(env.get("PD_OPERATOR_ALLOWED_PRIORITY_CLASSES") or None),
                   allowed_scheduler_names=_list(env.get("PD_OPERATOR_ALLOWED_SCHEDULER_NAMES") or None)
                   or DEFAULT_SCHEDULER_NAMES,
                   cross_namespace_affinity=(env.get("PD_OPERATOR_CROSS_NAMESPACE_AFFINITY") or "").lower()
                   in ("1", "true", "yes"))


def path_allowed(path: str, allowed: tuple[str, ...]) -> bool:
    """The path is an allowed one or under an allowed directory. `..` never gets here: the
    CRD's pattern refuses it (and so does this)."""
    if "/../" in f"{path}/" or "/./" in f"{path}/":
        return False
    return any(path == a or path.startswith(a.rstrip("/") + "/") for a in allowed)


def ascend_mount_paths(spec: PDDeploymentSpec) -> tuple[str, ...]:
    """Where the operator mounts the Ascend host paths in the engine pods (backend llm-datadist)."""
    if spec.backend != "llm-datadist":
        return ()
    a = spec.ascend or Ascend()
    return (a.hccn_conf, a.driver_path, *a.extra_host_paths)


def _affinity_namespaces(affinity: dict | None, namespace: str | None) -> list[str]:
    """Where pod affinity or anti-affinity terms select pods of other namespaces than the
    deployment's own: `<field>: why` each."""
    found = []
    for kind in ("podAffinity", "podAntiAffinity"):
        rules = (affinity or {}).get(kind) or {}
        if not isinstance(rules, dict):
            continue
        terms = [(f"{kind}.requiredDuringSchedulingIgnoredDuringExecution[{i}]", t)
                 for i, t in enumerate(rules.get("requiredDuringSchedulingIgnoredDuringExecution") or [])]
        terms += [(f"{kind}.preferredDuringSchedulingIgnoredDuringExecution[{i}].podAffinityTerm",
                   (t or {}).get("podAffinityTerm") if isinstance(t, dict) else None)
                  for i, t in enumerate(rules.get("preferredDuringSchedulingIgnoredDuringExecution") or [])]
        for where, term in terms:
            if not isinstance(term, dict):
                continue
            if term.get("namespaceSelector") is not None:
                found.append(f"{where}.namespaceSelector: selects pods of other namespaces")
            listed = term.get("namespaces")
            others = [n for n in listed if n != namespace] if isinstance(listed, list) else []
            if others:
                found.append(f"{where}.namespaces: names {', '.join(map(str, others[:5]))}")
    return found


def _scheduling(group: str, g, config: OperatorConfig, namespace: str | None) -> list[str]:
    """What a group's scheduling asks for beyond the admin's allow-lists."""
    problems = []
    pc = g.priority_class_name
    if pc and (pc not in config.allowed_priority_classes if config.allowed_priority_classes is not None
               else pc.startswith(SYSTEM_PRIORITY_PREFIX)):
        allowed = (", ".join(config.allowed_priority_classes) or "none") if config.allowed_priority_classes \
            is not None else f"any but {SYSTEM_PRIORITY_PREFIX}*"
        problems.append(f"spec.{group}.priorityClassName: {pc} is not allowed (allowed: {allowed}; chart value "
                        f"scheduling.allowedPriorityClasses)")
    if g.scheduler_name and g.scheduler_name not in config.allowed_scheduler_names:
        problems.append(f"spec.{group}.schedulerName: {g.scheduler_name} is not allowed (allowed: "
                        f"{', '.join(config.allowed_scheduler_names) or 'none'}; chart value "
                        f"scheduling.allowedSchedulerNames)")
    if not config.cross_namespace_affinity:
        problems += [f"spec.{group}.affinity.{why}, which is not allowed (chart value "
                     f"scheduling.crossNamespaceAffinity)" for why in _affinity_namespaces(g.affinity, namespace)]
    for i, v in enumerate(g.volumes or []):
        if v.host_path is not None and v.host_path.type in CREATING_HOST_PATH_TYPES:
            problems.append(f"spec.{group}.volumes[{i}].hostPath.type: {v.host_path.type} would create the path "
                            f"on the node; use Directory or File (an admin makes host paths)")
    return problems


def not_allowed(spec: PDDeploymentSpec, config: OperatorConfig, namespace: str | None = None) -> str | None:
    """Why the spec asks for more than the operator's configuration allows, naming the field
    and the allow-list; None if it does not. `namespace`: the deployment's (affinity terms may
    select pods there)."""
    problems = []
    if spec.ascend is not None:
        asked = [("spec.ascend.hccnConf", spec.ascend.hccn_conf), ("spec.ascend.driverPath", spec.ascend.driver_path)]
        asked += [(f"spec.ascend.extraHostPaths[{i}]", p) for i, p in enumerate(spec.ascend.extra_host_paths)]
        for fld, path in asked:
            if not path_allowed(path, config.allowed_host_paths):
                problems.append(f"{fld}: host path {path} is not allowed (allowed: "
                                f"{', '.join(config.allowed_host_paths) or 'none'})")
    elif spec.backend == "llm-datadist":
        for path in DEFAULT_HOST_PATHS:
            if not path_allowed(path, config.allowed_host_paths):
                problems.append(f"spec.ascend (default): host path {path} is not allowed (allowed: "
                                f"{', '.join(config.allowed_host_paths) or 'none'}); list the paths this "
                                f"cluster allows in spec.ascend")
    for group in ("prefill", "decoder"):
        g = spec.prefill if group == "prefill" else spec.decoder
        for i, v in enumerate(g.volumes or []):
            if v.host_path is not None and not path_allowed(v.host_path.path, config.engine_host_paths):
                problems.append(f"spec.{group}.volumes[{i}].hostPath.path: host path {v.host_path.path} is not "
                                f"allowed (allowed: {', '.join(config.engine_host_paths) or 'none'}; chart value "
                                f"engine.allowedHostPaths, or use a PersistentVolume)")
        problems += _scheduling(group, g, config, namespace)
        taken = ascend_mount_paths(spec)
        for i, m in enumerate(g.volume_mounts or []):
            if m.mount_path in taken:
                problems.append(f"spec.{group}.volumeMounts[{i}].mountPath: {m.mount_path} is mounted by the "
                                f"operator (spec.ascend) and cannot be used")
    image = spec.gateway.image if spec.gateway else None
    if image and image != config.gateway_image and image not in config.allowed_gateway_images:
        allowed = [i for i in (config.gateway_image, *config.allowed_gateway_images) if i]
        problems.append(f"spec.gateway.image: {image} is not an allowed gateway image (allowed: "
                        f"{', '.join(allowed) or 'none; leave it unset for the operator-configured one'})")
    return "; ".join(problems) or None
