"""pd_engine.vllm_connector over the simulator: the scheduler side's metadata and
kv_transfer_params, and a prefill -> pull -> decode between two worker connectors in this process
(two simulated engines, the decoder linked to the prefill by its agent core as the operator does).
Runs against vLLM's own base class when vllm is importable (make test-vllm), else the stand-in."""
from __future__ import annotations

import json
import time
from types import SimpleNamespace

import numpy as np
import pytest

import llm_datadist_sim.engine as sim_engine
from pd_contract.agent_api import LinkRequest, Peer
from pd_engine import vllm_connector as vc
from pd_engine.adapter import NotLinked
from pd_engine.vllm_config import render_vllm_args
from tests.unit.test_sim import free_port

LAYERS, BLOCKS, BLOCK, HEADS, DIM = 2, 8, 4, 2, 8
DESC = {"num_tensors": 2 * LAYERS, "shape": [BLOCKS, BLOCK, HEADS, DIM], "data_type": "DT_FLOAT16",
        "paged": {"num_blocks": BLOCKS, "block_size": BLOCK}}


class Agent:
    """Captures what a rank registers with its pod's agent."""
    def __init__(self):
        self.calls = []

    def register(self, rank, url, boot_id):
        self.calls.append({"rank": rank, "url": url, "boot_id": boot_id})


def vllm_config():
    if vc.VLLM:
        from vllm.config import KVTransferConfig
        cfg = KVTransferConfig(kv_connector="PDOperatorConnector", kv_connector_module_path="pd_engine.vllm_connector",
                               kv_role="kv_both")
    else:
        cfg = SimpleNamespace(kv_connector_extra_config={}, is_kv_producer=True)
    return SimpleNamespace(kv_transfer_config=cfg)


def env(role: str, cluster_id: int, port: int) -> dict:
    return {"LLM_DATADIST_ROLE": role, "LLM_DATADIST_CLUSTER_ID": str(cluster_id), "LLM_DATADIST_IP": "127.0.0.1",
            "LLM_DATADIST_PORT": str(port), "PD_BACKEND": "sim", "PD_RANK": "0", "PD_TENSOR_PARALLEL": "1",
            "LLM_DATADIST_CACHE_DESC": json.dumps(DESC), "POD_NAME": f"{role}-0",
            "PD_AGENT_TOKEN": "control-token"}


def connector(role, e=None, agent=None):
    return vc.PDOperatorConnector(vllm_config(), role, None, env=e or {}, agent=agent)


def request(rid, params, prompt_len=10):
    return SimpleNamespace(request_id=rid, kv_transfer_params=params, prompt_token_ids=list(range(prompt_len)))


class Blocks:
    def __init__(self, ids):
        self.ids = ids

    def get_block_ids(self):
        return (list(self.ids),)


def kv_caches(fill: bool):
    rng = np.random.default_rng(7)
    out = {}
    for i in range(LAYERS):
        shape = (2, BLOCKS, BLOCK, HEADS, DIM)
        out[f"model.layers.{i}.self_attn"] = (rng.standard_normal(shape).astype(np.float16) if fill
                                              else np.zeros(shape, np.float16))
    return out


@pytest.fixture
def engines():
    """Two simulated engines in this process: the simulator allows one per process (as the real
    library does), so the guard is cleared between the two inits; both are finalized after."""
    made = []

    def make(c):
        sim_engine._active_engine = None
        made.append(c)
        return c
    yield make
    for c in made:
        c.shutdown()
    sim_engine._active_engine = None


# ---- scheduler side ------------------------------------------------------------------------------

