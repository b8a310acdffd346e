"""`kubectl pdd`: the connectivity check, the one-screen status and live role switches, from
anywhere kubectl works.

    kubectl pdd verify NAME [-n NS] [--timeout S] [--no-completion] [--key-name K] [--api-key KEY]
    kubectl pdd status NAME [-n NS]
    kubectl pdd connect NAME [-n NS] --client openai|anthropic|claude-code|codex|cline|curl
                        [--key-name K] [--model M] [--base-url URL] [--check]
    kubectl pdd switch status NAME [-n NS]
    kubectl pdd switch abort NAME POD [-n NS] [--timeout S] [--no-wait]

Agents and the gateway are reached through the API server's pod proxy, so nothing but the
kubeconfig is needed (no route to the pod network). The API server consumes the
`Authorization` header, so the agent token travels in `X-PD-Agent-Token` and the API key in
`x-api-key`. `verify` checks every decoder's links, pulls a probe KV cache on every decoder,
and sends one completion through the gateway (billed to the key it names; none with
--no-completion), up to 16 calls at once under one deadline (--timeout); each failure is
explained in the words of the status conditions; a tensor-parallel pod's links and probe are
reported per rank pair (rank r links and pulls from the prefill's rank r), and `status` lists
its ranks. `switch abort` asks the operator, through an annotation, to abort a switch that has
not reached switch_role yet. Exit code 1 if anything failed."""
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import re
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TextIO

import httpx

from pd_contract import preflight as pf
from pd_contract.agent_api import AgentPath
from pd_contract.names import BROKEN_CODES

from .builders import AGENT_PORT, token_secret_name
from .conditions import healthy
from .connect import CLIENTS, check, render, resolve
from .diagnosis import link_failure, verify_failure
from .gateway import GATEWAY_PORT, LABEL_GATEWAY, data_token_secret_name
from .kube import Kube, KubeError
from .switch import ANNOTATION_ABORT, parse_iso

OK, BAD = "ok ", "FAIL"
SUB = " " * 9   # a rank's line, under its pod pair's ok/FAIL line
DEVICE_IP_SOURCES = {"annotation": "the device plugin's annotation", "hccn.conf": "hccn.conf",
                     "list": "the configured list", "pod-ip": "the pod IP (no device IPs: simulator)"}


class Proxy:
    """Calls to pods through the API server (`.../pods/NAME:PORT/proxy/PATH`). The API server
    refuses to proxy to loopback and link-local pod IPs ("address not allowed"); for those
    (a single-machine cluster) the pod is called directly, and the report says so."""

    def __init__(self, kube: Kube, namespace: str, via: str = "auto", out=print):
        self.kube = kube
        self.ns = namespace
        self.via = via
        self.out = out
        self._direct = httpx.AsyncClient(trust_env=False)
        self._ips: dict[str, str] = {}

    async def close(self) -> None:
        await self._direct.aclose()

    async def pod_ip(self, pod: str) -> str:
        """The pod's IP: where its agent listens (its engines may listen on device IPs)."""
        if pod not in self._ips:
            p = await self.kube.get("v1", "Pod", self.ns, pod)
            self._ips[pod] = ((p or {}).get("status") or {}).get("podIP", "")
        return self._ips[pod]

    async def call(self, method: str, pod: str, port: int, path: str, headers: dict | None = None,
                   body: dict | None = None, timeout: float = 30) -> tuple[int, dict | str]:
        mode = self.via   # as this call began: a parallel one may have switched to direct meanwhile
        if mode != "direct":
            url = f"/api/v1/namespaces/{self.ns}/pods/{pod}:{port}/proxy{path}"
            r = await self.kube._http.request(method, url, headers=headers or {}, json=body, timeout=timeout)
            if not (mode == "auto" and r.status_code == 400 and "address not allowed" in r.text):
                return _decoded(r)
            if self.via != "direct":   # said once, though calls run in parallel
                self.out(f"      (the API server does not proxy to {pod}'s address, a loopback or link-local IP: "
                         f"calling the pods directly)")
                self.via = "direct"
        url = f"http://{await self.pod_ip(pod)}:{port}{path}"
        try:
            r = await self._direct.request(method, url, headers=headers or {}, json=body, timeout=timeout)
        except httpx.HTTPError as e:
            return 0, f"{type(e).__name__}: {e}"
        return _decoded(r)


def _decoded(r: httpx.Response) -> tuple[int, dict | str]:
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, r.text


async def _secret(kube: Kube, ns: str, name: str) -> dict[str, str]:
    sec = await kube.get("v1", "Secret", ns, name)
    if sec is None:
        return {}
    return {k: base64.b64decode(v).decode() for k, v in (sec.get("data") or {}).items()}


def _members(obj: dict) -> list[dict]:
    return [m for m in (obj.get("status") or {}).get("members") or [] if m.get("role") not in ("-", None)]


# ---- verify: the calls run in parallel under one deadline ------------------------------------

PARALLEL = 16            # calls to pods at once
VERIFY_TIMEOUT_S = 60.0  # verify's --timeout default


def call_timeout(total_s: float) -> float:
    """One call's share of verify's deadline: a quarter (the three rounds of calls, agents, probes
    and the completion, fit in it), between 1 and 30 s."""
    return min(30.0, max(1.0, total_s / 4))


@dataclass(frozen=True)
class TimedOut:
    """A call that did not finish: cut at its timeout, or not started before the deadline."""
    after_s: float | None = None   # None: it never started

    def __str__(self) -> str:
        return "timed out (not started before the deadline)" if self.after_s is None else \
            f"timed out (no answer within {round(self.after_s, 1):g}s)"


@dataclass(frozen=True)
class Failed:
    """A call that raised (the API server unreachable, the pod gone...)."""
    error: str

    def __str__(self) -> str:
        return self.error


