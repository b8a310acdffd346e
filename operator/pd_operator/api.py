"""The PDDeployment API (pdoperator.io/v1alpha1): pydantic models are the single source of
truth; crds/pddeployment.yaml is generated from them (``python -m pd_operator.crdgen``).

Cross-field rules are CEL ``x-kubernetes-validations`` so the API server rejects bad specs
at admission, each with a message naming the field."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from pd_contract import mooncake
from pd_contract.mooncake import DEFAULT_KV_PORT, DEFAULT_NPUS_PER_NODE, KvTransfer
from pd_contract.names import PODINFO_DIR

GROUP = "pdoperator.io"
VERSION = "v1alpha1"
KIND = "PDDeployment"
PLURAL = "pddeployments"
SINGULAR = "pddeployment"
SHORT_NAMES = ["pdd"]
CATEGORIES = ["all"]

Quantity = int | str
DType = Literal["float16", "bfloat16", "float32", "int8"]


def rules(*pairs: tuple[str, str] | tuple[str, str, str]) -> dict:
    out = []
    for p in pairs:
        r = {"rule": p[0], "message": p[1]}
        if len(p) == 3:
            r["fieldPath"] = p[2]
        out.append(r)
    return {"x-kubernetes-validations": out}


class Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class Paged(Model):
    """Blocks (paged-attention) cache: allocate_blocks_cache + pull_blocks."""
    block_size: int = Field(ge=1, le=65536, description="tokens per block")
    num_blocks: int = Field(ge=1, le=1 << 24, description="blocks in the cache")


class KvCache(Model):
    """The model profile the CacheDesc is derived from; never typed by hand."""
    model_config = ConfigDict(json_schema_extra=rules(
        ("self.attention != 'GQA' || self.numKvHeads % self.tensorParallel == 0 || "
         "self.tensorParallel % self.numKvHeads == 0",
         "spec.model.kvCache.tensorParallel must divide spec.model.kvCache.numKvHeads, or be a "
         "multiple of it (GQA heads are split across tensor-parallel ranks)", ".tensorParallel"),
        ("self.attention != 'MLA' || has(self.latentDim)",
         "spec.model.kvCache.latentDim is required when attention is MLA", ".latentDim"),
    ))
    attention: Literal["GQA", "MLA"] = Field(default="GQA",
                                             description="GQA: K and V per layer; MLA: one latent per layer")
    num_layers: int = Field(ge=1, le=1024)
    num_kv_heads: int = Field(default=8, ge=1, le=1024)
    head_dim: int = Field(default=128, ge=1, le=4096)
    latent_dim: int | None = Field(default=None, ge=1, le=65536, description="MLA latent width (DeepSeek-V3: 576)")
    dtype: DType = "float16"
    tensor_parallel: int = Field(default=1, ge=1, le=64)
    max_batch: int = Field(default=1, ge=1, le=4096, description="CacheDesc shape[0]")
    max_seq_len: int = Field(default=2048, ge=1, le=1 << 20, description="CacheDesc shape[1]")
    paged: Paged | None = None


_NAME = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"


class TokenizerConfigMap(Model):
    name: str = Field(min_length=1, max_length=253, pattern=_NAME, description="a ConfigMap of this namespace")
    key: str = Field(default="tokenizer.json", min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$",
                     description="the key holding tokenizer.json (a ConfigMap holds at most 1 MiB)")


class TokenizerClaim(Model):
    claim_name: str = Field(min_length=1, max_length=253, pattern=_NAME,
                            description="a PersistentVolumeClaim the gateway mounts read-only (ReadOnlyMany, or one "
                                        "the engines also mount, such as the weights')")
    path: str = Field(min_length=1, max_length=1024, pattern=r"^[^/].*$",
                      description="tokenizer.json's path inside the volume")
    model_config = ConfigDict(json_schema_extra=rules(
        ("!self.path.split('/').exists(p, p == '..')", "spec.model.tokenizer.persistentVolumeClaim.path must stay "
         "inside the volume (no ..)", ".path")))


class Tokenizer(Model):
    """The model's own tokenizer, for the gateway's token path: a Hugging Face `tokenizers` file
    (tokenizer.json) and, optionally, the chat template that lays out a chat's messages."""
    model_config = ConfigDict(json_schema_extra=rules(
        ("has(self.configMap) != has(self.persistentVolumeClaim)",
         "spec.model.tokenizer needs exactly one of configMap and persistentVolumeClaim")))
    config_map: TokenizerConfigMap | None = None
    persistent_volume_claim: TokenizerClaim | None = None
    chat_template: str | None = Field(
        default=None, max_length=24576,
        description="a Jinja2 chat template as in tokenizer_config.json's chat_template (rendered with messages, "
                    "add_generation_prompt true, bos_token and eos_token, in a sandbox); without one, a line "
                    "`role: content` per message")
    bos_token: str | None = Field(default=None, max_length=256,
                                  description="tokenizer_config.json's bos_token, as the chat template writes it")
    eos_token: str | None = Field(default=None, max_length=256,
                                  description="tokenizer_config.json's eos_token, as the chat template writes it")

    @model_validator(mode="after")
    def _one_source(self) -> "Tokenizer":
        if (self.config_map is None) == (self.persistent_volume_claim is None):
            raise ValueError("spec.model.tokenizer needs exactly one of configMap and persistentVolumeClaim")
        return self


class ModelSpec(Model):
    name: str = Field(min_length=1, max_length=253, description="served model id")
    aliases: list[Annotated[str, Field(min_length=1, max_length=253)]] | None = Field(
        default=None, max_length=16, description="other model ids a gateway routes to this deployment")
    model_id: int = Field(default=0, ge=0, le=(1 << 53) - 1, description="llm_datadist model_id in every CacheKey")
    kv_cache: KvCache
    tokenizer: Tokenizer | None = Field(
        default=None, description="the model's own tokenizer for pd-gateway's token path (default: cl100k, the "
                                  "reference engine's); engines serving their own API (vLLM) tokenize for themselves")


class Datadist(Model):
    port: int = Field(default=26000, ge=1, le=65535, description="datadist listen port (llm.listenIpInfo)")
    link_timeout_ms: int = Field(default=5000, ge=1, le=600000, description="link_clusters timeout; > 200 ms advised")
    sync_kv_timeout_ms: int = Field(default=1000, ge=1, le=600000, description="llm.SyncKvCacheWaitTime")
    topology: Literal["FullMesh"] = "FullMesh"
    verify_interval_seconds: int = Field(default=60, ge=5, le=86400,
                                         description="how often a P-D pair's KV path is re-verified")
    preflight: Literal["Enforce", "Report", "Off"] = Field(
        default="Enforce", description="the network preflight of every engine pod's NPUs (hccn_tool link, net "
        "health, detect address, gateway, device IP, TLS switch; the simulator's stand-in on sim): Enforce "
        "starts no engine and links no pod until its checks pass (and none whose TLS switch differs from the "
        "other nodes'); Report names failures in condition NetworkPreflight only; Off runs none")


class Resources(Model):
    limits: dict[str, Quantity] | None = None
    requests: dict[str, Quantity] | None = None


HOST_PATH = r"^/[A-Za-z0-9._+@/-]*$"
# no `.`/`..` segment: an allowed directory must not lead out of itself
_NO_DOTS = "!('/' + {p} + '/').contains('/../') && !('/' + {p} + '/').contains('/./')"
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
MOUNT_PATH = r"^(/[A-Za-z0-9._+@-]+)+$"             # absolute, no trailing or doubled slash
RELATIVE_PATH = r"^[A-Za-z0-9._+@-]+(/[A-Za-z0-9._+@-]+)*$"
KEY = r"^[-._a-zA-Z0-9]+$"                           # a ConfigMap's or Secret's data key
# what the operator mounts in every engine pod: harden's /tmp, the downwardAPI volume of the device
# annotation, the Ascend host paths (ascend-<i>); the same names the builders use
OPERATOR_VOLUMES = ("tmp", "podinfo", "mindie-rank-table")
OPERATOR_VOLUME_PREFIX = "ascend-"
OPERATOR_MOUNT_PATHS = ("/tmp", PODINFO_DIR, "/etc/pd-mindie")
# the operator's agent tokens: engines get them as the operator's env, never by a user's reference
OPERATOR_SECRET_SUFFIXES = ("-agent-token", "-agent-data-token", "-agent-peer-token")
OPERATOR_ENV = ("POD_NAME", "POD_NAMESPACE")         # the identity every engine reads