def test_scheduler_side_builds_metadata_and_kv_transfer_params():
    e = {"LLM_DATADIST_CLUSTER_ID_BASE": "0", "LLM_DATADIST_POD_INDEX": "3", "PD_TENSOR_PARALLEL": "2",
         "LLM_DATADIST_IP": "10.0.0.7", "LLM_DATADIST_PORT": "26000", "LLM_DATADIST_MODEL_ID": "5"}
    p = connector(vc.KVConnectorRole.SCHEDULER, e)
    plain = request("r0", None)
    assert p.get_num_new_matched_tokens(plain, 0) == (0, False)
    assert p.request_finished(plain, [1]) == (False, None)
    prod = request("r1", {"do_remote_decode": True})
    assert p.get_num_new_matched_tokens(prod, 0) == (0, False)
    p.update_state_after_alloc(prod, Blocks([4, 5, 6]), 0)
    meta = p.build_connector_meta(SimpleNamespace(scheduled_cached_reqs=None))
    assert meta.reqs_to_save == {"r1": [4, 5, 6]} and not meta.reqs_to_recv
    delay, params = p.request_finished(prod, [4, 5, 6])
    assert delay is True
    assert params == {"do_remote_prefill": True, "do_remote_decode": False, "remote_cluster_id": 6,
                      "remote_tp_size": 2, "remote_host": "10.0.0.7", "remote_port": 26000,
                      "remote_block_ids": [4, 5, 6], "remote_request_id": "r1", "remote_model_id": 5}
    assert set(p.build_connector_meta(SimpleNamespace()).reqs_to_send) == {"r1"}

    d = connector(vc.KVConnectorRole.SCHEDULER, {"PD_TENSOR_PARALLEL": "2"})
    cons = request("d1", dict(params), prompt_len=12)
    assert d.get_num_new_matched_tokens(cons, 2) == (10, True)
    d.update_state_after_alloc(cons, Blocks([0, 1, 2]), 10)
    assert cons.kv_transfer_params["do_remote_prefill"] is False      # loaded once
    meta = d.build_connector_meta(SimpleNamespace())
    assert meta.reqs_to_recv == {"d1": vc.RecvSpec([0, 1, 2], 6, [4, 5, 6], 2, "r1", 5)}
    assert d.build_connector_meta(SimpleNamespace()).reqs_to_recv == {}  # reset after each build
    with pytest.raises(ValueError, match="remote_cluster_id"):
        d.update_state_after_alloc(request("d2", {"do_remote_prefill": True, "remote_block_ids": [1]}),
                                   Blocks([1]), 4)


# ---- worker side ---------------------------------------------------------------------------------

