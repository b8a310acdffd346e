"""Observe: what the agents report, gathered under per-member backoff. Every failure comes
back as a result on that member, never as an exception for the deployment.

A pod is asked only when its backoff allows: an agent that keeps failing (a crash loop, a
pod that never gets Ready, a black-holed address) is asked at 1, 2, 4 … 30 s intervals,
like any other failing call. A pod on its first start, not Ready yet, is asked on a short
schedule (0.25 s up to 2 s), so an engine is linked as soon as its agent is up. The backoff
key includes both, so a pod that just became Ready is asked at once."""
from __future__ import annotations

import asyncio

from .agentclient import AgentCallError, AgentClient
from .api import PDDeploymentSpec
from .backoff import Backoff
from .links import Engine
from .rebalance import PERIODIC
from .reports import Report
from .state import Memory
from .switch import Book

STARTING_BACKOFF = (0.25, 2.0)


def ask_always(spec: PDDeploymentSpec, book: Book, engines: list[Engine], wall: float) -> set[str]:
    """Switching pods every pass; everyone when a periodic policy's evaluation is due, so it
    decides on fresh signals rather than on reports up to decide.SETTLED_POLL_S old."""
    pods = {s.pod for s in book.switches}
    rb = spec.rebalance
    if rb is not None and rb.policy in PERIODIC and wall >= book.next_evaluation:
        pods |= {e.pod for e in engines}
    return pods


def to_ask(mem: Memory, engines: list[Engine], now: float, dirty: set[str],
           always: set[str] | frozenset[str] = frozenset()) -> set[str]:
    """Members to ask this pass: any whose pod changed, that is not settled (not linked yet,
    leaving, never asked), or whose settled interval is over. A large deployment coming up
    then costs a call per changing member, not one per member on every pass."""
    return {e.pod for e in engines if e.pod in dirty or e.leaving or e.pod not in mem.reports
            or e.pod in always or now >= mem.next_poll.get(e.pod, 0.0)}


def backoff_key(e: Engine) -> tuple[str, bool, bool]:
    return e.pod, e.ready, e.starting


async def gather(engines: list[Engine], client: AgentClient, token: str, backoff: Backoff, now: float,
                 limiter: asyncio.Semaphore, only: set[str] | None = None) -> dict[str, Report]:
    """Reports from the agents that are due; init the ones whose engine is not initialised."""
    targets = [e for e in engines if e.agent_url and (only is None or e.pod in only)
               and backoff.due(backoff_key(e), now)]

    async def one(e: Engine) -> tuple[Engine, Report]:
        url = e.agent_url or ""   # (targets have one)
        try:
            s = await client.status(url, token, limiter)
            if not s.initialized and e.ready:
                s = await client.init(url, token, limiter)
            return e, Report(status=s)
        except AgentCallError as err:
            return e, Report(error=err)
    out = {}
    for e, rep in await asyncio.gather(*(one(e) for e in targets)):
        if rep.error is not None:
            backoff.fail(backoff_key(e), now, *(STARTING_BACKOFF if e.starting else (None, None)))
        else:
            backoff.succeed(backoff_key(e))
        out[e.pod] = rep
    return out
