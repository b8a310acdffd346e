"""The agent's identity and settings, read from the env the operator injects."""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pd_contract import engine_env as ev
from pd_contract.agent_api import Role
from pd_contract.engine_env import EngineIdentity
from pd_contract.names import AGENT_PORT

PROXY_VARS = ("http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY")
DEFAULT_CACHE_DESC = {"num_tensors": 4, "shape": [4, 256, 1, 64], "data_type": "DT_FLOAT16"}


class ConfigError(ValueError):
    pass


@dataclass
class Identity:
    pod: str
    role: Role
    cluster_id: int
    ip: str
    port: int
    backend: str = "sim"         # "sim" | "llm-datadist"
    model_id: int = 0
    model_name: str = ""             # the served model id (PD_MODEL_NAME): the model-server metrics' label
    cache_desc: dict = field(default_factory=lambda: dict(DEFAULT_CACHE_DESC))
    link_timeout_ms: int = 3000
    sync_kv_timeout_ms: int = 1000
    device_id: int | None = None
    token: str | None = None             # control scope: the operator's
    data_token: str | None = None        # data scope: routers (status, prefill, decode)
    peer_token: str | None = None        # peer scope: other agents' pull notices (POST /v1/notify only)
    agent_port: int = AGENT_PORT
    # /metrics alone on a port of its own (the operator sets AGENT_METRICS_PORT); None: only on agent_port
    metrics_port: int | None = None
    drain_timeout_s: float = 60.0    # SIGTERM: how long to wait for in-flight work and pending KV
    engine_start_s: float = 0.0      # simulator: delay before the engine initialises
    switchable: bool = True          # init with llm.EnableSwitchRole (the operator sets it when rebalancing)
    max_prefill_queue: int = 1024    # prefills waiting beyond this are refused (OVERLOADED, 503), not queued
    idle_timeout_s: float = 75.0     # an HTTP connection with no request in progress is closed after this
    engine: str = "timing"           # what serves requests: "timing" (the timing model) or "reference"
    reference_model: dict | None = None   # the reference engine's profile (llm_datadist_sim.refmodel.Profile.from_json)
    rank: int = 0                    # this process's tensor-parallel rank, of `tensor_parallel`
    tensor_parallel: int = 1

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Identity":
        env_is_process = env is None
        env = dict(os.environ if env is None else env)

        def need(name: str) -> str:
            v = env.get(name)
            if not v:
                raise ConfigError(f"{name} is not set")
            return v

        try:
            eid = EngineIdentity.from_env(env)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        if not env.get(ev.LLM_DATADIST_CLUSTER_ID) and env_is_process:
            # computed from the group's base and the pod index: exported, so an inference server in
            # this process sees LLM_DATADIST_CLUSTER_ID too
            os.environ[ev.LLM_DATADIST_CLUSTER_ID] = str(eid.cluster_id)
        desc = dict(DEFAULT_CACHE_DESC)
        if env.get(ev.LLM_DATADIST_CACHE_DESC):
            try:
                desc = json.loads(env[ev.LLM_DATADIST_CACHE_DESC])
            except ValueError as e:
                raise ConfigError(f"{ev.LLM_DATADIST_CACHE_DESC} is not JSON: {e}") from e
        token = _secret(env, ev.PD_AGENT_TOKEN)
        for name in ev.TOKEN_ENV.values():
            _check_digest(env, name)
        engine = (env.get(ev.PD_SIM_ENGINE) or "timing").lower()
        if engine not in ("timing", "reference"):
            raise ConfigError(f"{ev.PD_SIM_ENGINE} must be timing or reference, got {engine!r}")
        reference_model = None
        if engine == "reference":
            try:
                reference_model = json.loads(need(ev.PD_REFERENCE_MODEL))
            except ValueError as e:
                raise ConfigError(f"{ev.PD_REFERENCE_MODEL} is not JSON: {e}") from e
        return cls(
            pod=env.get(ev.POD_NAME) or env.get("HOSTNAME") or f"agent-{eid.cluster_id}",
            role=eid.role, cluster_id=eid.cluster_id, ip=eid.ip, port=eid.port,
            backend=env.get(ev.PD_BACKEND, "sim"),
            model_name=env.get(ev.PD_MODEL_NAME, ""),
            model_id=eid.model_id,
            cache_desc=desc,
            link_timeout_ms=int(env.get(ev.LLM_DATADIST_LINK_TIMEOUT_MS, "3000")),
            sync_kv_timeout_ms=int(env.get(ev.LLM_DATADIST_SYNC_KV_TIMEOUT_MS, "1000")),
            device_id=eid.device_id,
            token=token,
            data_token=env.get(ev.PD_AGENT_DATA_TOKEN) or None,
            peer_token=_secret(env, ev.PD_AGENT_PEER_TOKEN),
            agent_port=int(env.get(ev.PD_AGENT_PORT, str(AGENT_PORT))),
            metrics_port=_metrics_port(env),
            drain_timeout_s=_float(env, ev.PD_DRAIN_TIMEOUT_S, 60.0),
            engine_start_s=_float(env, ev.PD_SIM_ENGINE_START_S, 0.0),
            switchable=ev.flag(env, ev.PD_ENABLE_SWITCH_ROLE, default=True),
            max_prefill_queue=_positive_int(env, "PD_AGENT_MAX_PREFILL_QUEUE", 1024),
            idle_timeout_s=_float(env, "PD_AGENT_IDLE_TIMEOUT_S", 75.0),
            engine=engine, reference_model=reference_model,
            rank=eid.rank, tensor_parallel=eid.tensor_parallel,
        )


