"""Act: the thin I/O the reconcile decided on. Server-side apply under the one field
manager, link/unlink/verify through the agents, Events. What each call did comes back in a
`Results` (results.fold records it in the memory); API errors are raised for the error policy."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pd_contract.agent_api import Peer, RankEndpoint
from pd_contract.names import LINKED_CODES, llmd_labels

from . import children as ch
from . import gangs as gangs_
from . import links as lk
from . import pools
from . import tokens as tk
from .agentclient import AgentCallError, AgentClient, code_label
from .builders import ANNOTATION_ROLE, LABEL_ROLE, token_secret
from .conditions import iso
from .diagnosis import Diagnosis, link_failure
from .events import Events
from .kube import Kube, KubeError
from .metrics import OperatorMetrics
from .results import LinkAttempt, Results, StepResult
from .runtime import SYSTEM_CLOCK, Clock
from .state import Memory, Seen
from .switch import ENGINE_ROLE, Intent, IntentKind

log = logging.getLogger("pd_operator.act")


def url_of(e: lk.Engine) -> str:
    """The engine's agent URL (planned calls go only to engines whose agent answered)."""
    if not e.agent_url:
        raise AgentCallError("AgentUnreachable", f"{e.pod}: no agent URL (the pod has no IP yet)")
    return e.agent_url


def peer_of(e: lk.Engine) -> Peer:
    ranks = [RankEndpoint(rank=r, cluster_id=cid, ip=ip or "0.0.0.0", port=port or 1)
             for r, (cid, ip, port) in enumerate(e.ranks)] if e.tp > 1 and e.ranks else None
    return Peer(name=e.pod, cluster_id=e.cluster_id, ip=e.ip or "", port=e.port, agent_url=e.agent_url,
                boot_id=e.boot_id, ranks=ranks)


def _peer_of_link(link: dict) -> Peer:
    ranks = [RankEndpoint(rank=r["rank"], cluster_id=r["cluster_id"], ip=r.get("ip") or "0.0.0.0",
                          port=r.get("port") or 1) for r in link["ranks"]] if link.get("ranks") else None
    return Peer(name=link["name"], cluster_id=link["cluster_id"], ip=link.get("ip") or "0.0.0.0",
                port=link.get("port") or 1, ranks=ranks)


async def create_tokens(kube: Kube, seen: Seen, name: str, namespace: str, owner: dict, res: Results) -> None:
    """The agents' bearer tokens, control (the operator's), data (routers') and peer (pull notices
    between the deployment's agents), whose digests the status now records: created once, never
    re-generated (running pods hold them). One that exists already (409) was made by someone
    else: the next pass reads it and refuses it (tokens.judge)."""
    for role, token in list(seen.token_create.items()):
        made = await kube.create(token_secret(name, namespace, token, owner, tk.SECRETS[role](name)))
        if made is None:
            res.tokens_taken.append(role)
        else:
            res.tokens_created[role] = token


class NameTaken(Exception):
    """Objects of the names the deployment's children have, controlled by another owner."""

    def __init__(self, taken: list[str]):
        super().__init__("; ".join(taken))
        self.taken = taken


async def apply_children(kube: Kube, metrics: OperatorMetrics, objs: list[dict], res: Results,
                         observed: frozenset = frozenset(), uid: str | None = None) -> None:
    """Server-side apply of each object. With `uid`, an object not `observed` among the children (a
    name the deployment has not applied before) is read first: one another owner controls is not
    applied over (NameTaken), and nothing is."""
    if uid is not None:
        taken = []
        for obj in objs:
            if ch.child_key(obj) in observed:
                continue
            meta = obj["metadata"]
            have = await kube.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
            if have is not None:
                taken += ch.taken({ch.child_key(obj): have}, uid)
        if taken:
            raise NameTaken(taken)
    for obj in objs:
        got = await kube.apply(obj)
        res.applied[ch.child_key(obj)] = (ch.digest(obj), ch.marker(got))
        metrics.applies.labels(obj["kind"]).inc()


