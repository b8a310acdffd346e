"""`make bench-gateway`: what pd-gateway adds to a request, and how many it can route.

The token path: one prefill and one decoder agent (real processes, the simulator's timing
scaled to near zero so the engines cost almost nothing), linked. Then:

1. latency: the same small request (a prefill, then a streamed 4-token decode) sent one at
   a time straight to the agents and through the gateway (a streamed chat completion);
   the added latency is the difference of the percentiles;
2. throughput: the gateway pinned to CPU 0, the agents and this client on CPU 1, a closed
   loop of concurrent streamed requests for a fixed time; requests/s and the gateway's CPU.

The vLLM path (`--paths vllm`): one prefill and one decoder vLLM stand-in
(pd_engine.vllm_standin, a small reference model) each beside its pod's agent, linked; the same
chat completion sent with vLLM's P-D protocol straight to the engines (the prefill, then the
decoder with its kv_transfer_params) and through the gateway, which does the same.

The abusive tenant (`--paths abuse`): on the token path, one key sends what a hostile client
would: huge bodies (8 MiB chats of ~270,000 tiny messages, 8 MiB one-word prompts, 8 MiB of
empty arrays) from 8 connections, and headers with no body from 32 more, while another key sends
the same small request one at a time; its latency beside its latency on an idle gateway.

    python bench/bench_gateway.py [--paths token,vllm,abuse] [--requests 300] [--concurrency 32] [--seconds 10]"""
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
from agentproc import TOKEN, AgentProc, next_ip  # noqa: E402
from common import cpu_seconds  # noqa: E402

KEY = "sk-bench-gateway-0001"
ABUSER = "sk-bench-gateway-abuser-0001"
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


def vllm_body(stream: bool) -> dict:
    return {"model": MODEL, "max_tokens": OUTPUT_TOKENS, "temperature": 0, "stream": stream,
            "messages": [{"role": "user", "content": "x" * 60}]}


