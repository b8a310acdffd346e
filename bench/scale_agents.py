"""Many fake agents and a fake Node, from one process, for the scale harness (bench_scale.py).

In the style of kwok: a Node is registered that no node agent runs (tainted, so only pods that
tolerate the taint land there), and this process plays its kubelet for the pods scheduled on it.
It marks each one Running and Ready with a pod IP it chooses and the Ascend device annotation
the local device plugin writes (pd_localcluster.devices), so no process is started per pod.

Each such pod gets a fake agent answering the real agent HTTP API (pd_agent.routes, the bodies
of pd_contract.agent_api) on <pod IP>:8080, where the operator dials it, behind the agent's own
auth middleware fed with the tokens the pod's env resolves to (the Secrets the operator made).
The answers are scripted per rank as a settled pod of TP ranks reports them: initialised, every
rank on its device IP, links made when asked (rank r to the peer's rank it pairs with) and KV
probes verified. Nothing moves bytes: the point is the operator's cost, not the data path.

    python bench/scale_agents.py --kubeconfig KC --node scale-fake-node --npus 6400 --stats-addr 127.0.0.1:PORT

GET /stats on --stats-addr: pods served and agent calls by operation (counted since start)."""
from __future__ import annotations

import argparse
import asyncio
import contextvars
import datetime as dt
import ipaddress
import json
import logging
import signal
import socket
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

from aiohttp import web

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pd_agent import devices as agent_devices  # noqa: E402
from pd_agent.front import rank_map  # noqa: E402
from pd_agent.http import METRICS, api_routes, auth_middleware, error_middleware, error_reply  # noqa: E402
from pd_agent.identity import Identity  # noqa: E402
from pd_agent.metrics import AgentMetrics  # noqa: E402
from pd_agent.routes import ROUTES, AgentService  # noqa: E402
from pd_contract.agent_api import (  # noqa: E402
    AgentStatus,
    DrainResult,
    LinkResult,
    LinkState,
    Peer,
    ProbeResponse,
    RankInfo,
    RankLinkState,
    RankVerify,
    VerifyResult,
)
from pd_localcluster import devices as dev  # noqa: E402
from pd_localcluster.kubeapi import ApiError, KubeApi  # noqa: E402
from pd_localcluster.podspec import ConfigError, referenced_objects, resolve_env  # noqa: E402

log = logging.getLogger("scale-agents")
AGENT_PORT = 8080
FAKE_TAINT = {"key": "kwok.x-k8s.io/node", "value": "fake", "effect": "NoSchedule"}
FAKE_LABEL = "pdoperator.io/scale-fake-node"
# Pod IPs 127.<octet>.x.y. The local clusters take second octets 100..249 (cluster.pod_ip_base
# plus node index) and the test agents 127.60; 250 is free. Device IPs use the same prefix with
# third octets from devices.DEVICE_THIRD_OCTET up, as the local device plugin does.
DEFAULT_OCTET = 250
PROBE_BYTES = 4096      # what a verified rank pair reports pulling
START_CONCURRENCY = 32  # pods brought up at once (API writes in flight)
HEARTBEAT_S = 10.0
CURRENT: contextvars.ContextVar[FakeAgent] = contextvars.ContextVar("fake_agent")


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class FakeAgent:
    """One pod's agent: the identity its env gives, its ranks on the annotation's device IPs,
    and the links and drain flag the operator set."""

    def __init__(self, fleet: Fleet, namespace: str, identity: Identity, tp: int,
                 ranks: list[tuple[int | None, str, int]], pod_ip: str, source: str):
        self.fleet, self.namespace, self.id, self.tp, self.pod_ip = fleet, namespace, identity, tp, pod_ip
        self.source = source
        self.role = identity.role
        self.boot_id = uuid.uuid4().hex
        base = identity.cluster_id      # rank 0's id names the pod; ranks take a consecutive block
        self.ranks = [RankInfo(rank=r, cluster_id=base + r, device_id=d, ip=ip, port=port,
                               initialized=True, registered=True) for r, (d, ip, port) in enumerate(ranks)]
        self.links: dict[str, tuple[Peer, float]] = {}   # peer pod -> the peer as linked, since
        self.incoming: set[int] = set()                   # prompt side: decoder ids linked to it
        self.draining = False
        self.faults: dict = {}
        self.auth = auth_middleware(identity.token, identity.data_token, identity.peer_token)
        self._status: dict | None = None

    @property
    def pod(self) -> str:
        return self.id.pod

    def changed(self) -> None:
        self._status = None

    def _link_state(self, peer: Peer, since: float) -> LinkState:
        ranks = None
        ip, port = peer.ip, peer.port
        if peer.ranks:
            pairs = [peer.ranks[rank_map(self.tp, len(peer.ranks), r)] for r in range(self.tp)]
            ranks = [RankLinkState(rank=r, cluster_id=ep.cluster_id, ip=ep.ip, port=ep.port, code="LLM_SUCCESS")
                     for r, ep in enumerate(pairs)]
            ip, port = pairs[0].ip, pairs[0].port
        return LinkState(name=peer.name, cluster_id=peer.cluster_id, ip=ip, port=port, code="LLM_SUCCESS",
                         since=since, healthy=True, peer_boot_id=peer.boot_id, ranks=ranks)

    def status(self) -> dict:
        """The report, as JSON, rebuilt only after a change (most calls are settled polls)."""
        if self._status is None:
            r0 = self.ranks[0]
            st = AgentStatus(
                pod=self.pod, role=self.role, cluster_id=self.id.cluster_id, boot_id=self.boot_id,
                backend=self.id.backend, initialized=True, ip=r0.ip, port=r0.port, model_id=self.id.model_id,
                links=[self._link_state(p, t) for _, (p, t) in sorted(self.links.items())],
                incoming=sorted(self.incoming), draining=self.draining, switchable=self.id.switchable,
                cache_desc=self.id.cache_desc, tensor_parallel=self.tp, ranks=self.ranks,
                device_ips=self.source)
            self._status = st.model_dump(mode="json")
        return self._status