async def execute(body: dict, agents: AgentClient, events: Events, metrics: OperatorMetrics,
                  limiter: asyncio.Semaphore, plan: lk.DecoderPlan, token: str, link_timeout_ms: int
                  ) -> list[LinkAttempt]:
    """One decoder's unlinks and links; what became of each link."""
    d = plan.decoder
    out: list[LinkAttempt] = []
    try:
        for force, stale in ((True, plan.force_unlink), (False, plan.unlink)):
            for batch in lk.batches(stale):
                res = await agents.unlink(url_of(d), token, [_peer_of_link(l) for l in batch], force=force,
                                          limiter=limiter)
                for code in res.rets.values():
                    metrics.link_ops.labels("force_unlink" if force else "unlink", code_label(code)).inc()
                names = ", ".join(l["name"] for l in batch)
                await events.post(body, "Normal", "Unlinked", f"{d.pod} unlinked {names}"
                                  + (" (broken link, local end)" if force else ""))
        for batch in plan.link_batches():
            res = await agents.link(url_of(d), token, [peer_of(e) for e in batch], link_timeout_ms,
                                    limiter=limiter)
            ok, bad = [], []
            for e in batch:
                code = res.rets.get(e.pod, "LLM_FAILED")
                metrics.link_ops.labels("link", code_label(code)).inc()
                if code in LINKED_CODES:
                    out.append(LinkAttempt(d.pod, e.cluster_id, code))
                    ok.append(e.pod)
                else:
                    diag = _link_failure(code, d, e, (res.rank_rets or {}).get(e.pod), link_timeout_ms)
                    out.append(LinkAttempt(d.pod, e.cluster_id, code, diag))
                    bad.append((code, diag))
            if ok:
                await events.post(body, "Normal", "Linked", f"{d.pod} linked {', '.join(ok)} (LLM_SUCCESS) "
                                  f"in {res.duration_ms:.0f} ms", key=f"{d.pod} linked {', '.join(ok)}")
            for code, diag in bad:
                await events.post(body, "Warning", diag.reason, f"{code}: {diag.message}")
    except AgentCallError as err:
        log.info("agent call to %s failed: %s", d.pod, err)
        diag = Diagnosis(err.kind, f"{d.pod}: {err}")
        for cid in {e.cluster_id for e in plan.link} | {l["cluster_id"] for l in plan.unlink + plan.force_unlink}:
            out.append(LinkAttempt(d.pod, cid, err.code or err.kind, diag))
    return out


def _link_failure(code: str, d: lk.Engine, e: lk.Engine, rank_codes: list[str] | None, timeout_ms: int) -> Diagnosis:
    """The diagnosis of a failed pod link names the rank that failed, and its address."""
    bad = next((r for r, c in enumerate(rank_codes or []) if c not in LINKED_CODES), None)
    if bad is None or bad >= len(e.ranks):
        return link_failure(code, d.pod, e.pod, e.ip or "", e.port, timeout_ms)
    _, ip, port = e.ranks[bad]
    return link_failure(code, f"{d.pod} rank {bad}", f"{e.pod} rank {bad}", ip, port, timeout_ms)


async def verify(body: dict, agents: AgentClient, events: Events, mem: Memory, limiter: asyncio.Semaphore,
                 pairs: list[tuple[lk.Engine, lk.Engine]], token: str, res: Results, wall: float) -> None:
    """One verification round: each decoder pulls a probe from one prefill. `mem` is read only
    (what the last round found, for the Events of a change)."""
    async def one(d: lk.Engine, p: lk.Engine) -> dict:
        try:
            return (await agents.verify(url_of(d), token, peer_of(p), limiter=limiter)).model_dump()
        except AgentCallError as err:
            return {"ok": False, "code": err.code or err.kind, "message": str(err), "prefill": p.pod,
                    "decoder": d.pod, "bytes": 0, "pull_ms": 0}
    results = await asyncio.gather(*(one(d, p) for d, p in pairs))
    first_time = not mem.verify and not mem.verify_carried
    for r in results:
        agents.metrics.verified(body["metadata"].get("namespace", ""), body["metadata"]["name"], r["ok"], r["code"])
        before = mem.verify.get(r["decoder"])
        if not r["ok"] and (before is None or before.get("ok")):
            reason = "KVContentMismatch" if r["code"] == "KV_CONTENT_MISMATCH" else "KVPathVerifyFailed"
            await events.post(body, "Warning", reason,
                              f"{r['decoder']} <- {r['prefill']}: {r['code']} {r.get('message', '')}")
    if first_time and results and all(r["ok"] for r in results):
        await events.post(body, "Normal", "KVPathVerified", "; ".join(
            f"{r['decoder']} <- {r['prefill']}: {r['bytes']} B in {r['pull_ms']:.2f} ms" for r in results),
            key="first verification")
    res.verified = results
    res.verified_at = iso(wall)


