"""The gateway's Prometheus metrics, and the recent percentiles the operator reads."""
from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

MS = (5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000)
TBT_MS = (1, 2, 5, 10, 20, 40, 80, 160, 320, 1000)
WINDOW = 500   # requests the percentiles cover


def _pct(values, q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, int(q * len(s)))], 2)


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("pd_gateway_requests", "Requests by API key name, API and HTTP status",
                                ["key", "api", "status"], registry=r)
        self.errors = Counter("pd_gateway_errors", "Failed requests by key name and reason", ["key", "reason"],
                              registry=r)
        self.ttft = Histogram("pd_gateway_ttft_ms", "Time to first token as the client sees it, ms", ["key"],
                              buckets=MS, registry=r)
        self.tbt = Histogram("pd_gateway_tbt_ms", "Time between tokens, ms", ["key"], buckets=TBT_MS, registry=r)
        self.tokens = Counter("pd_gateway_tokens", "Tokens by key name and kind (prompt, completion)",
                              ["key", "kind"], registry=r)
        self.usage = Counter("pd_gateway_usage", "Served requests and their tokens by key name and model "
                             "(kind: requests, input_tokens, output_tokens)", ["key", "model", "kind"], registry=r)
        self.pod_requests = Counter("pd_gateway_pod_requests", "Requests sent to each engine pod by role and result",
                                    ["pod", "role", "result"], registry=r)
        self.retries = Counter("pd_gateway_refusals", "Refusals before the first token, retried on another pair",
                               ["reason"], registry=r)
        self.bad_reports = Counter("pd_gateway_bad_reports", "Status answers of an engine pod that routing could not "
                                   "use (malformed, wrong types, HTTP error): the pod is skipped", ["pod"], registry=r)
        self.usage_rejected = Counter("pd_gateway_usage_store_rejected", "Shared usage documents ignored as not "
                                      "this gateway's (reason: not_json, too_large, bad_shape, bad_count, "
                                      "implausible_growth, lowered): the last good copy is kept and "
                                      "written back", ["reason"], registry=r)
        self.kv_pulls = Gauge("pd_gateway_kv_pulls", "Decoders picked for a prefill since start, by where the KV "
                              "pull goes: within its A3 superpod, across superpods, or unknown (no superpod "
                              "reported)", ["superpod"], registry=r)
        self._ttft: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self._tbt: collections.deque[float] = collections.deque(maxlen=WINDOW)

    def counting_pulls(self, fleets: Iterable[Any]) -> GatewayMetrics:
        """kv_pulls read from the routers' counts (pd_router.Fleet.pulls) at each scrape."""
        fleets = list(fleets)

        def count(where: str) -> Callable[[], float]:
            return lambda: float(sum(f.pulls[where] for f in fleets))
        for where in ("within", "across", "unknown"):
            self.kv_pulls.labels(where).set_function(count(where))
        return self

    def record(self, key: str, ttft_ms: float, tbt_ms: float | None) -> None:
        self.ttft.labels(key).observe(ttft_ms)
        self._ttft.append(ttft_ms)
        if tbt_ms is not None:
            self.tbt.labels(key).observe(tbt_ms)
            self._tbt.append(tbt_ms)

    def stats(self) -> dict:
        """Recent client-side latencies (the last WINDOW requests), for the SLO policy."""
        return {"requests": len(self._ttft),
                "ttft_ms": {"p50": _pct(self._ttft, 0.5), "p90": _pct(self._ttft, 0.9), "p99": _pct(self._ttft, 0.99)},
                "tbt_ms": {"p50": _pct(self._tbt, 0.5), "p90": _pct(self._tbt, 0.9), "p99": _pct(self._tbt, 0.99)}}
