"""What the operator remembers about one PDDeployment between passes, by owner: `Memory`, what
decide forks and returns (retry memory per link, the last results of link attempts and
verification, what was applied, switches in flight), with the actor's bookkeeping of its
Events; `Seen`, observing's own (the agents' backoff, the Secrets as last read). The runtime's
per-deployment limit on agent calls is in runtime.Limiters. Nothing here is needed for
correctness after a restart: each pass re-observes; memory only avoids hot retries and
repeated Events."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields

from .backoff import Backoff
from .children import Applied, ChildKey
from .diagnosis import Diagnosis
from .switch import Book

# blocked reasons that are looked at again when due (not only when the spec changes): what a
# quota, a webhook, or another owner's object of a child's name may stop being
RETRIED = frozenset({"ApplyRejected", "NameTaken"})

LINK_BACKOFF = (0.5, 30.0)
SWITCH_BACKOFF = (0.25, 10.0)   # a switch step whose action failed
AGENT_BACKOFF = (1.0, 30.0)
AGENT_CONCURRENCY = 16   # calls in flight to one deployment's agents


@dataclass
class Memory:
    link_backoff: Backoff = field(default_factory=lambda: Backoff(*LINK_BACKOFF))
    agent_errors: dict[str, tuple[str, str]] = field(default_factory=dict)
    failures: dict[tuple[str, int], tuple[str, Diagnosis]] = field(default_factory=dict)
    boot_ids: dict[str, str] = field(default_factory=dict)
    reports: dict = field(default_factory=dict)          # pod -> last AgentStatus
    links_dumped: dict[str, tuple] = field(default_factory=dict)   # pod -> (that AgentStatus, its links as dicts)
    next_poll: dict[str, float] = field(default_factory=dict)  # pod -> when a settled member is asked again
    verify_round: int = 0
    next_verify: float = 0.0
    verified_links: frozenset = frozenset()
    verify: dict[str, dict] = field(default_factory=dict)
    verified_at: str | None = None
    verify_digest: str | None = None      # verification.link_digest of what the last round verified
    verify_carried: bool = False          # the round recorded in status stands for one of ours (a takeover)
    last_status: dict | None = None
    applied_keys: bool | None = None      # whether the children last applied gave the gateway its keys
    proxy_warned: set[str] = field(default_factory=set)
    applied: dict[ChildKey, Applied] = field(default_factory=dict)
    applied_event_generation: int | None = None
    applied_spec: dict | None = None      # the spec whose children were applied last
    blocked: Diagnosis | None = None      # a terminal error for this generation
    blocked_generation: int | None = None
    blocked_attempts: int = 0             # ApplyRejected: refused applies of this generation so far
    blocked_retry_at: float | None = None  # ApplyRejected: when the apply is tried again (monotonic)
    errors: int = 0                       # consecutive transient errors
    pods_ready_at: float | None = None
    was_ready: bool = False
    book: Book | None = None              # switches in flight and cooldown (loaded from status on start)
    switch_backoff: Backoff = field(default_factory=lambda: Backoff(*SWITCH_BACKOFF))
    switch_errors: dict[str, str] = field(default_factory=dict)      # pod -> the last failed action
    switch_fails: dict[str, int] = field(default_factory=dict)       # pod -> failed actions in its switch
    switch_refused: dict[str, str] = field(default_factory=dict)     # pod -> why its engine cannot switch
    switch_verified: dict[tuple[str, str], set] = field(default_factory=dict)  # (pod, boot id) -> pairs ok
    reported_at: dict[str, float] = field(default_factory=dict)   # pod -> when its agent last answered
    gateway_stats: tuple[dict, float] | None = None   # the gateway's /stats and when it was read
    gangs: dict = field(default_factory=dict)   # instance of several pods -> gangs.Memo

    def fork(self) -> "Memory":
        """A copy decide may change without touching this one: containers and backoffs copied."""
        new = copy.copy(self)
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (dict, set, list)):
                setattr(new, f.name, copy.copy(v))
            elif isinstance(v, Backoff):
                setattr(new, f.name, v.copy())
        new.book = self.book.copy() if self.book is not None else None
        return new

    def fail(self, decoder: str, cid: int, code: str, diag: Diagnosis, now: float) -> None:
        self.link_backoff.fail((decoder, cid), now)
        self.failures[(decoder, cid)] = (code, diag)

    def succeed(self, decoder: str, cid: int) -> None:
        self.link_backoff.succeed((decoder, cid))
        self.failures.pop((decoder, cid), None)

    def next_retry_in(self, now: float) -> float | None:
        return self.link_backoff.next_in(now)


@dataclass
class Seen:
    """What observing keeps between passes, its own bookkeeping (not decide's memory): the
    agents' backoff, and the token and keys Secrets as last read and judged."""
    agent_backoff: Backoff = field(default_factory=lambda: Backoff(*AGENT_BACKOFF))
    token: str | None = None
    token_read_at: float = 0.0
    token_problem: str | None = None      # a token Secret the operator did not make (tokens.judge)
    token_digests: dict[str, str] = field(default_factory=dict)   # status.tokenDigests
    token_create: dict[str, str] = field(default_factory=dict)    # role -> token recorded, not yet created
    keys_verdict: tuple[bool, str, str] | None = None   # the gateway's keys Secret: opted in or why not
    keys_read_at: float = 0.0
    # this deployment may have InferencePools to keep or delete (True at start: look once)
    pools_kept: bool = True
    pools: tuple[dict, ...] | None = None   # its InferencePools as last read (None: not read, or failed)
    pools_at: float = 0.0
    pool_error: str = ""                    # why they could not be read, or the last write was refused

    def next_retry_in(self, now: float) -> float | None:
        return self.agent_backoff.next_in(now)
