"""What acting did, as values: act's calls return these and `fold` alone turns them into the
memory the next pass decides from (`fold_seen`: the Secrets it created, into observing's own).
Agent failures travel here, never as exceptions (an API error is raised for the error policy)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .children import Applied, ChildKey
from .diagnosis import Diagnosis
from .state import Memory, Seen


@dataclass(frozen=True)
class LinkAttempt:
    """One link attempt (or an unlink that could not be made): linked when `diagnosis` is None."""
    decoder: str
    cluster_id: int
    code: str
    diagnosis: Diagnosis | None = None


@dataclass(frozen=True)
class StepResult:
    """One pod's switch intents: carried out, or the action that failed and why."""
    pod: str
    failed: str | None = None       # "<action>: <code>: <message>"
    refused: str | None = None      # the engine cannot switch at all (LLM_FEATURE_NOT_ENABLED)


@dataclass
class Results:
    applied: dict[ChildKey, Applied] = field(default_factory=dict)
    links: list[LinkAttempt] = field(default_factory=list)
    verified: list[dict] = field(default_factory=list)       # one verification round's answers
    verified_at: str | None = None
    verified_links: frozenset | None = None   # the link set a round verified, when the links just made completed it
    next_verify: float | None = None          # a round ran: when the next is due (monotonic)
    steps: list[StepResult] = field(default_factory=list)
    switch_verified: list[tuple[tuple[str, str], tuple[str, str]]] = field(default_factory=list)
    tokens_created: dict[str, str] = field(default_factory=dict)    # role -> token
    tokens_taken: list[str] = field(default_factory=list)           # roles whose Secret someone else made
    pools_written: bool = False                # an InferencePool was applied or deleted: read them again
    pool_errors: list[str] = field(default_factory=list)             # why a write of one was refused

    def links_failing(self, before: dict) -> bool:
        """Whether any link is failing once these attempts are folded into `before` (Memory.failures)."""
        ok = {(r.decoder, r.cluster_id) for r in self.links if r.diagnosis is None}
        return any(r.diagnosis is not None for r in self.links) or any(k not in ok for k in before)


def fold(mem: Memory, res: Results, now: float) -> None:
    """Record what acting did in the memory (the only place it does)."""
    mem.applied.update(res.applied)
    for r in res.links:
        if r.diagnosis is None:
            mem.succeed(r.decoder, r.cluster_id)
        else:
            mem.fail(r.decoder, r.cluster_id, r.code, r.diagnosis, now)
    for v in res.verified:
        mem.verify[v["decoder"]] = v
    if res.verified_at is not None:
        mem.verified_at = res.verified_at
    if res.verified_links is not None:   # its digest is taken from the next pass's reports (decide._links)
        mem.verified_links, mem.verify_digest = res.verified_links, None
    if res.next_verify is not None:
        mem.verify_round += 1
        mem.next_verify = res.next_verify
    for (pod, boot), pair in res.switch_verified:
        mem.switch_verified.setdefault((pod, boot), set()).add(pair)
    for s in res.steps:
        if s.failed is None:
            mem.switch_backoff.succeed(s.pod)
            mem.switch_errors.pop(s.pod, None)
            continue
        mem.switch_backoff.fail(s.pod, now)
        mem.switch_errors[s.pod] = s.failed[:300]
        mem.switch_fails[s.pod] = mem.switch_fails.get(s.pod, 0) + 1
        if s.refused is not None:
            mem.switch_refused[s.pod] = s.refused[:300]


def fold_seen(seen: Seen, res: Results, now: float) -> None:
    """The token Secrets created: observing need not read back what it knows."""
    for role, token in res.tokens_created.items():
        seen.token_create.pop(role, None)
        if role == "control":
            seen.token, seen.token_read_at = token, now
    if res.tokens_taken:
        seen.token_read_at = 0.0   # read again: the next pass judges the Secret someone else made
    if res.pools_written or res.pool_errors:
        seen.pools_at = 0.0
        seen.pool_error = "; ".join(res.pool_errors)
