"""Pure helpers the node agent uses to turn a Pod into processes: the image table, env
resolution (literal, downward API, ConfigMap/Secret refs, ``$(VAR)`` expansion), the files
of downwardAPI volumes, the command line, and the pod status built from container states."""
from __future__ import annotations

import base64
import re
import sys
from dataclasses import dataclass, field
from typing import Any

# Repository suffix -> entrypoint. Images stand for our Python entry points on this machine.
IMAGE_ENTRYPOINTS: dict[str, list[str]] = {
    "pd-sim-agent": ["{python}", "-m", "pd_agent"],
    "pd-reference-engine": ["{python}", "-m", "pd_engine.reference_server"],
    "pd-operator": ["{python}", "-m", "pd_operator"],
    "pd-gateway": ["{python}", "-m", "pd_gateway"],
}
PYTHON_NAMES = {"python", "python3", "/usr/bin/python", "/usr/bin/python3",
                "/usr/local/bin/python", "/usr/local/bin/python3"}


class UnknownImage(Exception):
    """The image maps to no local command."""


class ConfigError(Exception):
    """A referenced ConfigMap/Secret key is missing (the kubelet's CreateContainerConfigError)."""


def repository(image: str) -> str:
    """`registry:5000/org/pd-sim-agent:0.1@sha256:...` -> `registry:5000/org/pd-sim-agent`."""
    name = image.split("@", 1)[0]
    slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > slash:
        name = name[:colon]
    return name


def entrypoint_for(image: str, python: str = sys.executable) -> list[str]:
    repo = repository(image)
    for suffix, argv in IMAGE_ENTRYPOINTS.items():
        if repo == suffix or repo.endswith("/" + suffix) or repo.endswith(suffix):
            return [a.format(python=python) for a in argv]
    known = ", ".join(f"*{s}" for s in IMAGE_ENTRYPOINTS)
    raise UnknownImage(
        f'image "{image}" is not available on this local node: no command is mapped for '
        f'repository "{repo}" (known repositories end in: {known})'
    )


_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)|\$\$")


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion: known vars are replaced, unknown ones kept, `$$` -> `$`."""
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return _VAR.sub(sub, value)


def command_line(container: dict, env: dict[str, str], python: str = sys.executable) -> list[str]:
    """The process argv: the container's command (or the image's entrypoint) plus args."""
    if container.get("command"):
        argv = [expand(a, env) for a in container["command"]]
        if argv[0] in PYTHON_NAMES:
            argv[0] = python
        entrypoint_for(container.get("image", ""), python)  # still rejects unknown images
    else:
        argv = entrypoint_for(container.get("image", ""), python)
    return argv + [expand(a, env) for a in container.get("args", [])]


_FIELD_KEY = re.compile(r"^metadata\.(labels|annotations)\['(.+)'\]$")


def field_ref(pod: dict, path: str, pod_ip: str, host_ip: str) -> str:
    meta = pod.get("metadata", {})
    spec = pod.get("spec", {})
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
        "status.hostIP": host_ip,
        "status.hostIPs": host_ip,
    }
    if path in simple:
        return simple[path]
    m = _FIELD_KEY.match(path)
    if m:
        return str(meta.get(m.group(1), {}).get(m.group(2), ""))
    if path in ("metadata.labels", "metadata.annotations"):
        d = meta.get(path.split(".")[1], {})
        return "\n".join(f'{k}="{v}"' for k, v in sorted(d.items()))
    raise ConfigError(f"unsupported fieldRef {path!r}")


def downward_api_files(pod: dict, volume: dict, pod_ip: str = "", host_ip: str = "") -> dict[str, str]:
    """Relative path -> content of a downwardAPI volume's files."""
    containers = {c["name"]: c for c in pod.get("spec", {}).get("containers", [])}
    out: dict[str, str] = {}
    for item in (volume.get("downwardAPI") or {}).get("items") or []:
        path = item["path"]
        if path.startswith("/") or ".." in path.split("/"):
            raise ConfigError(f"downwardAPI path {path!r} must be relative and stay in the volume")
        if "fieldRef" in item:
            out[path] = field_ref(pod, item["fieldRef"]["fieldPath"], pod_ip, host_ip)
        elif "resourceFieldRef" in item:
            ref = item["resourceFieldRef"]
            out[path] = _resource_field(containers.get(ref.get("containerName", ""), {}), ref)
        else:
            raise ConfigError(f"downwardAPI item {path!r}: neither fieldRef nor resourceFieldRef")
    return out


