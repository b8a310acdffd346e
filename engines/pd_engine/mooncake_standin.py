"""A stand-in for vllm-ascend's `MooncakeConnectorV1` (vllm_ascend.distributed.kv_transfer.kv_p2p.
mooncake_connector.MooncakeConnector) for pd_engine.vllm_standin: the same `--kv-transfer-config`
(`kv_role` kv_producer or kv_consumer, `kv_port`, `engine_id`, `kv_connector_extra_config` with both
roles' `tp_size` and `dp_size`, asserted as vllm-ascend asserts them) and the same
kv_transfer_params, over real TCP with real bytes, where Mooncake's Ascend transport cannot run.

- A producer's `request_finished` keeps a do_remote_decode request's blocks and returns
  `do_remote_prefill`, `remote_block_ids` (per KV cache group), `remote_engine_id`,
  `remote_request_id`, `remote_host`, `remote_port` (its side channel, kv_port + rank), ... as
  vllm-ascend's does.
- A consumer given those reads the blocks from remote_host:remote_port (a one-request TCP
  exchange here; a handshake then the transfer engine's reads in Mooncake), then tells the producer
  it is done, which frees them (vllm-ascend's DONE_RECVING). A producer frees blocks no consumer
  read after ABORT_S, as vllm-ascend does.
No link is made beforehand: any consumer that has a request's params can read it.

Wire (this stand-in's own, not Mooncake's): a request is a JSON line; `{"op": "read",
"request_id", "engine_id", "blocks"}` answers a JSON line `{"ok", "sizes" | "error"}` then the
blocks' bytes, every tensor in order; `{"op": "done", "request_id"}` answers `{"ok"}`."""
from __future__ import annotations

import json
import logging
import os
import socket
import socketserver
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pd_contract.engine_env import PD_LOCAL_POD_IP, engine_ip

log = logging.getLogger("pd_engine.mooncake_standin")
ABORT_S = 120.0          # a producer frees blocks no consumer read after this
IO_TIMEOUT_S = 30.0
MAX_LINE = 1 << 20


def _parallel(extra: dict, role: str) -> dict:
    conf = extra.get(role, {})
    for key in ("tp_size", "dp_size"):     # vllm-ascend asserts both, for both roles
        if key not in conf:
            raise ValueError(f"kv_connector_extra_config.{role}.{key} is required (vllm-ascend asserts it)")
    return conf


def serve_lines(host: str, port: int, answer: Callable[[dict, Any, Any], None],
                name: str) -> socketserver.ThreadingTCPServer:
    """A side channel: each connection's JSON lines answered by `answer(msg, rfile, wfile)`."""
    class Handler(socketserver.StreamRequestHandler):
        timeout = IO_TIMEOUT_S

        def handle(self) -> None:
            try:
                while True:
                    line = self.rfile.readline(MAX_LINE)
                    if not line:
                        return
                    answer(json.loads(line), self.rfile, self.wfile)
            except (OSError, ValueError) as e:
                log.warning("side channel: %r", e)

    socketserver.ThreadingTCPServer.allow_reuse_address = True
    server = socketserver.ThreadingTCPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name=name, daemon=True).start()
    return server


@dataclass
class _Recv:
    request_id: str
    local_blocks: list[int]
    params: dict


@dataclass
class MooncakeStandInMetadata:
    recv: list[_Recv] = field(default_factory=list)
    send: dict[str, list[int]] = field(default_factory=dict)
    push: dict[str, dict] = field(default_factory=dict)      # layerwise: the decoder's params, and "local"


