"""The level-based loop: one worker per PDDeployment reads actual state (pods from the
watch cache, agents' /v1/status), converges links (decoders dial, stale links removed,
failures retried with backoff), verifies the KV path, and writes status.

Runs as a plain asyncio task fed by Kopf event handlers, so no finalizer is needed:
deleting a PDDeployment leaves nothing to clean up that owner references do not."""
from __future__ import annotations

import asyncio
import base64
import logging
import time
from dataclasses import dataclass, field, replace

from pd_agent.models import Peer

from . import links as lk
from .agentclient import AgentCallError, AgentClient
from .backoff import Backoff
from .api import GROUP, KIND, VERSION, PDDeploymentSpec, parse_spec
from .builders import token_secret_name
from .diagnosis import Diagnosis, link_failure
from .events import Events
from .kube import Kube, KubeError
from .status import Observed, build_status, engine_of

log = logging.getLogger("pd_operator.controller")
Key = tuple[str, str]
BACKOFF_BASE_S = 0.5
BACKOFF_CAP_S = 30.0
TOKEN_TTL_S = 20.0
HOLDING_RECHECK_S = 0.5


@dataclass
class DeploymentState:
    link_backoff: Backoff = field(default_factory=lambda: Backoff(BACKOFF_BASE_S, BACKOFF_CAP_S))
    agent_backoff: Backoff = field(default_factory=lambda: Backoff(1.0, BACKOFF_CAP_S))
    agent_errors: dict[str, tuple[str, str]] = field(default_factory=dict)
    failures: dict[tuple[str, int], tuple[str, Diagnosis]] = field(default_factory=dict)
    boot_ids: dict[str, str] = field(default_factory=dict)
    verify_round: int = 0
    next_verify: float = 0.0
    verified_links: frozenset = frozenset()
    verify: dict[str, dict] = field(default_factory=dict)
    last_status: dict | None = None
    token: str | None = None
    token_read_at: float = 0.0
    proxy_warned: set[str] = field(default_factory=set)

    def due(self, decoder: str, cid: int) -> bool:
        return self.link_backoff.due((decoder, cid), time.monotonic())

    def fail(self, decoder: str, cid: int, code: str, diag: Diagnosis) -> None:
        self.link_backoff.fail((decoder, cid), time.monotonic())
        self.failures[(decoder, cid)] = (code, diag)

    def succeed(self, decoder: str, cid: int) -> None:
        self.link_backoff.succeed((decoder, cid))
        self.failures.pop((decoder, cid), None)

    def next_retry_in(self) -> float | None:
        now = time.monotonic()
        waits = [w for w in (self.link_backoff.next_in(now), self.agent_backoff.next_in(now)) if w is not None]
        return min(waits) if waits else None


def peer_of(e: lk.Engine) -> Peer:
    return Peer(name=e.pod, cluster_id=e.cluster_id, ip=e.ip or "", port=e.port, agent_url=e.agent_url,
                boot_id=e.boot_id)


