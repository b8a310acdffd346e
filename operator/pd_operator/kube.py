"""A small async Kubernetes client (httpx) for the operator: server-side apply under one
field manager, get/list/patch/delete. Credentials come from the same places the official
client reads (in-cluster ServiceAccount, then kubeconfig)."""
from __future__ import annotations

import json
import ssl
from typing import Any

import httpx
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config

from .kinds import BY_KIND

FIELD_MANAGER = "pd-operator"   # the one field manager of every apply


class KubeError(Exception):
    def __init__(self, status: int, body: str, what: str = ""):
        try:
            message = json.loads(body).get("message", body)
        except ValueError:
            message = body
        super().__init__(f"{what}: HTTP {status}: {message}" if what else f"HTTP {status}: {message}")
        self.status = status
        self.message = message


def _configuration() -> k8s_client.Configuration:
    cfg = k8s_client.Configuration()
    try:
        k8s_config.load_incluster_config(client_configuration=cfg)
    except k8s_config.ConfigException:
        k8s_config.load_kube_config(client_configuration=cfg)
    return cfg


def object_path(api_version: str, kind: str, namespace: str | None, name: str | None = None) -> str:
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    ns = f"/namespaces/{namespace}" if namespace else ""
    tail = f"/{name}" if name else ""
    return f"{base}{ns}/{BY_KIND[kind].plural}{tail}"


class Kube:
    def __init__(self, cfg: k8s_client.Configuration | None = None):
        cfg = cfg or _configuration()
        ctx = ssl.create_default_context(cafile=cfg.ssl_ca_cert) if cfg.ssl_ca_cert else ssl.create_default_context()
        if cfg.cert_file:
            ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
        if not cfg.verify_ssl:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        headers = {}
        token = cfg.api_key.get("authorization") or cfg.api_key.get("BearerToken")
        if token:
            headers["Authorization"] = token if token.startswith("Bearer ") else f"Bearer {token}"
        self._http = httpx.AsyncClient(base_url=cfg.host, verify=ctx, headers=headers, trust_env=False,
                                       timeout=httpx.Timeout(30, connect=10))

    async def close(self) -> None:
        await self._http.aclose()

    async def _req(self, method: str, path: str, what: str, **kw) -> dict:
        r = await self._http.request(method, path, **kw)
        if r.status_code >= 400:
            raise KubeError(r.status_code, r.text, what)
        return r.json() if r.content else {}

    async def apply(self, obj: dict, subresource: str = "") -> dict:
        """Server-side apply under the operator's single field manager."""
        meta = obj["metadata"]
        path = object_path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
        if subresource:
            path += f"/{subresource}"
        return await self._req(
            "PATCH", path, f"apply {obj['kind']} {meta['name']}",
            params={"fieldManager": FIELD_MANAGER, "force": "true"},
            content=json.dumps(obj), headers={"Content-Type": "application/apply-patch+yaml"})

    async def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict | None:
        try:
            return await self._req("GET", object_path(api_version, kind, namespace, name), f"get {kind} {name}")
        except KubeError as e:
            if e.status == 404:
                return None
            raise

    async def list(self, api_version: str, kind: str, namespace: str | None, selector: str = "") -> list[dict]:
        params = {"labelSelector": selector} if selector else {}
        out = await self._req("GET", object_path(api_version, kind, namespace), f"list {kind}", params=params)
        return out.get("items", [])

    async def create(self, obj: dict) -> dict | None:
        """Create if absent (for objects whose content must not be re-generated, like a token)."""
        meta = obj["metadata"]
        try:
            return await self._req("POST", object_path(obj["apiVersion"], obj["kind"], meta.get("namespace")),
                                   f"create {obj['kind']} {meta['name']}", json=obj,
                                   params={"fieldManager": FIELD_MANAGER})
        except KubeError as e:
            if e.status == 409:
                return None
            raise

    async def replace(self, obj: dict) -> dict:
        """PUT: with metadata.resourceVersion set, it fails (409) if the object changed since."""
        meta = obj["metadata"]
        return await self._req("PUT", object_path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"]),
                               f"replace {obj['kind']} {meta['name']}", json=obj,
                               params={"fieldManager": FIELD_MANAGER})

    async def patch(self, api_version: str, kind: str, namespace: str, name: str, body: Any,
                    subresource: str = "") -> dict:
        path = object_path(api_version, kind, namespace, name) + (f"/{subresource}" if subresource else "")
        return await self._req("PATCH", path, f"patch {kind} {name}", content=json.dumps(body),
                               params={"fieldManager": FIELD_MANAGER},
                               headers={"Content-Type": "application/merge-patch+json"})
