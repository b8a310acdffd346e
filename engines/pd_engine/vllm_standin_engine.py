"""The engine of `python -m pd_engine.vllm_standin`, a stand-in for `vllm serve` that drives a KV connector the way
vLLM's V1 engine does and serves vLLM's OpenAI API, computing with the reference model (a small real
transformer on the CPU, llm_datadist_sim.refmodel), so pd-operator's vLLM path runs where vLLM cannot (no
NPU, no vllm package): the connector, the operator and the router are real, the engine is a stand-in.

It takes vLLM's arguments `--tensor-parallel-size` and `--kv-transfer-config` (what the operator adds
for `spec.engine.adapter: vLLM`), loads the connector class named there from its
`kv_connector_module_path` as vLLM does, and runs one scheduler-side and one worker-side connector
(TP 1: one rank, in this process). Its KV caches are numpy arrays in vLLM's layout (per attention
layer one [2 (K, V), blocks, block size, heads, head dim] tensor; MLA [blocks, block size, latent]),
sized by the operator's CacheDesc (`LLM_DATADIST_CACHE_DESC`, paged); `register_kv_caches` registers
them with the rank's LLM-DataDist engine by address and registers the rank with the pod's agent.

Requests (pd_engine.vllm_standin serves them over HTTP, with vLLM's request and reply fields):
- `kv_transfer_params: {"do_remote_decode": true}`: the prompt is computed, its KV written into the
  request's blocks, and the blocks held for a decoder; the reply (one token) carries the
  connector's kv_transfer_params.
- `kv_transfer_params: {"do_remote_prefill": true, ...}`: the connector pulls the prompt's blocks over
  the operator's link into this engine's blocks; as vLLM does, the last prompt token is computed
  again here from the KV before it (its logits give the first output token), and decoding goes on
  over every pulled position (the last one's KV kept as the prefill computed it, so the state is the
  one a single engine decodes from). A pull that fails is recomputed locally, as vLLM recomputes
  blocks it could not load.
- neither: the whole request here.
The model is the one `--reference-model` or `PD_REFERENCE_MODEL` names, else one built from the
CacheDesc. Prompts are tokenized with cl100k (pd_contract.tokens), a chat as a line
"role: content" per message: the reference model's tokenizer and template.

Also, byte-level (tests of the connector alone): `POST /prefill {"request_id", "prompt_len", "seed"}`
fills a request's blocks with seeded bytes and returns `{"kv_transfer_params", "blocks", "sha256"}`;
`POST /decode {"request_id", "kv_transfer_params"}` pulls them (`{"blocks", "sha256", "errors",
"finished", "failed_blocks"}`); `sha256` is over the request's blocks, every tensor in order."""
from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

# the reference model's matrices are small: one BLAS thread (set before numpy loads), so engines
# sharing a machine do not spin against each other
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from llm_datadist_sim.refmodel import Model, Profile  # noqa: E402
from pd_contract import tokens  # noqa: E402
from pd_contract.engine_env import LLM_DATADIST_CACHE_DESC, PD_REFERENCE_MODEL  # noqa: E402

log = logging.getLogger("pd_engine.vllm_standin")
DTYPES = {"DT_FLOAT16": np.float16, "DT_BF16": np.uint16, "DT_FLOAT": np.float32, "DT_INT8": np.int8}
PROFILE_DTYPES = {"DT_FLOAT16": "float16", "DT_BF16": "bfloat16", "DT_FLOAT": "float32"}
RECORDED = 256          # request bodies kept for GET /standin/requests


class NoRoom(Exception):
    """Not enough free blocks: vLLM would queue the request; the stand-in answers 503."""


class _Blocks:
    """vLLM's KVCacheBlocks, as the connector reads them."""

    def __init__(self, ids: list[int]):
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int]]:
        return (list(self.ids),)


# connectors a plugin registers by name (vllm-ascend's register_connector), as the stand-in has them
REGISTERED = {"MooncakeConnectorV1": ("pd_engine.mooncake_standin", "MooncakeConnector"),
              "MooncakeLayerwiseConnector": ("pd_engine.mooncake_standin", "MooncakeLayerwiseConnector")}


def load_connector(kv_transfer_config: dict) -> type:
    """The class vLLM would load: `kv_connector` from `kv_connector_module_path`, else the one
    registered under that name (vllm-ascend's connectors: the stand-in's of them)."""
    name, path = kv_transfer_config["kv_connector"], kv_transfer_config.get("kv_connector_module_path")
    if not path:
        if name not in REGISTERED:
            raise SystemExit(f"no connector registered as {name!r} (known: {', '.join(sorted(REGISTERED))})")
        path, name = REGISTERED[name]
    return getattr(importlib.import_module(path), name)


