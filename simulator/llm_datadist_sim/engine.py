"""LLMDataDist and KvCacheManager with a real data path.

A PROMPT engine listens on ``llm.listenIpInfo``; a DECODER's link is a TCP connection it
opens, with a handshake carrying both cluster ids, bounded by the link timeout. Pulls move
the prompt cache's actual bytes over that connection. Failures return the codes the real
library returns. Cache memory may be scaled down (``PD_SIM_MEMORY_SCALE``) so large
CacheDescs fit on a CPU machine; accounting always uses the logical (unscaled) sizes."""
from __future__ import annotations

import ctypes
import itertools
import logging
import math
import os
import socket
import threading
import time
import uuid
from typing import Iterable

from pd_contract.engine_env import PD_SIM_MEMORY_SCALE

from . import faults as _faults
from .status import LLMException, raise_if
from .status import LLMStatusCode as C
from .types import BlocksCacheKey, CacheDesc, CacheKey, LLMClusterInfo, LLMRole
from .wire import MAGIC, LinkClosed, recv_exact_into, recv_header, send_msg

MAX_CLUSTERS_PER_CALL = 16
log = logging.getLogger("llm_datadist_sim")
# The prompt side's listener (simulator settings, read when it starts listening):
# PD_SIM_MAX_CONNECTIONS: decoder links (and connections yet to say hello) served at once; more
#   are refused, so a flood of connections cannot take a thread each.
# PD_SIM_HANDSHAKE_TIMEOUT_S: a new connection must send its hello within this.
# PD_SIM_IO_TIMEOUT_S: a message, once started, must arrive within this; and a decoder must take
#   each MiB of a pull within it (a whole KV cache may take longer). A link may idle between
#   messages for as long as it likes: the decoder's link is long-lived.
MAX_CONNECTIONS = 1024
HANDSHAKE_TIMEOUT_S = 10.0
IO_TIMEOUT_S = 60.0
ACCEPT_BACKOFF_MAX_S = 1.0
_engine_lock = threading.Lock()
_active_engine: "LLMDataDist | None" = None
_cache_ids = itertools.count(1)


def memory_scale() -> int:
    return max(1, int(os.environ.get(PD_SIM_MEMORY_SCALE, "1")))


def device_memory_bytes() -> int:
    return int(float(os.environ.get("PD_SIM_DEVICE_MEMORY_GB", "64")) * (1 << 30))


def _setting(name: str, default: float) -> float:
    try:
        v = float(os.environ.get(name) or default)
    except ValueError:
        log.warning("%s=%r is not a number; using %s", name, os.environ.get(name), default)
        return default
    return v if v > 0 else default


