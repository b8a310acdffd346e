"""The simulator's semantics: every status-code path, with the prompt engine in its own
process (the library allows one engine per process) and this process as the decoder."""
from __future__ import annotations

import hashlib
import json
import socket
import subprocess
import sys
import time

import pytest

from llm_datadist_sim import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
)
from tests.conftest import wait_for
from tests.procs import spawn

DESC = {"num_tensors": 4, "shape": [2, 32, 2, 16], "data_type": "DT_FLOAT16"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PromptPeer:
    def __init__(self, cluster_id: int, env: dict | None = None):
        import os
        self.cluster_id = cluster_id
        self.port = free_port()
        self.proc = spawn(
            [sys.executable, "-m", "llm_datadist_sim.peer", str(cluster_id), f"127.0.0.1:{self.port}"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
        assert self.read()["ready"]

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, "prompt peer died"
        return json.loads(line)

    def cmd(self, **kw) -> dict:
        self.proc.stdin.write(json.dumps(kw) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def info(self, port: int | None = None, cluster_id: int | None = None) -> LLMClusterInfo:
        info = LLMClusterInfo()
        info.remote_cluster_id = self.cluster_id if cluster_id is None else cluster_id
        info.append_local_ip_info("127.0.0.1", 26000)
        info.append_remote_ip_info("127.0.0.1", self.port if port is None else port)
        return info

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def prompt():
    peers = []

    def make(cluster_id: int = 0, env: dict | None = None) -> PromptPeer:
        p = PromptPeer(cluster_id, env)
        peers.append(p)
        return p
    yield make
    for p in peers:
        p.close()


@pytest.fixture
def decoder():
    engines = []

    def make(cluster_id: int = 1000, **cfg) -> LLMDataDist:
        e = LLMDataDist(LLMRole.DECODER, cluster_id)
        e.init(LLMConfig(**cfg).generate_options())
        engines.append(e)
        return e
    yield make
    for e in engines:
        e.finalize()


def desc() -> CacheDesc:
    return CacheDesc(DESC["num_tensors"], DESC["shape"], DataType.DT_FLOAT16)


def sha_of(cache, index: int) -> str:
    h = hashlib.sha256()
    for t in range(cache.cache_desc.num_tensors):
        h.update(cache.slot(t, index))
    return h.hexdigest()


# ---- API surface --------------------------------------------------------------------------

def test_status_codes_in_the_real_order():
    names = [c.name for c in LLMStatusCode]
    assert names[:5] == ["LLM_SUCCESS", "LLM_FAILED", "LLM_PARAM_INVALID", "LLM_WAIT_PROCESS_TIMEOUT",
                         "LLM_KV_CACHE_NOT_EXIST"]
    assert "LLM_SEQ_LENOVERLIMIT" in names and names[-1] == "LLM_UNKNOWN_ERROR"
    assert len(names) == 29
    assert LLMStatusCode.LLM_LINK_FAILED.value == 0x5010B009
    assert LLMStatusCode.LLM_EXIST_LINK.value == 0x5010B018
    assert issubclass(LLMException, RuntimeError)


def test_generate_options_keys():
    opts = LLMConfig(device_id=3, sync_kv_timeout=2000, listen_ip_info="10.0.0.1:26000",
                     enable_switch_role=True, enable_cache_manager=True, mem_utilization=0.9,
                     buf_pool_cfg='{"buf_cfg":[]}', mem_pool_cfg='{"memory_size":1}').generate_options()
    assert opts == {
        "ge.exec.deviceId": "3", "llm.SyncKvCacheWaitTime": "2000", "llm.listenIpInfo": "10.0.0.1:26000",
        "llm.EnableSwitchRole": "1", "llm.EnableCacheManager": "1", "llm.MemoryUtilization": "0.9",
        "llm.BufPoolCfg": '{"buf_cfg":[]}', "llm.MemPoolConfig": '{"memory_size":1}',
    }
    assert LLMConfig().generate_options() == {"llm.SyncKvCacheWaitTime": "1000", "llm.MemoryUtilization": "0.95"}


def test_calls_before_init_raise_runtime_error():
    e = LLMDataDist(LLMRole.DECODER, 1)
    with pytest.raises(RuntimeError, match="not initialized"):
        e.link_clusters([LLMClusterInfo()], 1000)
    with pytest.raises(RuntimeError, match="not initialized"):
        _ = e.kv_cache_manager
    e.finalize()  # no-op when not initialised


def test_one_engine_per_process(decoder):
    decoder(1000)
    other = LLMDataDist(LLMRole.DECODER, 1001)
    with pytest.raises(LLMException) as ei:
        other.init({})
    assert ei.value.status_code is LLMStatusCode.LLM_FAILED
    assert "multiple" in str(ei.value)


def test_prompt_needs_listen_ip_info():
    e = LLMDataDist(LLMRole.PROMPT, 0)
    with pytest.raises(LLMException) as ei:
        e.init({})
    assert ei.value.status_code is LLMStatusCode.LLM_PARAM_INVALID


def test_link_argument_checks(decoder):
    d = decoder()
    infos = [LLMClusterInfo() for _ in range(17)]
    for i, info in enumerate(infos):
        info.remote_cluster_id = i
        info.append_remote_ip_info("127.0.0.1", 1)
    ret, rets = d.link_clusters(infos, 1000)
    assert ret is LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT and len(rets) == 17
    ret, _ = d.link_clusters(infos[:1], 0)
    assert ret is LLMStatusCode.LLM_PARAM_INVALID


def test_decoder_role_checks(decoder):
    d = decoder()
    kv = d.kv_cache_manager
    with pytest.raises(LLMException) as ei:
        kv.allocate_cache(desc(), [CacheKey(1000, 1)])
    assert ei.value.status_code is LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(LLMException) as ei:
        kv.remove_cache_key(CacheKey(1000, 1))
    assert ei.value.status_code is LLMStatusCode.LLM_PARAM_INVALID
    cache = kv.allocate_cache(desc())
    with pytest.raises(LLMException) as ei:
        kv.pull_cache(CacheKey(7, 1), cache, 0)
    assert ei.value.status_code is LLMStatusCode.LLM_NOT_YET_LINK
    with pytest.raises(LLMException) as ei:
        kv.pull_blocks(BlocksCacheKey(7), cache, [], [])
    assert ei.value.status_code is LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(LLMException) as ei:
        d.check_link_status(7)
    assert ei.value.status_code is LLMStatusCode.LLM_NOT_YET_LINK


def test_switch_role_checks(decoder):
    d = decoder()
    with pytest.raises(LLMException) as ei:
        d.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": "127.0.0.1:1"})
    assert ei.value.status_code is LLMStatusCode.LLM_FEATURE_NOT_ENABLED
    d.finalize()
    d2 = decoder(enable_switch_role=True)
    with pytest.raises(LLMException) as ei:
        d2.switch_role(LLMRole.DECODER)
    assert ei.value.status_code is LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(LLMException) as ei:
        d2.switch_role(LLMRole.PROMPT)  # no listen address
    assert ei.value.status_code is LLMStatusCode.LLM_PARAM_INVALID


def test_out_of_memory(decoder, monkeypatch):
    monkeypatch.setenv("PD_SIM_DEVICE_MEMORY_GB", "0.000001")  # ~1 KiB
    d = decoder()
    with pytest.raises(LLMException) as ei:
        d.kv_cache_manager.allocate_cache(desc())
    assert ei.value.status_code is LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY


def test_memory_scale_keeps_logical_accounting(decoder, monkeypatch):
    monkeypatch.setenv("PD_SIM_MEMORY_SCALE", "8")
    d = decoder()
    c = d.kv_cache_manager.allocate_cache(desc())
    logical = 4 * 2 * 32 * 2 * 16 * 2
    assert d.kv_cache_manager.used_bytes == logical
    assert sum(len(t) for t in c.tensors) == logical // 8


# ---- with a prompt engine in another process -----------------------------------------------

def test_article_flow_pull_cache(prompt, decoder):
    p = prompt(0)
    got = p.cmd(op="alloc", req_ids=[1, 2], desc=DESC)
    d = decoder()
    ret, rets = d.link_clusters([p.info()], 5000)
    assert ret is LLMStatusCode.LLM_SUCCESS and rets == [LLMStatusCode.LLM_SUCCESS]
    d.check_link_status(0)
    assert p.cmd(op="incoming")["incoming"] == [1000]
    kv = d.kv_cache_manager
    cache = kv.allocate_cache(desc())
    kv.pull_cache(CacheKey(prompt_cluster_id=0, req_id=2, model_id=0), cache, 0)
    assert sha_of(cache, 0) == got["sha256"][1]
    kv.pull_cache(CacheKey(0, 1), cache, 1)
    assert sha_of(cache, 1) == got["sha256"][0]
    # pulled once: the key is gone
    with pytest.raises(LLMException) as ei:
        kv.pull_cache(CacheKey(0, 1), cache, 0)
    assert ei.value.status_code is LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    # a second link to the same cluster
    ret, rets = d.link_clusters([p.info()], 5000)
    assert rets == [LLMStatusCode.LLM_ALREADY_LINK]


def test_prompt_memory_freed_after_pull(prompt, decoder):
    p = prompt(0)
    got = p.cmd(op="alloc", req_ids=[5], desc=DESC)
    before = p.cmd(op="used")["used"]
    assert p.cmd(op="dealloc", cache_id=got["cache_id"])["used"] == before  # key still unpulled
    d = decoder()
    d.link_clusters([p.info()], 5000)
    kv = d.kv_cache_manager
    kv.pull_cache(CacheKey(0, 5), kv.allocate_cache(desc()), 0)
    # the prompt side frees the key after it sent the bytes, which may be just after the pull returns
    wait_for("the prompt side freed the pulled cache", lambda: p.cmd(op="used")["used"] == 0, timeout=5,
             interval=0.01)


@pytest.mark.parametrize("key", [CacheKey(0, 99), CacheKey(0, 1, model_id=3)])
def test_wrong_cache_key(prompt, decoder, key):
    p = prompt(0)
    p.cmd(op="alloc", req_ids=[1], desc=DESC)
    d = decoder()
    d.link_clusters([p.info()], 5000)
    with pytest.raises(LLMException) as ei:
        d.kv_cache_manager.pull_cache(key, d.kv_cache_manager.allocate_cache(desc()), 0)
    assert ei.value.status_code is LLMStatusCode.LLM_KV_CACHE_NOT_EXIST


def test_wrong_prompt_cluster_in_key_is_not_linked(prompt, decoder):
    p = prompt(0)
    d = decoder()
    d.link_clusters([p.info()], 5000)
    with pytest.raises(LLMException) as ei:
        d.kv_cache_manager.pull_cache(CacheKey(5, 1), d.kv_cache_manager.allocate_cache(desc()), 0)
    assert ei.value.status_code is LLMStatusCode.LLM_NOT_YET_LINK


def test_mismatched_cache_desc(prompt, decoder):
    p = prompt(0)
    p.cmd(op="alloc", req_ids=[1], desc=DESC)
    d = decoder()
    d.link_clusters([p.info()], 5000)
    other = CacheDesc(4, [2, 32, 4, 16], DataType.DT_FLOAT16)
    with pytest.raises(LLMException) as ei:
        d.kv_cache_manager.pull_cache(CacheKey(0, 1), d.kv_cache_manager.allocate_cache(other), 0)
    assert ei.value.status_code is LLMStatusCode.LLM_PARAM_INVALID


def test_article_flow_pull_blocks(prompt, decoder):
    p = prompt(0)
    bdesc = {"num_tensors": 2, "shape": [8, 16, 1, 32], "data_type": "DT_BF16"}
    shas = p.cmd(op="alloc_blocks", desc=bdesc, model_id=0)["sha256"]
    d = decoder()
    d.link_clusters([p.info()], 5000)
    kv = d.kv_cache_manager
    mine = kv.allocate_blocks_cache(CacheDesc(2, [8, 16, 1, 32], DataType.DT_BF16))
    kv.pull_blocks(BlocksCacheKey(prompt_cluster_id=0, model_id=0), mine, [3, 5], [0, 1])
    assert sha_of(mine, 0) == shas[3] and sha_of(mine, 1) == shas[5]
    with pytest.raises(LLMException) as ei:
        kv.pull_blocks(BlocksCacheKey(0, 0), mine, [1, 2], [0])
    assert ei.value.status_code is LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(LLMException) as ei:
        kv.pull_blocks(BlocksCacheKey(0, model_id=9), mine, [1], [0])
    assert ei.value.status_code is LLMStatusCode.LLM_KV_CACHE_NOT_EXIST


def test_wrong_port_is_link_failed(prompt, decoder):
    p = prompt(0)
    d = decoder()
    ret, rets = d.link_clusters([p.info(port=free_port())], 2000)
    assert ret is LLMStatusCode.LLM_LINK_FAILED and rets == [LLMStatusCode.LLM_LINK_FAILED]


def test_wrong_cluster_id_is_link_failed(prompt, decoder):
    p = prompt(0)
    d = decoder()
    _, rets = d.link_clusters([p.info(cluster_id=42)], 2000)
    assert rets == [LLMStatusCode.LLM_LINK_FAILED]


def test_slow_handshake_is_timeout(prompt, decoder):
    p = prompt(0, env={"PD_SIM_FAULT_LINK_DELAY_MS": "60000"})
    d = decoder()
    ret, rets = d.link_clusters([p.info()], 300)
    assert rets == [LLMStatusCode.LLM_TIMEOUT]
    # bounded by the link timeout, not the peer: the peer has not even answered the handshake
    assert p.cmd(op="incoming")["incoming"] == []


def test_refused_links_then_recovered(prompt, decoder):
    p = prompt(0, env={"PD_SIM_FAULT_REFUSE_LINKS": "1"})
    d = decoder()
    assert d.link_clusters([p.info()], 1000)[1] == [LLMStatusCode.LLM_LINK_FAILED]
    p.cmd(op="faults", set={"refuse_links": False})
    assert d.link_clusters([p.info()], 1000)[1] == [LLMStatusCode.LLM_SUCCESS]
    p.cmd(op="faults", set={"refuse_links": True})  # drops the established link too
    time.sleep(0.1)
    with pytest.raises(LLMException) as ei:
        d.check_link_status(0)
    assert ei.value.status_code is LLMStatusCode.LLM_LINK_FAILED


def test_slow_pull_is_wait_process_timeout(prompt, decoder):
    p = prompt(0, env={"PD_SIM_FAULT_PULL_DELAY_MS": "800"})
    p.cmd(op="alloc", req_ids=[1], desc=DESC)
    d = decoder(sync_kv_timeout=200)
    d.link_clusters([p.info()], 2000)
    with pytest.raises(LLMException) as ei:
        d.kv_cache_manager.pull_cache(CacheKey(0, 1), d.kv_cache_manager.allocate_cache(desc()), 0)
    assert ei.value.status_code is LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT
    # the link is now unusable until relinked
    with pytest.raises(LLMException) as ei:
        d.check_link_status(0)
    assert ei.value.status_code is LLMStatusCode.LLM_LINK_FAILED


def test_failed_pull(prompt, decoder):
    p = prompt(0, env={"PD_SIM_FAULT_PULL_FAIL": "1"})
    p.cmd(op="alloc", req_ids=[1], desc=DESC)
    d = decoder()
    d.link_clusters([p.info()], 2000)
    with pytest.raises(LLMException) as ei:
        d.kv_cache_manager.pull_cache(CacheKey(0, 1), d.kv_cache_manager.allocate_cache(desc()), 0)
    assert ei.value.status_code is LLMStatusCode.LLM_FAILED


def test_switch_with_links_then_unlink(prompt, decoder):
    p = prompt(0)
    d = decoder(enable_switch_role=True)
    d.link_clusters([p.info()], 2000)
    with pytest.raises(LLMException) as ei:
        d.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": f"127.0.0.1:{free_port()}"})
    assert ei.value.status_code is LLMStatusCode.LLM_EXIST_LINK
    ret, rets = d.unlink_clusters([p.info()], 2000)
    assert ret is LLMStatusCode.LLM_SUCCESS
    assert p.cmd(op="incoming")["incoming"] == []
    assert d.unlink_clusters([p.info()], 2000)[1] == [LLMStatusCode.LLM_NOT_YET_LINK]
    port = free_port()
    d.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": f"127.0.0.1:{port}"})
    assert d.role is LLMRole.PROMPT
    with socket.create_connection(("127.0.0.1", port), timeout=1):
        pass  # it listens now
    assert d.link_clusters([p.info()], 1000)[0] is LLMStatusCode.LLM_PARAM_INVALID  # prompts never dial


def test_concurrent_link_waiter_gets_processing_link(prompt, decoder):
    import threading
    slow = prompt(0, env={"PD_SIM_FAULT_LINK_DELAY_MS": "1500"})
    other = prompt(1)
    d = decoder()
    t = threading.Thread(target=d.link_clusters, args=([slow.info()], 3000))
    t.start()
    time.sleep(0.2)  # the first call holds the link mutex while the handshake waits
    ret, rets = d.link_clusters([other.info()], 300)
    t.join()
    assert ret is LLMStatusCode.LLM_PROCESSING_LINK and rets == [LLMStatusCode.LLM_PROCESSING_LINK]
    assert d.link_clusters([other.info()], 2000)[0] is LLMStatusCode.LLM_SUCCESS  # retry later works


def test_check_link_status_during_pull_is_link_busy(prompt, decoder):
    import threading
    p = prompt(0, env={"PD_SIM_FAULT_PULL_DELAY_MS": "800"})
    p.cmd(op="alloc", req_ids=[1], desc=DESC)
    d = decoder(sync_kv_timeout=5000)
    d.link_clusters([p.info()], 2000)
    kv = d.kv_cache_manager
    cache = kv.allocate_cache(desc())
    t = threading.Thread(target=kv.pull_cache, args=(CacheKey(0, 1), cache, 0))
    t.start()
    time.sleep(0.2)
    with pytest.raises(LLMException) as ei:
        d.check_link_status(0)
    t.join()
    assert ei.value.status_code is LLMStatusCode.LLM_LINK_BUSY
    d.check_link_status(0)  # usable again after the pull


def test_unlink_returns_once_the_prompt_side_let_go(prompt, decoder):
    """A prompt side slow to tear down (a busy host) still counts the link until it does: the
    decoder's unlink waits for it, so a switch_role there right after finds no link
    (LLM_EXIST_LINK was the result when unlink returned first). Past the timeout, the decoder
    says so (LLM_UNLINK_FAILED) instead of claiming both ends are gone."""
    p = prompt(0, env={"PD_SIM_FAULT_UNLINK_DELAY_MS": "300"})
    d = decoder()
    assert d.link_clusters([p.info()], 2000)[0] is LLMStatusCode.LLM_SUCCESS
    assert p.cmd(op="incoming")["incoming"] == [1000]
    assert d.unlink_clusters([p.info()], 2000)[0] is LLMStatusCode.LLM_SUCCESS
    assert p.cmd(op="incoming")["incoming"] == []
    p.cmd(op="faults", set={"unlink_delay_ms": 1500})
    assert d.link_clusters([p.info()], 2000)[0] is LLMStatusCode.LLM_SUCCESS
    assert d.unlink_clusters([p.info()], 500)[0] is LLMStatusCode.LLM_UNLINK_FAILED
    assert d.unlink_clusters([p.info()], 500)[1] == [LLMStatusCode.LLM_NOT_YET_LINK]   # the local end is gone
