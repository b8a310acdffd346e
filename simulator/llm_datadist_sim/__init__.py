"""A simulator of CANN's ``llm_datadist`` Python API with a real data path.

``import llm_datadist_sim as llm_datadist`` runs code written for the real module: same
names, signatures, enums and status codes; links are TCP connections opened by the
decoder, and pulls move the prompt cache's bytes."""
from .engine import Cache, KvCacheManager, LLMDataDist, memory_scale
from .faults import Faults
from .status import LLMException, LLMStatusCode
from .types import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LlmConfig,
    LLMRole,
    Placement,
    dtype_size,
)

SIMULATED = True  # lets callers tell the simulator from the real module

__all__ = [
    "BlocksCacheKey", "Cache", "CacheDesc", "CacheKey", "DataType", "Faults", "KvCacheManager",
    "LLMClusterInfo", "LLMConfig", "LLMDataDist", "LLMException", "LLMRole", "LLMStatusCode",
    "LlmConfig", "Placement", "SIMULATED", "dtype_size", "memory_scale",
]
