"""`ReferenceAdapter`: the engine adapter interface implemented for pd_agent's reference engine (a
small real transformer on the CPU, llm_datadist_sim.refmodel), over the simulator's caches.

A prefill computes the prompt's KV, writes this rank's shard into a cache of the prompt's length
keyed `CacheKey(cluster_id, req_id, model_id)` and returns that handle with the first token; a
decoder allocates a cache of the same length, pd-operator pulls into it (`adapter.pull`), and the
decode continues from the pulled bytes. GQA needs every rank's heads to decode, so a GQA decode runs
at tensor parallel 1 here; MLA ranks each hold the whole latent and decode alone at any TP."""
from __future__ import annotations

import threading

from pd_agent.identity import Identity
from pd_agent.reference import DTYPES, ReferenceEngine

from .adapter import (
    CacheHandle,
    DecodeRequest,
    KVLayout,
    LoadFigures,
    PrefillRequest,
    PrefillResult,
    PullTarget,
    Rank,
    SwitchRefused,
)


class ReferenceAdapter:
    def __init__(self, identity: Identity):
        self.engine = ReferenceEngine(identity)
        self.reference = self.engine    # lets the operator's content probe compare this engine's KV
        self.layout = KVLayout.from_json(identity.cache_desc)
        self.rank: Rank | None = None
        self._lock = threading.Lock()
        self._running = 0
        self._held: dict[int, object] = {}     # prompt: req_id -> its cache, until released

    # ---- registration ---------------------------------------------------------------------------
    def register_kv_caches(self, rank: Rank) -> KVLayout:
        """Contiguous caches, one per request of the prompt's length (allocated in prefill and
        pull_target): nothing to allocate up front; the layout is the model's."""
        self.rank = rank
        m = self.engine.model
        return KVLayout(m.num_tensors, (1, self.engine.max_seq, self.engine.heads, self.engine.dim),
                        DTYPES[self.engine.profile.dtype])

    def _rank(self) -> Rank:
        if self.rank is None:
            raise RuntimeError("register_kv_caches was not called")
        return self.rank

    # ---- prompt ---------------------------------------------------------------------------------
    def prefill(self, req: PrefillRequest) -> PrefillResult:
        rank = self._rank()
        if rank.role != "prompt":
            raise ValueError(f"prefill on a {rank.role} engine")
        n = len(req.token_ids)
        if not 1 <= n < self.engine.max_seq:
            raise ValueError(f"a prompt of {n} tokens does not fit maxSeqLen {self.engine.max_seq} with its output")
        with self._lock:
            self._running += 1
        try:
            s = req.sampling
            shard, first = self.engine.prefill(list(req.token_ids), s.temperature, s.top_p, s.seed)
            handle = CacheHandle(rank.cluster_id, req.req_id, rank.model_id, n)
            mgr = rank.kv_cache_manager
            cache = mgr.allocate_cache(self.layout.cache_desc(rank.llm, batch=1, seq=n), [handle.cache_key(rank.llm)])
            try:
                self.engine.write(cache, shard)
            except BaseException:
                mgr.remove_cache_key(handle.cache_key(rank.llm))
                mgr.deallocate_cache(cache)
                raise
            # freed by the library once the key is pulled (or removed by release)
            mgr.deallocate_cache(cache)
            return PrefillResult(handle, first)
        finally:
            with self._lock:
                self._running -= 1

    def release(self, handle: CacheHandle) -> None:
        """A prefilled cache nobody will pull (the request was cancelled)."""
        rank = self._rank()
        rank.kv_cache_manager.remove_cache_key(handle.cache_key(rank.llm))

    # ---- decoder --------------------------------------------------------------------------------
    def pull_target(self, handle: CacheHandle) -> PullTarget:
        rank = self._rank()
        if rank.role != "decoder":
            raise ValueError(f"a decode on a {rank.role} engine")
        if self.engine.profile.attention == "GQA" and self.engine.tp != 1:
            raise ValueError("a GQA decode needs every rank's heads: the reference adapter decodes at TP 1 (MLA at "
                             "any TP)")
        if not 1 <= handle.num_tokens < self.engine.max_seq:
            raise ValueError(f"the handle's prompt length {handle.num_tokens} is not in [1, {self.engine.max_seq})")
        cache = rank.kv_cache_manager.allocate_cache(self.layout.cache_desc(rank.llm, batch=1, seq=handle.num_tokens))
        return PullTarget(cache)

    def decode(self, handle: CacheHandle, target: PullTarget, req: DecodeRequest) -> list[int]:
        rank = self._rank()
        with self._lock:
            self._running += 1
        try:
            n = handle.num_tokens
            shard = self.engine.read(target.cache, n)
            m = self.engine.model
            remaining = max(1, min(req.max_tokens, self.engine.max_seq - n))
            st = m.state([shard], n, n + remaining)
            s = req.sampling
            return list(m.continue_(st, req.first_token, remaining, s.temperature, s.top_p, s.seed))
        finally:
            if target.owned:
                rank.kv_cache_manager.deallocate_cache(target.cache)
            with self._lock:
                self._running -= 1

    # ---- switching and load ---------------------------------------------------------------------
    def before_switch(self, old_role: str, new_role: str) -> None:
        with self._lock:
            if self._running:
                raise SwitchRefused(f"{self._running} requests in flight")

    def after_switch(self, old_role: str, new_role: str) -> None:
        return None   # per-request caches: nothing to re-register

    def load(self) -> LoadFigures:
        rank = self.rank
        mgr = rank.kv_cache_manager if rank is not None else None
        used = int(getattr(mgr, "used_bytes", 0) or 0)
        cap = int(getattr(mgr, "capacity_bytes", 0) or 0)
        return LoadFigures(queue_depth=0, running=self._running, kv_usage=used / cap if cap else 0.0,
                           kv_used_bytes=used, kv_capacity_bytes=cap)
