"""`python -m pd_agent.loadgen`: drive prefill -> decode requests through the agents.

Arrivals are Poisson (fixed rate) or sinusoidal (rate between --rate-min and --rate-max over
--period seconds); prompt/output lengths follow the chat or code workload means. Each
request goes to the least-loaded prefill, then to a decoder linked to it. Reports TTFT/TBT
percentiles, goodput under the SLOs, and failures by reason.

A request refused before any token was produced (a draining or terminating pod answers 503
DRAINING, a pod that is gone refuses the connection, no linked pair exists yet) is retried
on another pair within --retry-window seconds; if its prefill already ran, the decode is
retried on another decoder linked to the same prefill, so the cache is still pulled. Such
refusals and retries are reported apart from failures: a request fails only when no pair
could take it, or when it failed after it was admitted.

With --gateway URL --api-key KEY the requests go through pd-gateway instead, as OpenAI
streaming chat completions (greedy, temperature 0) whose prompt tokenizes to the planned
length; TTFT and TBT are measured client-side from the SSE chunks, and whatever the gateway
answers is what counts (it does the retrying)."""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx

from pd_contract.engine_env import PD_AGENT_TOKEN
from pd_router.routing import Attempt, EngineError, Fleet, Unavailable, fixed_finder, generate, pod_finder

WORKLOADS = {"chat": (1155, 211), "code": (2048, 28)}  # (prompt mean, output mean)


# ---- pure parts --------------------------------------------------------------------------

def rate_at(t: float, kind: str, rate: float, rate_min: float, rate_max: float, period: float) -> float:
    if kind == "poisson":
        return rate
    mid, amp = (rate_max + rate_min) / 2, (rate_max - rate_min) / 2
    return mid + amp * math.sin(2 * math.pi * t / period)


def arrival_times(kind: str, duration: float, rng: random.Random, rate: float = 10,
                  rate_min: float = 5, rate_max: float = 20, period: float = 150) -> list[float]:
    """Non-homogeneous Poisson arrivals by thinning against the peak rate."""
    peak = rate if kind == "poisson" else rate_max
    out: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= duration:
            return out
        if rng.random() <= rate_at(t, kind, rate, rate_min, rate_max, period) / peak:
            out.append(t)


def read_trace(lines, speed: float = 1.0, max_prompt: int | None = None, max_output: int | None = None
               ) -> list[tuple[float, int, int]]:
    """A trace in the Mooncake JSON-lines format (`timestamp` in ms, `input_length`,
    `output_length`; other fields such as `hash_ids` ignored) as (seconds from the first
    request / speed, prompt tokens, output tokens), in time order."""
    rows = []
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        try:
            r = json.loads(line)
            rows.append((float(r["timestamp"]), int(r["input_length"]), int(r["output_length"])))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"trace line {n}: {e}: expected timestamp (ms), input_length, output_length") from e
    rows.sort()
    if not rows:
        return []
    t0 = rows[0][0]
    cap = lambda v, c: max(1, min(v, c)) if c else max(1, v)  # noqa: E731
    return [((ts - t0) / 1000 / speed, cap(p, max_prompt), cap(o, max_output)) for ts, p, o in rows]


def request_plan(args: argparse.Namespace, rng: random.Random) -> list[tuple[float, int, int]]:
    """(send at, prompt tokens, output tokens) per request: from --trace, or the synthetic shapes."""
    if args.trace:
        with open(args.trace) as f:
            plan = read_trace(f, args.trace_speed, args.max_prompt, args.max_output)
        return [r for r in plan if r[0] < args.duration] if args.duration else plan
    times = arrival_times(args.arrival, args.duration, rng, args.rate, args.rate_min, args.rate_max, args.period)
    p_mean, o_mean = WORKLOADS[args.workload]
    return [(t, sample_length(p_mean, rng, args.max_prompt), sample_length(o_mean, rng, args.max_output))
            for t in times]


