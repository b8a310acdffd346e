"""MindIE's global rank table (pure): a ConfigMap `<name>-rank-table` (key ranktable.json) from
the observed engine pods, and what the engine pods need to read it and reach MindIE's role API.

Only with spec.mindie.enabled. The table is rendered every pass from the pods as observed (their
role label, the device plugin's annotation, pod and host IPs; pd_contract.mindie.rank_table), so
it follows a live switch; the same pods give the same bytes, and children.to_apply applies it
only when its content changed (or it drifted). The pods mount it (optional: it may come after
them) at RANK_TABLE_DIR; the kubelet refreshes a mounted ConfigMap within its sync period, and
the agent re-reads it (pd_agent.mindie_hook), so a pod's peers follow without a restart."""
from __future__ import annotations

from typing import Iterable

from pd_contract import engine_env as ev
from pd_contract.mindie import TABLE_KEY, rank_table, render

from .api import PDDeploymentSpec
from .objmeta import common_labels, object_meta, owner_reference

RANK_TABLE_DIR = "/etc/pd-mindie"     # api.OPERATOR_MOUNT_PATHS reserves it
VOLUME = "mindie-rank-table"          # api.OPERATOR_VOLUMES reserves it


def rank_table_name(name: str) -> str:
    return f"{name}-rank-table"


def enabled(spec: PDDeploymentSpec) -> bool:
    return spec.mindie is not None and spec.mindie.enabled


def config_map(name: str, namespace: str, owner: dict, pods: Iterable[dict]) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": object_meta(rank_table_name(name), namespace, owner, common_labels(name)),
            "data": {TABLE_KEY: render(rank_table(pods))}}


def desired(name: str, namespace: str, uid: str, spec: PDDeploymentSpec, pods: Iterable[dict]) -> list[dict]:
    """The rank-table ConfigMap when the spec opts in, else nothing."""
    if not enabled(spec):
        return []
    return [config_map(name, namespace, owner_reference(name, uid), pods)]


def mindie_pod_patch(spec: PDDeploymentSpec, name: str) -> tuple[list[dict], list[dict], list[dict]]:
    """(env, volumes, volume mounts) the engine container gets with spec.mindie.enabled."""
    if not enabled(spec):
        return [], [], []
    assert spec.mindie is not None
    env = [{"name": ev.PD_MINDIE_ROLE_URL, "value": spec.mindie.role_url},
           {"name": ev.PD_MINDIE_RANK_TABLE_FILE, "value": f"{RANK_TABLE_DIR}/{TABLE_KEY}"}]
    volumes = [{"name": VOLUME, "configMap": {"name": rank_table_name(name), "optional": True}}]
    mounts = [{"name": VOLUME, "mountPath": RANK_TABLE_DIR, "readOnly": True}]
    return env, volumes, mounts