def test_prefill_pull_decode_moves_the_exact_bytes(engines):
    port = free_port()
    pa, da = Agent(), Agent()
    p = engines(connector(vc.KVConnectorRole.WORKER, env("prompt", 11, port), pa))
    src = kv_caches(fill=True)
    p.register_kv_caches(src)
    d = engines(connector(vc.KVConnectorRole.WORKER, env("decoder", 1011, free_port()), da))
    dst = kv_caches(fill=False)
    d.register_kv_caches(dst)
    assert pa.calls[0]["rank"] == 0 and pa.calls[0]["url"] == p.server.url
    assert p.layout.to_json() == DESC and p.rank.role == "prompt" and d.rank.role == "decoder"

    # the operator links the decoder to the prefill through the decoder rank's agent API
    res = d.server.run(d.server.core.link(LinkRequest(peers=[
        Peer(name="prompt-0", cluster_id=11, ip="127.0.0.1", port=port, agent_url=p.server.url)])))
    assert res.ret == "LLM_SUCCESS", res

    # the operator's verify: a probe cache of its own, never one of vLLM's blocks
    import httpx
    before = {k: v.copy() for k, v in src.items()}
    peer = {"name": "prompt-0", "cluster_id": 11, "ip": "127.0.0.1", "port": port, "agent_url": p.server.url}
    v = httpx.post(f"{d.server.url}/v1/verify", json={"peer": peer}, trust_env=False, timeout=30,
                   headers={"Authorization": "Bearer control-token"})
    assert v.status_code == 200 and v.json()["ok"] is True, v.text
    assert all(np.array_equal(before[k], src[k]) for k in src) and not any(a.any() for a in dst.values())

    # prefill: the blocks of r1 are saved layer by layer, then held for the decoder
    blocks = [1, 3, 4]
    p.bind_connector_metadata(vc.PDConnectorMetadata(reqs_to_save={"r1": blocks}))
    for name, kv in src.items():
        p.save_kv_layer(name, kv, None)
    p.wait_for_save()
    p.clear_connector_metadata()
    p.bind_connector_metadata(vc.PDConnectorMetadata(reqs_to_send={"r1": time.time() + 60}))
    p.start_load_kv(None)
    assert p.get_finished(set()) == (None, None)   # held until pulled

    # decode: start_load_kv pulls into other block ids
    local = [0, 5, 7]
    d.bind_connector_metadata(vc.PDConnectorMetadata(reqs_to_recv={
        "d1": vc.RecvSpec(local, 11, blocks, 1, "r1")}))
    d.start_load_kv(None)
    for name in src:
        for t in range(2):
            for lb, pb in zip(local, blocks):
                assert dst[name][t, lb].tobytes() == src[name][t, pb].tobytes()
            assert not dst[name][t, [2, 3, 6]].any()   # nothing else written
    assert d.get_finished(set()) == (None, {"d1"})
    assert d.get_block_ids_with_load_errors() == set() and d.load_errors == {}

    # the decoder's agent core tells the prefill's agent, which releases the blocks
    deadline = time.monotonic() + 10
    sent = None
    while time.monotonic() < deadline and not sent:
        sent, _ = p.get_finished(set())
        time.sleep(0.05)
    assert sent == {"r1"}


def test_an_unlinked_remote_is_a_clear_error_naming_the_cluster(engines, caplog):
    d = engines(connector(vc.KVConnectorRole.WORKER, env("decoder", 1011, free_port()), Agent()))
    d.register_kv_caches(kv_caches(fill=False))
    d.bind_connector_metadata(vc.PDConnectorMetadata(reqs_to_recv={"d9": vc.RecvSpec([2, 3], 42, [0, 1])}))
    d.start_load_kv(None)
    assert "not linked to prompt cluster 42" in d.load_errors["d9"]
    assert "not linked to prompt cluster 42" in caplog.text
    assert d.get_block_ids_with_load_errors() == {2, 3}
    assert d.get_finished(set()) == (None, {"d9"})       # reported, so vLLM recomputes it
    spec = vc.RecvSpec([2], 42, [0])
    with pytest.raises(NotLinked) as ei:
        d._load(spec)
    assert ei.value.cluster_id == 42


def test_a_layout_other_than_the_operators_is_refused(engines):
    e = env("decoder", 1011, free_port())
    e["LLM_DATADIST_CACHE_DESC"] = json.dumps({**DESC, "shape": [BLOCKS, BLOCK, 4, DIM]})
    d = engines(connector(vc.KVConnectorRole.WORKER, e, Agent()))
    with pytest.raises(ValueError, match=r"heads x head dim \[2, 8\]"):
        d.register_kv_caches(kv_caches(fill=False))


# ---- render_vllm_args ----------------------------------------------------------------------------

