"""`python -m pd_operator`: run the operator (Kopf underneath).

Watches every namespace by default; PD_OPERATOR_NAMESPACES=ns1,ns2 limits it."""
from __future__ import annotations

import asyncio
import logging
import os

import kopf

from . import faultpoint, handlers  # noqa: F401  (handlers: registers them)


def main() -> None:
    logging.basicConfig(level=os.environ.get("PD_OPERATOR_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # Kopf logs every successful event handler; the controller logs what it does instead.
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    if os.environ.get("PD_OPERATOR_TRACE"):  # one line per reconcile pass
        logging.getLogger("pd_operator.reconcile").setLevel(logging.DEBUG)
    namespaces = [n for n in os.environ.get("PD_OPERATOR_NAMESPACES", "").split(",") if n]
    liveness = os.environ.get("PD_OPERATOR_LIVENESS", "")
    # read once here, never in the pass: crash tests stop the operator after a recorded step
    memo = kopf.Memo(after_record=faultpoint.from_env())
    asyncio.run(kopf.operator(
        clusterwide=not namespaces, namespaces=namespaces, standalone=True,
        liveness_endpoint=liveness or None, memo=memo,
    ))


if __name__ == "__main__":
    main()
