"""The engine wheel in vendors' images, as `make images` builds them (hack/images/vendor.Dockerfile):
it imported in the build, and here it runs: the vLLM connector beside numpy 1.26 in vllm-ascend-pd, the
agent's entry point in pd-ascend-agent and mindie-pd-agent. `make test` builds the images first."""
from __future__ import annotations

import subprocess

import pytest

from tests.conftest import REPO

REGISTRY = "example.com/pd"


def built(image: str) -> str:
    """The image `make images` built: on the vendor's release, or (where that cannot be pulled) on the
    stand-in, tagged `-standin`."""
    for ref in (f"{REGISTRY}/{image}", f"{REGISTRY}/{image}-standin"):
        if subprocess.run(["docker", "image", "inspect", ref], capture_output=True).returncode == 0:
            return ref
    raise AssertionError(f"no {REGISTRY}/{image} (or -standin): make images builds it")


def docker(*args: str) -> str:
    r = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, f"docker {' '.join(args)}: {r.stderr[-2000:]} (make images builds the images)"
    return r.stdout


def test_vllm_ascend_pd_has_the_connector_beside_the_releases_numpy():
    out = docker("run", "--rm", "--network", "host", "--entrypoint", "python3", built("vllm-ascend-pd:v0.9.1"),
                 "-c", "import numpy, pd_engine.vllm_connector as c; print(numpy.__version__, c.__file__)")
    version, path = out.split()
    assert version == "1.26.4" and "site-packages/pd_engine/vllm_connector.py" in path


@pytest.mark.parametrize("image", ["pd-ascend-agent:8.0", "mindie-pd-agent:2.1"])
def test_the_agent_images_start_the_agent(image):
    out = docker("run", "--rm", "--network", "host", built(image), "--help")
    assert "usage" in out.lower() and "pd_agent" in out
