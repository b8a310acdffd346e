"""The local node agent: a stand-in for the kubelet that runs the pods bound to the local
Nodes on this machine, as processes or from their images under Docker (runtime.py).

Each pod gets its own loopback IP (127.<base+n>.x.y on node n; the base differs per
cluster directory so two local clusters do not hand out the same addresses) which its processes find in
``PD_LOCAL_POD_IP`` (the stand-in for a network namespace: servers bind to it). Likewise a
process has no mount namespace: when a container mounts a downwardAPI volume, its files are
kept under the pod's directory and ``PD_LOCAL_ROOT`` names a directory in which each
mountPath resolves to them (``$PD_LOCAL_ROOT/<mountPath>``); a workload reads a mounted
file there when the variable is set (under Docker the volume is bind-mounted, unset).

The agent plays the Ascend device plugin too (devices.py): each node advertises
``--npus-per-node`` devices of ``--npu-resource`` (default 32 ``huawei.com/Ascend910``); a
pod that requests them gets the lowest free device ids before its containers start, in its
``ascend.kubectl.kubernetes.io/ascend-910-configuration`` annotation (device IPs on
loopback) and in ``ASCEND_VISIBLE_DEVICES``, and releases them when it ends. The agent
registers the Nodes and keeps them Ready (status + Lease), resolves env, starts the
container's command from the image table, runs readiness/liveness probes, restarts per
restartPolicy with back-off, reports pod status, serves the kubelet's container-log
endpoint (so ``kubectl logs`` works), and completes graceful deletion."""
from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import platform
import shutil
import signal
import ssl
import sys
import uuid
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web

from . import devices as dev
from .kubeapi import ApiError, KubeApi
from .pki import node_ip
from .podspec import (
    ConfigError,
    ContainerState,
    UnknownImage,
    backoff_seconds,
    claim_path,
    downward_api_files,
    object_volume_files,
    pod_phase,
    referenced_objects,
    resolve_env,
    should_restart,
    with_claims,
)
from .runtime import Running, Runtime, volume_dir
from .runtime import make as make_runtime

log = logging.getLogger("node-agent")
K8S_VERSION = os.environ.get("PD_K8S_VERSION", "v1.36.3")
NODE_CAPACITY = {"cpu": "16", "memory": "32Gi", "pods": "110", "ephemeral-storage": "100Gi"}
NPU_RETRY_SECONDS = 3
# how often configMap and secret volumes follow their objects (a kubelet: about a minute)
OBJECT_VOLUME_SYNC_S = 3


def replace_file(path: Path, content: bytes) -> None:
    """Write a volume's file atomically, and only when it changed (a reader never sees half)."""
    if path.exists() and path.read_bytes() == content:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(content)
    tmp.chmod(0o644)  # readable by a container's own user under Docker
    os.replace(tmp, path)


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class IPAllocator:
    # third octets from devices.DEVICE_THIRD_OCTET up are the node's device IPs
    LIMIT = dev.DEVICE_THIRD_OCTET * 254

    def __init__(self, node_index: int, base: int = 100):
        self.prefix = base + node_index
        self.next = 1
        self.used: set[str] = set()

    def allocate(self) -> str:
        while True:
            n = self.next
            self.next = self.next + 1 if self.next + 1 < self.LIMIT else 1
            ip = f"127.{self.prefix}.{n // 254}.{n % 254 + 1}"
            if ip not in self.used:
                self.used.add(ip)
                return ip

    def release(self, ip: str) -> None:
        self.used.discard(ip)