def referenced_objects(container: dict) -> tuple[set[str], set[str]]:
    """Names of ConfigMaps and Secrets a container's env refers to (to fetch before resolving)."""
    cms: set[str] = set()
    secrets: set[str] = set()
    for e in container.get("env", []) or []:
        vf = e.get("valueFrom") or {}
        if "configMapKeyRef" in vf:
            cms.add(vf["configMapKeyRef"]["name"])
        if "secretKeyRef" in vf:
            secrets.add(vf["secretKeyRef"]["name"])
    for ef in container.get("envFrom", []) or []:
        if "configMapRef" in ef:
            cms.add(ef["configMapRef"]["name"])
        if "secretRef" in ef:
            secrets.add(ef["secretRef"]["name"])
    return cms, secrets


def _resource_field(container: dict, ref: dict) -> str:
    res = ref.get("resource", "")
    kind, _, name = res.partition(".")
    value = (container.get("resources", {}).get(kind, {}) or {}).get(name)
    return str(value) if value is not None else "0"


def resolve_env(
    pod: dict,
    container: dict,
    pod_ip: str,
    host_ip: str,
    configmaps: dict[str, dict | None],
    secrets: dict[str, dict | None],
    service_env: dict[str, str] | None = None,
) -> dict[str, str]:
    """The container's environment, in Kubernetes order: service env, envFrom, then env
    (later wins), each value `$(VAR)`-expanded against what came before it."""
    env: dict[str, str] = dict(service_env or {})

    def cm_data(name: str, optional: bool) -> dict[str, str] | None:
        cm = configmaps.get(name)
        if cm is None:
            if optional:
                return None
            raise ConfigError(f'configmap "{name}" not found')
        return dict(cm.get("data") or {})

    def secret_data(name: str, optional: bool) -> dict[str, str] | None:
        s = secrets.get(name)
        if s is None:
            if optional:
                return None
            raise ConfigError(f'secret "{name}" not found')
        return {k: base64.b64decode(v).decode() for k, v in (s.get("data") or {}).items()}

    for ef in container.get("envFrom", []) or []:
        prefix = ef.get("prefix", "")
        if "configMapRef" in ef:
            ref = ef["configMapRef"]
            data = cm_data(ref["name"], ref.get("optional", False)) or {}
        else:
            ref = ef["secretRef"]
            data = secret_data(ref["name"], ref.get("optional", False)) or {}
        for k, v in data.items():
            env[prefix + k] = v

    for e in container.get("env", []) or []:
        name = e["name"]
        if "value" in e or "valueFrom" not in e:
            env[name] = expand(e.get("value", ""), env)
            continue
        vf = e["valueFrom"]
        if "fieldRef" in vf:
            env[name] = field_ref(pod, vf["fieldRef"]["fieldPath"], pod_ip, host_ip)
        elif "resourceFieldRef" in vf:
            env[name] = _resource_field(container, vf["resourceFieldRef"])
        elif "configMapKeyRef" in vf or "secretKeyRef" in vf:
            kind, ref_key, load = (("ConfigMap", "configMapKeyRef", cm_data) if "configMapKeyRef" in vf
                                   else ("Secret", "secretKeyRef", secret_data))
            ref = vf[ref_key]
            optional = ref.get("optional", False)
            data = load(ref["name"], optional)
            if data is None or ref["key"] not in data:
                if optional:
                    continue
                raise ConfigError(f'couldn\'t find key {ref["key"]} in {kind} '
                                  f'{pod["metadata"]["namespace"]}/{ref["name"]}')
            env[name] = data[ref["key"]]
        else:
            raise ConfigError(f"env {name}: unsupported valueFrom {sorted(vf)}")
    return env


# ---- status ------------------------------------------------------------------------------

@dataclass
class ContainerState:
    """What the node agent knows of one container, rendered into a ContainerStatus."""
    name: str
    image: str
    state: dict[str, Any] = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: dict[str, Any] = field(default_factory=dict)
    restart_count: int = 0
    ready: bool = False
    container_id: str = ""
    done: bool = False  # terminated and will not be restarted

    def to_status(self) -> dict:
        s = {
            "name": self.name,
            "image": self.image,
            "imageID": f"local://{repository(self.image)}",
            "ready": self.ready,
            "started": "running" in self.state,
            "restartCount": self.restart_count,
            "state": self.state,
            "lastState": self.last_state,
        }
        if self.container_id:
            s["containerID"] = self.container_id
        return s


