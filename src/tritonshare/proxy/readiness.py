"""The probes the proxy answers itself: Triton's answer to one GET, asked at most once per ``ttl_s`` and kept.

Two are kept: the own model's readiness (``GET /v2/models/NAME/ready``), which is what REST
``/v2/health/ready`` and gRPC ``ServerReady`` and ``Health/Check`` mean through the proxy — "my model is
served", not Triton's strict server readiness, which is false while ANY tenant's model is broken (REFERENCE
§2) — and Triton's liveness (``GET /v2/health/live``), for REST ``/v2/health/live`` and gRPC ``ServerLive``.

They need no token and take no admission slot (the kubelet sends none), so asking Triton once per probe
would let anyone flood the SHARED Triton through a tenant's proxy: 60k liveness calls a second through one
proxy took another tenant's p99 from 2 ms to 140-220 ms. Kept for ``ttl_s``
(``ProxySettings.readiness_interval_s``, 1 s), a flood of probes costs Triton one question a second per probe,
whatever its rate; callers that come while a question is out share it.

A plain asyncio HTTP/1.1 exchange: the proxy keeps its imports small.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import urllib.parse
from collections.abc import Callable

logger = logging.getLogger(__name__)

UNREACHABLE = 503  # the status kept when Triton did not answer (as the REST front end answers then)
READY_PATH = "/v2/models/{name}/ready"
LIVE_PATH = "/v2/health/live"


class TritonProbe:
    """Triton's status for ``GET path`` (200: yes), kept ``ttl_s``; :data:`UNREACHABLE` when Triton did not
    answer within ``timeout_s``."""

    def __init__(
        self,
        triton_url: str,
        path: str,
        *,
        ttl_s: float = 1.0,
        timeout_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        parsed = urllib.parse.urlsplit(triton_url)
        self.path = path
        self._host = parsed.hostname or "127.0.0.1"
        self._port = parsed.port or 80
        self._request = f"GET {path} HTTP/1.1\r\nHost: {parsed.netloc}\r\nConnection: close\r\n\r\n".encode()
        self._ttl_s = ttl_s
        self._timeout_s = timeout_s
        self._clock = clock
        self._status = UNREACHABLE
        self._checked_at = -math.inf
        self._asking: asyncio.Task[int] | None = None

    @classmethod
    def readiness(cls, triton_url: str, name: str, *, ttl_s: float = 1.0, timeout_s: float = 2.0) -> TritonProbe:
        """The own model's readiness."""
        path = READY_PATH.format(name=urllib.parse.quote(name, safe=""))
        return cls(triton_url, path, ttl_s=ttl_s, timeout_s=timeout_s)

    @classmethod
    def liveness(cls, triton_url: str, *, ttl_s: float = 1.0, timeout_s: float = 2.0) -> TritonProbe:
        """Triton's liveness."""
        return cls(triton_url, LIVE_PATH, ttl_s=ttl_s, timeout_s=timeout_s)

    def fresh(self) -> int | None:
        """The status kept, while it is fresh; else None."""
        return self._status if self._clock() - self._checked_at < self._ttl_s else None

    async def status(self) -> int:
        """The status, kept or asked now (one question for every caller that comes while it is out)."""
        fresh = self.fresh()
        if fresh is not None:
            return fresh
        return await asyncio.shield(self._question())

    async def ok(self) -> bool:
        return await self.status() == 200

    def ask(self, answered: Callable[[int], None]) -> None:
        """``answered(status)``: at once when the status kept is fresh, else when the question out (asked now if
        none is) comes back. For protocol callbacks, which cannot await."""
        fresh = self.fresh()
        if fresh is not None:
            answered(fresh)
            return
        self._question().add_done_callback(lambda task: None if task.cancelled() else answered(task.result()))

    def _question(self) -> asyncio.Task[int]:
        if self._asking is None:
            self._asking = asyncio.get_running_loop().create_task(self._ask())
            self._asking.add_done_callback(self._asked)
        return self._asking

    def _asked(self, task: asyncio.Task[int]) -> None:
        self._asking = None

    async def _ask(self) -> int:
        try:
            status = await asyncio.wait_for(self._exchange(), self._timeout_s)
        except (OSError, TimeoutError, ValueError) as exc:
            logger.debug("probe %s: Triton did not answer: %s", self.path, exc)
            status = UNREACHABLE
        self._status, self._checked_at = status, self._clock()
        return status

    async def _exchange(self) -> int:
        reader, writer = await asyncio.open_connection(self._host, self._port)
        try:
            writer.write(self._request)
            parts = (await reader.readline()).split(b" ", 2)
            if len(parts) < 2 or not parts[1].isdigit():
                raise ValueError(f"not an HTTP status line: {parts[:2]!r}")
            return int(parts[1])
        finally:
            writer.close()
