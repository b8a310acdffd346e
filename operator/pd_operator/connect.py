"""`kubectl pdd connect NAME --client C`: the three things every client needs (Base URL, key,
model id), filled in, in the form the client reads; `--check` sends one request the way that
client would and explains a failure.

The renderers are pure; `connect()` finds the gateway (a PDGateway, or a PDDeployment with its
own gateway), reads the key from its Secret and works out the Base URL: `--base-url`, else an
Ingress or a LoadBalancer in front of the gateway's Service, else the Service's DNS name; on a
cluster whose pods have loopback addresses (this project's local cluster, which routes no
Service) a gateway pod's address, saying so.

OpenAI-style clients take the Base URL with `/v1` (they append `/chat/completions`); Anthropic
clients take it without (they append `/v1/messages`). Getting that wrong is the most common
mistake, so each snippet carries the form its client needs."""
from __future__ import annotations

import base64
import ipaddress
import json
import os
import time

import httpx

from pd_contract.names import GATEWAY_PORT, LABEL_GATEWAY, LABEL_PDGATEWAY

from .api import GROUP, VERSION
from .kube import Kube, KubeError

CLIENTS = ("openai", "anthropic", "claude-code", "codex", "cline", "curl")
KEY_ENV = "PD_API_KEY"
PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
# the client documentation these forms follow
VERSIONS = {
    "codex": "Codex CLI 0.171 (config.toml model_providers; it speaks only the Responses API since 0.95, "
             "so wire_api = \"responses\" and it POSTs <base_url>/responses)",
    "cline": "Cline 4.1 extension / CLI 3.0 (provider openai-compatible; it POSTs <baseUrl>/chat/completions)",
    "claude-code": "Claude Code 2.1 (settings.json \"env\"; it calls <ANTHROPIC_BASE_URL>/v1/messages)",
    "openai": "openai-python 3.x (OPENAI_BASE_URL ends in /v1)",
    "anthropic": "anthropic-python 2.x (ANTHROPIC_BASE_URL without /v1)",
}


def openai_base(root: str) -> str:
    return root.rstrip("/") + "/v1"


def render(client: str, root: str, key: str, model: str) -> str:
    """The configuration `client` reads, for a gateway at `root` (no /v1)."""
    v1 = openai_base(root)
    if client == "openai":
        return (f"# {VERSIONS['openai']}\nexport OPENAI_BASE_URL={v1}\nexport OPENAI_API_KEY={key}\n"
                f"export OPENAI_MODEL={model}   # pass as model= in each request\n")
    if client == "anthropic":
        return (f"# {VERSIONS['anthropic']}: the SDK appends /v1/messages, so no /v1 here\n"
                f"export ANTHROPIC_BASE_URL={root.rstrip('/')}\nexport ANTHROPIC_API_KEY={key}\n"
                f"export ANTHROPIC_MODEL={model}   # pass as model= in each request\n")
    if client == "claude-code":
        # AUTH_TOKEN goes as a bearer token (API_KEY would be x-api-key: the gateway takes either);
        # the Haiku tier runs background tasks, so it is this model too
        settings = {"env": {"ANTHROPIC_BASE_URL": root.rstrip("/"), "ANTHROPIC_AUTH_TOKEN": key,
                            "ANTHROPIC_MODEL": model, "ANTHROPIC_DEFAULT_HAIKU_MODEL": model}}
        return (f"// {VERSIONS['claude-code']}\n// ~/.claude/settings.json (or .claude/settings.json in a "
                f"project); no /v1 in the Base URL\n" + json.dumps(settings, indent=2) + "\n")
    if client == "codex":
        return (f"# {VERSIONS['codex']}\n# ~/.codex/config.toml\n"
                f"model = {json.dumps(model)}\nmodel_provider = \"pd-gateway\"\n\n"
                f"[model_providers.pd-gateway]\nname = \"pd-gateway\"\nbase_url = {json.dumps(v1)}\n"
                f"env_key = \"{KEY_ENV}\"\nwire_api = \"responses\"\n\n"
                f"# and in the shell that runs codex:\n# export {KEY_ENV}={key}\n")
    if client == "cline":
        providers = {"version": 1, "lastUsedProvider": "openai-compatible", "modes": {}, "providers": {
            "openai-compatible": {"settings": {"provider": "openai-compatible", "apiKey": key, "model": model,
                                               "baseUrl": v1, "headers": {}}, "tokenSource": "manual"}}}
        return (f"# {VERSIONS['cline']}\n# in the IDE: API Provider \"OpenAI Compatible\", Base URL {v1}, "
                f"API Key, Model ID {model}; from a shell:\n"
                f"cline auth --provider openai-compatible --apikey {key} --modelid {model} --baseurl {v1}\n"
                f"# or as ~/.cline/data/settings/providers.json:\n" + json.dumps(providers, indent=2) + "\n")
    if client == "curl":
        body = json.dumps({"model": model, "max_tokens": 16, "messages": [{"role": "user", "content": "Hello"}]})
        return (f"curl -sS --noproxy '*' {v1}/chat/completions -H 'Authorization: Bearer {key}' "
                f"-H 'Content-Type: application/json' -d '{body}'\n")
    raise ValueError(f"unknown client {client!r}; one of {', '.join(CLIENTS)}")


