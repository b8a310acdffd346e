"""What the operator puts on a vLLM(-Ascend) engine container so it runs under pd-operator: the
`--kv-transfer-config` that loads pd_engine's KV connector, and the environment for its NPUs and
collective communication. Pure: no I/O, no vllm import."""
from __future__ import annotations

import json
from collections.abc import Sequence

from .engine_env import PD_RANKS_EXTERNAL

CONNECTOR = "PDOperatorConnector"
CONNECTOR_MODULE = "pd_engine.vllm_connector"


def kv_transfer_config(tensor_parallel: int = 1, extra: dict | None = None) -> dict:
    """kv_role `kv_both`: every engine can prefill and decode (the operator switches roles live);
    each request's kv_transfer_params say which it is."""
    return {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_both",
            "kv_connector_extra_config": {"tensor_parallel": tensor_parallel, **(extra or {})}}


def render_vllm_args(*, tensor_parallel: int, host_ip: str, devices: Sequence[int] | None = None,
                     socket_ifname: str = "eth0", extra: dict | None = None) -> tuple[list[str], dict[str, str]]:
    """(vllm serve arguments, environment) for one engine pod of `tensor_parallel` ranks.
    devices: the NPUs' process-visible ids, one per rank (default 0..TP-1); host_ip: the pod's
    address for HCCL (HCCL_IF_IP); socket_ifname: its network interface for Gloo, TP and HCCL
    sockets. The pod's agent then waits for vLLM's workers to register (PD_RANKS_EXTERNAL=1)."""
    if tensor_parallel < 1:
        raise ValueError(f"tensor_parallel must be at least 1, got {tensor_parallel}")
    devs = list(range(tensor_parallel)) if devices is None else [int(d) for d in devices]
    if len(devs) != tensor_parallel:
        raise ValueError(f"{len(devs)} devices for tensor parallel {tensor_parallel}: one device per rank")
    if any(d < 0 for d in devs) or len(set(devs)) != len(devs):
        raise ValueError(f"devices must be distinct non-negative ids, got {devs}")
    if not host_ip:
        raise ValueError("host_ip is required (HCCL_IF_IP)")
    if not socket_ifname or any(c in socket_ifname for c in ", "):
        raise ValueError(f"socket_ifname must be one interface name, got {socket_ifname!r}")
    cfg = json.dumps(kv_transfer_config(tensor_parallel, extra), separators=(",", ":"), sort_keys=True)
    args = ["--tensor-parallel-size", str(tensor_parallel), "--kv-transfer-config", cfg]
    env = {"ASCEND_RT_VISIBLE_DEVICES": ",".join(map(str, devs)), "HCCL_IF_IP": host_ip,
           "GLOO_SOCKET_IFNAME": socket_ifname, "TP_SOCKET_IFNAME": socket_ifname,
           "HCCL_SOCKET_IFNAME": socket_ifname, PD_RANKS_EXTERNAL: "1"}
    return args, env