class Fleet(AgentService):
    """Every fake agent behind one aiohttp app: the route table's handlers find the pod by the
    address the call came in on, and its tokens are checked by the agent's own middleware."""

    where = "front"

    def __init__(self) -> None:
        self.by_ip: dict[str, FakeAgent] = {}
        self.by_pod: dict[tuple[str, str], FakeAgent] = {}
        self.calls: Counter[str] = Counter()
        self.metrics = AgentMetrics()
        self.app = web.Application(middlewares=[self._dispatch, error_middleware])
        self.app[METRICS] = self.metrics
        self.app.add_routes(api_routes(self))
        self.ops = {(r.method, r.path): r.op for r in ROUTES}
        self.runner = web.AppRunner(self.app, access_log=None, keepalive_timeout=75)
        self.sites: dict[str, web.TCPSite] = {}

    async def start(self) -> None:
        await self.runner.setup()

    @web.middleware
    async def _dispatch(self, request: web.Request, handler):
        sock = request.transport.get_extra_info("sockname") if request.transport else None
        agent = self.by_ip.get(sock[0]) if sock else None
        if agent is None:
            return error_reply(404, "NoSuchPod", "no fake pod on this address")
        route = request.match_info.route.resource
        self.calls[route.canonical.rsplit("/", 1)[-1] if route is not None else "unmatched"] += 1
        CURRENT.set(agent)
        return await agent.auth(request, handler)

    async def serve(self, agent: FakeAgent) -> None:
        site = web.TCPSite(self.runner, agent.pod_ip, AGENT_PORT, backlog=512)
        await site.start()
        self.sites[agent.pod_ip] = site
        self.by_ip[agent.pod_ip] = agent
        self.by_pod[(agent.namespace, agent.pod)] = agent

    async def retire(self, pod_ip: str) -> None:
        agent = self.by_ip.pop(pod_ip, None)
        if agent is not None and self.by_pod.get((agent.namespace, agent.pod)) is agent:
            del self.by_pod[(agent.namespace, agent.pod)]
        site = self.sites.pop(pod_ip, None)
        if site is not None:
            await site.stop()

    # ---- the agent API, answered by the pod the call reached ----
    async def current_status(self) -> AgentStatus:
        return AgentStatus.model_validate(CURRENT.get().status())

    async def healthz(self, request: web.Request) -> web.Response:
        a = CURRENT.get()
        return web.json_response({"ok": True, "role": a.role, "boot_id": a.boot_id, "last_error": ""})

    async def livez(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text="", content_type="text/plain")

    async def get_status(self):
        return CURRENT.get().status()

    async def init(self):
        return CURRENT.get().status()

    async def link(self, req):
        a = CURRENT.get()
        t = time.time()
        for p in req.peers:
            if p.ranks and max(a.tp, len(p.ranks)) % min(a.tp, len(p.ranks)):
                return LinkResult(ret="LLM_PARAM_INVALID", rets={q.name: "LLM_PARAM_INVALID" for q in req.peers})
        for p in req.peers:
            a.links[p.name] = (p, t)
            peer = self.by_pod.get((a.namespace, p.name))
            if peer is not None:
                peer.incoming.add(a.id.cluster_id)
                peer.changed()
        a.changed()
        return LinkResult(ret="LLM_SUCCESS", rets={p.name: "LLM_SUCCESS" for p in req.peers}, duration_ms=1.0,
                          rank_rets={p.name: ["LLM_SUCCESS"] * a.tp for p in req.peers})

    async def unlink(self, req):
        a = CURRENT.get()
        rets = {}
        for p in req.peers:
            rets[p.name] = "LLM_SUCCESS" if a.links.pop(p.name, None) else "LLM_NOT_YET_LINK"
            peer = self.by_pod.get((a.namespace, p.name))
            if peer is not None:
                peer.incoming.discard(a.id.cluster_id)
                peer.changed()
        a.changed()
        return LinkResult(ret="LLM_SUCCESS", rets=rets, rank_rets={n: [c] * a.tp for n, c in rets.items()})

    async def switch_role(self, req):
        a = CURRENT.get()
        a.role = req.role
        a.changed()
        return None

    async def verify(self, req):
        a = CURRENT.get()
        peer_tp = len(req.peer.ranks) if req.peer.ranks else 1
        linked = req.peer.name in a.links
        code = "LLM_SUCCESS" if linked else "LLM_NOT_YET_LINK"
        ranks = [RankVerify(rank=r, peer_rank=rank_map(a.tp, peer_tp, r), ok=linked, code=code,
                            bytes=PROBE_BYTES if linked else 0, pull_ms=0.2 if linked else 0)
                 for r in (req.ranks if req.ranks is not None else range(a.tp))]
        return VerifyResult(ok=linked, code=code, message="" if linked else "rank 0: not linked",
                            prefill=req.peer.name, decoder=a.pod, bytes=sum(x.bytes for x in ranks),
                            pull_ms=0.2 if linked else 0, ranks=ranks)

    async def probe(self, req):
        a = CURRENT.get()
        return ProbeResponse(prompt_cluster_id=a.id.cluster_id, req_id=req.req_id, model_id=a.id.model_id,
                             sha256="0" * 64, bytes=PROBE_BYTES)

    async def drain(self, req):
        a = CURRENT.get()
        a.draining = True
        a.changed()
        return DrainResult(draining=True, in_flight=0, pending_kv=0, drained=True)

    async def undrain(self):
        a = CURRENT.get()
        a.draining = False
        a.changed()
        return DrainResult(draining=False, in_flight=0, pending_kv=0, drained=False)

    async def notify(self, req):
        return {}

    async def set_faults(self, req):
        CURRENT.get().faults.update(req.model_dump(exclude_none=True))
        return None

    async def get_faults(self):
        return dict(CURRENT.get().faults)

    async def prefill(self, req):
        raise web.HTTPNotImplemented(text=json.dumps({"code": "NotServing", "message": "a fake agent serves "
                                                      "no requests"}), content_type="application/json")

    async def decode(self, req, request):
        raise web.HTTPNotImplemented(text=json.dumps({"code": "NotServing", "message": "a fake agent serves "
                                                      "no requests"}), content_type="application/json")