# ---- role switching ---------------------------------------------------------------------------

@dataclass(frozen=True)
class _Switching:
    """What carrying out one pod's switch intents needs."""
    kube: Kube
    agents: AgentClient
    mem: Memory                  # read only
    limiter: asyncio.Semaphore
    res: Results
    namespace: str
    reported: dict[str, list[dict]]
    pairs: dict[str, list[tuple[lk.Engine, lk.Engine]]]
    token: str


async def _label(c: _Switching, it: Intent, e: lk.Engine | None) -> None:
    """The role label and llm-d's labels in one patch: a pod leaves (or joins) the role Services
    and every InferencePool that selects llm-d's labels at the same moment."""
    assert it.role is not None
    labels: dict[str, str | None] = {LABEL_ROLE: it.role, **llmd_labels(it.role)}
    await _instance_patch(c, it, e, {"metadata": {"labels": labels}})


async def _annotate(c: _Switching, it: Intent, e: lk.Engine | None) -> None:
    await _instance_patch(c, it, e, {"metadata": {"annotations": {ANNOTATION_ROLE: it.role}}})


async def _instance_patch(c: _Switching, it: Intent, e: lk.Engine | None, patch: dict) -> None:
    """The pod's patch, and its instance's other pods' (one gone is left to the gang's restart)."""
    for pod in (e.followers if e is not None else ()):
        try:
            await c.kube.patch("v1", "Pod", c.namespace, pod, patch)
        except KubeError as err:
            if err.status != 404:
                raise
    await c.kube.patch("v1", "Pod", c.namespace, it.pod, patch)


async def _drain(c: _Switching, it: Intent, e: lk.Engine | None) -> None:
    assert e is not None and e.agent_url
    await c.agents.drain(e.agent_url, c.token, limiter=c.limiter)


async def _undrain(c: _Switching, it: Intent, e: lk.Engine | None) -> None:
    assert e is not None and e.agent_url
    await c.agents.undrain(e.agent_url, c.token, limiter=c.limiter)


async def _switch_role(c: _Switching, it: Intent, e: lk.Engine | None) -> None:
    assert e is not None and e.agent_url and it.role is not None
    await c.agents.switch_role(e.agent_url, c.token, ENGINE_ROLE[it.role], limiter=c.limiter)


async def _unlink_all(c: _Switching, it: Intent, e: lk.Engine | None) -> None:
    assert e is not None and e.agent_url
    for batch in lk.batches(c.reported.get(it.pod, [])):
        await c.agents.unlink(e.agent_url, c.token, [_peer_of_link(l) for l in batch], limiter=c.limiter)


async def _verify(c: _Switching, it: Intent, e: lk.Engine | None) -> None:
    assert e is not None
    await _switch_verify(c, e, c.pairs.get(it.pod, []))


# each kind of switch intent: (whether it calls the pod's agent, what carries it out); a kind
# missing here fails the type check (the table is typed by IntentKind) and test_act_intents
INTENTS: dict[IntentKind, tuple[bool, Callable[[_Switching, Intent, lk.Engine | None], Awaitable[None]]]] = {
    "label": (False, _label), "annotate": (False, _annotate), "drain": (True, _drain), "undrain": (True, _undrain),
    "switch_role": (True, _switch_role), "unlink_all": (True, _unlink_all), "verify": (True, _verify),
}


async def switch_intents(kube: Kube, agents: AgentClient, mem: Memory, limiter: asyncio.Semaphore, res: Results,
                         namespace: str, intents: list[Intent], engines: dict[str, lk.Engine],
                         reported: dict[str, list[dict]], pairs: dict[str, list[tuple[lk.Engine, lk.Engine]]],
                         token: str, clock: Clock = SYSTEM_CLOCK) -> None:
    """Carry out one pod's switch intents in order. An agent failure is a result (the step is
    retried after a backoff; an engine that cannot switch is marked for the abort); an API
    error on the pod is raised, except a pod that is gone (the next pass ends its switch)."""
    ctx = _Switching(kube, agents, mem, limiter, res, namespace, reported, pairs, token)
    for it in intents:
        e = engines.get(it.pod)
        calls_agent, carry_out = INTENTS[it.kind]
        try:
            if calls_agent and (e is None or not e.agent_url or not mem.switch_backoff.due(it.pod, clock.monotonic())):
                return  # an agent call that must wait: the rest of this pod's intents follow it
            await carry_out(ctx, it, e)
        except KubeError as err:
            if err.status == 404:
                return
            raise
        except AgentCallError as err:
            log.info("switch of %s: %s failed: %s", it.pod, it.kind, err)
            res.steps.append(StepResult(it.pod, f"{it.kind}: {err.code or err.kind}: {err}",
                                        str(err) if err.code == "LLM_FEATURE_NOT_ENABLED" else None))
            return
    if intents:
        res.steps.append(StepResult(intents[0].pod))


