"""How the local node agent runs a container: as a process on this machine (the default, fast
for tests), or from its image under Docker (`--runtime container`).

Both give the pod's loopback IP to the workload (PD_LOCAL_POD_IP: servers bind to it; Docker
runs with the host network, so a container binds only its pod's IP, as a process does), the
resolved env, command/args, logs to the same files, signals for graceful stops, and exec
probes. The container runtime also applies the securityContext (user, read-only root,
capabilities, no-new-privileges; RuntimeDefault is Docker's default seccomp profile),
emptyDir volumes (as tmpfs), memory and CPU limits, and mounts the pod's ServiceAccount
kubeconfig read-only at the same path.

downwardAPI, configMap and secret volumes are files the node agent keeps under
``<pod dir>/volumes/<volume>``, and an emptyDir is a directory there. Docker bind-mounts the
files read-only at their mountPath (an emptyDir is a tmpfs, a hostPath or a claim's hostPath or
local PersistentVolume a bind); a process has no mount namespace, so the process runtime links
``<pod dir>/root/<mountPath>`` to each (the host path itself for a hostPath or a claim) and sets
PD_LOCAL_ROOT to ``<pod dir>/root``."""
from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import sys
from pathlib import Path
from typing import Protocol

from .podspec import UnknownImage, command_line

PR_SET_PDEATHSIG = 1
LABEL = "pd.localcluster.root"
ROOT_ENV = "PD_LOCAL_ROOT"


# volumes whose files the node agent writes under the pod's directory
FILE_VOLUMES = ("downwardAPI", "configMap", "secret")


def volume_dir(pod_dir: Path, volume: str) -> Path:
    """Where the node agent keeps a volume of the pod: the files of a downwardAPI, configMap or
    secret volume, or an emptyDir (created empty, removed with the pod's directory)."""
    return pod_dir / "volumes" / volume


def _source(volume: dict, pod_dir: Path) -> Path | None:
    if any(k in volume for k in (*FILE_VOLUMES, "emptyDir")):
        return volume_dir(pod_dir, volume["name"])
    if "hostPath" in volume:   # a claim's volume too, once the node agent resolved it (podspec.with_claims)
        return Path(volume["hostPath"]["path"])
    return None


def file_mounts(spec: dict, pod_spec: dict, pod_dir: Path) -> list[tuple[Path, str]]:
    """(host source, mountPath) of the container's mounts of file-backed volumes (downwardAPI,
    configMap, secret): what Docker bind-mounts read-only."""
    volumes = {v["name"]: v for v in pod_spec.get("volumes") or []}
    out = []
    for m in spec.get("volumeMounts") or []:
        v = volumes.get(m["name"], {})
        if any(k in v for k in FILE_VOLUMES):
            src = volume_dir(pod_dir, m["name"])
            out.append((src / m["subPath"] if m.get("subPath") else src, m["mountPath"]))
    return out


def local_mounts(spec: dict, pod_spec: dict, pod_dir: Path) -> list[tuple[Path, str]]:
    """(host source, mountPath) of every mount a process gets as a link under PD_LOCAL_ROOT: the
    file-backed volumes, emptyDirs (a directory of the pod), hostPaths (the path itself) and claims
    (the directory behind them, handed in as hostPath). Other kinds are not mounted."""
    volumes = {v["name"]: v for v in pod_spec.get("volumes") or []}
    out = []
    for m in spec.get("volumeMounts") or []:
        src = _source(volumes.get(m["name"], {"name": m["name"]}), pod_dir)
        if src is not None:
            out.append((src / m["subPath"] if m.get("subPath") else src, m["mountPath"]))
    return out


