"""Load signals (pure data): what the serving engines' last reports say, as the policies read them."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Earlier:
    """What an engine took on in a role it has left, over the last `full_window_s` (either role
    reports it): the demand the fleet saw that its current role's window does not hold."""
    full_window_s: float = 0.0
    prompts: int = 0              # prompts taken on as a prefill, and their tokens
    prompt_tokens: int = 0
    output_tokens: int = 0        # tokens generated as a decoder, and decodes finished
    completed: int = 0


@dataclass(frozen=True)
class PrefillLoad:
    busy: float = 0.0            # fraction of the last 10 s computing
    queue: int = 0               # requests waiting
    queued_tokens: int = 0
    # over the last `window_s` (Goodput): requests and prompt tokens that arrived, prompt tokens
    # computed and the seconds that took
    window_s: float = 0.0
    arrived: int = 0
    arrived_tokens: int = 0
    computed_tokens: int = 0
    busy_s: float = 0.0
    earlier: Earlier = Earlier()


@dataclass(frozen=True)
class DecoderLoad:
    running: int = 0
    waiting: int = 0
    max_batch: int = 1
    kv_used: int = 0
    kv_capacity: int = 0
    # over the last `window_s` (Goodput): tokens generated, decodes finished; now: the running
    # decodes' context tokens; the newest steps as (batch, context tokens, ms)
    window_s: float = 0.0
    output_tokens: int = 0
    completed: int = 0
    context_tokens: int = 0
    steps: tuple[tuple[int, int, float], ...] = ()
    earlier: Earlier = Earlier()


@dataclass(frozen=True)
class Signals:
    prefills: list[PrefillLoad] = field(default_factory=list)
    decoders: list[DecoderLoad] = field(default_factory=list)
    # engines that take no new work now (draining, switching): what their windows saw still is
    # demand (Goodput), under the role they had when it arrived
    idle_prefills: list[PrefillLoad] = field(default_factory=list)
    idle_decoders: list[DecoderLoad] = field(default_factory=list)
    ttft_p90_ms: float | None = None
    tbt_p90_ms: float | None = None
    age_s: float = 0.0           # of the oldest signal used
    source: str = "agents"
