"""Which NPU, device IP and datadist port each tensor-parallel rank of this pod uses.

On Ascend, an engine listens and is dialled on its NPU's device IP, not the pod IP. The
sources, in order:
1. the Ascend device plugin's pod annotation (`ascend.kubectl.kubernetes.io/ascend-910-
   configuration`), read from the downwardAPI volume file the operator mounts, so a value the
   plugin writes late is seen (the file follows the annotation);
2. `/etc/hccn.conf` (`address_<device_id>=<ip>`) for the devices `ASCEND_VISIBLE_DEVICES`
   names (or devices 0..TP-1);
3. an explicit list, `PD_DEVICE_IPS=ip0,ip1,...` (rank order).
Rank r takes the r-th device in device-id order. A partial mapping, or none on the real backend,
is an error naming the rank; never a silent fallback to the pod IP. Only the simulator, given
none of these (kind has no Ascend device plugin), runs its ranks on the pod IP at ports
port, port+1, ..., port+TP-1, and says so (source "pod-ip").

The process runtime of the local cluster has no mount namespace: it sets PD_LOCAL_ROOT, under
which absolute mount paths are found."""
from __future__ import annotations

import ipaddress
import json
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

from pd_contract.engine_env import (
    LLM_DATADIST_PORT,
    PD_BACKEND,
    PD_DEVICE_ANNOTATION_FILE,
    PD_HCCN_CONF,
    PD_LOCAL_ROOT,
    PD_TENSOR_PARALLEL,
    engine_ip,
)
from pd_contract.names import DATADIST_PORT, HCCN_CONF, PODINFO_ASCEND, PODINFO_DIR

_HCCN_LINE = re.compile(r"^([A-Za-z][A-Za-z_]*?)_(\d+)\s*=\s*(\S*)\s*$")


class DeviceError(ValueError):
    """A device source that does not parse; the message names the file and the line."""


@dataclass(frozen=True)
class Device:
    rank: int
    device_id: int | None     # the physical NPU id (None: not known)
    ip: str | None            # None: unknown (see Devices.error)
    port: int


@dataclass(frozen=True)
class Devices:
    source: str                       # annotation | hccn.conf | list | pod-ip | "" (none found)
    ranks: tuple[Device, ...]
    error: str = ""                   # set when some rank has no device IP: names the rank(s)
    superpod: str = ""                # the A3 superpod the node is in (the annotation's super_pod_id), if given

    @property
    def complete(self) -> bool:
        return not self.error and all(d.ip for d in self.ranks)


def local_path(path: str, env: dict[str, str]) -> Path:
    """An absolute path as this process sees it (under PD_LOCAL_ROOT on the local cluster)."""
    root = env.get(PD_LOCAL_ROOT)
    return Path(root) / path.lstrip("/") if root else Path(path)


def _ip(text: str) -> str:
    ipaddress.ip_address(text)   # raises ValueError
    return text


def parse_annotation(text: str, where: str = "the device plugin's annotation") -> list[tuple[int, str | None]]:
    """(device_id, device_ip) in device-id order from the annotation's JSON."""
    try:
        doc = json.loads(text)
        devices = doc["devices"]
        out = []
        for d in devices:
            ip = d.get("device_ip") or None
            out.append((int(d["device_id"]), _ip(ip) if ip else None))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise DeviceError(f"{where} is not {{\"devices\": [{{\"device_id\", \"device_ip\"}}, ...]}}: "
                          f"{type(e).__name__}: {e}") from None
    return sorted(out)


def superpod_of(text: str) -> str:
    """The annotation's `super_pod_id` (MindCluster's device plugin writes it on A3), "" without one."""
    try:
        value = json.loads(text).get("super_pod_id")
        n = int(value) if value is not None and not isinstance(value, bool) else -1
        return str(n) if 0 <= n < 1 << 32 else ""
    except (ValueError, TypeError, AttributeError):
        return ""