def test_render_vllm_args():
    args, envs = render_vllm_args(tensor_parallel=2, host_ip="10.1.2.3", devices=[4, 5], socket_ifname="eth1")
    assert args[:2] == ["--tensor-parallel-size", "2"] and args[2] == "--kv-transfer-config"
    assert json.loads(args[3]) == {"kv_connector": "PDOperatorConnector",
                                   "kv_connector_module_path": "pd_engine.vllm_connector", "kv_role": "kv_both",
                                   "kv_connector_extra_config": {"tensor_parallel": 2}}
    assert envs == {"ASCEND_RT_VISIBLE_DEVICES": "4,5", "HCCL_IF_IP": "10.1.2.3", "GLOO_SOCKET_IFNAME": "eth1",
                    "TP_SOCKET_IFNAME": "eth1", "HCCL_SOCKET_IFNAME": "eth1", "PD_RANKS_EXTERNAL": "1"}
    assert render_vllm_args(tensor_parallel=1, host_ip="h")[1]["ASCEND_RT_VISIBLE_DEVICES"] == "0"
    for bad in ({"tensor_parallel": 0, "host_ip": "h"}, {"tensor_parallel": 2, "host_ip": "h", "devices": [1]},
                {"tensor_parallel": 2, "host_ip": "h", "devices": [1, 1]}, {"tensor_parallel": 1, "host_ip": ""},
                {"tensor_parallel": 1, "host_ip": "h", "socket_ifname": "a,b"}):
        with pytest.raises(ValueError):
            render_vllm_args(**bad)


# ---- registration in place -----------------------------------------------------------------------

def test_the_decoder_pulls_vllms_blocks_as_they_are_at_the_pull_no_staging_copy(engines):
    """The prefill's vLLM tensors are registered by address: a byte written into a block after the
    save reaches the decoder (a snapshot taken at the save would miss it), and the decoder's pull
    lands in the decoder's own vLLM tensors."""
    port = free_port()
    p = engines(connector(vc.KVConnectorRole.WORKER, env("prompt", 11, port), Agent()))
    src = kv_caches(fill=True)
    p.register_kv_caches(src)
    d = engines(connector(vc.KVConnectorRole.WORKER, env("decoder", 1011, free_port()), Agent()))
    dst = kv_caches(fill=False)
    d.register_kv_caches(dst)
    first = next(iter(src.values()))
    assert p._cache.tensor_addrs[0] == first.ctypes.data          # vLLM's memory, not a copy of it
    assert d._cache.tensor_addrs[0] == next(iter(dst.values())).ctypes.data
    res = d.server.run(d.server.core.link(LinkRequest(peers=[
        Peer(name="prompt-0", cluster_id=11, ip="127.0.0.1", port=port, agent_url=p.server.url)])))
    assert res.ret == "LLM_SUCCESS", res

    p.bind_connector_metadata(vc.PDConnectorMetadata(reqs_to_save={"r1": [2]}))
    for name, kv in src.items():
        p.save_kv_layer(name, kv, None)
    p.wait_for_save()
    p.clear_connector_metadata()
    raw = first.view(np.uint8)
    raw[1, 2, 0, 0, :4] = [0xDE, 0xAD, 0xBE, 0xEF]                 # V of layer 0, block 2, after the save
    d.bind_connector_metadata(vc.PDConnectorMetadata(reqs_to_recv={"d1": vc.RecvSpec([6], 11, [2], 1, "r1")}))
    d.start_load_kv(None)
    assert d.load_errors == {}
    got = next(iter(dst.values())).view(np.uint8)
    assert list(got[1, 6, 0, 0, :4]) == [0xDE, 0xAD, 0xBE, 0xEF]
    for name in src:
        assert dst[name][:, 6].tobytes() == src[name][:, 2].tobytes()


