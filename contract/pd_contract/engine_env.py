"""The environment of an engine pod: the names the operator sets on its agent and engine
containers (and the pod's agent on each rank process it starts), which the agent, the rank
processes and pd_engine's adapters read. A constant is named as the variable it holds, so a
search for the variable finds its writers and readers.

`EngineIdentity` is who an engine is (its role, cluster id, address, rank): `to_env` writes it,
`from_env` reads it, and `cluster_id` is the one formula for the cluster ids. A process's own
tuning knobs (the gateway's limits, the operator's settings, the simulator's timeouts) stay with
that process."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import overload

from .agent_api import Role
from .names import DATADIST_PORT, DECODER, ENGINE_ROLE, PROMPT

# Kubernetes' downward API: the pod's own name and namespace
POD_NAME = "POD_NAME"
POD_NAMESPACE = "POD_NAMESPACE"

# the engine's identity (LLM-DataDist's own names, as an Ascend engine reads them)
LLM_DATADIST_ROLE = "LLM_DATADIST_ROLE"                  # prompt | decoder (the operator's prefill is taken too)
LLM_DATADIST_CLUSTER_ID = "LLM_DATADIST_CLUSTER_ID"
# the operator sets the group's base and the pod index (the downward API cannot add); the agent
# computes LLM_DATADIST_CLUSTER_ID from them
LLM_DATADIST_CLUSTER_ID_BASE = "LLM_DATADIST_CLUSTER_ID_BASE"
LLM_DATADIST_POD_INDEX = "LLM_DATADIST_POD_INDEX"
LLM_DATADIST_IP = "LLM_DATADIST_IP"
LLM_DATADIST_PORT = "LLM_DATADIST_PORT"
LLM_DATADIST_MODEL_ID = "LLM_DATADIST_MODEL_ID"
LLM_DATADIST_DEVICE_ID = "LLM_DATADIST_DEVICE_ID"      # the process-visible device index
LLM_DATADIST_CACHE_DESC = "LLM_DATADIST_CACHE_DESC"
LLM_DATADIST_LINK_TIMEOUT_MS = "LLM_DATADIST_LINK_TIMEOUT_MS"
LLM_DATADIST_SYNC_KV_TIMEOUT_MS = "LLM_DATADIST_SYNC_KV_TIMEOUT_MS"
PD_TENSOR_PARALLEL = "PD_TENSOR_PARALLEL"
PD_RANK = "PD_RANK"
PD_DEVICE_ID = "PD_DEVICE_ID"                            # the physical NPU of a rank
# an instance beyond one TP group in one pod (spec.<group>.podsPerInstance, dataParallel): a gang
PD_PODS_PER_INSTANCE = "PD_PODS_PER_INSTANCE"            # pods one instance spans
PD_DATA_PARALLEL = "PD_DATA_PARALLEL"                    # its data-parallel groups
PD_TP_SIZE = "PD_TP_SIZE"                                # one group's ranks (a rank process: its TP)
PD_INSTANCE_RANK = "PD_INSTANCE_RANK"                    # a rank process: its rank in the instance
PD_DP_RANK = "PD_DP_RANK"                                # a rank process: its data-parallel group

# a pod of several ranks: where a rank registers, and whether the agent starts the ranks itself
PD_RANK_REGISTER_URL = "PD_RANK_REGISTER_URL"
PD_RANKS_EXTERNAL = "PD_RANKS_EXTERNAL"                  # "1": an inference server's workers register
PD_AGENT_URL = "PD_AGENT_URL"                            # the pod's agent, as the engine container reaches it

# vllm-ascend's Mooncake connector (spec.engine.kvTransfer mooncake): what pd_engine.launch renders
PD_KV_TRANSFER = "PD_KV_TRANSFER"                        # mooncake
PD_KV_PORT = "PD_KV_PORT"                                # the side channel's base port (vLLM's kv_port)
PD_KV_PARALLEL = "PD_KV_PARALLEL"                        # JSON: both roles' tp_size and dp_size
PD_ENGINE_PORT = "PD_ENGINE_PORT"                        # the server's own OpenAI port

# the agent
PD_BACKEND = "PD_BACKEND"                                # sim | llm-datadist
PD_MODEL_NAME = "PD_MODEL_NAME"
PD_AGENT_PORT = "PD_AGENT_PORT"
PD_AGENT_METRICS_PORT = "PD_AGENT_METRICS_PORT"
PD_DRAIN_TIMEOUT_S = "PD_DRAIN_TIMEOUT_S"
PD_ENABLE_SWITCH_ROLE = "PD_ENABLE_SWITCH_ROLE"
PD_DEVICE_ANNOTATION_FILE = "PD_DEVICE_ANNOTATION_FILE"
PD_HCCN_CONF = "PD_HCCN_CONF"
PD_PREFLIGHT = "PD_PREFLIGHT"                            # enforce (default) | report | off
PD_HCCN_TOOL = "PD_HCCN_TOOL"                            # the hccn_tool to run (default: found)

# the agent's tokens (each may come from a file: NAME_FILE), and the operator's record of each
# (its sha256): a token with another digest was written by someone else
PD_AGENT_TOKEN = "PD_AGENT_TOKEN"                        # control scope: the operator's
PD_AGENT_DATA_TOKEN = "PD_AGENT_DATA_TOKEN"              # data scope: routers
PD_AGENT_PEER_TOKEN = "PD_AGENT_PEER_TOKEN"              # peer scope: other agents' pull notices
PD_AGENT_TOKEN_SHA256 = "PD_AGENT_TOKEN_SHA256"
PD_AGENT_DATA_TOKEN_SHA256 = "PD_AGENT_DATA_TOKEN_SHA256"
PD_AGENT_PEER_TOKEN_SHA256 = "PD_AGENT_PEER_TOKEN_SHA256"
TOKEN_ENV = {"control": PD_AGENT_TOKEN, "data": PD_AGENT_DATA_TOKEN, "peer": PD_AGENT_PEER_TOKEN}
TOKEN_DIGEST_ENV = {"control": PD_AGENT_TOKEN_SHA256, "data": PD_AGENT_DATA_TOKEN_SHA256,
                    "peer": PD_AGENT_PEER_TOKEN_SHA256}
DIGEST_OF = {TOKEN_ENV[scope]: digest for scope, digest in TOKEN_DIGEST_ENV.items()}   # token -> its digest

# the simulator: spec.sim's settings (PD_SIM_<timing field>, PD_SIM_FAULT_<fault>) and the engine
PD_SIM_ = "PD_SIM_"
PD_SIM_FAULT_ = "PD_SIM_FAULT_"
PD_SIM_TIME_SCALE = PD_SIM_ + "TIME_SCALE"
PD_SIM_ENGINE_START_S = PD_SIM_ + "ENGINE_START_S"
PD_SIM_MEMORY_SCALE = PD_SIM_ + "MEMORY_SCALE"
PD_SIM_ENGINE = PD_SIM_ + "ENGINE"                       # timing | reference
PD_REFERENCE_MODEL = "PD_REFERENCE_MODEL"                # the reference engine's profile (JSON)

# MindIE: where its server takes role pushes, and the rank table the operator mounts
PD_MINDIE_ROLE_URL = "PD_MINDIE_ROLE_URL"
PD_MINDIE_RANK_TABLE_FILE = "PD_MINDIE_RANK_TABLE_FILE"

# set by the local cluster's node agent on every container: the pod's IP, and the directory
# that stands for the host's root (host paths and mounted files are under it)
PD_LOCAL_POD_IP = "PD_LOCAL_POD_IP"
PD_LOCAL_ROOT = "PD_LOCAL_ROOT"

# an operator's group name is taken for the engine role that group starts in
ROLE_ALIASES = {group: role for group, role in ENGINE_ROLE.items() if group != role}
FALLBACK_IP = "127.0.0.1"     # no engine IP and no pod IP: a process run by hand


def cluster_id(base: int, pod_index: int, tensor_parallel: int = 1, rank: int = 0) -> int:
    """The cluster id convention, stable per rank whatever the pod's role: a group's pods take
    consecutive blocks of TP ids from the group's base (rank 0's id names the pod)."""
    return base + pod_index * tensor_parallel + rank


def parse_role(name: str) -> Role:
    """An engine role from its name, or from the name of the operator's group that starts in it."""
    role = name.lower()
    role = ROLE_ALIASES.get(role, role)
    if role == PROMPT:
        return "prompt"
    if role == DECODER:
        return "decoder"
    raise ValueError(f"{LLM_DATADIST_ROLE} must be prompt (or prefill) or decoder, got {role!r}")