class Progress:
    """Progress on stderr while calls run: one line rewritten in place on a terminal; otherwise
    (a log, CI) a line at most every `every` seconds, so a quick run prints none."""

    def __init__(self, stream: TextIO | None = None, tty: bool | None = None, every: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)()) if tty is None else tty
        self.every, self.clock = every, clock
        self.last = clock()
        self.width = 0   # of the line on the terminal now

    def __call__(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r" + text.ljust(self.width))
            self.width = len(text)
        elif self.clock() - self.last >= self.every:
            self.stream.write(text + "\n")
            self.last = self.clock()
        else:
            return
        self.stream.flush()

    def clear(self) -> None:
        """Before a line goes to stdout: no half-overwritten progress line on the terminal."""
        if self.tty and self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()
            self.width = 0


Call = Callable[[float], Awaitable[Any]]   # a call given its timeout in seconds


async def run_bounded(jobs: list[tuple[str, Call]], deadline: float, per_call: float, limit: int = PARALLEL,
                      progress: Callable[[int, int], None] | None = None, tick: float = 1.0,
                      clock: Callable[[], float] = time.monotonic) -> dict[str, Any]:
    """Run the calls, `limit` at a time, each cut at `per_call` seconds and all at `deadline`
    (a `clock()` time): key -> its result, a TimedOut or a Failed, in the jobs' order. `progress`
    gets (done, total) after each call and every `tick` seconds."""
    sem = asyncio.Semaphore(limit)
    results: dict[str, Any] = {}
    done = 0

    async def one(key: str, call: Call) -> None:
        nonlocal done
        async with sem:
            left = deadline - clock()
            if left <= 0:
                res: Any = TimedOut()
            else:
                t = min(per_call, left)
                try:
                    res = await asyncio.wait_for(call(t), t)
                except (TimeoutError, asyncio.TimeoutError, httpx.TimeoutException):
                    res = TimedOut(t)
                except Exception as e:  # noqa: BLE001 - one pod's failure is a line of the report
                    res = Failed(f"{type(e).__name__}: {e}"[:300])
        results[key] = res
        done += 1
        if progress is not None:
            progress(done, len(jobs))

    async def ticker() -> None:
        while True:
            await asyncio.sleep(tick)
            if progress is not None:
                progress(done, len(jobs))

    beat = asyncio.create_task(ticker())
    try:
        await asyncio.gather(*(one(k, c) for k, c in jobs))
    finally:
        beat.cancel()
    return {k: results[k] for k, _ in jobs}


async def _within(aw: Awaitable[Any], deadline: float) -> Any:
    """A call to the API server, cut at the deadline (TimeoutError)."""
    left = deadline - time.monotonic()
    if left <= 0:
        if asyncio.iscoroutine(aw):
            aw.close()
        raise TimeoutError
    return await asyncio.wait_for(aw, left)


def choose_key(keys: dict[str, str], key_name: str | None, secret: str) -> tuple[str, str]:
    """(name, key) the completion is billed to, as `connect` chooses: `key_name`, else the first
    name in the Secret. LookupError: none to use."""
    if not keys:
        raise LookupError(f"Secret {secret} has no keys (or cannot be read); pass --api-key, or --no-completion")
    key_name = key_name or sorted(keys)[0]
    if key_name not in keys:
        raise LookupError(f"Secret {secret} has no key named {key_name!r} (it has {', '.join(sorted(keys))})")
    return key_name, keys[key_name].strip()


@dataclass(frozen=True)
class VerifyOptions:
    api_key: str | None = None      # a key the user holds (the Secret is not read)
    key_name: str | None = None     # which key of the gateway's Secret (default: the first)
    completion: bool = True         # False: nothing is sent through the gateway
    timeout: float = VERIFY_TIMEOUT_S
    via: str = "auto"


async def verify(kube: Kube, ns: str, name: str, opts: VerifyOptions = VerifyOptions(), out=print,
                 progress: Progress | None = None) -> int:
    progress = progress if progress is not None else Progress()

    def say(line: str) -> None:
        progress.clear()
        out(line)
    deadline = time.monotonic() + opts.timeout
    try:
        obj = await _within(kube.get("pdoperator.io/v1alpha1", "PDDeployment", ns, name), deadline)
        if obj is None:
            say(f"PDDeployment {ns}/{name} not found")
            return 1
        control = (await _within(_secret(kube, ns, token_secret_name(name)), deadline)).get("token")
    except (TimeoutError, httpx.TimeoutException):
        say(f"PDDeployment {ns}/{name}: timed out reading it (--timeout {opts.timeout:g}s)")
        return 1
    px = Proxy(kube, ns, opts.via, say)
    try:
        return await _verify(kube, px, obj, ns, name, control, opts, deadline, progress, say)
    finally:
        progress.clear()
        await px.close()


def _counter(progress: Progress, verb: str, noun: str) -> Callable[[int, int], None]:
    return lambda done, total: progress(f"{verb} {done}/{total} {noun}...")


@dataclass
class _Tally:
    """Checks failed, and how many of them timed out."""
    failed: int = 0
    timed_out: int = 0

    def miss(self, res: object) -> None:
        self.failed += 1
        self.timed_out += isinstance(res, TimedOut)


async def _verify(kube: Kube, px: Proxy, obj: dict, ns: str, name: str, control: str | None, opts: VerifyOptions,
                  deadline: float, progress: Progress, out) -> int:
    spec, status = obj["spec"], obj.get("status") or {}
    per_call = call_timeout(opts.timeout)
    tally = _Tally()
    out(f"PDDeployment {ns}/{name}: phase {status.get('phase')}, links {status.get('linksSummary')}")
    members = _members(obj)
    hdr = {"X-PD-Agent-Token": control or ""}
    statuses = await _verify_links(px, spec, members, hdr, deadline, per_call, progress, out, tally)
    await _verify_kv(px, spec, members, statuses, hdr, deadline, per_call, progress, out, tally)
    gw = spec.get("gateway") or {}
    if not gw.get("enabled"):
        out("\ngateway:")
        out("  -   spec.gateway is not enabled")
    elif not opts.completion:
        out("\ngateway (--no-completion: nothing sent):")
        bad, late, lines = gateway_ready(await _gateway_pods(kube, ns, name, deadline), name)
        for line in lines:
            out(line)
        tally.failed, tally.timed_out = tally.failed + bad, tally.timed_out + late
    else:
        out("\ngateway (one completion with the key):")
        bad, late = await _gateway_check(kube, px, ns, name, spec, gw, opts, deadline, per_call, progress, out)
        tally.failed, tally.timed_out = tally.failed + bad, tally.timed_out + late
    late_note = f", {tally.timed_out} timed out (--timeout {opts.timeout:g}s)" if tally.timed_out else ""
    out(f"\n{'all checks passed' if not tally.failed else f'{tally.failed} check(s) failed{late_note}'}")
    return 1 if tally.failed else 0


async def _verify_links(px: Proxy, spec: dict, members: list[dict], hdr: dict, deadline: float, per_call: float,
                        progress: Progress, out, tally: _Tally) -> dict[str, dict]:
    """Every member's agent asked; each decoder's links as its engine reports them. The statuses."""
    def agent_status(pod: str) -> Call:
        # httpx's own timeout a second later: the deadline is the one that fires, as "timed out"
        return lambda t: px.call("GET", pod, AGENT_PORT, AgentPath.STATUS, hdr, timeout=t + 1)
    got = await run_bounded([(m["pod"], agent_status(m["pod"])) for m in members], deadline, per_call,
                            progress=_counter(progress, "checked", "agents"))
    out("\nlinks (each decoder's engine, check_link_status):")
    statuses = {}
    for m in members:
        res = got[m["pod"]]
        if isinstance(res, (TimedOut, Failed)):
            tally.miss(res)
            out(f"  {BAD} {m['pod']}: agent status {res}" if isinstance(res, TimedOut) else
                f"  {BAD} {m['pod']}: agent not reachable: {res}")
            continue
        code, st = res
        if code != 200 or not isinstance(st, dict):
            tally.failed += 1
            out(f"  {BAD} {m['pod']}: agent not reachable through the API server ({code}): {str(st)[:160]}")
            continue
        statuses[m["pod"]] = st
        tally.failed += _preflight_lines(m["pod"], st.get("preflight"), out)
        if st.get("proxy_env"):
            out(f"  {BAD} {m['pod']}: proxy variables set ({', '.join(sorted(st['proxy_env']))}): unset them or "
                f"list the peers in no_proxy")
            tally.failed += 1
    timeout_ms = spec.get("datadist", {}).get("linkTimeoutMs", 3000)
    for d in (m for m in members if m["role"] == "decoder" and m["pod"] in statuses):
        bad, lines = format_links(d["pod"], statuses, timeout_ms)
        tally.failed += bad
        for line in lines:
            out(line)
    return statuses


def _preflight_lines(pod: str, pre: dict | None, out) -> int:
    """A pod's network preflight as its agent reports it (pd_contract.preflight): failed checks count."""
    if not pre or pre.get("state") == "passed":
        return 0
    if pre.get("state") == "pending":
        out(f"  {BAD} {pod}: network preflight still running")
        return 1
    for f in pre.get("failures") or []:
        out(f"  {BAD} {pod}: preflight device {f.get('device_id')} {f.get('check')}: {f.get('message')} "
            f"({pf.HINTS.get(f.get('check', ''), '')})")
    return 1 if pre.get("enforced", True) else 0


async def _verify_kv(px: Proxy, spec: dict, members: list[dict], statuses: dict[str, dict], hdr: dict,
                     deadline: float, per_call: float, progress: Progress, out, tally: _Tally) -> None:
    """Each answering decoder pulls a probe cache from one prefill, round robin."""
    decoders = [m for m in members if m["role"] == "decoder"]
    prefills = [m for m in members if statuses.get(m["pod"], {}).get("role") == "prompt"]
    pairs = {d["pod"]: prefills[i % len(prefills)] for i, d in enumerate(decoders)
             if prefills and d["pod"] in statuses}

    def probe(d: str, p: dict) -> Call:
        async def call(t: float) -> tuple[int, dict | str]:
            peer = probe_peer(p, statuses[p["pod"]], await px.pod_ip(p["pod"]))
            return await px.call("POST", d, AGENT_PORT, AgentPath.VERIFY, hdr, {"peer": peer}, timeout=t + 1)
        return call
    got = await run_bounded([(d, probe(d, p)) for d, p in pairs.items()], deadline, per_call,
                            progress=_counter(progress, "verified", "KV paths")) if pairs else {}
    out("\nKV path (a probe cache pulled by each decoder):")
    for d in decoders:
        if d["pod"] not in pairs:
            if prefills:
                out(f"  -   {d['pod']}: no probe (its agent did not answer)")
            continue
        p, res = pairs[d["pod"]], got[d["pod"]]
        if isinstance(res, (TimedOut, Failed)):
            tally.miss(res)
            out(f"  {BAD} {d['pod']} <- {p['pod']}: {res}")
            continue
        code, r = res
        ok, lines = format_probe(d["pod"], p["pod"], code, r, spec.get("model", {}).get("modelId", 0))
        tally.failed += not ok
        for line in lines:
            out(line)


async def _gateway_pods(kube: Kube, ns: str, name: str, deadline: float) -> list[dict] | None:
    """The gateway's pods (None: the deadline passed)."""
    try:
        return [p for p in await _within(kube.list("v1", "Pod", ns, f"{LABEL_GATEWAY}={name}"), deadline)
                if not p["metadata"].get("deletionTimestamp")]
    except TimeoutError:
        return None


def gateway_ready(pods: list[dict] | None, name: str) -> tuple[int, int, list[str]]:
    """--no-completion: (failed, timed out, lines): a line per gateway pod, ready or not."""
    if pods is None:
        return 1, 1, [f"  {BAD} {name}-gateway: timed out listing its pods"]
    if not pods:
        return 1, 0, [f"  {BAD} no {name}-gateway pod"]
    lines, bad = [], 0
    for p in pods:
        ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                    for c in (p.get("status") or {}).get("conditions") or [])
        bad += not ready
        lines.append(f"  {OK if ready else BAD} {p['metadata']['name']}: {'ready' if ready else 'not ready'}")
    return bad, 0, lines


