"""Prometheus metrics of one agent (its own registry, so embedding hosts keep theirs)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pd_contract.agent_api import Load

from .identity import Identity

LATENCY_BUCKETS_MS = (5, 10, 20, 30, 50, 75, 100, 150, 200, 300, 500, 750, 1000, 1500, 2000, 3000, 5000,
                      10000, 30000)


# The model-server protocol's names (Gateway API Inference Extension; vLLM's own), what endpoint
# pickers scrape: GIE's reference picker and llm-d's read these per engine.
WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
CACHE_CONFIG = "vllm:cache_config_info"


def cache_blocks(cache_desc: dict) -> tuple[int, int]:
    """(block_size, num_gpu_blocks) of an engine's KV cache as the protocol's cache_config_info
    states them: the paged cache's blocks, or for a contiguous cache one block per batch slot of
    the whole sequence length."""
    paged = cache_desc.get("paged") or {}
    if paged.get("block_size") and paged.get("num_blocks"):
        return int(paged["block_size"]), int(paged["num_blocks"])
    shape = list(cache_desc.get("shape") or [0, 0])
    return int(shape[1] if len(shape) > 1 else 0), int(shape[0] if shape else 0)


class ModelServerGauges:
    """The model-server protocol's four gauges in a registry, labelled `model_name`."""

    def __init__(self, r: CollectorRegistry):
        self.waiting = Gauge(WAITING, "Requests waiting to be processed (model-server protocol)", ["model_name"],
                             registry=r)
        self.running = Gauge(RUNNING, "Requests being processed (model-server protocol)", ["model_name"], registry=r)
        self.kv_usage = Gauge(KV_USAGE, "KV cache usage, 0 to 1 (model-server protocol)", ["model_name"], registry=r)
        self.cache_config = Gauge(CACHE_CONFIG, "KV cache configuration (model-server protocol)",
                                  ["model_name", "block_size", "num_gpu_blocks"], registry=r)
        self._config: tuple[str, str, str] | None = None

    def set(self, model: str, waiting: int, running: int, usage: float, block_size: int, blocks: int) -> None:
        self.waiting.labels(model).set(waiting)
        self.running.labels(model).set(running)
        self.kv_usage.labels(model).set(min(1.0, max(0.0, usage)))
        config = (model, str(block_size), str(blocks))
        if config != self._config:
            if self._config is not None:
                self.cache_config.remove(*self._config)
            self.cache_config.labels(*config).set(1)
            self._config = config


class AgentMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.queue_depth = Gauge("pd_agent_queue_depth", "Requests waiting to run", registry=r)
        self.running = Gauge("pd_agent_running_requests", "Requests running in the engine", registry=r)
        self.kv_used = Gauge("pd_agent_kv_cache_used_bytes", "KV cache bytes allocated (logical)", registry=r)
        self.pending_kv = Gauge("pd_agent_pending_kv_caches", "Prefilled caches not yet pulled", registry=r)
        self.links = Gauge("pd_agent_links", "Datadist links by state", ["state"], registry=r)
        self.ttft = Histogram("pd_agent_ttft_ms", "Time to first token seen by this agent (ms)",
                              buckets=LATENCY_BUCKETS_MS, registry=r)
        self.tbt = Histogram("pd_agent_tbt_ms", "Time between tokens (ms)", buckets=LATENCY_BUCKETS_MS,
                             registry=r)
        self.kv_pull = Histogram("pd_agent_kv_pull_ms", "KV cache pull latency (ms)",
                                 buckets=LATENCY_BUCKETS_MS, registry=r)
        self.requests = Counter("pd_agent_requests", "Requests finished", ["phase"], registry=r)
        self.failed = Counter("pd_agent_requests_failed", "Requests failed, by reason", ["reason"], registry=r)
        self.api_calls = Counter("pd_agent_api_calls", "Agent API calls", ["op", "code"], registry=r)
        self.model_server_gauges = ModelServerGauges(r)

    def model_server(self, model: str, waiting: int, running: int, kv_used: int, kv_capacity: int,
                     cache_desc: dict) -> None:
        """The model-server protocol's gauges from the engine's load, set at each scrape."""
        self.model_server_gauges.set(model, waiting, running, kv_used / kv_capacity if kv_capacity > 0 else 0.0,
                                     *cache_blocks(cache_desc))


def scrape(m: AgentMetrics, ident: Identity, load: Load) -> bytes:
    """The registry as a scrape sees it, the model-server protocol's gauges set from `load`."""
    m.model_server(ident.model_name, load.queue_depth, load.running, load.kv_used_bytes, load.kv_capacity_bytes,
                   ident.cache_desc)
    return generate_latest(m.registry)
