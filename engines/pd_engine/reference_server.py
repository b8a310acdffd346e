"""`python -m pd_engine.reference_server`: the reference engine packaged as an ordinary inference
server, the way a real one plugs in. It knows pd-operator only through the engine adapter interface:
one process per tensor-parallel rank, each running `serve_rank(ReferenceAdapter(...))`.

It is what runs in the `engine` container of a PDDeployment with `spec.engine` (image
pd-reference-engine): the operator's agent runs beside it in the pod and waits for the ranks to
register (PD_RANKS_EXTERNAL), then links, verifies and switches them as it does its own.

    python -m pd_engine.reference_server [--tensor-parallel N]

The ranks' identities come from the env the operator injects in the container (`rank_env_for`).
The server exits when a rank dies (the kubelet restarts the container) and passes SIGTERM on to
its ranks, which drain before they exit."""
from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import signal
import sys
import time

from pd_contract.engine_env import PD_TENSOR_PARALLEL

log = logging.getLogger("pd_engine.reference_server")


def run_rank(rank: int, tensor_parallel: int) -> None:
    """One rank process: its identity, the reference model over it, and serve_rank."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from pd_agent.identity import Identity

    from .rank import rank_env_for, serve_rank
    from .reference import ReferenceAdapter

    env = rank_env_for(os.environ, rank, tensor_parallel)
    serve_rank(ReferenceAdapter(Identity.from_env(env)), identity_env=env)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pd_engine.reference_server", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensor-parallel", type=int, default=int(os.environ.get(PD_TENSOR_PARALLEL) or 1),
                    help="rank processes to start (default PD_TENSOR_PARALLEL, else 1)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tp = args.tensor_parallel
    if tp < 1:
        ap.error("--tensor-parallel must be at least 1")
    ctx = mp.get_context("spawn")     # a fresh interpreter per rank: one LLM-DataDist engine per process
    procs = [ctx.Process(target=run_rank, args=(r, tp), name=f"rank-{r}") for r in range(tp)]
    for p in procs:
        p.start()
    log.info("started %d rank process(es): %s", tp, ", ".join(str(p.pid) for p in procs))
    stopping = False

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for p in procs:
            if p.is_alive() and p.pid:
                os.kill(p.pid, signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while True:
        dead = [p for p in procs if not p.is_alive()]
        if stopping and len(dead) == len(procs):
            return 0
        if dead and not stopping:
            # one rank gone: the engine is broken; the rest stop and the container restarts whole
            log.error("%s exited with %s: stopping the other ranks", dead[0].name, dead[0].exitcode)
            stop(signal.SIGTERM, None)
            for p in procs:
                p.join(30)
            return 1
        time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