def pod_phase(containers: list[ContainerState]) -> str:
    """Pending until a container has started; Succeeded/Failed once every container has
    terminated for good (`done`); Running otherwise, including while waiting to restart."""
    if containers and all(c.done for c in containers):
        codes = [c.state.get("terminated", {}).get("exitCode", 1) for c in containers]
        return "Succeeded" if all(code == 0 for code in codes) else "Failed"
    if any("running" in c.state or c.restart_count > 0 or c.last_state for c in containers):
        return "Running"
    return "Pending"


def should_restart(restart_policy: str, exit_code: int) -> bool:
    if restart_policy == "Always":
        return True
    if restart_policy == "OnFailure":
        return exit_code != 0
    return False


def backoff_seconds(restarts: int, base: float = 1.0, cap: float = 20.0) -> float:
    """CrashLoopBackOff delay: doubling from `base`, capped (the kubelet caps at 5 min;
    locally a short cap keeps tests fast)."""
    return min(cap, base * (2 ** max(0, restarts)))


# ---- volumes -----------------------------------------------------------------------------

def _safe_relative(path: str, what: str) -> str:
    if path.startswith("/") or ".." in path.split("/"):
        raise ConfigError(f"{what}: path {path!r} must be relative and stay in the volume")
    return path


def object_volume_files(volume: dict, obj: dict | None) -> dict[str, bytes]:
    """Relative path -> content of a configMap or secret volume, from the object (None: not
    found). Every key, or the listed `items`; a missing object or key fails the mount unless the
    volume is optional, as the kubelet's does."""
    kind, src = ("configMap", volume["configMap"]) if "configMap" in volume else ("secret", volume["secret"])
    name = src.get("name") if kind == "configMap" else src.get("secretName")
    label = f'{kind} "{name}"'
    if obj is None:
        if src.get("optional"):
            return {}
        raise ConfigError(f"{label} not found")
    data: dict[str, bytes] = {}
    if kind == "configMap":
        data.update({k: v.encode() for k, v in (obj.get("data") or {}).items()})
        data.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
    else:
        data.update({k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()})
    items = src.get("items")
    if not items:
        return {_safe_relative(k, label): v for k, v in data.items()}
    out = {}
    for item in items:
        if item["key"] not in data:
            if src.get("optional"):
                continue
            raise ConfigError(f"{label}: no key {item['key']!r}")
        out[_safe_relative(item["path"], label)] = data[item["key"]]
    return out


def claim_path(namespace: str, claim: str, pvc: dict | None, pv: dict | None) -> str:
    """The directory on this machine behind a PersistentVolumeClaim: its bound PersistentVolume's
    spec.hostPath.path or spec.local.path. Anything else (not found, unbound, another kind of
    volume) is a ConfigError saying why: the pod does not start and a FailedMount Event says so."""
    if pvc is None:
        raise ConfigError(f'persistentvolumeclaim "{namespace}/{claim}" not found')
    phase = (pvc.get("status") or {}).get("phase")
    volume = (pvc.get("spec") or {}).get("volumeName")
    if phase != "Bound" or not volume:
        raise ConfigError(f'persistentvolumeclaim "{namespace}/{claim}" is not bound (phase {phase or "unknown"})')
    if pv is None:
        raise ConfigError(f'persistentvolume "{volume}" of claim "{namespace}/{claim}" not found')
    spec = pv.get("spec") or {}
    for kind in ("hostPath", "local"):
        if (spec.get(kind) or {}).get("path"):
            return str(spec[kind]["path"])
    kinds = sorted(k for k in spec if isinstance(spec[k], dict) and k not in ("capacity", "claimRef", "nodeAffinity"))
    raise ConfigError(f'persistentvolume "{volume}" of claim "{namespace}/{claim}" is of a kind this local node '
                      f"cannot mount ({', '.join(kinds) or 'none'}): only hostPath and local volumes")


def with_claims(pod_spec: dict, paths: dict[str, str]) -> dict:
    """The pod spec with each persistentVolumeClaim volume replaced by a hostPath volume of the
    directory behind the claim (`paths`: claim name -> path), as the kubelet mounts a claim's
    volume: what the runtimes are handed. The pod's own spec is not changed."""
    if not any("persistentVolumeClaim" in v for v in pod_spec.get("volumes") or []):
        return pod_spec
    volumes = []
    for v in pod_spec.get("volumes") or []:
        if "persistentVolumeClaim" in v:
            claim = v["persistentVolumeClaim"]["claimName"]
            v = {"name": v["name"], "hostPath": {"path": paths[claim]},
                 **({"readOnly": True} if v["persistentVolumeClaim"].get("readOnly") else {})}
        volumes.append(v)
    return {**pod_spec, "volumes": volumes}
