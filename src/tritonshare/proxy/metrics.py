"""The proxy's Prometheus metrics, on a registry of its own (so tests can run several proxies).

The request path only bumps plain Python numbers; a :class:`prometheus_client` collector turns them into
metric families when ``/metrics`` is scraped. ``Counter.labels().inc()`` and ``Histogram.observe()`` take
locks and build label keys on every call — measured at ~30k instructions per request, about as much as the
whole REST forwarding path — which a sidecar paid once per request cannot afford.

Each (protocol, route) has a :class:`RouteMeter`: a front end that knows a request's route when it forwards it
keeps the meter (the REST front end keeps it with the judged head) and records through it, building no label
key per request. The meters share their protocol's in-flight gauge and one :class:`Flight` for the whole proxy.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from time import perf_counter

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

# Latency buckets from 250 µs to 30 s: inference spans sub-millisecond identity models to long generations.
BUCKETS = (0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Histogram:
    """Per-bucket counts (not cumulative) and a sum; made cumulative only when scraped."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(BUCKETS, seconds)] += 1
        self.total += seconds

    def cumulative(self) -> list[tuple[str, float]]:
        out, running = [], 0
        for bound, count in zip((*map(str, BUCKETS), "+Inf"), self.counts, strict=True):
            running += count
            out.append((bound, float(running)))
        return out


class Inflight:
    """The gauge of requests in flight for one protocol, as a plain number."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def inc(self) -> None:
        self.value += 1

    def dec(self) -> None:
        self.value -= 1


class Flight:
    """Requests in flight in the whole proxy (every protocol), and who to tell when the count drops to zero
    (``on_idle``, set only while a drain waits)."""

    __slots__ = ("value", "on_idle")

    def __init__(self) -> None:
        self.value = 0
        self.on_idle: Callable[[], object] | None = None


class RouteMeter:
    """The numbers of one (protocol, route): requests by status code, their latency, and the in-flight counts
    it shares (its protocol's gauge, the proxy's :class:`Flight`). Per request: :meth:`begin` when the request
    is forwarded, :meth:`end` when its response is complete or it failed."""

    __slots__ = ("gauge", "flight", "latency", "codes")

    def __init__(self, gauge: Inflight, flight: Flight) -> None:
        self.gauge = gauge
        self.flight = flight
        self.latency = Histogram()
        self.codes: dict[str, int] = {}

    def begin(self) -> float:
        """A request was forwarded: returns its start time for :meth:`end`."""
        self.gauge.value += 1
        self.flight.value += 1
        return perf_counter()

    def end(self, code: str, started: float) -> None:
        """Its response is complete (or it failed) with ``code``."""
        seconds = perf_counter() - started
        codes = self.codes  # record(), inlined: once per request
        codes[code] = codes.get(code, 0) + 1
        latency = self.latency
        latency.counts[bisect_left(BUCKETS, seconds)] += 1
        latency.total += seconds
        self.gauge.value -= 1
        flight = self.flight
        flight.value -= 1
        if flight.value == 0 and flight.on_idle is not None:
            flight.on_idle()

    def count(self, code: str) -> None:
        """An answer with ``code`` the proxy gave itself instead of serving the request (a refusal): counted, but
        not timed — its few microseconds in the latency histogram, which has no code label, would pull the served
        requests' quantiles towards zero exactly when refusals abound (throttling, a client without a token)."""
        codes = self.codes
        codes[code] = codes.get(code, 0) + 1

    def record(self, code: str, seconds: float) -> None:
        """An answer with ``code`` after ``seconds`` (not counted in flight: refusals and local answers)."""
        codes = self.codes
        codes[code] = codes.get(code, 0) + 1
        latency = self.latency
        latency.counts[bisect_left(BUCKETS, seconds)] += 1
        latency.total += seconds


