"""Inference timing models for simulated serving (DistServe-style fits).

Prefill batch: T = a*sum(p) + b*sum(p^2) + c ms over prompt lengths p.
Decode step:   T = a*sum(ctx) + b*batch + c ms.
KV transfer:   t = alpha + bytes / bandwidth.
Defaults are the OPT-13B/A100 fits; every coefficient is configurable, and
PD_SIM_TIME_SCALE scales all simulated time (tests run faster than real time)."""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from pd_contract.engine_env import PD_SIM_


@dataclass(frozen=True)
class TimingModel:
    prefill_a: float = 0.0948
    prefill_b: float = 4.03e-6
    prefill_c: float = 18.9
    decode_a: float = 6.1e-4
    decode_b: float = 0.068
    decode_c: float = 19.9
    kv_alpha_ms: float = 0.5
    kv_bandwidth_gbps: float = 25.0   # GB/s, one 200 Gb/s RoCE link
    time_scale: float = 1.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "TimingModel":
        seen = os.environ if env is None else env
        kw = {}
        for name in cls.__dataclass_fields__:
            raw = seen.get(PD_SIM_ + name.upper())
            if raw is not None:
                kw[name] = float(raw)
        return cls(**kw)

    def prefill_ms(self, prompt_lens: list[int]) -> float:
        if not prompt_lens:
            return 0.0
        t = self.prefill_a * sum(prompt_lens) + self.prefill_b * sum(p * p for p in prompt_lens) + self.prefill_c
        return t * self.time_scale

    def decode_step_ms(self, ctx_lens: list[int]) -> float:
        if not ctx_lens:
            return 0.0
        t = self.decode_a * sum(ctx_lens) + self.decode_b * len(ctx_lens) + self.decode_c
        return t * self.time_scale

    def kv_transfer_ms(self, nbytes: int) -> float:
        return (self.kv_alpha_ms + nbytes / (self.kv_bandwidth_gbps * 1e9) * 1000) * self.time_scale