def engine_ip(env: Mapping[str, str], default: str = FALLBACK_IP) -> str:
    """The address the engine listens on: LLM_DATADIST_IP, else the pod's IP."""
    return env.get(LLM_DATADIST_IP) or env.get(PD_LOCAL_POD_IP) or default


def flag(env: Mapping[str, str], name: str, default: bool = False) -> bool:
    """A yes/no variable ("1", "true", "yes" or "0", "false", "no"); unset or empty: `default`."""
    raw = (env.get(name) or "").lower()
    if not raw:
        return default
    return raw not in ("0", "false", "no") if default else raw in ("1", "true", "yes")


@dataclass(frozen=True)
class EngineIdentity:
    """Who an engine (one rank's process) is. A pod's agent reads the pod's (rank 0's) and gives
    each rank process its own (`for_rank`, then `to_env`)."""
    role: Role
    cluster_id: int
    ip: str
    port: int = DATADIST_PORT
    model_id: int = 0
    tensor_parallel: int = 1
    rank: int = 0
    device_id: int | None = None     # LLM_DATADIST_DEVICE_ID: the process-visible device index
    npu: int | None = None           # PD_DEVICE_ID: the physical NPU

    @property
    def pod_cluster_id(self) -> int:
        """Rank 0's cluster id: the pod's."""
        return self.cluster_id - self.rank

    def for_rank(self, rank: int) -> EngineIdentity:
        """Rank `rank` of this engine's pod: its cluster id is the pod's block's `rank`th."""
        return replace(self, rank=rank, cluster_id=self.pod_cluster_id + rank)

    def to_env(self) -> dict[str, str]:
        env = {LLM_DATADIST_ROLE: self.role, LLM_DATADIST_CLUSTER_ID: str(self.cluster_id),
               LLM_DATADIST_IP: self.ip, LLM_DATADIST_PORT: str(self.port),
               LLM_DATADIST_MODEL_ID: str(self.model_id), PD_TENSOR_PARALLEL: str(self.tensor_parallel),
               PD_RANK: str(self.rank)}
        if self.device_id is not None:
            env[LLM_DATADIST_DEVICE_ID] = str(self.device_id)
        if self.npu is not None:
            env[PD_DEVICE_ID] = str(self.npu)
        return env

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> EngineIdentity:
        """The identity `env` gives; ValueError naming the variable that is missing or wrong. The
        cluster id is LLM_DATADIST_CLUSTER_ID, else computed from the group's base and the pod index."""
        role = parse_role(env.get(LLM_DATADIST_ROLE, PROMPT))
        tp = _positive_int(env, PD_TENSOR_PARALLEL, 1)
        rank = _positive_int(env, PD_RANK, 0) if env.get(PD_RANK) not in (None, "", "0") else 0
        if not env.get(LLM_DATADIST_CLUSTER_ID) and env.get(LLM_DATADIST_CLUSTER_ID_BASE):
            if not env.get(LLM_DATADIST_POD_INDEX):
                raise ValueError(f"{LLM_DATADIST_POD_INDEX} is not set")
            try:
                cid = cluster_id(int(env[LLM_DATADIST_CLUSTER_ID_BASE]), int(env[LLM_DATADIST_POD_INDEX]), tp, rank)
            except ValueError as e:
                raise ValueError(f"{LLM_DATADIST_CLUSTER_ID_BASE}/{LLM_DATADIST_POD_INDEX} must be integers: "
                                 f"{e}") from e
        elif not env.get(LLM_DATADIST_CLUSTER_ID):
            raise ValueError(f"{LLM_DATADIST_CLUSTER_ID} is not set")
        else:
            cid = _int(env, LLM_DATADIST_CLUSTER_ID, 0)
        return cls(role=role, cluster_id=cid, ip=engine_ip(env), port=_int(env, LLM_DATADIST_PORT, DATADIST_PORT),
                   model_id=_int(env, LLM_DATADIST_MODEL_ID, 0), tensor_parallel=tp, rank=rank,
                   device_id=_int(env, LLM_DATADIST_DEVICE_ID, None), npu=_int(env, PD_DEVICE_ID, None))