def explain(status: int, body: str, url: str, key_source: str, model: str) -> str:
    """A failed check in the terms a user reads in their client's error."""
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    message = ""
    if isinstance(data, dict):
        err = data.get("error")
        message = (err.get("message") if isinstance(err, dict) else "") or str(data.get("message") or "")
    if data is None and status:
        return (f"HTTP {status} from {url} is not JSON (it starts {body[:60]!r}): something other than pd-gateway "
                f"answered (a proxy, an ingress's default page): check the Base URL and proxy variables")
    if status == 401:
        return (f"401: the key was refused ({message}). The key came from {key_source}: check it is still there, "
                f"has not expired, and has no space or newline around it")
    if status == 403:
        return f"403: {message}. Use a model this key may use, or widen its models in the PDGateway's spec.keys"
    if status == 404 and "/v1/v1" in url:
        return f"404: the Base URL doubles /v1 ({url}); give it once: the client appends the rest"
    if status == 404 and "model" in message and "not found" in message:
        return f"404: {message}. The model id must be one the gateway serves (kubectl get pdgw -o yaml: status.models)"
    if status == 404:
        return (f"404 from {url}: {message or 'not found'}. OpenAI clients need the Base URL to end in /v1, "
                f"Anthropic clients need it without /v1")
    if status == 429:
        return f"429: {message}"
    if status == 503:
        return f"503: {message}. The model's deployment has no serving P-D pair now (kubectl get pdd)"
    if status == 200 and isinstance(data, dict) and not {"choices", "content", "output"} & set(data):
        return ("200 but no `choices` in the answer: the client would fail \"reading choices\"; the Base URL "
                "reaches something that is not an OpenAI-compatible endpoint")
    return f"HTTP {status}: {message or body[:200]}"