def parse_hccn(text: str, name: str = HCCN_CONF) -> dict[int, str]:
    """device_id -> device IP from hccn.conf. Every non-blank, non-comment line must be
    `<key>_<device_id>=<value>`; address lines must hold an IP."""
    out: dict[int, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        m = _HCCN_LINE.match(s)
        if not m:
            raise DeviceError(f"{name} line {n}: {s!r} does not parse: expected <key>_<device_id>=<value>, "
                              f"e.g. address_0=192.168.100.101")
        key, dev, value = m.group(1), int(m.group(2)), m.group(3)
        if key == "address":
            try:
                out[dev] = _ip(value)
            except ValueError:
                raise DeviceError(f"{name} line {n}: {s!r}: {value!r} is not an IP address") from None
    return out


def _visible(env: dict[str, str], tp: int) -> list[int]:
    raw = env.get("ASCEND_VISIBLE_DEVICES", "").strip()
    if raw:
        try:
            return sorted(int(x) for x in raw.split(",") if x.strip())
        except ValueError:
            raise DeviceError(f"ASCEND_VISIBLE_DEVICES={raw!r} is not a list of device ids") from None
    return list(range(tp))


def _assign(source: str, pairs: list[tuple[int | None, str | None]], tp: int, port: int, what: str) -> Devices:
    ranks, missing = [], []
    for r in range(tp):
        dev, ip = pairs[r] if r < len(pairs) else (None, None)
        if not ip:
            missing.append(f"rank {r}" + (f" (device {dev})" if dev is not None else "")
                           + (": no device_ip" if r < len(pairs) else f": {what} lists {len(pairs)} device(s) "
                              f"for {tp} ranks"))
        ranks.append(Device(r, dev, ip, port))
    return Devices(source, tuple(ranks), "; ".join(missing) + (f" in {what}" if missing else ""))


def resolve(tp: int, port: int, env: dict[str, str], pod_ip: str, backend: str) -> Devices:
    """Each rank's device and address, from the first source that exists."""
    ann_file = local_path(env.get(PD_DEVICE_ANNOTATION_FILE) or f"{PODINFO_DIR}/{PODINFO_ASCEND}", env)
    text = ann_file.read_text().strip() if ann_file.is_file() else ""
    if text:
        pairs: list[tuple[int | None, str | None]] = list(parse_annotation(text))
        return replace(_assign("annotation", pairs, tp, port, "the device plugin's annotation"),
                       superpod=superpod_of(text))
    hccn_path = env.get(PD_HCCN_CONF) or HCCN_CONF
    hccn = local_path(hccn_path, env)
    if hccn.is_file():
        table = parse_hccn(hccn.read_text(), hccn_path)
        pairs = [(d, table.get(d)) for d in _visible(env, tp)]
        return _assign("hccn.conf", pairs, tp, port, hccn_path)
    listed = [x.strip() for x in env.get("PD_DEVICE_IPS", "").split(",") if x.strip()]
    if listed:
        try:
            ips = [_ip(x) for x in listed]
        except ValueError as e:
            raise DeviceError(f"PD_DEVICE_IPS: {e}") from None
        ids = _visible(env, tp)
        return _assign("list", list(zip(ids, ips)), tp, port, "PD_DEVICE_IPS")
    if backend == "sim":
        return Devices("pod-ip", tuple(Device(r, None, pod_ip, port + r) for r in range(tp)))
    return Devices("", tuple(Device(r, None, None, port) for r in range(tp)),
                   f"no device IPs for ranks 0-{tp - 1}: no device plugin annotation in {ann_file}, no "
                   f"{hccn_path}, no PD_DEVICE_IPS")


def resolve_env(env: dict[str, str] | None = None) -> Devices:
    """resolve() with this pod's settings from the environment the operator injects."""
    env = dict(os.environ if env is None else env)
    tp = int(env.get(PD_TENSOR_PARALLEL) or 1)
    port = int(env.get(LLM_DATADIST_PORT) or DATADIST_PORT)
    pod_ip = engine_ip(env)
    return resolve(tp, port, env, pod_ip, env.get(PD_BACKEND, "sim"))