class ContainerRun:
    """One container of a pod: its process, log files and state."""

    def __init__(self, worker: "PodWorker", spec: dict):
        self.worker = worker
        self.spec = spec
        self.name = spec["name"]
        self.cs = ContainerState(name=self.name, image=spec.get("image", ""))
        self.run: Running | None = None
        self.exited = True
        self.instance = 0  # bumps on every start, so log followers see the end of an instance
        self.log_dir = worker.dir / self.name
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.task: asyncio.Task | None = None
        self.kill_reason = ""
        self.env: dict[str, str] = {}  # what the running instance was started with

    def log_path(self, restart: int | None = None) -> Path:
        return self.log_dir / f"{self.cs.restart_count if restart is None else restart}.log"

    @property
    def running(self) -> bool:
        return self.run is not None and not self.exited

    async def supervise(self) -> None:
        w = self.worker
        pull_failures = 0
        while not w.deleting:
            spec = w.container_spec(self.name) or self.spec
            self.cs.image = spec.get("image", "")
            exit_code: int | None = None
            try:
                env = await w.container_env(spec)
                self.env = env
                # an image the runtime cannot run (no local command, not in Docker) raises
                # UnknownImage here, as a failed pull would
                self.run = await w.agent.runtime.start(
                    pod_uid=w.uid, pod_dir=w.dir, name=self.name, restart=self.cs.restart_count, spec=spec,
                    pod_spec=with_claims(w.pod["spec"], w.claims), env=env, log_path=self.log_path())
            except UnknownImage as e:
                reason = "ErrImagePull" if pull_failures == 0 else "ImagePullBackOff"
                self.cs.state = {"waiting": {"reason": reason, "message": str(e)}}
                if pull_failures == 0:
                    await w.event("Warning", "Failed", f"Failed to pull image: {e}")
                pull_failures += 1
                await w.report()
                await w.sleep_unless_deleted(backoff_seconds(pull_failures, 2, 10))
                continue
            except ConfigError as e:
                self.cs.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(e)}}
                await w.event("Warning", "Failed", f"Error: {e}")
                await w.report()
                await w.sleep_unless_deleted(3)
                continue
            except OSError as e:
                self.cs.state = {"terminated": {"exitCode": 128, "reason": "StartError", "message": str(e),
                                                "startedAt": now(), "finishedAt": now()}}
                exit_code = 128
                await w.report()
            pull_failures = 0
            if exit_code is None:
                exit_code = await self._run_once(spec)
            if w.deleting:
                break
            if not should_restart(w.restart_policy, exit_code):
                self.cs.done = True
                await w.report()
                if all(c.cs.done for c in w.containers):
                    w.release_devices()  # a finished pod holds no devices, as for the scheduler
                return
            delay = backoff_seconds(self.cs.restart_count)
            self.cs.last_state = dict(self.cs.state)
            self.cs.state = {"waiting": {
                "reason": "CrashLoopBackOff",
                "message": f"back-off {delay:.0f}s restarting failed container={self.name} "
                           f"pod={w.name}_{w.namespace}({w.uid})"}}
            await w.event("Warning", "BackOff", f"Back-off restarting failed container {self.name}")
            await w.report()
            await w.sleep_unless_deleted(delay)
            if w.deleting:
                break
            self.cs.restart_count += 1

    async def _run_once(self, spec: dict) -> int:
        w = self.worker
        self.exited = False
        self.instance += 1
        started = now()
        self.cs.container_id = self.run.id
        self.cs.state = {"running": {"startedAt": started}}
        self.cs.ready = "readinessProbe" not in spec
        self.kill_reason = ""
        await w.event("Normal", "Started", f"Started container {self.name} ({self.run.id})")
        await w.report()
        probes = [asyncio.create_task(self._probe_loop(spec[k], k))
                  for k in ("readinessProbe", "livenessProbe") if k in spec]
        code = await self.run.wait()
        self.exited = True
        for p in probes:
            p.cancel()
        self.cs.ready = False
        if code < 0:
            reason, code = "Error", 128 - code  # killed by signal N -> 128+N
        else:
            reason = "Completed" if code == 0 else "Error"
        self.cs.state = {"terminated": {
            "exitCode": code, "reason": self.kill_reason or reason, "startedAt": started,
            "finishedAt": now(), "containerID": self.cs.container_id}}
        await w.report()
        return code

    async def _probe_loop(self, probe: dict, kind: str) -> None:
        w = self.worker
        period = probe.get("periodSeconds", 10)
        timeout = probe.get("timeoutSeconds", 1)
        success_th = probe.get("successThreshold", 1)
        failure_th = probe.get("failureThreshold", 3)
        await asyncio.sleep(probe.get("initialDelaySeconds", 0))
        ok_run = fail_run = 0
        while self.running:
            ok = await self._probe_once(probe, timeout)
            ok_run, fail_run = (ok_run + 1, 0) if ok else (0, fail_run + 1)
            if kind == "readinessProbe":
                ready = self.cs.ready
                if ok_run >= success_th:
                    ready = True
                elif fail_run >= failure_th:
                    ready = False
                if ready != self.cs.ready:
                    self.cs.ready = ready
                    await w.report()
            elif fail_run >= failure_th:
                await w.event("Warning", "Unhealthy", f"Liveness probe failed {fail_run} times; restarting")
                self.kill_reason = "Error"
                await self.stop(probe.get("terminationGracePeriodSeconds") or 5)
                return
            await asyncio.sleep(period)

    async def _probe_once(self, probe: dict, timeout: float) -> bool:
        w = self.worker
        try:
            if "httpGet" in probe:
                hg = probe["httpGet"]
                port = w.resolve_port(self.spec, hg.get("port"))
                host = hg.get("host") or w.ip
                scheme = hg.get("scheme", "HTTP").lower()
                url = f"{scheme}://{host}:{port}{hg.get('path', '/')}"
                client = w.agent.http
                r = await client.get(url, timeout=timeout,
                                      headers={h["name"]: h["value"] for h in hg.get("httpHeaders", [])})
                return 200 <= r.status_code < 400
            if "tcpSocket" in probe:
                port = w.resolve_port(self.spec, probe["tcpSocket"].get("port"))
                _, writer = await asyncio.wait_for(
                    asyncio.open_connection(probe["tcpSocket"].get("host") or w.ip, port), timeout)
                writer.close()
                return True
            if "exec" in probe and self.run is not None:
                # the env the container started with: no API reads on every probe
                return await self.run.exec(probe["exec"]["command"], self.env, timeout) == 0
        except Exception:  # noqa: BLE001 - any failure is a failed probe
            return False
        return True

    async def stop(self, grace: float) -> None:
        if self.running:
            await self.run.stop(grace)