def _check_digest(env: dict[str, str], name: str) -> None:
    """NAME_SHA256 (the operator's record of the token it made): a token in the Secret with
    another digest was put there by someone else, and the agent does not start with it."""
    digest = ev.DIGEST_OF[name]
    want = env.get(digest)
    got = _secret(env, name)
    if want and got and hashlib.sha256(got.encode()).hexdigest() != want:
        raise ConfigError(f"{name}: the token in its Secret is not the one the operator made (its sha256 is not "
                          f"{digest}, the operator's record): someone else wrote that Secret; delete it and the "
                          f"operator makes a new one")


def _secret(env: dict[str, str], name: str) -> str | None:
    """A token from env NAME, or from the file env NAME_FILE names (a mounted Secret)."""
    if env.get(name):
        return env[name]
    if env.get(f"{name}_FILE"):
        try:
            return Path(env[f"{name}_FILE"]).read_text().strip() or None
        except OSError as e:
            raise ConfigError(f"{name}_FILE: {e}") from e
    return None


def _float(env: dict[str, str], name: str, default: float) -> float:
    try:
        return float(env.get(name) or default)
    except ValueError as e:
        raise ConfigError(f"{name} must be a number: {e}") from e


def _positive_int(env: dict[str, str], name: str, default: int) -> int:
    try:
        v = int(env.get(name) or default)
    except ValueError as e:
        raise ConfigError(f"{name} must be an integer: {e}") from e
    if v < 1:
        raise ConfigError(f"{name} must be at least 1, got {v}")
    return v


def _metrics_port(env: dict[str, str]) -> int | None:
    """PD_AGENT_METRICS_PORT: the port /metrics is served on alone; unset or 0: none."""
    raw = (env.get(ev.PD_AGENT_METRICS_PORT) or "").strip()
    try:
        port = int(raw) if raw else 0
    except ValueError as e:
        raise ConfigError(f"{ev.PD_AGENT_METRICS_PORT} must be an integer: {e}") from e
    if not 0 <= port <= 65535:
        raise ConfigError(f"{ev.PD_AGENT_METRICS_PORT} must be a port (0 for none), got {port}")
    return port or None


def proxy_environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Proxy variables break datadist links (they reroute the engine's connections)."""
    seen = os.environ if env is None else env
    return {k: seen[k] for k in PROXY_VARS if seen.get(k)}


def import_backend(backend: str):
    """The llm_datadist module for a backend: the real CANN module or the simulator."""
    if backend == "llm-datadist":
        import llm_datadist  # type: ignore[import-not-found]  # shipped with CANN
        return llm_datadist
    if backend == "sim":
        import llm_datadist_sim
        return llm_datadist_sim
    raise ConfigError(f"unknown backend {backend!r}; expected sim or llm-datadist")
