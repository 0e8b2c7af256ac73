"""The opening of Triton's connection for one relayed gRPC client connection.

Triton's connection opens with the client's first bytes, not when the client's connection is accepted: bare
TCP connects (port scanners, load balancers' health checks, idle pools) must not hold connections on the node's
shared Triton, and a client connection that stays silent for :data:`SILENT_TIMEOUT_S` is closed. The client's
bytes that come while Triton's connection opens are held, and go on once it is open — or, when Triton cannot be
reached within ``connect_timeout_s``, are answered by the proxy (every stream UNAVAILABLE, see
:mod:`tritonshare.proxy.grpc`). Past :data:`HELD_LIMIT` bytes held, the connection stops reading the client.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from tritonshare.proxy.grpc_streams import PROTOCOL
from tritonshare.proxy.grpc_upstream import UpstreamConnection
from tritonshare.proxy.state import ProxyState

logger = logging.getLogger(__name__)

SILENT_TIMEOUT_S = 30.0  # a client connection that sends no byte for this long is closed
HELD_LIMIT = 1 << 20  # client bytes held while Triton's connection opens; reading the client pauses beyond

# Opens the connection to Triton for one client connection (a seam: tests pass their own).
OpenUpstream = Callable[[Callable[[], UpstreamConnection]], Awaitable[UpstreamConnection]]


class Opener(Protocol):
    """What the opening needs of the client connection it opens Triton's connection for."""

    def opened(self, upstream: UpstreamConnection | None, held: list[bytes]) -> None: ...  # None: unreachable


class UpstreamOpening:
    """Triton's connection for one client connection, until it is open, and the client's bytes held meanwhile."""

    def __init__(
        self,
        connection: Opener,
        client: asyncio.Transport,
        state: ProxyState,
        *,
        open_upstream: OpenUpstream,
        upstream_address: str,
        new_upstream: Callable[[], UpstreamConnection],
    ) -> None:
        """``client``: the client connection's transport; ``new_upstream``: makes the protocol of Triton's
        connection; ``upstream_address``: where that is, for log lines."""
        self._connection = connection
        self._client = client
        self._state = state
        self._open_upstream = open_upstream
        self._upstream_address = upstream_address
        self._new_upstream = new_upstream
        self._held: list[bytes] = []
        self._held_size = 0
        self._task: asyncio.Task[None] | None = None  # once the client has spoken
        self._silence = asyncio.get_running_loop().call_later(SILENT_TIMEOUT_S, self.close_silent)

    @property
    def started(self) -> bool:
        """Whether the client has spoken (and Triton's connection is opening)."""
        return self._task is not None

    def start(self) -> None:
        """The client spoke: Triton's connection opens."""
        self._silence.cancel()
        self._task = asyncio.get_running_loop().create_task(self._open())

    def hold(self, data: bytes) -> bool:
        """Hold a read of the client's until Triton's connection is open. True: too many bytes are held (the
        client's connection stops reading until they go on)."""
        self._held.append(data)
        self._held_size += len(data)
        return self._held_size > HELD_LIMIT

    def close_silent(self) -> None:
        """The silence timer: the client has sent nothing for :data:`SILENT_TIMEOUT_S`."""
        if self._task is None:
            self._client.close()

    def cancel(self) -> None:
        """The client's connection is gone."""
        self._silence.cancel()
        if self._task is not None:
            self._task.cancel()

    async def _open(self) -> None:
        try:
            upstream = await asyncio.wait_for(
                self._open_upstream(self._new_upstream), self._state.settings.connect_timeout_s
            )
        except (OSError, TimeoutError) as exc:
            self._unreachable(exc)
            self._connection.opened(None, self._held)
            return
        if self._state.grpc_unreachable:
            self._state.grpc_unreachable = False
            logger.info("Triton gRPC at %s is reachable again", self._upstream_address)
        if self._client.is_closing():
            if upstream.transport is not None:
                upstream.transport.close()
            return
        self._connection.opened(upstream, self._held)

    def _unreachable(self, exc: Exception) -> None:
        """Counted each time (``tritonshare_proxy_upstream_errors_total``), logged once per outage: a Triton that
        restarts is down for as long as its models take to load, and every client's reconnect lands here."""
        self._state.metrics.upstream_error(PROTOCOL)
        if not self._state.grpc_unreachable:
            self._state.grpc_unreachable = True
            logger.warning(
                "Triton gRPC at %s is unreachable (%s): answering UNAVAILABLE until it is back",
                self._upstream_address,
                str(exc) or "connect timeout",
            )