def _differs(seen: dict, reported: dict) -> bool:
    """The API's copy of a pod's status no longer says what this agent reported last."""
    conds = lambda st: {c["type"]: c["status"] for c in st.get("conditions", [])}  # noqa: E731
    return seen.get("phase") != reported["phase"] or seen.get("podIP") != reported["podIP"] or any(
        conds(seen).get(t) != s for t, s in conds(reported).items())


class PodWorker:
    def __init__(self, agent: "NodeAgent", pod: dict, node_index: int):
        self.agent = agent
        self.pod = pod
        meta = pod["metadata"]
        self.uid = meta["uid"]
        self.name = meta["name"]
        self.namespace = meta["namespace"]
        self.node = pod["spec"]["nodeName"]
        self.node_index = node_index
        self.dir = agent.root / "pods" / f"{self.namespace}_{self.name}_{self.uid}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ip = agent.ips[node_index].allocate()
        self.host_ip = node_ip(node_index)
        self.start_time = now()
        self.containers = [ContainerRun(self, c) for c in pod["spec"].get("containers", [])]
        self.deleting = False
        self._deleted = asyncio.Event()
        self._report_lock = asyncio.Lock()
        self._last_report: Any = None
        self._transitions: dict[str, tuple[str, str]] = {}
        self._kubeconfig: Path | None = None
        self._volumes_ready = False  # written once before the containers start, then on changes
        self._refresh: asyncio.Task | None = None   # configMap and secret volumes following their objects
        self.claims: dict[str, str] = {}  # claim name -> the directory behind it (podspec.claim_path)
        self.task: asyncio.Task | None = None
        self.npus = dev.requested(pod, agent.npu_resource)
        self.devices: list[int] = []
        if self.npus:
            self._readopt_devices()

    @property
    def allocator(self) -> dev.DeviceAllocator:
        return self.agent.devices[self.node_index]

    def _readopt_devices(self) -> None:
        """After a node-agent restart, the devices this node gave the pod stay its own. Runs
        as the worker is made, so a relist re-adopts every pod's before any new one allocates."""
        got = dev.parse_annotation((self.pod["metadata"].get("annotations") or {}).get(dev.ASCEND_ANNOTATION))
        if not got or got[0] != self.host_ip or len(got[1]) != self.npus:
            return
        try:
            self.allocator.restore(self.uid, got[1])
            self.devices = got[1]
        except ValueError as e:
            log.warning("pod %s/%s: not re-adopting its devices: %s", self.namespace, self.name, e)

    def release_devices(self) -> None:
        if self.devices:
            self.allocator.release(self.uid)
            self.devices = []

    async def _attach_devices(self) -> bool:
        """Allocate the pod's NPUs and annotate the pod with them, retrying while the node
        has too few free; False if the pod is deleted first."""
        warned = ""
        while not self.deleting:
            try:
                self.devices = self.allocator.allocate(self.uid, self.npus)
                value = dev.annotation(self.name, self.host_ip, self.devices, self.agent.ips[self.node_index].prefix,
                                       self.agent.superpods[self.node_index])
                annotations = self.pod["metadata"].get("annotations") or {}
                if dev.parse_annotation(annotations.get(dev.ASCEND_ANNOTATION)) != \
                        dev.parse_annotation(value):
                    pod = await self.agent.api.patch(
                        f"/api/v1/namespaces/{self.namespace}/pods/{self.name}",
                        {"metadata": {"uid": self.uid, "annotations": {dev.ASCEND_ANNOTATION: value}}})
                    self._accept(pod)
                return True
            except (dev.NotEnoughDevices, ApiError) as e:
                if isinstance(e, ApiError) and e.status == 404:
                    return False
                msg = f"allocating {self.npus} {self.agent.npu_resource}: {e}"
                if msg != warned:
                    await self.event("Warning", "NPUAllocationFailed", msg)
                    warned = msg
                await self.sleep_unless_deleted(NPU_RETRY_SECONDS)
        return False

    def _accept(self, pod: dict) -> bool:
        """Take a newer view of the pod (a watch event may arrive after the answer to a
        patch of ours: the older object must not undo what the patch wrote)."""
        try:
            if int(pod["metadata"]["resourceVersion"]) < int(self.pod["metadata"]["resourceVersion"]):
                return False
        except (KeyError, ValueError):
            pass
        self.pod = pod
        return True

    def write_volumes(self) -> None:
        """The files of the pod's downwardAPI volumes, each replaced atomically when it changes."""
        for v in self.pod["spec"].get("volumes") or []:
            if "downwardAPI" not in v:
                continue
            d = volume_dir(self.dir, v["name"])
            for rel, content in downward_api_files(self.pod, v, self.ip, self.host_ip).items():
                replace_file(d / rel, content.encode())

    async def _get(self, path: str) -> dict | None:
        try:
            return await self.agent.api.get(path)
        except ApiError as e:
            if e.status == 404:
                return None
            raise ConfigError(f"reading {path}: {e}") from e

    async def mount_volumes(self) -> None:
        """Before the containers start: an empty directory per emptyDir, the files of configMap and
        secret volumes (as they are now), and the directory behind each persistentVolumeClaim (its
        bound hostPath or local PersistentVolume). A ConfigError says why a volume cannot be mounted."""
        ns = self.namespace
        for v in self.pod["spec"].get("volumes") or []:
            d = volume_dir(self.dir, v["name"])
            if "emptyDir" in v:
                d.mkdir(parents=True, exist_ok=True)
                d.chmod(0o777)   # writable by a container's own user under Docker, as an emptyDir is
            elif "configMap" in v or "secret" in v:
                await self._write_object_volume(v)
            elif "persistentVolumeClaim" in v:
                claim = v["persistentVolumeClaim"]["claimName"]
                pvc = await self._get(f"/api/v1/namespaces/{ns}/persistentvolumeclaims/{claim}")
                volume = ((pvc or {}).get("spec") or {}).get("volumeName")
                pv = await self._get(f"/api/v1/persistentvolumes/{volume}") if volume else None
                self.claims[claim] = claim_path(ns, claim, pvc, pv)

    async def _write_object_volume(self, v: dict) -> None:
        """A configMap or secret volume's files as the object holds them now, each replaced
        atomically when it changed (a running container sees the update, as under a kubelet)."""
        kind, name = (("configmaps", v["configMap"].get("name")) if "configMap" in v
                      else ("secrets", v["secret"].get("secretName")))
        files = object_volume_files(v, await self._get(f"/api/v1/namespaces/{self.namespace}/{kind}/{name}"))
        d = volume_dir(self.dir, v["name"])
        d.mkdir(parents=True, exist_ok=True)
        for rel, content in files.items():
            replace_file(d / rel, content)

    async def refresh_object_volumes(self) -> None:
        """The kubelet's periodic sync of configMap and secret volumes, every few seconds here."""
        while not self.deleting:
            await self.sleep_unless_deleted(OBJECT_VOLUME_SYNC_S)
            for v in self.pod["spec"].get("volumes") or []:
                if self.deleting or not ("configMap" in v or "secret" in v):
                    continue
                try:
                    await self._write_object_volume(v)
                except (ConfigError, OSError, ApiError) as e:
                    log.warning("refreshing volume %s of %s/%s: %s", v["name"], self.namespace, self.name, e)

    @property
    def restart_policy(self) -> str:
        return self.pod["spec"].get("restartPolicy", "Always")

    def container_spec(self, name: str) -> dict | None:
        return next((c for c in self.pod["spec"].get("containers", []) if c["name"] == name), None)

    def resolve_port(self, spec: dict, port: Any) -> int:
        if isinstance(port, int) or (isinstance(port, str) and port.isdigit()):
            return int(port)
        for p in spec.get("ports", []):
            if p.get("name") == port:
                return int(p["containerPort"])
        raise ValueError(f"unknown named port {port!r}")

    def update(self, pod: dict) -> None:
        if self._last_report is not None and _differs(pod.get("status", {}), self._last_report):
            # someone else wrote this pod's status (the node lifecycle controller marks pods not
            # Ready while the node's heartbeats are missing): write ours again, as the kubelet does
            self._last_report = None
            asyncio.create_task(self.report())
        if self._accept(pod) and self._volumes_ready:
            try:
                self.write_volumes()
            except (ConfigError, OSError) as e:
                log.warning("volumes of %s/%s: %s", self.namespace, self.name, e)
        if pod["metadata"].get("deletionTimestamp") and not self.deleting:
            self.deleting = True
            self._deleted.set()
            asyncio.create_task(self.terminate(pod["metadata"].get("deletionGracePeriodSeconds")))

    async def sleep_unless_deleted(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._deleted.wait(), seconds)
        except asyncio.TimeoutError:
            pass

    async def start(self) -> None:
        await self.report()
        if self.npus and not await self._attach_devices():
            return
        if self.deleting:
            return
        warned = ""
        while not self.deleting:
            try:
                self.write_volumes()
                await self.mount_volumes()
                break
            except (ConfigError, OSError) as e:
                for c in self.containers:
                    c.cs.state = {"waiting": {"reason": "ContainerCreating", "message": str(e)}}
                if str(e) != warned:   # once per cause, as the kubelet's repeated events are aggregated
                    await self.event("Warning", "FailedMount", f"MountVolume.SetUp failed: {e}")
                    warned = str(e)
                await self.report()
                await self.sleep_unless_deleted(3)
        self._volumes_ready = True
        if any("configMap" in v or "secret" in v for v in self.pod["spec"].get("volumes") or []):
            self._refresh = asyncio.create_task(self.refresh_object_volumes())
        for c in self.containers:
            c.task = asyncio.create_task(c.supervise())

    async def _service_account_kubeconfig(self) -> Path | None:
        """A kubeconfig built from a TokenRequest for the pod's ServiceAccount, so a pod's
        API access is exactly what its RBAC grants."""
        spec = self.pod["spec"]
        if spec.get("automountServiceAccountToken") is False:
            return None
        if self._kubeconfig:
            return self._kubeconfig
        sa = spec.get("serviceAccountName", "default")
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "spec": {"expirationSeconds": 3607,  # the kubelet's value: extended by the server
                         "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": self.name,
                                            "uid": self.uid}}}
        tr = await self.agent.api.create(
            f"/api/v1/namespaces/{self.namespace}/serviceaccounts/{sa}/token", body)
        token = tr["status"]["token"]
        sa_dir = self.dir / "serviceaccount"
        sa_dir.mkdir(exist_ok=True)
        (sa_dir / "token").write_text(token)
        (sa_dir / "namespace").write_text(self.namespace)
        shutil.copy(self.agent.api.ca_file, sa_dir / "ca.crt")
        cfg = {
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "local", "cluster": {"server": self.agent.api.server,
                                                       "certificate-authority": str(sa_dir / "ca.crt")}}],
            "users": [{"name": f"system:serviceaccount:{self.namespace}:{sa}",
                       "user": {"tokenFile": str(sa_dir / "token")}}],
            "contexts": [{"name": "local", "context": {"cluster": "local", "namespace": self.namespace,
                                                       "user": f"system:serviceaccount:{self.namespace}:{sa}"}}],
            "current-context": "local",
        }
        path = sa_dir / "kubeconfig"
        path.write_text(yaml.safe_dump(cfg))
        self._kubeconfig = path
        return path

    async def container_env(self, spec: dict) -> dict[str, str]:
        cm_names, secret_names = referenced_objects(spec)
        cms: dict[str, dict | None] = {}
        secrets: dict[str, dict | None] = {}
        for kind, names, out in (("configmaps", cm_names, cms), ("secrets", secret_names, secrets)):
            for n in names:
                try:
                    out[n] = await self.agent.api.get(f"/api/v1/namespaces/{self.namespace}/{kind}/{n}")
                except ApiError as e:
                    if e.status != 404:
                        raise ConfigError(f"reading {kind[:-1]} {n}: {e}") from e
                    out[n] = None
        host = self.agent.api.server.split("//", 1)[1]
        base = {
            "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
            "HOME": str(self.dir),
            "HOSTNAME": self.name,
            "LANG": "C.UTF-8",
            "PYTHONUNBUFFERED": "1",
            "PD_LOCAL_POD_IP": self.ip,
            "KUBERNETES_SERVICE_HOST": host.rsplit(":", 1)[0],
            "KUBERNETES_SERVICE_PORT": host.rsplit(":", 1)[1],
        }
        try:
            kc = await self._service_account_kubeconfig()
        except ApiError as e:
            raise ConfigError(f"requesting a service account token: {e}") from e
        if kc:
            base["KUBECONFIG"] = str(kc)
        env = resolve_env(self.pod, spec, self.ip, self.host_ip, cms, secrets, base)
        mine = dev.split(self.pod, self.agent.npu_resource, self.devices).get(spec["name"])
        if mine:  # the device plugin's env wins over the container's own
            env[dev.VISIBLE_DEVICES_ENV] = ",".join(map(str, mine))
        return env

    def _condition(self, ctype: str, status: bool) -> dict:
        s = "True" if status else "False"
        prev = self._transitions.get(ctype)
        if prev is None or prev[0] != s:
            self._transitions[ctype] = (s, now())
        c = {"type": ctype, "status": s, "lastTransitionTime": self._transitions[ctype][1],
             "lastProbeTime": None}
        return c

    def status(self) -> dict:
        states = [c.cs for c in self.containers]
        all_ready = bool(states) and all(s.ready for s in states)
        phase = pod_phase(states)
        return {
            "phase": phase,
            "hostIP": self.host_ip,
            "hostIPs": [{"ip": self.host_ip}],
            "podIP": self.ip,
            "podIPs": [{"ip": self.ip}],
            "startTime": self.start_time,
            "conditions": [
                self._condition("PodReadyToStartContainers", True),
                self._condition("Initialized", True),
                self._condition("ContainersReady", all_ready),
                self._condition("Ready", all_ready),
            ],
            "containerStatuses": [s.to_status() for s in states],
        }

    async def report(self) -> None:
        async with self._report_lock:
            st = self.status()
            if st == self._last_report:
                return
            try:
                await self.agent.api.patch(
                    f"/api/v1/namespaces/{self.namespace}/pods/{self.name}/status",
                    {"metadata": {"uid": self.uid}, "status": st}, strategic=True)
                self._last_report = st
            except ApiError as e:
                if e.status not in (404, 409, 422):
                    log.warning("status of %s/%s: %s", self.namespace, self.name, e)

    async def event(self, etype: str, reason: str, message: str) -> None:
        ts = now()
        body = {
            "metadata": {"name": f"{self.name}.{uuid.uuid4().hex[:16]}", "namespace": self.namespace},
            "involvedObject": {"kind": "Pod", "namespace": self.namespace, "name": self.name,
                               "uid": self.uid, "apiVersion": "v1"},
            "reason": reason, "message": message, "type": etype,
            "source": {"component": "local-node-agent", "host": self.node},
            "firstTimestamp": ts, "lastTimestamp": ts, "count": 1,
        }
        try:
            await self.agent.api.create(f"/api/v1/namespaces/{self.namespace}/events", body)
        except ApiError as e:
            log.debug("event for %s: %s", self.name, e)

    async def terminate(self, grace: int | None) -> None:
        """Graceful deletion: SIGTERM, wait the grace period, SIGKILL, then remove the pod."""
        if grace is None:
            grace = self.pod["spec"].get("terminationGracePeriodSeconds", 30)
        running = [c for c in self.containers if c.running]
        if running:
            await self.event("Normal", "Killing", "Stopping container " + ", ".join(c.name for c in running))
        await asyncio.gather(*(c.stop(max(1, grace)) for c in self.containers))
        for c in self.containers:
            if c.task:
                c.task.cancel()
        try:
            await self.agent.api.delete(
                f"/api/v1/namespaces/{self.namespace}/pods/{self.name}",
                {"gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}})
        except ApiError as e:
            if e.status not in (404, 409):
                log.warning("completing deletion of %s/%s: %s", self.namespace, self.name, e)
        self.agent.forget(self)

    async def kill_now(self) -> None:
        """The pod is gone from the API (force-deleted): stop processes at once."""
        self.deleting = True
        self._deleted.set()
        await asyncio.gather(*(c.stop(2) for c in self.containers))
        for c in self.containers:
            if c.task:
                c.task.cancel()
        self.agent.forget(self)

    def cleanup(self) -> None:
        self.release_devices()
        self.agent.ips[self.node_index].release(self.ip)
        shutil.rmtree(self.dir, ignore_errors=True)


class NodeAgent:
    def __init__(self, root: Path, nodes: int, kubelet_port: int, pod_ip_base: int = 100,
                 runtime: str = "process", npus_per_node: int = dev.DEFAULT_PER_NODE,
                 npu_resource: str = dev.DEFAULT_RESOURCE):
        import httpx
        self.root = root
        self.npu_resource = npu_resource
        self.devices = [dev.DeviceAllocator(npus_per_node) for _ in range(nodes)]
        # A3 superpods: the nodes split into PD_LOCAL_SUPERPODS runs (default 2), in the devices' annotation
        self.superpods = [dev.superpod(i, nodes, int(os.environ.get("PD_LOCAL_SUPERPODS") or 2)) for i in range(nodes)]
        self.runtime: Runtime = make_runtime(runtime, root)
        self.node_names = [f"local-node-{i + 1}" for i in range(nodes)]
        self.kubelet_port = kubelet_port
        self.api = KubeApi(root / "kubeconfig")
        # Probes open a connection each, as the kubelet does: a shared, bounded keep-alive pool
        # runs dry with a hundred pods probing at once, and every probe would then fail.
        self.http = httpx.AsyncClient(trust_env=False, limits=httpx.Limits(max_connections=None,
                                                                           max_keepalive_connections=0))
        self.ips = [IPAllocator(i, pod_ip_base) for i in range(nodes)]
        self.workers: dict[str, PodWorker] = {}
        self.boot_id = str(uuid.uuid4())
        self._stop = asyncio.Event()

    def forget(self, w: PodWorker) -> None:
        if self.workers.get(w.uid) is w:
            del self.workers[w.uid]
        w.cleanup()

    def find(self, namespace: str, name: str) -> PodWorker | None:
        for w in self.workers.values():
            if w.namespace == namespace and w.name == name:
                return w
        return None

    # ---- nodes ---------------------------------------------------------------------------
    def node_status(self, i: int) -> dict:
        ts = now()
        cond = lambda t, s, r, m: {"type": t, "status": s, "reason": r, "message": m,  # noqa: E731
                                   "lastHeartbeatTime": ts, "lastTransitionTime": self._started}
        capacity = {**NODE_CAPACITY, self.npu_resource: str(self.devices[i].count)}
        return {
            "capacity": capacity, "allocatable": capacity,
            "conditions": [
                cond("MemoryPressure", "False", "KubeletHasSufficientMemory", "local node"),
                cond("DiskPressure", "False", "KubeletHasNoDiskPressure", "local node"),
                cond("PIDPressure", "False", "KubeletHasSufficientPID", "local node"),
                cond("Ready", "True", "KubeletReady", "local node agent is posting ready status"),
            ],
            "addresses": [{"type": "InternalIP", "address": node_ip(i)},
                          {"type": "Hostname", "address": self.node_names[i]}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": self.kubelet_port}},
            "nodeInfo": {
                "machineID": uuid.uuid5(uuid.NAMESPACE_DNS, self.node_names[i]).hex,
                "systemUUID": str(uuid.uuid5(uuid.NAMESPACE_DNS, self.node_names[i])),
                "bootID": self.boot_id, "kernelVersion": platform.release(),
                "osImage": "pd-operator local node", "containerRuntimeVersion":
                    "local://processes" if self.runtime.name == "process" else "docker://local",
                "kubeletVersion": K8S_VERSION, "kubeProxyVersion": "",
                "operatingSystem": "linux", "architecture": "amd64",
            },
        }

    async def register_nodes(self) -> None:
        self._started = now()
        for i, name in enumerate(self.node_names):
            body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {
                "kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64", "pdoperator.io/local-node": "true",
                dev.SUPERPOD_LABEL: str(self.superpods[i])}}}
            try:
                await self.api.create("/api/v1/nodes", body)
                log.info("registered node %s (%s)", name, node_ip(i))
            except ApiError as e:
                if e.status != 409:
                    raise
            await self.api.patch(f"/api/v1/nodes/{name}/status", {"status": self.node_status(i)})

    async def heartbeat(self) -> None:
        while not self._stop.is_set():
            for i, name in enumerate(self.node_names):
                try:
                    await self._renew_lease(name)
                    await self.api.patch(f"/api/v1/nodes/{name}/status", {"status": self.node_status(i)})
                except Exception as e:  # noqa: BLE001 - keep beating
                    log.warning("heartbeat for %s: %s", name, e)
            try:
                await asyncio.wait_for(self._stop.wait(), 10)
            except asyncio.TimeoutError:
                pass

    async def _renew_lease(self, name: str) -> None:
        path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{name}"
        spec = {"holderIdentity": name, "leaseDurationSeconds": 40, "renewTime": now_micro()}
        try:
            await self.api.patch(path, {"spec": spec})
        except ApiError as e:
            if e.status != 404:
                raise
            await self.api.create("/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases",
                                  {"metadata": {"name": name}, "spec": spec})

    # ---- pods ----------------------------------------------------------------------------
    async def handle(self, etype: str, pod: dict) -> None:
        node = pod.get("spec", {}).get("nodeName")
        if node not in self.node_names:
            return
        uid = pod["metadata"]["uid"]
        w = self.workers.get(uid)
        if etype == "DELETED":
            if w:
                await w.kill_now()
            return
        if w:
            w.update(pod)
            return
        if pod.get("status", {}).get("phase") in ("Succeeded", "Failed") and \
                not pod["metadata"].get("deletionTimestamp"):
            return  # finished before this agent started; nothing to run
        w = PodWorker(self, pod, self.node_names.index(node))
        self.workers[uid] = w
        if pod["metadata"].get("deletionTimestamp"):
            w.update(pod)
            return
        log.info("starting pod %s/%s on %s at %s", w.namespace, w.name, node, w.ip)
        w.task = asyncio.create_task(w.start())

    async def watch_pods(self) -> None:
        while not self._stop.is_set():
            try:
                lst = await self.api.get("/api/v1/pods")
                seen = set()
                for pod in lst["items"]:
                    seen.add(pod["metadata"]["uid"])
                    await self.handle("MODIFIED", pod)
                for uid, w in list(self.workers.items()):
                    if uid not in seen:
                        await w.kill_now()
                rv = lst["metadata"]["resourceVersion"]
                while not self._stop.is_set():
                    async for ev in self.api.watch("/api/v1/pods", {"resourceVersion": rv}):
                        if ev["type"] == "ERROR":
                            raise ApiError(ev["object"].get("code", 500), str(ev["object"]))
                        rv = ev["object"]["metadata"]["resourceVersion"]
                        if ev["type"] != "BOOKMARK":
                            await self.handle(ev["type"], ev["object"])
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - relist on any watch failure
                log.info("pod watch restarting: %s", e)
                await asyncio.sleep(1)

    # ---- container logs (the kubelet endpoint the API server proxies to) ------------------
    async def container_logs(self, request: web.Request) -> web.StreamResponse:
        ns, pod, container = (request.match_info[k] for k in ("ns", "pod", "container"))
        w = self.find(ns, pod)
        run = next((c for c in w.containers if c.name == container), None) if w else None
        if run is None:
            raise web.HTTPNotFound(text=f"container {container} of pod {ns}/{pod} is not on this node")
        q = request.query
        previous = q.get("previous") == "true"
        restart = run.cs.restart_count - 1 if previous else run.cs.restart_count
        if previous and restart < 0:
            raise web.HTTPBadRequest(text=f'previous terminated container "{container}" in pod "{pod}" not found')
        path = run.log_path(restart)
        resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await resp.prepare(request)
        data = path.read_bytes() if path.exists() else b""
        end = len(data)  # a follower continues from here
        if "tailLines" in q:
            n = int(q["tailLines"])
            lines = data.splitlines(keepends=True)
            data = b"".join(lines[-n:]) if n > 0 else b""
        limit = int(q["limitBytes"]) if "limitBytes" in q else None
        sent = 0
        if limit is not None:
            data = data[:limit]
        await resp.write(data)
        sent += len(data)
        if q.get("follow") == "true" and not previous:
            instance = run.instance
            # Hold the file open: a deleted pod's directory is removed as soon as its process
            # exits, and its last lines (a graceful shutdown's) must still reach the follower.
            f = None
            try:
                while limit is None or sent < limit:
                    if f is None and path.exists():
                        f = open(path, "rb")
                        f.seek(end)
                    chunk = f.read() if f is not None else b""
                    if chunk:
                        if limit is not None:
                            chunk = chunk[: limit - sent]
                        await resp.write(chunk)
                        sent += len(chunk)
                    elif not run.running and (run.instance != instance or run.cs.done or w.deleting):
                        break
                    else:
                        await asyncio.sleep(0.2)
            finally:
                if f is not None:
                    f.close()
        await resp.write_eof()
        return resp

    async def serve_logs(self) -> list[web.AppRunner]:
        app = web.Application()
        app.router.add_get("/containerLogs/{ns}/{pod}/{container}", self.container_logs)
        app.router.add_get("/healthz", lambda r: web.Response(text="ok"))
        pki = self.root / "pki"
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(pki / "ca.crt"))
        ctx.load_cert_chain(pki / "node-agent-serving.crt", pki / "node-agent-serving.key")
        ctx.verify_mode = ssl.CERT_REQUIRED  # only the API server's kubelet-client cert
        runners = []
        for i in range(len(self.node_names)):
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, node_ip(i), self.kubelet_port, ssl_context=ctx).start()
            runners.append(runner)
        return runners

    # ---- main ----------------------------------------------------------------------------
    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        await self.runtime.cleanup()
        await self.register_nodes()
        runners = await self.serve_logs()
        tasks = [asyncio.create_task(self.heartbeat()), asyncio.create_task(self.watch_pods())]
        await self._stop.wait()
        log.info("stopping: terminating %d pods", len(self.workers))
        for t in tasks:
            t.cancel()
        await asyncio.gather(*(c.stop(5) for w in list(self.workers.values()) for c in w.containers),
                             return_exceptions=True)
        await self.runtime.cleanup()
        for r in runners:
            await r.cleanup()
        await self.http.aclose()
        await self.api.close()


def main(root: Path, nodes: int, kubelet_port: int, pod_ip_base: int = 100, runtime: str = "process",
         npus_per_node: int = dev.DEFAULT_PER_NODE, npu_resource: str = dev.DEFAULT_RESOURCE) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    asyncio.run(NodeAgent(root, nodes, kubelet_port, pod_ip_base, runtime, npus_per_node, npu_resource).run())
