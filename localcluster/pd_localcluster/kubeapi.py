"""A small async Kubernetes API client (httpx) for the node agent: get, list, watch,
create, patch and delete, authenticated by the client certificate of a kubeconfig."""
from __future__ import annotations

import json
import ssl
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
import yaml


class ApiError(Exception):
    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status = status
        self.body = body


def _resolve(base: Path, value: str) -> str:
    p = Path(value)
    return str(p if p.is_absolute() else base / p)


class KubeApi:
    def __init__(self, kubeconfig: Path):
        cfg = yaml.safe_load(kubeconfig.read_text())
        ctx_name = cfg["current-context"]
        ctx = next(c["context"] for c in cfg["contexts"] if c["name"] == ctx_name)
        cluster = next(c["cluster"] for c in cfg["clusters"] if c["name"] == ctx["cluster"])
        user = next(u["user"] for u in cfg["users"] if u["name"] == ctx["user"])
        base = kubeconfig.parent
        self.server = cluster["server"]
        self.ca_file = _resolve(base, cluster["certificate-authority"])
        ssl_ctx = ssl.create_default_context(cafile=self.ca_file)
        ssl_ctx.load_cert_chain(_resolve(base, user["client-certificate"]),
                                _resolve(base, user["client-key"]))
        self._client = httpx.AsyncClient(base_url=self.server, verify=ssl_ctx,
                                         timeout=httpx.Timeout(30, read=None))

    async def close(self) -> None:
        await self._client.aclose()

    async def request(self, method: str, path: str, *, body: Any = None,
                      content_type: str = "application/json", params: dict | None = None) -> dict:
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body)
        r = await self._client.request(method, path, content=data, headers=headers, params=params,
                                       timeout=30)
        if r.status_code >= 400:
            raise ApiError(r.status_code, r.text)
        return r.json() if r.content else {}

    async def get(self, path: str, params: dict | None = None) -> dict:
        return await self.request("GET", path, params=params)

    async def create(self, path: str, body: dict) -> dict:
        return await self.request("POST", path, body=body)

    async def patch(self, path: str, body: dict, strategic: bool = False) -> dict:
        ct = "application/strategic-merge-patch+json" if strategic else "application/merge-patch+json"
        return await self.request("PATCH", path, body=body, content_type=ct)

    async def put(self, path: str, body: dict) -> dict:
        return await self.request("PUT", path, body=body)

    async def delete(self, path: str, body: dict | None = None) -> dict:
        return await self.request("DELETE", path, body=body)

    async def watch(self, path: str, params: dict) -> AsyncIterator[dict]:
        """Yields watch events until the server closes the stream."""
        q = dict(params, watch="true", allowWatchBookmarks="true", timeoutSeconds="300")
        async with self._client.stream("GET", path, params=q) as r:
            if r.status_code >= 400:
                raise ApiError(r.status_code, (await r.aread()).decode())
            async for line in r.aiter_lines():
                if line.strip():
                    yield json.loads(line)
