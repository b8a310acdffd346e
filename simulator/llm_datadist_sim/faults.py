"""Fault injection for the simulator, from the environment or at run time (the agent's
admin call): refuse or delay links, fail or slow pulls, crash the process."""
from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Callable

from pd_contract.engine_env import PD_SIM_FAULT_

ENV_PREFIX = PD_SIM_FAULT_   # spec.sim.faults, as the operator sets them


@dataclass
class Faults:
    refuse_links: bool = False   # the prompt side stops listening and drops its links
    link_delay_ms: int = 0       # the prompt side answers a link handshake this late
    pull_delay_ms: int = 0       # the prompt side answers a pull this late
    unlink_delay_ms: int = 0     # the prompt side lets go of a decoder that unlinks this late (a busy host)
    pull_fail: bool = False      # the prompt side answers pulls with LLM_FAILED
    refuse_switch: bool = False  # switch_role answers LLM_FEATURE_NOT_ENABLED (an engine that cannot switch)
    # the prompt side serves pulls wrong, the link still says success: "corrupt" (bytes flipped),
    # "truncate" (only the first half of each tensor sent), "swap" (the tensors in the wrong order)
    kv_fault: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Faults":
        seen = os.environ if env is None else env
        f = cls()
        for fd in fields(cls):
            raw = seen.get(ENV_PREFIX + fd.name.upper())
            if raw is not None:
                setattr(f, fd.name, _parse(fd.type, raw))
        return f

    def as_dict(self) -> dict:
        return asdict(self)


KV_FAULTS = ("", "corrupt", "truncate", "swap")


def _parse(typ, raw):
    if typ in (str, "str"):
        if str(raw) not in KV_FAULTS:
            raise ValueError(f"kv_fault must be one of {KV_FAULTS}, got {raw!r}")
        return str(raw)
    if typ in (bool, "bool"):
        return str(raw).lower() in ("1", "true", "yes", "on")
    return int(raw)


_lock = threading.Lock()
_current = Faults.from_env()
_listeners: list[Callable[[Faults], None]] = []


def current() -> Faults:
    return _current


def update(**changes) -> Faults:
    """Change faults at run time; engines are told so they can close or reopen listeners."""
    global _current
    with _lock:
        data = _current.as_dict()
        for k, v in changes.items():
            if k not in data:
                raise ValueError(f"unknown fault {k!r}; known: {sorted(data)}")
            data[k] = _parse(type(data[k]), v) if not isinstance(v, type(data[k])) else v
        _current = Faults(**data)
        listeners = list(_listeners)
    for cb in listeners:
        cb(_current)
    return _current


def subscribe(cb: Callable[[Faults], None]) -> None:
    with _lock:
        _listeners.append(cb)


def unsubscribe(cb: Callable[[Faults], None]) -> None:
    with _lock:
        if cb in _listeners:
            _listeners.remove(cb)


def crash(code: int = 137) -> None:
    os._exit(code)
