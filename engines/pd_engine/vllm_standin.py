"""`python -m pd_engine.vllm_standin`: a stand-in for `vllm serve` that drives a KV connector the way
vLLM's V1 engine does, without a model, so pd-operator's vLLM path runs where vLLM cannot (no NPU, no
vllm package): the connector and the operator are real, the model is not.

It takes vLLM's arguments `--tensor-parallel-size` and `--kv-transfer-config` (what the operator adds
for `spec.engine.adapter: vLLM`), loads the connector class named there from its
`kv_connector_module_path` as vLLM does, and runs one scheduler-side and one worker-side connector
(TP 1: one rank, in this process). Its KV caches are numpy arrays laid out by the operator's CacheDesc
(`LLM_DATADIST_CACHE_DESC`, paged), `register_kv_caches` opens the rank's LLM-DataDist engine and
registers it with the pod's agent, and a small HTTP API stands for the requests:

    POST /prefill {"request_id", "prompt_len", "seed"}   -> {"kv_transfer_params", "blocks", "sha256"}
        fills the request's blocks with seeded bytes (the "prefill"), saves them through the connector
        (save_kv_layer, wait_for_save) and finishes the request (request_finished keeps the blocks
        and returns the kv_transfer_params a router hands to a decoder)
    POST /decode {"request_id", "kv_transfer_params"}   -> {"blocks", "sha256", "errors", "finished"}
        what vLLM does for `do_remote_prefill`: get_num_new_matched_tokens, update_state_after_alloc,
        build_connector_meta, start_load_kv (the pull over the operator's link), get_finished
    GET /healthz

`sha256` is over the request's blocks, every tensor in order: equal on both sides when the pull
moved the exact bytes."""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib
import json
import logging
import os
import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
from aiohttp import web

from pd_contract.engine_env import LLM_DATADIST_CACHE_DESC, PD_LOCAL_POD_IP

log = logging.getLogger("pd_engine.vllm_standin")
DTYPES = {"DT_FLOAT16": np.float16, "DT_BF16": np.uint16, "DT_FLOAT": np.float32, "DT_INT8": np.int8}


class _Blocks:
    """vLLM's KVCacheBlocks, as the connector reads them."""

    def __init__(self, ids: list[int]):
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int]]:
        return (list(self.ids),)


def load_connector(kv_transfer_config: dict) -> type:
    """The class vLLM would load: `kv_connector` from `kv_connector_module_path`."""
    module = importlib.import_module(kv_transfer_config["kv_connector_module_path"])
    return getattr(module, kv_transfer_config["kv_connector"])


