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


@dataclass
class _Recv:
    request_id: str
    local_blocks: list[int]
    params: dict


@dataclass
class MooncakeStandInMetadata:
    recv: list[_Recv] = field(default_factory=list)
    send: dict[str, list[int]] = field(default_factory=dict)


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
        self.host = self.env.get(PD_LOCAL_POD_IP) or engine_ip(self.env)
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
        channel = self

        class Handler(socketserver.StreamRequestHandler):
            timeout = IO_TIMEOUT_S

            def handle(self) -> None:
                try:
                    while True:
                        line = self.rfile.readline(MAX_LINE)
                        if not line:
                            return
                        channel.answer(json.loads(line), self.wfile)
                except (OSError, ValueError) as e:
                    log.warning("side channel: %r", e)

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self.server = socketserver.ThreadingTCPServer((host, port), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, name="mooncake-side-channel", daemon=True).start()
        log.info("side channel of engine %s on %s:%d", conn.engine_id, host, port)

    def answer(self, msg: dict, out: Any) -> None:
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
