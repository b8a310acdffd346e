"""`kubectl pdd`: the connectivity check and the one-screen status, from anywhere kubectl works.

    kubectl pdd verify NAME [-n NS] [--api-key KEY]
    kubectl pdd status NAME [-n NS]
    kubectl pdd connect NAME [-n NS] --client openai|anthropic|claude-code|codex|cline|curl
                        [--key-name K] [--model M] [--base-url URL] [--check]

Agents and the gateway are reached through the API server's pod proxy, so nothing but the
kubeconfig is needed (no route to the pod network). The API server consumes the
`Authorization` header, so the agent token travels in `X-PD-Agent-Token` and the API key in
`x-api-key`. `verify` checks every decoder's links, pulls a probe KV cache on every decoder,
and sends one completion through the gateway; each failure is explained in the words of
the status conditions; a tensor-parallel pod's links and probe are reported per rank pair
(rank r links and pulls from the prefill's rank r), and `status` lists its ranks. Exit code 1
if anything failed."""
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
import time

import httpx

from pd_contract.names import BROKEN_CODES

from .builders import AGENT_PORT, token_secret_name
from .connect import CLIENTS, check, render, resolve
from .diagnosis import link_failure, verify_failure
from .gateway import GATEWAY_PORT, LABEL_GATEWAY, data_token_secret_name
from .kube import Kube, KubeError

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
        if self.via != "direct":
            url = f"/api/v1/namespaces/{self.ns}/pods/{pod}:{port}/proxy{path}"
            r = await self.kube._http.request(method, url, headers=headers or {}, json=body, timeout=timeout)
            if not (self.via == "auto" and r.status_code == 400 and "address not allowed" in r.text):
                return _decoded(r)
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


async def verify(kube: Kube, ns: str, name: str, api_key: str | None, out=print, via: str = "auto") -> int:
    obj = await kube.get("pdoperator.io/v1alpha1", "PDDeployment", ns, name)
    if obj is None:
        out(f"PDDeployment {ns}/{name} not found")
        return 1
    control = (await _secret(kube, ns, token_secret_name(name))).get("token")
    px = Proxy(kube, ns, via, out)
    try:
        return await _verify(kube, px, obj, ns, name, control, api_key, out)
    finally:
        await px.close()


async def _verify(kube: Kube, px: Proxy, obj: dict, ns: str, name: str, control: str | None, api_key: str | None,
                  out) -> int:
    spec, status = obj["spec"], obj.get("status") or {}
    failures = 0
    out(f"PDDeployment {ns}/{name}: phase {status.get('phase')}, links {status.get('linksSummary')}")
    members = _members(obj)
    decoders = [m for m in members if m["role"] == "decoder"]
    hdr = {"X-PD-Agent-Token": control or ""}
    timeout_ms = spec.get("datadist", {}).get("linkTimeoutMs", 3000)
    out("\nlinks (each decoder's engine, check_link_status):")
    statuses = {}
    for m in members:
        code, st = await px.call("GET", m["pod"], AGENT_PORT, "/v1/status", hdr, timeout=10)
        if code != 200 or not isinstance(st, dict):
            failures += 1
            out(f"  {BAD} {m['pod']}: agent not reachable through the API server ({code}): {str(st)[:160]}")
            continue
        statuses[m["pod"]] = st
        if st.get("proxy_env"):
            out(f"  {BAD} {m['pod']}: proxy variables set ({', '.join(sorted(st['proxy_env']))}): unset them or "
                f"list the peers in no_proxy")
            failures += 1
    for d in decoders:
        if d["pod"] not in statuses:
            continue
        bad, lines = format_links(d["pod"], statuses, timeout_ms)
        failures += bad
        for line in lines:
            out(line)
    out("\nKV path (a probe cache pulled by each decoder):")
    prefills = [m for m in members if statuses.get(m["pod"], {}).get("role") == "prompt"]
    for i, d in enumerate(decoders):
        if not prefills or d["pod"] not in statuses:
            continue
        p = prefills[i % len(prefills)]
        code, r = await px.call("POST", d["pod"], AGENT_PORT, "/v1/verify", hdr,
                                {"peer": probe_peer(p, statuses[p["pod"]], await px.pod_ip(p["pod"]))})
        ok, lines = format_probe(d["pod"], p["pod"], code, r, spec.get("model", {}).get("modelId", 0))
        failures += not ok
        for line in lines:
            out(line)
    gw = spec.get("gateway") or {}
    out("\ngateway (one completion with the key):")
    if not gw.get("enabled"):
        out("  -   spec.gateway is not enabled")
    else:
        failures += await _gateway_check(kube, px, ns, name, spec, gw, api_key, out)
    out(f"\n{'all checks passed' if not failures else f'{failures} check(s) failed'}")
    return 1 if failures else 0


