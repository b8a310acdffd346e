"""`make bench-sim`: KV pull throughput over loopback and agent API latency.

Goal: pull throughput >= 1 GB/s."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentproc import AgentProc  # noqa: E402

import llm_datadist_sim as llm  # noqa: E402


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_pull(tensor_mib: int = 64, num_tensors: int = 4, rounds: int = 8) -> None:
    port = free_port()
    peer = subprocess.Popen([sys.executable, "-m", "llm_datadist_sim.peer", "0", f"127.0.0.1:{port}"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert json.loads(peer.stdout.readline())["ready"]
    seq = tensor_mib * (1 << 20) // (8 * 128 * 2)
    desc = {"num_tensors": num_tensors, "shape": [1, seq, 8, 128], "data_type": "DT_FLOAT16"}
    engine = llm.LLMDataDist(llm.LLMRole.DECODER, 1000)
    engine.init(llm.LLMConfig(sync_kv_timeout=30000).generate_options())
    info = llm.LLMClusterInfo()
    info.remote_cluster_id = 0
    info.append_remote_ip_info("127.0.0.1", port)
    assert engine.link_clusters([info], 5000)[0] is llm.LLMStatusCode.LLM_SUCCESS
    kv = engine.kv_cache_manager
    cache = kv.allocate_cache(llm.CacheDesc(num_tensors, desc["shape"], llm.DataType.DT_FLOAT16))
    rates = []
    for r in range(rounds):
        peer.stdin.write(json.dumps({"op": "alloc", "req_ids": [r], "desc": desc}) + "\n")
        peer.stdin.flush()
        json.loads(peer.stdout.readline())
        t0 = time.perf_counter()
        kv.pull_cache(llm.CacheKey(0, r), cache, 0)
        dt = time.perf_counter() - t0
        rates.append(cache.slot_bytes * num_tensors / dt / 1e9)
    total_mib = tensor_mib * num_tensors
    print(f"kv pull over loopback: {total_mib} MiB per pull, {rounds} pulls: "
          f"median {statistics.median(rates):.2f} GB/s, min {min(rates):.2f}, max {max(rates):.2f} (goal >= 1 GB/s)")
    engine.finalize()
    peer.stdin.write('{"op": "exit"}\n')
    peer.stdin.flush()
    peer.wait(10)


def bench_api(n: int = 1000) -> None:
    p = AgentProc("prompt", 0)
    d = AgentProc("decoder", 1000)
    try:
        d.post("/v1/link", {"peers": [p.peer()]})
        for path, fn in (("GET /v1/status", lambda: d.http.get("/v1/status")),
                         ("POST /v1/link (already linked)", lambda: d.post("/v1/link", {"peers": [p.peer()]})),
                         ("POST /v1/verify", lambda: d.post("/v1/verify", {"peer": p.peer()}))):
            lat = []
            for _ in range(n if "verify" not in path else n // 5):
                t0 = time.perf_counter()
                r = fn()
                lat.append((time.perf_counter() - t0) * 1000)
                assert r.status_code == 200, r.text
            lat.sort()
            print(f"agent API {path}: n={len(lat)} p50 {lat[len(lat) // 2]:.2f} ms  "
                  f"p99 {lat[int(len(lat) * 0.99)]:.2f} ms")
    finally:
        p.stop()
        d.stop()


if __name__ == "__main__":
    bench_pull()
    bench_api(int(os.environ.get("BENCH_API_N", "1000")))