class StandIn:
    def __init__(self, cls: type, kv_transfer_config: dict, tensor_parallel: int, env: dict[str, str]):
        if tensor_parallel != 1:
            raise SystemExit("pd_engine.vllm_standin runs one rank (--tensor-parallel-size 1)")
        from .vllm_connector import KVConnectorRole
        cfg = SimpleNamespace(kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config=kv_transfer_config.get("kv_connector_extra_config") or {},
            is_kv_producer=True, kv_role=kv_transfer_config.get("kv_role")))
        desc = json.loads(env[LLM_DATADIST_CACHE_DESC])
        paged = desc.get("paged")
        if not paged:
            raise SystemExit("vLLM's caches are paged: spec.model.kvCache.paged must be set")
        blocks, size, heads, dim = paged["num_blocks"], paged["block_size"], desc["shape"][2], desc["shape"][3]
        self.block_size, self.num_blocks = size, blocks
        layers = desc["num_tensors"] // 2
        dtype = DTYPES[desc["data_type"]]
        # vLLM's layout: per attention layer one [2 (K, V), blocks, block size, heads, head dim] tensor
        self.caches = {f"model.layers.{i}.self_attn": np.zeros((2, blocks, size, heads, dim), dtype)
                       for i in range(layers)}
        self.scheduler = cls(cfg, KVConnectorRole.SCHEDULER, None, env=env)
        self.worker = cls(cfg, KVConnectorRole.WORKER, None, env=env)
        self.worker.register_kv_caches(self.caches)
        self.free = list(range(blocks))
        self.held: dict[str, list[int]] = {}      # prefilled, until the connector says they were sent
        self.lock = threading.Lock()              # one engine step at a time, as vLLM's loop

    def _alloc(self, n_tokens: int) -> list[int]:
        n = max(1, -(-n_tokens // self.block_size))
        if n > len(self.free):
            raise web.HTTPServiceUnavailable(text=f"no room: {n} blocks wanted, {len(self.free)} free")
        out, self.free = self.free[:n], self.free[n:]
        return out

    def _digest(self, blocks: list[int]) -> str:
        h = hashlib.sha256()
        for kv in self.caches.values():
            for t in range(2):
                for b in blocks:
                    h.update(kv[t, b].tobytes())
        return h.hexdigest()

    def _step(self, meta: Any) -> tuple[set[str] | None, set[str] | None]:
        """One engine step of the worker: bind, load, save every layer, finish."""
        w = self.worker
        w.bind_connector_metadata(meta)
        try:
            w.start_load_kv(None)
            for name, kv in self.caches.items():
                w.save_kv_layer(name, kv, None)
            w.wait_for_save()
            return w.get_finished(set())
        finally:
            w.clear_connector_metadata()

    def _release_sent(self, sent: set[str] | None) -> None:
        for rid in sent or ():
            self.free += self.held.pop(rid, [])

    def prefill(self, request_id: str, prompt_len: int, seed: int) -> dict:
        with self.lock:
            req = SimpleNamespace(request_id=request_id, kv_transfer_params={"do_remote_decode": True},
                                  prompt_token_ids=list(range(prompt_len)))
            self.scheduler.get_num_new_matched_tokens(req, 0)
            blocks = self._alloc(prompt_len)
            rng = np.random.default_rng(seed)
            for kv in self.caches.values():   # the "forward pass": this request's KV, as bytes
                raw = kv.view(np.uint8)
                raw[:, blocks] = rng.integers(0, 256, raw[:, blocks].shape, dtype=np.uint8)
            self.scheduler.update_state_after_alloc(req, _Blocks(blocks), 0)
            self._release_sent(self._step(self.scheduler.build_connector_meta(SimpleNamespace(
                scheduled_cached_reqs=None)))[0])
            delay, params = self.scheduler.request_finished(req, blocks)
            if delay:
                self.held[request_id] = blocks
            else:
                self.free += blocks
            self._release_sent(self._step(self.scheduler.build_connector_meta(SimpleNamespace()))[0])
            return {"kv_transfer_params": params, "blocks": blocks, "sha256": self._digest(blocks)}

    def decode(self, request_id: str, params: dict) -> dict:
        with self.lock:
            prompt_len = len(params.get("remote_block_ids") or []) * self.block_size
            req = SimpleNamespace(request_id=request_id, kv_transfer_params={**params, "do_remote_prefill": True},
                                  prompt_token_ids=list(range(prompt_len + 1)))
            count, _ = self.scheduler.get_num_new_matched_tokens(req, 0)
            blocks = self._alloc(prompt_len)
            self.scheduler.update_state_after_alloc(req, _Blocks(blocks), count or 0)
            sent, recved = self._step(self.scheduler.build_connector_meta(SimpleNamespace()))
            self._release_sent(sent)
            errors = {rid: why for rid, why in self.worker.load_errors.items() if rid == request_id}
            failed = sorted(self.worker.get_block_ids_with_load_errors())
            out = {"blocks": blocks, "sha256": self._digest(blocks), "errors": errors, "failed_blocks": failed,
                   "finished": sorted(recved or [])}
            self.free += blocks     # the "decode" is done: vLLM frees the blocks when the request ends
            return out

    def tick(self) -> None:
        """An idle engine step: blocks the decoders pulled (the agent was told) are released."""
        with self.lock:
            self._release_sent(self._step(self.scheduler.build_connector_meta(SimpleNamespace()))[0])


def app(standin: StandIn) -> web.Application:
    async def prefill(request: web.Request) -> web.Response:
        b = await request.json()
        out = await asyncio.to_thread(standin.prefill, str(b["request_id"]), int(b["prompt_len"]),
                                      int(b.get("seed", 0)))
        return web.json_response(out)

    async def decode(request: web.Request) -> web.Response:
        b = await request.json()
        return web.json_response(await asyncio.to_thread(standin.decode, str(b["request_id"]),
                                                         dict(b["kv_transfer_params"])))

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"ok": True, "held": len(standin.held), "free_blocks": len(standin.free)})

    async def ticker(a: web.Application):
        async def run() -> None:
            while True:
                await asyncio.sleep(1)
                await asyncio.to_thread(standin.tick)
        task = asyncio.create_task(run())
        yield
        task.cancel()

    a = web.Application()
    a.add_routes([web.post("/prefill", prefill), web.post("/decode", decode), web.get("/healthz", healthz)])
    a.cleanup_ctx.append(ticker)
    return a


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="pd_engine.vllm_standin", description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--kv-transfer-config", required=True, help="vLLM's KVTransferConfig as JSON")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    cfg = json.loads(args.kv_transfer_config)
    standin = StandIn(load_connector(cfg), cfg, args.tensor_parallel_size, dict(os.environ))
    host = os.environ.get(PD_LOCAL_POD_IP) or "0.0.0.0"
    log.info("connector %s loaded from %s; serving on %s:%d", cfg["kv_connector"], cfg["kv_connector_module_path"],
             host, args.port)
    try:
        web.run_app(app(standin), host=host, port=args.port, print=None)
    finally:
        standin.worker.shutdown()


if __name__ == "__main__":
    main()
