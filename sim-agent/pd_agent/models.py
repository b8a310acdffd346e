"""JSON bodies of the agent API, shared by the agent and the operator's client."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Role = Literal["prompt", "decoder"]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Peer(_Body):
    """Another engine, as a decoder links it: its cluster id and datadist ip/port."""
    name: str = Field(min_length=1, description="pod name, used to key results")
    cluster_id: int = Field(ge=0, lt=2**64)
    ip: str = Field(min_length=1)
    port: int = Field(ge=1, le=65535)
    agent_url: str | None = Field(default=None, description="the peer's agent, for verify")


class LinkRequest(_Body):
    peers: list[Peer] = Field(min_length=1)
    timeout_ms: int = Field(default=3000, gt=0)


class UnlinkRequest(_Body):
    peers: list[Peer] = Field(min_length=1)
    timeout_ms: int = Field(default=3000, gt=0)
    force: bool = False


class LinkResult(_Body):
    ret: str
    rets: dict[str, str]  # peer name -> LLMStatusCode name
    duration_ms: float = 0


class SwitchRoleRequest(_Body):
    role: Role


class VerifyRequest(_Body):
    peer: Peer


class VerifyResult(_Body):
    ok: bool
    code: str
    message: str = ""
    prefill: str
    decoder: str
    bytes: int = 0
    pull_ms: float = 0


class ProbeRequest(_Body):
    req_id: int = Field(ge=0, lt=2**64)


class ProbeResponse(_Body):
    prompt_cluster_id: int
    req_id: int
    model_id: int
    sha256: str
    bytes: int
    paged: bool = False
    block: int | None = None


class DrainRequest(_Body):
    timeout_s: float = Field(default=30, ge=0)


class DrainResult(_Body):
    draining: bool
    in_flight: int
    pending_kv: int
    drained: bool


class PrefillRequest(_Body):
    req_id: int = Field(ge=0, lt=2**64)
    prompt_tokens: int = Field(gt=0)


class PrefillResponse(_Body):
    prompt_cluster_id: int
    req_id: int
    model_id: int
    queue_ms: float
    prefill_ms: float


class DecodeRequest(_Body):
    req_id: int = Field(ge=0, lt=2**64)
    prompt_cluster_id: int = Field(ge=0, lt=2**64)
    prompt_tokens: int = Field(gt=0)
    output_tokens: int = Field(gt=0)


class DecodeResponse(_Body):
    tokens: int
    pull_ms: float
    first_token_ms: float
    tbt_ms_mean: float
    tbt_ms_max: float
    total_ms: float


class FaultsRequest(_Body):
    refuse_links: bool | None = None
    link_delay_ms: int | None = Field(default=None, ge=0)
    pull_delay_ms: int | None = Field(default=None, ge=0)
    pull_fail: bool | None = None
    crash: bool = False


class LinkState(_Body):
    name: str
    cluster_id: int
    ip: str = ""
    port: int = 0
    code: str  # LLMStatusCode name from check_link_status (LLM_SUCCESS when usable)
    since: float = 0


class Load(_Body):
    queue_depth: int = 0
    running: int = 0
    in_flight: int = 0
    pending_kv: int = 0
    kv_used_bytes: int = 0
    kv_capacity_bytes: int = 0
    completed: int = 0
    failed: int = 0
    ttft_p90_ms: float | None = None
    tbt_p90_ms: float | None = None


class AgentStatus(_Body):
    pod: str
    role: Role
    cluster_id: int
    boot_id: str
    backend: str
    initialized: bool
    ip: str
    port: int
    model_id: int
    links: list[LinkState] = []
    incoming: list[int] = []  # prompt side: decoder cluster ids linked to it
    load: Load = Load()
    draining: bool = False
    proxy_env: dict[str, str] = {}
    memory_scale: int = 1
    cache_desc: dict = {}
    last_error: str = ""
