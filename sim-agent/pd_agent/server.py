"""The agent's HTTP layer (aiohttp)."""
from __future__ import annotations

import argparse
import os

from aiohttp import web


def build_app() -> web.Application:
    app = web.Application()
    app.router.add_get("/healthz", lambda r: web.json_response({"ok": True}))
    return app


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="pd_agent")
    ap.add_argument("--host", default=os.environ.get("PD_LOCAL_POD_IP", "0.0.0.0"))
    ap.add_argument("--port", type=int, default=int(os.environ.get("PD_AGENT_PORT", "8080")))
    args = ap.parse_args(argv)
    web.run_app(build_app(), host=args.host, port=args.port, print=None)