async def _gateway_check(kube: Kube, px: Proxy, ns: str, name: str, spec: dict, gw: dict, opts: VerifyOptions,
                         deadline: float, per_call: float, progress: Progress, out) -> tuple[int, int]:
    """(failed, timed out): one completion through the gateway, billed to the chosen key."""
    pods = await _gateway_pods(kube, ns, name, deadline)
    if not pods:
        bad, late, lines = gateway_ready(pods, name)
        for line in lines:
            out(line)
        return bad, late
    api_key = opts.api_key
    if api_key is None:
        try:
            keys = await _within(_secret(kube, ns, gw["apiKeysSecret"]), deadline)
        except TimeoutError:
            out(f"  {BAD} {name}-gateway: timed out reading Secret {gw['apiKeysSecret']}")
            return 1, 1
        try:
            key_name, api_key = choose_key(keys, opts.key_name, gw["apiKeysSecret"])
        except LookupError as e:
            out(f"  {BAD} {e}")
            return 1, 0
        out(f"      using the key named {key_name!r} from Secret {gw['apiKeysSecret']}")
    pod = pods[0]["metadata"]["name"]
    model = spec["model"]["name"]
    t0 = time.monotonic()
    body = {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "kubectl pdd verify"}]}
    res = (await run_bounded(
        [("completion", lambda t: px.call("POST", pod, GATEWAY_PORT, "/v1/chat/completions",
                                          {"x-api-key": api_key}, body, timeout=t + 1))],
        deadline, per_call, progress=_counter(progress, "sent", "completion")))["completion"]
    if isinstance(res, (TimedOut, Failed)):
        out(f"  {BAD} {pod}: completion {res}" if isinstance(res, TimedOut) else f"  {BAD} {pod}: {res}")
        return 1, int(isinstance(res, TimedOut))
    code, r = res
    ms = (time.monotonic() - t0) * 1000
    if code == 200 and isinstance(r, dict) and r.get("choices"):
        out(f"  {OK} {pod}: model {model}, {r['usage']['completion_tokens']} tokens in {ms:.0f} ms: "
            f"{r['choices'][0]['message']['content']!r}")
        return 0, 0
    msg = r.get("error", {}).get("message") if isinstance(r, dict) else str(r)[:200]
    hint = {401: "the key is missing or wrong (check for a typo or spaces)",
            404: "wrong path or model id", 503: "no prefill/decoder pair could take the request"}.get(code, "")
    out(f"  {BAD} {pod}: HTTP {code}: {msg}" + (f" ({hint})" if hint else ""))
    return 1, 0


