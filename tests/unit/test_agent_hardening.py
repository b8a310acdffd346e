"""What the simulator's listener does with peers that misbehave: failures to accept,
connection floods, silent or malformed peers. One engine per process: each test makes its
own and finalizes it."""
from __future__ import annotations

import errno
import json
import socket
import struct
import threading
import time
import tracemalloc

import pytest

from llm_datadist_sim import (
    CacheDesc,
    CacheKey,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
)
from llm_datadist_sim.status import LLMStatusCode as C
from llm_datadist_sim.wire import MAGIC, LinkClosed, recv_header, send_msg
from tests.conftest import DEADLINE_SCALE, wait_for
from tests.procs import spawn

WAIT_S = 10 * DEADLINE_SCALE   # how long a test waits for what must happen (never a performance bound)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the simulator's listener ------------------------------------------------------------------

@pytest.fixture
def prompt_engine(monkeypatch):
    """A prompt engine in this process, with the listener settings given as env."""
    made: list[LLMDataDist] = []

    def make(**settings: str) -> tuple[LLMDataDist, int]:
        for k, v in settings.items():
            monkeypatch.setenv(k, v)
        port = free_port()
        e = LLMDataDist(LLMRole.PROMPT, 0)
        e.init(LLMConfig(listen_ip_info=f"127.0.0.1:{port}").generate_options())
        made.append(e)
        return e, port
    yield make
    for e in made:
        e.finalize()


def hello(port: int, cluster_id: int = 0, me: int = 1000) -> tuple[socket.socket, dict]:
    s = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    send_msg(s, {"magic": MAGIC, "op": "hello", "cluster_id": me, "remote_cluster_id": cluster_id})
    return s, recv_header(s)


def closed_by_peer(s: socket.socket) -> bool:
    """True once the other end closed (what it sent before is read and dropped)."""
    s.settimeout(WAIT_S)
    try:
        while s.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return True


def test_an_accept_failure_does_not_stop_the_listener(prompt_engine, monkeypatch, caplog):
    real = socket.socket.accept
    failed: list[int] = []

    def accept(self):
        if not failed:   # the first accept finds the process out of file descriptors
            failed.append(1)
            raise OSError(errno.EMFILE, "Too many open files")
        return real(self)
    monkeypatch.setattr(socket.socket, "accept", accept)
    caplog.set_level("WARNING", logger="llm_datadist_sim")
    _, port = prompt_engine()
    s, reply = hello(port)
    s.close()
    assert failed and reply["ret"] == "LLM_SUCCESS"
    assert "accept failed" in caplog.text


def test_a_thread_that_cannot_start_costs_one_connection_not_the_listener(prompt_engine, monkeypatch):
    real = threading.Thread.start
    failed: list[int] = []

    def start(self):
        if getattr(getattr(self, "_target", None), "__name__", "") == "_serve" and not failed:
            failed.append(1)
            raise RuntimeError("can't start new thread")
        return real(self)
    monkeypatch.setattr(threading.Thread, "start", start)
    _, port = prompt_engine()
    first = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    assert closed_by_peer(first)
    s, reply = hello(port)
    s.close()
    assert failed and reply["ret"] == "LLM_SUCCESS"


def test_silent_peers_are_dropped_and_idle_links_are_not(prompt_engine):
    e, port = prompt_engine(PD_SIM_HANDSHAKE_TIMEOUT_S="0.2", PD_SIM_IO_TIMEOUT_S="0.2")
    # connects and says nothing
    silent = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    assert closed_by_peer(silent)
    # links, then starts a message and stops half-way
    stalled, reply = hello(port, me=1001)
    assert reply["ret"] == "LLM_SUCCESS"
    stalled.sendall(b"\x00\x00")
    assert closed_by_peer(stalled)
    # links and idles past both timeouts: a link waits for its next pull as long as it likes
    kv = e.kv_cache_manager
    cache = kv.allocate_cache(CacheDesc(1, [1, 16], DataType.DT_FLOAT16), [CacheKey(0, 5)])
    cache.slot(0, 0)[:] = bytes(range(cache.slot_bytes))
    kv.deallocate_cache(cache)
    link, reply = hello(port, me=1002)
    assert reply["ret"] == "LLM_SUCCESS"
    time.sleep(0.6)
    send_msg(link, {"op": "pull", "req_id": 5, "model_id": 0, "prefix_id": 2 ** 64 - 1, "num_tensors": 1,
                    "slot_bytes": cache.slot_bytes, "size": -1})
    got = recv_header(link)
    assert got["ret"] == "LLM_SUCCESS" and got["length"] == cache.slot_bytes
    data = b""
    while len(data) < got["length"]:
        data += link.recv(got["length"] - len(data))
    assert data == bytes(range(cache.slot_bytes))
    link.close()