class MooncakeConnector:
    """One role's connector (scheduler or worker), as vLLM's V1 engine drives it."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None, *,
                 env: dict[str, str] | None = None, agent: Any = None,
                 clock: Callable[[], float] = time.monotonic):
        kt = vllm_config.kv_transfer_config
        self.env = dict(os.environ if env is None else env)
        self.kv_role = kt.kv_role
        if self.kv_role not in ("kv_producer", "kv_consumer"):
            raise ValueError(f"MooncakeConnectorV1's kv_role is kv_producer or kv_consumer, got {self.kv_role!r}")
        self.engine_id = str(kt.engine_id)
        self.kv_port = int(kt.kv_port)
        extra = kt.kv_connector_extra_config or {}
        self.prefill_tp = int(_parallel(extra, "prefill")["tp_size"])
        self.decode_tp = int(_parallel(extra, "decode")["tp_size"])
        if self.prefill_tp < self.decode_tp:
            raise ValueError(f"prefill_tp_size: {self.prefill_tp} must be greater than or equal to the "
                             f"decode_tp_size: {self.decode_tp}")
        # vLLM's get_ip(): VLLM_HOST_IP (the operator sets the pod's), else the host's address
        self.host = self.env.get("VLLM_HOST_IP") or self.env.get(PD_LOCAL_POD_IP) or engine_ip(self.env)
        self.side_channel_port = self.kv_port      # data-parallel rank 0, TP rank 0
        self.role = role
        # scheduler side
        self._need_recv: dict[str, _Recv] = {}
        self._need_send: dict[str, list[int]] = {}
        # worker side
        self.tensors: list[Any] = []
        self.sending: dict[str, tuple[list[int], float]] = {}
        self.done_sending: set[str] = set()
        self.done_recving: set[str] = set()
        self.load_errors: dict[str, str] = {}
        self._failed_blocks: set[int] = set()
        self._meta: MooncakeStandInMetadata | None = None
        self._lock = threading.Lock()
        self.channel: SideChannel | None = None
        self.clock = clock
        self.counts = {"sent": 0, "read": 0, "expired": 0}

    # ---- scheduler side -------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill"):
            count = max(len(request.prompt_token_ids or []) - num_computed_tokens, 0)
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill"):
            if params.get("remote_block_ids") and all(
                    p in params for p in ("remote_engine_id", "remote_host", "remote_port", "remote_request_id")):
                local = list(blocks.get_block_ids()[0]) if num_external_tokens > 0 else []
                self._need_recv[request.request_id] = _Recv(request.request_id, local, dict(params))
            else:
                log.warning("Got invalid KVTransferParams. params=%s", params)
            params["do_remote_prefill"] = False

    def build_connector_meta(self, scheduler_output: Any) -> MooncakeStandInMetadata:
        meta = MooncakeStandInMetadata(recv=list(self._need_recv.values()), send=dict(self._need_send))
        self._need_recv.clear()
        self._need_send.clear()
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_decode") or not block_ids:
            return False, None
        ids = list(block_ids)
        self._need_send[request.request_id] = ids
        return True, {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [ids],
                      "remote_engine_id": self.engine_id, "remote_request_id": request.request_id,
                      "remote_host": self.host, "remote_port": self.side_channel_port, "remote_pcp_size": 1,
                      "remote_dcp_size": 1, "remote_ptp_size": self.prefill_tp,
                      "num_prompt_blocks": len(ids), "remote_block_size": None}

    # ---- worker side ----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.tensors = [t for kv in kv_caches.values() for t in (list(kv) if kv.ndim == 5 else [kv])]
        if self.kv_role == "kv_producer":
            self.channel = SideChannel(self, self.host, self.side_channel_port)

    def bind_connector_metadata(self, meta: MooncakeStandInMetadata) -> None:
        self._meta = meta
        now = self.clock()
        with self._lock:
            for rid, blocks in meta.send.items():
                self.sending[rid] = (blocks, now)
            for rid, (_, at) in list(self.sending.items()):
                if now - at > ABORT_S:
                    log.warning("request %s: no consumer read its blocks in %.0fs; freeing them", rid, ABORT_S)
                    del self.sending[rid]
                    self.done_sending.add(rid)
                    self.counts["expired"] += 1

    def clear_connector_metadata(self) -> None:
        self._meta = None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        for r in (self._meta.recv if self._meta else []):
            try:
                self._read(r)
                self.done_recving.add(r.request_id)
            except (OSError, ValueError, RuntimeError) as e:
                self.load_errors[r.request_id] = f"reading from {r.params.get('remote_host')}:" \
                                                 f"{r.params.get('remote_port')}: {e}"
                self._failed_blocks.update(r.local_blocks)
                self.done_recving.add(r.request_id)

    def _read(self, r: _Recv) -> None:
        p = r.params
        if str(p["remote_engine_id"]) == self.engine_id:
            raise RuntimeError(f"Conflict engine id {p['remote_engine_id']} with local engine id {self.engine_id}")
        remote = [int(b) for b in (p["remote_block_ids"][0] if p["remote_block_ids"]
                                   and isinstance(p["remote_block_ids"][0], list) else p["remote_block_ids"])]
        local = r.local_blocks[:len(remote)]
        if len(local) < len(remote):
            raise RuntimeError(f"{len(remote)} remote blocks for {len(local)} local ones")
        with socket.create_connection((p["remote_host"], int(p["remote_port"])), timeout=IO_TIMEOUT_S) as s:
            f = s.makefile("rwb")
            f.write(json.dumps({"op": "read", "request_id": p["remote_request_id"], "engine_id": self.engine_id,
                                "blocks": remote}).encode() + b"\n")
            f.flush()
            head = json.loads(f.readline(MAX_LINE) or b"{}")
            if not head.get("ok"):
                raise RuntimeError(head.get("error") or "no answer")
            sizes = head["sizes"]
            if len(sizes) != len(self.tensors):
                raise RuntimeError(f"{len(sizes)} tensors from the producer, {len(self.tensors)} here")
            for t, n in zip(self.tensors, sizes):
                data = f.read(n)
                if len(data) != n or n != t[local].nbytes:
                    raise RuntimeError(f"{len(data)} bytes of {n} for a tensor of {t[local].nbytes}")
                raw = t.view("uint8").reshape(t.shape[0], -1)
                raw[local] = np.frombuffer(data, dtype=np.uint8).reshape(len(local), -1)
            f.write(json.dumps({"op": "done", "request_id": p["remote_request_id"]}).encode() + b"\n")
            f.flush()
            f.readline(MAX_LINE)
        self.counts["read"] += 1

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None      # pull-based: the consumer reads the blocks when it has the request

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        with self._lock:
            sent, self.done_sending = self.done_sending, set()
        recved, self.done_recving = self.done_recving, set()
        return sent or None, recved or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._failed_blocks = self._failed_blocks, set()
        return out

    def held(self) -> int:
        with self._lock:
            return len(self.sending)

    def shutdown(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None


class SideChannel:
    """A producer's side channel: consumers read held blocks and say when they are done."""

    def __init__(self, conn: MooncakeConnector, host: str, port: int):
        self.conn = conn
        self.server = serve_lines(host, port, self.answer, "mooncake-side-channel")
        log.info("side channel of engine %s on %s:%d", conn.engine_id, host, port)

    def answer(self, msg: dict, rfile: Any, out: Any) -> None:
        c, rid = self.conn, str(msg.get("request_id", ""))
        if msg.get("op") == "done":
            with c._lock:
                if c.sending.pop(rid, None) is not None:
                    c.done_sending.add(rid)
                    c.counts["sent"] += 1
            out.write(b'{"ok": true}\n')
            return
        with c._lock:
            held = c.sending.get(rid)
        if msg.get("op") != "read" or held is None:
            out.write(json.dumps({"ok": False, "error": f"request {rid} is not held here"}).encode() + b"\n")
            return
        blocks = [int(b) for b in msg.get("blocks") or []]
        if sorted(blocks) != sorted(held[0]):
            out.write(json.dumps({"ok": False, "error": f"blocks {blocks} are not request {rid}'s"}).encode() + b"\n")
            return
        parts = [t[blocks].tobytes() for t in c.tensors]
        out.write(json.dumps({"ok": True, "sizes": [len(p) for p in parts]}).encode() + b"\n")
        for p in parts:
            out.write(p)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# ---- MooncakeLayerwiseConnector: decoder first, the prefill pushes layer by layer -----------------

