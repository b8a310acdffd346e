"""A fake API server and fake agents for controller scenario tests (as controller-rs tests its
reconciler against a scripted API): both record every call in one ordered log and answer from
state the test scripts. The API server feeds what is written back into the controller's
caches, as the watches would; the StatefulSet controller and the kubelet are the test's
`add_pod`."""
from __future__ import annotations

import base64
import copy
import itertools
from dataclasses import dataclass, field

from pd_contract.agent_api import AgentStatus, DrainResult, LinkResult, Load, VerifyResult
from pd_operator.agentclient import AgentCallError
from pd_operator.kinds import CHILDREN
from pd_operator.kube import KubeError
from pd_operator.metrics import OperatorMetrics
from pd_operator.reconcile import Controller

CHILD_KINDS = {k.kind for k in CHILDREN}
DESC = {"num_tensors": 8, "shape": [4, 1024, 4, 64], "data_type": "DT_FLOAT16"}


class Log(list):
    def kinds(self, prefix: str = "") -> list[str]:
        return [c[0] for c in self if c[0].startswith(prefix)]

    def count(self, what: str) -> int:  # type: ignore[override]
        return sum(1 for c in self if c[0] == what)


class FakeKube:
    def __init__(self, log: Log):
        self.log = log
        self.objects: dict[tuple[str, str, str], dict] = {}    # (kind, namespace, name) -> object
        self.controller: Controller | None = None
        self.reject: dict[str, tuple[int, str]] = {}           # kind -> (status, message) for applies
        self._rv = itertools.count(1)
        self.served: set[str] = set()                            # custom resources' plurals the server serves

    def store(self, obj: dict) -> dict:
        obj = copy.deepcopy(obj)
        meta = obj["metadata"]
        meta["resourceVersion"] = str(next(self._rv))
        meta.setdefault("uid", f"uid-{obj['kind']}-{meta['name']}")   # stable across applies, as on a server
        self.objects[(obj["kind"], meta.get("namespace", ""), meta["name"])] = obj
        return obj

    def feed(self, obj: dict) -> None:
        if self.controller is None:
            return
        if obj["kind"] in CHILD_KINDS:
            self.controller.on_child("MODIFIED", copy.deepcopy(obj))
        elif obj["kind"] == "Pod":
            self.controller.on_pod("MODIFIED", copy.deepcopy(obj))
        elif obj["kind"] == "PDDeployment":
            self.controller.on_deployment("MODIFIED", copy.deepcopy(obj))

    async def apply(self, obj: dict, subresource: str = "") -> dict:
        meta = obj["metadata"]
        key = (obj["kind"], meta["namespace"], meta["name"])
        if subresource == "status":
            self.log.append(("status", copy.deepcopy(obj["status"])))
            cur = self.objects.get(key)
            if cur is None:
                raise KubeError(404, '{"message": "not found"}', "apply status")
            cur = {**cur, "status": copy.deepcopy(obj["status"])}
            stored = self.store(cur)
            self.feed(stored)
            return stored
        self.log.append(("apply", obj["kind"], meta["name"]))
        if obj["kind"] in self.reject:
            status, message = self.reject[obj["kind"]]
            raise KubeError(status, '{"message": "%s"}' % message, f"apply {obj['kind']} {meta['name']}")
        stored = self.store(obj)
        self.feed(stored)
        return stored

    async def delete(self, api_version: str, kind: str, namespace: str | None, name: str) -> None:
        self.log.append(("delete", kind, name))
        if self.objects.pop((kind, namespace or "", name), None) is None:
            raise KubeError(404, '{"message": "not found"}', f"delete {kind} {name}")

    async def serves(self, api_version: str, plural: str) -> bool:
        return plural in self.served

    async def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict | None:
        obj = self.objects.get((kind, namespace or "", name))
        return copy.deepcopy(obj) if obj is not None else None

    async def list(self, api_version: str, kind: str, namespace: str | None, selector: str = "") -> list[dict]:
        want = dict(s.split("=", 1) for s in selector.split(",") if "=" in s)
        return [copy.deepcopy(o) for (k, ns, _), o in self.objects.items() if k == kind and ns == namespace
                and all(o["metadata"].get("labels", {}).get(lk) == lv for lk, lv in want.items())]

    async def create(self, obj: dict) -> dict | None:
        meta = obj["metadata"]
        key = (obj["kind"], meta.get("namespace", ""), meta["name"])
        if obj["kind"] == "Event":
            self.log.append(("event", obj["reason"], obj["message"]))
        else:
            self.log.append(("create", obj["kind"], meta["name"]))
        if key in self.objects:
            return None
        obj = copy.deepcopy(obj)
        if "stringData" in obj:   # as the API server stores a Secret
            obj["data"] = {k: base64.b64encode(v.encode()).decode() for k, v in obj.pop("stringData").items()}
        return self.store(obj)

    async def patch(self, api_version: str, kind: str, namespace: str, name: str, body, subresource: str = "",
                    json_patch: bool = False) -> dict:
        key = (kind, namespace, name)
        if kind != "Event":
            self.log.append(("patch", kind, name, copy.deepcopy(body)))
        cur = self.objects.get(key)
        if cur is None:
            raise KubeError(404, '{"message": "not found"}', f"patch {kind} {name}")
        if json_patch:   # the ops used on annotations: test, remove
            for op in body:
                ann = cur["metadata"].setdefault("annotations", {})
                k = op["path"].rsplit("/", 1)[1].replace("~1", "/").replace("~0", "~")
                if op["op"] == "test" and ann.get(k) != op["value"]:
                    raise KubeError(422, '{"message": "test failed"}', f"patch {kind} {name}")
                if op["op"] == "remove":
                    ann.pop(k, None)
            stored = self.store(cur)
            self.feed(stored)
            return stored
        for part in ("labels", "annotations"):   # a merge patch: null removes the key
            into = cur["metadata"].setdefault(part, {})
            for k, v in ((body.get("metadata") or {}).get(part) or {}).items():
                if v is None:
                    into.pop(k, None)
                else:
                    into[k] = v
        stored = self.store(cur)
        self.feed(stored)
        return stored

    async def close(self) -> None:
        pass


