"""What the proxy's front ends share: settings, the own model's name, the probes it answers itself
(readiness, liveness), drain state, the
accounting of requests in flight (for metrics and for draining on SIGTERM), and the optional fairness and
access controls (issue 9): :attr:`ProxyState.admission`, :attr:`ProxyState.auth`, :attr:`ProxyState.tls`.

Front ends account a forwarded request on its route's meter (``state.metrics.meter(protocol, route)``:
:meth:`~tritonshare.proxy.metrics.RouteMeter.begin` when it is forwarded,
:meth:`~tritonshare.proxy.metrics.RouteMeter.end` when its response is complete or it failed), which also
counts it in flight for the drain; refusals the proxy answers itself go through :meth:`ProxyState.refuse`, and
other answers it gives itself (the probes) through :meth:`ProxyState.answered`.

Build it inside the running event loop (admission control schedules on it). The access-control files are
read here, so a bad ``--auth-token-file`` or ``--tls-cert`` stops the proxy before it listens.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any, Protocol

from tritonshare.proxy import held
from tritonshare.proxy.admission import LIMITED_BY_PROTOCOL, METADATA_BY_PROTOCOL, Admission, AdmissionLimits
from tritonshare.proxy.auth import BearerTokens
from tritonshare.proxy.held import HeldBudget
from tritonshare.proxy.metrics import ProxyMetrics
from tritonshare.proxy.policy import Verdict
from tritonshare.proxy.readiness import TritonProbe
from tritonshare.proxy.settings import ProxySettings
from tritonshare.proxy.tls import TlsCertificates

_IDLE_POLL_S = 0.02  # how often a drain looks at the admission queue once nothing is in flight


class Frontend(Protocol):
    """One listening protocol (REST or gRPC)."""

    protocol: str  # "rest" | "grpc"

    @property
    def port(self) -> int: ...  # the bound port (useful when settings asked for 0)

    async def start(self) -> None: ...

    def stop_accepting(self) -> None:
        """Close the listening socket: new connections are refused from now on."""

    def begin_drain(self) -> None:
        """Tell connected clients to stop sending new requests (REST: close idle keep-alive connections and
        close each connection after its current response; gRPC: GOAWAY). In-flight requests continue."""

    def abort(self) -> None:
        """Close every connection left (after the drain timeout)."""


def listening_port(server: asyncio.AbstractServer | None) -> int:
    """The port ``server`` listens on; 0 before it listens. (``sockets`` is read untyped: uvloop's is a list
    where typeshed says tuple, and a compiled module checks the type an expression declares.)"""
    sockets: Any = getattr(server, "sockets", None)
    return int(sockets[0].getsockname()[1]) if sockets else 0


class ProxyState:
    def __init__(self, settings: ProxySettings, *, metrics: ProxyMetrics | None = None) -> None:
        self.settings = settings
        self.own = settings.name
        self.own_bytes = settings.name.encode()
        self.metrics = metrics or ProxyMetrics(settings.name)
        kept = {"ttl_s": settings.readiness_interval_s, "timeout_s": settings.connect_timeout_s}
        self.readiness = TritonProbe.readiness(settings.triton_url, settings.name, **kept)
        self.liveness = TritonProbe.liveness(settings.triton_url, **kept)
        # What the probes the proxy answers itself (policy verdicts READY and LIVE) are answered from.
        self.probes: dict[Verdict, TritonProbe] = {Verdict.READY: self.readiness, Verdict.LIVE: self.liveness}
        registry = self.metrics.registry
        self.admission = Admission(_limits(settings), model=settings.name, registry=registry)
        token_file, model = settings.auth_token_file, settings.name
        self.auth = BearerTokens(token_file, registry=registry, model=model) if token_file else None
        self.tls = TlsCertificates.from_options(settings.tls_cert, settings.tls_key, registry=registry, model=model)
        self.draining = False
        # Triton's gRPC port did not take the last connection tried: said once per outage, not per client connection
        self.grpc_unreachable = False
        self.held = 0  # REST requests whose body is held for its check: not in flight yet, but a drain waits
        self.held_budget = HeldBudget(settings.max_held_bytes)  # the bytes they hold
        self.metrics.count_held(lambda: self.held_budget.held)
        self.metrics.expect_refusals(_alerted_refusals(settings))
        self._flight = self.metrics.flight  # in flight, every protocol: what a drain waits for

    @property
    def inflight(self) -> int:
        return self._flight.value

    def refuse(self, protocol: str, route: str, code: str, reason: str) -> None:
        """A request the proxy answered itself without reaching Triton."""
        self.metrics.refused_answer(protocol, route, code, reason)

    def answered(self, protocol: str, route: str, code: str, started: float) -> None:
        """A request the proxy answered itself that is not a refusal (a probe)."""
        self.metrics.observe(protocol, route, code, time.perf_counter() - started)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing is in flight, no request waits for an admission slot and no REST request body
        is held for its check (such requests are not in flight yet); False if the timeout passed first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            if self._flight.value:
                idle = asyncio.Event()
                self._flight.on_idle = idle.set  # made only while a drain waits: nothing to do per request
                try:
                    await asyncio.wait_for(idle.wait(), max(0.0, deadline - loop.time()))
                except TimeoutError:
                    return False
                finally:
                    self._flight.on_idle = None
            if self.admission.idle and not self.held:
                return True
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(_IDLE_POLL_S)


def _alerted_refusals(settings: ProxySettings) -> Iterator[tuple[str, str, str]]:
    """The refusals an operator alerts on that this proxy can make, as (protocol, route, reason): connections
    over the cap, and inference (plus metadata, when rate limited) refused for the options that are on."""
    for protocol in ("rest", "grpc", *(("metrics",) if settings.metrics_port else ())):
        yield protocol, "connection", "too_many_connections"
    reasons = {
        "unauthenticated": settings.auth_token_file is not None,
        "rate_limited": settings.rate_limit_rps > 0,
        "queue_full": settings.max_inflight > 0,
        "queue_timeout": settings.max_inflight > 0 and settings.max_queue > 0,
        held.REASON: settings.max_held_bytes > 0,
    }
    on = [reason for reason, given in reasons.items() if given]
    for protocol, routes in LIMITED_BY_PROTOCOL.items():
        for route in sorted(routes):
            yield from ((protocol, route, reason) for reason in (*on, "draining"))
        if settings.rate_limit_rps > 0:
            yield from ((protocol, route, "rate_limited") for route in sorted(METADATA_BY_PROTOCOL[protocol]))


def _limits(settings: ProxySettings) -> AdmissionLimits:
    return AdmissionLimits(
        max_inflight=settings.max_inflight,
        max_queue=settings.max_queue,
        queue_timeout_s=settings.queue_timeout_s,
        rate_limit_rps=settings.rate_limit_rps,
        rate_limit_burst=settings.rate_limit_burst,
    )