def _keepalive(sock: socket.socket) -> None:
    """A peer whose host vanished (no FIN, no RST) is found out in about two minutes, not hours."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, v in (("TCP_KEEPIDLE", 60), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 6)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), v)


class Cache:
    """A KV cache: ``num_tensors`` buffers, each holding ``slots`` rows along dim 0 (batch
    entries, or blocks for a blocks cache)."""

    def __init__(self, desc: CacheDesc, scale: int, is_blocks: bool):
        self.cache_id = next(_cache_ids)
        self.cache_desc = desc
        self.is_blocks = is_blocks
        self.slots = desc.shape[0]
        self.logical_bytes = desc.total_bytes
        logical_slot = desc.tensor_bytes // self.slots
        self.slot_bytes = max(1, math.ceil(logical_slot / scale))
        self.tensors = [bytearray(self.slot_bytes * self.slots) for _ in range(desc.num_tensors)]
        self.tensor_addrs = [(self.cache_id << 32) + i * self.slot_bytes * self.slots
                             for i in range(desc.num_tensors)]
        self.keys: set[tuple[int, int, int]] = set()
        self.blocks_key: BlocksCacheKey | None = None
        self.deallocated = False

    @classmethod
    def at(cls, desc: CacheDesc, addrs: list[int], is_blocks: bool) -> "Cache":
        """A cache over memory the caller owns (`register_cache` / `register_blocks_cache`): each
        tensor is read and written through its address, as the library does with device memory an
        inference framework allocated. Nothing is copied and nothing is allocated here."""
        self = cls.__new__(cls)
        self.cache_id = next(_cache_ids)
        self.cache_desc = desc
        self.is_blocks = is_blocks
        self.slots = desc.shape[0]
        self.logical_bytes = 0          # not the library's memory: nothing to account
        self.slot_bytes = desc.tensor_bytes // self.slots
        size = self.slot_bytes * self.slots
        self.tensors = [memoryview((ctypes.c_ubyte * size).from_address(a)).cast("B") for a in addrs]  # type: ignore[misc]
        self.tensor_addrs = list(addrs)
        self.keys = set()
        self.blocks_key = None
        self.deallocated = False
        self.registered = True
        return self

    registered = False
    users = 0   # pulls reading or writing it now (registered memory is given back only when none is)

    def slot(self, tensor: int, index: int) -> memoryview:
        return memoryview(self.tensors[tensor])[index * self.slot_bytes:(index + 1) * self.slot_bytes]

    def __repr__(self) -> str:
        return f"Cache(cache_id={self.cache_id}, {self.cache_desc})"


class _Link:
    def __init__(self, remote_cluster_id: int, ip: str, port: int, sock: socket.socket):
        self.remote_cluster_id = remote_cluster_id
        self.ip = ip
        self.port = port
        self.sock = sock
        self.lock = threading.Lock()
        self.broken = False
        self.since = time.time()

    def alive(self) -> bool:
        if self.broken:
            return False
        try:
            self.sock.setblocking(False)
            try:
                data = self.sock.recv(1, socket.MSG_PEEK)
            finally:
                self.sock.setblocking(True)
            return data != b""
        except BlockingIOError:
            return True
        except OSError:
            return False

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class _PromptServer:
    """The PROMPT side's listener: accepts decoder links and serves their pulls."""

    def __init__(self, engine: "LLMDataDist", ip: str, port: int):
        self.engine = engine
        self.ip, self.port = ip, port
        self.listener: socket.socket | None = None
        self.conns: dict[int, socket.socket] = {}  # decoder cluster_id -> connection
        self.lock = threading.Lock()
        self.stopped = False
        self.max_conns = int(_setting("PD_SIM_MAX_CONNECTIONS", MAX_CONNECTIONS))
        self.handshake_s = _setting("PD_SIM_HANDSHAKE_TIMEOUT_S", HANDSHAKE_TIMEOUT_S)
        self.io_s = _setting("PD_SIM_IO_TIMEOUT_S", IO_TIMEOUT_S)
        self.open = 0                  # connections being served (each has a thread)
        self._quiet_until = 0.0        # warnings about refused connections: one per few seconds
        self._quiet = 0

    def start(self) -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((self.ip, self.port))
        except OSError as e:
            s.close()
            raise LLMException(f"cannot listen on {self.ip}:{self.port}: {e}", C.LLM_PARAM_INVALID) from e
        s.listen(128)
        self.listener = s
        threading.Thread(target=self._accept_loop, args=(s,), daemon=True,
                         name=f"datadist-accept-{self.port}").start()

    def close_listener(self) -> None:
        s, self.listener = self.listener, None
        if s:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def drop(self, cluster_ids: Iterable[int] | None = None) -> None:
        with self.lock:
            ids = list(self.conns) if cluster_ids is None else [i for i in cluster_ids if i in self.conns]
            socks = [self.conns.pop(i) for i in ids]
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def stop(self) -> None:
        self.stopped = True
        self.close_listener()
        self.drop()

    def _warn(self, msg: str, *args) -> None:
        """At most one warning every few seconds: a flood of refusals must not flood the log too."""
        now = time.monotonic()
        if now < self._quiet_until:
            self._quiet += 1
            return
        if self._quiet:
            msg += f" ({self._quiet} more like it not logged)"
        self._quiet_until, self._quiet = now + 5, 0
        log.warning(msg, *args)

    def _accept_loop(self, listener: socket.socket) -> None:
        backoff = 0.0
        while not self.stopped and self.listener is listener:
            try:
                conn, addr = listener.accept()
            except OSError as e:
                if self.stopped or self.listener is not listener:
                    return   # closed: stop, refuse_links, or a role switch
                # out of file descriptors or memory, for now: keep listening (the backlog waits)
                backoff = min(ACCEPT_BACKOFF_MAX_S, backoff * 2 or 0.01)
                self._warn("prompt cluster %d: accept failed (%s); retrying in %.2fs",
                           self.engine.cluster_id, e, backoff)
                time.sleep(backoff)
                continue
            backoff = 0.0
            with self.lock:
                full = self.open >= self.max_conns
                if not full:
                    self.open += 1
            if full:
                self._warn("prompt cluster %d: refused a connection from %s: %d open (PD_SIM_MAX_CONNECTIONS)",
                           self.engine.cluster_id, addr, self.max_conns)
                self._refuse(conn, "too many connections")
                continue
            try:
                threading.Thread(target=self._serve, args=(conn,), daemon=True,
                                 name=f"datadist-conn-{self.port}").start()
            except RuntimeError as e:   # no thread to be had: this connection goes, the listener stays
                with self.lock:
                    self.open -= 1
                self._warn("prompt cluster %d: no thread for a connection from %s (%s)",
                           self.engine.cluster_id, addr, e)
                self._refuse(conn, "no thread to serve the link")
                time.sleep(ACCEPT_BACKOFF_MAX_S / 10)

    def _refuse(self, conn: socket.socket, why: str) -> None:
        """Close a connection not served, telling a decoder why if it can be told at once."""
        try:
            conn.setblocking(False)
            send_msg(conn, {"ret": C.LLM_LINK_FAILED.name,
                            "message": f"prompt cluster {self.engine.cluster_id} refused the link: {why}"})
        except OSError:
            pass
        finally:
            conn.close()

    def _serve(self, conn: socket.socket) -> None:
        decoder_id = None
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _keepalive(conn)
            hello = recv_header(conn, timeout=self.handshake_s)
            conn.settimeout(self.io_s)
            if hello.get("magic") != MAGIC or hello.get("op") != "hello":
                return
            delay = _faults.current().link_delay_ms
            if delay:
                time.sleep(delay / 1000)
            if hello.get("remote_cluster_id") != self.engine.cluster_id:
                send_msg(conn, {"ret": C.LLM_LINK_FAILED.name,
                                "message": f"this is cluster {self.engine.cluster_id}, "
                                           f"not {hello.get('remote_cluster_id')}"})
                return
            decoder_id = int(hello["cluster_id"])
            with self.lock:
                old = self.conns.pop(decoder_id, None)
                self.conns[decoder_id] = conn
            if old is not None:
                old.close()
            send_msg(conn, {"ret": C.LLM_SUCCESS.name, "cluster_id": self.engine.cluster_id})
            while True:
                req = recv_header(conn, timeout=self.io_s, idle=True)
                conn.settimeout(self.io_s)   # what is sent back: a MiB at a time within it
                op = req.get("op")
                if op == "bye":
                    # let go first, then answer: when the decoder's unlink returns, this end is
                    # torn down too (and a switch_role here finds no link left)
                    delay = _faults.current().unlink_delay_ms
                    if delay:
                        time.sleep(delay / 1000)
                    with self.lock:
                        if self.conns.get(decoder_id) is conn:
                            del self.conns[decoder_id]
                    send_msg(conn, {"ret": C.LLM_SUCCESS.name})
                    return
                if op == "pull":
                    self._serve_pull(conn, req)
                elif op == "pull_blocks":
                    self._serve_pull_blocks(conn, req)
                else:
                    send_msg(conn, {"ret": C.LLM_PARAM_INVALID.name, "message": f"unknown op {op!r}"})
        except (LinkClosed, OSError, ValueError):   # gone, silent too long (socket.timeout), or not JSON
            pass
        except (KeyError, TypeError, OverflowError) as e:   # fields no decoder sends: drop the link
            self._warn("prompt cluster %d: dropped a link that sent a malformed request: %r",
                       self.engine.cluster_id, e)
        finally:
            with self.lock:
                self.open -= 1
                if decoder_id is not None and self.conns.get(decoder_id) is conn:
                    del self.conns[decoder_id]
            try:
                conn.close()
            except OSError:
                pass

    def _pull_faults(self, conn) -> bool:
        f = _faults.current()
        if f.pull_delay_ms:
            time.sleep(f.pull_delay_ms / 1000)
        if f.pull_fail:
            send_msg(conn, {"ret": C.LLM_FAILED.name, "message": "pull failure injected"})
            return True
        return False

    def _serve_pull(self, conn: socket.socket, req: dict) -> None:
        if self._pull_faults(conn):
            return
        ident = (req["req_id"], req["model_id"], req["prefix_id"])
        mgr = self.engine.kv_cache_manager
        with mgr.lock:
            entry = mgr.keyed.get(ident)
        if entry is None:
            send_msg(conn, {"ret": C.LLM_KV_CACHE_NOT_EXIST.name,
                            "message": f"no cache for req_id={ident[0]} model_id={ident[1]} "
                                       f"on prompt cluster {self.engine.cluster_id}"})
            return
        cache, index = entry
        if req["num_tensors"] != cache.cache_desc.num_tensors or req["slot_bytes"] != cache.slot_bytes:
            send_msg(conn, {"ret": C.LLM_PARAM_INVALID.name,
                            "message": f"decoder cache ({req['num_tensors']} tensors x {req['slot_bytes']} B) "
                                       f"does not match prompt cache ({cache.cache_desc.num_tensors} x "
                                       f"{cache.slot_bytes} B)"})
            return
        size = req.get("size", -1)
        n = cache.slot_bytes if size is None or size < 0 else min(size, cache.slot_bytes)
        views = [cache.slot(t, index)[:n] for t in range(cache.cache_desc.num_tensors)]
        n, views = _kv_fault(_faults.current().kv_fault, n, views)
        send_msg(conn, {"ret": C.LLM_SUCCESS.name, "length": n}, views)
        mgr._consume_key(ident)

    def _serve_pull_blocks(self, conn: socket.socket, req: dict) -> None:
        if self._pull_faults(conn):
            return
        mgr = self.engine.kv_cache_manager
        with mgr.lock:
            cache = mgr.blocks.get(req["model_id"])
            if cache is not None:
                cache.users += 1     # registered memory is not given back while it is read
        try:
            self._send_blocks(conn, req, cache)
        finally:
            if cache is not None:
                mgr.done_with(cache)

    def _send_blocks(self, conn: socket.socket, req: dict, cache: "Cache | None") -> None:
        if cache is None:
            send_msg(conn, {"ret": C.LLM_KV_CACHE_NOT_EXIST.name,
                            "message": f"no blocks cache for model_id={req['model_id']} on prompt "
                                       f"cluster {self.engine.cluster_id}"})
            return
        blocks = req["blocks"]
        # at most every block once over: what one request makes this side send stays the cache's size
        if req["num_tensors"] != cache.cache_desc.num_tensors or req["slot_bytes"] != cache.slot_bytes \
                or len(blocks) > cache.slots or any(not 0 <= b < cache.slots for b in blocks):
            send_msg(conn, {"ret": C.LLM_PARAM_INVALID.name,
                            "message": "block indexes or block size do not match the prompt cache"})
            return
        views = [cache.slot(t, b) for t in range(cache.cache_desc.num_tensors) for b in blocks]
        send_msg(conn, {"ret": C.LLM_SUCCESS.name, "length": cache.slot_bytes}, views)


