"""What one call to an agent gave (pure data): its status, or a typed failure. The client
(agentclient.py) raises these errors; observe and decide read them."""
from __future__ import annotations

from dataclasses import dataclass

from pd_contract.agent_api import AgentStatus


class AgentCallError(Exception):
    def __init__(self, kind: str, message: str, code: str = ""):
        super().__init__(message)
        self.kind = kind      # AgentUnreachable | AgentUnauthorized | AgentError | AgentBadReply
        self.code = code      # the agent's error code, if it answered


@dataclass(frozen=True)
class Report:
    status: AgentStatus | None = None
    error: AgentCallError | None = None