async def status(kube: Kube, ns: str, name: str, out=print, via: str = "auto") -> int:
    raw = out

    def show(line: str) -> None:   # agents' strings reach the terminal escaped (our own line breaks kept)
        raw("\n".join(printable(part) for part in line.split("\n")))
    return await _status(kube, ns, name, show, via)


async def _status(kube: Kube, ns: str, name: str, out, via: str) -> int:
    obj = await kube.get("pdoperator.io/v1alpha1", "PDDeployment", ns, name)
    if obj is None:
        out(f"PDDeployment {ns}/{name} not found")
        return 1
    st = obj.get("status") or {}
    data = (await _secret(kube, ns, data_token_secret_name(name))).get("token") or \
        (await _secret(kube, ns, token_secret_name(name))).get("token")
    px = Proxy(kube, ns, via, lambda _: None)
    out(f"{ns}/{name}: {st.get('phase')}  prefill {st.get('prefill')}  decoder {st.get('decoder')}  "
        f"links {st.get('linksSummary')}")
    out(f"\n{'POD':28} {'GROUP':8} {'ROLE':10} {'ASSIGNED':9} {'READY':6} {'CLUSTER':8} {'LINKS':6} "
        f"{'INFLIGHT':8} {'QUEUE':6} {'KV MiB':7} DRAINING")
    for m in (st.get("members") or []):
        load: dict = {}
        draining = "-"
        agent: dict | None = None
        if m.get("ip"):
            code, a = await px.call("GET", m["pod"], AGENT_PORT, AgentPath.STATUS, {"X-PD-Agent-Token": data or ""},
                                    timeout=5)
            if code == 200 and isinstance(a, dict):
                agent = a
                load = a["load"] if isinstance(a.get("load"), dict) else {}
                draining = str(a.get("draining", False)).lower()
        links = m.get("links")
        out(f"{m['pod']:28} {m.get('group', '-'):8} {m.get('role', '-'):10} {m.get('assignedRole') or '-':9} "
            f"{str(m.get('ready', False)).lower():6} {m.get('clusterId', '-')!s:8} "
            f"{(str(links['up']) + '/' + str(links['expected'])) if links else '-':6} "
            f"{load.get('in_flight', '-')!s:8} {load.get('queue_depth', '-')!s:6} "
            f"{_mib(load.get('kv_used_bytes'))!s:7} {draining}")
        if m.get("lastError"):
            out(f"    {m['lastError']}")
        for line in format_ranks(agent, m.get("ranks"), m.get("lastError") or ""):
            out(line)
    await px.close()
    for sw in st.get("switches") or []:
        out(f"\nswitch in flight: {sw['pod']} {sw['from']} -> {sw['to']}, step {sw['step']} since "
            f"{sw['stepStartedAt']}" + (f" ({sw['message']})" if sw.get("message") else ""))
    if st.get("lastSwitch"):
        out(f"\nlast switch: {json.dumps(st['lastSwitch'])}")
    for c in st.get("conditions") or []:
        if c["type"] == "Rebalancing" or not healthy(c):   # what is wrong, by each type's polarity
            out(f"{c['type']}: {c['status']} {c['reason']}: {c.get('message', '')}")
    return 0


