"""Helpers every builder shares (pure): labels, owner references, object metadata, and the
hardening every pod the project creates gets."""
from __future__ import annotations

from pd_contract.names import LABEL_DEPLOYMENT

from .api import GROUP, KIND, VERSION

RUN_AS = 10001   # the images' user


def common_labels(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "pd-engine", "app.kubernetes.io/instance": name,
            "app.kubernetes.io/managed-by": "pd-operator", LABEL_DEPLOYMENT: name}


def owner_reference(name: str, uid: str) -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": name, "uid": uid,
            "controller": True, "blockOwnerDeletion": True}


def object_meta(name: str, namespace: str, owner: dict, labels: dict | None = None) -> dict:
    return {"name": name, "namespace": namespace, "labels": labels or {}, "ownerReferences": [owner]}


def liveness_probe(port: str = "http", path: str | None = "/livez") -> dict:
    """Liveness, distinct from readiness (/healthz: it can serve now) and patient: 30 s to start
    listening (a hundred pods starting on a busy node), then a minute without an answer, so a
    pod that is only slow is not restarted. `path` None: the port accepts connections (engine
    pods, whose image the spec names: an agent built before /livez must not be restarted for a
    404); the gateway, whose image the operator's configuration sets, has /livez (its loops run)."""
    check: dict = {"httpGet": {"path": path, "port": port}} if path else {"tcpSocket": {"port": port}}
    return {**check, "initialDelaySeconds": 30, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 6}


def harden(pod_spec: dict, container: dict, non_root: bool = True, user: int | None = None,
           group: int | None = None) -> None:
    """Every pod the project creates: no privilege escalation, no capabilities, the
    RuntimeDefault seccomp profile, a read-only root filesystem with an emptyDir on /tmp, and
    (where the workload allows it) a non-root user. Ascend engines are the exception to the
    last: the NPU driver's device nodes belong to its own user and group (HwHiAiUser), so
    `backend: llm-datadist` runs as the user and group the operator's configuration names
    (chart values engineUser/engineGroup), or the image's user if the admin left them unset."""
    sc: dict = {"seccompProfile": {"type": "RuntimeDefault"}}
    if non_root:
        sc.update(runAsNonRoot=True, runAsUser=RUN_AS, runAsGroup=RUN_AS)
    elif user is not None:
        sc.update(runAsUser=user, **({"runAsGroup": group} if group is not None else {}),
                  **({"runAsNonRoot": True} if user != 0 else {}))
    pod_spec["securityContext"] = sc
    container["securityContext"] = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}}
    pod_spec.setdefault("volumes", []).append({"name": "tmp", "emptyDir": {}})
    container.setdefault("volumeMounts", []).append({"name": "tmp", "mountPath": "/tmp"})