class KeySelector(Model):
    """One key of a ConfigMap or Secret in the deployment's namespace."""
    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)
    key: str = Field(min_length=1, max_length=253, pattern=KEY)
    optional: bool | None = None


class FieldSelector(Model):
    """A field of the pod (the downward API), e.g. metadata.labels['x'] or status.hostIP."""
    field_path: str = Field(min_length=1, max_length=256)
    api_version: str | None = Field(default=None, max_length=64)


class ResourceFieldSelector(Model):
    """A request or limit of the engine container, e.g. limits.memory."""
    resource: str = Field(min_length=1, max_length=256)
    container_name: str | None = Field(default=None, max_length=63)
    divisor: Quantity | None = None


class EnvVarSource(Model):
    model_config = ConfigDict(json_schema_extra=rules(
        ("[has(self.secretKeyRef), has(self.configMapKeyRef), has(self.fieldRef), has(self.resourceFieldRef)]"
         ".filter(x, x).size() == 1",
         "env[].valueFrom: set exactly one of secretKeyRef, configMapKeyRef, fieldRef, resourceFieldRef"),
    ))
    secret_key_ref: KeySelector | None = None
    config_map_key_ref: KeySelector | None = None
    field_ref: FieldSelector | None = None
    resource_field_ref: ResourceFieldSelector | None = None


class EnvVar(Model):
    model_config = ConfigDict(json_schema_extra=rules(
        ("!(has(self.value) && has(self.valueFrom))", "env[]: set value or valueFrom, not both", ".valueFrom"),
    ))
    name: str = Field(min_length=1, max_length=256, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
    value: str | None = Field(default=None, max_length=32768, description="a literal value (neither: empty)")
    value_from: EnvVarSource | None = Field(default=None, description="a Secret's or ConfigMap's key, or a "
                                                                      "field or resource of the pod")


class PersistentVolumeClaimSource(Model):
    claim_name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN,
                            description="a PersistentVolumeClaim in the deployment's namespace")
    read_only: bool | None = None


class KeyToPath(Model):
    key: str = Field(min_length=1, max_length=253, pattern=KEY)
    path: str = Field(min_length=1, max_length=1024, pattern=RELATIVE_PATH)
    mode: int | None = Field(default=None, ge=0, le=0o777)


class ConfigMapSource(Model):
    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)
    items: list[KeyToPath] | None = Field(default=None, max_length=64, description="default: every key, as a file")
    default_mode: int | None = Field(default=None, ge=0, le=0o777)
    optional: bool | None = None


class SecretSource(Model):
    secret_name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)
    items: list[KeyToPath] | None = Field(default=None, max_length=64, description="default: every key, as a file")
    default_mode: int | None = Field(default=None, ge=0, le=0o777)
    optional: bool | None = None


class EmptyDirSource(Model):
    medium: Literal["", "Memory"] | None = Field(default=None, description="Memory: a tmpfs (mounted at /dev/shm, "
                                                                           "the engine's shared memory)")
    size_limit: Quantity | None = None


class HostPathSource(Model):
    path: str = Field(max_length=1024, pattern=HOST_PATH, description="must be in the operator's allow-list "
                                                                      "(chart value engine.allowedHostPaths)")
    type: Literal["", "DirectoryOrCreate", "Directory", "FileOrCreate", "File", "Socket", "CharDevice",
                  "BlockDevice"] | None = None


class Volume(Model):
    """A volume of the engine pods: exactly one source."""
    model_config = ConfigDict(json_schema_extra=rules(
        ("[has(self.persistentVolumeClaim), has(self.configMap), has(self.secret), has(self.emptyDir), "
         "has(self.hostPath)].filter(x, x).size() == 1",
         "volumes[]: set exactly one of persistentVolumeClaim, configMap, secret, emptyDir, hostPath"),
    ))
    name: str = Field(min_length=1, max_length=63, pattern=DNS_LABEL)
    persistent_volume_claim: PersistentVolumeClaimSource | None = None
    config_map: ConfigMapSource | None = None
    secret: SecretSource | None = None
    empty_dir: EmptyDirSource | None = None
    host_path: HostPathSource | None = None


class VolumeMount(Model):
    name: str = Field(min_length=1, max_length=63, pattern=DNS_LABEL, description="one of the group's volumes")
    mount_path: str = Field(min_length=2, max_length=1024, pattern=MOUNT_PATH)
    read_only: bool | None = None
    sub_path: str | None = Field(default=None, max_length=1024, pattern=RELATIVE_PATH)


class LocalObjectReference(Model):
    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)


