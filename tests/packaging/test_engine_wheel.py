"""The slim engine wheel (pd-engine, hack/engine-wheel/build.py) installs where vllm-ascend's images
are: into a venv that already has numpy 1.26, leaving numpy as it was, and the vLLM connector's and
the vLLM stand-in's tests pass against the installed wheel (not the checkout). The venv is Python
3.10 where the machine has one (this one does, through pyenv), else this Python (printed)."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.conftest import REPO


def python310() -> str:
    """A Python 3.10 (vllm-ascend's images run 3.10 or 3.11), else this one."""
    for c in [shutil.which("python3.10"), *sorted(Path.home().glob(".pyenv/versions/3.10*/bin/python3.10"))]:
        if c and subprocess.run([str(c), "--version"], capture_output=True).returncode == 0:
            return str(c)
    return sys.executable


def run(*cmd: str, cwd: Path | None = None) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=900)
    assert r.returncode == 0, f"{' '.join(cmd)}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def test_the_engine_wheel_installs_beside_numpy_1_26_and_its_tests_pass(tmp_path: Path) -> None:
    wheel = Path(run(sys.executable, str(REPO / "hack" / "engine-wheel" / "build.py"), "--out",
                     str(tmp_path / "dist")).strip().splitlines()[-1])
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if "/" in n and not n.startswith("pd_engine-")} == {
        "pd_engine", "pd_contract", "pd_router", "pd_agent", "llm_datadist_sim"}, \
        "the operator and the gateway stay out (the load generator's router, pd_router, goes in)"
    venv = tmp_path / "venv"
    run(python310(), "-m", "venv", str(venv))
    pip, py = str(venv / "bin" / "pip"), str(venv / "bin" / "python")
    run(pip, "install", "-q", "numpy==1.26.4")                        # what the engine image already has
    run(pip, "install", "-q", f"{wheel}[standin]", "pytest==9.2.0", "pytest-asyncio==1.5.0", "pytest-timeout==2.4.0")
    got = run(py, "-c", "import sys, numpy, pd_engine; print(sys.version_info[:2], numpy.__version__, "
                        "pd_engine.__file__)", cwd=tmp_path)
    print(f"\nengine wheel in {got.strip()}")
    assert "1.26.4" in got and str(venv) in got
    # the tests, from the checkout, against the installed packages (the checkout's package folders are
    # not on the path: only the repository root, for the tests package)
    out = run(py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore",
              "tests/unit/test_vllm_connector.py", "tests/unit/test_vllm_standin.py", cwd=REPO)
    print(out.strip().splitlines()[-1])
