"""Client connections past ``--max-connections``: told why, then closed.

Each front end keeps at most ``max_connections`` client connections (0: no cap). Every one may hold a
connection to the node's shared Triton too (gRPC always, REST while it has requests), so without a cap one
tenant's connection flood would spend the proxy's open files (then every accept fails, for all its clients)
and Triton's. One more is accepted, takes no place and opens nothing at Triton, and is answered in its
protocol's words:

- REST: :class:`TurnedAway` writes ``503`` with ``Retry-After`` at once and half-closes; what the client sends
  meanwhile is read and dropped for up to :data:`LINGER_S`, so that it reads the answer rather than a reset.
- gRPC: the connection answers each stream the client opens UNAVAILABLE with the reason, then GOAWAY
  (:meth:`tritonshare.proxy.grpc_connection.ClientConnection._become_unavailable`, as when Triton is down).

With TLS, a handshake under way holds a place too (:class:`tritonshare.proxy.tls.Handshakes`), and a
connection past the cap is closed at once, before any handshake (:class:`Closed`): an answer in TLS would
take the very handshake the cap bounds. Each answer or close counts as a refusal with reason
``too_many_connections``.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from tritonshare.proxy.tls import Handshakes

LINGER_S = 2.0  # after the proxy closes a connection, how long it still reads (and drops) what the client sends


def half_close(transport: asyncio.Transport) -> asyncio.TimerHandle | None:
    """Close from the proxy's side: flush, send FIN, and close for good :data:`LINGER_S` later (the returned
    timer; cancel it if the client closes first) — reading on meanwhile, so the client sees the answer rather
    than a reset. TLS has no half-close: the transport closes at once (after its buffered bytes, with TLS
    close_notify), and there is no timer."""
    if not transport.can_write_eof():
        transport.close()
        return None
    transport.write_eof()
    return asyncio.get_running_loop().call_later(LINGER_S, transport.close)


def over_cap_message(model: str, cap: int) -> str:
    return (
        f"the proxy of model '{model}' holds its maximum of {cap} client connections (--max-connections); "
        "reuse a connection, close idle ones, or retry later"
    )


def has_room(cap: int, connections: int, handshakes: Handshakes | None) -> bool:
    """Whether one more client connection fits under ``cap`` (0: no cap), TLS handshakes under way counted."""
    return not cap or connections + (handshakes.under_way if handshakes else 0) < cap


class Lingering(asyncio.Protocol):
    """A connection the proxy has ended after writing its last bytes (a 503, a gRPC GOAWAY): half-closed,
    and what the client still sends read and dropped until it closes or :data:`LINGER_S` pass. Closed at
    once, with the client's bytes unread, the kernel answers them with a reset, and a client may lose the
    last bytes still in its receive buffer (seen: a GOAWAY in the rapid-reset test, once). ``transport``: a
    connection taken over once ended; without one, :meth:`end` is called when it is."""

    linger: asyncio.TimerHandle | None = None

    def __init__(self, transport: asyncio.Transport | None = None) -> None:
        if transport is not None:
            self.end(transport)

    def end(self, transport: asyncio.Transport) -> None:
        self.linger = half_close(transport)
        try:
            transport.resume_reading()  # it may have been paused for backpressure: read on, and drop
        except (AttributeError, RuntimeError):
            pass

    def data_received(self, data: bytes) -> None:
        pass

    def connection_lost(self, exc: Exception | None) -> None:
        if self.linger is not None:
            self.linger.cancel()


class Closed(asyncio.Protocol):
    """A TLS connection past the cap: closed as soon as it is accepted."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


class TurnedAway(Lingering):
    """A connection past the cap: ``answer`` is written, then the connection ends (and lingers)."""

    def __init__(self, answer: bytes) -> None:
        super().__init__()
        self.answer = answer

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        writer = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it
        writer.write(self.answer)
        self.end(writer)
