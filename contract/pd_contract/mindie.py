"""MindIE (Motor) role assignment, pure: the global rank table built from the engine pods, and
the body of the role push `POST /v2/role/{prefill|decode}`.

The wire shapes follow MindIE-LLM's endpoint parser (`JsonParse::CheckPDRoleV2ReqJson`):

    {"local": [<node>],                      # this instance: one node per pod here
     "peers": [[<node>], [<node>], ...]}     # the other role's instances, each a list of nodes
    <node> = {"server_ip": <IPv4>, "host_ip": <IPv4, optional>,
              "dp_inst_list": [{"dp_inst_id": <unsigned>,
                                "device": [{"device_id": "<n>", "device_ip": <IPv4>,
                                            "device_logical_id": "<n>", "rank_id": "<n>"}, ...]}]}

The rank table has MindCluster's shape (`server_group_list[].server_list[].device[]`), one
group per role (`group_name` prefill | decode). Each pod is one instance of tensor parallelism
only (one DP group): its devices are the Ascend device plugin's annotation, rank r on the r-th
device in device-id order (as pd_agent.devices assigns them), `device_logical_id` the rank (the
process-visible index), `rank_id` the rank within the instance.

Role names: the pods' label says prefill | decoder (| switching), llm_datadist says prompt |
decoder, MindIE says prefill | decode."""
from __future__ import annotations

import ipaddress
import json
import re
from typing import Any, Iterable

from pd_contract.names import ANNOTATION_ROLE, ASCEND_ANNOTATION, LABEL_GROUP, LABEL_ROLE, POD_INDEX_LABEL

VERSION = "1.0"
ROLES = ("prefill", "decode")                                  # MindIE's, in table order
OF_LABEL = {"prefill": "prefill", "decoder": "decode"}         # pod label / assigned role -> MindIE
OF_ENGINE = {"prompt": "prefill", "decoder": "decode"}         # llm_datadist role -> MindIE
OTHER = {"prefill": "decode", "decode": "prefill"}
GROUP_BASE = {"prefill": 0, "decoder": 1000}                   # instance ids: StatefulSet group + pod index
TABLE_KEY = "ranktable.json"
_TRAILING = re.compile(r"^(.*?)(\d+)$")


def is_ipv4(text: Any) -> bool:
    try:
        return isinstance(text, str) and isinstance(ipaddress.ip_address(text), ipaddress.IPv4Address)
    except ValueError:
        return False


def annotation_devices(text: str | None) -> tuple[str, list[dict]] | None:
    """(the plugin's server_id, devices in rank order) from the annotation's JSON; None when
    absent, malformed, or a device has no IP (the plugin has not finished)."""
    if not text:
        return None
    try:
        doc = json.loads(text)
        pairs = sorted((int(d["device_id"]), d.get("device_ip") or "") for d in doc["devices"])
        server_id = str(doc.get("server_id") or "")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if not pairs or not all(ip for _, ip in pairs):
        return None
    return server_id, devices(pairs)


def devices(pairs: Iterable[tuple[int, str]]) -> list[dict]:
    """(device_id, device_ip) in rank order -> the table's and the body's device entries."""
    return [{"device_id": str(dev), "device_ip": ip, "device_logical_id": str(r), "rank_id": str(r)}
            for r, (dev, ip) in enumerate(pairs)]


def pod_role(pod: dict) -> str | None:
    """The pod's MindIE role: its role label; a switching pod's (label `switching`) is the role
    it was assigned (the annotation moves to the new role just before the engine switches)."""
    meta = pod.get("metadata") or {}
    label = (meta.get("labels") or {}).get(LABEL_ROLE)
    if label in OF_LABEL:
        return OF_LABEL[label]
    return OF_LABEL.get((meta.get("annotations") or {}).get(ANNOTATION_ROLE, ""))