@dataclass
class Agent:
    """One engine as its agent reports it."""
    pod: str
    role: str                  # prompt | decoder
    cluster_id: int
    ip: str
    boot_id: str = "boot-1"
    initialized: bool = True
    links: dict[int, dict] = field(default_factory=dict)   # decoder: cluster id -> LinkState dict
    incoming: set[int] = field(default_factory=set)
    draining: bool = False
    in_flight: int = 0
    pending_kv: int = 0
    switchable: bool = True
    broken: str | None = None       # AgentCallError kind every call raises (AgentUnreachable, AgentBadReply)

    def status(self) -> AgentStatus:
        return AgentStatus(pod=self.pod, role=self.role, cluster_id=self.cluster_id, boot_id=self.boot_id,
                           backend="sim", initialized=self.initialized, ip=self.ip, port=26000, model_id=0,
                           links=list(self.links.values()), incoming=sorted(self.incoming),
                           load=Load(in_flight=self.in_flight, pending_kv=self.pending_kv, max_batch=4),
                           draining=self.draining, switchable=self.switchable, cache_desc=DESC)


class FakeAgents:
    """The agent client, over scripted agents keyed by URL."""

    def __init__(self, log: Log):
        self.log = log
        self.agents: dict[str, Agent] = {}
        self.link_codes: dict[tuple[int, int], str] = {}   # (decoder cid, prefill cid) -> code link answers
        self.verify_ok = True
        self.metrics = OperatorMetrics()

    def by_cid(self) -> dict[int, Agent]:
        return {a.cluster_id: a for a in self.agents.values()}

    def _agent(self, op: str, base: str) -> Agent:
        a = self.agents[base]
        self.log.append((op, a.pod))
        if a.broken == "AgentBadReply":
            raise AgentCallError("AgentBadReply", f"{base}: answered 200 with a body that is not JSON: b'<html>'")
        if a.broken:
            raise AgentCallError(a.broken, f"{base}: ConnectError: connection refused")
        return a

    async def status(self, base: str, token: str, limiter=None) -> AgentStatus:
        return self._agent("agent.status", base).status()

    async def init(self, base: str, token: str, limiter=None) -> AgentStatus:
        a = self._agent("agent.init", base)
        a.initialized = True
        return a.status()

    async def link(self, base: str, token: str, peers, timeout_ms: int, limiter=None) -> LinkResult:
        d = self._agent("agent.link", base)
        rets = {}
        for p in peers:
            code = self.link_codes.get((d.cluster_id, p.cluster_id), "LLM_SUCCESS")
            rets[p.name] = code
            if code == "LLM_SUCCESS":
                d.links[p.cluster_id] = {"name": p.name, "cluster_id": p.cluster_id, "ip": p.ip, "port": p.port,
                                         "code": "LLM_SUCCESS", "healthy": True, "peer_boot_id": p.boot_id}
                self.by_cid()[p.cluster_id].incoming.add(d.cluster_id)
        return LinkResult(ret="LLM_SUCCESS" if all(c == "LLM_SUCCESS" for c in rets.values()) else "LLM_FAILED",
                          rets=rets, duration_ms=1.0)

    async def unlink(self, base: str, token: str, peers, force: bool = False, limiter=None) -> LinkResult:
        d = self._agent("agent.force_unlink" if force else "agent.unlink", base)
        rets = {}
        for p in peers:
            rets[p.name] = "LLM_SUCCESS" if d.links.pop(p.cluster_id, None) else "LLM_NOT_YET_LINK"
            peer = self.by_cid().get(p.cluster_id)
            if peer is not None:
                peer.incoming.discard(d.cluster_id)
        return LinkResult(ret="LLM_SUCCESS", rets=rets)

    async def verify(self, base: str, token: str, peer, limiter=None) -> VerifyResult:
        d = self._agent("agent.verify", base)
        ok = self.verify_ok and peer.cluster_id in d.links
        return VerifyResult(ok=ok, code="LLM_SUCCESS" if ok else "LLM_KV_CACHE_NOT_EXIST", prefill=peer.name,
                            decoder=d.pod, bytes=4096 if ok else 0, pull_ms=0.5,
                            message="" if ok else "no cache under the probe key")

    async def drain(self, base: str, token: str, limiter=None) -> DrainResult:
        a = self._agent("agent.drain", base)
        a.draining = True
        return DrainResult(draining=True, in_flight=a.in_flight, pending_kv=a.pending_kv,
                           drained=not (a.in_flight or a.pending_kv))

    async def undrain(self, base: str, token: str, limiter=None) -> DrainResult:
        a = self._agent("agent.undrain", base)
        a.draining = False
        return DrainResult(draining=False, in_flight=a.in_flight, pending_kv=a.pending_kv, drained=False)

    async def switch_role(self, base: str, token: str, role: str, limiter=None) -> AgentStatus:
        a = self._agent("agent.switch_role", base)
        if a.links or a.incoming:
            raise AgentCallError("AgentError", "LLM_EXIST_LINK: unlink every cluster first", "LLM_EXIST_LINK")
        a.role = role
        return a.status()

    async def gateway_stats(self, base: str):
        return None

    async def close(self) -> None:
        pass


def pod(name: str, group: str, index: int, ip: str, ready: bool = True, role: str | None = None,
        uid: str | None = None) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "ns", "uid": uid or f"uid-{name}",
                         "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": f"x-{group}",
                                              "uid": f"uid-StatefulSet-x-{group}", "controller": True}],
                         "labels": {"pdoperator.io/deployment": "x", "pdoperator.io/group": group,
                                    "pdoperator.io/role": role or group,
                                    "apps.kubernetes.io/pod-index": str(index)},
                         "annotations": {"pdoperator.io/assigned-role": role or group}},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                       "containerStatuses": [{"state": {"running": {}}, "restartCount": 0}]}}
