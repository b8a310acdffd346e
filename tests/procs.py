"""Processes a test starts end with the test.

`spawn` starts a process the current test owns; the autouse fixture in tests/conftest.py
ends every one of them when the test ends, passed or failed (SIGTERM, then SIGKILL after a
grace). Every process that inherits the suite's environment carries SESSION_ENV (operators,
agents and load generators the tests start, the local clusters' control planes and node
agents), so the session can check at the end that none is left running. Pods the local node
agent runs get an environment of their own; they end with their node agent, which the check
covers."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

SESSION_ENV = "PD_TEST_SESSION"
_owned: list[subprocess.Popen] = []


def spawn(args: list[str], **kw) -> subprocess.Popen:
    p = subprocess.Popen(args, **kw)
    _owned.append(p)
    return p


def end(p: subprocess.Popen, grace: float = 20) -> int | None:
    """SIGTERM, then SIGKILL if it is still there after `grace` seconds."""
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
    return p.returncode


def end_owned() -> list[str]:
    """End what the test started; the commands that had to be killed."""
    killed = []
    while _owned:
        p = _owned.pop()
        if p.poll() is None:
            end(p)
            if p.returncode == -signal.SIGKILL:
                killed.append(" ".join(map(str, p.args))[:200])
    return killed


def session_processes(session: str) -> list[tuple[int, str]]:
    """(pid, command line) of live processes whose environment carries this session's marker."""
    marker = f"{SESSION_ENV}={session}".encode()
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if marker not in (d / "environ").read_bytes().split(b"\0"):
                continue
            if (d / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue   # exited, waiting to be reaped by its parent
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        out.append((int(d.name), cmd[:200]))
    return out


def kill_all(pids: list[int], grace: float = 10) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in pids):
        time.sleep(0.2)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
