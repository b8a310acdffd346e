"""The llm_datadist value types: roles, data types, CacheDesc, CacheKey, cluster info, config."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import Any

from .status import LLMException, LLMStatusCode


class LLMRole(IntEnum):
    PROMPT = 1
    DECODER = 2
    MIX = 3


class Placement(IntEnum):
    HOST = 0
    DEVICE = 1


class DataType(Enum):
    DT_FLOAT = 0
    DT_FLOAT16 = 1
    DT_INT8 = 2
    DT_INT32 = 3
    DT_UINT8 = 4
    DT_INT16 = 6
    DT_UINT16 = 7
    DT_UINT32 = 8
    DT_INT64 = 9
    DT_UINT64 = 10
    DT_DOUBLE = 11
    DT_BOOL = 12
    DT_BF16 = 27


_DTYPE_BYTES = {
    DataType.DT_FLOAT: 4, DataType.DT_FLOAT16: 2, DataType.DT_BF16: 2, DataType.DT_INT8: 1,
    DataType.DT_UINT8: 1, DataType.DT_INT16: 2, DataType.DT_UINT16: 2, DataType.DT_INT32: 4,
    DataType.DT_UINT32: 4, DataType.DT_INT64: 8, DataType.DT_UINT64: 8, DataType.DT_DOUBLE: 8,
    DataType.DT_BOOL: 1,
}


def dtype_size(dt: DataType) -> int:
    return _DTYPE_BYTES[dt]


class CacheDesc:
    def __init__(self, num_tensors: int, shape, data_type: DataType = DataType.DT_FLOAT16,
                 placement: Placement = Placement.DEVICE, batch_dim_index: int = 0,
                 seq_len_dim_index: int = -1):
        if not isinstance(num_tensors, int) or num_tensors <= 0:
            raise LLMException(f"num_tensors must be a positive int, got {num_tensors!r}",
                               LLMStatusCode.LLM_PARAM_INVALID)
        shape = list(shape)
        if not shape or any(not isinstance(d, int) or d <= 0 for d in shape):
            raise LLMException(f"shape must be positive ints, got {shape!r}", LLMStatusCode.LLM_PARAM_INVALID)
        if not isinstance(data_type, DataType):
            raise LLMException(f"data_type must be a DataType, got {data_type!r}",
                               LLMStatusCode.LLM_PARAM_INVALID)
        self.num_tensors = num_tensors
        self.shape = shape
        self.data_type = data_type
        self.placement = Placement(placement)
        self.batch_dim_index = batch_dim_index
        self.seq_len_dim_index = seq_len_dim_index

    @property
    def tensor_bytes(self) -> int:
        return math.prod(self.shape) * dtype_size(self.data_type)

    @property
    def total_bytes(self) -> int:
        return self.tensor_bytes * self.num_tensors

    def __repr__(self) -> str:
        return (f"CacheDesc(num_tensors={self.num_tensors}, shape={self.shape}, "
                f"data_type={self.data_type.name}, placement={self.placement.name})")


UINT64_MAX = 2 ** 64 - 1


class CacheKey:
    def __init__(self, prompt_cluster_id: int, req_id: int, model_id: int = 0,
                 prefix_id: int = UINT64_MAX):
        for n, v in (("prompt_cluster_id", prompt_cluster_id), ("req_id", req_id),
                     ("model_id", model_id), ("prefix_id", prefix_id)):
            if not isinstance(v, int) or not 0 <= v <= UINT64_MAX:
                raise LLMException(f"{n} must be a uint64, got {v!r}", LLMStatusCode.LLM_PARAM_INVALID)
        self.prompt_cluster_id = prompt_cluster_id
        self.req_id = req_id
        self.model_id = model_id
        self.prefix_id = prefix_id

    def ident(self) -> tuple[int, int, int]:
        """What identifies the cache on the prompt side (its own cluster id is implied)."""
        return (self.req_id, self.model_id, self.prefix_id)

    def __repr__(self) -> str:
        return (f"CacheKey(prompt_cluster_id={self.prompt_cluster_id}, req_id={self.req_id}, "
                f"model_id={self.model_id})")


class BlocksCacheKey:
    def __init__(self, prompt_cluster_id: int, model_id: int = 0):
        self.prompt_cluster_id = prompt_cluster_id
        self.model_id = model_id

    def __repr__(self) -> str:
        return f"BlocksCacheKey(prompt_cluster_id={self.prompt_cluster_id}, model_id={self.model_id})"


def _ip_str(ip: Any) -> str:
    if isinstance(ip, int):  # the real API also takes an int IPv4
        return ".".join(str((ip >> s) & 0xFF) for s in (24, 16, 8, 0))
    return str(ip)


class IpInfo:
    def __init__(self, ip: Any, port: int):
        self.ip = _ip_str(ip)
        self.port = int(port)

    def __repr__(self) -> str:
        return f"{self.ip}:{self.port}"


class LLMClusterInfo:
    def __init__(self):
        self.remote_cluster_id: int = 0
        self.remote_role_type: LLMRole = LLMRole.PROMPT
        self.local_ip_info: list[IpInfo] = []
        self.remote_ip_info: list[IpInfo] = []

    def append_local_ip_info(self, ip: Any, port: int) -> None:
        self.local_ip_info.append(IpInfo(ip, port))

    def append_remote_ip_info(self, ip: Any, port: int) -> None:
        self.remote_ip_info.append(IpInfo(ip, port))

    def __repr__(self) -> str:
        return f"LLMClusterInfo(remote_cluster_id={self.remote_cluster_id}, remote={self.remote_ip_info})"


@dataclass
class LLMConfig:
    """Engine options; ``generate_options()`` yields the real option keys."""
    device_id: int | list[int] | None = None
    sync_kv_timeout: int = 1000
    listen_ip_info: str | None = None
    enable_switch_role: bool = False
    enable_cache_manager: bool = False
    mem_utilization: float = 0.95
    buf_pool_cfg: str | None = None
    mem_pool_cfg: str | None = None
    extra: dict[str, str] = field(default_factory=dict)

    def generate_options(self) -> dict[str, str]:
        opts: dict[str, str] = {}
        if self.device_id is not None:
            ids = self.device_id if isinstance(self.device_id, list) else [self.device_id]
            opts["ge.exec.deviceId"] = ";".join(str(i) for i in ids)
        opts["llm.SyncKvCacheWaitTime"] = str(self.sync_kv_timeout)
        if self.listen_ip_info:
            opts["llm.listenIpInfo"] = self.listen_ip_info
        if self.enable_switch_role:
            opts["llm.EnableSwitchRole"] = "1"
        if self.enable_cache_manager:
            opts["llm.EnableCacheManager"] = "1"
        opts["llm.MemoryUtilization"] = str(self.mem_utilization)
        if self.buf_pool_cfg:
            opts["llm.BufPoolCfg"] = self.buf_pool_cfg
        if self.mem_pool_cfg:
            opts["llm.MemPoolConfig"] = self.mem_pool_cfg
        opts.update(self.extra)
        return opts


LlmConfig = LLMConfig