LOAD_TIMEOUT_S = 30.0     # a decoder waits this long for a prefill's push, then computes the prompt itself


class MooncakeLayerwiseConnector:
    """A stand-in for vllm-ascend's MooncakeLayerwiseConnector. The decoder gets the request first
    (`do_remote_prefill` and a `metaserver` URL): it allocates the prompt's blocks and posts them to
    the metaserver (`do_remote_decode`, `remote_block_ids`, `remote_host`, `remote_port`,
    `request_id`, ...); the router sends that to a prefill, which pushes each layer's blocks into
    the decoder's as it computes them, then says done. The prefill keeps nothing afterwards."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None, *,
                 env: dict[str, str] | None = None, agent: Any = None,
                 clock: Callable[[], float] = time.monotonic):
        kt = vllm_config.kv_transfer_config
        self.env = dict(os.environ if env is None else env)
        self.kv_role, self.engine_id, self.kv_port = kt.kv_role, str(kt.engine_id), int(kt.kv_port)
        if self.kv_role not in ("kv_producer", "kv_consumer"):
            raise ValueError(f"MooncakeLayerwiseConnector's kv_role is kv_producer or kv_consumer, "
                             f"got {self.kv_role!r}")
        # vLLM's get_ip(): VLLM_HOST_IP (the operator sets the pod's), else the host's address
        self.host = self.env.get("VLLM_HOST_IP") or self.env.get(PD_LOCAL_POD_IP) or engine_ip(self.env)
        self.side_channel_port = self.kv_port
        self.block_size = 0
        self._need_recv: dict[str, list[int]] = {}
        self._need_send: dict[str, dict] = {}
        self.layers: list[list[Any]] = []
        self.receiver: PushReceiver | None = None
        self._meta: MooncakeStandInMetadata | None = None
        self._sending: dict[str, tuple[socket.socket, Any]] = {}
        self._failed_push: set[str] = set()
        self.done_recving: set[str] = set()
        self.load_errors: dict[str, str] = {}
        self._failed_blocks: set[int] = set()
        self.counts = {"pushed": 0, "received": 0, "metaserver_failed": 0}

    # ---- scheduler side -------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill"):
            count = max(len(request.prompt_token_ids or []) - num_computed_tokens, 0)
            return count, count > 0
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill"):
            local = list(blocks.get_block_ids()[0]) if num_external_tokens > 0 else []
            params["do_remote_prefill"] = False
            self._need_recv[request.request_id] = local
            message = {"token_ids": [], "request_id": request.request_id, "do_remote_prefill": False,
                       "do_remote_decode": True, "remote_block_ids": [local], "remote_block_size": self.block_size,
                       "remote_engine_id": self.engine_id, "remote_host": self.host,
                       "remote_port": self.side_channel_port, "remote_tp_size": 1, "remote_pcp_size": 1,
                       "remote_dcp_size": 1, "remote_cached_tokens": 0}
            threading.Thread(target=self._metaserver, args=(params.get("metaserver"), message), daemon=True).start()
        if params.get("do_remote_decode") and params.get("remote_block_ids"):
            self._need_send[request.request_id] = {**params, "local": list(blocks.get_block_ids()[0])}

    def _metaserver(self, url: str | None, message: dict) -> None:
        import httpx
        try:
            httpx.post(str(url), json=message, timeout=IO_TIMEOUT_S, trust_env=False).raise_for_status()
        except (httpx.HTTPError, ValueError) as e:
            self.counts["metaserver_failed"] += 1
            log.error("Access metaserver fail. url=%s error=%r", url, e)

    def build_connector_meta(self, scheduler_output: Any) -> MooncakeStandInMetadata:
        meta = MooncakeStandInMetadata(recv=[_Recv(rid, blocks, {}) for rid, blocks in self._need_recv.items()],
                                       push=dict(self._need_send))
        self._need_recv.clear()
        self._need_send.clear()
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        return False, None      # pushed layer by layer: nothing held after the step

    # ---- worker side ----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.layers = [list(kv) if kv.ndim == 5 else [kv] for kv in kv_caches.values()]
        self.block_size = int(next(iter(kv_caches.values())).shape[-3])
        if self.kv_role == "kv_consumer":
            self.receiver = PushReceiver(self, self.host, self.side_channel_port)

    def bind_connector_metadata(self, meta: MooncakeStandInMetadata) -> None:
        self._meta = meta

    def clear_connector_metadata(self) -> None:
        self._meta = None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        for r in (self._meta.recv if self._meta else []):
            if self.receiver is not None and self.receiver.wait(r.request_id, LOAD_TIMEOUT_S):
                self.counts["received"] += 1
            else:
                self.load_errors[r.request_id] = f"no prefill pushed the KV in {LOAD_TIMEOUT_S:.0f}s"
                self._failed_blocks.update(r.local_blocks)
            self.done_recving.add(r.request_id)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """The prefill pushes this layer's blocks of every request it computed to its decoder."""
        index = int(layer_name.split(".")[2]) if layer_name.count(".") >= 2 else 0
        tensors = list(kv_layer) if kv_layer.ndim == 5 else [kv_layer]
        for rid, p in (self._meta.push.items() if self._meta else []):
            if rid in self._failed_push:
                continue
            try:
                if rid not in self._sending:
                    s = socket.create_connection((p["remote_host"], int(p["remote_port"])), timeout=IO_TIMEOUT_S)
                    self._sending[rid] = (s, s.makefile("rwb"))
                remote = [int(b) for b in p["remote_block_ids"][0]]
                local = p["local"][:len(remote)]
                parts = [t[local].tobytes() for t in tensors]
                f = self._sending[rid][1]
                # named by this engine's own request id: the router gave both engines one id
                f.write(json.dumps({"op": "write", "request_id": rid, "layer": index,
                                    "blocks": remote, "sizes": [len(x) for x in parts]}).encode() + b"\n")
                for x in parts:
                    f.write(x)
                f.flush()
                if not json.loads(f.readline(MAX_LINE) or b"{}").get("ok"):
                    raise RuntimeError("the decoder refused the layer")
            except (OSError, ValueError, RuntimeError, KeyError) as e:
                log.error("request %s: pushing layer %d to %s:%s: %r", rid, index, p.get("remote_host"),
                          p.get("remote_port"), e)
                self._failed_push.add(rid)      # no later layer, no done: the decoder computes it itself
                self._close(rid)

    def wait_for_save(self) -> None:
        for rid in (self._meta.push if self._meta else {}):
            if rid in self._failed_push:
                self._failed_push.discard(rid)
                continue
            if rid in self._sending:
                f = self._sending[rid][1]
                try:
                    f.write(json.dumps({"op": "done", "request_id": rid}).encode() + b"\n")
                    f.flush()
                    f.readline(MAX_LINE)
                    self.counts["pushed"] += 1
                except OSError as e:
                    log.error("request %s: done to the decoder: %r", rid, e)
                self._close(rid)

    def _close(self, rid: str) -> None:
        s, f = self._sending.pop(rid, (None, None))
        for x in (f, s):
            if x is not None:
                try:
                    x.close()
                except OSError:
                    pass

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        recved, self.done_recving = self.done_recving, set()
        return None, recved or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._failed_blocks = self._failed_blocks, set()
        return out

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None