def _rank_down(r: dict) -> bool:
    """A rank link that is down, as the operator counts it (links.ranks_up)."""
    return not r.get("healthy", True) or r.get("code") in BROKEN_CODES


def format_links(decoder: str, status_by_pod: dict[str, dict], timeout_ms: int = 3000) -> tuple[int, list[str]]:
    """A decoder's links to every prefill that answered, from the agents' /v1/status bodies
    (pod -> body): (failed pod links, lines). A line per pod link; a multi-rank link counts its
    healthy ranks and names each failing one with its diagnosis, a line each (TP 8 at 4
    prefills would be 32 lines per decoder otherwise)."""
    prefills = {st["cluster_id"]: pod for pod, st in status_by_pod.items() if st.get("role") == "prompt"}
    have = {link["cluster_id"]: link for link in status_by_pod[decoder].get("links", [])}
    failures, lines = 0, []
    for cid in sorted(prefills):
        p = prefills[cid]
        link = have.get(cid)
        if link is None:
            failures += 1
            lines.append(f"  {BAD} {decoder} -> {p}: not linked")
        elif link.get("ranks"):
            down = [r for r in link["ranks"] if _rank_down(r)]
            up = f"{len(link['ranks']) - len(down)}/{len(link['ranks'])} ranks up"
            if not down:
                lines.append(f"  {OK} {decoder} -> {p}: {link['code']}, {up}")
                continue
            failures += 1
            lines.append(f"  {BAD} {decoder} -> {p}: {up}")
            # a rank that never linked has no address in the link: the prefill's own report has it
            eps = {r["rank"]: r for r in status_by_pod[p].get("ranks") or []}
            for r in down:
                ep = eps.get(r["rank"], {})
                diag = link_failure(r["code"], f"{decoder} rank {r['rank']}", f"{p} rank {r['rank']}",
                                    r.get("ip") or ep.get("ip", ""), r.get("port") or ep.get("port", 0), timeout_ms)
                lines.append(f"{SUB}rank {r['rank']} {r['code']} ({diag.reason}): {diag.message}")
        elif not link.get("healthy", True):
            failures += 1
            diag = link_failure(link["code"], decoder, p, link.get("ip", ""), link.get("port", 0), timeout_ms)
            lines.append(f"  {BAD} {decoder} -> {p}: {link['code']} ({diag.reason}): {diag.message}")
        else:
            lines.append(f"  {OK} {decoder} -> {p}: {link['code']}")
    return failures, lines


def probe_peer(member: dict, agent_status: dict, pod_ip: str | None = None) -> dict:
    """The prefill as a verify request's peer: its engine's address (a device IP on NPUs) and its
    agent's (the pod IP). A multi-rank decoder pairs its rank r with the peer's rank r, so a
    multi-rank prefill lists its ranks as its agent reports them (the operator's placeholders for a
    rank without an address, so the rank fails, not the call)."""
    peer = {"name": member["pod"], "cluster_id": member["clusterId"], "ip": member["ip"], "port": member["port"],
            "agent_url": f"http://{pod_ip or member['ip']}:{AGENT_PORT}"}
    ranks = agent_status.get("ranks") or []
    if agent_status.get("tensor_parallel", 1) > 1 and ranks:
        peer["ranks"] = [{"rank": r["rank"], "cluster_id": r["cluster_id"], "ip": r.get("ip") or "0.0.0.0",
                          "port": r.get("port") or 1} for r in sorted(ranks, key=lambda r: r["rank"])]
    return peer


def format_probe(decoder: str, prefill: str, code: int, r: dict | str, model_id: int) -> tuple[bool, list[str]]:
    """A decoder's probe pull (the agent's /v1/verify answer): (ok, lines); a multi-rank pull
    adds a line per rank pair, a failing one with its diagnosis."""
    body = r if code == 200 and isinstance(r, dict) else {}
    ranks = body.get("ranks") or []
    if ranks:
        ok = bool(body.get("ok")) and all(x["ok"] for x in ranks)
        lines = [f"  {OK} {decoder} <- {prefill}: {len(ranks)} rank pairs, {body['bytes']} bytes in "
                 f"{body['pull_ms']:.2f} ms, bytes match" if ok else
                 f"  {BAD} {decoder} <- {prefill}: {sum(1 for x in ranks if x['ok'])}/{len(ranks)} rank pairs "
                 f"pulled the probe"]
        for x in ranks:
            if x["ok"]:
                lines.append(f"{SUB}rank {x['rank']}: {x['bytes']} bytes in {x['pull_ms']:.2f} ms")
            else:
                diag = verify_failure(x["code"], f"{decoder} rank {x['rank']}", f"{prefill} rank {x['rank']}",
                                      x.get("message", ""), model_id)
                lines.append(f"{SUB}rank {x['rank']} {x['code']} ({diag.reason}): {diag.message}")
        return ok, lines
    if body.get("ok"):
        return True, [f"  {OK} {decoder} <- {prefill}: {body['bytes']} bytes in {body['pull_ms']:.2f} ms, bytes match"]
    rc = r.get("code", str(code)) if isinstance(r, dict) else str(code)
    diag = verify_failure(rc, decoder, prefill, r.get("message", "") if isinstance(r, dict) else str(r), model_id)
    return False, [f"  {BAD} {decoder} <- {prefill}: {rc} ({diag.reason}): {diag.message}"]


_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7f, 0xa0))} | {0x09: "\\t", 0x0a: "\\n", 0x0d: "\\r"}


