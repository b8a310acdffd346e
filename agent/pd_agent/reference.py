"""The reference engine's side of a rank: the model (refmodel) over this rank's llm_datadist
caches. A prefill computes the prompt's real KV and writes this rank's shard (its heads; MLA: the
whole latent) into the cache it leaves under the request's CacheKey; a decoder reads what it
pulled back out of its cache. The content probe checks a pulled shard against what the model
computes for the fixed probe prompt, and decodes from it."""
from __future__ import annotations

import threading

import numpy as np

from llm_datadist_sim.refmodel import PROBE_PROMPT, Model, Profile, shard_from_bytes

from .identity import ConfigError, Identity

PROBE_TOKENS = 8        # tokens the content probe decodes from the pulled KV
DTYPES = {"float16": "DT_FLOAT16", "bfloat16": "DT_BF16", "float32": "DT_FLOAT"}


class ReferenceEngine:
    def __init__(self, identity: Identity):
        try:
            self.profile = Profile.from_json(identity.reference_model or {})
            self.model = Model.get(self.profile)
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"PD_REFERENCE_MODEL: {e}") from e
        self.rank, self.tp = identity.rank, identity.tensor_parallel
        d = identity.cache_desc
        shape = d["shape"]
        self.heads, self.dim = shape[2], shape[3]
        m = self.model
        want_heads = m.kv_heads // self.tp if self.profile.attention == "GQA" else 1
        problems = []
        if d["num_tensors"] != m.num_tensors:
            problems.append(f"num_tensors {d['num_tensors']} (the model has {m.num_tensors})")
        if self.heads != want_heads or m.kv_heads % self.tp and self.profile.attention == "GQA":
            problems.append(f"shape[2] {self.heads} (rank {self.rank} of {self.tp} holds {want_heads} heads)")
        if self.dim != m.kv_dim:
            problems.append(f"shape[3] {self.dim} (the model's KV width is {m.kv_dim})")
        if d.get("data_type") != DTYPES.get(self.profile.dtype):
            problems.append(f"data_type {d.get('data_type')} (the model stores {self.profile.dtype})")
        if shape[1] < self.profile.max_seq:
            problems.append(f"shape[1] {shape[1]} is less than the model's maxSeqLen {self.profile.max_seq}")
        if problems:
            raise ConfigError("the CacheDesc does not lay out the reference model's KV: " + "; ".join(problems))
        self.max_seq = min(shape[1], self.profile.max_seq)
        self._probe: tuple[np.ndarray, int, list[int]] | None = None
        self._lock = threading.Lock()

    # ---- prefill --------------------------------------------------------------------------------
    def prefill(self, token_ids: list[int], temperature: float, top_p: float, seed: int) -> tuple[np.ndarray, int]:
        """(this rank's shard of the prompt's KV, the first output token)."""
        kv, logits = self.model.prefill(token_ids)
        first = self.model.sample(logits, temperature, top_p, seed, 0)
        return self.model.shard(kv, self.rank, self.tp), first

    @staticmethod
    def write(cache, shard: np.ndarray) -> None:
        """Into slot 0 of a cache of seq = the prompt's length (the simulator's cache memory; on
        an NPU the inference server's own kernels fill the device cache)."""
        if not hasattr(cache, "slot"):
            raise ConfigError("the reference engine runs on the simulator's caches only")
        for t in range(shard.shape[0]):
            data = shard[t].tobytes()
            view = cache.slot(t, 0)
            if len(view) != len(data):
                raise ConfigError(f"cache slot of {len(view)} B for a KV tensor of {len(data)} B: the reference "
                                  f"engine needs PD_SIM_MEMORY_SCALE=1")
            view[:] = data

    def read(self, cache, n: int) -> np.ndarray:
        return shard_from_bytes([cache.slot(t, 0) for t in range(cache.cache_desc.num_tensors)], n, self.heads,
                                self.dim, self.model.storage)

    def from_bytes(self, raw: bytes, n: int) -> np.ndarray:
        per = len(raw) // self.model.num_tensors
        return shard_from_bytes([raw[t * per:(t + 1) * per] for t in range(self.model.num_tensors)], n, self.heads,
                                self.dim, self.model.storage)

    # ---- the content probe ----------------------------------------------------------------------
    def probe(self) -> tuple[np.ndarray, int, list[int]]:
        """(the probe prompt's whole KV, its first token, one engine's decode of it), computed once."""
        with self._lock:
            if self._probe is None:
                kv, logits = self.model.prefill(list(PROBE_PROMPT))
                first = self.model.sample(logits, 0.0, 1.0, 0, 0)
                alone = self.model.generate(list(PROBE_PROMPT), PROBE_TOKENS)
                self._probe = (kv, first, alone)
            return self._probe

    def probe_shard(self) -> np.ndarray:
        kv, _, _ = self.probe()
        return self.model.shard(kv, self.rank, self.tp)

    def check_probe(self, pulled: np.ndarray) -> str | None:
        """None when the pulled shard is the model's; else what differs, and what it decodes to."""
        kv, first, alone = self.probe()
        expected = self.model.shard(kv, self.rank, self.tp)
        if pulled.shape == expected.shape and pulled.tobytes() == expected.tobytes():
            return None
        where = "its shape differs"
        if pulled.shape == expected.shape:
            diff = np.argwhere(pulled.view(np.uint8).reshape(pulled.shape[0], pulled.shape[1], -1)
                               != expected.view(np.uint8).reshape(expected.shape[0], expected.shape[1], -1))
            t, pos = int(diff[0][0]), int(diff[0][1])
            what = (f"{'KV'[t % 2]} of layer {t // 2}" if self.profile.attention == "GQA" else f"latent of layer {t}")
            rows = len({(int(a), int(b)) for a, b, _ in diff})
            where = f"tensor {t} ({what}) differs from position {pos}; {rows} (tensor, position) rows differ"
        decoded: list[int] | str
        try:
            shards = [self.model.shard(kv, r, self.tp) for r in range(self.tp)]
            shards[self.rank] = pulled
            st = self.model.state(shards, len(PROBE_PROMPT))
            decoded = list(self.model.continue_(st, first, PROBE_TOKENS))
        except ValueError as e:
            decoded = f"not decodable ({e})"
        return (f"the KV pulled for the probe prompt is not what the model computes for it: {where}; decoded from "
                f"it: {decoded}, one engine alone: {alone}")
