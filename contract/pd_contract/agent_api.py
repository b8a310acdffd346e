"""The agent API (HTTP on port 8080 under /v1/): its paths and JSON bodies, shared by the agent,
the operator's client, kubectl pdd, the routers and pd_engine's rank processes."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

Role = Literal["prompt", "decoder"]


class AgentPath:
    """The agent API's paths: pd_agent's routes.py serves them; the operator, the pod's agent,
    the rank processes, pd_engine and the routers call them."""
    HEALTHZ = "/healthz"       # readiness: the engine is initialised
    LIVEZ = "/livez"           # liveness: the process answers
    METRICS = "/metrics"
    API = "/v1/"               # the token-checked API; the paths above are open
    STATUS = "/v1/status"
    RANKS = "/v1/ranks"        # a rank process registers with its pod's agent
    INIT = "/v1/init"
    LINK = "/v1/link"
    UNLINK = "/v1/unlink"
    SWITCH_ROLE = "/v1/switch_role"
    VERIFY = "/v1/verify"
    PROBE = "/v1/probe"
    DRAIN = "/v1/drain"
    UNDRAIN = "/v1/undrain"
    NOTIFY = "/v1/notify"
    FAULTS = "/v1/admin/faults"
    PREFILL = "/v1/prefill"
    DECODE = "/v1/decode"
    PULL = "/v1/pull"
    KV = "/v1/kv/{req_id}"     # a multi-rank decoder's rank: the shard it pulled, once
    RANK_PROXY = "/r/{rank}/{tail:.*}"   # the pod's agent: that rank's own API
    GANG = "/v1/gang"          # an instance's leading pod: the pods holding the rest of its ranks

    @staticmethod
    def kv(req_id: int) -> str:
        return AgentPath.KV.format(req_id=req_id)

    @staticmethod
    def rank_prefix(rank: int) -> str:
        """The prefix under which the pod's agent relays to rank `rank`'s own API."""
        return f"/r/{rank}"


class _Body(BaseModel):
    """A request body: strict, so a typo is a 400 naming the field."""
    model_config = ConfigDict(extra="forbid")


class _Reply(BaseModel):
    """A response body: forward-compatible, so a newer agent's extra fields are ignored."""
    model_config = ConfigDict(extra="ignore")


class RankEndpoint(_Body):
    """One tensor-parallel rank's engine: its own cluster id, device IP and datadist port."""
    rank: int = Field(ge=0, lt=512)
    cluster_id: int = Field(ge=0, lt=2**64)
    ip: str = Field(min_length=1)
    port: int = Field(ge=1, le=65535)


class Peer(_Body):
    """Another engine, as a decoder links it: its cluster id and datadist ip/port. A pod of
    several tensor-parallel ranks lists them in `ranks` (cluster_id/ip/port are rank 0's): the
    decoder's rank r links the peer's rank r."""
    name: str = Field(min_length=1, description="pod name, used to key results")
    cluster_id: int = Field(ge=0, lt=2**64)
    ip: str = Field(min_length=1)
    port: int = Field(ge=1, le=65535)
    agent_url: str | None = Field(default=None, description="the peer's agent: verify, and pull notices")
    boot_id: str | None = Field(default=None, description="the peer agent's boot id when the link was made")
    ranks: list[RankEndpoint] | None = Field(default=None, description="a multi-rank pod's ranks, in rank order")


class LinkRequest(_Body):
    peers: list[Peer] = Field(min_length=1)
    timeout_ms: int = Field(default=3000, gt=0)


class UnlinkRequest(_Body):
    peers: list[Peer] = Field(min_length=1)
    timeout_ms: int = Field(default=3000, gt=0)
    force: bool = False


class LinkResult(_Reply):
    ret: str
    rets: dict[str, str]  # peer name -> LLMStatusCode name (a multi-rank pod: the first rank's that failed)
    duration_ms: float = 0
    rank_rets: dict[str, list[str]] | None = None  # peer name -> code per rank (multi-rank pods)


class SwitchRoleRequest(_Body):
    role: Role


class VerifyRequest(_Body):
    peer: Peer
    ranks: list[int] | None = Field(default=None, description="multi-rank pods: the rank pairs to probe (all if unset)")


class RankVerify(_Reply):
    rank: int
    peer_rank: int | None = None   # the prefill rank it pulled from (rank_map)
    ok: bool
    code: str
    message: str = ""
    bytes: int = 0
    pull_ms: float = 0