async def _switch_verify(c: _Switching, e: lk.Engine, pairs: list[tuple[lk.Engine, lk.Engine]]) -> None:
    """Each (decoder, prefill) path through the switched engine pulls a probe, all at once; those
    that pulled are results even if another failed (they are not asked again)."""
    at = (e.pod, e.boot_id or "")
    done = c.mem.switch_verified.get(at, set())
    todo = [(d, p) for d, p in pairs if (d.pod, p.pod) not in done]
    results = await asyncio.gather(*(c.agents.verify(url_of(d), c.token, peer_of(p), limiter=c.limiter)
                                     for d, p in todo), return_exceptions=True)
    failed = None
    for (d, p), r in zip(todo, results):
        if isinstance(r, BaseException):
            if not isinstance(r, AgentCallError):
                raise r
            failed = failed or r
        elif r.ok:
            c.res.switch_verified.append((at, (d.pod, p.pod)))
        else:
            failed = failed or AgentCallError("AgentError", f"{d.pod} <- {p.pod}: {r.message}", r.code)
    if failed is not None:
        raise failed


async def gangs(kube: Kube, agents: AgentClient, ns: str, plan: gangs_.Plan, token: str | None,
                limiter: asyncio.Semaphore) -> bool:
    """An instance's pods: gates lifted together, an incarnation's pods deleted together, its leading
    pod told its members. A pod that changed meanwhile (another uid) is left to the next pass."""
    for pod, uid, keep in plan.ungate:
        try:
            await kube.patch("v1", "Pod", ns, pod, [{"op": "test", "path": "/metadata/uid", "value": uid},
                                                    {"op": "replace", "path": "/spec/schedulingGates", "value": keep}],
                             json_patch=True)
        except KubeError as e:
            log.info("%s/%s: its scheduling gate not lifted: %s", ns, pod, e)
    for pod, uid, why in plan.delete:
        log.warning("%s/%s: deleted: %s", ns, pod, why)
        try:
            await kube.delete("v1", "Pod", ns, pod, uid=uid)
        except KubeError as e:
            if e.status != 409:
                raise
    for pod, url, req in plan.tell if token else []:
        try:
            await agents.gang(url, token, req, limiter=limiter)   # type: ignore[arg-type]
        except AgentCallError as e:
            log.info("%s/%s: not told its instance's pods: %s", ns, pod, e)
    return bool(plan.ungate or plan.delete or plan.tell)


async def pools_and_gangs(kube: Kube, agents: AgentClient, ns: str, plan: Any, token: str | None,
                          limiter: asyncio.Semaphore, res: Results) -> bool:
    """The plan's InferencePools and its instances of several pods (decide.Plan's `pools`, `gangs`)."""
    kept = await keep_pools(kube, ns, plan.pools, res)
    return await gangs(kube, agents, ns, plan.gangs, token, limiter) or kept


async def keep_pools(kube: Kube, ns: str, plan: pools.PoolPlan, res: Results) -> bool:
    """InferencePools applied and deleted. A refusal (an API server that stopped serving them,
    RBAC, a webhook) is a result the condition names, tried again when they are next read, never
    the pass's failure. True if any was written."""
    for obj in plan.apply:
        try:
            await kube.apply(obj)
            res.pools_written = True
        except KubeError as e:
            log.warning("InferencePool %s/%s not applied: %s", ns, obj["metadata"]["name"], e)
            res.pool_errors.append(f"InferencePool {obj['metadata']['name']} not applied: {e}")
    for pool in plan.delete:
        try:
            await kube.delete(pools.POOL_API, pools.POOL_KIND, ns, pool)
            res.pools_written = True
        except KubeError as e:
            if e.status != 404:
                log.warning("InferencePool %s/%s not deleted: %s", ns, pool, e)
                res.pool_errors.append(f"InferencePool {pool} not deleted: {e}")
    return res.pools_written