def parse_shard(text: str) -> tuple[int, int]:
    """"K/N" -> (K, N): this process sends requests K, K+N, K+2N ... of the plan."""
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected K/N, e.g. 0/4") from None
    if not 0 <= k < n:
        raise argparse.ArgumentTypeError(f"{text!r}: K must be in 0..N-1")
    return k, n


class LoopLag:
    """How late this event loop wakes a timer: one process carries only so many streams, and a
    loop that falls behind fires its own timeouts late and measures itself, not the fleet."""

    def __init__(self, every: float = 0.1) -> None:
        self.every = every
        self.lags: list[float] = []

    async def run(self) -> None:
        while True:
            t = time.monotonic()
            await asyncio.sleep(self.every)
            self.lags.append(max(0.0, (time.monotonic() - t - self.every) * 1000))

    def summary(self) -> dict[str, float]:
        return {"p99": round(percentile(self.lags, 99) or 0.0, 1), "max": round(max(self.lags, default=0.0), 1)}


def sample_length(mean: float, rng: random.Random, cap: int, sigma: float = 0.8) -> int:
    mu = math.log(mean) - sigma * sigma / 2  # lognormal with the given mean
    return max(1, min(cap, int(rng.lognormvariate(mu, sigma))))


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


@dataclass
class Result:
    ok: bool
    ttft_ms: float = 0
    tbt_ms: float = 0        # mean time between tokens of this request
    reason: str = ""
    refusals: dict[str, int] = field(default_factory=dict)  # refused before any token, by reason


@dataclass
class Summary:
    requests: int
    completed: int
    failed: int
    failed_by_reason: dict[str, int]
    duration_s: float
    throughput_rps: float
    goodput_rps: float
    slo_attainment: float
    ttft_ms: dict[str, float | None] = field(default_factory=dict)
    tbt_ms: dict[str, float | None] = field(default_factory=dict)
    retried: int = 0                     # requests that were refused at least once
    refused_by_reason: dict[str, int] = field(default_factory=dict)
    # how late this process's own timers fired (p99, max): past a second or so the load generator,
    # not the fleet, is what the numbers measure
    loop_lag_ms: dict[str, float] = field(default_factory=dict)


def summarize(results: list[Result], duration_s: float, slo_ttft_ms: float, slo_tbt_ms: float) -> Summary:
    ok = [r for r in results if r.ok]
    failed: dict[str, int] = {}
    for r in results:
        if not r.ok:
            failed[r.reason] = failed.get(r.reason, 0) + 1
    refused: dict[str, int] = {}
    for r in results:
        for k, v in r.refusals.items():
            refused[k] = refused.get(k, 0) + v
    good = [r for r in ok if r.ttft_ms <= slo_ttft_ms and r.tbt_ms <= slo_tbt_ms]
    pct = lambda vals: {f"p{q}": percentile(vals, q) for q in (50, 90, 99)}  # noqa: E731
    return Summary(
        requests=len(results), completed=len(ok), failed=len(results) - len(ok), failed_by_reason=failed,
        duration_s=duration_s, throughput_rps=len(ok) / duration_s if duration_s else 0,
        goodput_rps=len(good) / duration_s if duration_s else 0,
        slo_attainment=len(good) / len(results) if results else 0,
        ttft_ms=pct([r.ttft_ms for r in ok]), tbt_ms=pct([r.tbt_ms for r in ok]),
        retried=sum(1 for r in results if r.refusals), refused_by_reason=refused,
    )


# ---- I/O -----------------------------------------------------------------------------------

