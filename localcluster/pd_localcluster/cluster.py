"""Start and stop the local control plane: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler and the local node agent, each as a background process on free loopback
ports. State (ports, pids, certificates, kubeconfigs, logs) lives in ``.localcluster/``."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

from .devices import DEFAULT_PER_NODE, DEFAULT_RESOURCE
from .pki import PKI

BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
# Stop order: pods first (node agent), then the controllers, then storage last.
STOP_ORDER = ("node-agent", "kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd")
SERVICE_CIDR = "10.96.0.0/16"


def pod_ip_base(root: Path, nodes: int) -> int:
    """Second octet of node 0's pod addresses: 100..240 in steps of 10, chosen by the state
    directory, so clusters of different checkouts can run side by side."""
    if nodes > 10:
        raise SystemExit("at most 10 local nodes")
    return 100 + 10 * (int(hashlib.sha1(str(root).encode()).hexdigest(), 16) % 15)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log(msg: str) -> None:
    print(f"[localcluster] {msg}", flush=True)


@dataclass
class Paths:
    root: Path

    @property
    def state(self) -> Path:
        return self.root / "state.json"

    @property
    def kubeconfig(self) -> Path:
        return self.root / "kubeconfig"

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def component_kubeconfig(self, name: str) -> Path:
        return self.root / f"{name}.kubeconfig"


def default_root() -> Path:
    return Path(os.environ.get("PD_LOCALCLUSTER_DIR", ".localcluster")).resolve()


def write_kubeconfig(path: Path, server: str, ca: Path, cert: Path, key: Path, user: str) -> None:
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "local", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": user, "user": {"client-certificate": str(cert), "client-key": str(key)}}],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": user}}],
        "current-context": "local",
    }
    path.write_text(yaml.safe_dump(cfg))


def _alive(pid: int, needle: str) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return False
    return needle in cmdline


def _wait(what: str, check, timeout: float, procs: dict[str, subprocess.Popen] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, p in (procs or {}).items():
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with code {p.returncode} while waiting for {what}; "
                                   f"see .localcluster/logs/{name}.log")
        try:
            if check():
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.2)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


def _environ(pid: int) -> dict[str, str] | None:
    """A running process's environment (None, i.e. ours, if it cannot be read)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    return dict(kv.decode(errors="replace").split("=", 1) for kv in raw.split(b"\0") if b"=" in kv)


