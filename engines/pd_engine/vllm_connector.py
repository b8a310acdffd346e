"""PDOperatorConnector: a vLLM KV connector (KVConnectorBase_V1) over LLM-DataDist, for engines run
by pd-operator. vLLM loads it with

    --kv-transfer-config '{"kv_connector":"PDOperatorConnector",
                           "kv_connector_module_path":"pd_engine.vllm_connector","kv_role":"kv_both"}'

(`pd_engine.vllm_config.render_vllm_args` writes it). It subclasses vLLM's class when vllm is
importable, else a stand-in with the same signatures (pd_engine._vllm_compat).

How a request flows (the kv_transfer_params convention of vLLM's P-D connectors):
- The router sends the prompt to a prefill pod with `kv_transfer_params: {"do_remote_decode": true}`.
  Worker side, `register_kv_caches` registered vLLM's own KV cache tensors with LLM-DataDist by
  address (`register_blocks_cache`, keyed `BlocksCacheKey(cluster_id, model_id)` on a prefill): no
  cache of the connector's own, no copy. vLLM's forward pass writes the request's blocks;
  `request_finished` keeps them (returns True) and returns kv_transfer_params naming the remote:
  `remote_cluster_id` (rank 0's; rank r is + r), `remote_host`/`remote_port` (its datadist address,
  for diagnostics), `remote_block_ids`, `remote_tp_size`, `remote_request_id`.
- The router passes them to a decoder pod with `do_remote_prefill: true`.
  `get_num_new_matched_tokens` reports the prompt's tokens as loadable (asynchronously),
  `update_state_after_alloc` pairs the local blocks with the remote ones, and each worker's
  `start_load_kv` pulls its rank's blocks with `pull_blocks` from the prefill rank it is linked
  to, straight into the decoder's vLLM blocks (registered the same way, without a key);
  `get_finished` reports the request loaded.
- The decoder never dials: it pulls only over the links the operator made (rank r to the
  prefill's rank r). An unlinked remote is a `NotLinked` error naming the cluster id: logged,
  kept in `load_errors`, and its blocks reported by `get_block_ids_with_load_errors` (vLLM then
  recomputes them).
- The prefill releases the blocks when the decoder's agent reports the pull (`/v1/notify`), or
  after PENDING_TTL_S.

Each worker is one rank process: it opens its LLM-DataDist engine from the env the operator
injects (`pd_agent.front.rank_env` for vLLM's TP rank), serves that rank's agent API and
registers it with the pod's agent (`pd_engine.rank.AgentClient`, URL from PD_AGENT_URL), so the
operator's link, verify and switch calls reach it. A role switch gives the registration back
(`deallocate_cache`) and registers the same tensors again in the new role.

The tensors are registered by address whatever device holds them (`data_ptr()` of a torch tensor on
an NPU, the buffer of a numpy array in tests and the stand-in): the code path is one. The base class
is vLLM's from 0.9 on: its `__init__` took `(vllm_config, role)` before 0.11.2 and
`(vllm_config, role, kv_cache_config)` since; the connector calls it the way the installed vLLM takes.
"""
from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pd_contract.engine_env import (
    LLM_DATADIST_CACHE_DESC,
    LLM_DATADIST_CLUSTER_ID,
    LLM_DATADIST_CLUSTER_ID_BASE,
    LLM_DATADIST_MODEL_ID,
    LLM_DATADIST_POD_INDEX,
    LLM_DATADIST_PORT,
    PD_RANK,
    PD_TENSOR_PARALLEL,
    cluster_id,
    engine_ip,
)
from pd_contract.names import DATADIST_PORT

from ._vllm_compat import base_init_args
from .adapter import BlockInfo, KVLayout, NotLinked, Rank, check_layout
from .rank import AgentClient, RankServer, open_rank, rank_env_for

try:  # vLLM's own base class when vllm is installed
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore[import-not-found]
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )
    VLLM = True
except ImportError:
    from ._vllm_compat import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
    VLLM = False

__all__ = ["VLLM", "KVConnectorRole", "PDConnectorMetadata", "PDOperatorConnector", "RecvSpec", "req_id_of"]
log = logging.getLogger("pd_engine.vllm")
PENDING_TTL_S = 120.0     # as the agent's: a prefilled cache nobody pulled is released after this
_DTYPES = (("bfloat16", "DT_BF16"), ("float16", "DT_FLOAT16"), ("float32", "DT_FLOAT"), ("int8", "DT_INT8"))


def req_id_of(request_id: str) -> int:
    """vLLM's request ids are strings; LLM-DataDist's are uint64: a stable 63-bit hash."""
    return int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "big") >> 1


@dataclass
class RecvSpec:
    local_block_ids: list[int]
    remote_cluster_id: int            # the prefill's rank 0; rank r pulls from + r
    remote_block_ids: list[int]
    remote_tp_size: int = 1
    remote_request_id: str = ""
    remote_model_id: int = 0