async def direct_request(fleet: Fleet, req_id: int, prompt: int, output: int, retry_window: float = 10.0) -> Result:
    """One request routed to the agents as pd-gateway routes it (pd_router.routing.generate: a
    prefill, then a streamed decode on a decoder linked to it, refusals before the first token
    retried elsewhere); TTFT and TBT measured here, as the tokens arrive."""
    t0 = time.monotonic()
    attempt = Attempt()
    times: list[float] = []
    try:
        async for msg in generate(fleet, req_id, prompt, output, attempt, retry_window):
            if "token" in msg:
                times.append(time.monotonic())
    except Unavailable as e:
        return Result(ok=False, reason=e.reason, refusals=attempt.refusals)
    except EngineError as e:
        return Result(ok=False, reason=e.code, refusals=attempt.refusals)
    gaps = [(b - a) * 1000 for a, b in zip(times, times[1:])]
    return Result(ok=True, ttft_ms=(times[0] - t0) * 1000, tbt_ms=sum(gaps) / len(gaps) if gaps else 0.0,
                  refusals=attempt.refusals)


# the gateway's chat template lays a message out as "user: <content>": "user" and ":" are a
# token each, and each " x" of the content is one more (pd_contract.tokens, cl100k_base)
CHAT_TEMPLATE_TOKENS = 2


def gateway_content(prompt: int) -> str:
    """A user message whose chat text is `prompt` tokens (at least 3) under the gateway's tokenizer."""
    return "x" + " x" * (max(1, prompt - CHAT_TEMPLATE_TOKENS) - 1)


