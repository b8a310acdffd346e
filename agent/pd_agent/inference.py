"""Serving, so load is real: a prefill costs time by the timing model and leaves a KV cache
under a CacheKey; a decode pulls that cache from the named prefill over the link and emits
tokens at the decode-step time of the current batch.

Two engines (spec.sim.engine): `timing` models only the time, and its caches carry no content
(its tokens have no ids: a router writes placeholders); `reference` also computes (pd_agent.reference):
the prefill leaves the prompt's real KV shard in the cache, the decoder continues generation
from what it pulled, and every token has its id. Both take the timing model's time (the
reference engine computes meanwhile, so a step takes the longer of the two; at the small
profiles it runs, the model's time), so the benchmarks, which run the timing engine, measure
the same thing."""
from __future__ import annotations

import asyncio
import collections
import os
import time
from dataclasses import dataclass, field
from typing import Iterator

import httpx

from pd_contract.agent_api import (
    AgentPath,
    DecodeRequest,
    DecodeResponse,
    Load,
    PrefillRequest,
    PrefillResponse,
    PullRequest,
    PullResponse,
)
from pd_contract.engine_env import PD_INSTANCE_RANK, PD_RANK_REGISTER_URL
from pd_contract.names import BROKEN_CODES

from .core import AgentCore, AgentError, _code_name
from .metrics import AgentMetrics
from .timing import TimingModel

HELD_TTL_S = 120.0   # a multi-rank decoder's rank keeps a pulled shard this long for rank 0 to gather
HELD_MAX = 256       # and at most this many (the oldest go first): a decode that failed after its pulls

BUSY_WINDOW_S = 10.0   # the prefill busy fraction covers this window
OVERLOADED_RETRY_S = 1   # Retry-After of an OVERLOADED refusal: another pod now, this one a little later
LATENCY_WINDOW_S = 30.0   # TTFT/TBT percentiles cover the requests finished in this window, so a
                          # ratio that just changed shows in them within one window
CALLER_CODES = {"LLM_REPEAT_REQUEST", "LLM_PARAM_INVALID"}   # a prefill the caller got wrong: 409, not 507


def _p90(window, now: float) -> float | None:
    """p90 of the (finished at, value) pairs of the last LATENCY_WINDOW_S."""
    while window and window[0][0] < now - LATENCY_WINDOW_S:
        window.popleft()
    if not window:
        return None
    s = sorted(v for _, v in window)
    return s[min(len(s) - 1, int(0.9 * len(s)))]


@dataclass
class _Prefill:
    req: PrefillRequest
    fut: asyncio.Future
    enqueued: float


@dataclass
class _Decode:
    ctx: int
    remaining: int
    fut: asyncio.Future
    started: float
    token_times: list[float] = field(default_factory=list)
    out: asyncio.Queue | None = None     # streaming: a message per token
    gen: Iterator[int] | None = None     # the reference engine: the output tokens, computed a step at a time
    ids: list[int] = field(default_factory=list)


