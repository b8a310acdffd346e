"""Prometheus metrics of one agent (its own registry, so embedding hosts keep theirs)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS_MS = (5, 10, 20, 30, 50, 75, 100, 150, 200, 300, 500, 750, 1000, 1500, 2000, 3000, 5000,
                      10000, 30000)


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
