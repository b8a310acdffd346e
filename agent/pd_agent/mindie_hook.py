"""MindIE role pushes: the pod's MindIE server learns its role from the agent.

With PD_MINDIE_ROLE_URL set (the MindIE server's base URL in the pod, spec.mindie.roleUrl), the
agent POSTs `/v2/role/{prefill|decode}` (pd_contract.mindie.role_body): once the engine is
initialised, after every role switch (an after_switch hook), and again whenever the peers it
would send change (the rank table the operator keeps is re-read every PD_MINDIE_WATCH_S). A
failed push is retried with backoff (0.5 s doubling to 30 s) until the server takes it.

- `local`: this pod's devices, read as pd_agent.devices reads them (the device plugin's
  annotation file PD_DEVICE_ANNOTATION_FILE, under PD_LOCAL_ROOT on the local cluster; else
  hccn.conf or PD_DEVICE_IPS; the simulator without any: the pod IP);
- `peers`: the other role's servers in the rank table the operator mounts
  (PD_MINDIE_RANK_TABLE_FILE, ConfigMap `<name>-rank-table`), this pod left out. No table yet:
  no peers (pushed again once it appears).

One push per pod: a single-rank agent pushes from its core, a multi-rank pod from its front
(rank processes never). On the local cluster's process runtime (no network namespace) a URL on
127.0.0.1 or localhost means this pod's loopback address, PD_LOCAL_POD_IP."""
from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import time
from typing import Any, Awaitable, Callable, Union
from urllib.parse import urlsplit, urlunsplit

import httpx

from pd_contract.engine_env import (
    PD_DEVICE_ANNOTATION_FILE,
    PD_LOCAL_POD_IP,
    PD_MINDIE_RANK_TABLE_FILE,
    PD_MINDIE_ROLE_URL,
    engine_ip,
)
from pd_contract.mindie import OF_ENGINE, OTHER, annotation_devices, devices, role_body, servers
from pd_contract.names import PODINFO_ASCEND, PODINFO_DIR

from .devices import DeviceError, local_path, resolve_env
from .http import wait_event

log = logging.getLogger("pd_agent.mindie")
WATCH_ENV = "PD_MINDIE_WATCH_S"
RETRY_MIN_S = 0.5
RETRY_MAX_S = 30.0
POST_TIMEOUT_S = 10.0
Ready = Callable[[], Union[bool, Awaitable[bool]]]   # the engine is initialised
HOOK_WAIT_S = 5.0       # a switch waits this long at most for its push; later tries run in the background
REPUSH_S = 60.0         # the same role and peers are told again after this (a restarted server forgets)


def role_url(env: dict[str, str]) -> str | None:
    url = (env.get(PD_MINDIE_ROLE_URL) or "").strip().rstrip("/")
    if not url:
        return None
    ip = env.get(PD_LOCAL_POD_IP)
    parts = urlsplit(url)
    if ip and parts.hostname in ("127.0.0.1", "localhost"):
        netloc = ip + (f":{parts.port}" if parts.port else "")
        url = urlunsplit(parts._replace(netloc=netloc))
    return url