class PushReceiver:
    """A decoder's side channel (layerwise): prefills write layers into its blocks, then say done."""

    def __init__(self, conn: MooncakeLayerwiseConnector, host: str, port: int):
        self.conn = conn
        self.lock = threading.Lock()
        self.done: dict[str, threading.Event] = {}
        self.server = serve_lines(host, port, self.answer, "mooncake-layerwise")

    def _event(self, rid: str) -> threading.Event:
        with self.lock:
            while len(self.done) >= 4096:       # dones nobody waited for (their wait timed out)
                self.done.pop(next(iter(self.done)))
            return self.done.setdefault(rid, threading.Event())

    def answer(self, msg: dict, rfile: Any, out: Any) -> None:
        rid = str(msg.get("request_id", ""))
        if msg.get("op") == "done":
            self._event(rid).set()
            out.write(b'{"ok": true}\n')
            return
        layer, blocks, sizes = int(msg["layer"]), [int(b) for b in msg["blocks"]], msg["sizes"]
        tensors = self.conn.layers[layer]
        if len(sizes) != len(tensors):
            out.write(b'{"ok": false}\n')
            return
        for t, n in zip(tensors, sizes):
            data = rfile.read(n)
            raw = t.view(np.uint8).reshape(t.shape[0], -1)
            if len(data) != n or n != raw[blocks].nbytes:
                out.write(b'{"ok": false}\n')
                return
            raw[blocks] = np.frombuffer(data, dtype=np.uint8).reshape(len(blocks), -1)
        out.write(b'{"ok": true}\n')

    def wait(self, rid: str, timeout: float) -> bool:
        ok = self._event(rid).wait(timeout)
        with self.lock:
            self.done.pop(rid, None)
        return ok

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