class VerifyResult(_Reply):
    ok: bool
    code: str
    message: str = ""
    prefill: str
    decoder: str
    bytes: int = 0
    pull_ms: float = 0
    ranks: list[RankVerify] | None = None   # multi-rank pods: each rank pair probed (rank r <- rank r)


class ProbeRequest(_Body):
    req_id: int = Field(ge=0, lt=2**64)
    content: bool = Field(default=False, description="the reference engine: prefill the fixed probe prompt (real "
                          "KV) instead of random bytes, so the decoder can check what it pulls against the model")


class ProbeResponse(_Reply):
    prompt_cluster_id: int
    req_id: int
    model_id: int
    sha256: str
    bytes: int
    paged: bool = False
    block: int | None = None
    content: bool = False      # the reference engine's probe prompt (real KV), not random bytes
    seq: int | None = None     # content probes: the probe prompt's length


class DrainRequest(_Body):
    timeout_s: float = Field(default=30, ge=0)


class DrainResult(_Reply):
    draining: bool
    in_flight: int
    pending_kv: int
    drained: bool


MAX_PROMPT_IDS = 1 << 20
TokenId = Annotated[int, Field(ge=0, lt=2**32)]


class Sampling(_Body):
    """How the next token is chosen. temperature 0 is greedy; otherwise the token at output
    position i is drawn with a generator seeded by (seed, i), so the prefill (which samples the
    first token) and the decoder (the rest) draw the same way a single engine would."""
    temperature: float = Field(default=0.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int = Field(default=0, ge=0, lt=2**63)


class PrefillRequest(_Body):
    req_id: int = Field(ge=0, lt=2**64)
    prompt_tokens: int = Field(gt=0)
    token_ids: list[TokenId] | None = Field(default=None, max_length=MAX_PROMPT_IDS,
                                            description="the prompt, tokenized (len == prompt_tokens); without "
                                            "it an engine that computes (the reference engine) prefills "
                                            "prompt_tokens copies of token 0")
    sampling: Sampling | None = None
    admitted: bool = Field(default=False, description="set by a multi-rank pod's agent for its ranks: the "
                           "instance took the request on, so a rank finishes its part even while draining")


class PrefillResponse(_Reply):
    prompt_cluster_id: int
    req_id: int
    model_id: int
    queue_ms: float
    prefill_ms: float
    first_token: int | None = None   # an engine that computes: the token the prompt's last position chose


class DecodeRequest(_Body):
    req_id: int = Field(ge=0, lt=2**64)
    prompt_cluster_id: int = Field(ge=0, lt=2**64)
    prompt_agent_url: str | None = Field(default=None, description="where to report the pull, if the "
                                         "decoder does not know the prefill's agent from its link")
    prompt_tokens: int = Field(gt=0)
    output_tokens: int = Field(gt=0)
    first_token: TokenId | None = Field(default=None, description="the prefill's first token (PrefillResponse): "
                                        "the decoder emits it first and continues from it")
    sampling: Sampling | None = None
    stream: bool = Field(default=False, description="NDJSON, a line per token as it is produced")
    prefill_ms: float | None = Field(default=None, ge=0, description="the prefill's queue and compute time, "
                                     "so the decoder records the request's whole TTFT")
    kv_pulled_ms: float | None = Field(default=None, ge=0, description="set by a multi-rank pod's agent: every "
                                       "rank already pulled its shard (this long); do not pull again")
    admitted: bool = Field(default=False, description="set by a multi-rank pod's agent for its ranks: the "
                           "instance took the request on, so a rank finishes its part even while draining")


class PullRequest(_Body):
    """A multi-rank decoder pod's agent -> each rank: pull this request's KV shard (before the
    decode, so the first token waits for the slowest rank's pull)."""
    req_id: int = Field(ge=0, lt=2**64)
    prompt_cluster_id: int = Field(ge=0, lt=2**64, description="the prefill rank this rank pulls from")
    prompt_agent_url: str | None = None
    prompt_tokens: int = Field(gt=0)
    admitted: bool = Field(default=False, description="set by a multi-rank pod's agent for its ranks: the "
                           "instance took the request on, so a rank finishes its part even while draining")


class PullResponse(_Reply):
    pull_ms: float


class DecodeResponse(_Reply):
    tokens: int
    token_ids: list[int] | None = None   # an engine that computes: the output, in order
    pull_ms: float
    first_token_ms: float
    tbt_ms_mean: float
    tbt_ms_max: float
    total_ms: float


class NotifyRequest(_Body):
    """Decoder agent -> prefill agent: what the v1 API does not tell the prompt side."""
    decoder_cluster_id: int = Field(ge=0, lt=2**64)
    pulled: list[int] = Field(default_factory=list, description="req_ids whose KV cache was pulled")
    linked: bool | None = Field(default=None, description="True: linked to you; False: unlinked you")
    released: list[int] = Field(default_factory=list, description="req_ids whose cache no decoder rank will "
                                "pull from you (a decoder of smaller TP reads another rank's copy): free them")
    ranks: list[int] | None = Field(default=None, max_length=512, description=(
        "to a pod's (or an instance's leading) agent: the ranks whose copies of `released` to free, one notice "
        "for them all"))


class FaultsRequest(_Body):
    refuse_links: bool | None = None
    link_delay_ms: int | None = Field(default=None, ge=0)
    pull_delay_ms: int | None = Field(default=None, ge=0)
    pull_fail: bool | None = None
    refuse_switch: bool | None = Field(default=None, description="switch_role is refused (LLM_FEATURE_NOT_ENABLED)")
    switch_crash_after_ranks: int | None = Field(default=None, ge=0, description="a multi-rank pod's agent: switch "
                                                 "ranks one by one and crash after this many switched")
    kv_fault: Literal["", "corrupt", "truncate", "swap"] | None = Field(
        default=None, description="the prompt side serves pulls wrong: corrupt (bytes flipped), truncate (the "
        "second half never sent), swap (the tensors in the wrong order); \"\" clears it")
    # the simulated network of the pod's devices, as the network preflight reads it (hccn_tool)
    preflight_link_down: list[int] | None = Field(default=None, max_length=64,
                                                  description="these ranks' devices report link DOWN; [] clears")
    preflight_tls_switch: int | None = Field(default=None, ge=0, le=1,
                                             description="the pod's devices report this TLS switch (default 0)")
    preflight_no_gateway: bool | None = Field(default=None, description="the pod's devices report no gateway")
    crash: bool = False


class RankLinkState(_Reply):
    rank: int
    cluster_id: int
    ip: str = ""
    port: int = 0
    code: str
    healthy: bool = True


class LinkState(_Reply):
    """A link to a peer pod. Multi-rank pods: one per peer pod, with its rank links in `ranks`;
    code/healthy are the worst rank's, cluster_id/ip/port the peer's rank 0."""
    name: str
    cluster_id: int
    ip: str = ""
    port: int = 0
    code: str  # the last LLMStatusCode the engine gave for this link (check_link_status or a pull)
    since: float = 0
    healthy: bool = True       # False only when the engine said the link is broken
    peer_boot_id: str | None = None
    ranks: list[RankLinkState] | None = None


class StepSample(_Reply):
    """One decode step: how many requests it advanced, the context tokens they held, its time."""
    batch: int
    context_tokens: int
    ms: float


class Load(_Reply):
    queue_depth: int = 0
    queued_prompt_tokens: int = 0
    running: int = 0
    decode_queue: int = 0            # decodes waiting for a batch slot
    max_batch: int = 0
    prefill_busy: float = 0.0        # fraction of the last 10 s the prefill loop was computing
    in_flight: int = 0
    pending_kv: int = 0
    kv_used_bytes: int = 0
    kv_capacity_bytes: int = 0
    completed: int = 0
    failed: int = 0
    ttft_p90_ms: float | None = None
    tbt_p90_ms: float | None = None
    # what the Goodput policy measures demand and capacity from: counts over the last `window_s`
    window_s: float = 0.0
    requests_arrived: int = 0        # requests this engine took on (prefill: prompts; decoder: decodes)
    prompt_tokens_arrived: int = 0   # prefill: their prompt tokens
    prefill_tokens: int = 0          # prefill: prompt tokens computed
    prefill_busy_s: float = 0.0      # prefill: seconds spent computing them
    output_tokens: int = 0           # decoder: tokens generated
    decodes_completed: int = 0       # decoder: decodes finished
    context_tokens: int = 0          # decoder: context tokens the running decodes hold now
    steps: list[StepSample] = []     # decoder: recent decode steps (the newest, at most 32)
    # over the last `full_window_s` (the whole window, or as long as the engine has run), what it
    # took on in a role it has since left (the window above starts at the switch): prompts as a
    # prefill, and as a decoder tokens and decodes done
    full_window_s: float = 0.0
    earlier_prompts_arrived: int = 0
    earlier_prompt_tokens_arrived: int = 0
    earlier_output_tokens: int = 0
    earlier_decodes_completed: int = 0


class RankInfo(_Reply):
    """One tensor-parallel rank of a pod: its engine's identity and where it listens."""
    rank: int
    cluster_id: int
    device_id: int | None = None     # the physical NPU (the annotation's or hccn.conf's device id)
    ip: str = ""                     # its device IP (or the pod IP, on the simulator without one)
    port: int = 0
    initialized: bool = False
    registered: bool = False         # the rank process registered with the pod's agent
    last_error: str = ""


class RegisterRank(_Body):
    """A rank process -> the pod's agent: where its own agent API listens."""
    rank: int = Field(ge=0, lt=512)
    url: str = Field(min_length=1)
    boot_id: str = Field(min_length=1)


class GangMember(_Body):
    """A pod of an instance that holds some of its ranks: where its agent answers."""
    pod: str = Field(min_length=1, max_length=253)
    agent_url: str = Field(min_length=1, max_length=1024)
    first_rank: int = Field(ge=0, lt=512)


class GangRequest(_Body):
    """The operator -> an instance's leading pod: its other pods. The leading pod's agent takes
    their ranks on as its own (each listed at the pod's GET /v1/ranks), so it fronts the whole
    instance: links, verification, drain and switch_role reach every rank of every pod."""
    members: list[GangMember] = Field(default=[], max_length=64)


class GangState(_Reply):
    """A pod's place in an instance of several pods or data-parallel groups."""
    index: int = 0          # 0: it leads (its agent fronts every rank); others hold ranks only
    pods: int = 1
    tp: int = 1             # a tensor-parallel group's ranks
    dp: int = 1
    members: dict[str, str] = {}   # leading pod: the other pods and their agents, as told
    missing: list[int] = []        # leading pod: instance ranks not registered (yet)


MAX_STATUS_LINKS = 16384


class DeviceCheck(_Reply):
    """One failed network preflight check of one device (pd_contract.preflight names them)."""
    device_id: int
    check: str = Field(max_length=32)                 # link | net_health | netdetect | gateway | ip | tls
    value: str = Field(default="", max_length=256)    # what the device reported
    message: str = Field(default="", max_length=512)


class PreflightReport(_Reply):
    """The network preflight of the pod's devices: `hccn_tool` on Ascend, the simulator's stand-in
    on loopback devices. A pod whose preflight failed does not start its engines (until it passes)
    and is not linked while it fails."""
    state: Literal["pending", "passed", "failed"] = "pending"
    enforced: bool = True         # false: checks are reported, nothing waits on them
    source: str = Field(default="", max_length=32)        # hccn_tool | sim
    devices: int = 0
    tls_switch: str = Field(default="", max_length=8)     # the devices' TLS switch (0 | 1), "" unknown or differ
    superpod: str = Field(default="", max_length=64)      # the node's A3 superpod (device plugin annotation)
    failures: list[DeviceCheck] = Field(default=[], max_length=256)
    checked_at: float = 0.0       # unix seconds


class AgentStatus(_Reply):
    pod: str
    role: Role
    cluster_id: int
    boot_id: str
    backend: str
    initialized: bool
    ip: str
    port: int
    model_id: int
    # bounded (what an answer may hold, whatever code answers): a rank engine links at most 512
    # peers, a pod holds at most 256 ranks' links
    links: list[LinkState] = Field(default=[], max_length=MAX_STATUS_LINKS)
    incoming: list[int] = Field(default=[], max_length=MAX_STATUS_LINKS)  # prompt side: decoder cluster ids linked
    load: Load = Load()
    draining: bool = False
    terminating: bool = False     # SIGTERM received: draining, then exiting
    switchable: bool = True       # the engine was initialised with llm.EnableSwitchRole
    proxy_env: dict[str, str] = {}
    memory_scale: int = 1
    cache_desc: dict = {}
    engine: str = "timing"           # what serves requests: "timing" (the timing model) or "reference"
    last_error: str = ""
    tensor_parallel: int = 1
    ranks: list[RankInfo] = Field(default=[], max_length=512)   # multi-rank pods: every rank, registered or not
    device_ips: str = ""             # where the device IPs came from: annotation, hccn.conf, list, pod-ip
    device_error: str = ""           # DeviceIPUnknown: which rank has no device IP, and why
    preflight: PreflightReport | None = None   # the network preflight (pods the operator runs)
    gang: GangState | None = None   # an instance of several pods or data-parallel groups