def read_table(env: dict[str, str]) -> dict | None:
    path = env.get(PD_MINDIE_RANK_TABLE_FILE)
    if not path:
        return None
    f = local_path(path, env)
    try:
        return json.loads(f.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("MindIE rank table %s does not parse: %s", f, e)
        return None


def local_server(env: dict[str, str], table: dict | None) -> dict:
    """This pod as a rank-table server: its devices from its own device sources; its addresses
    from its entry in the table if there is one, else the environment."""
    pod = env.get("POD_NAME", "")
    mine = next((s for role in ("prefill", "decode") for s in servers(table or {}, role)
                 if s.get("pod_name") == pod), None)
    devs = resolve_env(env)
    if devs.error:
        raise DeviceError(devs.error)
    pairs = [(d.device_id if d.device_id is not None else d.rank, d.ip or "") for d in devs.ranks]
    ann = local_path(env.get(PD_DEVICE_ANNOTATION_FILE) or f"{PODINFO_DIR}/{PODINFO_ASCEND}", env)
    got = annotation_devices(ann.read_text()) if ann.is_file() else None
    pod_ip = engine_ip(env)
    out: dict[str, Any] = {"server_ip": (mine or {}).get("server_ip") or pod_ip, "pod_name": pod,
                           "device": devices(pairs)}
    host = (mine or {}).get("host_ip") or (got[0] if got else "")
    if host:
        out["host_ip"] = host
    if mine is not None and "instance_id" in mine:
        out["instance_id"] = mine["instance_id"]
    return out


def body_for(engine_role: str, env: dict[str, str]) -> tuple[str, dict]:
    """(MindIE role, body) for this pod in `engine_role` (prompt | decoder), read fresh."""
    role = OF_ENGINE[engine_role]
    table = read_table(env)
    me = local_server(env, table)
    peers = [s for s in servers(table or {}, OTHER[role]) if s.get("pod_name") != me["pod_name"]]
    return role, role_body(role, me, peers)


class Pusher:
    """Keeps the MindIE server told: the role the engine is in and the peers it has now."""

    def __init__(self, url: str, env: dict[str, str], engine_role: str, http: httpx.AsyncClient | None = None,
                 watch_s: float | None = None):
        self.url = url
        self.env = env
        self.engine_role = engine_role    # prompt | decoder: what the next push says
        self.http = http or httpx.AsyncClient(trust_env=False, timeout=POST_TIMEOUT_S)
        self.watch_s = watch_s if watch_s is not None else float(env.get(WATCH_ENV) or 5)
        self.acked: tuple[str, dict] | None = None   # the last (role, body) the server took
        self.acked_at = 0.0                          # when (monotonic)
        self.pushes = 0                              # answered 200
        self.failures = 0                            # in a row
        self.last_error = ""
        self.wake = asyncio.Event()
        self.lock = asyncio.Lock()

    async def push(self, why: str) -> bool:
        """One POST of what this pod should say now; True if the server took it (or had it)."""
        async with self.lock:
            try:
                role, body = body_for(self.engine_role, self.env)
            except Exception as e:  # noqa: BLE001 - a file being rewritten, a malformed table: retried, never fatal
                self.last_error = f"MindIE role push ({why}): no body yet: {e!r}"
                log.warning("%s", self.last_error)
                return False
            # the same body again only now and then: a MindIE server that restarted learns its role back
            if self.acked == (role, body) and time.monotonic() - self.acked_at < REPUSH_S:
                return True
            target = f"{self.url}/v2/role/{role}"
            try:
                r = await self.http.post(target, json=body, timeout=POST_TIMEOUT_S)
            except (httpx.HTTPError, httpx.InvalidURL) as e:
                return self._failed(f"POST {target} ({why}): {e!r}")
            if r.status_code != 200:
                return self._failed(f"POST {target} ({why}): {r.status_code} {r.text[:300]}")
            self.acked, self.acked_at, self.failures, self.last_error = (role, body), time.monotonic(), 0, ""
            self.pushes += 1
            log.info("MindIE told role %s (%s): %d peer instance(s)", role, why, len(body["peers"]))
            return True

    def _failed(self, message: str) -> bool:
        self.failures += 1
        self.last_error = message
        log.error("MindIE role push failed (attempt %d): %s; retrying", self.failures, message)
        return False

    async def after_switch(self, old: str, new: str) -> None:
        """AgentCore / Front hook: the engine is in role `new` now (prompt | decoder)."""
        self.engine_role = new
        try:
            ok = await asyncio.wait_for(self.push(f"switched {old} -> {new}"), HOOK_WAIT_S)
        except asyncio.TimeoutError:
            ok = False
            self._failed(f"the push after the switch to {new} took over {HOOK_WAIT_S:.0f}s")
        if not ok:
            self.wake.set()   # the loop retries with backoff

    async def run(self, ready: Ready, stop: asyncio.Event) -> None:
        """Wait for the engine, push its role, then keep it current until `stop`."""
        while not stop.is_set() and not await _ready(ready):
            await wait_event(stop, 0.2)
        delay, why = RETRY_MIN_S, "initial role"
        while not stop.is_set():
            if await self.push(why):
                delay, why = RETRY_MIN_S, "peers changed"
                self.wake.clear()
                await _wait_any(stop, self.wake, self.watch_s)
            else:
                await wait_event(stop, delay)
                delay = min(RETRY_MAX_S, delay * 2)

    async def aclose(self) -> None:
        await self.http.aclose()


async def _ready(ready: Ready) -> bool:
    try:
        got = ready()
        return bool(await got) if inspect.isawaitable(got) else bool(got)
    except Exception as e:  # noqa: BLE001 - a status round that failed: not ready yet
        log.debug("readiness check: %s", e)
        return False


async def _wait_any(a: asyncio.Event, b: asyncio.Event, seconds: float) -> None:
    tasks = [asyncio.create_task(a.wait()), asyncio.create_task(b.wait())]
    try:
        await asyncio.wait(tasks, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()


def attach(hooks: list, engine_role: str, ready: Ready, stop: asyncio.Event,
           env: dict[str, str] | None = None) -> tuple[Pusher, asyncio.Task] | None:
    """With PD_MINDIE_ROLE_URL set: a Pusher registered in `hooks` (an after_switch list) and
    its loop started. `engine_role`: the role the engine starts in; `ready`: the engine is
    initialised."""
    env = dict(os.environ if env is None else env)
    url = role_url(env)
    if url is None:
        return None
    p = Pusher(url, env, engine_role)
    hooks.append(p.after_switch)
    log.info("MindIE role pushes to %s (rank table %s)", url, env.get(PD_MINDIE_RANK_TABLE_FILE) or "none")
    return p, asyncio.create_task(p.run(ready, stop), name="mindie-role")