@dataclass
class PDConnectorMetadata(KVConnectorMetadata):
    reqs_to_recv: dict[str, RecvSpec] = field(default_factory=dict)
    reqs_to_save: dict[str, list[int]] = field(default_factory=dict)    # this step's blocks to copy out
    reqs_to_send: dict[str, float] = field(default_factory=dict)        # finished, held until pulled (expiry)


def _params(request: Any) -> dict:
    return getattr(request, "kv_transfer_params", None) or {}


def _block_ids(blocks: Any) -> list[int]:
    """KVCacheBlocks (its first KV cache group), or a plain list."""
    if hasattr(blocks, "get_block_ids"):
        ids = blocks.get_block_ids()
        return list(ids[0]) if ids else []
    return list(blocks or [])


def _tensors_of(value: Any) -> list[Any]:
    """A layer's cache as its tensors: (K, V) pairs, [2, blocks, ...] stacks, or one tensor (MLA)."""
    if isinstance(value, (list, tuple)):
        return list(value)
    if len(value.shape) == 5 and value.shape[0] == 2:
        return [value[0], value[1]]
    return [value]


def _address(t: Any) -> int:
    """Where a KV tensor's memory starts, for registering it with LLM-DataDist: `data_ptr()` of a
    torch tensor (host or device memory alike), the buffer of a numpy array. Blocks must lie back
    to back (contiguous), as LLM-DataDist addresses block b at address + b * block bytes."""
    if hasattr(t, "data_ptr"):
        if not t.is_contiguous():
            raise ValueError("KV cache tensors must be contiguous to be registered by address")
        return int(t.data_ptr())
    arr = np.asarray(t)
    if not arr.flags.c_contiguous:
        raise ValueError("KV cache tensors must be contiguous to be registered by address")
    return int(arr.ctypes.data)


def _dtype_name(t: Any) -> str:
    name = str(t.dtype)
    for key, dt in _DTYPES:
        if key in name:
            return dt
    raise ValueError(f"KV cache dtype {name} has no LLM-DataDist DataType here")


class PDOperatorConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None, *,
                 env: Mapping[str, str] | None = None, agent: AgentClient | None = None, llm: Any = None,
                 tp_rank: int | None = None, api_host: str = "127.0.0.1"):
        """vLLM passes the first three. The keyword arguments are for tests and embedding: the
        pod's env (default os.environ), the agent client, the llm_datadist module, the TP rank
        (default vLLM's), where the rank's agent API listens."""
        super().__init__(*base_init_args(KVConnectorBase_V1, vllm_config, role, kv_cache_config))
        self.env = dict(os.environ if env is None else env)
        # vLLM's base keeps kv_transfer_config from 0.11 on; 0.9's keeps only vllm_config
        kv_cfg = getattr(self, "_kv_transfer_config", None) or getattr(vllm_config, "kv_transfer_config", None)
        extra = getattr(kv_cfg, "kv_connector_extra_config", None) or {}
        self.tp = int(self.env.get(PD_TENSOR_PARALLEL) or extra.get("tensor_parallel") or 1)
        self._agent, self._llm, self._tp_rank, self._api_host = agent, llm, tp_rank, api_host
        # scheduler side
        self._recv: dict[str, RecvSpec] = {}
        self._save: dict[str, list[int]] = {}
        self._send: dict[str, float] = {}
        self._all_saving: set[str] = set()     # producer requests still prefilling
        # worker side
        self.server: RankServer | None = None
        self.rank: Rank | None = None
        self.layout: KVLayout | None = None
        self._cache: Any = None                           # vLLM's tensors, registered with LLM-DataDist
        self._addrs: list[int] = []                       # tensor index -> its address
        self._tensors: list[Any] = []                     # kept alive while registered
        self._recved: set[str] = set()
        self._sending: dict[str, float] = {}
        self._failed_blocks: set[int] = set()
        self.load_errors: dict[str, str] = {}

    # ================================ scheduler side ================================
    def _base_cluster_id(self) -> int:
        e = self.env
        if e.get(LLM_DATADIST_CLUSTER_ID_BASE) and e.get(LLM_DATADIST_POD_INDEX):
            return cluster_id(int(e[LLM_DATADIST_CLUSTER_ID_BASE]), int(e[LLM_DATADIST_POD_INDEX]), self.tp)
        return int(e.get(LLM_DATADIST_CLUSTER_ID) or 0) - int(e.get(PD_RANK) or 0)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        p = _params(request)
        if p.get("do_remote_prefill") and p.get("remote_block_ids") is not None:
            count = len(request.prompt_token_ids) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        p = _params(request)
        if p.get("do_remote_prefill") and num_external_tokens > 0:
            if "remote_cluster_id" not in p:
                raise ValueError(f"request {request.request_id}: kv_transfer_params has no remote_cluster_id")
            self._recv[request.request_id] = RecvSpec(
                _block_ids(blocks), int(p["remote_cluster_id"]), [int(b) for b in p["remote_block_ids"]],
                int(p.get("remote_tp_size") or 1), str(p.get("remote_request_id") or ""),
                int(p.get("remote_model_id") or 0))
            p["do_remote_prefill"] = False     # loaded once
        elif p.get("do_remote_decode"):
            self._save[request.request_id] = _block_ids(blocks)

    def build_connector_meta(self, scheduler_output: Any) -> PDConnectorMetadata:
        meta = PDConnectorMetadata(reqs_to_recv=self._recv, reqs_to_save=self._save, reqs_to_send=self._send)
        self._saving_ids()   # before _save is cleared: a request's later chunks are saved too
        # a chunked prefill's later chunks: the request's new blocks
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        for i, rid in enumerate(getattr(cached, "req_ids", None) or []):
            if rid in self._saving_ids():
                new = (getattr(cached, "new_block_ids", None) or [None] * (i + 1))[i]
                if new:
                    meta.reqs_to_save.setdefault(rid, []).extend(new[0])
        self._recv, self._save, self._send = {}, {}, {}
        return meta

    def _saving_ids(self) -> set[str]:
        self._all_saving |= set(self._save)
        return self._all_saving

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        p = _params(request)
        self._saving_ids().discard(request.request_id)
        if not p.get("do_remote_decode"):
            return False, None
        self._send[request.request_id] = time.time() + PENDING_TTL_S
        e = self.env
        return True, {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_cluster_id": self._base_cluster_id(), "remote_tp_size": self.tp,
            "remote_host": engine_ip(e, default=""),
            "remote_port": int(e.get(LLM_DATADIST_PORT) or DATADIST_PORT),
            "remote_block_ids": list(block_ids), "remote_request_id": request.request_id,
            "remote_model_id": int(e.get(LLM_DATADIST_MODEL_ID) or 0),
        }

    # ================================ worker side ================================
    def _rank_env(self) -> dict[str, str]:
        if self.env.get(PD_RANK):
            return self.env
        r = self._tp_rank
        if r is None:
            r = 0
            if VLLM:
                from vllm.distributed.parallel_state import get_tensor_model_parallel_rank  # type: ignore
                r = get_tensor_model_parallel_rank()
        return rank_env_for(self.env, r, self.tp)

    def register_kv_caches(self, kv_caches: dict[str, Any]):
        tensors = [t for value in kv_caches.values() for t in _tensors_of(value)]
        if not tensors:
            raise ValueError("no KV caches to register")
        first = tensors[0]
        shape = tuple(int(x) for x in first.shape)
        if any(tuple(int(x) for x in t.shape) != shape or str(t.dtype) != str(first.dtype) for t in tensors):
            raise ValueError("every KV tensor must have the first one's shape and dtype to be one blocks cache")
        heads, dim = (shape[2], shape[3]) if len(shape) == 4 else (1, shape[2])
        self._tensors, self._addrs = tensors, [_address(t) for t in tensors]
        self.layout = KVLayout(len(tensors), (shape[0], shape[1], heads, dim), _dtype_name(first),
                               BlockInfo(shape[0], shape[1]))
        env = self._rank_env()
        identity, rank, core = open_rank(env, self._llm)
        core.engine_owns_blocks = True     # vLLM's blocks: the operator's probes use a cache of their own
        self.rank = rank
        self.server = RankServer(None, identity, rank, core)   # type: ignore[arg-type]  # no adapter: vLLM serves
        try:
            if env.get(LLM_DATADIST_CACHE_DESC):
                check_layout(self.layout, identity.cache_desc)
            self._register()
            core.after_switch.append(self._after_switch)
            core.before_switch.append(self._before_switch)
            url = self.server.start_api(self._api_host)
            (self._agent or AgentClient(env, identity.token)).register(identity.rank, url, core.boot_id)
        except BaseException:
            self.server.stop()
            raise
        log.info("rank %d: %d KV tensors of %s registered with LLM-DataDist in place (cluster %d, %s)",
                 identity.rank, len(tensors), self.layout.to_json(), identity.cluster_id, rank.role)

    def _manager(self) -> Any:
        """The engine's cache manager that registers memory by address: CANN's CacheManager
        (`llm.EnableCacheManager=1`) or the simulator's manager, which has the same calls."""
        rank = self.rank
        assert rank is not None
        try:
            v2 = rank.engine.cache_manager      # CANN raises unless the engine is in CacheManager mode
        except Exception:  # noqa: BLE001
            v2 = None
        for mgr in (v2, rank.kv_cache_manager):
            if mgr is not None and hasattr(mgr, "register_blocks_cache"):
                return mgr
        raise RuntimeError("this llm_datadist has no register_blocks_cache: registering vLLM's KV cache in place "
                           "needs CANN's CacheManager mode (llm.EnableCacheManager=1)")

    def _register(self) -> None:
        """vLLM's tensors as this rank's blocks cache, by address: keyed on a prefill (decoders pull
        its blocks), without a key on a decoder (pulls write into it)."""
        rank, layout = self.rank, self.layout
        assert rank is not None and layout is not None
        key = rank.llm.BlocksCacheKey(rank.cluster_id, rank.model_id) if rank.role == "prompt" else None
        self._cache = self._manager().register_blocks_cache(layout.cache_desc(rank.llm), self._addrs, key)

    def _unregister(self) -> None:
        if self._cache is not None:
            self._manager().unregister_cache(self._cache.cache_id)
            self._cache = None

    async def _before_switch(self, old: str, new: str) -> None:
        if self._sending:
            from pd_agent.core import AgentError
            raise AgentError("SWITCH_REFUSED", f"{len(self._sending)} KV caches wait to be pulled", 409)
        self._unregister()

    async def _after_switch(self, old: str, new: str) -> None:
        self._register()

    def _meta(self) -> PDConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PDConnectorMetadata)
        return meta

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._meta()
        for rid, spec in meta.reqs_to_recv.items():
            try:
                self._load(spec)
            except NotLinked as e:
                self._load_failed(rid, spec, str(e))
            except Exception as e:  # noqa: BLE001 - vLLM recomputes what failed to load
                self._load_failed(rid, spec, f"pulling from prompt cluster {self._remote(spec)}: {e!r}")
            self._recved.add(rid)
        for rid, expiry in meta.reqs_to_send.items():
            self._sending[rid] = expiry
            if self.server is not None:
                self.server.core.cache_ready(req_id_of(rid))

    def _remote(self, spec: RecvSpec) -> int:
        """Rank r pulls from the prefill's rank r (equal TP); a larger prefill TP maps by its factor."""
        rank = self.rank
        assert rank is not None
        factor = max(1, spec.remote_tp_size // max(1, self.tp))
        return spec.remote_cluster_id + rank.rank * factor

    def _load(self, spec: RecvSpec) -> None:
        rank = self.rank
        assert rank is not None
        if rank.role != "decoder":
            raise ValueError("this engine is a prefill (LLMRole.PROMPT): only a decoder pulls")
        if len(spec.local_block_ids) != len(spec.remote_block_ids):
            n = min(len(spec.local_block_ids), len(spec.remote_block_ids))
            spec.local_block_ids, spec.remote_block_ids = spec.local_block_ids[:n], spec.remote_block_ids[:n]
        if not spec.local_block_ids:
            return
        remote = self._remote(spec)
        llm = rank.llm
        try:
            rank.kv_cache_manager.pull_blocks(llm.BlocksCacheKey(remote, spec.remote_model_id), self._cache,
                                              spec.remote_block_ids, spec.local_block_ids)
        except llm.LLMException as e:
            if e.status_code == llm.LLMStatusCode.LLM_NOT_YET_LINK:
                raise NotLinked(remote, str(e)) from e
            raise
        self._notify_pulled(remote, spec.remote_request_id)

    def _load_failed(self, rid: str, spec: RecvSpec, why: str) -> None:
        log.error("request %s: %s", rid, why)
        self.load_errors[rid] = why
        self._failed_blocks.update(spec.local_block_ids)

    def _notify_pulled(self, remote: int, remote_request_id: str) -> None:
        """Tell the prefill's agent (as the operator linked it) so it releases the blocks now."""
        server = self.server
        if server is None or not remote_request_id or server._loop is None:
            return
        core = server.core
        peer = core.peers.get(remote)
        if peer is not None and core.notifier is not None:
            server._loop.call_soon_threadsafe(core.notifier.pulled, peer.agent_url, req_id_of(remote_request_id))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None   # start_load_kv loads whole requests

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None   # the blocks are registered in place: a decoder's pull reads them where vLLM wrote them

    def wait_for_save(self):
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        recved, self._recved = self._recved, set()
        sent = set()
        pending = self.server.core.kv_pending if self.server is not None else {}
        now = time.time()
        for rid, expiry in list(self._sending.items()):
            if req_id_of(rid) not in pending or now >= expiry:
                sent.add(rid)
                del self._sending[rid]
        return sent or None, recved or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._failed_blocks = self._failed_blocks, set()
        return out

    def shutdown(self):
        if self.server is not None:
            try:
                self._unregister()
            except Exception:  # noqa: BLE001 - the engine may be finalized already
                log.debug("unregistering the KV cache at shutdown", exc_info=True)
            self.server.stop()
            self.server = None

