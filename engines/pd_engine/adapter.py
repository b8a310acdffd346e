"""The engine adapter interface: what an inference server implements, per rank process, to run
under pd-operator.

The operator runs one LLM-DataDist engine per tensor-parallel rank process (one engine per process
is all the library allows). The pieces around it are pd-operator's: the engine's identity (role,
cluster id, device IP and port, CacheDesc) comes from the env the operator injects, the links are
made by the operator through the rank's agent API, role switches are driven by the operator too.
What only the inference server knows is where its KV lives and how to compute with it. That is this
interface, `EngineAdapter`:

    register_kv_caches(rank) -> KVLayout
        Called once, after the rank's LLM-DataDist engine is initialised. Allocate (or register) the
        KV cache memory through `rank.kv_cache_manager` and return its layout: the CacheDesc fields
        (num_tensors, shape, data_type) and, for a paged cache, its block info. A paged cache on the
        prompt side is keyed `BlocksCacheKey(rank.cluster_id, rank.model_id)`; a contiguous cache
        is allocated per request in `prefill`. The layout must equal what the operator derived from
        spec.model.kvCache (LLM_DATADIST_CACHE_DESC): `check_layout` compares them and says which
        field differs, because the decoder pulls the bytes of exactly that layout.

    prefill(req) -> PrefillResult
        Prompt role. Compute the prompt, leave its KV in LLM-DataDist memory where a decoder can pull
        it, and return the `CacheHandle` that names it: `(cluster_id, req_id, model_id)` (the
        CacheKey) and, for a paged cache, the prompt-side block ids. The handle is what crosses to
        the decoder (through the router, or vLLM's kv_transfer_params), never an address to dial.

    pull_target(handle) -> PullTarget
        Decoder role. Where the KV of `handle` should land: a cache allocated through
        `rank.kv_cache_manager` (and, paged, the decoder block ids). pd-operator then pulls into it
        over the link the operator made (`pull`); the decoder never links on its own.

    decode(handle, target, req) -> list[int]
        Decoder role. Continue from the pulled KV (and the prefill's first token), return the tokens,
        and free `target`.

    before_switch(old_role, new_role) / after_switch(old_role, new_role)
        The operator switches a drained engine between "prompt" and "decoder". `before_switch` may
        refuse by raising `SwitchRefused` (for example while requests are in flight); the engine's
        caches are dropped and re-made around the switch, so `after_switch` re-registers what the
        new role needs (call `register_kv_caches` again if the layout is role-dependent).

    load() -> LoadFigures
        Queue depth, running requests and KV usage, as the rank sees them now. The pod's agent
        reports them to the operator (`/v1/status` -> `load`), whose rebalancing policies read them.

Calls may come from any thread but never two at once for the same request; `prefill` and `decode`
of different requests may overlap. An adapter raises `ValueError` for a request it refuses.

The entry point for a rank process is `pd_engine.rank.serve_rank(adapter, identity_env=os.environ)`
(see docs/engines.md). `pd_engine.reference.ReferenceAdapter` is the first implementation; vLLM
needs none of this: its KV connector (`pd_engine.vllm_connector`) speaks to LLM-DataDist itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from pd_contract.names import ENGINE_ROLES as ROLES  # noqa: F401 (the roles an adapter's engine takes)


class SwitchRefused(Exception):
    """Raised by `before_switch` to refuse a role switch for now (the operator retries later)."""


class NotLinked(RuntimeError):
    """A decoder was asked to pull from a prefill cluster it has no link to. Links are the
    operator's to make (the decoder never dials on its own): this names the cluster id."""

    def __init__(self, cluster_id: int, detail: str = ""):
        self.cluster_id = cluster_id
        super().__init__(f"not linked to prompt cluster {cluster_id}: the operator links each decoder rank to the "
                         f"prefill ranks it may pull from; check the PDDeployment's LinksReady condition"
                         + (f" ({detail})" if detail else ""))


