"""An instance of several pods (a gang) or of several data-parallel groups, seen from its agents.

The pod of index 0 in the instance leads: its agent fronts every rank of the instance. It starts
its own ranks and takes the other pods' on (`Members`): the operator tells it which pods hold the
rest (POST /v1/gang) and it reads each one's registered ranks (GET /v1/ranks), reaching them
through that pod's agent (`/r/<rank>/...` on the agent port, the one port engines admit). So
links, verification, drain and switch_role reach every rank of every pod through one agent, and
the instance is ready (and routed to) only once every rank is. The other pods' agents start and
supervise their own ranks, refuse requests, and say in their status that they do not lead.

Data-parallel groups (`Groups`): a decode is pulled and computed by one group, the one with the
fewest decodes in hand; a prefill is computed by every rank, so that whichever decoder group reads
a request finds its copy on the prefill rank it pairs with (with MLA every rank holds the latent)."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx

from pd_contract.agent_api import AgentPath, GangMember, GangRequest, GangState, RegisterRank
from pd_contract.engine_env import Gang

from .core import AgentError

log = logging.getLogger("pd_agent.gang")
ADOPT_EVERY_S = 2.0     # a leading pod missing ranks reads its members' registries this often
ASK_S = 5.0


class Members:
    """The leading pod's other pods and their ranks, taken on into its rank table."""

    def __init__(self, gang: Gang, http: httpx.AsyncClient, headers: Callable[[], dict[str, str]],
                 register: Callable[[RegisterRank], None], clock: Callable[[], float]):
        self.gang, self.http, self.headers, self.register, self.clock = gang, http, headers, register, clock
        self.members: dict[str, GangMember] = {}
        self.asked_at = float("-inf")
        self.error = ""
        self._lock = asyncio.Lock()

    def tell(self, req: GangRequest) -> bool:
        """The operator's word on the instance's other pods (a pod replaced comes with its new
        address). True if it changed them (their ranks are then read afresh)."""
        if not self.gang.leader:
            raise AgentError("NOT_LEADING", f"this pod is pod {self.gang.index} of its instance; the instance's "
                                            "pod 0 takes its members", 409)
        per = self.gang.per_pod
        for m in req.members:
            if m.first_rank % per or not per <= m.first_rank < self.gang.ranks:
                raise AgentError("LLM_PARAM_INVALID", f"member {m.pod}: first_rank {m.first_rank} is not the first "
                                 f"rank of another pod ({per} ranks each, {self.gang.ranks} in the instance)", 400)
        members = {m.pod: m for m in req.members}
        if members == self.members:
            return False
        self.members, self.asked_at = members, float("-inf")
        return True

    async def adopt(self, missing: bool) -> None:
        """Reads the members' ranks when some are missing (every ADOPT_EVERY_S at most) and
        registers each here under its instance rank."""
        if not self.members or not missing or self.clock() - self.asked_at < ADOPT_EVERY_S or self._lock.locked():
            return
        async with self._lock:
            self.asked_at = self.clock()
            errors = await asyncio.gather(*(self._one(m) for m in self.members.values()))
            self.error = "; ".join(e for e in errors if e)

    async def _one(self, m: GangMember) -> str:
        try:
            r = await self.http.get(f"{m.agent_url.rstrip('/')}{AgentPath.RANKS}", headers=self.headers(),
                                    timeout=ASK_S)
            got = r.json().get("ranks", []) if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError) as e:
            return f"pod {m.pod} ({m.agent_url}): {e!r}"
        if got is None:
            return f"pod {m.pod}: GET {AgentPath.RANKS} answered HTTP {r.status_code}"
        for x in got:
            try:
                reg = RegisterRank.model_validate(x)
            except ValueError as e:
                return f"pod {m.pod}: a rank it lists: {e}"
            if not m.first_rank <= reg.rank < m.first_rank + self.gang.per_pod:
                return f"pod {m.pod} lists rank {reg.rank}, not one of its ranks {m.first_rank}+"
            # reached through that pod's agent (its rank API listens on the pod's own ports only)
            url = f"{m.agent_url.rstrip('/')}{AgentPath.rank_prefix(reg.rank)}"
            try:
                self.register(reg.model_copy(update={"url": url}))
            except AgentError as e:
                return f"pod {m.pod} rank {reg.rank}: {e}"
        return ""

    def state(self, registered: Callable[[int], bool]) -> GangState:
        g = self.gang
        return GangState(index=g.index, pods=g.pods, tp=g.tp, dp=g.dp,
                         members={p: m.agent_url for p, m in sorted(self.members.items())},
                         missing=[r for r in range(g.ranks) if not registered(r)] if g.leader else [])


class Groups:
    """A decoder instance's data-parallel groups: which one takes a request."""

    def __init__(self, gang: Gang):
        self.tp = gang.tp
        self.in_hand = [0] * gang.dp

    def ranks(self, group: int) -> list[int]:
        return list(range(group * self.tp, (group + 1) * self.tp))

    @contextmanager
    def take(self) -> Iterator[int]:
        """The group with the fewest decodes in hand, for one decode."""
        g = min(range(len(self.in_hand)), key=lambda i: (self.in_hand[i], i))
        self.in_hand[g] += 1
        try:
            yield g
        finally:
            self.in_hand[g] -= 1
