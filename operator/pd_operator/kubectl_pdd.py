"""`kubectl pdd`: the connectivity check and the one-screen status, from anywhere kubectl works.

    kubectl pdd verify NAME [-n NS] [--api-key KEY]
    kubectl pdd status NAME [-n NS]

Agents and the gateway are reached through the API server's pod proxy, so nothing but the
kubeconfig is needed (no route to the pod network). The API server consumes the
`Authorization` header, so the agent token travels in `X-PD-Agent-Token` and the API key in
`x-api-key`. `verify` checks every decoder's links, pulls a probe KV cache on every decoder,
and sends one completion through the gateway; each failure is explained in the words of
the status conditions. Exit code 1 if anything failed."""
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
import time

import httpx

from .builders import AGENT_PORT, token_secret_name
from .diagnosis import link_failure, verify_failure
from .gateway import GATEWAY_PORT, LABEL_GATEWAY, data_token_secret_name
from .kube import Kube, KubeError

OK, BAD = "ok ", "FAIL"


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
        if pod not in self._ips:
            p = await self.kube.get("v1", "Pod", self.ns, pod)
            self._ips[pod] = ((p or {}).get("status") or {}).get("podIP", "")
        try:
            r = await self._direct.request(method, f"http://{self._ips[pod]}:{port}{path}", headers=headers or {},
                                           json=body, timeout=timeout)
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
    by_cid = {m.get("clusterId"): m for m in members}
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
    prefill_ids = {st["cluster_id"] for st in statuses.values() if st["role"] == "prompt"}
    for d in decoders:
        st = statuses.get(d["pod"])
        if st is None:
            continue
        have = {link["cluster_id"]: link for link in st.get("links", [])}
        for cid in sorted(prefill_ids):
            p = by_cid.get(cid, {"pod": str(cid), "ip": "?", "port": 0})
            link = have.get(cid)
            if link is None:
                failures += 1
                out(f"  {BAD} {d['pod']} -> {p['pod']}: not linked")
            elif not link.get("healthy", True):
                failures += 1
                diag = link_failure(link["code"], d["pod"], p["pod"], link.get("ip", ""), link.get("port", 0),
                                    timeout_ms)
                out(f"  {BAD} {d['pod']} -> {p['pod']}: {link['code']} ({diag.reason}): {diag.message}")
            else:
                out(f"  {OK} {d['pod']} -> {p['pod']}: {link['code']}")
    out("\nKV path (a probe cache pulled by each decoder):")
    prefills = [m for m in members if statuses.get(m["pod"], {}).get("role") == "prompt"]
    for i, d in enumerate(decoders):
        if not prefills or d["pod"] not in statuses:
            continue
        p = prefills[i % len(prefills)]
        peer = {"name": p["pod"], "cluster_id": p["clusterId"], "ip": p["ip"], "port": p["port"],
                "agent_url": f"http://{p['ip']}:{AGENT_PORT}"}
        code, r = await px.call("POST", d["pod"], AGENT_PORT, "/v1/verify", hdr, {"peer": peer})
        if code == 200 and isinstance(r, dict) and r.get("ok"):
            out(f"  {OK} {d['pod']} <- {p['pod']}: {r['bytes']} bytes in {r['pull_ms']:.2f} ms, bytes match")
        else:
            failures += 1
            rc = r.get("code", str(code)) if isinstance(r, dict) else str(code)
            diag = verify_failure(rc, d["pod"], p["pod"], r.get("message", "") if isinstance(r, dict) else str(r),
                                  spec.get("model", {}).get("modelId", 0))
            out(f"  {BAD} {d['pod']} <- {p['pod']}: {rc} ({diag.reason}): {diag.message}")
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
        if m.get("ip"):
            code, a = await px.call("GET", m["pod"], AGENT_PORT, "/v1/status", {"X-PD-Agent-Token": data or ""},
                                    timeout=5)
            if code == 200 and isinstance(a, dict):
                load, draining = a.get("load", {}), str(a.get("draining", False)).lower()
        links = m.get("links")
        out(f"{m['pod']:28} {m.get('group', '-'):8} {m.get('role', '-'):10} {m.get('assignedRole') or '-':9} "
            f"{str(m.get('ready', False)).lower():6} {m.get('clusterId', '-')!s:8} "
            f"{(str(links['up']) + '/' + str(links['expected'])) if links else '-':6} "
            f"{load.get('in_flight', '-')!s:8} {load.get('queue_depth', '-')!s:6} "
            f"{round(load['kv_used_bytes'] / 2**20, 1) if 'kv_used_bytes' in load else '-'!s:7} {draining}")
        if m.get("lastError"):
            out(f"    {m['lastError']}")
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="kubectl pdd", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["verify", "status"])
    ap.add_argument("name")
    ap.add_argument("-n", "--namespace", default=None)
    ap.add_argument("--api-key", default=None, help="the gateway key to use (default: the first in its Secret)")
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
            return await status(kube, ns, args.name, via=args.via)
        except KubeError as e:
            print(f"kubectl pdd: {e}", file=sys.stderr)
            return 1
        finally:
            await kube.close()
    sys.exit(asyncio.run(run()))