def instance_id(pod: dict) -> int:
    """Stable across role switches: the StatefulSet group's base plus the pod's index."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    name = meta.get("name", "")
    group = labels.get(LABEL_GROUP) or ("decoder" if "-decoder-" in name else "prefill")
    index = labels.get(POD_INDEX_LABEL)
    if index is None:
        m = _TRAILING.match(name)
        index = m.group(2) if m else "0"
    try:
        return GROUP_BASE.get(group, 0) + int(index)
    except ValueError:
        return GROUP_BASE.get(group, 0)


def server_of(pod: dict) -> dict | None:
    """The pod as a rank-table server, or None until it has a pod IP and its devices' IPs."""
    meta, status, spec = pod.get("metadata") or {}, pod.get("status") or {}, pod.get("spec") or {}
    got = annotation_devices((meta.get("annotations") or {}).get(ASCEND_ANNOTATION))
    pod_ip = status.get("podIP")
    if got is None or not pod_ip:
        return None
    plugin_server, devs = got
    host_ip = status.get("hostIP") or (plugin_server if is_ipv4(plugin_server) else "")
    out = {"server_id": host_ip or plugin_server or spec.get("nodeName") or "", "server_ip": pod_ip,
           "container_ip": pod_ip, "pod_name": meta.get("name", ""), "instance_id": instance_id(pod),
           "device": devs}
    if host_ip:
        out["host_ip"] = host_ip
    return out


def _order(name: str) -> tuple:
    m = _TRAILING.match(name)
    return (m.group(1), int(m.group(2)), name) if m else (name, -1, name)


def rank_table(pods: Iterable[dict]) -> dict:
    """The global rank table of the live engine pods (leaving ones are left out). A pod without a
    role, pod IP or device IPs yet is left out and the table says `initializing`."""
    groups: dict[str, list[dict]] = {r: [] for r in ROLES}
    waiting = False
    for pod in pods:
        if (pod.get("metadata") or {}).get("deletionTimestamp"):
            continue
        role, server = pod_role(pod), server_of(pod)
        if role is None or server is None:
            waiting = True
            continue
        groups[role].append(server)
    return {"version": VERSION, "status": "initializing" if waiting else "completed",
            "server_group_list": [
                {"group_id": str(i), "group_name": role, "server_count": str(len(groups[role])),
                 "server_list": sorted(groups[role], key=lambda s: _order(s["pod_name"]))}
                for i, role in enumerate(ROLES)]}


def render(table: dict) -> str:
    """The ConfigMap's text: the same table gives the same bytes."""
    return json.dumps(table, separators=(",", ":"), sort_keys=True) + "\n"   # compact: 1 MiB holds it


def servers(table: dict, role: str) -> list[dict]:
    """The table's servers of one MindIE role."""
    for g in table.get("server_group_list") or []:
        if g.get("group_name") == role:
            return list(g.get("server_list") or [])
    return []


def node(server: dict) -> dict:
    """A rank-table server (or a pod) as a node of the role body."""
    if "metadata" in server:
        got = server_of(server)
        if got is None:
            raise ValueError(f"pod {server['metadata'].get('name')} has no pod IP or device IPs yet")
        server = got
    out: dict = {"server_ip": server["server_ip"]}
    host = server.get("host_ip") or server.get("server_id")
    if is_ipv4(host):
        out["host_ip"] = host
    out["dp_inst_list"] = [{"dp_inst_id": int(server.get("instance_id") or 0),
                            "device": [{k: d[k] for k in ("device_id", "device_ip", "device_logical_id", "rank_id")}
                                       for d in server["device"]]}]
    return out


def role_body(role: str, local: dict, peers: Iterable[dict]) -> dict:
    """The body of `POST /v2/role/{role}`: `local` this instance (a pod dict or its rank-table
    server), `peers` the other role's instances (each one pod: one node)."""
    if role not in ROLES:
        raise ValueError(f"MindIE roles are {' | '.join(ROLES)}, not {role!r}")
    return {"local": [node(local)], "peers": [[node(p)] for p in peers]}