async def _gateway_check(kube: Kube, px: Proxy, ns: str, name: str, spec: dict, gw: dict, api_key: str | None,
                         out) -> int:
    pods = [p for p in await kube.list("v1", "Pod", ns, f"{LABEL_GATEWAY}={name}")
            if not p["metadata"].get("deletionTimestamp")]
    if not pods:
        out(f"  {BAD} no {name}-gateway pod")
        return 1
    if api_key is None:
        keys = await _secret(kube, ns, gw["apiKeysSecret"])
        if not keys:
            out(f"  {BAD} Secret {gw['apiKeysSecret']} has no keys (or cannot be read); pass --api-key")
            return 1
        key_name, api_key = sorted(keys.items())[0]
        out(f"      using the key named {key_name!r} from Secret {gw['apiKeysSecret']}")
    pod = pods[0]["metadata"]["name"]
    model = spec["model"]["name"]
    t0 = time.monotonic()
    code, r = await px.call("POST", pod, GATEWAY_PORT, "/v1/chat/completions", {"x-api-key": api_key},
                            {"model": model, "max_tokens": 8,
                             "messages": [{"role": "user", "content": "kubectl pdd verify"}]})
    ms = (time.monotonic() - t0) * 1000
    if code == 200 and isinstance(r, dict) and r.get("choices"):
        out(f"  {OK} {pod}: model {model}, {r['usage']['completion_tokens']} tokens in {ms:.0f} ms: "
            f"{r['choices'][0]['message']['content']!r}")
        return 0
    msg = r.get("error", {}).get("message") if isinstance(r, dict) else str(r)[:200]
    hint = {401: "the key is missing or wrong (check for a typo or spaces)",
            404: "wrong path or model id", 503: "no prefill/decoder pair could take the request"}.get(code, "")
    out(f"  {BAD} {pod}: HTTP {code}: {msg}" + (f" ({hint})" if hint else ""))
    return 1


async def status(kube: Kube, ns: str, name: str, out=print, via: str = "auto") -> int:
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
            code, a = await px.call("GET", m["pod"], AGENT_PORT, "/v1/status", {"X-PD-Agent-Token": data or ""},
                                    timeout=5)
            if code == 200 and isinstance(a, dict):
                agent = a
                load, draining = a.get("load", {}), str(a.get("draining", False)).lower()
        links = m.get("links")
        out(f"{m['pod']:28} {m.get('group', '-'):8} {m.get('role', '-'):10} {m.get('assignedRole') or '-':9} "
            f"{str(m.get('ready', False)).lower():6} {m.get('clusterId', '-')!s:8} "
            f"{(str(links['up']) + '/' + str(links['expected'])) if links else '-':6} "
            f"{load.get('in_flight', '-')!s:8} {load.get('queue_depth', '-')!s:6} "
            f"{round(load['kv_used_bytes'] / 2**20, 1) if 'kv_used_bytes' in load else '-'!s:7} {draining}")
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
        if c["type"] == "Rebalancing" or c["status"] != "True" and c["type"] != "ProxyEnvironment":
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


def format_ranks(agent_status: dict | None, summary: dict | None = None, last_error: str = "") -> list[str]:
    """Lines under a pod's status row: a multi-rank pod's TP, where its device IPs came from and
    a line per rank (only the member's rank summary when its agent did not answer); any pod's
    device IP error unless its lastError already says it. Nothing for a healthy single-rank pod."""
    a, summary = agent_status or {}, summary or {}
    ranks = sorted(a.get("ranks") or [], key=lambda r: r["rank"])
    tp = a.get("tensor_parallel") or summary.get("tensorParallel") or 1
    lines = []
    if ranks or tp > 1:
        init = sum(1 for r in ranks if r.get("initialized")) if ranks else summary.get("initialized", "?")
        src = a.get("device_ips") or summary.get("deviceIps") or ""
        lines.append(f"    TP {tp}: {init}/{tp} ranks initialised, device IPs from "
                     f"{DEVICE_IP_SOURCES.get(src, src or 'nowhere yet')}")
        for r in ranks:
            dev = r.get("device_id")
            state = "initialised" if r.get("initialized") else \
                "not registered" if not r.get("registered", True) else "not initialised"
            lines.append(f"      rank {r['rank']:<3} cluster {r['cluster_id']:<8} "
                         f"device {'-' if dev is None else dev!s:<3} "
                         f"{(r.get('ip') or '?') + ':' + str(r.get('port') or '?'):21} {state}"
                         + (f": {r['last_error']}" if r.get("last_error") else ""))
    err = a.get("device_error")
    if err and err not in last_error:
        lines.append(f"    DeviceIPUnknown: {err}")
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="kubectl pdd", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["verify", "status", "connect"])
    ap.add_argument("name")
    ap.add_argument("-n", "--namespace", default=None)
    ap.add_argument("--api-key", default=None, help="the gateway key to use (default: the first in its Secret)")
    ap.add_argument("--client", choices=CLIENTS, default="openai", help="connect: the configuration to print")
    ap.add_argument("--key-name", default=None, help="connect: which key of the Secret (default: the first)")
    ap.add_argument("--model", default=None, help="connect: the model id (default: the first the key may use)")
    ap.add_argument("--base-url", default=None, help="connect: the Base URL clients reach the gateway at")
    ap.add_argument("--check", action="store_true", help="connect: send one request as the client would")
    ap.add_argument("--via", choices=["auto", "proxy", "direct"], default="auto",
                    help="reach pods through the API server's pod proxy, directly, or proxy with a direct fallback")
    args = ap.parse_args(argv)
    ns = args.namespace
    if ns is None:
        from kubernetes import config
        try:
            _, ctx = config.list_kube_config_contexts()
            ns = ctx.get("context", {}).get("namespace") or "default"
        except Exception:  # noqa: BLE001 - in a pod, or no kubeconfig context: the default namespace
            ns = "default"

    async def run() -> int:
        kube = Kube()
        try:
            if args.command == "verify":
                return await verify(kube, ns, args.name, args.api_key, via=args.via)
            if args.command == "connect":
                return await connect(kube, ns, args)
            return await status(kube, ns, args.name, via=args.via)
        except KubeError as e:
            print(f"kubectl pdd: {e}", file=sys.stderr)
            return 1
        finally:
            await kube.close()
    sys.exit(asyncio.run(run()))