@overload
def _int(env: Mapping[str, str], name: str, default: int) -> int: ...
@overload
def _int(env: Mapping[str, str], name: str, default: None) -> int | None: ...
def _int(env: Mapping[str, str], name: str, default: int | None) -> int | None:
    raw = env.get(name)
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError as e:
        raise ValueError(f"{name} must be an integer: {e}") from e


def _positive_int(env: Mapping[str, str], name: str, default: int) -> int:
    v = _int(env, name, default)
    if v < 1:
        raise ValueError(f"{name} must be at least 1, got {v}")
    return v


@dataclass(frozen=True)
class Gang:
    """Where a pod stands in its instance: `pods` pods hold the instance's `tp` x `dp` ranks in
    equal consecutive shares (pod `index` holds ranks index x per_pod ...), the pod of index 0
    leads it (its agent fronts every rank of the instance). Rank g of the instance is rank g % tp of
    data-parallel group g // tp; its cluster id is the instance's first plus g."""
    pods: int = 1
    tp: int = 1
    dp: int = 1
    index: int = 0

    @property
    def ranks(self) -> int:
        return self.tp * self.dp

    @property
    def per_pod(self) -> int:
        return self.ranks // self.pods

    @property
    def first_rank(self) -> int:
        return self.index * self.per_pod

    @property
    def leader(self) -> bool:
        return self.index == 0

    @property
    def spans(self) -> bool:
        return self.pods > 1 or self.dp > 1

    def rank_env(self, local: int) -> dict[str, str]:
        """A rank process's place: its TP rank and size, its instance rank and its DP group."""
        g = self.first_rank + local
        return {PD_RANK: str(g % self.tp), PD_TENSOR_PARALLEL: str(self.tp), PD_INSTANCE_RANK: str(g),
                PD_DP_RANK: str(g // self.tp)}

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Gang:
        """The pod's gang (a single-pod, single-group instance without the variables)."""
        if not env.get(PD_PODS_PER_INSTANCE) and not env.get(PD_DATA_PARALLEL):
            return cls(tp=_positive_int(env, PD_TENSOR_PARALLEL, 1))
        pods = _positive_int(env, PD_PODS_PER_INSTANCE, 1)
        dp = _positive_int(env, PD_DATA_PARALLEL, 1)
        tp = _positive_int(env, PD_TP_SIZE, 1)
        if (tp * dp) % pods:
            raise ValueError(f"{PD_PODS_PER_INSTANCE}={pods} does not divide {PD_TP_SIZE} x {PD_DATA_PARALLEL} "
                             f"= {tp * dp}")
        index = _int(env, LLM_DATADIST_POD_INDEX, 0) % pods
        return cls(pods=pods, tp=tp, dp=dp, index=index)
