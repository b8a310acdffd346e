"""InferencePools (Gateway API Inference Extension, inference.networking.k8s.io/v1) kept for a
deployment whose spec.routing.inferencePool is true (decide: pure; observe and act below).

A pool selects the deployment's serving pods by llm-d's labels, which the operator moves with
every switch: a pod loses them before its drain and gets them back only after relink and verify,
so a pool (and the endpoint picker reading it) never holds a pod that is draining, switching or
not yet verified in its role. Scope Deployment keeps one pool `<name>` of every serving pod (llm-d's
P/D scheduler tells the roles apart by llm-d.ai/role); scope Role keeps `<name>-prefill` and
`<name>-decode`. Without the InferencePool CRD nothing is created, and the condition
InferencePoolReady says why."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pd_contract.names import AGENT_PORT, LABEL_DEPLOYMENT, LLMD_ROLE, LLMD_SERVING

from .api import EndpointPickerRef, PDDeploymentSpec
from .objmeta import common_labels, object_meta

POOL_API = "inference.networking.k8s.io/v1"
POOL_KIND = "InferencePool"
POOL_PLURAL = "inferencepools"
CRD_NAME = f"{POOL_PLURAL}.inference.networking.k8s.io"
CONDITION = "InferencePoolReady"
Verdict = tuple[bool, str, str]


@dataclass(frozen=True)
class PoolPlan:
    apply: tuple[dict, ...] = ()       # pools to server-side apply (only those that differ)
    delete: tuple[str, ...] = ()       # pools of this deployment no longer wanted
    verdict: Verdict | None = None     # InferencePoolReady; None: the condition goes


def wanted(spec: PDDeploymentSpec) -> bool:
    return spec.routing is not None and spec.routing.inference_pool


def target_ports(spec: PDDeploymentSpec) -> list[int]:
    r = spec.routing
    if r is not None and r.target_ports:
        return list(r.target_ports)
    return [spec.engine.port] if spec.engine is not None and spec.engine.port else [AGENT_PORT]


def selectors(name: str, spec: PDDeploymentSpec) -> dict[str, dict[str, str]]:
    """Pool name -> the labels it selects on."""
    base = {LABEL_DEPLOYMENT: name, LLMD_SERVING: "true"}
    if spec.routing is not None and spec.routing.pool_scope == "Role":
        return {f"{name}-{role}": {**base, LLMD_ROLE: role} for role in ("prefill", "decode")}
    return {name: base}


def _picker(spec: PDDeploymentSpec, pool: str, name: str) -> EndpointPickerRef | None:
    r = spec.routing
    assert r is not None
    if r.pool_scope == "Deployment":
        return r.endpoint_picker_ref
    refs = r.endpoint_picker_refs
    if refs is None:
        return None
    return refs.prefill if pool == f"{name}-prefill" else refs.decode


def desired(name: str, namespace: str, owner: dict, spec: PDDeploymentSpec) -> list[dict]:
    out = []
    for pool, labels in selectors(name, spec).items():
        # every field the API server would default is set, so what is stored compares equal
        body: dict = {"appProtocol": "http", "selector": {"matchLabels": labels},
                      "targetPorts": [{"number": p} for p in target_ports(spec)]}
        ref = _picker(spec, pool, name)
        if ref is not None:
            body["endpointPickerRef"] = {"group": ref.group, "kind": ref.kind, "name": ref.name,
                                         "port": {"number": ref.port}, "failureMode": ref.failure_mode}
        out.append({"apiVersion": POOL_API, "kind": POOL_KIND,
                    "metadata": object_meta(pool, namespace, owner, common_labels(name)), "spec": body})
    return out


def _matches(labels: dict, selector: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _ready(pod: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def _controller(obj: dict) -> dict | None:
    return next((o for o in obj["metadata"].get("ownerReferences") or [] if o.get("controller")), None)


def _owner(obj: dict) -> str:
    c = _controller(obj)
    return f"{c.get('kind', '?')} {c.get('name', '?')}" if c else "nobody"


def ours(obj: dict, owner: dict) -> bool:
    return (_controller(obj) or {}).get("uid") == owner["uid"]


def plan(name: str, namespace: str, owner: dict, spec: PDDeploymentSpec, api: bool | None,
         read: Iterable[dict] | None, pods: list[dict], error: str = "") -> PoolPlan:
    """What to apply and delete, and the condition. `api`: whether the API server serves
    InferencePools (None: not asked yet); `observed`: the pools labelled with this deployment and
    those of the names it wants, by name (None: they could not be listed: `error`); `error`: also
    why the last apply or delete was refused. Only pools this deployment controls are written or
    deleted: one of the same name that another owns (or nobody) is named in the condition."""
    observed = None if read is None else {p["metadata"]["name"]: p for p in read}
    if not wanted(spec):
        mine = sorted(n for n, o in (observed or {}).items() if ours(o, owner))
        return PoolPlan(delete=tuple(mine) if api else ())
    if api is None:
        return PoolPlan(verdict=(False, "Checking", "looking for the InferencePool API"))
    if not api:
        return PoolPlan(verdict=(False, "CRDNotInstalled", f"spec.routing.inferencePool is true but the API server "
                                 f"does not serve {POOL_API} InferencePools (CRD {CRD_NAME}): no pool is kept. "
                                 "Install the Gateway API Inference Extension's CRDs; the pools follow within a "
                                 "minute"))
    if observed is None:
        return PoolPlan(verdict=(False, "Unknown", f"the InferencePools could not be read: {error}"))
    want = desired(name, namespace, owner, spec)
    taken = [f"InferencePool {n} exists and is not this deployment's (controlled by {_owner(observed[n])})"
             for n in (o["metadata"]["name"] for o in want) if n in observed and not ours(observed[n], owner)]
    if taken:
        return PoolPlan(verdict=(False, "NameTaken", "; ".join(taken) + ": it is never written over; delete or "
                                 "rename it, or change spec.routing.poolScope"))
    names = {o["metadata"]["name"] for o in want}
    apply = tuple(o for o in want if _differs(o, observed.get(o["metadata"]["name"])))
    delete = tuple(sorted(n for n, o in observed.items() if n not in names and ours(o, owner)))
    if apply and error:
        return PoolPlan(apply=apply, delete=delete, verdict=(False, "ApplyFailed", error))
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    parts = []
    for pool, sel in selectors(name, spec).items():
        n = sum(1 for p in live if _matches(p["metadata"].get("labels") or {}, sel) and _ready(p))
        parts.append(f"{pool}: {n} serving pod{'s' if n != 1 else ''}")
    verb = "applying" if apply else "kept"
    return PoolPlan(apply=apply, delete=delete,
                    verdict=(not apply, "Applying" if apply else "Kept", f"InferencePools {verb}: " + "; ".join(parts)))


def _contains(have: object, want: object) -> bool:
    """Whether `have` holds every field of `want` with its value (fields others set are theirs)."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(_contains(have.get(k), v) for k, v in want.items())
    return have == want


def _differs(want: dict, have: dict | None) -> bool:
    if have is None:
        return True
    return not _contains(have.get("spec"), want["spec"]) or \
        not _contains(have["metadata"].get("labels") or {}, want["metadata"]["labels"])