def printable(text: object) -> str:
    """An agent's string as the terminal may show it: control characters (escape sequences among
    them) written out, never sent raw. Agents are the tenant's code."""
    return str(text).translate(_CONTROL)


def _mib(n: object) -> object:
    return round(n / 2**20, 1) if isinstance(n, (int, float)) and not isinstance(n, bool) else "-"


def _rank_key(r: dict) -> tuple[int, int]:
    n = r.get("rank")
    return (0, n) if isinstance(n, int) and not isinstance(n, bool) else (1, 0)


def format_ranks(agent_status: dict | None, summary: dict | None = None, last_error: str = "") -> list[str]:
    """Lines under a pod's status row: a multi-rank pod's TP, where its device IPs came from and
    a line per rank (only the member's rank summary when its agent did not answer); any pod's
    device IP error unless its lastError already says it. Nothing for a healthy single-rank pod.
    A field an agent reported wrongly is shown as `?`, its strings escaped (printable)."""
    a, summary = agent_status or {}, summary or {}
    ranks = sorted((r for r in a.get("ranks") or [] if isinstance(r, dict)), key=_rank_key)
    tp = a.get("tensor_parallel") or summary.get("tensorParallel") or 1
    lines = []
    if ranks or tp != 1:
        init = sum(1 for r in ranks if r.get("initialized")) if ranks else summary.get("initialized", "?")
        src = a.get("device_ips") or summary.get("deviceIps") or ""
        lines.append(f"    TP {printable(tp)}: {printable(init)}/{printable(tp)} ranks initialised, device IPs from "
                     f"{DEVICE_IP_SOURCES.get(src, printable(src) or 'nowhere yet') if isinstance(src, str) else '?'}")
        for r in ranks:
            dev = r.get("device_id")
            state = "initialised" if r.get("initialized") else \
                "not registered" if not r.get("registered", True) else "not initialised"
            n = r.get("rank") if _rank_key(r)[0] == 0 else "?"
            lines.append(f"      rank {n!s:<3} cluster {printable(r.get('cluster_id', '?')):<8} "
                         f"device {'-' if dev is None else printable(dev):<3} "
                         f"{printable(r.get('ip') or '?') + ':' + printable(r.get('port') or '?'):21} {state}"
                         + (f": {printable(r['last_error'])}" if r.get("last_error") else ""))
    err = a.get("device_error")
    if err and str(err) not in last_error:
        lines.append(f"    DeviceIPUnknown: {printable(err)}")
    return lines


async def connect(kube: Kube, ns: str, args: argparse.Namespace) -> int:
    try:
        c = await resolve(kube, ns, args.name, args.key_name, args.model, args.base_url, args.api_key)
    except LookupError as e:
        print(f"kubectl pdd connect: {e}", file=sys.stderr)
        return 1
    print(f"# Base URL from {c['how']}; key {c['key_name']!r}; model {c['model']}", file=sys.stderr)
    sys.stdout.write(render(args.client, c["root"], c["key"], c["model"]))
    if not args.check:
        return 0
    ok, what = await asyncio.to_thread(check, args.client, c["root"], c["key"], c["model"], c["key_source"])
    print(("ok   " if ok else "FAIL ") + what, file=sys.stderr)
    return 0 if ok else 1


# ---- switch: the switches in flight, and aborting one ----------------------------------------

PDD_API = "pdoperator.io/v1alpha1"
ABORT_TIMEOUT_S = 120.0


def _switch_of(obj: dict, pod: str) -> dict | None:
    return next((s for s in (obj.get("status") or {}).get("switches") or [] if s.get("pod") == pod), None)


def _abort_asked(obj: dict) -> str | None:
    return ((obj.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_ABORT)


def _rebalancing(obj: dict) -> dict | None:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("type") == "Rebalancing"),
                None)


def _names(text: str, pod: str) -> bool:
    """`text` names `pod` (not merely a longer name it begins: decoder-1 in decoder-10)."""
    return re.search(rf"(?<![\w.-]){re.escape(pod)}(?![\w-]|\.\w)", text) is not None


def _age(since: str | None, now: float) -> str:
    t = parse_iso(since)
    return "" if t is None else f" ({max(0.0, now - t):.0f}s ago)"


def _in_flight(sw: dict, now: float) -> str:
    return (f"{sw.get('pod')}: {sw.get('from')} -> {sw.get('to')}, step {sw.get('step')} since "
            f"{sw.get('stepStartedAt')}{_age(sw.get('stepStartedAt'), now)}"
            + (f" ({sw['message']})" if sw.get("message") else ""))


@dataclass(frozen=True)
class Verdict:
    message: str
    code: int      # the exit code


def abort_verdict(pod: str, obj: dict, last_before: dict | None) -> Verdict | None:
    """What `switch abort` concludes from the PDDeployment as observed after it set the
    annotation (`last_before`: status.lastSwitch before it did); None: wait on."""
    st = obj.get("status") or {}
    last = st.get("lastSwitch")
    if last and last.get("pod") == pod and last != last_before:
        if last.get("result") == "Aborted":
            return Verdict(f"the switch of {pod} was aborted; it serves as {last.get('from')} again", 0)
        why = f" ({last['message']})" if last.get("message") else ""
        return Verdict(f"the switch of {pod} ended before it could be aborted: {last.get('result')}, "
                       f"{last.get('from')} -> {last.get('to')}{why}", 1)
    cond = _rebalancing(obj)
    if cond and cond.get("reason") == "AbortRefused" and _names(cond.get("message") or "", pod):
        return Verdict(cond["message"], 1)
    asked = _abort_asked(obj)
    if asked is not None and asked != pod:
        return Verdict(f"the abort request was replaced: {ANNOTATION_ABORT} now names {asked}", 1)
    if asked is None and _switch_of(obj, pod) is None:
        return Verdict(f"there was no switch of {pod} to abort", 1)
    return None   # asked, not yet acted on; or acted on and the switch still going back


