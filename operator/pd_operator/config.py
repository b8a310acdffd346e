"""The operator's configuration (pure once read): what the cluster admin allows, set by the
chart's values, never by a PDDeployment. A PDDeployment's author may ask for host paths and a
gateway image; what they may get is this allow-list. The chart passes the same values to a
ValidatingAdmissionPolicy (its ConfigMap is the policy's params), so a spec outside them is
refused at admission; the operator checks again, for installs without the policy."""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from pd_contract.names import NPU_RESOURCE

from .api import Ascend, PDDeploymentSpec

# the paths the real llm_datadist needs by default (Ascend's defaults); an admin may list others
DEFAULT_HOST_PATHS = (Ascend().hccn_conf, Ascend().driver_path, *Ascend().extra_host_paths)


def _list(raw: str | None) -> tuple[str, ...] | None:
    if raw is None:
        return None
    return tuple(p.strip() for p in raw.replace("\n", ",").split(",") if p.strip())


def _int(raw: str | None) -> int | None:
    return int(raw) if raw and raw.strip().lstrip("-").isdigit() else None


@dataclass(frozen=True)
class OperatorConfig:
    npu_resource: str = NPU_RESOURCE
    allowed_host_paths: tuple[str, ...] = DEFAULT_HOST_PATHS
    # the gateway's image; None: spec.image's repository renamed pd-gateway (an install without
    # the chart). spec.gateway.image must be one of allowed_gateway_images (or the configured one).
    gateway_image: str | None = None
    allowed_gateway_images: tuple[str, ...] = ()
    namespace: str | None = None          # where the operator runs: its NetworkPolicy peer
    # the user and group real-backend engines run as (the NPU driver's, HwHiAiUser); None keeps
    # the image's user, which only an admin may choose
    engine_user: int | None = None
    engine_group: int | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> OperatorConfig:
        paths = _list(env.get("PD_OPERATOR_ALLOWED_HOST_PATHS"))
        return cls(npu_resource=env.get("PD_OPERATOR_NPU_RESOURCE") or NPU_RESOURCE,
                   allowed_host_paths=DEFAULT_HOST_PATHS if paths is None else paths,
                   gateway_image=env.get("PD_OPERATOR_GATEWAY_IMAGE") or None,
                   allowed_gateway_images=_list(env.get("PD_OPERATOR_ALLOWED_GATEWAY_IMAGES")) or (),
                   namespace=env.get("PD_OPERATOR_NAMESPACE") or env.get("POD_NAMESPACE") or None,
                   engine_user=_int(env.get("PD_OPERATOR_ENGINE_USER")),
                   engine_group=_int(env.get("PD_OPERATOR_ENGINE_GROUP")))


def path_allowed(path: str, allowed: tuple[str, ...]) -> bool:
    """The path is an allowed one or under an allowed directory. `..` never gets here: the
    CRD's pattern refuses it (and so does this)."""
    if "/../" in f"{path}/" or "/./" in f"{path}/":
        return False
    return any(path == a or path.startswith(a.rstrip("/") + "/") for a in allowed)


def not_allowed(spec: PDDeploymentSpec, config: OperatorConfig) -> str | None:
    """Why the spec asks for more than the operator's configuration allows, naming the field
    and the allow-list; None if it does not."""
    problems = []
    if spec.ascend is not None:
        asked = [("spec.ascend.hccnConf", spec.ascend.hccn_conf), ("spec.ascend.driverPath", spec.ascend.driver_path)]
        asked += [(f"spec.ascend.extraHostPaths[{i}]", p) for i, p in enumerate(spec.ascend.extra_host_paths)]
        for fld, path in asked:
            if not path_allowed(path, config.allowed_host_paths):
                problems.append(f"{fld}: host path {path} is not allowed (allowed: "
                                f"{', '.join(config.allowed_host_paths) or 'none'})")
    elif spec.backend == "llm-datadist":
        for path in DEFAULT_HOST_PATHS:
            if not path_allowed(path, config.allowed_host_paths):
                problems.append(f"spec.ascend (default): host path {path} is not allowed (allowed: "
                                f"{', '.join(config.allowed_host_paths) or 'none'}); list the paths this "
                                f"cluster allows in spec.ascend")
    image = spec.gateway.image if spec.gateway else None
    if image and image != config.gateway_image and image not in config.allowed_gateway_images:
        allowed = [i for i in (config.gateway_image, *config.allowed_gateway_images) if i]
        problems.append(f"spec.gateway.image: {image} is not an allowed gateway image (allowed: "
                        f"{', '.join(allowed) or 'none; leave it unset for the operator-configured one'})")
    return "; ".join(problems) or None