@dataclass(frozen=True)
class BlockInfo:
    """A paged cache: `num_blocks` blocks of `block_size` token positions each."""
    num_blocks: int
    block_size: int


@dataclass(frozen=True)
class KVLayout:
    """The CacheDesc of a rank's KV cache: `num_tensors` tensors (GQA: K and V per layer; MLA: one
    latent per layer) of `shape` [batch or blocks, seq or block_size, kv heads on this rank, head
    dim] in `data_type` (an llm_datadist DataType name, e.g. "DT_FLOAT16"); `paged` when the cache
    is a blocks cache."""
    num_tensors: int
    shape: tuple[int, ...]
    data_type: str
    paged: BlockInfo | None = None

    def to_json(self) -> dict:
        """The LLM_DATADIST_CACHE_DESC form (pd_agent.identity's `cache_desc`)."""
        d: dict[str, Any] = {"num_tensors": self.num_tensors, "shape": list(self.shape), "data_type": self.data_type}
        if self.paged is not None:
            d["paged"] = {"num_blocks": self.paged.num_blocks, "block_size": self.paged.block_size}
        return d

    @classmethod
    def from_json(cls, d: dict) -> KVLayout:
        p = d.get("paged")
        return cls(int(d["num_tensors"]), tuple(int(x) for x in d["shape"]), str(d["data_type"]),
                   BlockInfo(int(p["num_blocks"]), int(p["block_size"])) if p else None)

    def cache_desc(self, llm: Any, batch: int | None = None, seq: int | None = None) -> Any:
        """An `llm.CacheDesc` of this layout (batch/seq override shape[0]/shape[1])."""
        shape = list(self.shape)
        if batch is not None:
            shape[0] = batch
        if seq is not None:
            shape[1] = seq
        return llm.CacheDesc(self.num_tensors, shape, getattr(llm.DataType, self.data_type))


def check_layout(got: KVLayout, want: dict) -> None:
    """ValueError naming every field of `got` that differs from the operator's CacheDesc `want`
    (its JSON). Paged caches compare heads and head dim (shape[2:]); the rest are the engine's."""
    problems = []
    if got.num_tensors != int(want["num_tensors"]):
        problems.append(f"num_tensors {got.num_tensors} (the operator's CacheDesc says {want['num_tensors']})")
    if got.data_type != want.get("data_type"):
        problems.append(f"data_type {got.data_type} (the operator's CacheDesc says {want.get('data_type')})")
    if list(got.shape[2:]) != list(want["shape"])[2:]:
        problems.append(f"heads x head dim {list(got.shape[2:])} (the operator's CacheDesc says "
                        f"{list(want['shape'])[2:]})")
    if problems:
        raise ValueError("the engine's KV layout is not the PDDeployment's spec.model.kvCache: " + "; ".join(problems))


@dataclass(frozen=True)
class CacheHandle:
    """What a decoder needs to pull a prefill's KV: the CacheKey `(cluster_id, req_id, model_id)`
    of the prompt rank that holds it, the prompt's length and, for a paged cache, the prompt-side
    block ids (pulled with `BlocksCacheKey(cluster_id, model_id)`)."""
    cluster_id: int
    req_id: int
    model_id: int = 0
    num_tokens: int = 0
    blocks: tuple[int, ...] = ()

    def cache_key(self, llm: Any) -> Any:
        return llm.CacheKey(self.cluster_id, self.req_id, self.model_id)

    def to_json(self) -> dict:
        return {"cluster_id": self.cluster_id, "req_id": self.req_id, "model_id": self.model_id,
                "num_tokens": self.num_tokens, "blocks": list(self.blocks)}

    @classmethod
    def from_json(cls, d: dict) -> CacheHandle:
        return cls(int(d["cluster_id"]), int(d["req_id"]), int(d.get("model_id", 0)), int(d.get("num_tokens", 0)),
                   tuple(int(b) for b in d.get("blocks", ())))


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