def _kv_fault(fault: str, n: int, views: list[memoryview]) -> tuple[int, list]:
    """A pull served wrong while the link reports success: what the content probe must catch."""
    if fault == "corrupt":
        bad = [bytearray(v) for v in views]
        for b in bad:
            for i in range(0, len(b), 7):
                b[i] ^= 0x5A
        return n, bad
    if fault == "truncate":   # the decoder's buffers keep what they held past the half
        half = n // 2
        return half, [v[:half] for v in views]
    if fault == "swap" and len(views) > 1:
        return n, views[1:] + views[:1]
    return n, views


class KvCacheManager:
    def __init__(self, engine: "LLMDataDist"):
        self.engine = engine
        self.lock = threading.RLock()
        self.idle = threading.Condition(self.lock)   # a cache's pulls ended
        self.caches: dict[int, Cache] = {}
        self.keyed: dict[tuple[int, int, int], tuple[Cache, int]] = {}
        self.blocks: dict[int, Cache] = {}  # model_id -> prompt blocks cache
        self.used_bytes = 0

    # -- helpers --
    def _check(self) -> None:
        self.engine._check_init()

    def _role(self, *roles: LLMRole, what: str) -> None:
        raise_if(self.engine.role not in roles, C.LLM_PARAM_INVALID,
                 f"{what} is not allowed on a {self.engine.role.name} engine")

    @property
    def capacity_bytes(self) -> int:
        """Simulator extra: the memory caches may use (device memory x mem_utilization)."""
        return int(device_memory_bytes() * self.engine.mem_utilization)

    def _reserve(self, desc: CacheDesc) -> None:
        capacity = self.capacity_bytes
        raise_if(self.used_bytes + desc.total_bytes > capacity, C.LLM_DEVICE_OUT_OF_MEMORY,
                 f"cannot allocate {desc.total_bytes} B: {self.used_bytes} of {capacity} B in use")
        self.used_bytes += desc.total_bytes

    def _free(self, cache: Cache) -> None:
        if self.caches.pop(cache.cache_id, None) is not None:
            self.used_bytes -= cache.logical_bytes
        if cache.registered:
            cache.tensors = []   # the caller's memory: never touched after it is given back

    def _consume_key(self, ident) -> None:
        with self.lock:
            entry = self.keyed.pop(ident, None)
            if entry:
                cache = entry[0]
                cache.keys.discard(ident)
                if cache.deallocated and not cache.keys:
                    self._free(cache)

    # -- public API --
    def allocate_cache(self, cache_desc: CacheDesc, cache_keys: Iterable[CacheKey] = ()) -> Cache:
        self._check()
        keys = list(cache_keys or ())
        raise_if(not isinstance(cache_desc, CacheDesc), C.LLM_PARAM_INVALID, "cache_desc must be a CacheDesc")
        if keys:
            self._role(LLMRole.PROMPT, what="allocate_cache with cache_keys")
            raise_if(len(keys) > cache_desc.shape[0], C.LLM_PARAM_INVALID,
                     f"{len(keys)} cache_keys for a batch of {cache_desc.shape[0]}")
            for k in keys:
                raise_if(not isinstance(k, CacheKey), C.LLM_PARAM_INVALID, "cache_keys must be CacheKey")
                raise_if(k.prompt_cluster_id != self.engine.cluster_id, C.LLM_PARAM_INVALID,
                         f"{k} does not name this prompt cluster ({self.engine.cluster_id})")
        with self.lock:
            for k in keys:
                raise_if(k.ident() in self.keyed, C.LLM_REPEAT_REQUEST, f"{k} is already allocated")
            self._reserve(cache_desc)
            cache = Cache(cache_desc, memory_scale(), is_blocks=False)
            self.caches[cache.cache_id] = cache
            for i, k in enumerate(keys):
                self.keyed[k.ident()] = (cache, i)
                cache.keys.add(k.ident())
        return cache

    def allocate_blocks_cache(self, cache_desc: CacheDesc,
                              blocks_cache_key: BlocksCacheKey | None = None) -> Cache:
        self._check()
        raise_if(not isinstance(cache_desc, CacheDesc), C.LLM_PARAM_INVALID, "cache_desc must be a CacheDesc")

        def make() -> Cache:
            self._reserve(cache_desc)
            return Cache(cache_desc, memory_scale(), is_blocks=True)
        return self._add_blocks_cache(make, blocks_cache_key, "allocate_blocks_cache")

    def _add_blocks_cache(self, make, blocks_cache_key: BlocksCacheKey | None, what: str) -> Cache:
        with self.lock:
            if blocks_cache_key is not None:
                self._role(LLMRole.PROMPT, what=f"{what} with a blocks_cache_key")
                raise_if(blocks_cache_key.prompt_cluster_id != self.engine.cluster_id, C.LLM_PARAM_INVALID,
                         f"{blocks_cache_key} does not name this prompt cluster")
                raise_if(blocks_cache_key.model_id in self.blocks, C.LLM_REPEAT_REQUEST,
                         f"a blocks cache for model_id={blocks_cache_key.model_id} exists")
            cache = make()
            self.caches[cache.cache_id] = cache
            if blocks_cache_key is not None:
                cache.blocks_key = blocks_cache_key
                self.blocks[blocks_cache_key.model_id] = cache
        return cache

    def _check_addrs(self, cache_desc: CacheDesc, addrs: list[int]) -> list[int]:
        raise_if(not isinstance(cache_desc, CacheDesc), C.LLM_PARAM_INVALID, "cache_desc must be a CacheDesc")
        addrs = list(addrs or ())
        raise_if(len(addrs) != cache_desc.num_tensors, C.LLM_PARAM_INVALID,
                 f"{len(addrs)} addresses for a CacheDesc of {cache_desc.num_tensors} tensors")
        raise_if(any(not isinstance(a, int) or a <= 0 for a in addrs), C.LLM_PARAM_INVALID,
                 "addrs must be the tensors' addresses (positive ints)")
        return addrs

    # Registration by address has the signatures of CANN's CacheManager (llm_datadist v2,
    # `llm.EnableCacheManager=1`): `register_cache`, `register_blocks_cache`, `unregister_cache`. The
    # simulator offers them on its one manager; `remote_accessible` is accepted and has no effect.
    def register_cache(self, cache_desc: CacheDesc, addrs: list[int],
                       cache_keys: Iterable[CacheKey] = (), remote_accessible: bool | None = None) -> Cache:
        """Memory the caller allocated (one address per tensor, each `cache_desc.shape` contiguous)
        as a cache: pulls read and write it in place. The caller keeps it alive until
        `unregister_cache`."""
        self._check()
        addrs = self._check_addrs(cache_desc, addrs)
        keys = list(cache_keys or ())
        if keys:
            self._role(LLMRole.PROMPT, what="register_cache with cache_keys")
            raise_if(len(keys) > cache_desc.shape[0], C.LLM_PARAM_INVALID,
                     f"{len(keys)} cache_keys for a batch of {cache_desc.shape[0]}")
        with self.lock:
            for k in keys:
                raise_if(k.ident() in self.keyed, C.LLM_REPEAT_REQUEST, f"{k} is already allocated")
            cache = Cache.at(cache_desc, addrs, is_blocks=False)
            self.caches[cache.cache_id] = cache
            for i, k in enumerate(keys):
                self.keyed[k.ident()] = (cache, i)
                cache.keys.add(k.ident())
        return cache

    def register_blocks_cache(self, cache_desc: CacheDesc, addrs: list[int],
                              blocks_cache_key: BlocksCacheKey | None = None,
                              remote_accessible: bool | None = None) -> Cache:
        """A blocks cache over memory the caller allocated (an inference framework's paged KV
        cache): one address per tensor, each holding `shape[0]` blocks back to back. On a PROMPT
        engine with a key, decoders' `pull_blocks` read these blocks as they are at the pull; on a
        DECODER, `pull_blocks` writes into them."""
        self._check()
        addrs = self._check_addrs(cache_desc, addrs)
        return self._add_blocks_cache(lambda: Cache.at(cache_desc, addrs, is_blocks=True), blocks_cache_key,
                                      "register_blocks_cache")

    def done_with(self, cache: Cache) -> None:
        with self.lock:
            cache.users -= 1
            self.idle.notify_all()

    def unregister_cache(self, cache_id: int) -> None:
        """Give registered memory back: nothing reads or writes it after this returns (pulls of it
        under way end first; no new one starts)."""
        self._check()
        with self.lock:
            cache = self.caches.get(cache_id)
            raise_if(cache is None or not cache.registered, C.LLM_PARAM_INVALID,
                     f"no registered cache {cache_id}")
            assert cache is not None
            cache.deallocated = True
            if cache.blocks_key is not None:
                self.blocks.pop(cache.blocks_key.model_id, None)
            while cache.users:
                self.idle.wait(timeout=1.0)
            for ident in list(cache.keys):
                self.keyed.pop(ident, None)
            cache.keys.clear()
            self._free(cache)

    def deallocate_cache(self, cache: Cache) -> None:
        self._check()
        with self.lock:
            cache.deallocated = True
            if cache.blocks_key is not None:
                self.blocks.pop(cache.blocks_key.model_id, None)
            if not cache.keys:
                self._free(cache)

    def remove_cache_key(self, cache_key: CacheKey) -> None:
        self._check()
        self._role(LLMRole.PROMPT, what="remove_cache_key")
        self._consume_key(cache_key.ident())

    def _link_for(self, prompt_cluster_id: int) -> _Link:
        link = self.engine._links.get(prompt_cluster_id)
        if link is None:
            raise LLMException(f"not linked to prompt cluster {prompt_cluster_id}", C.LLM_NOT_YET_LINK)
        raise_if(link.broken, C.LLM_LINK_FAILED, f"the link to {prompt_cluster_id} is broken; relink")
        return link

    def _exchange(self, link: _Link, header: dict, targets: list[memoryview]) -> None:
        timeout = self.engine.sync_kv_timeout_ms / 1000
        with link.lock:
            try:
                link.sock.settimeout(timeout)
                send_msg(link.sock, header)
                reply = recv_header(link.sock)
                ret = reply.get("ret")
                code = C[ret] if isinstance(ret, str) and ret in C.__members__ else None
                if code is not None and code is not C.LLM_SUCCESS:
                    raise LLMException(str(reply.get("message", code.name)), code)
                n = reply.get("length")
                # the peer's length sizes nothing here: it must fit the caller's buffers
                if code is None or not isinstance(n, int) or not 0 <= n <= min(len(v) for v in targets):
                    link.broken = True   # the stream cannot be trusted to be in step any more
                    raise LLMException(f"prompt cluster {link.remote_cluster_id} answered what no datadist "
                                       f"peer would: {str(reply)[:200]}", C.LLM_LINK_FAILED)
                for view in targets:
                    recv_exact_into(link.sock, view[:n])
            except socket.timeout as e:
                link.broken = True  # a late reply would desynchronise the stream
                raise LLMException(f"no reply from prompt cluster {link.remote_cluster_id} within "
                                   f"{self.engine.sync_kv_timeout_ms} ms", C.LLM_WAIT_PROCESS_TIMEOUT) from e
            except (LinkClosed, OSError) as e:
                link.broken = True
                raise LLMException(f"link to prompt cluster {link.remote_cluster_id} failed: {e}",
                                   C.LLM_WAIT_PROCESS_TIMEOUT) from e
            except ValueError as e:   # a header that is not one: no datadist peer sent it
                link.broken = True
                raise LLMException(f"prompt cluster {link.remote_cluster_id} answered what no datadist peer "
                                   f"would: {e}", C.LLM_LINK_FAILED) from e
            finally:
                try:
                    link.sock.settimeout(None)
                except OSError:
                    pass

    def pull_cache(self, cache_key: CacheKey, kv_cache: Cache, batch_index: int = 0, size: int = -1) -> None:
        self._check()
        self._role(LLMRole.DECODER, what="pull_cache")
        raise_if(not isinstance(cache_key, CacheKey), C.LLM_PARAM_INVALID, "cache_key must be a CacheKey")
        raise_if(not isinstance(kv_cache, Cache) or kv_cache.deallocated, C.LLM_PARAM_INVALID,
                 "kv_cache must be an allocated Cache")
        raise_if(not 0 <= batch_index < kv_cache.slots, C.LLM_PARAM_INVALID,
                 f"batch_index {batch_index} out of range [0, {kv_cache.slots})")
        link = self._link_for(cache_key.prompt_cluster_id)
        header = {"op": "pull", "req_id": cache_key.req_id, "model_id": cache_key.model_id,
                  "prefix_id": cache_key.prefix_id, "num_tensors": kv_cache.cache_desc.num_tensors,
                  "slot_bytes": kv_cache.slot_bytes, "size": size}
        targets = [kv_cache.slot(t, batch_index) for t in range(kv_cache.cache_desc.num_tensors)]
        self._exchange(link, header, targets)

    def pull_blocks(self, prompt_cache_key: BlocksCacheKey, decoder_kv_cache: Cache,
                    prompt_blocks: list[int], decoder_blocks: list[int]) -> None:
        self._check()
        self._role(LLMRole.DECODER, what="pull_blocks")
        raise_if(not isinstance(prompt_cache_key, BlocksCacheKey), C.LLM_PARAM_INVALID,
                 "prompt_cache_key must be a BlocksCacheKey")
        raise_if(not isinstance(decoder_kv_cache, Cache) or decoder_kv_cache.deallocated, C.LLM_PARAM_INVALID,
                 "decoder_kv_cache must be an allocated or registered Cache")
        raise_if(not prompt_blocks or not decoder_blocks or len(prompt_blocks) != len(decoder_blocks),
                 C.LLM_PARAM_INVALID, "prompt_blocks and decoder_blocks must be non-empty and of equal length")
        raise_if(any(not 0 <= b < decoder_kv_cache.slots for b in decoder_blocks), C.LLM_PARAM_INVALID,
                 f"decoder block index out of range [0, {decoder_kv_cache.slots})")
        link = self._link_for(prompt_cache_key.prompt_cluster_id)
        header = {"op": "pull_blocks", "model_id": prompt_cache_key.model_id, "blocks": list(prompt_blocks),
                  "num_tensors": decoder_kv_cache.cache_desc.num_tensors,
                  "slot_bytes": decoder_kv_cache.slot_bytes}
        with self.lock:
            raise_if(decoder_kv_cache.deallocated, C.LLM_PARAM_INVALID, "decoder_kv_cache was given back")
            decoder_kv_cache.users += 1
        try:
            targets = [decoder_kv_cache.slot(t, b) for t in range(decoder_kv_cache.cache_desc.num_tensors)
                       for b in decoder_blocks]
            self._exchange(link, header, targets)
        finally:
            self.done_with(decoder_kv_cache)

    def copy_cache(self, dst: Cache, src: Cache, dst_batch_index: int = 0, src_batch_index: int = 0,
                   offset: int = 0, size: int = -1) -> None:
        self._check()
        raise_if(dst.cache_desc.num_tensors != src.cache_desc.num_tensors or dst.slot_bytes != src.slot_bytes,
                 C.LLM_PARAM_INVALID, "src and dst caches differ in shape")
        n = src.slot_bytes - offset if size < 0 else size
        for t in range(src.cache_desc.num_tensors):
            dst.slot(t, dst_batch_index)[offset:offset + n] = src.slot(t, src_batch_index)[offset:offset + n]

    def swap_blocks(self, src: Cache, dst: Cache, src_to_dst: dict[int, int]) -> None:
        self._check()
        for s, d in src_to_dst.items():
            for t in range(src.cache_desc.num_tensors):
                dst.slot(t, d)[:] = src.slot(t, s)


