"""e2e: the scenarios run against "a cluster with the chart installed", written once for two
targets:

- the local cluster with the container runtime (default; part of `make test`): a second local
  control plane in .localcluster-e2e whose node agent runs every pod from its image under
  Docker (`make images` builds them first);
- any cluster named by PD_E2E_KUBECONFIG, with the images already loaded (`make e2e-kind`
  creates a kind cluster and loads them)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, Cluster

REGISTRY = os.environ.get("PD_IMAGE_REGISTRY", "example.com/pd")


def version() -> str:
    for line in (REPO / "pyproject.toml").read_text().splitlines():
        if line.startswith("version = "):
            return line.split('"')[1]
    raise RuntimeError("no version in pyproject.toml")


def image(name: str) -> str:
    return f"{REGISTRY}/{name}:{version()}"


@pytest.fixture(scope="session")
def e2e_cluster() -> Cluster:
    from pd_localcluster.__main__ import bin_dir_default
    bin_dir = bin_dir_default()
    kc = os.environ.get("PD_E2E_KUBECONFIG")
    if kc:
        yield Cluster(kubeconfig=Path(kc), bin_dir=bin_dir)
        return
    from pd_localcluster.cluster import LocalCluster
    missing = [n for n in ("pd-operator", "pd-sim-agent", "pd-gateway")
               if subprocess.run(["docker", "image", "inspect", image(n)], capture_output=True).returncode]
    assert not missing, f"images {missing} are not built: run `make images` (make test does)"
    lc = LocalCluster(REPO / ".localcluster-e2e")
    if lc.is_up():
        lc.down(quiet=True)
    lc.up(bin_dir, nodes=1, runtime="container")
    try:
        yield Cluster(kubeconfig=lc.paths.kubeconfig, bin_dir=bin_dir)
    finally:
        lc.down()