class IPs:
    """Pod IPs on the fake node, skipping any address something else already listens on."""

    def __init__(self, octet: int):
        self.octet, self.next, self.used = octet, 1, set()

    def allocate(self) -> str:
        while True:
            n, self.next = self.next, self.next + 1
            if n >= dev.DEVICE_THIRD_OCTET * 254:
                raise RuntimeError("no pod IPs left on the fake node")
            ip = f"127.{self.octet}.{n // 254}.{n % 254 + 1}"
            if ip in self.used:
                continue
            with socket.socket() as s:
                try:
                    s.bind((ip, AGENT_PORT))
                except OSError:
                    continue
            self.used.add(ip)
            return ip

    def release(self, ip: str) -> None:
        self.used.discard(ip)


class FakeNode:
    """The kubelet of one fake Node: registers it, keeps it Ready, and for each pod bound to it
    allocates NPUs (the annotation), starts its fake agent and reports it Running and Ready."""

    def __init__(self, api: KubeApi, fleet: Fleet, name: str, npus: int, resource: str, octet: int):
        self.api, self.fleet, self.name, self.resource = api, fleet, name, resource
        self.devices = dev.DeviceAllocator(npus)
        self.ips = IPs(octet)
        self.octet = octet
        self.host_ip = f"127.{octet}.255.254"
        self.pods: dict[str, str] = {}       # uid -> pod IP (started)
        self.starting: set[str] = set()
        self.deleting: set[str] = set()
        self.gate = asyncio.Semaphore(START_CONCURRENCY)
        self.objects: dict[tuple[str, str, str], dict | None] = {}   # (kind, ns, name) -> ConfigMap/Secret
        self.tasks: set[asyncio.Task] = set()
        self.errors: Counter[str] = Counter()

    def node_status(self) -> dict:
        ts = now_iso()
        cap = {"cpu": "100000", "memory": "100Ti", "pods": "100000", "ephemeral-storage": "100Ti",
               self.resource: str(self.devices.count)}
        cond = lambda t, s, r: {"type": t, "status": s, "reason": r, "message": "fake node (scale harness)",  # noqa: E731
                                "lastHeartbeatTime": ts, "lastTransitionTime": ts}
        return {"capacity": cap, "allocatable": cap,
                "conditions": [cond("MemoryPressure", "False", "KubeletHasSufficientMemory"),
                               cond("DiskPressure", "False", "KubeletHasNoDiskPressure"),
                               cond("PIDPressure", "False", "KubeletHasSufficientPID"),
                               cond("Ready", "True", "KubeletReady")],
                "addresses": [{"type": "InternalIP", "address": self.host_ip},
                              {"type": "Hostname", "address": self.name}],
                "nodeInfo": {"machineID": uuid.uuid5(uuid.NAMESPACE_DNS, self.name).hex,
                             "systemUUID": str(uuid.uuid5(uuid.NAMESPACE_DNS, self.name)), "bootID": "fake",
                             "kernelVersion": "fake", "osImage": "fake node (pd-operator scale harness)",
                             "containerRuntimeVersion": "fake://none", "kubeletVersion": "v1.36.3-fake",
                             "kubeProxyVersion": "", "operatingSystem": "linux", "architecture": "amd64"}}

    async def register(self) -> None:
        body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": self.name, "labels": {
            "kubernetes.io/hostname": self.name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
            "type": "kwok", FAKE_LABEL: "true"}}, "spec": {"taints": [FAKE_TAINT]}}
        try:
            await self.api.create("/api/v1/nodes", body)
        except ApiError as e:
            if e.status != 409:
                raise
        await self.api.patch(f"/api/v1/nodes/{self.name}/status", {"status": self.node_status()})
        log.info("registered node %s (%d %s)", self.name, self.devices.count, self.resource)

    async def heartbeat(self) -> None:
        lease = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{self.name}"
        while True:
            spec = {"holderIdentity": self.name, "leaseDurationSeconds": 40,
                    "renewTime": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")}
            try:
                try:
                    await self.api.patch(lease, {"spec": spec})
                except ApiError as e:
                    if e.status != 404:
                        raise
                    await self.api.create("/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases",
                                          {"metadata": {"name": self.name}, "spec": spec})
                await self.api.patch(f"/api/v1/nodes/{self.name}/status", {"status": self.node_status()})
            except Exception as e:  # noqa: BLE001 - keep beating
                log.warning("heartbeat: %s", e)
            await asyncio.sleep(HEARTBEAT_S)

    def spawn(self, coro) -> None:
        t = asyncio.create_task(coro)
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)

    async def watch(self) -> None:
        sel = {"fieldSelector": f"spec.nodeName={self.name}"}
        while True:
            try:
                lst = await self.api.get("/api/v1/pods", sel)
                seen = set()
                for pod in lst["items"]:
                    seen.add(pod["metadata"]["uid"])
                    self.handle("MODIFIED", pod)
                for uid in [u for u in self.pods if u not in seen]:
                    self.spawn(self.gone(uid))
                rv = lst["metadata"]["resourceVersion"]
                while True:
                    async for ev in self.api.watch("/api/v1/pods", {**sel, "resourceVersion": rv}):
                        if ev["type"] == "ERROR":
                            raise ApiError(ev["object"].get("code", 500), str(ev["object"]))
                        rv = ev["object"]["metadata"]["resourceVersion"]
                        if ev["type"] != "BOOKMARK":
                            self.handle(ev["type"], ev["object"])
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - relist on any watch failure
                log.info("pod watch restarting: %s", e)
                await asyncio.sleep(1)

    def handle(self, etype: str, pod: dict) -> None:
        uid = pod["metadata"]["uid"]
        if etype == "DELETED":
            self.spawn(self.gone(uid))
        elif pod["metadata"].get("deletionTimestamp"):
            if uid not in self.deleting:
                self.deleting.add(uid)
                self.spawn(self.delete(pod))
        elif uid not in self.pods and uid not in self.starting:
            self.starting.add(uid)
            self.spawn(self.start(pod))

    async def _object(self, kind: str, ns: str, name: str) -> dict | None:
        key = (kind, ns, name)
        if self.objects.get(key) is None:
            try:
                self.objects[key] = await self.api.get(f"/api/v1/namespaces/{ns}/{kind}/{name}")
            except ApiError as e:
                if e.status != 404:
                    raise
                return None
        return self.objects[key]

    async def start(self, pod: dict) -> None:
        meta = pod["metadata"]
        uid, ns, name = meta["uid"], meta["namespace"], meta["name"]
        ip = None
        try:
            async with self.gate:
                npus = dev.requested(pod, self.resource)
                ids = self.devices.allocate(uid, npus) if npus else []
                value = dev.annotation(name, self.host_ip, ids, self.octet)
                if ids and dev.parse_annotation((meta.get("annotations") or {}).get(dev.ASCEND_ANNOTATION)) \
                        != dev.parse_annotation(value):
                    patch = {"metadata": {"uid": uid, "annotations": {dev.ASCEND_ANNOTATION: value}}}
                    pod = await self.api.patch(f"/api/v1/namespaces/{ns}/pods/{name}", patch)
                ip = self.ips.allocate()
                agent = await self._agent(pod, ip, bool(ids))
                await self.fleet.serve(agent)
                self.pods[uid] = ip
                await self.api.patch(f"/api/v1/namespaces/{ns}/pods/{name}/status",
                                     {"metadata": {"uid": uid}, "status": self._running(pod, ip)}, strategic=True)
        except (ApiError, ConfigError, ValueError, OSError, dev.NotEnoughDevices) as e:
            self.errors[type(e).__name__] += 1
            if uid in self.pods:   # served, but the status write failed: stop it and start over
                await self._stop(uid)
            elif ip is not None:
                self.ips.release(ip)
            self.devices.release(uid)
            gone = isinstance(e, ApiError) and e.status == 404
            if not gone:
                log.warning("pod %s/%s: %s (retrying)", ns, name, e)
                # a ConfigMap or Secret the operator has not made yet: forget the misses, try again
                self.objects = {k: v for k, v in self.objects.items() if v is not None}
                await asyncio.sleep(1)
                if uid not in self.deleting:
                    self.spawn(self.start(pod))
                    return
        self.starting.discard(uid)

    async def _agent(self, pod: dict, ip: str, has_devices: bool) -> FakeAgent:
        """The pod's identity from its own env, as the agent would read it; its ranks on the
        annotation's device IPs (a pod without NPUs: the pod IP, a port per rank, as the simulator)."""
        container = next(c for c in pod["spec"]["containers"]
                         if any(e["name"] == "PD_AGENT_TOKEN" for e in c.get("env") or []))
        cm_names, secret_names = referenced_objects(container)
        ns = pod["metadata"]["namespace"]
        cms = {n: await self._object("configmaps", ns, n) for n in cm_names}
        secrets = {n: await self._object("secrets", ns, n) for n in secret_names}
        env = resolve_env(pod, container, ip, self.host_ip, cms, secrets)
        ident = Identity.from_env(env)
        tp = int(env.get("PD_TENSOR_PARALLEL") or 1)
        if has_devices:
            pairs = agent_devices.parse_annotation((pod["metadata"].get("annotations") or {})[dev.ASCEND_ANNOTATION])
            if len(pairs) < tp or not all(d_ip for _, d_ip in pairs[:tp]):
                raise ValueError(f"the device annotation lists {len(pairs)} devices for {tp} ranks")
            ranks = [(d, d_ip or "", ident.port) for d, d_ip in pairs[:tp]]
            source = "annotation"
        else:
            ranks = [(None, ip, ident.port + r) for r in range(tp)]
            source = "pod-ip"
        return FakeAgent(self.fleet, ns, ident, tp, ranks, ip, source)

    def _running(self, pod: dict, ip: str) -> dict:
        ts = now_iso()
        cond = lambda t: {"type": t, "status": "True", "lastTransitionTime": ts, "lastProbeTime": None}  # noqa: E731
        return {"phase": "Running", "hostIP": self.host_ip, "hostIPs": [{"ip": self.host_ip}],
                "podIP": ip, "podIPs": [{"ip": ip}], "startTime": ts,
                "conditions": [cond(t) for t in ("PodReadyToStartContainers", "Initialized", "ContainersReady",
                                                 "Ready")],
                "containerStatuses": [{"name": c["name"], "image": c.get("image", ""), "imageID": "fake://",
                                       "containerID": f"fake://{uuid.uuid4().hex}", "ready": True, "started": True,
                                       "restartCount": 0, "state": {"running": {"startedAt": ts}}, "lastState": {}}
                                      for c in pod["spec"]["containers"]]}

    async def delete(self, pod: dict) -> None:
        """Graceful deletion: the agent stops at once (nothing to drain), then the pod goes."""
        meta = pod["metadata"]
        while meta["uid"] in self.starting:
            await asyncio.sleep(0.2)
        await self._stop(meta["uid"])
        try:
            await self.api.delete(f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                                  {"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}})
        except ApiError as e:
            if e.status not in (404, 409):
                log.warning("deleting %s/%s: %s", meta["namespace"], meta["name"], e)

    async def gone(self, uid: str) -> None:
        await self._stop(uid)
        self.deleting.discard(uid)

    async def _stop(self, uid: str) -> None:
        ip = self.pods.pop(uid, None)
        if ip is not None:
            await self.fleet.retire(ip)
            self.ips.release(ip)
        self.devices.release(uid)


async def serve_stats(fleet: Fleet, node: FakeNode, addr: str) -> web.AppRunner:
    async def stats(_: web.Request) -> web.Response:
        return web.json_response({"pods": len(node.pods), "starting": len(node.starting),
                                  "calls": dict(fleet.calls), "errors": dict(node.errors)})
    app = web.Application()
    app.router.add_get("/stats", stats)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    host, _, port = addr.rpartition(":")
    await web.TCPSite(runner, host, int(port)).start()
    return runner


async def run(kubeconfig: Path, name: str, npus: int, resource: str, octet: int, stats_addr: str) -> None:
    ipaddress.ip_address(f"127.{octet}.0.1")
    api = KubeApi(kubeconfig)
    fleet = Fleet()
    await fleet.start()
    node = FakeNode(api, fleet, name, npus, resource, octet)
    await node.register()
    stats = await serve_stats(fleet, node, stats_addr)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = [asyncio.create_task(node.heartbeat()), asyncio.create_task(node.watch())]
    log.info("serving fake pods of node %s; stats on http://%s/stats", name, stats_addr)
    await stop.wait()
    for t in tasks + list(node.tasks):
        t.cancel()
    await asyncio.gather(*tasks, *node.tasks, return_exceptions=True)
    try:   # the fake node goes with its kubelet: nothing is left scheduled on a node no one serves
        await api.delete(f"/api/v1/nodes/{name}")
    except ApiError:
        pass
    await stats.cleanup()
    await fleet.runner.cleanup()
    await api.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kubeconfig", type=Path, required=True)
    ap.add_argument("--node", default="scale-fake-node")
    ap.add_argument("--npus", type=int, default=6400)
    ap.add_argument("--npu-resource", default=dev.DEFAULT_RESOURCE)
    ap.add_argument("--octet", type=int, default=DEFAULT_OCTET, help="second octet of the fake pods' IPs")
    ap.add_argument("--stats-addr", default="127.0.0.1:18099")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    asyncio.run(run(args.kubeconfig, args.node, args.npus, args.npu_resource, args.octet, args.stats_addr))


if __name__ == "__main__":
    main()