def test_a_role_switch_registers_the_same_tensors_again(engines):
    d = engines(connector(vc.KVConnectorRole.WORKER, env("decoder", 1011, free_port()), Agent()))
    dst = kv_caches(fill=False)
    d.register_kv_caches(dst)
    before = d._cache
    d.server.run(d._before_switch("decoder", "prompt"))
    assert d._cache is None and before.deallocated and before.tensors == []
    d.server.run(d._after_switch("decoder", "prompt"))
    assert d._cache.tensor_addrs == before.tensor_addrs and not d._cache.deallocated


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_registering_a_gib_of_kv_cache_allocates_nothing(engines):
    """1 GiB of vLLM KV cache (resident before it is registered): registering it grows the process
    by far less than a copy would (less than 64 MiB)."""
    layers, blocks, block, heads, dim = 16, 1024, 16, 8, 128         # 16 x 2 x 1024 x 16 x 8 x 128 x 2 B = 1 GiB
    desc = {"num_tensors": 2 * layers, "shape": [blocks, block, heads, dim], "data_type": "DT_FLOAT16",
            "paged": {"num_blocks": blocks, "block_size": block}}
    e = {**env("decoder", 1011, free_port()), "LLM_DATADIST_CACHE_DESC": json.dumps(desc)}
    caches = {f"model.layers.{i}.self_attn": np.ones((2, blocks, block, heads, dim), np.float16)
              for i in range(layers)}
    assert sum(c.nbytes for c in caches.values()) == 1 << 30
    d = engines(connector(vc.KVConnectorRole.WORKER, e, Agent()))
    before = _rss()
    d.register_kv_caches(caches)
    grown = _rss() - before
    print(f"registering 1 GiB of KV cache grew RSS by {grown / (1 << 20):.1f} MiB")
    assert grown < 64 << 20, f"registering 1 GiB grew RSS by {grown >> 20} MiB"


def test_the_connector_calls_a_two_argument_base_as_vllm_before_0_11_2_takes_it():
    from pd_engine._vllm_compat import base_init_args

    class Old:
        def __init__(self, vllm_config, role):
            pass

    class New:
        def __init__(self, vllm_config, role, kv_cache_config=None):
            pass

    assert base_init_args(Old, "c", "r", "k") == ("c", "r")
    assert base_init_args(New, "c", "r", "k") == ("c", "r", "k")

    class OldBase(vc.KVConnectorBase_V1):
        def __init__(self, vllm_config, role):           # vLLM 0.9 - 0.11.1
            self._kv_transfer_config = vllm_config.kv_transfer_config
            self.seen = (vllm_config, role)

    class Conn(vc.PDOperatorConnector, OldBase):
        pass

    import pd_engine.vllm_connector as mod
    saved = mod.KVConnectorBase_V1
    mod.KVConnectorBase_V1 = OldBase
    try:
        c = Conn(vllm_config(), vc.KVConnectorRole.SCHEDULER, None, env={})
    finally:
        mod.KVConnectorBase_V1 = saved
    assert c.seen[1] == vc.KVConnectorRole.SCHEDULER


def test_the_simulator_registers_by_address_as_cacheManager_does(engines):
    """register_blocks_cache checks one address per tensor; unregister_cache gives the memory back
    (nothing reads it after); pulling into a cache given back is refused."""
    import llm_datadist_sim as llm
    d = engines(connector(vc.KVConnectorRole.WORKER, env("decoder", 1011, free_port()), Agent()))
    d.register_kv_caches(kv_caches(fill=False))
    mgr = d.rank.kv_cache_manager
    desc = d.layout.cache_desc(llm)
    buf = np.zeros((BLOCKS, BLOCK, HEADS, DIM), np.float16)
    with pytest.raises(llm.LLMException) as ei:
        mgr.register_blocks_cache(desc, [buf.ctypes.data])
    assert ei.value.status_code == llm.LLMStatusCode.LLM_PARAM_INVALID and "4 tensors" in str(ei.value)
    cache = mgr.register_blocks_cache(llm.CacheDesc(1, [BLOCKS, BLOCK, HEADS, DIM], llm.DataType.DT_FLOAT16),
                                      [buf.ctypes.data])
    cache.slot(0, 3)[:2] = b"\x01\x02"
    assert buf.view(np.uint8)[3, 0, 0, :2].tolist() == [1, 2]      # written through the address
    mgr.unregister_cache(cache.cache_id)
    with pytest.raises(llm.LLMException):
        mgr.pull_blocks(llm.BlocksCacheKey(11), cache, [0], [0])
    with pytest.raises(llm.LLMException):
        mgr.unregister_cache(cache.cache_id)