def profile_from(env: dict[str, str], desc: dict) -> Profile:
    """The reference model this engine computes: PD_REFERENCE_MODEL's, else one the CacheDesc lays out."""
    if env.get(PD_REFERENCE_MODEL):
        return Profile.from_json(json.loads(env[PD_REFERENCE_MODEL]))
    heads, dim = desc["shape"][2], desc["shape"][3]
    mla = heads == 1 and desc["num_tensors"] % 2 == 1
    d = {"attention": "MLA" if mla else "GQA", "numLayers": desc["num_tensors"] if mla else desc["num_tensors"] // 2,
         "numKvHeads": heads, "headDim": dim, "dtype": PROFILE_DTYPES.get(desc["data_type"], "float16"),
         "maxSeqLen": max(64, desc["shape"][1])}
    if mla:
        d["latentDim"] = dim
    return Profile.from_json(d)


def vllm_config(kv_transfer_config: dict) -> SimpleNamespace:
    """vLLM's VllmConfig as a connector reads it: its kv_transfer_config."""
    return SimpleNamespace(kv_transfer_config=SimpleNamespace(
        kv_connector_extra_config=kv_transfer_config.get("kv_connector_extra_config") or {},
        is_kv_producer=kv_transfer_config.get("kv_role") in ("kv_producer", "kv_both"),
        kv_role=kv_transfer_config.get("kv_role"), kv_port=int(kv_transfer_config.get("kv_port") or 14579),
        engine_id=str(kv_transfer_config.get("engine_id") or os.environ.get("POD_NAME") or os.getpid())))


@dataclass
class Generation:
    """What a request asks of the model (vLLM's sampling parameters that the stand-in computes)."""
    ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    n: int = 1
    stops: list[str] = field(default_factory=list)
    ignore_eos: bool = False


@dataclass
class Choice:
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish: str = "length"
    stop_reason: str | None = None