class Controller:
    def __init__(self, kube: Kube, agents: AgentClient, resync_s: float = 5.0):
        self.kube = kube
        self.agents = agents
        self.events = Events(kube)
        self.resync_s = resync_s
        self.deployments: dict[Key, dict] = {}
        self.pods: dict[Key, dict[str, dict]] = {}
        self.states: dict[Key, DeploymentState] = {}
        self.wake: dict[Key, asyncio.Event] = {}
        self.tasks: dict[Key, asyncio.Task] = {}
        self.stopping = False

    # ---- fed by Kopf's watch events ------------------------------------------------------
    def on_deployment(self, etype: str | None, body: dict) -> None:
        key = (body["metadata"]["namespace"], body["metadata"]["name"])
        if etype == "DELETED" or body["metadata"].get("deletionTimestamp"):
            self.deployments.pop(key, None)
            task = self.tasks.pop(key, None)
            if task:
                task.cancel()
            self.states.pop(key, None)
            return
        self.deployments[key] = body
        if key not in self.tasks and not self.stopping:
            self.wake[key] = asyncio.Event()
            self.tasks[key] = asyncio.create_task(self._worker(key), name=f"pdd/{key[0]}/{key[1]}")
        self.poke(key)

    def on_pod(self, etype: str | None, body: dict) -> None:
        meta = body["metadata"]
        key = (meta["namespace"], meta.get("labels", {}).get("pdoperator.io/deployment", ""))
        pods = self.pods.setdefault(key, {})
        if etype == "DELETED":
            pods.pop(meta["name"], None)
        else:
            pods[meta["name"]] = body
        self.poke(key)

    def poke(self, key: Key) -> None:
        ev = self.wake.get(key)
        if ev:
            ev.set()

    async def stop(self) -> None:
        self.stopping = True
        for t in self.tasks.values():
            t.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    # ---- the loop ------------------------------------------------------------------------
    async def _worker(self, key: Key) -> None:
        while not self.stopping:
            self.wake[key].clear()
            try:
                delay = await self.converge(key)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - never let one deployment stop the operator
                log.exception("converging %s/%s failed: %s", key[0], key[1], e)
                delay = 2.0
            try:
                await asyncio.wait_for(self.wake[key].wait(), delay)
                await asyncio.sleep(0.1)  # coalesce bursts of pod events
            except asyncio.TimeoutError:
                pass

    async def _token(self, key: Key, st: DeploymentState) -> str | None:
        # Re-read now and then: a rotated Secret must show up (as AgentUnauthorized until
        # the pods restart with it), and RBAC allows `get` on the one Secret, not a watch.
        if st.token and time.monotonic() - st.token_read_at < TOKEN_TTL_S:
            return st.token
        sec = await self.kube.get("v1", "Secret", key[0], token_secret_name(key[1]))
        if sec and sec.get("data", {}).get("token"):
            st.token = base64.b64decode(sec["data"]["token"]).decode()
            st.token_read_at = time.monotonic()
        return st.token

    async def converge(self, key: Key) -> float:
        body = self.deployments.get(key)
        if body is None:
            return self.resync_s
        ns, name = key
        st = self.states.setdefault(key, DeploymentState())
        spec = parse_spec(body["spec"])
        # Terminating pods stay in view: a leaving prefill keeps its links until its KV
        # caches were pulled, and is then unlinked from the decoders' side.
        all_pods = list(self.pods.get(key, {}).values())
        pods = [p for p in all_pods if not p["metadata"].get("deletionTimestamp")]
        engines = [engine_of(p, spec) for p in all_pods]
        obs = Observed(generation=body["metadata"].get("generation", 0), pods=pods, engines=engines,
                       model_id=spec.model.model_id)
        token = await self._token(key, st)

        if token:
            await self._observe_agents(body, spec, st, obs, token)
            plans = lk.plan(obs.engines, obs.reported, spec.datadist.topology, due=st.due)
            if plans:
                await asyncio.gather(*(self._execute(body, spec, st, p, token) for p in plans))
                # re-read the decoders we touched, so status reflects the result
                touched = {p.decoder.pod for p in plans}
                await self._observe_agents(body, spec, st, obs, token, only=touched)
        # forget failures for links no longer desired (scaled down, switched)
        want = {(d, e.cluster_id) for d, es in lk.desired(obs.engines, spec.datadist.topology).items() for e in es}
        for k in list(st.failures):
            if k not in want:
                st.succeed(*k)
        obs.expected, obs.up = lk.counts(obs.engines, obs.reported, spec.datadist.topology)
        obs.link_failures = dict(st.failures)
        if token and obs.expected and obs.up == obs.expected:
            await self._maybe_verify(body, spec, st, obs, token)
        elif not obs.expected:
            st.verify.clear()
        obs.verify = {d: r for d, r in st.verify.items() if any(e.pod == d for e in obs.engines)}

        status = build_status(spec, obs, body.get("status"))
        if status != st.last_status:
            await self._write_status(key, status)
            st.last_status = status
        if lk.holding_links(obs.engines, obs.reported):
            return HOLDING_RECHECK_S  # a leaving prefill is unlinked as soon as nothing waits on it
        if status["phase"] != "Ready":
            retry = st.next_retry_in()
            return min(1.0, retry) if retry is not None else 1.0
        return min(self.resync_s, max(0.5, st.next_verify - time.monotonic()))

    async def _observe_agents(self, body: dict, spec: PDDeploymentSpec, st: DeploymentState, obs: Observed,
                              token: str, only: set[str] | None = None) -> None:
        now = time.monotonic()
        targets = []
        for e in obs.engines:
            if not e.ip or (only is not None and e.pod not in only):
                continue
            if st.agent_backoff.due(e.pod, now):
                targets.append(e)
            elif e.pod in st.agent_errors and e.ready:
                obs.agent_errors[e.pod] = st.agent_errors[e.pod]  # still failing; not asked again yet

        async def one(e: lk.Engine):
            try:
                s = await self.agents.status(e.agent_url, token)
                if not s.initialized:
                    s = await self.agents.init(e.agent_url, token)
                return e, s, None
            except AgentCallError as err:
                return e, None, err
        results = await asyncio.gather(*(one(e) for e in targets))
        if any(err is not None and err.kind == "AgentUnauthorized" for _, _, err in results):
            st.token = None  # the Secret may have been rotated: read it again next round
        by_pod = {e.pod: i for i, e in enumerate(obs.engines)}
        for e, s, err in results:
            if err is not None:
                # a pod that is not Ready yet, or is leaving, is expected not to answer
                if e.ready and not e.terminating:
                    obs.agent_errors[e.pod] = st.agent_errors[e.pod] = (err.kind, str(err))
                    st.agent_backoff.fail(e.pod, time.monotonic())
                obs.engines[by_pod[e.pod]] = replace(e, agent_ok=False)
                continue
            obs.agent_errors.pop(e.pod, None)
            st.agent_errors.pop(e.pod, None)
            st.agent_backoff.succeed(e.pod)
            obs.engines[by_pod[e.pod]] = replace(
                e, agent_ok=s.initialized, boot_id=s.boot_id, draining=s.draining or s.terminating,
                busy=s.load.in_flight > 0 or s.load.pending_kv > 0)
            prev = st.boot_ids.get(e.pod)
            if prev and prev != s.boot_id:
                await self.events.post(body, "Normal", "AgentRestarted",
                                       f"{e.pod} restarted (boot id {s.boot_id[:8]}); re-initialised and relinking")
            st.boot_ids[e.pod] = s.boot_id
            obs.boot_ids[e.pod] = s.boot_id
            obs.reported[e.pod] = [l.model_dump() for l in s.links] if s.role == "decoder" else []
            if s.proxy_env:
                obs.proxy[e.pod] = s.proxy_env
                if f"{e.pod}/{s.boot_id}" not in st.proxy_warned:
                    st.proxy_warned.add(f"{e.pod}/{s.boot_id}")
                    await self.events.post(body, "Warning", "ProxyEnvironment",
                                           f"{e.pod} has {', '.join(sorted(s.proxy_env))} set; datadist "
                                           f"links can be rerouted. Unset them or list peers in no_proxy")

    async def _execute(self, body: dict, spec: PDDeploymentSpec, st: DeploymentState, plan: lk.DecoderPlan,
                       token: str) -> None:
        d = plan.decoder
        to_peer = lambda l: Peer(name=l["name"], cluster_id=l["cluster_id"], ip=l.get("ip") or "0.0.0.0",  # noqa: E731
                                 port=l.get("port") or 1)
        try:
            for force, stale in ((True, plan.force_unlink), (False, plan.unlink)):
                for batch in lk.batches(stale):
                    await self.agents.unlink(d.agent_url, token, [to_peer(l) for l in batch], force=force)
                    await self.events.post(body, "Normal", "Unlinked",
                                           f"{d.pod} unlinked {', '.join(l['name'] for l in batch)}"
                                           + (" (broken link, local end)" if force else ""))
            for batch in plan.link_batches():
                res = await self.agents.link(d.agent_url, token, [peer_of(e) for e in batch],
                                             spec.datadist.link_timeout_ms)
                ok, bad = [], []
                for e in batch:
                    code = res.rets.get(e.pod, "LLM_FAILED")
                    if code in ("LLM_SUCCESS", "LLM_ALREADY_LINK"):
                        st.succeed(d.pod, e.cluster_id)
                        ok.append(e.pod)
                    else:
                        diag = link_failure(code, d.pod, e.pod, e.ip or "", e.port, spec.datadist.link_timeout_ms)
                        st.fail(d.pod, e.cluster_id, code, diag)
                        bad.append((e.pod, code, diag))
                if ok:
                    await self.events.post(body, "Normal", "Linked",
                                           f"{d.pod} linked {', '.join(ok)} (LLM_SUCCESS) in {res.duration_ms:.0f} ms")
                for pod, code, diag in bad:
                    await self.events.post(body, "Warning", diag.reason, f"{code}: {diag.message}")
        except AgentCallError as err:
            log.info("agent call to %s failed: %s", d.pod, err)
            for e in plan.link:
                st.fail(d.pod, e.cluster_id, err.code or err.kind,
                        Diagnosis(err.kind, f"{d.pod}: {err}"))

    async def _maybe_verify(self, body: dict, spec: PDDeploymentSpec, st: DeploymentState, obs: Observed,
                            token: str) -> None:
        link_set = frozenset((d, l["cluster_id"]) for d, ls in obs.reported.items() for l in ls)
        now = time.monotonic()
        if link_set == st.verified_links and now < st.next_verify:
            return
        pairs = lk.verify_pairs(obs.engines, st.verify_round)

        async def one(d: lk.Engine, p: lk.Engine):
            try:
                return (await self.agents.verify(d.agent_url, token, peer_of(p))).model_dump()
            except AgentCallError as err:
                return {"ok": False, "code": err.code or err.kind, "message": str(err), "prefill": p.pod,
                        "decoder": d.pod, "bytes": 0, "pull_ms": 0}
        results = await asyncio.gather(*(one(d, p) for d, p in pairs))
        first_time = not st.verify
        for r in results:
            before = st.verify.get(r["decoder"])
            st.verify[r["decoder"]] = r
            if not r["ok"] and (before is None or before.get("ok")):
                await self.events.post(body, "Warning", "KVPathVerifyFailed",
                                       f"{r['decoder']} <- {r['prefill']}: {r['code']} {r.get('message', '')}")
        if first_time and results and all(r["ok"] for r in results):
            await self.events.post(body, "Normal", "KVPathVerified", "; ".join(
                f"{r['decoder']} <- {r['prefill']}: {r['bytes']} B in {r['pull_ms']:.2f} ms" for r in results))
        st.verify_round += 1
        st.verified_links = link_set
        interval = spec.datadist.verify_interval_seconds
        st.next_verify = now + (interval if all(r["ok"] for r in results) else min(interval, 5))

    async def _write_status(self, key: Key, status: dict) -> None:
        obj = {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
               "metadata": {"name": key[1], "namespace": key[0]}, "status": status}
        try:
            await self.kube.apply(obj, subresource="status")
        except KubeError as e:
            if e.status != 404:
                raise