class LocalCluster:
    def __init__(self, root: Path | None = None):
        self.paths = Paths(root or default_root())

    # ---- state -------------------------------------------------------------------------
    def load_state(self) -> dict | None:
        try:
            return json.loads(self.paths.state.read_text())
        except (OSError, ValueError):
            return None

    def _ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.paths.pki / "ca.crt"))
        ctx.load_cert_chain(self.paths.pki / "admin.crt", self.paths.pki / "admin.key")
        return ctx

    def apiserver_ready(self, state: dict) -> bool:
        url = f"https://127.0.0.1:{state['ports']['apiserver']}/readyz"
        try:
            with urllib.request.urlopen(url, context=self._ssl_context(), timeout=2) as r:
                return r.status == 200
        except Exception:  # noqa: BLE001
            return False

    def is_up(self) -> bool:
        state = self.load_state()
        if not state:
            return False
        if not all(_alive(pid, name if name != "node-agent" else "pd_localcluster")
                   for name, pid in state["pids"].items()):
            return False
        return self.apiserver_ready(state)

    # ---- up ------------------------------------------------------------------------------
    def up(self, bin_dir: Path, nodes: int = 3, timeout: float = 120, runtime: str = "process",
           npus_per_node: int | None = None, npu_resource: str | None = None) -> None:
        t0 = time.monotonic()
        if npus_per_node is None:
            npus_per_node = int(os.environ.get("PD_LOCAL_NPUS_PER_NODE", DEFAULT_PER_NODE))
        npu_resource = npu_resource or os.environ.get("PD_LOCAL_NPU_RESOURCE", DEFAULT_RESOURCE)
        if self.is_up():
            log(f"already up (kubeconfig: {self.paths.kubeconfig})")
            return
        if self.load_state():
            log("found a stale or partial cluster; cleaning it up first")
            self.down(quiet=True)
        missing = [b for b in BINARIES if not (bin_dir / b).exists()]
        if missing:
            raise SystemExit(f"missing binaries in {bin_dir}: {missing}; run `make k8s-bins`")
        self.paths.root.mkdir(parents=True, exist_ok=True)
        self.paths.logs.mkdir(exist_ok=True)
        PKI(self.paths.pki).ensure()
        pki = self.paths.pki
        ports = {k: free_port() for k in ("etcd", "etcd_peer", "apiserver", "kcm", "scheduler", "kubelet")}
        shm = Path("/dev/shm")
        etcd_data = (shm if shm.is_dir() and os.access(shm, os.W_OK) else self.paths.root) / \
            f"pd-localcluster-etcd-{os.getpid()}-{int(time.time())}"
        state = {"ports": ports, "pids": {}, "bin_dir": str(bin_dir), "etcd_data": str(etcd_data),
                 "nodes": nodes}
        procs: dict[str, subprocess.Popen] = {}

        def spawn(name: str, argv: list[str]) -> None:
            out = open(self.paths.logs / f"{name}.log", "ab")
            p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True, cwd=self.paths.root)
            procs[name] = p
            state["pids"][name] = p.pid
            state.setdefault("argv", {})[name] = argv
            self.paths.state.write_text(json.dumps(state, indent=2))

        server = f"https://127.0.0.1:{ports['apiserver']}"
        try:
            log(f"starting etcd on 127.0.0.1:{ports['etcd']} (data in {etcd_data})")
            spawn("etcd", [
                str(bin_dir / "etcd"), "--name=local", f"--data-dir={etcd_data}",
                f"--listen-client-urls=http://127.0.0.1:{ports['etcd']}",
                f"--advertise-client-urls=http://127.0.0.1:{ports['etcd']}",
                f"--listen-peer-urls=http://127.0.0.1:{ports['etcd_peer']}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{ports['etcd_peer']}",
                f"--initial-cluster=local=http://127.0.0.1:{ports['etcd_peer']}",
                "--unsafe-no-fsync", "--log-level=warn", "--quota-backend-bytes=2147483648",
            ])
            _wait("etcd health", lambda: urllib.request.urlopen(
                f"http://127.0.0.1:{ports['etcd']}/health", timeout=1).status == 200, 30, procs)

            log(f"starting kube-apiserver on {server}")
            spawn("kube-apiserver", [
                str(bin_dir / "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{ports['etcd']}",
                "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
                f"--secure-port={ports['apiserver']}",
                f"--tls-cert-file={pki / 'apiserver.crt'}", f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--client-ca-file={pki / 'ca.crt'}",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                "--authorization-mode=RBAC",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
                f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
                f"--kubelet-certificate-authority={pki / 'ca.crt'}",
                "--kubelet-preferred-address-types=InternalIP",
                "--allow-privileged=true",
                # The `kubernetes` Service cannot point at a loopback address.
                "--endpoint-reconciler-type=none",
                "--profiling=false", "--v=1",
            ])
            _wait("kube-apiserver /readyz", lambda: self.apiserver_ready(state), 90, procs)

            admin_kc = self.paths.kubeconfig
            write_kubeconfig(admin_kc, server, pki / "ca.crt", pki / "admin.crt", pki / "admin.key",
                             "admin")
            cm_kc = self.paths.component_kubeconfig("controller-manager")
            write_kubeconfig(cm_kc, server, pki / "ca.crt", pki / "controller-manager.crt",
                             pki / "controller-manager.key", "system:kube-controller-manager")
            sch_kc = self.paths.component_kubeconfig("scheduler")
            write_kubeconfig(sch_kc, server, pki / "ca.crt", pki / "scheduler.crt",
                             pki / "scheduler.key", "system:kube-scheduler")

            log("starting kube-controller-manager and kube-scheduler")
            spawn("kube-controller-manager", [
                str(bin_dir / "kube-controller-manager"),
                f"--kubeconfig={cm_kc}", f"--authentication-kubeconfig={cm_kc}",
                f"--authorization-kubeconfig={cm_kc}",
                "--bind-address=127.0.0.1", f"--secure-port={ports['kcm']}",
                "--leader-elect=false", "--use-service-account-credentials=true",
                f"--service-account-private-key-file={pki / 'sa.key'}",
                f"--root-ca-file={pki / 'ca.crt'}",
                f"--cluster-signing-cert-file={pki / 'ca.crt'}",
                f"--cluster-signing-key-file={pki / 'ca.key'}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--controllers=*", "--v=1",
            ])
            spawn("kube-scheduler", [
                str(bin_dir / "kube-scheduler"),
                f"--kubeconfig={sch_kc}", f"--authentication-kubeconfig={sch_kc}",
                f"--authorization-kubeconfig={sch_kc}",
                "--bind-address=127.0.0.1", f"--secure-port={ports['scheduler']}",
                "--leader-elect=false", "--v=1",
            ])
            how = "as processes" if runtime == "process" else "from their images under Docker"
            log(f"starting the local node agent ({nodes} nodes with {npus_per_node} {npu_resource} each, "
                f"pods {how})")
            spawn("node-agent", [
                sys.executable, "-m", "pd_localcluster", f"--root={self.paths.root}", "node-agent",
                f"--nodes={nodes}", f"--runtime={runtime}",
                f"--kubelet-port={ports['kubelet']}",
                f"--pod-ip-base={pod_ip_base(self.paths.root, nodes)}",
                f"--npus-per-node={npus_per_node}", f"--npu-resource={npu_resource}",
            ])
            self._wait_nodes_ready(nodes, procs)
            self._wait_default_serviceaccount(procs)
        except BaseException:
            log("start failed; stopping what was started")
            for name in reversed(list(procs)):
                self._stop_pid(name, procs[name].pid)
            shutil.rmtree(etcd_data, ignore_errors=True)
            self.paths.state.unlink(missing_ok=True)
            raise
        log(f"cluster up in {time.monotonic() - t0:.1f}s; export KUBECONFIG={self.paths.kubeconfig}")

    def restart_apiserver(self, down_seconds: float = 1.0) -> None:
        """Stop kube-apiserver and start it again with the same flags: every client's watch
        breaks, and its watch cache starts over, so clients that resume list again."""
        self.restart("kube-apiserver", down_seconds)

    def restart(self, component: str, down_seconds: float = 1.0) -> None:
        """Stop a control-plane process (kube-apiserver, etcd, ...) for `down_seconds`, start it
        again with the same flags, and wait until the API server answers /readyz."""
        state = self.load_state()
        if not state or component not in state.get("argv", {}):
            raise RuntimeError(f"no running local cluster with {component} (or one started before restarts were "
                               f"possible)")
        pid = state["pids"][component]
        env = _environ(pid)   # the same environment too: it belongs to whoever started the cluster
        self._stop_pid(component, pid)
        time.sleep(down_seconds)
        out = open(self.paths.logs / f"{component}.log", "ab")
        p = subprocess.Popen(state["argv"][component], stdout=out, stderr=subprocess.STDOUT, env=env,
                             stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.paths.root)
        state["pids"][component] = p.pid
        self.paths.state.write_text(json.dumps(state, indent=2))
        _wait("kube-apiserver /readyz", lambda: self.apiserver_ready(state), 90, {component: p})

    def _kubectl(self, *args: str) -> str:
        state = self.load_state()
        assert state
        return subprocess.run(
            [str(Path(state["bin_dir"]) / "kubectl"), f"--kubeconfig={self.paths.kubeconfig}", *args],
            check=True, capture_output=True, text=True, timeout=30,
        ).stdout

    def _wait_nodes_ready(self, n: int, procs) -> None:
        def check() -> bool:
            out = json.loads(self._kubectl("get", "nodes", "-o", "json"))
            ready = [
                i["metadata"]["name"] for i in out["items"]
                if any(c["type"] == "Ready" and c["status"] == "True"
                       for c in i.get("status", {}).get("conditions", []))
            ]
            return len(ready) >= n
        _wait(f"{n} Ready nodes", check, 60, procs)
        log(f"{n} nodes Ready")

    def _wait_default_serviceaccount(self, procs) -> None:
        _wait("the default ServiceAccount (controller-manager working)",
              lambda: bool(self._kubectl("get", "serviceaccount", "default", "-n", "default",
                                         "-o", "name")), 60, procs)

    # ---- down ----------------------------------------------------------------------------
    @staticmethod
    def _stop_pid(name: str, pid: int, grace: float = 10) -> None:
        needle = "pd_localcluster" if name == "node-agent" else name
        if not _alive(pid, needle):
            return
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and _alive(pid, needle):
            time.sleep(0.1)
        if _alive(pid, needle):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def down(self, quiet: bool = False) -> None:
        state = self.load_state()
        if state:
            for name in STOP_ORDER:
                pid = state["pids"].get(name)
                if pid:
                    if not quiet:
                        log(f"stopping {name} (pid {pid})")
                    self._stop_pid(name, pid, grace=20 if name == "node-agent" else 10)
            shutil.rmtree(state.get("etcd_data", "/nonexistent"), ignore_errors=True)
        if self.paths.root.exists():
            shutil.rmtree(self.paths.root, ignore_errors=True)
        if not quiet:
            log("cluster down" if state else "no cluster was running")