async def vllm_direct_once(http: httpx.AsyncClient, p: str, d: str) -> None:
    """vLLM's P-D protocol by hand: what a P-D router does, without the gateway."""
    pre = {**vllm_body(False), "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    r = await http.post(f"{p}/v1/chat/completions", json=pre)
    r.raise_for_status()
    body = {**vllm_body(True), "kv_transfer_params": r.json()["kv_transfer_params"]}
    async with http.stream("POST", f"{d}/v1/chat/completions", json=body) as s:
        async for line in s.aiter_lines():
            if line == "data: [DONE]":
                return
    raise RuntimeError("the decoder's stream ended early")


class VllmPod:
    """A pod's agent (PD_RANKS_EXTERNAL: it waits for the engine's worker) and a vLLM stand-in
    beside it, on one loopback IP, as the local cluster runs a pod with spec.engine."""
    PORT = 8001

    def __init__(self, role: str, cluster_id: int, logs: Path):
        self.ip, self.role, self.cluster_id = next_ip(), role, cluster_id
        self.url, self.engine_url = f"http://{self.ip}:8080", f"http://{self.ip}:{self.PORT}"
        desc = {"num_tensors": 4, "shape": [256, 16, 4, 16], "data_type": "DT_FLOAT16",
                "paged": {"num_blocks": 256, "block_size": 16}}
        e = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
        e.update({"PD_LOCAL_POD_IP": self.ip, "POD_NAME": f"{role}-{cluster_id}", "LLM_DATADIST_ROLE": role,
                  "LLM_DATADIST_CLUSTER_ID": str(cluster_id), "LLM_DATADIST_IP": self.ip,
                  "LLM_DATADIST_PORT": "26000", "PD_AGENT_TOKEN": TOKEN, "PD_TENSOR_PARALLEL": "1",
                  "LLM_DATADIST_CACHE_DESC": json.dumps(desc), "PD_BACKEND": "sim", "OPENBLAS_NUM_THREADS": "1"})
        self.agent = subprocess.Popen([sys.executable, "-m", "pd_agent"], env={**e, "PD_RANKS_EXTERNAL": "1"},
                                      stdout=open(logs / f"bench-gateway-{role}-agent.log", "wb"),
                                      stderr=subprocess.STDOUT)
        profile = {"attention": "GQA", "numLayers": 2, "numKvHeads": 4, "headDim": 16, "maxSeqLen": 512,
                   "dtype": "float16", "seed": 1}
        cfg = {"kv_connector": "PDOperatorConnector", "kv_connector_module_path": "pd_engine.vllm_connector",
               "kv_role": "kv_both"}
        self.engine = subprocess.Popen(
            [sys.executable, "-m", "pd_engine.vllm_standin", "--port", str(self.PORT), "--kv-transfer-config",
             json.dumps(cfg), "--reference-model", json.dumps(profile)],
            env={**e, "PD_AGENT_URL": self.url}, stdout=open(logs / f"bench-gateway-{role}-engine.log", "wb"),
            stderr=subprocess.STDOUT)

    def peer(self) -> dict:
        return {"name": f"{self.role}-{self.cluster_id}", "cluster_id": self.cluster_id, "ip": self.ip,
                "port": 26000, "agent_url": self.url}

    def stop(self) -> None:
        for proc in (self.engine, self.agent):
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


async def ready(http: httpx.AsyncClient, url: str, what: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if (await http.get(url)).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{what} did not answer {url} within {timeout:.0f} s")


def start_gateway(agents: str, logs: Path, **extra: str) -> tuple[subprocess.Popen, str]:
    ip = next_ip()
    e = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    e.update(PD_GATEWAY_AGENTS=agents, PD_GATEWAY_API_KEYS=json.dumps({"bench": KEY, "abuser": ABUSER}),
             PD_MODEL_NAME=MODEL,
             PD_AGENT_DATA_TOKEN=TOKEN, PD_LOCAL_POD_IP=ip, **extra)
    gw = subprocess.Popen([sys.executable, "-m", "pd_gateway"], env=e, stdout=subprocess.DEVNULL,
                          stderr=open(logs / "bench-gateway.log", "ab"))
    os.sched_setaffinity(gw.pid, {0})
    return gw, f"http://{ip}:8000"


async def vllm_path(args) -> dict:
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    p, d = VllmPod("prompt", 0, logs), VllmPod("decoder", 1000, logs)
    gw = None
    try:
        async with httpx.AsyncClient(trust_env=False, timeout=60, limits=httpx.Limits(max_connections=512)) as http:
            for pod in (p, d):
                await ready(http, f"{pod.url}/healthz", f"{pod.role}'s agent (its engine's worker registered)")
                await ready(http, f"{pod.engine_url}/health", f"{pod.role}'s engine")
            r = await http.post(f"{d.url}/v1/link", json={"peers": [p.peer()]},
                                headers={"Authorization": f"Bearer {TOKEN}"})
            assert r.json()["ret"] == "LLM_SUCCESS", r.text
            for pod in (p, d):
                for proc in (pod.agent, pod.engine):
                    os.sched_setaffinity(proc.pid, {1})
            gw, url = start_gateway(f"{p.url},{d.url}", logs, PD_GATEWAY_ENGINE_PORT=str(VllmPod.PORT))
            for _ in range(300):
                try:
                    if (await http.get(f"{url}/healthz")).json().get("decoders"):
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.1)
            for _ in range(20):
                await vllm_direct_once(http, p.engine_url, d.engine_url)
                await gateway_once(http, url)
            direct = await latency(lambda: vllm_direct_once(http, p.engine_url, d.engine_url), args.requests)
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
    return {"direct": direct, "via": via, "done": done, "failed": failed, "span": span, "cpu": cpu,
            "direct_name": "straight to the engines"}


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


def agent_pair(logs: Path) -> tuple[AgentProc, AgentProc]:
    """A prefill and a decoder agent on CPU 1, linked, the simulator's timing near zero."""
    env = {"PD_SIM_TIME_SCALE": "0.001"}
    p = AgentProc("prompt", 0, env=env, log=open(logs / "bench-gateway-prompt.log", "wb"))
    d = AgentProc("decoder", 1000, env=env, log=open(logs / "bench-gateway-decoder.log", "wb"))
    assert d.post("/v1/link", {"peers": [p.peer()]}).json()["ret"] == "LLM_SUCCESS"
    for a in (p, d):
        os.sched_setaffinity(a.proc.pid, {1})
    return p, d


async def has_decoders(http: httpx.AsyncClient, url: str) -> None:
    for _ in range(100):
        try:
            if (await http.get(f"{url}/healthz")).json().get("decoders"):
                return
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.1)


async def token_path(args) -> dict:
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    p, d = agent_pair(logs)
    gw = None
    try:
        gw, url = start_gateway(f"{p.url},{d.url}", logs)
        async with httpx.AsyncClient(trust_env=False, timeout=30,
                                     limits=httpx.Limits(max_connections=512)) as http:
            await has_decoders(http, url)
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
    return {"direct": direct, "via": via, "done": done, "failed": failed, "span": span, "cpu": cpu,
            "direct_name": "straight to the agents"}