class LLMDataDist:
    def __init__(self, role: LLMRole, cluster_id: int):
        if not isinstance(role, LLMRole):
            raise LLMException(f"role must be an LLMRole, got {role!r}", C.LLM_PARAM_INVALID)
        if not isinstance(cluster_id, int) or not 0 <= cluster_id < 2 ** 64:
            raise LLMException(f"cluster_id must be a uint64, got {cluster_id!r}", C.LLM_PARAM_INVALID)
        self.role = role
        self.cluster_id = cluster_id
        self._initialized = False
        self._options: dict[str, str] = {}
        self._server: _PromptServer | None = None
        self._links: dict[int, _Link] = {}
        self._link_mutex = threading.Lock()
        self._kv = KvCacheManager(self)
        self.sync_kv_timeout_ms = 1000
        self.mem_utilization = 0.95
        self.enable_switch_role = False
        self.boot_id = uuid.uuid4().hex

    # -- lifecycle --
    def _check_init(self) -> None:
        if not self._initialized:
            raise RuntimeError("llm datadist is not initialized")

    def init(self, options: dict[str, str]) -> None:
        global _active_engine
        if self._initialized:
            return
        with _engine_lock:
            if _active_engine is not None and _active_engine is not self:
                raise LLMException("Cannot init multiple LLM engines", C.LLM_FAILED)
            if self.role is LLMRole.MIX:
                raise LLMException("the simulator supports PROMPT and DECODER engines", C.LLM_PARAM_INVALID)
            opts = {str(k): str(v) for k, v in (options or {}).items()}
            self.sync_kv_timeout_ms = int(opts.get("llm.SyncKvCacheWaitTime", "1000"))
            self.mem_utilization = float(opts.get("llm.MemoryUtilization", "0.95"))
            self.enable_switch_role = opts.get("llm.EnableSwitchRole") == "1"
            if self.role is LLMRole.PROMPT:
                self._listen(opts.get("llm.listenIpInfo"))
            self._options = opts
            self._initialized = True
            _active_engine = self
            _faults.subscribe(self._on_faults)

    def _listen(self, listen: str | None) -> None:
        if not listen or ":" not in listen:
            raise LLMException("a PROMPT engine needs llm.listenIpInfo as 'ip:port'", C.LLM_PARAM_INVALID)
        ip, port = listen.rsplit(":", 1)
        self._server = _PromptServer(self, ip, int(port))
        if not _faults.current().refuse_links:
            self._server.start()

    def _on_faults(self, f: _faults.Faults) -> None:
        srv = self._server
        if srv is None:
            return
        if f.refuse_links:
            srv.close_listener()
            srv.drop()
        elif srv.listener is None and not srv.stopped:
            srv.start()

    def finalize(self) -> None:
        global _active_engine
        if not self._initialized:
            return
        for link in list(self._links.values()):
            link.close()
        self._links.clear()
        if self._server:
            self._server.stop()
            self._server = None
        _faults.unsubscribe(self._on_faults)
        with _engine_lock:
            if _active_engine is self:
                _active_engine = None
        self._initialized = False

    @property
    def kv_cache_manager(self) -> KvCacheManager:
        self._check_init()
        return self._kv

    # -- links --
    def link_clusters(self, clusters: list[LLMClusterInfo], timeout: int = 3000):
        self._check_init()
        clusters = list(clusters or [])
        n = len(clusters)
        if self.role is not LLMRole.DECODER or not isinstance(timeout, int) or timeout <= 0 or n == 0:
            return C.LLM_PARAM_INVALID, [C.LLM_PARAM_INVALID] * n
        if n > MAX_CLUSTERS_PER_CALL:
            return C.LLM_CLUSTER_NUM_EXCEED_LIMIT, [C.LLM_CLUSTER_NUM_EXCEED_LIMIT] * n
        deadline = time.monotonic() + timeout / 1000
        if not self._link_mutex.acquire(timeout=timeout / 1000):
            return C.LLM_PROCESSING_LINK, [C.LLM_PROCESSING_LINK] * n
        try:
            rets = [self._link_one(c, deadline) for c in clusters]
        finally:
            self._link_mutex.release()
        return _overall(rets), rets

    def _link_one(self, info: LLMClusterInfo, deadline: float) -> C:
        if not isinstance(info, LLMClusterInfo) or not info.remote_ip_info:
            return C.LLM_PARAM_INVALID
        rid = info.remote_cluster_id
        if rid in self._links:
            return C.LLM_ALREADY_LINK
        remote = info.remote_ip_info[0]
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return C.LLM_TIMEOUT
        src = (info.local_ip_info[0].ip, 0) if info.local_ip_info else None
        try:
            sock = socket.create_connection((remote.ip, remote.port), timeout=remaining,
                                            source_address=src)
        except socket.timeout:
            return C.LLM_TIMEOUT
        except (OSError, ValueError, OverflowError):   # ValueError/OverflowError: not an address or port
            return C.LLM_LINK_FAILED
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _keepalive(sock)
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            send_msg(sock, {"magic": MAGIC, "op": "hello", "cluster_id": self.cluster_id,
                            "remote_cluster_id": rid})
            reply = recv_header(sock)
            code = C[reply.get("ret", "LLM_LINK_FAILED")]
            if code is not C.LLM_SUCCESS:
                sock.close()
                return code
            sock.settimeout(None)
        except socket.timeout:
            sock.close()
            return C.LLM_TIMEOUT
        except (OSError, LinkClosed, ValueError, KeyError, TypeError):
            sock.close()
            return C.LLM_LINK_FAILED
        self._links[rid] = _Link(rid, remote.ip, remote.port, sock)
        return C.LLM_SUCCESS

    def unlink_clusters(self, clusters: list[LLMClusterInfo], timeout: int = 3000, force: bool = False):
        self._check_init()
        clusters = list(clusters or [])
        n = len(clusters)
        if not isinstance(timeout, int) or timeout <= 0 or n == 0:
            return C.LLM_PARAM_INVALID, [C.LLM_PARAM_INVALID] * n
        if n > MAX_CLUSTERS_PER_CALL:
            return C.LLM_CLUSTER_NUM_EXCEED_LIMIT, [C.LLM_CLUSTER_NUM_EXCEED_LIMIT] * n
        if self.role is LLMRole.PROMPT:
            # A prompt engine may only tear down its own end (force), e.g. after a decoder died.
            if not force:
                return C.LLM_PARAM_INVALID, [C.LLM_PARAM_INVALID] * n
            assert self._server is not None
            ids = [c.remote_cluster_id for c in clusters]
            with self._server.lock:
                rets = [C.LLM_SUCCESS if i in self._server.conns else C.LLM_NOT_YET_LINK for i in ids]
            self._server.drop(ids)
            return _overall(rets), rets
        rets = []
        with self._link_mutex:
            for c in clusters:
                link = self._links.pop(c.remote_cluster_id, None)
                if link is None:
                    rets.append(C.LLM_NOT_YET_LINK)
                    continue
                # each link gets the whole timeout: one slow prompt side does not fail the others
                rets.append(C.LLM_SUCCESS if force or link.broken
                            else self._bye(link, time.monotonic() + timeout / 1000))
                link.close()
        return _overall(rets), rets

    @staticmethod
    def _bye(link: "_Link", deadline: float) -> C:
        """Both ends torn down: the prompt side answers once it let go. A prompt side that is
        gone has nothing left to release; one that does not answer in time lets go when it
        reads the close (LLM_UNLINK_FAILED says it may still count the link meanwhile)."""
        if not link.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return C.LLM_UNLINK_FAILED   # a pull holds the link past the timeout
        try:
            link.sock.settimeout(max(0.001, deadline - time.monotonic()))
            send_msg(link.sock, {"op": "bye"})
            recv_header(link.sock)
        except socket.timeout:
            return C.LLM_UNLINK_FAILED
        except (OSError, LinkClosed, ValueError):
            pass
        finally:
            link.lock.release()
        return C.LLM_SUCCESS

    def check_link_status(self, remote_cluster_id: int) -> None:
        self._check_init()
        link = self._links.get(remote_cluster_id)
        if link is None:
            raise LLMException(f"not linked to cluster {remote_cluster_id}", C.LLM_NOT_YET_LINK)
        if not link.lock.acquire(blocking=False):
            raise LLMException(f"link to {remote_cluster_id} is busy", C.LLM_LINK_BUSY)
        try:
            if not link.alive():
                link.broken = True
                raise LLMException(f"link to {remote_cluster_id} is down", C.LLM_LINK_FAILED)
        finally:
            link.lock.release()

    # -- role --
    def switch_role(self, role: LLMRole, switch_options: dict[str, str] | None = None) -> None:
        self._check_init()
        raise_if(not isinstance(role, LLMRole) or role is LLMRole.MIX, C.LLM_PARAM_INVALID,
                 f"cannot switch to {role!r}")
        raise_if(role is self.role, C.LLM_PARAM_INVALID, f"engine is already {role.name}")
        raise_if(not self.enable_switch_role, C.LLM_FEATURE_NOT_ENABLED,
                 "switch_role needs llm.EnableSwitchRole=1 at init")
        raise_if(_faults.current().refuse_switch, C.LLM_FEATURE_NOT_ENABLED,
                 "switch_role refused (simulator fault refuse_switch)")
        incoming = len(self._server.conns) if self._server else 0
        raise_if(bool(self._links) or incoming > 0, C.LLM_EXIST_LINK,
                 f"unlink every cluster first ({len(self._links) + incoming} links open)")
        if role is LLMRole.PROMPT:
            self._listen((switch_options or {}).get("llm.listenIpInfo"))
        else:
            if self._server:
                self._server.stop()
                self._server = None
        self.role = role

    # -- simulator extras (not in the real API) --
    def sim_links(self) -> dict[int, dict]:
        """Decoder: outgoing links; prompt: incoming decoder ids."""
        if self.role is LLMRole.PROMPT and self._server:
            with self._server.lock:
                return {i: {"direction": "in"} for i in self._server.conns}
        return {i: {"direction": "out", "ip": l.ip, "port": l.port, "broken": l.broken}
                for i, l in self._links.items()}


def _overall(rets: list[C]) -> C:
    if all(r is C.LLM_SUCCESS for r in rets):
        return C.LLM_SUCCESS
    failures = {r for r in rets if r is not C.LLM_SUCCESS}
    return failures.pop() if len(failures) == 1 else C.LLM_FAILED