async def gateway_request(http: httpx.AsyncClient, url: str, key: str, model: str, prompt: int,
                          output: int) -> Result:
    """One streamed chat completion through the gateway, of `prompt` tokens (as the gateway
    counts them) and greedy; the output counts as the usage chunk says (a chunk carries the
    text its token completed, so a character split across tokens arrives in fewer chunks)."""
    body = {"model": model, "stream": True, "max_tokens": output, "temperature": 0,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": gateway_content(prompt)}]}
    t0 = time.monotonic()
    times: list[float] = []
    produced: int | None = None
    try:
        async with http.stream("POST", f"{url}/v1/chat/completions", json=body,
                               headers={"Authorization": f"Bearer {key}"}) as r:
            if r.status_code != 200:
                await r.aread()
                try:
                    err = r.json()["error"]
                    return Result(ok=False, reason=err.get("code") or err.get("type") or str(r.status_code))
                except (ValueError, KeyError, TypeError):
                    return Result(ok=False, reason=str(r.status_code))
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                msg = json.loads(line[6:])
                if "error" in msg:
                    return Result(ok=False, reason=msg["error"].get("code") or "stream_error")
                if msg.get("choices") and msg["choices"][0]["delta"].get("content"):
                    times.append(time.monotonic())
                if isinstance(msg.get("usage"), dict):
                    produced = msg["usage"].get("completion_tokens")
    except httpx.HTTPError as e:
        return Result(ok=False, reason=type(e).__name__)
    if not times or (produced if isinstance(produced, int) else len(times)) < output:
        return Result(ok=False, reason="ShortStream")
    gaps = [(b - a) * 1000 for a, b in zip(times, times[1:])]
    return Result(ok=True, ttft_ms=(times[0] - t0) * 1000, tbt_ms=sum(gaps) / len(gaps) if gaps else 0.0)


async def run(args: argparse.Namespace) -> Summary:
    stop = _Stop.install()
    rng = random.Random(args.seed)
    headers = {"Authorization": f"Bearer {args.token}"} if args.token else {}
    async with httpx.AsyncClient(trust_env=False, headers=headers,
                                 timeout=httpx.Timeout(120, connect=5),
                                 limits=httpx.Limits(max_connections=1000)) as http:
        if args.gateway:
            return await _run_gateway(args, http, rng, stop)
        find = fixed_finder(args.agent)
        if args.deployment:
            pods = pod_finder(args.namespace, args.deployment, args.kubeconfig)
            find = lambda: fixed_finder(args.agent)() + pods()  # noqa: E731
        fleet = Fleet(http, args.token, find)
        await fleet.refresh()
        k, n = args.shard
        plan = request_plan(args, rng)[k::n]
        base_id = rng.getrandbits(40) << 20   # the same in every shard: ids by index in the whole plan
        start, wall0 = time.monotonic(), time.time()
        tasks = []
        lag = LoopLag()
        bg = [asyncio.create_task(fleet.run(1.0)), asyncio.create_task(lag.run())]
        for i, (t, prompt, output) in enumerate(plan):
            if await _until(stop.first, start + t):
                break
            tasks.append(asyncio.create_task(direct_request(fleet, base_id + k + i * n, prompt, output,
                                                            args.retry_window)))
        results = await _finish(tasks, stop, args.stop_grace)
        for b in bg:
            b.cancel()
        _write_requests(args.requests_out, plan, results, wall0)
        s = summarize(results, time.monotonic() - start, args.slo_ttft_ms, args.slo_tbt_ms)
        s.loop_lag_ms = lag.summary()
        return s


async def _run_gateway(args: argparse.Namespace, http: httpx.AsyncClient, rng: random.Random,
                       stop: "_Stop") -> Summary:
    url = args.gateway.rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    model = args.model
    if not model:
        r = await http.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {args.api_key}"})
        r.raise_for_status()
        model = r.json()["data"][0]["id"]
    k, n = args.shard
    plan = request_plan(args, rng)[k::n]
    start, wall0 = time.monotonic(), time.time()
    tasks = []
    lag = LoopLag()
    bg = asyncio.create_task(lag.run())
    for t, prompt, output in plan:
        if await _until(stop.first, start + t):
            break
        tasks.append(asyncio.create_task(gateway_request(http, url, args.api_key, model, prompt, output)))
    results = await _finish(tasks, stop, args.stop_grace)
    bg.cancel()
    _write_requests(args.requests_out, plan, results, wall0)
    s = summarize(results, time.monotonic() - start, args.slo_ttft_ms, args.slo_tbt_ms)
    s.loop_lag_ms = lag.summary()
    return s


def _write_requests(path: str | None, plan: list[tuple[float, int, int]], results, wall0: float) -> None:
    """One JSON line per request sent: when (s from the start, and as Unix time), lengths, and
    what it got."""
    if not path:
        return
    with open(path, "w") as f:
        for (t, prompt, output), r in zip(plan, results):
            f.write(json.dumps({"t": round(t, 3), "sent_at": round(wall0 + t, 3), "prompt": prompt,
                                "output": output, "ok": r.ok, "ttft_ms": round(r.ttft_ms, 2),
                                "tbt_ms": round(r.tbt_ms, 3), "reason": r.reason}) + "\n")


class _Stop:
    """SIGTERM/SIGINT: the first stops sending and gives the requests in flight --stop-grace
    seconds to finish; a second one cancels them at once. Either way the summary is printed."""

    def __init__(self) -> None:
        self.first = asyncio.Event()
        self.now = asyncio.Event()

    def signal(self) -> None:
        (self.now if self.first.is_set() else self.first).set()

    @classmethod
    def install(cls) -> "_Stop":
        stop = cls()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.signal)
        return stop