def _map_list(*keys: str) -> dict:
    return {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": list(keys)}


def _group_rules(group: str) -> dict:
    """The rules of spec.prefill or spec.decoder, each message naming the field: what the operator
    sets in the engine pods (identity env, its volumes and mounts) cannot be overridden."""
    f = f"spec.{group}"
    reserved_paths = " || ".join(f"m.mountPath == '{p}' || m.mountPath.startsWith('{p}/')"
                                 for p in OPERATOR_MOUNT_PATHS)
    suffixes = ", ".join(f"'{s}'" for s in OPERATOR_SECRET_SUFFIXES)
    token = lambda ref: f"[{suffixes}].exists(s, {ref}.endsWith(s))"  # noqa: E731
    return rules(
        ("!has(self.env) || self.env.all(e, !e.name.startsWith('LLM_DATADIST_') && !e.name.startsWith('PD_'))",
         f"{f}.env[].name: names starting with LLM_DATADIST_ or PD_ are set by the operator and cannot be "
         "overridden", ".env"),
        *((f"!has(self.env) || self.env.all(e, e.name != '{n}')",
           f"{f}.env[].name: {n} is set by the operator and cannot be overridden", ".env") for n in OPERATOR_ENV),
        ("!has(self.volumes) || self.volumes.all(v, " + " && ".join(f"v.name != '{n}'" for n in OPERATOR_VOLUMES)
         + f" && !v.name.startsWith('{OPERATOR_VOLUME_PREFIX}'))",
         f"{f}.volumes[].name: {', '.join(OPERATOR_VOLUMES)} and {OPERATOR_VOLUME_PREFIX}* are the operator's "
         "volumes and cannot be used", ".volumes"),
        ("!has(self.volumes) || self.volumes.all(v, !has(v.hostPath) || " + _NO_DOTS.format(p="v.hostPath.path")
         + ")", f"{f}.volumes[].hostPath.path may not contain . or .. segments", ".volumes"),
        ("!has(self.volumeMounts) || self.volumeMounts.all(m, has(self.volumes) && "
         "self.volumes.exists(v, v.name == m.name))",
         f"{f}.volumeMounts[].name must name one of {f}.volumes[]", ".volumeMounts"),
        ("!has(self.volumeMounts) || self.volumeMounts.all(m, !(" + reserved_paths + "))",
         f"{f}.volumeMounts[].mountPath: {', '.join(OPERATOR_MOUNT_PATHS)} and what is under them are mounted by "
         "the operator and cannot be used", ".volumeMounts"),
        ("!has(self.env) || self.env.all(e, !has(e.valueFrom) || !has(e.valueFrom.secretKeyRef) || !"
         + token("e.valueFrom.secretKeyRef.name") + ")",
         f"{f}.env[].valueFrom.secretKeyRef.name: the agent token Secrets (*{', *'.join(OPERATOR_SECRET_SUFFIXES)}) "
         "are the operator's and cannot be referenced", ".env"),
        ("!has(self.volumes) || self.volumes.all(v, !has(v.secret) || !" + token("v.secret.secretName") + ")",
         f"{f}.volumes[].secret.secretName: the agent token Secrets (*{', *'.join(OPERATOR_SECRET_SUFFIXES)}) "
         "are the operator's and cannot be referenced", ".volumes"),
        ("!has(self.volumeMounts) || self.volumeMounts.all(m, " + _NO_DOTS.format(p="m.mountPath")
         + " && (!has(m.subPath) || " + _NO_DOTS.format(p="m.subPath") + "))",
         f"{f}.volumeMounts[]: mountPath and subPath may not contain . or .. segments", ".volumeMounts"),
    )


class Group(Model):
    replicas: int = Field(default=1, ge=0, le=512)
    resources: Resources | None = None
    node_selector: dict[str, str] | None = None
    tolerations: list[dict[str, Any]] | None = None
    cluster_id_base: int | None = Field(default=None, ge=0, le=(1 << 53) - 1,
                                        description="cluster_id of pod 0's rank 0 (default prefill 0, decoder "
                                                    "1000); pod i's rank r is base + i x tensorParallel + r")
    tensor_parallel: int | None = Field(default=None, ge=1, le=64,
                                        description="ranks of one tensor-parallel group, one engine and one NPU "
                                                    "each (default spec.model.kvCache.tensorParallel); with "
                                                    "podsPerInstance and dataParallel 1, the ranks of a pod")
    pods_per_instance: int = Field(default=1, ge=1, le=32, description=(
        "pods one instance spans, across nodes: a gang, placed all or none, serving only when every rank of "
        "every pod is up, linked and verified, restarted as one when a pod is lost and switched as one; each "
        "pod holds tensorParallel x dataParallel / podsPerInstance ranks (and as many NPUs)"))
    data_parallel: int = Field(default=1, ge=1, le=256, description=(
        "attention data-parallel groups of an instance, each of tensorParallel ranks and serving requests of "
        "its own (above 1: attention MLA, a decoder group reads the whole latent from one prefill rank)"))
    gang_schedule_seconds: int = Field(default=120, ge=5, le=3600, description=(
        "podsPerInstance above 1: how long an instance's pods may wait to be placed; then they all give their "
        "NPUs back and are placed together again only once the nodes have room for every one of them"))
    env: list[EnvVar] | None = Field(default=None, max_length=128, json_schema_extra=_map_list("name"),
                                     description="extra environment for the engine (one entry per name)")
    topology_spread_constraints: list[dict[str, Any]] | None = Field(
        default=None, max_length=8, description="the pods' topologySpreadConstraints (default: spread the group "
                                                "over nodes, kubernetes.io/hostname, maxSkew 1, ScheduleAnyway)",
        json_schema_extra={"items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}})
    command: list[Annotated[str, Field(max_length=4096)]] | None = Field(
        default=None, max_length=64, description="the engine container's command (default: the image's "
                                                 "entrypoint); without spec.engine it must start the pd agent, "
                                                 "which starts the engine")
    args: list[Annotated[str, Field(max_length=4096)]] | None = Field(
        default=None, max_length=256, description="the engine container's arguments")
    volumes: list[Volume] | None = Field(default=None, max_length=32, json_schema_extra=_map_list("name"),
                                         description="volumes of the engine pods")
    volume_mounts: list[VolumeMount] | None = Field(
        default=None, max_length=32, json_schema_extra=_map_list("mountPath"),
        description="where the engine container mounts them (an emptyDir of medium Memory at /dev/shm is "
                    "shared memory)")
    image_pull_secrets: list[LocalObjectReference] | None = Field(
        default=None, max_length=16, json_schema_extra=_map_list("name"),
        description="Secrets of the namespace to pull spec.image with")
    affinity: dict[str, Any] | None = Field(default=None, description="the pods' affinity (node, pod, "
                                                                      "anti-affinity), as Kubernetes writes it")
    scheduler_name: str | None = Field(default=None, max_length=253, pattern=DNS_SUBDOMAIN)
    priority_class_name: str | None = Field(default=None, max_length=253, pattern=DNS_SUBDOMAIN)
    read_only_root_filesystem: bool = Field(
        default=True, description="false: the engine container's root filesystem is writable (the rest of the "
                                  "hardening stays: no privilege escalation, no capabilities, RuntimeDefault seccomp)")
    egress: list[dict[str, Any]] | None = Field(
        default=None, max_length=16,
        description="extra egress rules of the engines' NetworkPolicy (both groups' rules are added to the one "
                    "policy), as a NetworkPolicy writes them: e.g. a model store's address and port",
        json_schema_extra={"items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}})


class PrefillGroup(Group):
    model_config = ConfigDict(json_schema_extra=_group_rules("prefill"))


class DecoderGroup(Group):
    model_config = ConfigDict(json_schema_extra=_group_rules("decoder"))


class Targets(Model):
    ttft_p90_ms: int = Field(ge=1, le=600000)
    tbt_p90_ms: int = Field(ge=1, le=60000)


class ScheduleEntry(Model):
    cron: str = Field(pattern=r"^\s*\S+(\s+\S+){4}\s*$", description="five-field cron expression")
    prefill: int = Field(ge=0, le=1024)


class Manual(Model):
    prefill: int = Field(ge=0, le=1024)


class LoadThresholds(Model):
    """Policy Load: when a role counts as pressed or idle (high and low apart, for hysteresis)."""
    prefill_busy_high: float = Field(default=0.85, gt=0, le=1, description="prefill busy fraction: pressed")
    prefill_busy_low: float = Field(default=0.4, ge=0, lt=1, description="prefill busy fraction: idle")
    prefill_queue_high: float = Field(default=2.0, gt=0, description="waiting requests per prefill: pressed")
    decode_busy_high: float = Field(default=0.85, gt=0, description="(running + waiting) / max batch: pressed")
    decode_busy_low: float = Field(default=0.5, ge=0, description="(running + waiting) / max batch: idle")


class GoodputSettings(Model):
    """Policy Goodput: how the demand is forecast over the time a move takes."""
    model_config = ConfigDict(json_schema_extra=rules(
        # the object's default ({}) is checked as written, before its fields' defaults
        ("!has(self.predictor) || self.predictor != 'Seasonal' || has(self.seasonalPeriodSeconds)",
         "spec.rebalance.goodput.seasonalPeriodSeconds is required when the predictor is Seasonal",
         ".seasonalPeriodSeconds"),
    ))
    predictor: Literal["Trend", "Kalman", "Seasonal"] = Field(
        default="Trend", description="Trend: a line through the recent demand; Kalman: a local linear trend "
                                     "filtered over all of it; Seasonal: the demand a period earlier, shifted by "
                                     "how far its level moved since")
    window_seconds: int = Field(default=60, ge=5, le=86400, description="the recent demand Trend fits and "
                                                                         "Seasonal compares levels over")
    seasonal_period_seconds: int | None = Field(default=None, ge=10, le=604800,
                                                description="Seasonal: the period of the demand")
    replace_seconds: int = Field(default=120, ge=1, le=7200,
                                 description="method Replace: how long a new engine takes to serve (the time a "
                                             "move takes; nothing drains before its replacement serves)")


PERCENT = r"^(100|[1-9][0-9]?)%$"
Count = Annotated[int, Field(ge=1, le=1024, strict=True)]   # strict: "25" is neither a count nor a percentage
Percent = Annotated[str, Field(pattern=PERCENT)]


class Rebalance(Model):
    model_config = ConfigDict(json_schema_extra=rules(
        ("self.policy != 'Manual' || has(self.manual)",
         "spec.rebalance.manual is required when spec.rebalance.policy is Manual", ".manual"),
        ("!has(self.manual) || self.manual.prefill >= self.minPrefill",
         "spec.rebalance.manual.prefill must be >= spec.rebalance.minPrefill", ".manual"),
        ("self.policy != 'Schedule' || (has(self.schedule) && size(self.schedule) > 0)",
         "spec.rebalance.schedule needs at least one entry when spec.rebalance.policy is Schedule", ".schedule"),
        ("!has(self.schedule) || self.schedule.all(e, e.prefill >= self.minPrefill)",
         "every spec.rebalance.schedule[].prefill must be >= spec.rebalance.minPrefill", ".schedule"),
        ("!(self.policy in ['SLO', 'Goodput']) || has(self.targets)",
         "spec.rebalance.targets (ttftP90Ms, tbtP90Ms) are required when spec.rebalance.policy is SLO or Goodput",
         ".targets"),
        ("!has(self.maxConcurrentSwitches) || (type(self.maxConcurrentSwitches) == int ? "
         "self.maxConcurrentSwitches >= 1 && self.maxConcurrentSwitches <= 1024 : "
         "string(self.maxConcurrentSwitches).matches('" + PERCENT + "'))",
         "spec.rebalance.maxConcurrentSwitches must be a number from 1 to 1024 or a percentage from 1% to 100%",
         ".maxConcurrentSwitches"),
    ))
    policy: Literal["Manual", "Schedule", "Load", "SLO", "Goodput"]
    min_prefill: int = Field(default=1, ge=0, le=1024)
    min_decoder: int = Field(default=1, ge=0, le=1024)
    cooldown_seconds: int = Field(default=60, ge=0, le=86400, description=(
        "Load, SLO, Goodput: seconds after a decision that changed the target before the next may change it "
        "(the switches of one move run back to back meanwhile)"))
    drain_timeout_seconds: int | None = Field(
        default=None, ge=0, le=3600, description="drain timeout of a switch (default spec.drainTimeoutSeconds)")
    method: Literal["Switch", "Replace"] = Field(
        default="Switch", description="Switch: move roles between running engines (switch_role). Replace: move one "
                                      "replica between the groups (a new pod starts, then one of the other group "
                                      "drains and goes), for engines that cannot switch roles")
    max_concurrent_switches: Count | Percent = Field(
        default=1, description="role switches in flight at once: a number, or a percentage of the engines rounded "
                               "down (at least one), like maxUnavailable")
    evaluation_interval_seconds: int = Field(default=15, ge=1, le=86400,
                                             description="how often Load, SLO and Goodput re-decide the prefill "
                                                         "count")
    signal_max_age_seconds: int = Field(default=30, ge=1, le=3600,
                                        description="older load signals freeze the ratio instead of driving it")
    time_zone: str = Field(default="UTC", max_length=64, description="IANA time zone of the schedule")
    paused: bool = Field(default=False, description=(
        "no switch starts (and one still in its Drain step is withdrawn: its pod stays in its role); switches past "
        "Drain finish. The policy still evaluates and says what it would do"))
    stuck_after_seconds: int = Field(default=300, ge=10, le=86400, description=(
        "a switch in one step longer than this is reported (condition Rebalancing, reason SwitchStuck, and an "
        "Event) naming the step and what to check; it is not given up (past Drain the engine is out of service "
        "on purpose)"))
    load: LoadThresholds = Field(default_factory=LoadThresholds, json_schema_extra={"default": {}})
    goodput: GoodputSettings = Field(default_factory=GoodputSettings, json_schema_extra={"default": {}})
    targets: Targets | None = None
    schedule: list[ScheduleEntry] | None = Field(default=None, max_length=64)
    manual: Manual | None = None

    def max_in_flight(self, total: int) -> int:
        """maxConcurrentSwitches for a fleet of `total` engines: a percentage rounds down, to at least one."""
        m = self.max_concurrent_switches
        if isinstance(m, str):
            return max(1, total * int(m.rstrip("%")) // 100)
        return m


class GatewaySpec(Model):
    """pd-gateway in front of the deployment: OpenAI- and Anthropic-compatible, keyed."""
    model_config = ConfigDict(json_schema_extra=rules(
        ("!self.enabled || has(self.apiKeysSecret)",
         "spec.gateway.apiKeysSecret is required when spec.gateway.enabled is true", ".apiKeysSecret"),
    ))
    enabled: bool = False
    api_keys_secret: str | None = Field(default=None, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
                                        description="Secret with one data key per API key (its name -> the key); "
                                                    "it must opt in with the label pdoperator.io/keys: \"true\"")
    image: str | None = Field(default=None, max_length=1024, pattern=r"^\S+$",
                              description="default: the operator's configured gateway image; another must be one the "
                                          "operator's configuration allows (chart value gateway.allowedImages)")
    replicas: int = Field(default=1, ge=1, le=64)
    rate_limits: dict[str, Annotated[int, Field(ge=1, le=1000000)]] | None = Field(
        default=None, description="requests per minute per API key name")
    resources: Resources | None = None


_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


class EndpointPickerRef(Model):
    """An InferencePool's endpointPickerRef (inference.networking.k8s.io/v1): the endpoint
    picker's Service that a gateway asks, over Envoy's ext_proc, which pod serves a request."""
    name: str = Field(min_length=1, max_length=253, pattern=_DNS_LABEL)
    port: int = Field(default=9002, ge=1, le=65535, description="the picker's ext_proc port")
    kind: str = Field(default="Service", max_length=63, pattern=r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$")
    group: str = Field(default="", max_length=253, pattern=r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]"
                                                           r"([-a-z0-9]*[a-z0-9])?)*$")
    failure_mode: Literal["FailOpen", "FailClose"] = "FailClose"


class PickerRefs(Model):
    prefill: EndpointPickerRef | None = None
    decode: EndpointPickerRef | None = None


class Routing(Model):
    """Routing by the inference gateways people already run. Engine pods always carry llm-d's
    labels (llm-d.ai/role prefill | decode, llm-d.ai/inferenceServing "true") while they serve, and
    lose both from the moment a switch starts until it has relinked and verified them."""
    model_config = ConfigDict(json_schema_extra=rules(
        ("self.poolScope == 'Deployment' || !has(self.endpointPickerRef)",
         "spec.routing.endpointPickerRef is the Deployment pool's picker; with poolScope Role set "
         "spec.routing.endpointPickerRefs (prefill, decode)", ".endpointPickerRef"),
        ("self.poolScope == 'Role' || !has(self.endpointPickerRefs)",
         "spec.routing.endpointPickerRefs are the Role pools' pickers; with poolScope Deployment set "
         "spec.routing.endpointPickerRef", ".endpointPickerRefs"),
        ("!has(self.targetPorts) || self.targetPorts.all(p, self.targetPorts.exists_one(q, q == p))",
         "spec.routing.targetPorts must not repeat a port", ".targetPorts"),
    ))
    inference_pool: bool = Field(default=False, description="keep InferencePools (inference.networking.k8s.io/v1) "
                                                            "that select this deployment's serving pods")
    pool_scope: Literal["Deployment", "Role"] = Field(
        default="Deployment", description="Deployment: one pool <name> of every serving pod (llm-d's P/D scheduler "
                                          "tells the roles apart by llm-d.ai/role); Role: pools <name>-prefill and "
                                          "<name>-decode, one per role")
    target_ports: list[Annotated[int, Field(ge=1, le=65535)]] | None = Field(
        default=None, min_length=1, max_length=8,
        description="the pods' serving ports in the pools (default: spec.engine.port; one of the two is required)")
    endpoint_picker_ref: EndpointPickerRef | None = None
    endpoint_picker_refs: PickerRefs | None = None
    leave_pool_seconds: float = Field(
        default=2.0, ge=0, le=60,
        description="how long a switch waits between taking a pod's labels and draining it, so routers that "
                    "select the labels from outside see the pod leave before it refuses requests")


def _host_path(default: str) -> Any:
    return Field(default=default, max_length=1024, pattern=HOST_PATH)


class Ascend(Model):
    """Host paths the real llm_datadist needs (backend llm-datadist), each one the operator allows."""
    model_config = ConfigDict(json_schema_extra=rules(
        (_NO_DOTS.format(p="self.hccnConf"), "spec.ascend.hccnConf may not contain . or .. segments", ".hccnConf"),
        (_NO_DOTS.format(p="self.driverPath"), "spec.ascend.driverPath may not contain . or .. segments",
         ".driverPath"),
        ("!has(self.extraHostPaths) || self.extraHostPaths.all(p, " + _NO_DOTS.format(p="p") + ")",
         "spec.ascend.extraHostPaths may not contain . or .. segments", ".extraHostPaths"),
    ))
    hccn_conf: str = _host_path("/etc/hccn.conf")
    driver_path: str = _host_path("/usr/local/Ascend/driver")
    extra_host_paths: list[Annotated[str, Field(max_length=1024, pattern=HOST_PATH)]] = Field(
        default_factory=lambda: ["/usr/local/dcmi", "/usr/local/bin/npu-smi"], max_length=16)
    npus_per_node: int = Field(default=DEFAULT_NPUS_PER_NODE, ge=1, le=32, description=(
        "NPUs per node (8: Atlas 800 A2; 16: A3 superpod nodes): Mooncake's Ascend transport takes random ports "
        "in [20000, 20000 + 1000 x this), which spec.engine.kvPort must stay out of"))


class SimTiming(Model):
    """Coefficients of the simulator's timing models; unset ones keep their defaults. Prefill batch:
    a*sum(p) + b*sum(p^2) + c ms; decode step: a*sum(ctx) + b*batch + c ms; a KV pull: kvAlphaMs plus
    the bytes over kvBandwidthGbps."""
    prefill_a: float | None = Field(default=None, ge=0)
    prefill_b: float | None = Field(default=None, ge=0)
    prefill_c: float | None = Field(default=None, ge=0)
    decode_a: float | None = Field(default=None, ge=0)
    decode_b: float | None = Field(default=None, ge=0)
    decode_c: float | None = Field(default=None, ge=0)
    kv_alpha_ms: float | None = Field(default=None, ge=0)
    kv_bandwidth_gbps: float | None = Field(default=None, gt=0, description="GB/s")


class SimFaults(Model):
    """Faults the simulated engines start with (also settable at run time on each agent)."""
    refuse_links: bool = Field(default=False, description="prompt side stops listening")
    link_delay_ms: int = Field(default=0, ge=0, le=600000, description="prompt side answers link handshakes late")
    pull_delay_ms: int = Field(default=0, ge=0, le=600000, description="prompt side answers pulls late")
    pull_fail: bool = Field(default=False, description="prompt side fails every pull")
    preflight_link_down: list[Annotated[int, Field(ge=0, le=63)]] | None = Field(
        default=None, max_length=64, description="network preflight: these ranks' devices report link DOWN")
    preflight_tls_switch: int | None = Field(default=None, ge=0, le=1,
                                             description="network preflight: the devices report this TLS switch")
    preflight_no_gateway: bool | None = Field(default=None, description="network preflight: no gateway is set")


class Sim(Model):
    """Simulator settings (backend sim only)."""
    time_scale: float = Field(default=1.0, gt=0, le=100, description="multiplies all simulated time")
    timing: SimTiming | None = None
    engine_start_seconds: float = Field(default=0, ge=0, le=3600,
                                        description="delay before the engine initialises, like loading weights")
    faults: SimFaults | None = None
    engine: Literal["timing", "reference"] = Field(
        default="timing", description="what serves requests: timing (the simulator's timing model; tokens are "
        "placeholders) or reference (a small real transformer on CPU with seeded weights: real token ids in and "
        "out, real KV sharded by rank; for profiles of at most 16 layers and width 1024)")
    seed: int = Field(default=0, ge=0, le=(1 << 31) - 1, description="reference engine: the weights' seed")


# what the reference engine computes on a CPU (llm_datadist_sim.refmodel.Profile.check says the same)
REFERENCE_MAX_LAYERS = 16
REFERENCE_MAX_WIDTH = 1024
REFERENCE_MAX_SEQ = 8192
REFERENCE_MIN_SEQ = 64
_REF = "has(self.sim) && has(self.sim.engine) && self.sim.engine == 'reference'"
_KV = "self.model.kvCache"
_MOONCAKE = ("(has(self.engine) && has(self.engine.kvTransfer) && "
             "self.engine.kvTransfer in ['mooncake', 'mooncake-layerwise'])")
_KV_PORT = f"(has(self.engine.kvPort) ? self.engine.kvPort : {DEFAULT_KV_PORT})"
_NPN = f"(has(self.ascend) && has(self.ascend.npusPerNode) ? self.ascend.npusPerNode : {DEFAULT_NPUS_PER_NODE})"


def _kv_port_rule(npus: int | None) -> tuple[str, str, str]:
    """spec.engine.kvPort out of Mooncake's random range: a rule (and message naming the range) for
    8 and for 16 NPUs per node, and one for any other count."""
    tp = f"({_P_TP} > {_D_TP} ? {_P_TP} : {_D_TP})"
    ok = f"{_KV_PORT} + {tp} <= 20000 || {_KV_PORT} >= 20000 + 1000 * {_NPN}"
    if npus is None:
        return (f"!{_MOONCAKE} || {_NPN} == 8 || {_NPN} == 16 || {ok}",
                "spec.engine.kvPort is inside the Mooncake transport random port range [20000, 20000 + 1000 x "
                "spec.ascend.npusPerNode): use 20000 + 1000 x spec.ascend.npusPerNode or above", ".engine.kvPort")
    lo, hi = mooncake.random_port_range(npus)
    return (f"!{_MOONCAKE} || {_NPN} != {npus} || {ok}",
            f"spec.engine.kvPort is inside the Mooncake transport random port range [{lo}, {hi}) for {npus} NPUs "
            f"per node (spec.ascend.npusPerNode): use {hi} or above", ".engine.kvPort")


# each group's TP and cluster id base, as CEL (the defaults of Group.tensorParallel and clusterIdBase)
_P_TP = "(has(self.prefill.tensorParallel) ? self.prefill.tensorParallel : self.model.kvCache.tensorParallel)"
_D_TP = "(has(self.decoder.tensorParallel) ? self.decoder.tensorParallel : self.model.kvCache.tensorParallel)"
_MAX_TP = f"({_P_TP} > {_D_TP} ? {_P_TP} : {_D_TP})"
_P_DP = "(has(self.prefill.dataParallel) ? self.prefill.dataParallel : 1)"
_D_DP = "(has(self.decoder.dataParallel) ? self.decoder.dataParallel : 1)"
_P_PODS = "(has(self.prefill.podsPerInstance) ? self.prefill.podsPerInstance : 1)"
_D_PODS = "(has(self.decoder.podsPerInstance) ? self.decoder.podsPerInstance : 1)"
_P_RANKS = f"({_P_TP} * {_P_DP})"     # ranks of an instance
_D_RANKS = f"({_D_TP} * {_D_DP})"
_P_BASE = "(has(self.prefill.clusterIdBase) ? self.prefill.clusterIdBase : 0)"
_D_BASE = "(has(self.decoder.clusterIdBase) ? self.decoder.clusterIdBase : 1000)"


def _gang_rules(group: str, tp: str, dp: str, pods: str) -> tuple[tuple[str, str, str], ...]:
    """An instance's layout: its ranks divide evenly over its pods, each pod's NPUs fit a node, and
    data-parallel groups read whole latents (MLA)."""
    f = f"spec.{group}"
    return (
        (f"({tp} * {dp}) % {pods} == 0",
         f"{f}.podsPerInstance must divide {f}.tensorParallel x {f}.dataParallel (every pod of an instance holds "
         "as many ranks)", f".{group}.podsPerInstance"),
        (f"{pods} == 1 || ({tp} * {dp}) / {pods} <= {_NPN}",
         f"{f}: tensorParallel x dataParallel / podsPerInstance is the NPUs of one pod and must not exceed "
         "spec.ascend.npusPerNode", f".{group}.podsPerInstance"),
        (f"{dp} == 1 || self.model.kvCache.attention == 'MLA'",
         f"{f}.dataParallel above 1 needs spec.model.kvCache.attention MLA (a data-parallel group reads the whole "
         "latent of a request from one prefill rank)", f".{group}.dataParallel"),
        (f"{pods} == 1 || !has(self.engine)",
         f"{f}.podsPerInstance above 1 runs on the agent's own rank processes (the simulator or LLM-DataDist "
         "ranks it starts), not with spec.engine", f".{group}.podsPerInstance"),
    )


class Rollout(Model):
    """How an upgrade rolls the engine pods."""
    max_skew: int = Field(default=1, ge=1, le=512, description=(
        "prefill and decoder roll together: the pods at each group's new revision never differ by more than "
        "this between the groups while both still have old pods (each revision keeps prefills and decoders "
        "serving together; a decoder and a prefill of different revisions are never linked)"))


class MindIE(Model):
    """MindIE engines: a rank table (ConfigMap <name>-rank-table) and role pushes (POST /v2/role/<role>)."""
    # The operator keeps MindIE's global rank table from the pods' devices and roles (ranktable.py)
    # and mounts it in the engine pods; each pod's agent tells its MindIE server its role and peers
    # at start, after every switch, and when its peers change (pd_agent.mindie_hook).
    enabled: bool = Field(default=False, description="keep the rank table and push roles to MindIE")
    role_url: str = Field(default="http://127.0.0.1:1026", max_length=1024, pattern=r"^https?://\S+$",
                          description="the MindIE server's base URL as the agent in the pod reaches it")


class EngineContainer(Model):
    """An inference server of your own beside the pod's agent: container `engine` in every engine pod."""
    # The agent container (spec.image) keeps what the operator owns (identity, ports, probes, the
    # token); the engine container takes the group's command, args, env, mounts and resources and
    # gets the identity env, and its rank processes register with the agent (docs/engines.md).
    image: str = Field(min_length=1, max_length=1024, pattern=r"^\S+$", description="the inference server's image")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(
        default=None, description="default spec.imagePullPolicy")
    adapter: Literal["EngineAdapter", "vLLM"] = Field(
        default="EngineAdapter",
        description="EngineAdapter: each rank process calls pd_engine.rank.serve_rank; vLLM: vLLM(-Ascend) with "
                    "pd_engine's KV connector, the operator adds --tensor-parallel-size, --kv-transfer-config and "
                    "the Ascend env unless the args (or the group's env) already have them")
    port: int | None = Field(default=None, ge=1, le=65535,
                             description="the server's own API port (vLLM: its OpenAI port): declared on the "
                                         "container and admitted by the engines' NetworkPolicy from the pods of the "
                                         "namespace (a P-D router of the server's own)")
    kv_transfer: KvTransfer = Field(
        default="pd-operator", description=(
            "adapter vLLM: how KV moves. pd-operator: pd_engine's connector over LLM-DataDist (kv_both, roles "
            "switch live). mooncake: vllm-ascend's own MooncakeConnectorV1 (kv_producer or kv_consumer; the "
            "container runs the engine under pd_engine.launch, which restarts it in place, drained, with the "
            "flipped kv_role when the operator switches the pod's role). mooncake-layerwise: vllm-ascend's "
            "MooncakeLayerwiseConnector the same way (decoder first: pd-gateway serves its metaserver)"))
    kv_port: int = Field(default=DEFAULT_KV_PORT, ge=1024, le=65535, description=(
        "kvTransfer mooncake: the side channel's base port (vLLM's kv_port; rank r listens on kvPort + r); at "
        "least 20000 + 1000 x spec.ascend.npusPerNode"))


class PDDeploymentSpec(Model):
    model_config = ConfigDict(json_schema_extra=rules(
        ("!has(self.rebalance) || self.rebalance.minPrefill + self.rebalance.minDecoder <= "
         "(has(self.replicas) ? self.replicas : self.prefill.replicas + self.decoder.replicas)",
         "spec.rebalance.minPrefill + spec.rebalance.minDecoder must not exceed the engines "
         "(spec.replicas, or spec.prefill.replicas + spec.decoder.replicas)", ".rebalance"),
        ("!has(self.rebalance) || !has(self.rebalance.manual) || self.rebalance.manual.prefill <= "
         "(has(self.replicas) ? self.replicas : self.prefill.replicas + self.decoder.replicas)"
         " - self.rebalance.minDecoder",
         "spec.rebalance.manual.prefill must leave spec.rebalance.minDecoder decoders "
         "(at most the engines - minDecoder)", ".rebalance"),
        ("!has(self.rebalance) || !has(self.rebalance.schedule) || self.rebalance.schedule.all(e, "
         "e.prefill <= (has(self.replicas) ? self.replicas : self.prefill.replicas + self.decoder.replicas)"
         " - self.rebalance.minDecoder)",
         "every spec.rebalance.schedule[].prefill must leave spec.rebalance.minDecoder decoders", ".rebalance"),
        (_P_BASE + " + (has(self.replicas) ? self.replicas : self.prefill.replicas) * " + _P_RANKS + " <= "
         + _D_BASE + " || " + _D_BASE + " + (has(self.replicas) ? self.replicas : self.decoder.replicas) * "
         + _D_RANKS + " <= " + _P_BASE,
         "spec.prefill.clusterIdBase and spec.decoder.clusterIdBase ranges overlap (defaults 0 and 1000; each group "
         "takes instances x tensorParallel x dataParallel ids from its base, instances counted as spec.replicas if "
         "set): cluster_ids must be unique", ".decoder"),
        *_gang_rules("prefill", _P_TP, _P_DP, _P_PODS),
        *_gang_rules("decoder", _D_TP, _D_DP, _D_PODS),
        ("self.model.kvCache.attention != 'MLA' || " + _P_RANKS + " % " + _D_RANKS + " == 0 || " + _D_RANKS
         + " % " + _P_RANKS + " == 0",
         "spec.prefill and spec.decoder: one instance's ranks (tensorParallel x dataParallel) must divide the "
         "other's, so that every decoder rank is paired with a prefill rank", ".decoder"),
        (_P_TP + " == " + _D_TP + " || (self.model.kvCache.attention == 'MLA' && " + _P_TP + " % " + _D_TP
         + " == 0)",
         "spec.prefill.tensorParallel and spec.decoder.tensorParallel must be equal, or with attention MLA the "
         "decoder's must divide the prefill's (GQA head shards are paired rank to rank; an MLA rank holds the whole "
         "latent, and each decoder rank reads one prefill rank's copy)", ".decoder"),
        ("!has(self.rebalance) || !has(self.rebalance.method) || self.rebalance.method != 'Switch' || "
         + _P_TP + " == " + _D_TP + " || (self.model.kvCache.attention == 'MLA' && " + _P_PODS + " * " + _P_DP
         + " * " + _D_PODS + " * " + _D_DP + " > 1)",
         "spec.rebalance.method Switch needs equal spec.prefill.tensorParallel and spec.decoder.tensorParallel "
         "(a switched pod keeps its ranks), or attention MLA with instances laid out by podsPerInstance or "
         "dataParallel; use method Replace", ".rebalance"),
        ("!has(self.rollout) || " + _P_PODS + " * " + _D_PODS + " == 1",
         "spec.rollout (prefill and decoder rolled together) does not take instances of several pods yet "
         "(spec.<group>.podsPerInstance above 1): leave it out, each instance then restarts whole as its pods roll",
         ".rollout"),
        ("self.model.kvCache.attention != 'GQA' || [" + _P_TP + ", " + _D_TP + "].all(t, "
         "self.model.kvCache.numKvHeads % t == 0 || t % self.model.kvCache.numKvHeads == 0)",
         "spec.prefill.tensorParallel and spec.decoder.tensorParallel must divide "
         "spec.model.kvCache.numKvHeads, or be a multiple of it (GQA heads are split across ranks)", ".prefill"),
        ("!has(self.sim) || self.backend == 'sim'",
         "spec.sim applies only to backend sim", ".sim"),
        ("!has(self.engine) || !has(self.mindie) || !self.mindie.enabled",
         "spec.engine and spec.mindie.enabled cannot be combined: a MindIE server takes its role from the agent's "
         "role pushes, not as ranks registered with the agent", ".engine"),
        ("!has(self.engine) || self.engine.adapter != 'vLLM' || !has(self.gateway) || !self.gateway.enabled || "
         "has(self.engine.port)",
         "spec.engine.port is required with spec.gateway.enabled and spec.engine.adapter vLLM: pd-gateway sends "
         "requests to the engines' own OpenAI port with vLLM's P-D protocol", ".engine"),
        ("!has(self.routing) || !self.routing.inferencePool || has(self.routing.targetPorts) || "
         "(has(self.engine) && has(self.engine.port))",
         "spec.routing.targetPorts (or spec.engine.port) is required with spec.routing.inferencePool: the pools "
         "name the port a gateway sends requests to (the agent's 8080 is its control API, not an inference API)",
         ".routing"),
        ("!has(self.engine) || self.engine.adapter != 'vLLM' || has(self.model.kvCache.paged)",
         "spec.model.kvCache.paged is required with spec.engine.adapter vLLM (vLLM's KV cache is paged: blockSize "
         "and numBlocks as vLLM runs)", ".engine"),
        (f"!{_MOONCAKE} || self.engine.adapter == 'vLLM'",
         "spec.engine.kvTransfer mooncake and mooncake-layerwise need spec.engine.adapter vLLM (vllm-ascend's "
         "connectors)",
         ".engine.kvTransfer"),
        (f"!{_MOONCAKE} || has(self.engine.port)",
         "spec.engine.port is required with spec.engine.kvTransfer mooncake (and mooncake-layerwise): the operator "
         "verifies each pair and "
         "pd-gateway routes through the engines' own OpenAI port", ".engine.port"),
        *(_kv_port_rule(n) for n in (8, 16, None)),
        (f"!{_MOONCAKE} || ({_KV_PORT} > 8080 || {_KV_PORT} + {_MAX_TP} <= 8080) && "
         f"({_KV_PORT} > 9091 || {_KV_PORT} + {_MAX_TP} <= 9091)",
         "spec.engine.kvPort and the ranks' side channels above it must not take the agent's ports (8080, 9091)",
         ".engine.kvPort"),
        (f"!{_MOONCAKE} || {_KV_PORT} + ({_P_TP} > {_D_TP} ? {_P_TP} : {_D_TP}) <= 65536",
         "spec.engine.kvPort plus the ranks' side channels (one port per rank) must stay at most 65535",
         ".engine.kvPort"),
        (f"!{_MOONCAKE} || {_P_TP} >= {_D_TP}",
         "spec.prefill.tensorParallel must be at least spec.decoder.tensorParallel with spec.engine.kvTransfer "
         "mooncake (vllm-ascend's connector maps the decoder's heads onto the prefill's ranks)", ".engine.kvTransfer"),
        (f"!{_MOONCAKE} || !has(self.engine.port) || self.engine.port < {_KV_PORT} || self.engine.port >= "
         f"{_KV_PORT} + ({_P_TP} > {_D_TP} ? {_P_TP} : {_D_TP})",
         "spec.engine.port must not be one of the Mooncake side channels' ports (spec.engine.kvPort + rank)",
         ".engine.port"),
        ("!has(self.engine) || !has(self.engine.port) || (self.engine.port != 8080 && self.engine.port != 9091 && "
         "self.engine.port != (has(self.datadist.port) ? self.datadist.port : 26000))",
         "spec.engine.port must not be the agent's ports (8080, 9091) nor spec.datadist.port", ".engine"),
        ("!(" + _REF + ") || " + _KV + ".numLayers <= " + str(REFERENCE_MAX_LAYERS),
         f"spec.model.kvCache.numLayers must be at most {REFERENCE_MAX_LAYERS} with spec.sim.engine reference "
         "(a CPU model; use engine timing to model a large one)", ".sim"),
        ("!(" + _REF + ") || (" + _KV + ".maxSeqLen >= " + str(REFERENCE_MIN_SEQ) + " && " + _KV + ".maxSeqLen <= "
         + str(REFERENCE_MAX_SEQ) + ")",
         f"spec.model.kvCache.maxSeqLen must be {REFERENCE_MIN_SEQ} to {REFERENCE_MAX_SEQ} with spec.sim.engine "
         "reference (the content probe's prompt and decode must fit)", ".sim"),
        ("!(" + _REF + ") || !has(" + _KV + ".dtype) || " + _KV + ".dtype != 'int8'",
         "spec.model.kvCache.dtype int8 is not computed by spec.sim.engine reference (float16, bfloat16, float32)",
         ".sim"),
        ("!(" + _REF + ") || " + _KV + ".attention != 'GQA' || 2 * " + _KV + ".numKvHeads * "
         + _KV + ".headDim <= " + str(REFERENCE_MAX_WIDTH),
         f"spec.model.kvCache: 2 x numKvHeads x headDim (the reference model's width) must be at most "
         f"{REFERENCE_MAX_WIDTH} with spec.sim.engine reference", ".sim"),
        ("!(" + _REF + ") || " + _KV + ".attention != 'MLA' || (" + _KV + ".latentDim <= "
         + str(REFERENCE_MAX_WIDTH) + " && 8 * " + _KV + ".headDim <= " + str(REFERENCE_MAX_WIDTH) + ")",
         f"spec.model.kvCache.latentDim and 8 x headDim must be at most {REFERENCE_MAX_WIDTH} with "
         "spec.sim.engine reference", ".sim"),
        ("!(" + _REF + ") || " + _KV + ".attention != 'GQA' || [" + _P_TP + ", " + _D_TP + "].all(t, "
         + _KV + ".numKvHeads % t == 0)",
         "spec.prefill.tensorParallel and spec.decoder.tensorParallel must divide spec.model.kvCache.numKvHeads "
         "with spec.sim.engine reference (each rank holds its own heads' KV)", ".sim"),
    ))
    backend: Literal["sim", "llm-datadist"] = "sim"
    image: str = Field(min_length=1, max_length=1024, pattern=r"^\S+$")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    model: ModelSpec
    datadist: Datadist = Field(default_factory=Datadist, json_schema_extra={"default": {}})
    prefill: PrefillGroup = Field(default_factory=PrefillGroup, json_schema_extra={"default": {}})
    decoder: DecoderGroup = Field(default_factory=DecoderGroup, json_schema_extra={"default": {}})
    rebalance: Rebalance | None = None
    replicas: int | None = Field(
        default=None, ge=2, le=1024,
        description="total engines, for the scale subresource (kubectl scale, HPA, KEDA): spread over the groups "
                    "in proportion to prefill.replicas : decoder.replicas, at least one each")
    drain_timeout_seconds: int = Field(
        default=60, ge=0, le=3600,
        description="how long a leaving pod may finish in-flight requests and wait for its KV caches "
                    "to be pulled; terminationGracePeriodSeconds follows it")
    ascend: Ascend | None = None
    sim: Sim | None = None
    gateway: GatewaySpec | None = None
    routing: Routing | None = None
    rollout: Rollout | None = Field(default=None, description=(
        "roll prefill and decoder together with a bounded skew (the operator holds each StatefulSet's "
        "partition); without it each StatefulSet rolls on its own"))
    mindie: MindIE | None = None
    engine: EngineContainer | None = Field(
        default=None, description="run your inference server's image beside the agent (the groups' command, args, "
                                  "env, mounts and resources then apply to it)")

    def group_sizes(self, decided: dict | None = None) -> dict[str, int]:
        """The StatefulSets' sizes: the groups' replicas, or spec.replicas spread over them; with
        `method: Replace`, the sizes the operator decided and recorded (status.rebalance.groupSizes)
        while they still add up to this total (plus the pods a replacement adds for a while)."""
        if decided and self.rebalance is not None and self.rebalance.method == "Replace":
            n = decided.get("prefill", 0) + decided.get("decoder", 0)
            # a replacement adds `moving` pods for a while (records without it added one); a record
            # of another total (the spec was scaled meanwhile) is dropped, never shrunk from
            if n == self.total or (decided.get("growing") and n == self.total + (decided.get("moving") or 1)):
                return {"prefill": decided["prefill"], "decoder": decided["decoder"]}
        p, d = self.prefill.replicas, self.decoder.replicas
        if self.replicas is None or self.replicas == p + d:
            return {"prefill": p, "decoder": d}
        share = round(self.replicas * p / (p + d)) if p + d else self.replicas // 2
        pp = min(max(1, share), self.replicas - 1)
        return {"prefill": pp, "decoder": self.replicas - pp}

    def group(self, group: str) -> "Group":
        return self.prefill if group == "prefill" else self.decoder

    def tp_size(self, group: str) -> int:
        """The size of a tensor-parallel group: its own tensorParallel, else the model profile's."""
        return self.group(group).tensor_parallel or self.model.kv_cache.tensor_parallel

    def instance_ranks(self, group: str) -> int:
        """The ranks of one instance: tensorParallel x dataParallel."""
        return self.tp_size(group) * self.group(group).data_parallel

    def pods_per_instance(self, group: str) -> int:
        return self.group(group).pods_per_instance

    def gang(self, group: str) -> bool:
        """The group's instances are laid out beyond one TP group in one pod (the gang env is given)."""
        g = self.group(group)
        return g.pods_per_instance > 1 or g.data_parallel > 1

    def pod_sizes(self, decided: dict | None = None) -> dict[str, int]:
        """The StatefulSets' pods: each group's instances x its pods per instance."""
        return {g: n * self.pods_per_instance(g) for g, n in self.group_sizes(decided).items()}

    def tp(self, group: str) -> int:
        """Ranks per pod of a group (one NPU each): an instance's ranks over its pods."""
        return self.instance_ranks(group) // self.pods_per_instance(group)

    def kv_cache_for(self, group: str) -> "KvCache":
        """The model profile as one rank of `group` holds it (its CacheDesc follows the group's TP)."""
        return self.model.kv_cache.model_copy(update={"tensor_parallel": self.tp_size(group)})

    @property
    def total(self) -> int:
        p, d = self.prefill.replicas, self.decoder.replicas
        return self.replicas if self.replicas is not None else p + d


# ---- status ---------------------------------------------------------------------------------

class Condition(Model):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str = ""
    last_transition_time: str | None = None
    observed_generation: int | None = None


class LinkCounts(Model):
    expected: int = 0
    up: int = 0


class SuperpodPairs(Model):
    """Linked decoder-prefill pod pairs by A3 superpod (the pods' device annotation, super_pod_id)."""
    within: int = 0
    across: int = 0


class PeerLink(Model):
    peer: str
    cluster_id: int
    code: str
    rank: int | None = Field(default=None, description="multi-rank pods: the rank whose link is down")


class RankSummary(Model):
    """A multi-rank pod's ranks, summarised (kubectl pdd status lists each)."""
    tensor_parallel: int
    initialized: int = Field(description="ranks whose engine is initialised")
    device_ips: str | None = Field(default=None, description="where the device IPs came from: annotation, "
                                                             "hccn.conf, list, or pod-ip (simulator: port offsets)")


def map_list(*keys: str) -> dict:
    """A list keyed by fields (the API conventions' map-list), so server-side apply merges by key."""
    return {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": list(keys)}


class Member(Model):
    """One engine pod: a summary; only failing links are listed, healthy ones are counted."""
    pod: str
    group: str
    role: str
    cluster_id: int | None = None
    ip: str | None = None
    port: int | None = None
    ready: bool = False
    boot_id: str | None = None
    assigned_role: str | None = Field(default=None, description="the role its engine starts in")
    links: LinkCounts | None = Field(default=None, description="decoders: links up/expected")
    failing_links: list[PeerLink] | None = Field(default=None, description="links that are down, with the code "
                                                 "(the first 5; failingLinkCounts counts them all)")
    failing_link_counts: dict[str, int] | None = Field(
        default=None, description="when more links are down than failingLinks names: how many, per code")
    ranks: RankSummary | None = None
    last_error: str | None = Field(default=None, description="what is wrong with this member, if anything")
    instance: str | None = Field(default=None, description="an instance of several pods: its name (<group>-<n>)")
    leader: str | None = Field(default=None, description="a pod of an instance that another pod leads: that pod "
                                                         "(the member; this one holds ranks only)")


class CacheDescStatus(Model):
    num_tensors: int
    shape: list[int]
    data_type: str
    blocks_shape: list[int] | None = None
    bytes_per_token: int
    cache_bytes: int
    sim_memory_scale: int | None = None


class LastSwitch(Model):
    """The last switch that ended: its result and where the time went."""
    pod: str
    from_: str = Field(alias="from")
    to: str
    reason: str = ""
    result: Literal["Completed", "Aborted", "Interrupted"] | None = None
    message: str | None = None
    drain_ms: int | None = None
    switch_ms: int | None = Field(default=None, description="unlink and switch_role")
    relink_ms: int | None = Field(default=None, description="relink and KV-path verification")
    undrain_ms: int | None = None
    total_ms: int | None = None
    duration_ms: int | None = None
    at: str | None = None
    unpooled_at: str | None = Field(default=None, description="with spec.routing: when the pod's labels were seen "
                                                              "gone (its drain started leavePoolSeconds later)")


class SwitchInFlight(Model):
    """A switch in flight, recorded before each step is taken so a restart resumes it."""
    pod: str
    uid: str
    from_: str = Field(alias="from")
    to: str
    step: Literal["Drain", "Unlink", "SwitchRole", "Relink", "Verify", "Undrain", "Abort"]
    started_at: str
    step_started_at: str
    reason: str = ""
    attempts: int = 0
    steps_ms: dict[str, float] | None = Field(default=None, description="milliseconds of each step done")
    message: str | None = None
    unpooled_at: str | None = Field(default=None, description="Drain: when the pod's labels were first seen gone "
                                                              "(the drain starts spec.routing.leavePoolSeconds later)")


class LastDecision(Model):
    """The policy's last decision, with the numbers that drove it."""
    policy: str
    reason: str
    message: str = ""
    target_prefill: int | None = None
    current_prefill: int | None = None
    numbers: dict[str, str] | None = None
    at: str | None = None


class GroupSizes(Model):
    prefill: int
    decoder: int
    growing: Literal["prefill", "decoder"] | None = Field(
        default=None, description="a replacement in flight: this group got its new pods; the other shrinks by "
                                  "as many next")
    moving: int | None = Field(default=None, ge=1, description="a replacement in flight: how many pods it added")


class RebalanceStatus(Model):
    target_prefill: int | None = Field(default=None, description="prefill-role pods the policy wants")
    group_sizes: GroupSizes | None = Field(default=None, description="method Replace: the groups' decided sizes")
    cooldown_until: str | None = Field(default=None, description="a periodic policy changes the target again "
                                                                  "from then (cooldownSeconds after it last did)")
    retry_after: str | None = Field(default=None, description="no switch starts before then: a switch gave up on "
                                                              "its drain")


class PDDeploymentStatus(Model):
    phase: Literal["Pending", "Linking", "Ready", "Switching", "Degraded"] | None = None
    prefill: int | None = None
    decoder: int | None = None
    links: LinkCounts | None = None
    links_summary: str | None = Field(default=None, description="links up/expected, for kubectl get")
    superpod_pairs: SuperpodPairs | None = Field(
        default=None, description="linked decoder-prefill pairs within one A3 superpod (KV over the fabric) and "
                                  "across superpods (over RoCE); absent where no pod reports a superpod")
    members: list[Member] | None = Field(default=None, json_schema_extra=map_list("pod"))
    conditions: list[Condition] | None = Field(default=None, json_schema_extra=map_list("type"))
    cache_desc: CacheDescStatus | None = None
    last_switch: LastSwitch | None = None
    switches: list[SwitchInFlight] | None = Field(default=None, json_schema_extra=map_list("pod"))
    rebalance: RebalanceStatus | None = None
    last_decision: LastDecision | None = None
    last_verified: dict[str, Any] | None = Field(
        default=None, description="the last KV-path verification round: paths probed, bytes, slowest pull")
    observed_generation: int | None = None
    token_digests: dict[str, str] | None = Field(
        default=None, description="sha256 of the agent tokens (control, data, peer) the operator generated, recorded "
                                  "before their Secrets are created: a Secret of that name holding another token "
                                  "was not made by the operator and is never used")
    replicas: int | None = Field(default=None, description="engine pods that exist (scale subresource)")
    selector: str | None = Field(default=None, description="label selector of the engine pods (scale subresource)")


PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Prefill", "type": "integer", "jsonPath": ".status.prefill"},
    {"name": "Decoder", "type": "integer", "jsonPath": ".status.decoder"},
    {"name": "Links", "type": "string", "jsonPath": ".status.linksSummary", "description": "up/expected"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]

ROOT_RULES = rules(
    ("size(self.metadata.name) <= 40",
     "metadata.name must be at most 40 characters (pod names and labels derive from it)"),
)


def parse_spec(spec: dict) -> PDDeploymentSpec:
    return PDDeploymentSpec.model_validate(spec)
