"""A small async Kubernetes client (httpx) for the operator: server-side apply under one
field manager, get/list/patch/delete. Credentials come from the same places the official
client reads (in-cluster ServiceAccount, then kubeconfig), and are read again when the API
server answers 401: a projected ServiceAccount token rotates (hourly by default), a
kubeconfig's tokenFile is replaced, an exec plugin's credential expires. Kopf's watches
re-authenticate the same way (its login handler reloads the same sources on a 401)."""
from __future__ import annotations

import asyncio
import json
import logging
import ssl
from typing import Any

import httpx
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config

from pd_contract.names import FIELD_MANAGER

from .kinds import BY_KIND

log = logging.getLogger("pd_operator.kube")


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
        self._fixed = cfg is not None   # credentials given by the caller are not re-read
        self._http = self._client(cfg or _configuration())
        self._reloading: asyncio.Lock = asyncio.Lock()
        self._retired: list[httpx.AsyncClient] = []   # closed at close(): calls may still be in flight on them
        self.reloads = 0

    @staticmethod
    def _client(cfg: k8s_client.Configuration) -> httpx.AsyncClient:
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
        return httpx.AsyncClient(base_url=cfg.host, verify=ctx, headers=headers, trust_env=False,
                                 timeout=httpx.Timeout(30, connect=10))

    async def _reload(self, stale: httpx.AsyncClient) -> None:
        """New credentials from their source, once for every call that saw the old ones fail."""
        async with self._reloading:
            if self._http is not stale:
                return   # another call reloaded meanwhile
            cfg = await asyncio.to_thread(_configuration)
            self._http = self._client(cfg)
            self.reloads += 1
            self._retired.append(stale)
            log.info("credentials read again after a 401 (reload %d)", self.reloads)

    async def close(self) -> None:
        for http in [*self._retired, self._http]:
            await http.aclose()

    async def _req(self, method: str, path: str, what: str, **kw) -> dict:
        http = self._http
        r = await http.request(method, path, **kw)
        if r.status_code == 401 and not self._fixed:
            await self._reload(http)
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

    async def serves(self, api_version: str, plural: str) -> bool:
        """Whether the API server serves `plural` in `api_version` (discovery; a CRD may be absent)."""
        try:
            out = await self._req("GET", f"/apis/{api_version}", f"discover {api_version}")
        except KubeError as e:
            if e.status == 404:
                return False
            raise
        return any(r.get("name") == plural for r in out.get("resources") or [])

    async def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict | None:
        try:
            return await self._req("GET", object_path(api_version, kind, namespace, name), f"get {kind} {name}")
        except KubeError as e:
            if e.status == 404:
                return None
            raise

    async def list(self, api_version: str, kind: str, namespace: str | None, selector: str = "",
                   fields: str = "") -> list[dict]:
        params = {"labelSelector": selector} if selector else {}
        if fields:
            params["fieldSelector"] = fields
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

    async def delete(self, api_version: str, kind: str, namespace: str | None, name: str, uid: str = "") -> None:
        """Delete (only that object, given its uid); one already gone is not an error."""
        kw = {"json": {"preconditions": {"uid": uid}}} if uid else {}
        try:
            await self._req("DELETE", object_path(api_version, kind, namespace, name), f"delete {kind} {name}", **kw)
        except KubeError as e:
            if e.status != 404:
                raise

    async def replace(self, obj: dict) -> dict:
        """PUT: with metadata.resourceVersion set, it fails (409) if the object changed since."""
        meta = obj["metadata"]
        return await self._req("PUT", object_path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"]),
                               f"replace {obj['kind']} {meta['name']}", json=obj,
                               params={"fieldManager": FIELD_MANAGER})

    async def patch(self, api_version: str, kind: str, namespace: str, name: str, body: Any,
                    subresource: str = "", json_patch: bool = False) -> dict:
        """A merge patch, or (json_patch) a JSON patch: a list of ops, `test` ones included."""
        path = object_path(api_version, kind, namespace, name) + (f"/{subresource}" if subresource else "")
        kind_ = "application/json-patch+json" if json_patch else "application/merge-patch+json"
        return await self._req("PATCH", path, f"patch {kind} {name}", content=json.dumps(body),
                               params={"fieldManager": FIELD_MANAGER}, headers={"Content-Type": kind_})