class StandIn:
    def __init__(self, cls: type, kv_transfer_config: dict, tensor_parallel: int, env: dict[str, str],
                 agent: Any = None):
        """`agent`: the pod agent's client the worker registers with (default: PD_AGENT_URL's)."""
        if tensor_parallel != 1:
            raise SystemExit("pd_engine.vllm_standin runs one rank (--tensor-parallel-size 1)")
        from .vllm_connector import KVConnectorRole
        cfg = vllm_config(kv_transfer_config)
        self.connector, self.kv_role = kv_transfer_config["kv_connector"], kv_transfer_config.get("kv_role")
        desc = json.loads(env[LLM_DATADIST_CACHE_DESC])
        paged = desc.get("paged")
        if not paged:
            raise SystemExit("vLLM's caches are paged: spec.model.kvCache.paged must be set")
        blocks, size, heads, dim = paged["num_blocks"], paged["block_size"], desc["shape"][2], desc["shape"][3]
        self.block_size, self.num_blocks = size, blocks
        self.model = Model.get(profile_from(env, desc))
        self.mla = self.model.mla
        dtype = DTYPES[desc["data_type"]]
        if self.mla:   # vLLM's MLA cache: one [blocks, block size, latent] tensor per layer
            self.caches = {f"model.layers.{i}.self_attn": np.zeros((blocks, size, dim), dtype)
                           for i in range(desc["num_tensors"])}
        else:          # one [2 (K, V), blocks, block size, heads, head dim] tensor per layer
            self.caches = {f"model.layers.{i}.self_attn": np.zeros((2, blocks, size, heads, dim), dtype)
                           for i in range(desc["num_tensors"] // 2)}
        self.tensors = [t for kv in self.caches.values() for t in ([kv] if self.mla else [kv[0], kv[1]])]
        self.max_model_len = min(self.model.max_seq, blocks * size)
        self.scheduler = cls(cfg, KVConnectorRole.SCHEDULER, None, env=env)
        self.worker = cls(cfg, KVConnectorRole.WORKER, None, env=env, agent=agent)
        self.worker.register_kv_caches(self.caches)
        self.free = list(range(blocks))
        self.held: dict[str, list[int]] = {}      # prefilled, until the connector says they were sent
        self.lock = threading.Lock()              # one engine step at a time, as vLLM's loop
        self.requests: deque[dict] = deque(maxlen=RECORDED)
        self.counts = {"prefill": 0, "decode": 0, "local": 0, "recomputed": 0}

    # ---- blocks ---------------------------------------------------------------------------------
    def _alloc(self, n_tokens: int) -> list[int]:
        n = max(1, -(-n_tokens // self.block_size))
        if n > len(self.free):
            raise NoRoom(f"no room: {n} blocks wanted, {len(self.free)} free")
        out, self.free = self.free[:n], self.free[n:]
        return out

    def _release_sent(self, sent: set[str] | None) -> None:
        for rid in sent or ():
            self.free += self.held.pop(rid, [])

    def _digest(self, blocks: list[int]) -> str:
        h = hashlib.sha256()
        for t in self.tensors:
            for b in blocks:
                h.update(t[b].tobytes())
        return h.hexdigest()

    def write_kv(self, kv: np.ndarray, blocks: list[int]) -> None:
        """The model's KV of a prompt ([num_tensors, n, heads, dim]) into the request's blocks, as
        vLLM's attention writes them: position p in block blocks[p // block_size]."""
        n, bs = kv.shape[1], self.block_size
        for t, tensor in enumerate(self.tensors):
            src = kv[t].reshape(n, -1).view(np.uint8)
            dst = tensor.view(np.uint8).reshape(tensor.shape[0], bs, -1)
            for i, b in enumerate(blocks):
                rows = src[i * bs:(i + 1) * bs]
                dst[b, :len(rows)] = rows

    def read_kv(self, blocks: list[int], n: int) -> np.ndarray:
        """The first n positions of the request's blocks as the model's [num_tensors, n, heads, dim]."""
        m = self.model
        out = np.empty((m.num_tensors, n, m.kv_heads if not self.mla else 1, m.kv_dim), dtype=m.storage)
        flat = out.reshape(m.num_tensors, n, -1).view(np.uint8)
        for t, tensor in enumerate(self.tensors):
            rows = tensor.view(np.uint8).reshape(tensor.shape[0], self.block_size, -1)[blocks]
            flat[t] = rows.reshape(-1, rows.shape[-1])[:n]
        return out

    # ---- engine steps ---------------------------------------------------------------------------
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

    def _schedule(self) -> tuple[set[str] | None, set[str] | None]:
        sent, recved = self._step(self.scheduler.build_connector_meta(SimpleNamespace(scheduled_cached_reqs=None)))
        self._release_sent(sent)
        return sent, recved

    def tick(self) -> None:
        """An idle engine step: blocks the decoders pulled (the agent was told) are released."""
        with self.lock:
            self._schedule()

    # ---- the three kinds of request -------------------------------------------------------------
    def prefill_remote(self, rid: str, gen: Generation, given: dict | None = None) -> tuple[list[Choice], dict | None]:
        """do_remote_decode: compute the prompt, leave its KV in blocks for a decoder, one token."""
        m = self.model
        kv, logits = m.prefill(gen.ids)
        first = m.sample(logits, gen.temperature, gen.top_p, gen.seed, 0)
        with self.lock:
            _, params = self._produce(rid, gen.ids, lambda blocks: self.write_kv(kv, blocks), given)
            self.counts["prefill"] += 1
        return [Choice(0, [first], tokens.decode([first]))], params

    def _produce(self, rid: str, ids: list[int], forward, given: dict | None = None) -> tuple[list[int], dict | None]:
        """A request with do_remote_decode, as vLLM's engine runs it: blocks allocated, the forward
        pass fills them (`forward(blocks)`), the connector keeps them for a decoder."""
        req = SimpleNamespace(request_id=rid, kv_transfer_params={**(given or {}), "do_remote_decode": True},
                              prompt_token_ids=list(ids))
        self.scheduler.get_num_new_matched_tokens(req, 0)
        blocks = self._alloc(len(ids))
        forward(blocks)
        self.scheduler.update_state_after_alloc(req, _Blocks(blocks), 0)
        self._schedule()
        delay, params = self.scheduler.request_finished(req, blocks)
        if delay:
            self.held[rid] = blocks
        else:
            self.free += blocks
        self._schedule()
        return blocks, params

    def decode_remote(self, rid: str, gen: Generation, params: dict) -> Iterator[tuple[int, int]]:
        """do_remote_prefill: pull the prompt's blocks, recompute the last prompt token, decode."""
        m, n = self.model, len(gen.ids)
        with self.lock:
            req = SimpleNamespace(request_id=rid, kv_transfer_params={**params, "do_remote_prefill": True},
                                  prompt_token_ids=list(gen.ids))
            count, _ = self.scheduler.get_num_new_matched_tokens(req, 0)
            blocks = self._alloc(n)
            try:
                self.scheduler.update_state_after_alloc(req, _Blocks(blocks), count or 0)
                self._schedule()
                failed = self.worker.load_errors.pop(rid, None)
                self.worker.get_block_ids_with_load_errors()
                kv = None if failed or n < 2 else self.read_kv(blocks, n)
            finally:
                self.free += blocks
            self.counts["decode"] += 1
        if kv is None:   # nothing loaded (or a one-token prompt): vLLM computes the prompt itself
            if failed:
                log.warning("request %s: KV not loaded (%s); computing the prompt here", rid, failed)
                self.counts["recomputed"] += 1
            yield from self.local(gen)
            return
        # the last prompt token's logits computed here, from the pulled KV before it (as vLLM's decoder
        # does); the decode then attends over every pulled position, the last one's KV as the prefill
        # computed it: the state one engine decodes from, so the output is that engine's
        logits = m.step(m.state([kv], n - 1), gen.ids[-1])
        for i in range(gen.n):
            st = m.state([kv], n, reserve=n + gen.max_tokens)
            seed = gen.seed + i
            first = m.sample(logits, gen.temperature, gen.top_p, seed, 0)
            for tok in m.continue_(st, first, gen.max_tokens, gen.temperature, gen.top_p, seed):
                yield i, tok

    def local(self, gen: Generation) -> Iterator[tuple[int, int]]:
        """No P-D: the whole request on this engine."""
        m = self.model
        kv, logits = m.prefill(gen.ids)
        n = kv.shape[1]
        self.counts["local"] += 1
        for i in range(gen.n):
            seed = gen.seed + i
            st = m.state([kv], n, reserve=n + gen.max_tokens)
            first = m.sample(logits, gen.temperature, gen.top_p, seed, 0)
            for tok in m.continue_(st, first, gen.max_tokens, gen.temperature, gen.top_p, seed):
                yield i, tok

    def choices(self, gen: Generation, stream: Iterator[tuple[int, int]]) -> Iterator[tuple[Choice, str]]:
        """(choice, new text) per token, stop strings applied as vLLM applies them: the text ends
        before a stop string, finish_reason "stop" and stop_reason the string; while a choice runs,
        text that could still turn out to start a stop string (or an unfinished character) is held
        back, so what was sent is never taken back."""
        out = [Choice(i) for i in range(gen.n)]
        full = [""] * gen.n
        hold = max((len(s) for s in gen.stops), default=1) - 1
        for i, tok in stream:
            c = out[i]
            if c.finish == "stop":
                continue
            c.token_ids.append(tok)
            text = tokens.decode(c.token_ids)
            hit = min(((text.find(s), s) for s in gen.stops if s and s in text), default=None)
            if hit is not None:
                text, c.finish, c.stop_reason = text[:hit[0]], "stop", hit[1]
                upto = len(text)
            else:
                upto = max(len(c.text), len(text.rstrip(tokens.REPLACEMENT)) - hold)
            full[i] = text
            new, c.text = text[len(c.text):upto], text[:upto]
            yield c, new
        for c in out:
            if c.finish != "stop":
                c.finish = "length"
            rest, c.text = full[c.index][len(c.text):], full[c.index]
            if rest:
                yield c, rest

    # ---- byte-level requests (the connector alone) ----------------------------------------------
    def prefill_bytes(self, request_id: str, prompt_len: int, seed: int) -> dict:
        rng = np.random.default_rng(seed)

        def forward(blocks: list[int]) -> None:   # this request's "KV", as seeded bytes
            for t in self.tensors:
                raw = t.view(np.uint8)
                raw[blocks] = rng.integers(0, 256, raw[blocks].shape, dtype=np.uint8)
        with self.lock:
            blocks, params = self._produce(request_id, list(range(prompt_len)), forward)
            return {"kv_transfer_params": params, "blocks": blocks, "sha256": self._digest(blocks)}

    def decode_bytes(self, request_id: str, params: dict) -> dict:
        with self.lock:
            prompt_len = len(params.get("remote_block_ids") or []) * self.block_size
            req = SimpleNamespace(request_id=request_id, kv_transfer_params={**params, "do_remote_prefill": True},
                                  prompt_token_ids=list(range(prompt_len + 1)))
            count, _ = self.scheduler.get_num_new_matched_tokens(req, 0)
            blocks = self._alloc(prompt_len)
            self.scheduler.update_state_after_alloc(req, _Blocks(blocks), count or 0)
            _, recved = self._schedule()
            errors = {rid: why for rid, why in self.worker.load_errors.items() if rid == request_id}
            failed = sorted(self.worker.get_block_ids_with_load_errors())
            out = {"blocks": blocks, "sha256": self._digest(blocks), "errors": errors, "failed_blocks": failed,
                   "finished": sorted(recved or [])}
            self.free += blocks     # the "decode" is done: vLLM frees the blocks when the request ends
            return out
