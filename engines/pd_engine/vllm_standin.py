"""`python -m pd_engine.vllm_standin`: a stand-in for `vllm serve` that serves vLLM's OpenAI API and
drives a KV connector the way vLLM's V1 engine does, computing with the reference model, so
pd-operator's vLLM path runs where vLLM cannot (no NPU, no vllm package). The engine is
pd_engine.vllm_standin_engine (its docstring tells how requests flow), the HTTP API
pd_engine.vllm_standin_http. Arguments as vLLM's: `--port`, `--tensor-parallel-size` (1),
`--served-model-name`, `--kv-transfer-config` (what the operator adds); and `--reference-model`."""
from __future__ import annotations

import argparse
import json
import logging
import os
import time

from pd_contract.engine_env import PD_LOCAL_POD_IP, PD_MODEL_NAME, PD_REFERENCE_MODEL, PD_SIM_ENGINE_START_S

from .vllm_standin_engine import REGISTERED, Choice, Generation, NoRoom, StandIn, load_connector
from .vllm_standin_http import app

__all__ = ["REGISTERED", "Choice", "Generation", "NoRoom", "StandIn", "app", "load_connector", "main"]
log = logging.getLogger("pd_engine.vllm_standin")


def main(argv: list[str] | None = None) -> None:
    from aiohttp import web
    ap = argparse.ArgumentParser(prog="pd_engine.vllm_standin", description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--kv-transfer-config", required=True, help="vLLM's KVTransferConfig as JSON")
    ap.add_argument("--reference-model", default=None,
                    help="the reference model's profile as JSON (default: PD_REFERENCE_MODEL, else from the CacheDesc)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)   # a health check a second
    cfg = json.loads(args.kv_transfer_config)
    env = dict(os.environ)
    load_s = float(env.get(PD_SIM_ENGINE_START_S) or 0)   # spec.sim.engineStartSeconds: as a server loads weights
    if load_s:
        log.info("loading for %.1fs", load_s)
        time.sleep(load_s)
    if args.reference_model:
        env[PD_REFERENCE_MODEL] = args.reference_model
    standin = StandIn(load_connector(cfg), cfg, args.tensor_parallel_size, env)
    host = os.environ.get(PD_LOCAL_POD_IP) or "0.0.0.0"
    name = args.served_model_name or os.environ.get(PD_MODEL_NAME) or "reference"
    log.info("connector %s loaded from %s; serving %s on %s:%d", cfg["kv_connector"],
             cfg.get("kv_connector_module_path") or "its registration", name, host, args.port)
    try:
        web.run_app(app(standin, name), host=host, port=args.port, print=None)
    finally:
        standin.worker.shutdown()


if __name__ == "__main__":
    main()
