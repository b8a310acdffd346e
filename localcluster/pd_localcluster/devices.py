"""The local node's stand-in for the Ascend device plugin (pure): which NPUs a pod holds,
each device's IP, and the pod annotation the plugin writes for the workload to read.

Device IPs are loopback addresses, so a workload can bind or connect to them on this
machine: on node n (second octet ``prefix`` = pod-IP base + n) device d is
``127.<prefix>.<DEVICE_THIRD_OCTET + d // 254>.<d % 254 + 1>``. Pod IPs on that node stay
below the third octet ``DEVICE_THIRD_OCTET`` (see nodeagent.IPAllocator), so the two never
meet, and nodes differ by their prefix."""
from __future__ import annotations

import json
from typing import Any

ASCEND_ANNOTATION = "ascend.kubectl.kubernetes.io/ascend-910-configuration"
DEFAULT_RESOURCE = "huawei.com/Ascend910"
DEFAULT_PER_NODE = 32
VISIBLE_DEVICES_ENV = "ASCEND_VISIBLE_DEVICES"
SUPERPOD_LABEL = "pdoperator.io/superpod"   # the local nodes' superpod, for a topologyKey (tests)
# Third octets from here up are device IPs; pod IPs use the ones below.
DEVICE_THIRD_OCTET = 200
MAX_DEVICES = (256 - DEVICE_THIRD_OCTET) * 254


class NotEnoughDevices(Exception):
    """Fewer free devices on the node than the pod requests."""


class DeviceAllocator:
    """The devices of one node: ids 0..count-1, each held by at most one pod uid."""

    def __init__(self, count: int):
        if not 0 <= count <= MAX_DEVICES:
            raise ValueError(f"a node has 0..{MAX_DEVICES} devices, not {count}")
        self.count = count
        self.owner: dict[int, str] = {}

    def held(self, uid: str) -> list[int]:
        return sorted(d for d, u in self.owner.items() if u == uid)

    @property
    def free(self) -> int:
        return self.count - len(self.owner)

    def allocate(self, uid: str, n: int) -> list[int]:
        """The n lowest free ids for `uid`; a uid that already holds devices keeps them."""
        mine = self.held(uid)
        if mine:
            return mine
        free = [d for d in range(self.count) if d not in self.owner]
        if len(free) < n:
            raise NotEnoughDevices(f"{n} requested, {len(free)} of {self.count} free")
        for d in free[:n]:
            self.owner[d] = uid
        return free[:n]

    def restore(self, uid: str, ids: list[int]) -> None:
        """Re-adopt what a pod holds by its annotation (the node agent restarted)."""
        for d in ids:
            if not 0 <= d < self.count:
                raise ValueError(f"device {d} is not on this node (0..{self.count - 1})")
            if self.owner.get(d, uid) != uid:
                raise ValueError(f"device {d} is held by pod {self.owner[d]}")
        for d in ids:
            self.owner[d] = uid

    def release(self, uid: str) -> None:
        for d in self.held(uid):
            del self.owner[d]


def device_ip(prefix: int, device_id: int) -> str:
    if not 0 <= device_id < MAX_DEVICES:
        raise ValueError(f"device id {device_id} out of range")
    return f"127.{prefix}.{DEVICE_THIRD_OCTET + device_id // 254}.{device_id % 254 + 1}"


def annotation(pod_name: str, server_id: str, ids: list[int], prefix: int, super_pod_id: int = 0) -> str:
    """The value the Ascend device plugin writes under ASCEND_ANNOTATION (super_pod_id: as
    MindCluster's plugin writes it on A3 nodes)."""
    return json.dumps({"pod_name": pod_name, "server_id": server_id, "super_pod_id": super_pod_id,
                       "devices": [{"device_id": str(d), "device_ip": device_ip(prefix, d)}
                                   for d in sorted(ids)]})


def superpod(node_index: int, nodes: int, superpods: int) -> int:
    """The superpod of a node: the nodes split into `superpods` contiguous runs."""
    return node_index * max(1, min(superpods, nodes)) // max(1, nodes)


def parse_annotation(value: str | None) -> tuple[str, list[int]] | None:
    """(server_id, device ids) of an annotation, or None if absent or malformed."""
    if not value:
        return None
    try:
        doc = json.loads(value)
        return str(doc["server_id"]), sorted(int(d["device_id"]) for d in doc["devices"])
    except (ValueError, KeyError, TypeError):
        return None


def _quantity(v: Any) -> int:
    # extended resources are whole numbers; the API may hand them back as "2" or 2
    return int(str(v).strip()) if v is not None else 0


def container_requested(container: dict, resource: str) -> int:
    res = container.get("resources") or {}
    for kind in ("limits", "requests"):
        v = (res.get(kind) or {}).get(resource)
        if v is not None:
            return _quantity(v)
    return 0


def requested(pod: dict, resource: str) -> int:
    """How many devices the pod's containers ask for (limits, else requests)."""
    return sum(container_requested(c, resource) for c in (pod.get("spec") or {}).get("containers") or [])


def split(pod: dict, resource: str, ids: list[int]) -> dict[str, list[int]]:
    """Each requesting container's share of the pod's devices, in container order."""
    out: dict[str, list[int]] = {}
    rest = sorted(ids)
    for c in (pod.get("spec") or {}).get("containers") or []:
        n = container_requested(c, resource)
        if n:
            out[c["name"]], rest = rest[:n], rest[n:]
    return out