def abort_timeout(pod: str, obj: dict, waited_s: float, now: float) -> str:
    """What `switch abort` says when it stops waiting: what the status shows now."""
    sw = _switch_of(obj, pod)
    asked = _abort_asked(obj) == pod
    head = f"timed out after {waited_s:.0f}s"
    if sw is None:
        return (f"{head}: no switch of {pod} is in flight, and the operator has not removed {ANNOTATION_ABORT} "
                f"(is it running?)" if asked else f"{head}: no switch of {pod} is in flight")
    pending = f"; the request ({ANNOTATION_ABORT}) is still pending" if asked else ""
    return f"{head}: the status shows {_in_flight(sw, now)}{pending}"


def abort_outcome(pod: str, observed: list[dict], last_before: dict | None, waited_s: float,
                  now: float) -> Verdict:
    """The wait over a sequence of observations of the PDDeployment (the last one when the
    timeout came): the first verdict, else the timeout's."""
    for obj in observed:
        v = abort_verdict(pod, obj, last_before)
        if v is not None:
            return v
    return Verdict(abort_timeout(pod, observed[-1], waited_s, now), 1)


async def switch_abort(kube: Kube, ns: str, name: str, pod: str, timeout: float = ABORT_TIMEOUT_S,
                       wait: bool = True, poll: float = 1.0, out=print, err=None) -> int:
    note = err or (lambda line: print(line, file=sys.stderr))
    obj = await kube.get(PDD_API, "PDDeployment", ns, name)
    if obj is None:
        out(f"PDDeployment {ns}/{name} not found")
        return 1
    last_before = (obj.get("status") or {}).get("lastSwitch")
    other = _abort_asked(obj)
    if other and other != pod:
        note(f"replacing the pending abort of {other} ({ANNOTATION_ABORT})")
    obj = await kube.patch(PDD_API, "PDDeployment", ns, name, {"metadata": {"annotations": {ANNOTATION_ABORT: pod}}})
    if not wait:
        out(f"asked the operator to abort the switch of {pod} ({ANNOTATION_ABORT}={pod}); "
            f"`kubectl pdd switch status {name}` shows it")
        return 0
    t0 = time.monotonic()
    step = None
    while True:
        v = abort_verdict(pod, obj, last_before)
        if v is not None:
            out(v.message)
            return v.code
        sw = _switch_of(obj, pod)
        if sw is not None and sw.get("step") != step:
            step = sw.get("step")
            note(f"waiting: {pod} is at step {step}")
        waited = time.monotonic() - t0
        if waited >= timeout:
            out(abort_timeout(pod, obj, waited, time.time()))
            return 1
        await asyncio.sleep(min(poll, timeout - waited))
        now = await kube.get(PDD_API, "PDDeployment", ns, name)
        if now is None:
            out(f"PDDeployment {ns}/{name} was deleted")
            return 1
        obj = now


def format_switches(obj: dict, now: float) -> list[str]:
    """`switch status`: the switches in flight (pod, from -> to, step, since), a pending abort
    request, the Rebalancing condition and the last switch."""
    st = obj.get("status") or {}
    sws = st.get("switches") or []
    lines = [f"{'POD':28} {'FROM -> TO':22} {'STEP':10} SINCE"] if sws else ["no switch in flight"]
    for s in sws:
        lines.append(f"{s.get('pod', '?'):28} {str(s.get('from')) + ' -> ' + str(s.get('to')):22} "
                     f"{s.get('step', '?'):10} {s.get('stepStartedAt', '?')}{_age(s.get('stepStartedAt'), now)}"
                     + (f"\n    {s['message']}" if s.get("message") else ""))
    asked = _abort_asked(obj)
    if asked:
        lines.append(f"abort requested: {asked} ({ANNOTATION_ABORT})")
    cond = _rebalancing(obj)
    if cond:
        lines.append(f"Rebalancing: {cond.get('status')} {cond.get('reason')}: {cond.get('message', '')}")
    last = st.get("lastSwitch")
    if last:
        lines.append(f"last switch: {last.get('pod')} {last.get('from')} -> {last.get('to')}: {last.get('result')} "
                     f"at {last.get('at')}" + (f" ({last['message']})" if last.get("message") else ""))
    return lines


async def switch_status(kube: Kube, ns: str, name: str, out=print) -> int:
    obj = await kube.get(PDD_API, "PDDeployment", ns, name)
    if obj is None:
        out(f"PDDeployment {ns}/{name} not found")
        return 1
    for line in format_switches(obj, time.time()):
        out(line)
    return 0


def _seconds(v: str) -> float:
    try:
        s = float(v)
    except ValueError:
        s = 0.0
    if not s > 0:
        raise argparse.ArgumentTypeError(f"not a positive number of seconds: {v!r}")
    return s


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kubectl pdd", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    # -n and --via before the command or after it; SUPPRESS: a command's parser keeps what the top one parsed
    ap.add_argument("-n", "--namespace", default=None, help="the namespace (default: the kubeconfig context's)")
    ap.add_argument("--via", choices=["auto", "proxy", "direct"], default="auto",
                    help="reach pods through the API server's pod proxy, directly, or proxy with a direct fallback")
    ns = argparse.ArgumentParser(add_help=False)
    ns.add_argument("-n", "--namespace", default=argparse.SUPPRESS, help="the namespace")
    via = argparse.ArgumentParser(add_help=False)
    via.add_argument("--via", choices=["auto", "proxy", "direct"], default=argparse.SUPPRESS,
                     help="pod proxy, direct, or auto (proxy with a direct fallback; the default)")
    cmds = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _verify_parser(cmds, ns, via)
    _status_parser(cmds, ns, via)
    _connect_parser(cmds, ns)
    _switch_parser(cmds, ns)
    return ap


