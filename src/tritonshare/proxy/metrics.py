"""The proxy's Prometheus metrics, on a registry of its own (so tests can run several proxies).

Label children are cached: ``Counter.labels()`` takes a lock and builds a key on every call, which the
request path cannot afford once per request.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

# Latency buckets from 250 µs to 30 s: inference spans sub-millisecond identity models to long generations.
BUCKETS = (0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ProxyMetrics:
    def __init__(self, model: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.model = model
        self.requests = Counter(
            "tritonshare_proxy_requests",
            "Requests answered, by protocol, route and status code.",
            ["model", "protocol", "route", "code"],
            registry=reg,
        )
        self.latency = Histogram(
            "tritonshare_proxy_request_duration_seconds",
            "Time from request start to the end of its response.",
            ["model", "protocol", "route"],
            buckets=BUCKETS,
            registry=reg,
        )
        self.refusals = Counter(
            "tritonshare_proxy_refusals",
            "Requests refused by the proxy itself (policy, limits, drain).",
            ["model", "protocol", "route", "reason"],
            registry=reg,
        )
        self.inflight = Gauge(
            "tritonshare_proxy_inflight_requests",
            "Requests forwarded to Triton and not yet answered.",
            ["model", "protocol"],
            registry=reg,
        )
        self.upstream_errors = Counter(
            "tritonshare_proxy_upstream_errors",
            "Failures to reach or keep a connection to Triton.",
            ["model", "protocol"],
            registry=reg,
        )
        self._requests: dict[tuple[str, str, str], Counter] = {}
        self._latency: dict[tuple[str, str], Histogram] = {}
        self._inflight: dict[str, Gauge] = {}

    def observe(self, protocol: str, route: str, code: str, seconds: float) -> None:
        key = (protocol, route, code)
        child = self._requests.get(key)
        if child is None:
            child = self._requests[key] = self.requests.labels(self.model, protocol, route, code)
        child.inc()
        lkey = (protocol, route)
        hist = self._latency.get(lkey)
        if hist is None:
            hist = self._latency[lkey] = self.latency.labels(self.model, protocol, route)
        hist.observe(seconds)

    def refused(self, protocol: str, route: str, reason: str) -> None:
        self.refusals.labels(self.model, protocol, route, reason).inc()

    def upstream_error(self, protocol: str) -> None:
        self.upstream_errors.labels(self.model, protocol).inc()

    def inflight_gauge(self, protocol: str) -> Gauge:
        gauge = self._inflight.get(protocol)
        if gauge is None:
            gauge = self._inflight[protocol] = self.inflight.labels(self.model, protocol)
        return gauge

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
