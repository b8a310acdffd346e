"""A stop for crash tests, outside the pass: with PD_OPERATOR_FAULT_POINT=<direction>:<step>
(e.g. `decoder-to-prefill:Unlink`) the operator exits with code 17 right after it recorded a
status in which a switch of that direction has reached that step. "Reached" includes a step
the switch went through within one pass (a step already done when it began, such as Unlink
for a prefill whose decoders let go of it while it drained): the status then shows a later
step and the named one in stepsMs. With PD_OPERATOR_FAULT_SIGNAL=KILL the process is killed
with SIGKILL instead, as a node failure would. Unset, nothing happens."""
from __future__ import annotations

import logging
import os
import signal
from typing import Callable

from .switch import Switch

ENV = "PD_OPERATOR_FAULT_POINT"
EXIT_CODE = 17
log = logging.getLogger("pd_operator.faultpoint")


def reached(point: str, switches: list[Switch]) -> bool:
    direction, _, step = point.partition(":")
    return any(s.direction == direction and (s.step == step or step in dict(s.durations)) for s in switches)


def from_env() -> Callable[[list[Switch]], None] | None:
    point = os.environ.get(ENV)
    if not point:
        return None

    def check(switches: list[Switch]) -> None:
        if reached(point, switches):
            log.error("%s reached and recorded: exiting as told", point)
            logging.shutdown()
            if os.environ.get("PD_OPERATOR_FAULT_SIGNAL") == "KILL":
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(EXIT_CODE)
    return check