def _die_with_parent() -> None:
    """Pod processes must not outlive the node agent."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


class Running(Protocol):
    id: str

    async def wait(self) -> int: ...
    async def stop(self, grace: float) -> None: ...
    async def exec(self, command: list[str], env: dict[str, str], timeout: float) -> int: ...


class Runtime(Protocol):
    name: str

    async def start(self, *, pod_uid: str, pod_dir: Path, name: str, restart: int, spec: dict, pod_spec: dict,
                    env: dict[str, str], log_path: Path) -> Running: ...
    async def cleanup(self) -> None: ...


# ---- processes ----------------------------------------------------------------------------

class _Process:
    def __init__(self, proc: asyncio.subprocess.Process, pod_uid: str, name: str, spec: dict, cwd: Path,
                 local_root: str | None = None):
        self.proc, self.spec, self.cwd, self.local_root = proc, spec, cwd, local_root
        self.id = f"local://{pod_uid}/{name}/{proc.pid}"

    async def wait(self) -> int:
        return await self.proc.wait()

    async def stop(self, grace: float) -> None:
        p = self.proc
        if p.returncode is not None:
            return
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            await asyncio.wait_for(p.wait(), grace)
        except asyncio.TimeoutError:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await p.wait()

    async def exec(self, command: list[str], env: dict[str, str], timeout: float) -> int:
        if self.local_root:  # exec probes see the mounts as the container does
            env = {**env, ROOT_ENV: self.local_root}
        p = await asyncio.create_subprocess_exec(
            *command_line({"command": command, "image": self.spec.get("image", "")}, env), env=env,
            cwd=str(self.cwd), stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        return await asyncio.wait_for(p.wait(), timeout)


def link_mounts(root: Path, mounts: list[tuple[Path, str]]) -> None:
    """A process has no mount namespace: each mountPath becomes a symlink under `root`
    (``$PD_LOCAL_ROOT``) to the volume, and the workload resolves mounted paths there."""
    for src, mount_path in mounts:
        link = root / mount_path.lstrip("/")
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(src)


class ProcessRuntime:
    """The image table (podspec.IMAGE_COMMANDS) names the command; the process runs here."""
    name = "process"

    async def start(self, *, pod_uid, pod_dir, name, restart, spec, pod_spec, env, log_path) -> Running:
        mounts = local_mounts(spec, pod_spec, pod_dir)
        if mounts:
            link_mounts(pod_dir / "root", mounts)
            env = {**env, ROOT_ENV: str(pod_dir / "root")}
        argv = command_line(spec, env)
        with open(log_path, "ab") as logf:
            proc = await asyncio.create_subprocess_exec(
                *argv, env=env, cwd=str(pod_dir), stdin=asyncio.subprocess.DEVNULL, stdout=logf,
                stderr=asyncio.subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent)
        return _Process(proc, pod_uid, name, spec, pod_dir, env.get(ROOT_ENV))

    async def cleanup(self) -> None:
        return None


# ---- containers under Docker --------------------------------------------------------------

# what the node sets for a process that an image sets for itself
_HOST_ONLY_ENV = ("PATH", "HOME")


def docker_args(*, cname: str, root_label: str, spec: dict, pod_spec: dict, env: dict[str, str],
                mounts: list[Path], pod_dir: Path | None = None) -> list[str]:
    """`docker run` arguments for one container (pure, so the mapping is unit-tested)."""
    args = ["run", "--rm", "--name", cname, "--label", f"{LABEL}={root_label}", "--network", "host",
            "--stop-signal", "SIGTERM"]
    psc = pod_spec.get("securityContext") or {}
    csc = spec.get("securityContext") or {}
    uid = csc.get("runAsUser", psc.get("runAsUser"))
    gid = csc.get("runAsGroup", psc.get("runAsGroup"))
    if uid is not None:
        args += ["--user", f"{uid}:{gid if gid is not None else uid}"]
    if csc.get("readOnlyRootFilesystem"):
        args.append("--read-only")
    if csc.get("allowPrivilegeEscalation") is False:
        args += ["--security-opt", "no-new-privileges"]
    caps = csc.get("capabilities") or {}
    for c in caps.get("drop") or []:
        args += ["--cap-drop", c]
    for c in caps.get("add") or []:
        args += ["--cap-add", c]
    seccomp = (csc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
    if seccomp == "Unconfined":
        args += ["--security-opt", "seccomp=unconfined"]
    volumes = {v["name"]: v for v in pod_spec.get("volumes") or []}
    for m in spec.get("volumeMounts") or []:
        v = volumes.get(m["name"], {})
        if "emptyDir" in v and m["mountPath"] == "/dev/shm":   # Docker's own shared memory, sized
            size = (v["emptyDir"] or {}).get("sizeLimit")
            args += ["--shm-size", _bytes(size)] if size else []
        elif "emptyDir" in v:
            args += ["--tmpfs", f"{m['mountPath']}:rw,exec,mode=1777"]
        elif "hostPath" in v:   # a claim's volume too (a hostPath or local PersistentVolume's directory)
            src = v["hostPath"]["path"] + (f"/{m['subPath']}" if m.get("subPath") else "")
            ro = m.get("readOnly") or v.get("readOnly")
            args += ["-v", f"{src}:{m['mountPath']}{':ro' if ro else ''}"]
    if pod_dir is not None:
        for src, mount_path in file_mounts(spec, pod_spec, pod_dir):
            args += ["-v", f"{src}:{mount_path}:ro"]
    for p in mounts:
        args += ["-v", f"{p}:{p}:ro"]
    limits = (spec.get("resources") or {}).get("limits") or {}
    if "memory" in limits:
        args += ["--memory", _bytes(limits["memory"])]
    if "cpu" in limits:
        args += ["--cpus", _cpus(limits["cpu"])]
    for k, v in sorted(env.items()):
        if k not in _HOST_ONLY_ENV:
            args += ["-e", f"{k}={v}"]
    if spec.get("command"):
        args += ["--entrypoint", spec["command"][0]]
    args.append(spec["image"])
    if spec.get("command"):
        args += spec["command"][1:]
    args += spec.get("args") or []
    return args


def _bytes(q: str) -> str:
    units = {"Ki": "k", "Mi": "m", "Gi": "g", "K": "k", "M": "m", "G": "g"}
    for suffix, d in units.items():
        if str(q).endswith(suffix):
            return str(q)[: -len(suffix)] + d
    return str(q)


def _cpus(q: str) -> str:
    q = str(q)
    return str(int(q[:-1]) / 1000) if q.endswith("m") else q


class _Container:
    def __init__(self, rt: "ContainerRuntime", proc: asyncio.subprocess.Process, cname: str):
        self.rt, self.proc, self.cname = rt, proc, cname
        self.id = f"docker://{cname}"

    async def wait(self) -> int:
        return await self.proc.wait()

    async def stop(self, grace: float) -> None:
        if self.proc.returncode is not None:
            return
        await self.rt.docker("stop", "-t", str(max(1, int(grace))), self.cname, timeout=grace + 30)
        try:
            await asyncio.wait_for(self.proc.wait(), 30)
        except asyncio.TimeoutError:
            self.proc.kill()
            await self.proc.wait()

    async def exec(self, command: list[str], env: dict[str, str], timeout: float) -> int:
        code, _ = await self.rt.docker("exec", self.cname, *command, timeout=timeout)
        return code


class ContainerRuntime:
    name = "container"

    def __init__(self, root: Path, docker: str = "docker"):
        self.root_label = str(root)
        self.bin = docker

    async def docker(self, *args: str, timeout: float = 60) -> tuple[int, str]:
        p = await asyncio.create_subprocess_exec(self.bin, *args, stdin=asyncio.subprocess.DEVNULL,
                                                 stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        try:
            out, _ = await asyncio.wait_for(p.communicate(), timeout)
        except asyncio.TimeoutError:
            p.kill()
            return 124, "timed out"
        return p.returncode, out.decode(errors="replace")

    async def start(self, *, pod_uid, pod_dir, name, restart, spec, pod_spec, env, log_path) -> Running:
        image = spec.get("image", "")
        code, out = await self.docker("image", "inspect", "--format", "{{.Id}}", image)
        if code != 0:
            raise UnknownImage(f'image "{image}" is not present in this node\'s Docker ({out.strip()[:200]}); '
                               f"build it with `make images`")
        cname = f"pd-{pod_uid[:8]}-{name}-{restart}"
        await self.docker("rm", "-f", cname)      # a leftover of a node agent that died
        kc = env.get("KUBECONFIG")
        mounts = [Path(kc).parent] if kc else []
        args = docker_args(cname=cname, root_label=self.root_label, spec=spec, pod_spec=pod_spec, env=env,
                           mounts=mounts, pod_dir=pod_dir)
        with open(log_path, "ab") as logf:
            proc = await asyncio.create_subprocess_exec(self.bin, *args, stdin=asyncio.subprocess.DEVNULL,
                                                        stdout=logf, stderr=asyncio.subprocess.STDOUT,
                                                        start_new_session=True)
        return _Container(self, proc, cname)

    async def cleanup(self) -> None:
        """Containers this node started, left by a node agent that stopped: remove them."""
        code, out = await self.docker("ps", "-aq", "--filter", f"label={LABEL}={self.root_label}")
        ids = out.split() if code == 0 else []
        if ids:
            await self.docker("rm", "-f", *ids, timeout=120)


def make(kind: str, root: Path) -> Runtime:
    if kind == "process":
        return ProcessRuntime()
    if kind == "container":
        return ContainerRuntime(root)
    print(f"unknown runtime {kind!r}: process or container", file=sys.stderr)
    raise SystemExit(2)