class Inference:
    def __init__(self, core: AgentCore, metrics: AgentMetrics, timing: TimingModel | None = None):
        self.core = core
        self.m = metrics
        self.timing = timing or TimingModel.from_env()
        self.max_batch = max(1, core.id.cache_desc["shape"][0])
        self.max_seq = core.id.cache_desc["shape"][1]
        self.prefill_q: collections.deque[_Prefill] = collections.deque()
        self.decode_wait: collections.deque[_Decode] = collections.deque()
        self.decode_running: list[_Decode] = []
        self.in_flight = 0
        self.responding = 0     # streamed answers still being written (the HTTP layer counts them)
        self.completed = 0
        self.failed = 0
        self._ttft: collections.deque[tuple[float, float]] = collections.deque(maxlen=2000)
        self._tbt: collections.deque[tuple[float, float]] = collections.deque(maxlen=8000)
        self._prefill_wake = asyncio.Event()
        self._decode_wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._prefill_busy = 0
        self._busy: collections.deque[tuple[float, float]] = collections.deque(maxlen=4096)  # prefill batches
        self._busy_since: float | None = None
        self.ref = None
        if core.id.engine == "reference":
            from .reference import ReferenceEngine
            self.ref = ReferenceEngine(core.id)
        self.held: dict[int, tuple[float, object]] = {}   # req_id -> (pulled at, shard): for rank 0 to gather
        self._http: httpx.AsyncClient | None = None
        core.inference = self
        core.before_switch.append(self._before_switch)

    async def _before_switch(self, old: str, new: str) -> None:
        """Serving follows the engine's role (each request checks it); a switch with work in
        hand would fail that work, so it is refused: drain first."""
        pending = self.core.pending_kv()
        if self.in_flight or self.prefill_q or self.decode_wait or self.decode_running or pending:
            raise AgentError("SWITCH_REFUSED", f"{self.core.id.pod} has {self.in_flight} requests in flight and "
                             f"{pending} KV caches waiting to be pulled; drain it before switching", 409)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._prefill_loop()), asyncio.create_task(self._decode_loop())]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self._http is not None:
            await self._http.aclose()

    async def _compute(self, seconds: float, due_attr: str) -> float:
        """Take `seconds` of engine time. Back-to-back batches run on the engine's own clock: a
        batch that follows another starts when that one was due to end, so the event loop's
        wake-up latency does not add up over thousands of steps (the timing model is the engine;
        the Python around it is not). Returns the seconds from the batch's start to now."""
        now = time.monotonic()
        due = getattr(self, due_attr, 0.0)
        start = due if 0 <= now - due < max(seconds, 0.005) else now
        setattr(self, due_attr, start + seconds)
        await asyncio.sleep(max(0.0, start + seconds - time.monotonic()))
        return time.monotonic() - start

    # ---- accounting ---------------------------------------------------------------------------
    def load(self) -> Load:
        queue = len(self.prefill_q) + len(self.decode_wait)
        running = self._prefill_busy + len(self.decode_running)
        self.m.queue_depth.set(queue)
        self.m.running.set(running)
        pending = self.core.pending_kv()
        self.m.pending_kv.set(pending)
        # what the queue will compute: a prompt is cut at max_seq (a caller's number is only a claim)
        queued_tokens = sum(min(p.req.prompt_tokens, self.max_seq) for p in self.prefill_q)
        # what a rebalancing policy reads: prefill busy over the last window, decoder batch use
        now = time.monotonic()
        busy = sum(min(e, now) - max(s, now - BUSY_WINDOW_S) for s, e in self._busy if e > now - BUSY_WINDOW_S)
        if self._prefill_busy and self._busy_since is not None:
            busy += now - max(self._busy_since, now - BUSY_WINDOW_S)
        mgr = self.core.engine.kv_cache_manager if self.core.initialized else None
        capacity = int(getattr(mgr, "capacity_bytes", 0) or 0)
        return Load(queue_depth=queue, queued_prompt_tokens=queued_tokens, running=running,
                    decode_queue=len(self.decode_wait), max_batch=self.max_batch,
                    prefill_busy=round(min(1.0, busy / BUSY_WINDOW_S), 3), kv_capacity_bytes=capacity,
                    in_flight=self.in_flight, pending_kv=pending,
                    completed=self.completed, failed=self.failed, ttft_p90_ms=_p90(self._ttft, now),
                    tbt_p90_ms=_p90(self._tbt, now))

    def _admit(self, role: str, admitted: bool = False) -> None:
        """Refusals here happen before any work, so the caller can send the request elsewhere.
        `admitted`: a multi-rank pod's agent took the request on for the instance (it refuses for
        the whole pod when draining); this rank's part must not be refused half-way."""
        if self.core.initialized and self.core.draining and not admitted:
            self.m.failed.labels("draining").inc()
            raise AgentError("DRAINING", f"{self.core.id.pod} is draining; send the request elsewhere", 503)
        if self.core.initialized and self.core.role != role:
            self.m.failed.labels("role_changed").inc()
            raise AgentError("ROLE_CHANGED", f"{self.core.id.pod} now serves as {self.core.role}; send the "
                             f"{'prefill' if role == 'prompt' else 'decode'} elsewhere", 503)
        self.core._require(role, "prefill" if role == "prompt" else "decode")

    # ---- prefill (prompt role) ----------------------------------------------------------------
    async def prefill(self, req: PrefillRequest) -> PrefillResponse:
        self._admit("prompt", req.admitted)
        # a multi-rank pod's agent bounds what it takes on; a rank never refuses its part of that
        if len(self.prefill_q) >= self.core.id.max_prefill_queue and not req.admitted:
            self.m.failed.labels("overloaded").inc()
            raise AgentError("OVERLOADED", f"{self.core.id.pod} has {len(self.prefill_q)} prefills waiting (the "
                             f"bound, PD_AGENT_MAX_PREFILL_QUEUE); send the request elsewhere", 503,
                             retry_after=OVERLOADED_RETRY_S)
        if req.req_id in self.core.kv_pending or any(p.req.req_id == req.req_id for p in self.prefill_q):
            raise AgentError("LLM_REPEAT_REQUEST", f"req_id {req.req_id} is already prefilled or queued here", 409)
        if req.token_ids is not None and len(req.token_ids) != req.prompt_tokens:
            raise AgentError("LLM_PARAM_INVALID", f"token_ids has {len(req.token_ids)} tokens, prompt_tokens says "
                             f"{req.prompt_tokens}", 400)
        if self.ref is not None and req.prompt_tokens >= self.ref.max_seq:
            raise AgentError("LLM_SEQ_LENOVERLIMIT", f"a prompt of {req.prompt_tokens} tokens leaves no room for "
                             f"output in the model's {self.ref.max_seq} positions", 400)
        fut = asyncio.get_running_loop().create_future()
        self.in_flight += 1
        try:
            self.core.meter.arrived(min(req.prompt_tokens, self.max_seq))
            self.prefill_q.append(_Prefill(req, fut, time.monotonic()))
            self._prefill_wake.set()
            return await fut
        finally:
            self.in_flight -= 1

    async def _prefill_loop(self) -> None:
        while True:
            if not self.prefill_q:
                self._prefill_wake.clear()
                await self._prefill_wake.wait()
                continue
            batch = [self.prefill_q.popleft() for _ in range(min(self.max_batch, len(self.prefill_q)))]
            self._prefill_busy = len(batch)
            lens = [min(b.req.prompt_tokens, self.max_seq) for b in batch]
            t0 = self._busy_since = time.monotonic()
            computed = asyncio.ensure_future(asyncio.to_thread(self._ref_prefill, batch)) if self.ref else None
            took = await self._compute(self.timing.prefill_ms(lens) / 1000, "_prefill_due")
            outs = await computed if computed is not None else [None] * len(batch)
            prefill_ms = (time.monotonic() - t0) * 1000
            self.core.meter.prefilled(sum(lens), took)
            mgr = self.core.engine.kv_cache_manager
            for b, n, out in zip(batch, lens, outs):
                if isinstance(out, Exception):   # the reference engine refused this prompt: only this one
                    self.failed += 1
                    self.m.failed.labels(getattr(out, "code", "ENGINE_ERROR")).inc()
                    b.fut.set_exception(out if isinstance(out, AgentError) else
                                        AgentError("ENGINE_ERROR", f"the reference engine failed: {out!r}", 500))
                    continue
                try:
                    key = self.core.llm.CacheKey(self.core.id.cluster_id, b.req.req_id, self.core.id.model_id)
                    cache = await asyncio.to_thread(mgr.allocate_cache, self.core.desc(batch=1, seq=n), [key])
                    if out is not None and self.ref is not None:   # the reference engine computed it
                        try:
                            await asyncio.to_thread(self.ref.write, cache, out[0])
                        except Exception as e:
                            # the key goes with the cache: nobody may pull a half-written shard
                            await asyncio.to_thread(mgr.remove_cache_key, key)
                            await asyncio.to_thread(mgr.deallocate_cache, cache)
                            self.failed += 1
                            self.m.failed.labels("ENGINE_ERROR").inc()
                            b.fut.set_exception(AgentError("ENGINE_ERROR", f"writing the KV shard: {e}", 500))
                            continue
                    # The engine frees it once the decoder pulls the key.
                    await asyncio.to_thread(mgr.deallocate_cache, cache)
                    self.core.cache_ready(b.req.req_id)
                    queue_ms = (t0 - b.enqueued) * 1000
                    self.m.ttft.observe(queue_ms + prefill_ms)
                    self.m.requests.labels("prefill").inc()
                    b.fut.set_result(PrefillResponse(
                        prompt_cluster_id=self.core.id.cluster_id, req_id=b.req.req_id,
                        model_id=self.core.id.model_id, queue_ms=queue_ms, prefill_ms=prefill_ms,
                        first_token=out[1] if out is not None else None))
                except self.core.llm.LLMException as e:
                    self.failed += 1
                    code = _code_name(e.status_code)
                    self.m.failed.labels(code).inc()
                    # the request's own fault (a req_id in use) is the caller's; memory is the engine's
                    b.fut.set_exception(AgentError(code, str(e), 409 if code in CALLER_CODES else 507))
            self._prefill_busy = 0
            self._busy.append((t0, time.monotonic()))
            self._busy_since = None

    def _ref_prefill(self, batch: list[_Prefill]) -> list:
        """The reference engine's compute for a batch, one prompt at a time (a prompt's KV must not
        depend on what it was batched with): per request (shard, first token) or the exception."""
        ref = self.ref
        assert ref is not None, "only the reference engine computes"
        out: list = []
        for b in batch:
            s = b.req.sampling
            ids = list(b.req.token_ids) if b.req.token_ids is not None else [0] * b.req.prompt_tokens
            try:
                out.append(ref.prefill(ids, s.temperature if s else 0.0, s.top_p if s else 1.0,
                                       s.seed if s else 0))
            except ValueError as e:
                out.append(AgentError("LLM_PARAM_INVALID", f"the reference engine refused the prompt: {e}", 400))
            except Exception as e:  # noqa: BLE001 - this request fails, the loop and the batch go on
                out.append(e)
        return out

    # ---- decode (decoder role) ----------------------------------------------------------------
    async def _pull(self, req: DecodeRequest | PullRequest) -> tuple[float, object]:
        """Pull the request's KV cache (this rank's shard) over the link. Returns the pull's
        milliseconds and the cache, which the caller frees once it is done with it."""
        mgr = self.core.engine.kv_cache_manager
        llm = self.core.llm
        t0 = time.monotonic()
        n = min(req.prompt_tokens, self.max_seq)
        cache = None
        try:
            cache = await asyncio.to_thread(mgr.allocate_cache, self.core.desc(batch=1, seq=n))
            key = llm.CacheKey(req.prompt_cluster_id, req.req_id, self.core.id.model_id)
            await asyncio.to_thread(mgr.pull_cache, key, cache, 0)
        except llm.LLMException as e:
            if cache is not None:
                await asyncio.to_thread(mgr.deallocate_cache, cache)
            code = _code_name(e.status_code)
            if code in BROKEN_CODES:
                self.core.note_link(req.prompt_cluster_id, code)
            self.failed += 1
            self.m.failed.labels(code).inc()
            if code == "LLM_NOT_YET_LINK":
                # no link at this moment (a prefill restarted, a relink not done): nothing moved and
                # the cache still waits on the prefill, so a router may send it to another decoder
                raise AgentError("NOT_LINKED", f"{e} (LLM_NOT_YET_LINK); nothing was pulled", 503) from e
            raise AgentError(code, str(e), 502) from e
        except BaseException:
            if cache is not None:
                await asyncio.to_thread(mgr.deallocate_cache, cache)
            raise
        self.core.note_link(req.prompt_cluster_id, "LLM_SUCCESS")
        peer = self.core.peers.get(req.prompt_cluster_id)
        if self.core.notifier and peer is not None and peer.agent_url:
            # only to the prefill's agent as the operator linked it: a URL the request names
            # (prompt_agent_url) is the caller's to choose and would receive our token; a prefill
            # that hears nothing expires the cache after its TTL
            self.core.notifier.pulled(peer.agent_url, req.req_id)
        pull_ms = (time.monotonic() - t0) * 1000
        self.m.kv_pull.observe(pull_ms)
        return pull_ms, cache

    async def pull(self, req: PullRequest) -> PullResponse:
        """A rank of a multi-rank decoder: pull this rank's shard; the pod's agent then decodes."""
        self._admit("decoder", req.admitted)
        self.in_flight += 1
        try:
            pull_ms, cache = await self._pull(req)
            try:
                if self.ref is not None:   # kept for the rank that decodes (GET /v1/kv/<req_id>)
                    shard = await asyncio.to_thread(self.ref.read, cache, min(req.prompt_tokens, self.max_seq))
                    self.held[req.req_id] = (time.monotonic(), shard)
                    self._expire_held()
            finally:
                await asyncio.to_thread(self.core.engine.kv_cache_manager.deallocate_cache, cache)
            return PullResponse(pull_ms=pull_ms)
        finally:
            self.in_flight -= 1

    def _expire_held(self) -> None:
        now = time.monotonic()
        for k, (at, _) in list(self.held.items()):   # in the order they were pulled
            if now - at > HELD_TTL_S or len(self.held) > HELD_MAX:
                del self.held[k]

    def take_held(self, req_id: int) -> bytes:
        """A pulled shard, once, as the bytes of its tensors in order (for the rank that decodes)."""
        self._expire_held()
        got = self.held.pop(req_id, None)
        if got is None:
            raise AgentError("KV_NOT_HELD", f"no pulled KV shard for req_id {req_id} on {self.core.id.pod} rank "
                             f"{self.core.id.rank}", 404)
        return got[1].tobytes()  # type: ignore[attr-defined]

    async def _gather(self, req: DecodeRequest, n: int) -> list:
        """Rank 0 of a multi-rank decoder: every rank's pulled shard, in rank order (its own is held
        here; the others' through the pod's agent). Tensor parallelism's collectives, in one process."""
        own = self.held.pop(req.req_id, None)
        if own is None:
            raise AgentError("KV_NOT_HELD", f"rank 0 holds no pulled KV shard for req_id {req.req_id}", 502)
        shards = [own[1]]
        tp = self.core.id.tensor_parallel
        if tp > 1:
            front = os.environ.get(PD_RANK_REGISTER_URL, "").removesuffix(AgentPath.RANKS)
            if not front:
                raise AgentError("KV_NOT_HELD", "rank 0 does not know its pod's agent (PD_RANK_REGISTER_URL)", 502)
            http = self._http = self._http or httpx.AsyncClient(trust_env=False, timeout=30)
            token, rank = self.core.id.token, self.core.id.rank
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            first = int(os.environ.get(PD_INSTANCE_RANK) or rank) - rank   # the group's rank 0, as the pod numbers it

            async def one(r: int) -> bytes:
                resp = await http.get(f"{front}{AgentPath.rank_prefix(first + r)}{AgentPath.kv(req.req_id)}",
                                      headers=headers)
                if resp.status_code != 200:
                    raise AgentError("KV_NOT_HELD", f"rank {r}'s shard: HTTP {resp.status_code} "
                                     f"{resp.text[:200]}", 502)
                return resp.content
            try:
                raws = await asyncio.gather(*(one(r) for r in range(1, tp)))
            except httpx.HTTPError as e:
                raise AgentError("KV_NOT_HELD", f"gathering the ranks' shards: {e!r}", 502) from None
            ref = self.ref
            assert ref is not None, "only the reference engine gathers shards"
            shards += await asyncio.to_thread(lambda: [ref.from_bytes(raw, n) for raw in raws])
        return shards

    async def decode(self, req: DecodeRequest, out: asyncio.Queue | None = None) -> DecodeResponse:
        self._admit("decoder", req.admitted)
        self.in_flight += 1
        mgr = self.core.engine.kv_cache_manager
        t0 = time.monotonic()
        cache = None
        try:
            n = min(req.prompt_tokens, self.max_seq)
            if self.ref is not None and req.first_token is None:
                raise no_first_token()
            if req.kv_pulled_ms is not None:   # every rank pulled its shard already: the first token waited for them
                pull_ms = req.kv_pulled_ms
                t0 -= pull_ms / 1000
            else:
                pull_ms, cache = await self._pull(req)
            remaining, gen = req.output_tokens, None
            if self.ref is not None:
                assert req.first_token is not None   # refused above without it
                shards = await self._gather(req, n) if req.kv_pulled_ms is not None else \
                    [await asyncio.to_thread(self.ref.read, cache, n)]
                s = req.sampling
                # what fits in the model's positions (the gateway refuses more before any engine work)
                remaining = max(1, min(remaining, self.ref.max_seq - n))
                # room for this request's output only, not the model's whole length
                st = await asyncio.to_thread(self.ref.model.state, shards, n, n + remaining)
                gen = self.ref.model.continue_(st, req.first_token, remaining, s.temperature if s else 0.0,
                                               s.top_p if s else 1.0, s.seed if s else 0)
            job = _Decode(ctx=n, remaining=remaining, gen=gen,
                          fut=asyncio.get_running_loop().create_future(), started=time.monotonic(), out=out)
            self.core.meter.arrived(n)
            self.decode_wait.append(job)
            self._decode_wake.set()
            try:
                await job.fut
            except asyncio.CancelledError:
                # the client went away: free the batch slot
                job.remaining = 0
                if job in self.decode_wait:
                    self.decode_wait.remove(job)
                if job in self.decode_running:
                    self.decode_running.remove(job)
                self.m.failed.labels("cancelled").inc()
                raise
            first = (job.token_times[0] - t0) * 1000
            gaps = [(b - a) * 1000 for a, b in zip(job.token_times, job.token_times[1:])]
            # what a client saw: the prefill's queue and compute time (if the router passed it) too
            whole = first + (req.prefill_ms or 0.0)
            done_at = time.monotonic()
            self._ttft.append((done_at, whole))
            self.m.ttft.observe(whole)
            for g in gaps:
                self.m.tbt.observe(g)
            self._tbt.extend((done_at, g) for g in gaps)
            self.completed += 1
            self.m.requests.labels("decode").inc()
            return DecodeResponse(tokens=len(job.token_times), token_ids=job.ids if job.gen is not None else None,
                                  pull_ms=pull_ms, first_token_ms=first,
                                  tbt_ms_mean=sum(gaps) / len(gaps) if gaps else 0.0,
                                  tbt_ms_max=max(gaps) if gaps else 0.0,
                                  total_ms=(time.monotonic() - t0) * 1000)
        finally:
            self.in_flight -= 1
            if cache is not None:
                await asyncio.to_thread(mgr.deallocate_cache, cache)

    async def _decode_loop(self) -> None:
        while True:
            while self.decode_wait and len(self.decode_running) < self.max_batch:
                self.decode_running.append(self.decode_wait.popleft())
            if not self.decode_running:
                self._decode_wake.clear()
                await self._decode_wake.wait()
                continue
            ctx = [j.ctx for j in self.decode_running]
            running = list(self.decode_running)
            computed = asyncio.ensure_future(asyncio.to_thread(_next_tokens, running)) \
                if any(j.gen is not None for j in running) else None
            took = await self._compute(self.timing.decode_step_ms(ctx) / 1000, "_decode_due")
            toks = await computed if computed is not None else [None] * len(running)
            tok_of = {id(j): t for j, t in zip(running, toks)}
            now = time.monotonic()
            self.core.meter.step(len(ctx), sum(ctx), took * 1000, now)
            still = []
            for j in self.decode_running:
                tok = tok_of.get(id(j))
                if isinstance(tok, Exception):
                    j.remaining = 0
                    self.failed += 1
                    self.m.failed.labels("ENGINE_ERROR").inc()
                    if not j.fut.done():
                        j.fut.set_exception(AgentError("ENGINE_ERROR", f"the reference engine failed: {tok!r}", 500))
                    continue
                if j.gen is not None and tok is None:   # the model's positions are used up: the answer ends here
                    j.remaining = 0
                    self.core.meter.completed(now)
                    if not j.fut.done():
                        j.fut.set_result(None)
                    continue
                j.token_times.append(now)
                if tok is not None:
                    j.ids.append(tok)
                if j.out is not None:
                    msg = {"token": len(j.token_times) - 1, "ms": round((now - j.started) * 1000, 2)}
                    if tok is not None:
                        msg["id"] = tok
                    j.out.put_nowait(msg)
                j.ctx += 1
                j.remaining -= 1
                if j.remaining <= 0:
                    self.core.meter.completed(now)
                    if not j.fut.done():
                        j.fut.set_result(None)
                else:
                    still.append(j)
            self.decode_running = still
            self.core.meter.context_tokens = sum(j.ctx for j in still)


def no_first_token() -> AgentError:
    """A decode for the reference engine without the prefill's first token: the caller's error."""
    return AgentError("LLM_PARAM_INVALID", "the reference engine continues from the prefill's first token: send "
                      "first_token (the prefill's answer has it)", 400)


def _next_tokens(jobs: list[_Decode]) -> list[int | None | Exception]:
    """One decode step of the reference engine: each running request's next token (None when its
    generation ended, the exception when it failed: that request only), one request at a time so
    a token never depends on the batch."""
    out: list[int | None | Exception] = []
    for j in jobs:
        try:
            out.append(next(j.gen, None) if j.gen is not None else None)
        except Exception as e:  # noqa: BLE001 - reported to its request
            out.append(e)
    return out
