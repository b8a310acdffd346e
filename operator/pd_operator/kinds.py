"""The kinds the operator reads and writes, once: apiVersion and plural for the client, and
which of them are a PDDeployment's children (watched by Kopf, listed again by the relist)."""
from __future__ import annotations

from dataclasses import dataclass

from .api import GROUP, KIND, VERSION


@dataclass(frozen=True)
class Kind:
    kind: str
    api_version: str
    plural: str

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]

    @property
    def version(self) -> str:
        return self.api_version.rpartition("/")[2]


CHILDREN = (
    Kind("StatefulSet", "apps/v1", "statefulsets"),
    Kind("Service", "v1", "services"),
    Kind("ConfigMap", "v1", "configmaps"),
    Kind("Deployment", "apps/v1", "deployments"),
    Kind("ServiceAccount", "v1", "serviceaccounts"),
    Kind("Role", "rbac.authorization.k8s.io/v1", "roles"),
    Kind("RoleBinding", "rbac.authorization.k8s.io/v1", "rolebindings"),
    Kind("NetworkPolicy", "networking.k8s.io/v1", "networkpolicies"),
    Kind("PodDisruptionBudget", "policy/v1", "poddisruptionbudgets"),
)
OTHERS = (
    Kind(KIND, f"{GROUP}/{VERSION}", "pddeployments"),
    Kind("PDGateway", f"{GROUP}/{VERSION}", "pdgateways"),
    Kind("Pod", "v1", "pods"),
    Kind("Secret", "v1", "secrets"),
    Kind("Event", "v1", "events"),
    Kind("Lease", "coordination.k8s.io/v1", "leases"),
    Kind("Ingress", "networking.k8s.io/v1", "ingresses"),
    Kind("InferencePool", "inference.networking.k8s.io/v1", "inferencepools"),   # only where its CRD is
)
BY_KIND = {k.kind: k for k in CHILDREN + OTHERS}
