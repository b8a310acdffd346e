"""`make bench-gateway`: what pd-gateway adds to a request, and how many it can route.

One prefill and one decoder agent (real processes, the simulator's timing scaled to near
zero so the engines cost almost nothing), linked. Then:

1. latency: the same small request (a prefill, then a streamed 4-token decode) sent one at
   a time straight to the agents and through the gateway (a streamed chat completion);
   the added latency is the difference of the percentiles;
2. throughput: the gateway pinned to CPU 0, the agents and this client on CPU 1, a closed
   loop of concurrent streamed requests for a fixed time; requests/s and the gateway's CPU.

    python bench/bench_gateway.py [--requests 300] [--concurrency 32] [--seconds 10]"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
from common import cpu_seconds  # noqa: E402

from tests.agent_procs import TOKEN, AgentProc, next_ip  # noqa: E402

KEY = "sk-bench-gateway-0001"
MODEL = "bench-model"
OUTPUT_TOKENS = 4


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


async def direct_once(http: httpx.AsyncClient, p: AgentProc, d: AgentProc, req_id: int) -> None:
    h = {"Authorization": f"Bearer {TOKEN}"}
    r = await http.post(f"{p.url}/v1/prefill", json={"req_id": req_id, "prompt_tokens": 16}, headers=h)
    r.raise_for_status()
    async with http.stream("POST", f"{d.url}/v1/decode", headers=h, json={
            "req_id": req_id, "prompt_cluster_id": p.cluster_id, "prompt_agent_url": p.url, "prompt_tokens": 16,
            "output_tokens": OUTPUT_TOKENS, "stream": True}) as s:
        async for line in s.aiter_lines():
            if line and "done" in json.loads(line):
                return
    raise RuntimeError("the decode stream ended early")


async def gateway_once(http: httpx.AsyncClient, url: str) -> None:
    body = {"model": MODEL, "max_tokens": OUTPUT_TOKENS, "stream": True,
            "messages": [{"role": "user", "content": "x" * 60}]}
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body,
                           headers={"Authorization": f"Bearer {KEY}"}) as s:
        if s.status_code != 200:
            raise RuntimeError(f"gateway answered {s.status_code}: {(await s.aread())[:200]!r}")
        async for line in s.aiter_lines():
            if line == "data: [DONE]":
                return
    raise RuntimeError("the gateway stream ended early")


async def latency(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


ERRORS: dict[str, int] = {}


async def closed_loop(fn, concurrency: int, seconds: float) -> tuple[int, int]:
    done = failed = 0
    stop = time.monotonic() + seconds

    async def worker():
        nonlocal done, failed
        while time.monotonic() < stop:
            try:
                await fn()
                done += 1
            except Exception as e:  # noqa: BLE001 - counted
                failed += 1
                ERRORS[str(e)[:120]] = ERRORS.get(str(e)[:120], 0) + 1
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done, failed


async def main_async(args) -> None:
    env = {"PD_SIM_TIME_SCALE": "0.001"}
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    p = AgentProc("prompt", 0, env=env, log=open(logs / "bench-gateway-prompt.log", "wb"))
    d = AgentProc("decoder", 1000, env=env, log=open(logs / "bench-gateway-decoder.log", "wb"))
    gw = None
    try:
        assert d.post("/v1/link", {"peers": [p.peer()]}).json()["ret"] == "LLM_SUCCESS"
        for a in (p, d):
            os.sched_setaffinity(a.proc.pid, {1})
        os.sched_setaffinity(0, {1})
        ip = next_ip()
        url = f"http://{ip}:8000"
        e = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
        e.update(PD_GATEWAY_AGENTS=f"{p.url},{d.url}", PD_GATEWAY_API_KEYS=json.dumps({"bench": KEY}),
                 PD_MODEL_NAME=MODEL, PD_AGENT_DATA_TOKEN=TOKEN, PD_LOCAL_POD_IP=ip)
        gw = subprocess.Popen([sys.executable, "-m", "pd_gateway"], env=e, stdout=subprocess.DEVNULL,
                              stderr=open(Path(os.environ.get("TMPDIR", "/tmp")) / "bench-gateway.log", "wb"))
        os.sched_setaffinity(gw.pid, {0})
        async with httpx.AsyncClient(trust_env=False, timeout=30,
                                     limits=httpx.Limits(max_connections=512)) as http:
            for _ in range(100):
                try:
                    if (await http.get(f"{url}/healthz")).json().get("decoders"):
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.1)
            ids = iter(range(1, 10**9))
            for _ in range(20):   # warm up both paths
                await direct_once(http, p, d, next(ids))
                await gateway_once(http, url)
            direct = await latency(lambda: direct_once(http, p, d, next(ids)), args.requests)
            via = await latency(lambda: gateway_once(http, url), args.requests)
            c0, t0 = cpu_seconds(gw.pid), time.monotonic()
            done, failed = await closed_loop(lambda: gateway_once(http, url), args.concurrency, args.seconds)
            span = time.monotonic() - t0
            cpu = (cpu_seconds(gw.pid) - c0) / span * 100
    finally:
        if gw is not None:
            gw.terminate()
            gw.wait(10)
        p.stop()
        d.stop()
    print(f"per request ({OUTPUT_TOKENS}-token streamed completion, {args.requests} sequential requests each):")
    for name, xs in (("direct to the agents", direct), ("through the gateway", via)):
        print(f"  {name:22s} p50 {pct(xs, 0.5):6.2f} ms  p99 {pct(xs, 0.99):6.2f} ms  "
              f"mean {statistics.mean(xs):6.2f} ms")
    print(f"  added by the gateway   p50 {pct(via, 0.5) - pct(direct, 0.5):6.2f} ms  "
          f"p99 {pct(via, 0.99) - pct(direct, 0.99):6.2f} ms")
    print(f"throughput: {done / span:.1f} requests/s through the gateway pinned to one core "
          f"({args.concurrency} concurrent, {span:.0f} s, {failed} failed), gateway CPU {cpu:.0f}%")
    for err, n in ERRORS.items():
        print(f"  failed {n}x: {err}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=10)
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
