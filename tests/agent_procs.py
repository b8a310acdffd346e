"""pd_agent as real processes on their own loopback IPs (bench/agentproc.py), each ended with the
test that started it (tests.procs.spawn)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import agentproc  # noqa: E402
from agentproc import TOKEN, next_ip  # noqa: E402,F401 - re-exported for the tests

from tests.procs import spawn  # noqa: E402


class AgentProc(agentproc.AgentProc):
    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **{"spawn": spawn, **kw})