async def _finish(tasks: list[asyncio.Task], stop: _Stop, grace: float) -> list[Result]:
    """Wait for the requests in flight; after a stop signal at most `grace` seconds (none after
    a second one). Requests cut short count as failed, reason Cancelled."""
    pending = {t for t in tasks if not t.done()}
    hurry = asyncio.create_task(stop.now.wait())
    end: float | None = None
    while pending and not hurry.done():
        if stop.first.is_set() and end is None:
            end = time.monotonic() + grace
        if end is not None and time.monotonic() >= end:
            break
        _, pending = await asyncio.wait(pending | {hurry}, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
        pending.discard(hurry)
    hurry.cancel()
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return [Result(ok=False, reason="Cancelled") if t.cancelled() else t.result() for t in tasks]


async def _until(stop: asyncio.Event, when: float) -> bool:
    """Wait until `when` (monotonic); True if told to stop first."""
    delay = when - time.monotonic()
    if delay > 0:
        try:
            await asyncio.wait_for(stop.wait(), delay)
        except asyncio.TimeoutError:
            pass
    return stop.is_set()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pd_agent.loadgen", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agent", action="append", default=[], help="agent URL (repeat), e.g. http://10.0.0.7:8080")
    ap.add_argument("--kubeconfig", default=None)
    ap.add_argument("--namespace", default="default")
    ap.add_argument("--deployment", default=None, help="discover agents of this PDDeployment")
    ap.add_argument("--token", default=os.environ.get(PD_AGENT_TOKEN))
    ap.add_argument("--arrival", choices=["poisson", "sine"], default="poisson")
    ap.add_argument("--rate", type=float, default=5, help="req/s for poisson")
    ap.add_argument("--rate-min", type=float, default=5)
    ap.add_argument("--rate-max", type=float, default=20)
    ap.add_argument("--period", type=float, default=150)
    ap.add_argument("--duration", type=float, default=30)
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="chat")
    ap.add_argument("--max-prompt", type=int, default=2048)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--slo-ttft-ms", type=float, default=1500)
    ap.add_argument("--slo-tbt-ms", type=float, default=80)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--retry-window", type=float, default=10.0,
                    help="seconds a refused request (draining pod, no linked pair) keeps trying other pairs: "
                    "from its start for the prefill, and again from the prefill's end for the decode")
    ap.add_argument("--trace", default=None, help="replay a JSON-lines trace (timestamp ms, input_length, "
                    "output_length: the Mooncake format) instead of the synthetic arrivals; --duration 0 plays it all")
    ap.add_argument("--trace-speed", type=float, default=1.0, help="play the trace this many times faster")
    ap.add_argument("--gateway", default=None, help="send OpenAI streaming requests through pd-gateway at this URL")
    ap.add_argument("--api-key", default=os.environ.get("PD_GATEWAY_API_KEY"), help="the gateway's API key")
    ap.add_argument("--model", default=None, help="model id (default: the gateway's /v1/models)")
    ap.add_argument("--requests-out", default=None, help="write one JSON line per request (time sent, "
                    "lengths, TTFT, TBT, result) to this file")
    ap.add_argument("--stop-grace", type=float, default=60.0, help="after SIGTERM/SIGINT, seconds the requests "
                    "in flight get to finish before they are cancelled (a second signal cancels them at once)")
    ap.add_argument("--shard", type=parse_shard, default=(0, 1), metavar="K/N",
                    help="send only requests K, K+N, K+2N ... of the plan (N processes share a load one "
                    "process cannot carry; run one per K)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not args.agent and not args.deployment and not args.gateway:
        ap.error("give --agent URLs, --deployment or --gateway")
    s = asyncio.run(run(args))
    if args.json:
        print(json.dumps(asdict(s), indent=2))
    else:
        fmt = lambda d: " ".join(f"{k}={v:.1f}" if v is not None else f"{k}=-" for k, v in d.items())  # noqa: E731
        print(f"requests {s.requests}  completed {s.completed}  failed {s.failed} {s.failed_by_reason or ''}")
        print(f"retried {s.retried} (refusals before any token: {s.refused_by_reason or 'none'})")
        print(f"throughput {s.throughput_rps:.2f} req/s  goodput {s.goodput_rps:.2f} req/s  "
              f"SLO attainment {s.slo_attainment:.1%}")
        print(f"TTFT ms {fmt(s.ttft_ms)}")
        print(f"TBT  ms {fmt(s.tbt_ms)}")
        print(f"load generator's loop lag ms {fmt(s.loop_lag_ms)}")
    return 0 if s.completed else 1


if __name__ == "__main__":
    sys.exit(main())
