"""A stand-in for the MindIE server's role API, for tests: it takes role pushes and remembers them.

    POST /v2/role/{prefill|decode}   the body mindie.role_body makes; 200 {"result": "ok", ...},
                                     or 400 {"error", "field"} naming the first field that is
                                     missing or of the wrong shape (stricter than MindIE: `peers`
                                     is required, it may be empty)
    GET  /v2/role                    the current role, local and peers (role null before any push)
    GET  /pushes                     every push received, in order, refused ones included
    GET  /healthz                    200

Run it beside the agent, as a second container of the engine pod or as a process on a known
port (spec.mindie.roleUrl points the agent at it):

    python -m pd_engine.mindie_standin --port 1026

It binds to PD_LOCAL_POD_IP if set (the local cluster's process runtime: the pod's loopback
address), else 127.0.0.1; `--host` overrides."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import time
from typing import Any

from aiohttp import web

from pd_contract.engine_env import PD_LOCAL_POD_IP
from pd_contract.mindie import ROLES, is_ipv4

log = logging.getLogger("pd_engine.mindie_standin")
DEFAULT_PORT = 1026
STATE = web.AppKey("state", dict)


class BadBody(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def _numeric(v: Any) -> bool:
    return isinstance(v, str) and v.isdigit()


def _list(parent: dict, key: str, where: str, empty_ok: bool = False) -> list:
    if key not in parent or parent[key] is None:
        raise BadBody(f"{where}{key}", "missing")
    v = parent[key]
    if not isinstance(v, list):
        raise BadBody(f"{where}{key}", f"must be a list, not {type(v).__name__}")
    if not v and not empty_ok:
        raise BadBody(f"{where}{key}", "must not be empty")
    return v


def _object(v: Any, where: str) -> dict:
    if not isinstance(v, dict):
        raise BadBody(where, f"must be an object, not {type(v).__name__}")
    return v


def check_node(n: Any, where: str) -> None:
    n = _object(n, where)
    if "server_ip" not in n:
        raise BadBody(f"{where}.server_ip", "missing")
    if not is_ipv4(n["server_ip"]):
        raise BadBody(f"{where}.server_ip", f"must be an IPv4 address, not {n['server_ip']!r}")
    if "host_ip" in n and not is_ipv4(n["host_ip"]):
        raise BadBody(f"{where}.host_ip", f"must be an IPv4 address, not {n['host_ip']!r}")
    for i, dp in enumerate(_list(n, "dp_inst_list", f"{where}.")):
        w = f"{where}.dp_inst_list[{i}]"
        dp = _object(dp, w)
        if "dp_inst_id" not in dp:
            raise BadBody(f"{w}.dp_inst_id", "missing")
        if not isinstance(dp["dp_inst_id"], int) or isinstance(dp["dp_inst_id"], bool) or dp["dp_inst_id"] < 0:
            raise BadBody(f"{w}.dp_inst_id", f"must be an unsigned integer, not {dp['dp_inst_id']!r}")
        for j, d in enumerate(_list(dp, "device", f"{w}.")):
            wd = f"{w}.device[{j}]"
            d = _object(d, wd)
            for key in ("device_id", "device_ip", "device_logical_id", "rank_id"):
                if key not in d:
                    raise BadBody(f"{wd}.{key}", "missing")
            for key in ("device_id", "device_logical_id", "rank_id"):
                if not _numeric(d[key]):
                    raise BadBody(f"{wd}.{key}", f"must be a string of digits, not {d[key]!r}")
            if not is_ipv4(d["device_ip"]):
                raise BadBody(f"{wd}.device_ip", f"must be an IPv4 address, not {d['device_ip']!r}")


def check_body(body: Any) -> None:
    """Raises BadBody naming the first field that is missing or malformed."""
    body = _object(body, "(body)")
    for i, n in enumerate(_list(body, "local", "")):
        check_node(n, f"local[{i}]")
    for i, peer in enumerate(_list(body, "peers", "", empty_ok=True)):
        if not isinstance(peer, list) or not peer:
            raise BadBody(f"peers[{i}]", "must be a non-empty list of nodes (one peer instance)")
        for j, n in enumerate(peer):
            check_node(n, f"peers[{i}][{j}]")


def build_app() -> web.Application:
    app = web.Application()
    app[STATE] = {"role": None, "local": None, "peers": None, "pushes": []}

    async def post_role(request: web.Request) -> web.Response:
        st = request.app[STATE]
        role = request.match_info["role"]
        raw = await request.read()
        rec: dict = {"seq": len(st["pushes"]) + 1, "role": role, "at": time.time()}
        st["pushes"].append(rec)
        try:
            if role not in ROLES:
                raise BadBody("(path)", f"role must be {' or '.join(ROLES)}, not {role!r}")
            try:
                body = json.loads(raw)
            except ValueError as e:
                raise BadBody("(body)", f"not JSON: {e}") from None
            rec["body"] = body
            check_body(body)
        except BadBody as e:
            rec.update(status=400, error=str(e), field=e.field)
            log.warning("push %d refused: %s", rec["seq"], e)
            return web.json_response({"error": str(e), "field": e.field}, status=400)
        rec["status"] = 200
        st.update(role=role, local=body["local"], peers=body["peers"])
        log.info("push %d: role %s, %d peer instance(s)", rec["seq"], role, len(body["peers"]))
        return web.json_response({"result": "ok", "role": role, "seq": rec["seq"]})

    async def get_role(request: web.Request) -> web.Response:
        st = request.app[STATE]
        return web.json_response({k: st[k] for k in ("role", "local", "peers")})

    async def pushes(request: web.Request) -> web.Response:
        return web.json_response(request.app[STATE]["pushes"])

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app.add_routes([web.post("/v2/role/{role}", post_role), web.get("/v2/role", get_role),
                    web.get("/pushes", pushes), web.get("/healthz", healthz)])
    return app


async def serve(host: str, port: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    runner = web.AppRunner(build_app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    log.info("MindIE role API stand-in on %s:%d", host, port)
    await stop.wait()
    await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="pd_engine.mindie_standin", description="A stand-in for MindIE's role API")
    ap.add_argument("--host", default=os.environ.get(PD_LOCAL_POD_IP) or "127.0.0.1")
    ap.add_argument("--port", type=int, default=DEFAULT_PORT)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
