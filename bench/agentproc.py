"""pd_agent as real processes on their own loopback IPs, for benchmarks and tests (tests hand in
their `spawn`, which ends the process with the test: tests/agent_procs.py)."""
from __future__ import annotations

import itertools
import os
import subprocess
import sys
import tempfile
import time
from typing import Callable

import httpx

TOKEN = "test-token"
_ips = itertools.count(1)


def next_ip() -> str:
    n = next(_ips)
    return f"127.60.{os.getpid() % 250}.{n}"


class AgentProc:
    def __init__(self, role: str, cluster_id: int, env: dict | None = None, cache_desc: str | None = None,
                 log=None, spawn: Callable[..., subprocess.Popen] = subprocess.Popen):
        self.ip = next_ip()
        self.role = role
        self.cluster_id = cluster_id
        self.url = f"http://{self.ip}:8080"
        e = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
        e.update({
            "PD_LOCAL_POD_IP": self.ip, "POD_NAME": f"{role}-{cluster_id}",
            "LLM_DATADIST_ROLE": role, "LLM_DATADIST_CLUSTER_ID": str(cluster_id),
            "LLM_DATADIST_IP": self.ip, "LLM_DATADIST_PORT": "26000", "PD_AGENT_TOKEN": TOKEN,
            "PD_SIM_TIME_SCALE": "0.05", "PD_DRAIN_TIMEOUT_S": "2",
        })
        if cache_desc:
            e["LLM_DATADIST_CACHE_DESC"] = cache_desc
        e.update(env or {})
        # output to a file, not a pipe: a pipe nobody reads fills up and blocks the agent
        self.log = log or tempfile.TemporaryFile()
        self.proc = spawn([sys.executable, "-m", "pd_agent"], env=e, stdout=self.log, stderr=subprocess.STDOUT)
        self.http = httpx.Client(base_url=self.url, trust_env=False, timeout=30,
                                 headers={"Authorization": f"Bearer {TOKEN}"})
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"agent exited: {self.output()}")
            try:
                if self.http.get("/healthz").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError("agent did not become healthy")

    @property
    def name(self) -> str:
        return f"{self.role}-{self.cluster_id}"

    def peer(self) -> dict:
        return {"name": self.name, "cluster_id": self.cluster_id, "ip": self.ip, "port": 26000,
                "agent_url": self.url}

    def post(self, path: str, body: dict | None = None) -> httpx.Response:
        return self.http.post(path, json=body or {})

    def status(self) -> dict:
        return self.http.get("/v1/status").json()

    def output(self) -> str:
        """Everything the agent printed (after it exited)."""
        if self.proc.poll() is None or not hasattr(self.log, "seek"):
            return ""
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.http.close()
