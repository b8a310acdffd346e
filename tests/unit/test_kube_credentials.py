"""The operator's client reads its credentials again when the API server answers 401 (a
rotated ServiceAccount token, a replaced token file), once for all calls that saw it."""
from __future__ import annotations

import asyncio

import httpx

from pd_operator import kube as kube_mod


def test_a_401_reads_the_credentials_again_and_retries_once(monkeypatch):
    tokens = iter(["new-token", "newer-token"])
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("Authorization", ""))
        if request.headers.get("Authorization") == "Bearer old-token":
            return httpx.Response(401, json={"message": "Unauthorized"})
        return httpx.Response(200, json={"items": []})

    def client(token: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url="https://api", headers={"Authorization": f"Bearer {token}"},
                                 transport=httpx.MockTransport(handler))
    monkeypatch.setattr(kube_mod, "_configuration", lambda: next(tokens))
    monkeypatch.setattr(kube_mod.Kube, "_client", staticmethod(client))

    async def run():
        k = kube_mod.Kube.__new__(kube_mod.Kube)
        k._fixed, k._http, k._reloading, k._retired, k.reloads = False, client("old-token"), asyncio.Lock(), [], 0
        # three calls at once see the old token fail: one reload serves them all
        out = await asyncio.gather(*(k.list("v1", "Pod", "ns") for _ in range(3)))
        await k.close()
        return out, k.reloads
    out, reloads = asyncio.run(run())
    assert out == [[], [], []] and reloads == 1
    assert seen.count("Bearer old-token") == 3 and seen.count("Bearer new-token") == 3