class ProxyMetrics(Collector):
    def __init__(self, model: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.model = model
        self.flight = Flight()
        self._meters: dict[tuple[str, str], RouteMeter] = {}  # (protocol, route)
        self._refusals: dict[tuple[str, str, str], int] = {}  # (protocol, route, reason)
        self._inflight: dict[str, Inflight] = {}
        # at 0 from the start, so that increase() and rate() see the first failure (a series appearing at 1 has none)
        self._upstream_errors: dict[str, int] = {"rest": 0, "grpc": 0}
        self._connections: dict[str, Callable[[], int]] = {}  # protocol → its front end's count
        self._held: Callable[[], int] | None = None  # request bytes held to check them (proxy/held.py)
        self.registry.register(self)

    # -- the request path ------------------------------------------------------------------------------

    def meter(self, protocol: str, route: str) -> RouteMeter:
        meter = self._meters.get((protocol, route))
        if meter is None:
            meter = self._meters[protocol, route] = RouteMeter(self.inflight_gauge(protocol), self.flight)
        return meter

    def observe(self, protocol: str, route: str, code: str, seconds: float) -> None:
        self.meter(protocol, route).record(code, seconds)

    def refused_answer(self, protocol: str, route: str, code: str, reason: str) -> None:
        """A request refused with ``code`` by the proxy itself, without reaching Triton (not timed:
        :meth:`RouteMeter.count`)."""
        self.meter(protocol, route).count(code)
        self.refused(protocol, route, reason)

    def expect_refusals(self, keys: Iterable[tuple[str, str, str]]) -> None:
        """Refusals by (protocol, route, reason) this proxy can make, exported at 0 until the first: a series
        that appears at 1 has no increase for ``rate()`` and ``increase()`` to see, so an alert on it misses the
        first refusal (Prometheus: initialise the label sets you know of)."""
        for key in keys:
            self._refusals.setdefault(key, 0)

    def refused(self, protocol: str, route: str, reason: str) -> None:
        key = (protocol, route, reason)
        self._refusals[key] = self._refusals.get(key, 0) + 1

    def count_connections(self, protocol: str, count: Callable[[], int]) -> None:
        """Where the gauge of ``protocol``'s open client connections is read at scrape time."""
        self._connections[protocol] = count

    def count_held(self, count: Callable[[], int]) -> None:
        """Where the gauge of request bytes held to check them is read at scrape time."""
        self._held = count

    def upstream_error(self, protocol: str) -> None:
        self._upstream_errors[protocol] = self._upstream_errors.get(protocol, 0) + 1

    def inflight_gauge(self, protocol: str) -> Inflight:
        gauge = self._inflight.get(protocol)
        if gauge is None:
            gauge = self._inflight[protocol] = Inflight()
        return gauge

    # -- scraping --------------------------------------------------------------------------------------

    def describe(self) -> Iterator[Metric]:
        return iter(())  # families are only known at collect time; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        model = self.model
        requests = CounterMetricFamily(
            "tritonshare_proxy_requests",
            "Requests answered, by protocol, route and status code.",
            labels=["model", "protocol", "route", "code"],
        )
        meters = list(self._meters.items())
        for (protocol, route), meter in meters:
            for code, n in list(meter.codes.items()):
                requests.add_metric([model, protocol, route, code], n)
        yield requests
        latency = HistogramMetricFamily(
            "tritonshare_proxy_request_duration_seconds",
            "Time from request start to the end of its response, of requests the proxy did not refuse itself.",
            labels=["model", "protocol", "route"],
        )
        for (protocol, route), meter in meters:
            if any(meter.latency.counts):  # a route only ever refused, or not answered yet, has no latency to show
                latency.add_metric([model, protocol, route], meter.latency.cumulative(), meter.latency.total)
        yield latency
        refusals = CounterMetricFamily(
            "tritonshare_proxy_refusals",
            "Requests refused by the proxy itself (policy, limits, drain).",
            labels=["model", "protocol", "route", "reason"],
        )
        for (protocol, route, reason), n in list(self._refusals.items()):
            refusals.add_metric([model, protocol, route, reason], n)
        yield refusals
        inflight = GaugeMetricFamily(
            "tritonshare_proxy_inflight_requests",
            "Requests forwarded to Triton and not yet answered.",
            labels=["model", "protocol"],
        )
        for protocol, gauge in list(self._inflight.items()):
            inflight.add_metric([model, protocol], gauge.value)
        yield inflight
        connections = GaugeMetricFamily(
            "tritonshare_proxy_client_connections",
            "Client connections open (the cap is --max-connections per protocol; the metrics port has its own).",
            labels=["model", "protocol"],
        )
        for protocol, count in list(self._connections.items()):
            connections.add_metric([model, protocol], count())
        yield connections
        if self._held is not None:
            held = GaugeMetricFamily(
                "tritonshare_proxy_held_bytes",
                "Request bytes held to check them (REST infer JSON parts, gRPC infer parameter fields); the cap is "
                "--max-held-bytes.",
                labels=["model"],
            )
            held.add_metric([model], self._held())
            yield held
        errors = CounterMetricFamily(
            "tritonshare_proxy_upstream_errors",
            "Failures to reach or keep a connection to Triton.",
            labels=["model", "protocol"],
        )
        for protocol, n in list(self._upstream_errors.items()):
            errors.add_metric([model, protocol], n)
        yield errors

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