class PromptPeer:
    """A prompt engine in its own process (the library allows one engine per process)."""

    def __init__(self, env: dict[str, str]):
        import os
        import subprocess
        import sys
        self.port = free_port()
        self.proc = spawn([sys.executable, "-m", "llm_datadist_sim.peer", "0", f"127.0.0.1:{self.port}"],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **env})
        assert self.read()["ready"]

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, "prompt peer died"
        return json.loads(line)

    def cmd(self, **kw) -> dict:
        self.proc.stdin.write(json.dumps(kw) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def decoder():
    made: list[LLMDataDist] = []

    def make() -> LLMDataDist:
        e = LLMDataDist(LLMRole.DECODER, 1000)
        e.init(LLMConfig(sync_kv_timeout=int(WAIT_S * 1000)).generate_options())
        made.append(e)
        return e
    yield make
    for e in made:
        e.finalize()


def info(port: int, ip: str = "127.0.0.1") -> LLMClusterInfo:
    i = LLMClusterInfo()
    i.remote_cluster_id = 0
    i.append_local_ip_info("127.0.0.1", 26000)
    i.append_remote_ip_info(ip, port)
    return i


def test_connections_over_the_bound_are_refused_while_pulls_go_on(decoder):
    desc = {"num_tensors": 2, "shape": [1, 64, 1, 16], "data_type": "DT_FLOAT16"}
    p = PromptPeer({"PD_SIM_MAX_CONNECTIONS": "2", "PD_SIM_HANDSHAKE_TIMEOUT_S": "600"})
    held: list[socket.socket] = []
    try:
        d = decoder()
        assert d.link_clusters([info(p.port)], 5000)[1] == [C.LLM_SUCCESS]          # one
        held.append(socket.create_connection(("127.0.0.1", p.port), timeout=WAIT_S))  # two, silent
        over = socket.create_connection(("127.0.0.1", p.port), timeout=WAIT_S)       # three: refused
        held.append(over)
        reply = recv_header(over)
        assert reply["ret"] == "LLM_LINK_FAILED" and "too many connections" in reply["message"]
        assert closed_by_peer(over)
        # the link already made still serves pulls
        got = p.cmd(op="alloc", req_ids=[7], desc=desc)
        kv = d.kv_cache_manager
        cache = kv.allocate_cache(CacheDesc(desc["num_tensors"], desc["shape"], DataType.DT_FLOAT16))
        kv.pull_cache(CacheKey(0, 7), cache, 0)
        import hashlib
        h = hashlib.sha256()
        for t in range(cache.cache_desc.num_tensors):
            h.update(cache.slot(t, 0))
        assert h.hexdigest() == got["sha256"][0]
        # a connection that goes frees its place
        held.pop(0).close()

        def links() -> bool:
            s, r = hello(p.port, me=1001)
            s.close()
            return r["ret"] == "LLM_SUCCESS"
        wait_for("a place for a new link", links, timeout=10)
    finally:
        for s in held:
            s.close()
        p.close()


def test_a_header_buffer_grows_as_the_header_arrives():
    """A peer's length is a claim: 10 bytes of a declared 1 MiB header cost about 10 bytes."""
    a, b = socket.socketpair()
    b.sendall(struct.pack("!I", 1 << 20) + b"{" * 10)
    b.close()
    tracemalloc.start()
    try:
        with pytest.raises(LinkClosed):
            recv_header(a)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        a.close()
    assert peak < (1 << 20) // 4


class NonsensePrompt:
    """A listener that links like a prompt engine, then answers a pull with `reply`."""

    def __init__(self, reply) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.reply = reply
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            recv_header(conn)
            send_msg(conn, {"ret": "LLM_SUCCESS", "cluster_id": 0})
            recv_header(conn)
            raw = json.dumps(self.reply).encode()
            conn.sendall(struct.pack("!I", len(raw)) + raw)
            try:
                conn.recv(1)   # holds the link open until the decoder lets go
            except OSError:
                pass

    def close(self) -> None:
        self.listener.close()


@pytest.mark.parametrize("reply", [{"ret": "NO_SUCH_CODE"}, {"ret": ["LLM_SUCCESS"]},
                                   {"ret": "LLM_SUCCESS", "length": 1 << 40}, {"ret": "LLM_SUCCESS", "length": "8"},
                                   {"ret": "LLM_SUCCESS"}, ["not", "a", "header"]])
def test_a_prompt_side_that_answers_nonsense_breaks_its_link_only(decoder, reply):
    fake = NonsensePrompt(reply)
    try:
        d = decoder()
        assert d.link_clusters([info(fake.port)], 5000)[1] == [C.LLM_SUCCESS]
        kv = d.kv_cache_manager
        cache = kv.allocate_cache(CacheDesc(1, [1, 8], DataType.DT_FLOAT16))
        with pytest.raises(LLMException) as ei:
            kv.pull_cache(CacheKey(0, 1), cache, 0)
        assert ei.value.status_code is C.LLM_LINK_FAILED
        with pytest.raises(LLMException) as ei:
            d.check_link_status(0)
        assert ei.value.status_code is C.LLM_LINK_FAILED
    finally:
        fake.close()


def test_a_link_to_something_that_is_not_an_address_is_a_failed_link(decoder):
    d = decoder()
    assert d.link_clusters([info(26000, ip="a" * 300)], 2000)[1] == [C.LLM_LINK_FAILED]
    assert d.link_clusters([info(26000, ip="bad\x00ip")], 2000)[1] == [C.LLM_LINK_FAILED]
