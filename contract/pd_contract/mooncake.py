"""vllm-ascend's own P-D connectors, Mooncake (`MooncakeConnectorV1`, and `MooncakeLayerwiseConnector`
which pushes the KV layer by layer, decoder first), as pd-operator runs them: the
`--kv-transfer-config` an engine starts with in a role, and the ports rule of its Ascend transport.
Pure: no I/O, no vllm import. Checked against vllm-ascend's source (tests/unit/test_mooncake.py).

How vllm-ascend reads it (vllm_ascend/distributed/kv_transfer/kv_p2p/mooncake_connector.py):
- `kv_role`: `kv_producer` (the prefill keeps the prompt's blocks for a decoder) or `kv_consumer`
  (the decoder reads them); an engine's role is fixed for its life, so a role change restarts it.
- `kv_port`: the side channel's base; rank r of data-parallel rank d listens on
  kv_port + d x TP x PP + r. A prefill's reply names it (`remote_host`, `remote_port`).
- `engine_id`: unique per engine (a decoder refuses a remote of its own id).
- `kv_connector_extra_config.prefill` / `.decode`: each role's `tp_size` and `dp_size` (both
  required); the decoder maps its heads onto the prefill's TP with them, and the prefill's TP must
  be at least the decoder's.
The transport takes random ports in [20000, 20000 + 1000 x NPUs per node), so a kv_port below that
range's end collides with it intermittently ("Address already in use")."""
from __future__ import annotations

from typing import Literal

Role = Literal["prompt", "decoder"]
KvTransfer = Literal["pd-operator", "mooncake", "mooncake-layerwise"]
Kind = Literal["mooncake", "mooncake-layerwise"]

# the names vllm-ascend registers (register_connector)
CONNECTORS: dict[str, str] = {"mooncake": "MooncakeConnectorV1", "mooncake-layerwise": "MooncakeLayerwiseConnector"}
CONNECTOR = CONNECTORS["mooncake"]
# mooncake-layerwise runs decoder first: the router sends the request to a decoder with this
# metaserver URL; the decoder's connector posts its blocks there, and the router then sends the
# request to a prefill with those kv_transfer_params (the prefill pushes the KV layer by layer)
METASERVER_PATH = "/v1/metaserver"
KV_ROLES = {"prompt": "kv_producer", "decoder": "kv_consumer"}
RANDOM_PORT_BASE = 20000
RANDOM_PORTS_PER_NPU = 1000
DEFAULT_KV_PORT = 30000
DEFAULT_NPUS_PER_NODE = 8


def random_port_range(npus_per_node: int) -> tuple[int, int]:
    """[start, end) of the ports Mooncake's Ascend transport picks at random on a node."""
    if npus_per_node < 1:
        raise ValueError(f"npus_per_node must be at least 1, got {npus_per_node}")
    return RANDOM_PORT_BASE, RANDOM_PORT_BASE + RANDOM_PORTS_PER_NPU * npus_per_node


def kv_port_problem(kv_port: int, npus_per_node: int, tensor_parallel: int = 1) -> str | None:
    """Why `kv_port` cannot serve (None: it can): inside the random range, or its side channels
    (one port per rank) past 65535."""
    lo, hi = random_port_range(npus_per_node)
    if lo <= kv_port < hi or kv_port < lo and kv_port + tensor_parallel > lo:
        return (f"spec.engine.kvPort {kv_port} is inside Mooncake's random port range [{lo}, {hi}) for "
                f"{npus_per_node} NPUs per node (spec.ascend.npusPerNode): use {hi} or above")
    if kv_port + tensor_parallel - 1 > 65535:
        return f"spec.engine.kvPort {kv_port} + {tensor_parallel} ranks' side channels pass 65535"
    return None


def extra_config(prefill_tp: int, decoder_tp: int, prefill_dp: int = 1, decoder_dp: int = 1) -> dict:
    """`kv_connector_extra_config`: both roles' parallel sizes, as every engine of the deployment
    (either role) must be told them. dp_size is an engine's own data-parallel size (1: a pod is
    one engine of TP ranks)."""
    for name, v in (("prefill_tp", prefill_tp), ("decoder_tp", decoder_tp), ("prefill_dp", prefill_dp),
                    ("decoder_dp", decoder_dp)):
        if v < 1:
            raise ValueError(f"{name} must be at least 1, got {v}")
    if prefill_tp < decoder_tp:
        raise ValueError(f"the prefill's tensor parallel ({prefill_tp}) must be at least the decoder's ({decoder_tp})")
    return {"prefill": {"tp_size": prefill_tp, "dp_size": prefill_dp},
            "decode": {"tp_size": decoder_tp, "dp_size": decoder_dp}}


def is_mooncake(kv_transfer: str | None) -> bool:
    return kv_transfer in CONNECTORS


def decoder_first(kv_transfer: str | None) -> bool:
    """The router sends a request to the decoder first (mooncake-layerwise)."""
    return kv_transfer == "mooncake-layerwise"


def kv_transfer_config(role: Role, *, kv_port: int, engine_id: str, prefill_tp: int, decoder_tp: int,
                       prefill_dp: int = 1, decoder_dp: int = 1, kind: Kind = "mooncake") -> dict:
    """vLLM's `--kv-transfer-config` for an engine that serves as `role` (vllm-ascend's registry
    names the connector; no module path)."""
    if kind not in CONNECTORS:
        raise ValueError(f"kind must be one of {sorted(CONNECTORS)}, got {kind!r}")
    if role not in KV_ROLES:
        raise ValueError(f"role must be prompt or decoder, got {role!r}")
    if not engine_id:
        raise ValueError("engine_id is required (unique per engine)")
    if not 1 <= kv_port <= 65535:
        raise ValueError(f"kv_port must be a port, got {kv_port}")
    return {"kv_connector": CONNECTORS[kind], "kv_role": KV_ROLES[role], "kv_port": kv_port, "engine_id": engine_id,
            "kv_connector_extra_config": extra_config(prefill_tp, decoder_tp, prefill_dp, decoder_dp)}
