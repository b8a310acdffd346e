"""`python -m llm_datadist_sim.peer CLUSTER_ID IP:PORT`: a prompt engine in its own process,
written as code for the real module is written, driven by JSON lines on stdin (one reply
line each on stdout). Tests and benchmarks use it as the far end of a link."""
import hashlib
import json
import os
import sys

import llm_datadist_sim as llm_datadist
from llm_datadist_sim import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
)


def reply(**kw):
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()


def desc_of(d):
    return CacheDesc(d["num_tensors"], d["shape"], getattr(DataType, d.get("data_type", "DT_FLOAT16")))


def fill_random(cache, slot: int) -> str:
    """Random bytes into one batch entry (or block) of every tensor; their sha256."""
    h = hashlib.sha256()
    for t in range(cache.cache_desc.num_tensors):
        data = os.urandom(cache.slot_bytes)
        cache.slot(t, slot)[:] = data
        h.update(data)
    return h.hexdigest()


def main():
    cluster_id = int(sys.argv[1])
    listen = sys.argv[2]
    engine = LLMDataDist(LLMRole.PROMPT, cluster_id)
    config = LLMConfig()
    config.listen_ip_info = listen
    config.enable_switch_role = True
    engine.init(config.generate_options())
    kv = engine.kv_cache_manager
    caches = {}
    reply(ok=True, ready=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "alloc":
                keys = [CacheKey(prompt_cluster_id=cluster_id, req_id=r, model_id=cmd.get("model_id", 0))
                        for r in cmd["req_ids"]]
                cache = kv.allocate_cache(desc_of(cmd["desc"]), keys)
                shas = [fill_random(cache, i) for i in range(len(keys))]
                caches[cache.cache_id] = cache
                reply(ok=True, cache_id=cache.cache_id, sha256=shas)
            elif op == "alloc_blocks":
                cache = kv.allocate_blocks_cache(desc_of(cmd["desc"]),
                                                 BlocksCacheKey(cluster_id, cmd.get("model_id", 0)))
                shas = [fill_random(cache, b) for b in range(cache.slots)]
                reply(ok=True, sha256=shas)
            elif op == "dealloc":
                kv.deallocate_cache(caches.pop(cmd["cache_id"]))
                reply(ok=True, used=kv.used_bytes)
            elif op == "used":
                reply(ok=True, used=kv.used_bytes)
            elif op == "faults":
                llm_datadist.faults.update(**cmd["set"])
                reply(ok=True)
            elif op == "incoming":
                reply(ok=True, incoming=sorted(engine.sim_links()))
            elif op == "exit":
                engine.finalize()
                reply(ok=True)
                return
            else:
                reply(ok=False, error=f"unknown op {op}")
        except LLMException as e:
            reply(ok=False, code=e.status_code.name, error=str(e))


if __name__ == "__main__":
    main()
