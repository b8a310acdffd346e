"""`kubectl pdd` with no kubeconfig and no service account says so in one line, not a traceback."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("args", [["status", "x"], ["verify", "x"], ["switch", "abort", "x", "p"]])
def test_without_a_cluster_it_prints_one_line(tmp_path, args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    env.update(KUBECONFIG=str(tmp_path / "none"), HOME=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "pd_operator.kubectl_pdd", *args], capture_output=True, text=True,
                       env=env, timeout=60)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("kubectl pdd: no cluster to talk to") and "KUBECONFIG" in r.stderr