def _verify_parser(cmds, ns: argparse.ArgumentParser, via: argparse.ArgumentParser) -> None:
    v = cmds.add_parser("verify", parents=[ns, via], help="check links, a probe KV pull per decoder and the gateway",
                        description="Check every decoder's links, pull a probe KV cache on every decoder and send one "
                                    "completion through the gateway; calls run in parallel, progress on stderr. "
                                    "Exit code 1 if anything failed or timed out.")
    v.add_argument("name", metavar="NAME", help="the PDDeployment")
    v.add_argument("--timeout", type=_seconds, default=VERIFY_TIMEOUT_S, metavar="SECONDS",
                   help="deadline for the whole check; each call gets a quarter of it (at most 30 s); "
                        "what did not finish is reported as timed out")
    v.add_argument("--no-completion", action="store_true",
                   help="send no completion through the gateway (nothing is billed to a key); check its pods are ready")
    v.add_argument("--key-name", default=None,
                   help="which key of the gateway's Secret the completion is billed to (default: the first)")
    v.add_argument("--api-key", default=None, help="a gateway key to use instead of one from its Secret")


def _status_parser(cmds, ns: argparse.ArgumentParser, via: argparse.ArgumentParser) -> None:
    s = cmds.add_parser("status", parents=[ns, via], help="members, roles, links, load and switches on one screen",
                        description="Members, roles, assigned roles, links, load, draining, the switches in flight, "
                                    "the last switch and the Rebalancing condition.")
    s.add_argument("name", metavar="NAME", help="the PDDeployment")


def _connect_parser(cmds, ns: argparse.ArgumentParser) -> None:
    c = cmds.add_parser("connect", parents=[ns], help="print a client's configuration for the gateway",
                        description="The Base URL, key and model a client needs, in its own configuration format.")
    c.add_argument("name", metavar="NAME", help="the PDDeployment")
    c.add_argument("--client", choices=CLIENTS, default="openai", help="the configuration to print")
    c.add_argument("--key-name", default=None, help="which key of the Secret (default: the first)")
    c.add_argument("--api-key", default=None, help="a key you hold (the Secret is not read)")
    c.add_argument("--model", default=None, help="the model id (default: the first the key may use)")
    c.add_argument("--base-url", default=None, help="the Base URL clients reach the gateway at")
    c.add_argument("--check", action="store_true", help="send one request as the client would")


def _switch_parser(cmds, ns: argparse.ArgumentParser) -> None:
    w = cmds.add_parser("switch", help="live role switches: list them, abort one",
                        formatter_class=argparse.RawDescriptionHelpFormatter,
                        description="The role switches in flight, and aborting one:\n\n"
                                    "    kubectl pdd switch status NAME [-n NS]\n"
                                    "    kubectl pdd switch abort NAME POD [-n NS] [--timeout SECONDS] [--no-wait]\n\n"
                                    f"abort sets the annotation {ANNOTATION_ABORT}=POD and waits for the operator's "
                                    f"answer.")
    # abort's flags, also on `switch` itself (before or after the command), as -n is on the top parser
    wait = argparse.ArgumentParser(add_help=False)
    for p, default in ((w, None), (wait, argparse.SUPPRESS)):
        p.add_argument("--timeout", type=_seconds, metavar="SECONDS",
                       default=ABORT_TIMEOUT_S if default is None else default,
                       help=f"abort: how long to wait for the operator's answer (default {ABORT_TIMEOUT_S:g}; then "
                            f"exit 1 with the switch's step)")
        p.add_argument("--no-wait", action="store_true", default=False if default is None else default,
                       help="abort: set the annotation and return at once")
    wc = w.add_subparsers(dest="switch_command", required=True, metavar="COMMAND")
    ws = wc.add_parser("status", parents=[ns], help="the switches in flight: pod, from -> to, step, since",
                       description="The switches in flight (pod, from -> to, step, since), a pending abort, the "
                                   "Rebalancing condition and the last switch.")
    ws.add_argument("name", metavar="NAME", help="the PDDeployment")
    wa = wc.add_parser("abort", parents=[ns, wait], help="abort a pod's switch before switch_role: it keeps its role",
                       description=f"Ask the operator to abort POD's switch (annotation {ANNOTATION_ABORT}=POD) and "
                                   f"wait for its answer: aborted, POD keeping its old role (exit 0; possible only "
                                   f"before switch_role); refused, with what finishing the switch requires; or no "
                                   f"switch of POD to abort (both exit 1).")
    wa.add_argument("name", metavar="NAME", help="the PDDeployment")
    wa.add_argument("pod", metavar="POD", help="the pod whose switch to abort")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    ns = args.namespace
    if ns is None:
        from kubernetes import config
        try:
            _, ctx = config.list_kube_config_contexts()
            ns = ctx.get("context", {}).get("namespace") or "default"
        except Exception:  # noqa: BLE001 - in a pod, or no kubeconfig context: the default namespace
            ns = "default"

    async def run() -> int:
        from kubernetes.config import ConfigException
        try:
            kube = Kube()
        except ConfigException as e:
            print(f"kubectl pdd: no cluster to talk to ({e}): set KUBECONFIG to a kubeconfig, or run it in a pod "
                  f"with a service account", file=sys.stderr)
            return 1
        try:
            if args.command == "verify":
                return await verify(kube, ns, args.name, VerifyOptions(
                    api_key=args.api_key, key_name=args.key_name, completion=not args.no_completion,
                    timeout=args.timeout, via=args.via))
            if args.command == "connect":
                return await connect(kube, ns, args)
            if args.command == "switch":
                if args.switch_command == "abort":
                    return await switch_abort(kube, ns, args.name, args.pod, args.timeout, not args.no_wait)
                return await switch_status(kube, ns, args.name)
            return await status(kube, ns, args.name, via=args.via)
        except KubeError as e:
            print(f"kubectl pdd: {e}", file=sys.stderr)
            return 1
        except httpx.HTTPError as e:
            print(f"kubectl pdd: the API server did not answer: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        finally:
            await kube.close()
    sys.exit(asyncio.run(run()))


if __name__ == "__main__":
    main()
