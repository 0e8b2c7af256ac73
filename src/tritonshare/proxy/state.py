"""What the proxy's front ends share: settings, the own model's name, readiness, drain state, and the
accounting of requests in flight (for metrics and for draining on SIGTERM).

Front ends call :meth:`ProxyState.begin` when a request is forwarded and :meth:`ProxyState.end` when its
response is complete (or it failed); refusals the proxy answers itself go through :meth:`ProxyState.refuse`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

from tritonshare.proxy.metrics import ProxyMetrics
from tritonshare.proxy.readiness import Readiness
from tritonshare.proxy.settings import ProxySettings


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


class ProxyState:
    def __init__(
        self, settings: ProxySettings, *, metrics: ProxyMetrics | None = None, readiness: Readiness | None = None
    ) -> None:
        self.settings = settings
        self.own = settings.name
        self.own_bytes = settings.name.encode()
        self.metrics = metrics or ProxyMetrics(settings.name)
        self.readiness = readiness or Readiness(
            settings.triton_url,
            settings.name,
            ttl_s=settings.readiness_interval_s,
            timeout_s=settings.connect_timeout_s,
        )
        self.draining = False
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def inflight(self) -> int:
        return self._inflight

    def begin(self, protocol: str) -> float:
        """A request was forwarded to Triton; returns its start time for :meth:`end`."""
        self._inflight += 1
        self._idle.clear()
        self.metrics.inflight_gauge(protocol).inc()
        return time.perf_counter()

    def end(self, protocol: str, route: str, code: str, started: float) -> None:
        self._inflight -= 1
        self.metrics.inflight_gauge(protocol).dec()
        self.metrics.observe(protocol, route, code, time.perf_counter() - started)
        if self._inflight == 0:
            self._idle.set()

    def refuse(self, protocol: str, route: str, code: str, reason: str) -> None:
        """A request the proxy answered itself without reaching Triton."""
        self.metrics.refused(protocol, route, reason)
        self.metrics.observe(protocol, route, code, 0.0)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing is in flight; False if the timeout passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True