def huge_bodies() -> list[bytes]:
    """What an abusive client sends: 8 MiB each, just under the gateway's body limit."""
    size = (8 << 20) - 4096
    chat = {"model": MODEL, "max_tokens": 4, "messages": []}
    one = {"role": "user", "content": "hi"}
    chat["messages"] = [one] * ((size - 64) // (len(json.dumps(one)) + 2))
    word = {"model": MODEL, "max_tokens": 4, "prompt": "a" * (size - 64)}
    empties = b'{"model": "' + MODEL.encode() + b'", "messages": [' + b",".join([b"[]"] * ((size - 64) // 3)) + b"]}"
    return [json.dumps(chat).encode(), json.dumps(word).encode(), empties]


async def header_only(host: str, port: int, stop: float) -> None:
    """A connection that sends a request's headers and never its body, opened again when closed."""
    while time.monotonic() < stop:
        try:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ABUSER}\r\n"
                         f"Content-Type: application/json\r\nContent-Length: {8 << 20}\r\n\r\n".encode())
            await writer.drain()
            await asyncio.wait_for(reader.read(), max(0.1, stop - time.monotonic()))
            writer.close()
        except (OSError, TimeoutError):
            await asyncio.sleep(0.1)


async def abuse_path(args) -> dict:
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    p, d = agent_pair(logs)
    gw = None
    statuses: dict[str, int] = {}
    try:
        gw, url = start_gateway(f"{p.url},{d.url}", logs)
        host, port = url.split("//")[1].split(":")
        bodies = huge_bodies()
        async with httpx.AsyncClient(trust_env=False, timeout=120,
                                     limits=httpx.Limits(max_connections=512)) as http:
            await has_decoders(http, url)
            for _ in range(20):
                await gateway_once(http, url)
            idle = await latency(lambda: gateway_once(http, url), args.requests)
            stop = time.monotonic() + 3600

            async def huge(i: int) -> None:
                while time.monotonic() < stop:
                    body = bodies[i % len(bodies)]
                    path = "/v1/completions" if b'"prompt"' in body[:200] else "/v1/chat/completions"
                    try:
                        r = await http.post(f"{url}{path}", content=body, headers={
                            "Authorization": f"Bearer {ABUSER}", "Content-Type": "application/json"})
                        statuses[str(r.status_code)] = statuses.get(str(r.status_code), 0) + 1
                    except httpx.HTTPError as e:
                        statuses[type(e).__name__] = statuses.get(type(e).__name__, 0) + 1
                    i += 1
            abusers = [asyncio.create_task(huge(i)) for i in range(8)]
            abusers += [asyncio.create_task(header_only(host, int(port), stop)) for _ in range(32)]
            await asyncio.sleep(3)   # the abuse in full swing
            c0, t0 = cpu_seconds(gw.pid), time.monotonic()
            failed: dict[str, int] = {}

            async def victim() -> None:
                try:
                    await gateway_once(http, url)
                except Exception as e:  # noqa: BLE001 - counted: the other key's request refused or failed
                    failed[str(e)[:60]] = failed.get(str(e)[:60], 0) + 1
            abused = await latency(victim, args.requests)
            span = time.monotonic() - t0
            cpu = (cpu_seconds(gw.pid) - c0) / span * 100
            stop = 0.0
            for t in abusers:
                t.cancel()
            await asyncio.gather(*abusers, return_exceptions=True)
    finally:
        if gw is not None:
            gw.terminate()
            try:   # a tokenizer thread cannot be cut short: the gateway ends when it returns
                gw.wait(60)
            except subprocess.TimeoutExpired:
                gw.kill()
        p.stop()
        d.stop()
    return {"idle": idle, "abused": abused, "statuses": statuses, "span": span, "cpu": cpu, "failed": failed}


def report_abuse(r: dict, args) -> None:
    print(f"an abusive key beside another key ({args.requests} sequential {OUTPUT_TOKENS}-token streamed chats "
          f"from the other key):")
    for what, xs in (("the gateway idle", r["idle"]), ("under abuse", r["abused"])):
        print(f"  {what:24s} p50 {pct(xs, 0.5):7.2f} ms  p99 {pct(xs, 0.99):7.2f} ms  max {max(xs):7.2f} ms")
    print(f"  the other key's requests failed: {sum(r['failed'].values())} of {args.requests}")
    for err, n in r["failed"].items():
        print(f"    {n}x {err}")
    answered = ", ".join(f"{n}x {s}" for s, n in sorted(r["statuses"].items()))
    print(f"  abusive huge bodies answered: {answered or 'none'}; gateway CPU {r['cpu']:.0f}% over {r['span']:.0f} s")


def report(name: str, r: dict, args) -> None:
    direct, via = r["direct"], r["via"]
    print(f"{name}: per request ({OUTPUT_TOKENS}-token streamed completion, {args.requests} sequential requests each):")
    for what, xs in ((r["direct_name"], direct), ("through the gateway", via)):
        print(f"  {what:24s} p50 {pct(xs, 0.5):6.2f} ms  p99 {pct(xs, 0.99):6.2f} ms  "
              f"mean {statistics.mean(xs):6.2f} ms")
    print(f"  added by the gateway     p50 {pct(via, 0.5) - pct(direct, 0.5):6.2f} ms  "
          f"p99 {pct(via, 0.99) - pct(direct, 0.99):6.2f} ms")
    print(f"  throughput: {r['done'] / r['span']:.1f} requests/s through the gateway pinned to one core "
          f"({args.concurrency} concurrent, {r['span']:.0f} s, {r['failed']} failed), gateway CPU {r['cpu']:.0f}%")


async def main_async(args) -> None:
    os.sched_setaffinity(0, {1})
    paths = {"token": ("the token path (agents)", token_path), "vllm": ("the vLLM path (vLLM's P-D protocol)",
                                                                       vllm_path)}
    for key in args.paths.split(","):
        if key == "abuse":
            report_abuse(await abuse_path(args), args)
            continue
        name, run = paths[key]
        ERRORS.clear()
        report(name, await run(args), args)
        for err, n in ERRORS.items():
            print(f"  failed {n}x: {err}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--paths", default="token,vllm,abuse", help="token, vllm, abuse (comma-separated)")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=10)
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
