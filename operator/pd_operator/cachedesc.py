"""Derive the llm_datadist CacheDesc from a model profile (pure).

GQA: num_tensors = 2 * layers (K and V), shape [maxBatch, maxSeqLen, max(1, kvHeads // tp), headDim].
MLA: num_tensors = layers (one latent per layer), shape [maxBatch, maxSeqLen, 1, latentDim];
     the latent is not split by tensor parallelism.
Paged: the blocks cache has shape [numBlocks, blockSize, heads, dim] instead."""
from __future__ import annotations

import math
from dataclasses import dataclass

from .api import KvCache

DTYPES = {"float16": ("DT_FLOAT16", 2), "bfloat16": ("DT_BF16", 2), "float32": ("DT_FLOAT", 4),
          "int8": ("DT_INT8", 1)}
SIM_MEMORY_BUDGET = 64 << 20  # real bytes a simulated engine may hold for its cache


@dataclass(frozen=True)
class DerivedCache:
    num_tensors: int
    shape: list[int]
    data_type: str
    blocks_shape: list[int] | None
    bytes_per_token: int      # whole model, all ranks: what one token's KV costs
    cache_bytes: int          # one engine's cache as described (per tensor-parallel rank)

    def agent_json(self) -> dict:
        """What the agent reads from LLM_DATADIST_CACHE_DESC."""
        d = {"num_tensors": self.num_tensors, "shape": self.shape, "data_type": self.data_type}
        if self.blocks_shape:
            d["paged"] = {"num_blocks": self.blocks_shape[0], "block_size": self.blocks_shape[1]}
        return d

    def sim_memory_scale(self, budget: int = SIM_MEMORY_BUDGET) -> int:
        return max(1, math.ceil(self.cache_bytes / budget))


def derive(kv: KvCache) -> DerivedCache:
    dtype_name, size = DTYPES[kv.dtype]
    if kv.attention == "MLA":
        if kv.latent_dim is None:
            raise ValueError("spec.model.kvCache.latentDim is required for MLA")
        num_tensors, heads, dim = kv.num_layers, 1, kv.latent_dim
        bytes_per_token = kv.num_layers * kv.latent_dim * size
    else:
        num_tensors, heads, dim = 2 * kv.num_layers, max(1, kv.num_kv_heads // kv.tensor_parallel), kv.head_dim
        bytes_per_token = 2 * kv.num_layers * kv.num_kv_heads * kv.head_dim * size
    shape = [kv.max_batch, kv.max_seq_len, heads, dim]
    blocks = [kv.paged.num_blocks, kv.paged.block_size, heads, dim] if kv.paged else None
    cache_bytes = num_tensors * math.prod(blocks or shape) * size
    return DerivedCache(num_tensors=num_tensors, shape=shape, data_type=dtype_name, blocks_shape=blocks,
                        bytes_per_token=bytes_per_token, cache_bytes=cache_bytes)