def check(client: str, root: str, key: str, model: str, key_source: str,
          http: httpx.Client | None = None) -> tuple[bool, str]:
    """One request the way `client` sends it; (passed, what happened)."""
    proxies = [v for v in PROXY_VARS if os.environ.get(v)]
    anthropic_style = client in ("anthropic", "claude-code")
    if anthropic_style:
        url = root.rstrip("/") + "/v1/messages"
        # Claude Code sends ANTHROPIC_AUTH_TOKEN, and the Python SDK 2.x its api_key, as a bearer token
        headers = {"Authorization": f"Bearer {key}", "anthropic-version": "2023-06-01"}
    else:
        url = openai_base(root) + ("/responses" if client == "codex" else "/chat/completions")
        headers = {"Authorization": f"Bearer {key}"}
    body: dict = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "Say hello"}]}
    if client == "codex":   # the Responses API, as Codex sends it
        body = {"model": model, "max_output_tokens": 4, "stream": False,
                "input": [{"role": "user", "content": [{"type": "input_text", "text": "Say hello"}]}]}
    own = http is None
    http = http or httpx.Client(trust_env=True, timeout=30)
    t0 = time.monotonic()
    try:
        r = http.post(url, json=body, headers=headers)
    except httpx.HTTPError as e:
        via = f" through the proxy in {', '.join(proxies)} (set NO_PROXY for this host)" if proxies else ""
        return False, f"cannot reach {url}{via}: {type(e).__name__}: {e}"
    finally:
        if own:
            http.close()
    ms = (time.monotonic() - t0) * 1000
    if r.status_code == 200:
        try:
            data = r.json()
            tokens = data["usage"]["output_tokens" if anthropic_style or client == "codex" else "completion_tokens"]
            if client == "codex":
                data["output"][0]["content"][0]["text"]
            elif not anthropic_style:
                data["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            return False, explain(200, r.text, url, key_source, model)
        return True, f"check passed: {model} answered {tokens} tokens in {ms:.0f} ms at {url}"
    return False, explain(r.status_code, r.text, url, key_source, model)


# ---- finding the gateway ---------------------------------------------------------------------------

def _loopback(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip).is_loopback
    except ValueError:
        return False


async def base_root(kube: Kube, ns: str, service: str, pod_label: tuple[str, str]) -> tuple[str, str]:
    """(root URL without /v1, how it was found)."""
    try:
        ingresses = await kube.list("networking.k8s.io/v1", "Ingress", ns)
    except KubeError:   # not allowed to list them: look no further there
        ingresses = []
    for ing in ingresses:
        tls = bool(ing["spec"].get("tls"))
        for rule in ing["spec"].get("rules") or []:
            for path in (rule.get("http") or {}).get("paths") or []:
                if (path.get("backend", {}).get("service") or {}).get("name") == service and rule.get("host"):
                    prefix = (path.get("path") or "/").rstrip("/")
                    return (f"{'https' if tls else 'http'}://{rule['host']}{prefix}",
                            f"Ingress {ing['metadata']['name']}")
    svc = await kube.get("v1", "Service", ns, service) or {}
    for lb in ((svc.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []:
        host = lb.get("hostname") or lb.get("ip")
        if host:
            return f"http://{host}:{GATEWAY_PORT}", f"the LoadBalancer of Service {service}"
    pods = await kube.list("v1", "Pod", ns, f"{pod_label[0]}={pod_label[1]}")
    ready = [p for p in pods if any(c["type"] == "Ready" and c["status"] == "True"
                                    for c in (p.get("status") or {}).get("conditions") or [])]
    ips = [p["status"].get("podIP", "") for p in ready]
    if ips and all(_loopback(ip) for ip in ips):
        return (f"http://{ips[0]}:{GATEWAY_PORT}", f"pod {ready[0]['metadata']['name']}'s address: this cluster's "
                f"pods have loopback addresses and no Service routing (a single-machine cluster)")
    return f"http://{service}.{ns}.svc:{GATEWAY_PORT}", (
        f"the Service's DNS name (reachable in the cluster; from outside use `kubectl port-forward svc/{service} "
        f"{GATEWAY_PORT}` and --base-url http://127.0.0.1:{GATEWAY_PORT}, or an Ingress)")


async def find(kube: Kube, ns: str, name: str) -> dict:
    """{service, pod_label, secret, models, policy} of a PDGateway or a PDDeployment's own gateway."""
    gw = await kube.get(f"{GROUP}/{VERSION}", "PDGateway", ns, name)
    if gw is not None:
        spec = gw.get("spec") or {}
        models = [m["model"] for m in (gw.get("status") or {}).get("models") or []]
        return {"service": name, "pod_label": (LABEL_PDGATEWAY, name), "secret": spec.get("apiKeysSecret"),
                "models": models, "policy": spec.get("keys") or {}, "kind": "PDGateway"}
    d = await kube.get(f"{GROUP}/{VERSION}", "PDDeployment", ns, name)
    if d is None:
        raise LookupError(f"no PDGateway or PDDeployment {name!r} in namespace {ns}")
    gspec = (d.get("spec") or {}).get("gateway") or {}
    if not gspec.get("enabled"):
        raise LookupError(f"PDDeployment {name} has no gateway (spec.gateway.enabled is false); select it with a "
                          f"PDGateway, or enable its own")
    return {"service": f"{name}-gateway", "pod_label": (LABEL_GATEWAY, name), "secret": gspec.get("apiKeysSecret"),
            "models": [d["spec"]["model"]["name"]], "policy": {}, "kind": "PDDeployment"}


async def resolve(kube: Kube, ns: str, name: str, key_name: str | None, model: str | None,
                  base_url: str | None, api_key: str | None = None) -> dict:
    """`api_key`: a key the user holds (the Secret is not read: they may not be allowed to)."""
    g = await find(kube, ns, name)
    if api_key:
        key, key_name, source = api_key, key_name or "", "--api-key"
    else:
        secret = await kube.get("v1", "Secret", ns, g["secret"])
        data = (secret or {}).get("data") or {}
        if not data:
            raise LookupError(f"Secret {g['secret']} (the gateway's keys) is missing or empty")
        key_name = key_name or sorted(data)[0]
        if key_name not in data:
            raise LookupError(f"Secret {g['secret']} has no key named {key_name!r} (it has {', '.join(sorted(data))})")
        key = base64.b64decode(data[key_name]).decode().strip()
        source = f"Secret {g['secret']}, key {key_name!r}"
    allowed = (g["policy"].get(key_name) or {}).get("models")
    if model is None:
        candidates = [m for m in g["models"] if not allowed or m in allowed]
        if not candidates:
            raise LookupError(f"key {key_name!r} may use no model the gateway serves now ({', '.join(g['models'])})")
        model = candidates[0]
    if base_url:
        root, how = base_url.rstrip("/").removesuffix("/v1"), "--base-url"
    else:
        root, how = await base_root(kube, ns, g["service"], g["pod_label"])
    return {"root": root, "how": how, "key": key, "key_name": key_name or "(--api-key)", "model": model,
            "key_source": source, "kind": g["kind"]}