@dataclass(frozen=True)
class PrefillRequest:
    req_id: int
    token_ids: tuple[int, ...]
    sampling: Sampling = Sampling()


@dataclass(frozen=True)
class PrefillResult:
    handle: CacheHandle
    first_token: int


@dataclass(frozen=True)
class DecodeRequest:
    first_token: int
    max_tokens: int
    sampling: Sampling = Sampling()


@dataclass
class PullTarget:
    """Where a decoder pulls a handle's KV: `cache` (an llm_datadist Cache) at `batch_index`, or,
    paged, into `blocks` of a blocks cache (as many as the handle's)."""
    cache: Any
    batch_index: int = 0
    blocks: tuple[int, ...] = ()
    owned: bool = True          # decode() deallocates it when done


@dataclass(frozen=True)
class LoadFigures:
    """A rank's load now: requests waiting, requests running, KV cache usage as a fraction."""
    queue_depth: int = 0
    running: int = 0
    kv_usage: float = 0.0
    kv_used_bytes: int = 0
    kv_capacity_bytes: int = 0


@dataclass
class Rank:
    """One rank process's LLM-DataDist engine and identity, as an adapter sees them."""
    llm: Any                     # the llm_datadist module (CANN's or llm_datadist_sim)
    engine: Any                  # its LLMDataDist, initialised
    cluster_id: int
    model_id: int = 0
    rank: int = 0
    tensor_parallel: int = 1
    cache_desc: dict = field(default_factory=dict)   # the operator's CacheDesc (LLM_DATADIST_CACHE_DESC)

    @property
    def role(self) -> str:
        return "prompt" if self.engine.role == self.llm.LLMRole.PROMPT else "decoder"

    @property
    def kv_cache_manager(self) -> Any:
        return self.engine.kv_cache_manager


@runtime_checkable
class EngineAdapter(Protocol):
    """The calls an inference server implements per rank process (see the module docstring)."""

    def register_kv_caches(self, rank: Rank) -> KVLayout: ...

    def prefill(self, req: PrefillRequest) -> PrefillResult: ...

    def pull_target(self, handle: CacheHandle) -> PullTarget: ...

    def decode(self, handle: CacheHandle, target: PullTarget, req: DecodeRequest) -> list[int]: ...

    def before_switch(self, old_role: str, new_role: str) -> None: ...

    def after_switch(self, old_role: str, new_role: str) -> None: ...

    def load(self) -> LoadFigures: ...


def pull(rank: Rank, handle: CacheHandle, target: PullTarget) -> None:
    """Pull `handle`'s KV into `target` over the link the operator made to `handle.cluster_id`.
    `NotLinked` when there is none; other `llm.LLMException`s pass through (a pull's
    LLM_WAIT_PROCESS_TIMEOUT means the link broke: the operator re-links)."""
    llm = rank.llm
    mgr = rank.kv_cache_manager
    try:
        if handle.blocks:
            if len(target.blocks) != len(handle.blocks):
                raise ValueError(f"{len(handle.blocks)} prompt blocks into {len(target.blocks)} decoder blocks")
            mgr.pull_blocks(llm.BlocksCacheKey(handle.cluster_id, handle.model_id), target.cache,
                            list(handle.blocks), list(target.blocks))
        else:
            mgr.pull_cache(handle.cache_key(llm), target.cache, target.batch_index)
    except llm.LLMException as e:
        if e.status_code == llm.LLMStatusCode.LLM_NOT_YET_LINK:
            raise NotLinked(handle.cluster_id, str(e)) from e
        raise


def serve_decode(adapter: EngineAdapter, rank: Rank, handle: CacheHandle, req: DecodeRequest) -> list[int]:
    """The decoder's whole path for one request: a target from the adapter, the pull, the decode."""
    target = adapter.pull_target(handle)
    try:
        pull(rank, handle, target)
    except BaseException:
        if target.owned:
            rank.kv_cache_manager.deallocate_cache(target.cache)
        raise
    return adapter.decode(handle, target, req)
