"""Cancelled gRPC calls that Triton is not told about (``--grpc-cancellations absorb``, the default).

Why: Triton before 24.12 (2.53) can crash on a cancellation that races a call's end — a segmentation fault in
its gRPC handlers (``IsCancelled`` on a freed context; triton-inference-server/server#7368, #8034, fixed by #7840)
— and the Triton a proxy talks to is every tenant's. It was seen here twice (Triton 2.51, `bench/proxy_bench.sh`)
as 16 streaming clients left at once, and ``bench/faults/cancel_storm.py`` crashes it in seconds. So no client's
cancellation reaches Triton as one:

- A client's RST_STREAM on a forwarded stream is not passed on. The stream is *abandoned*: Triton runs the call
  to its end, whatever it sends of it is dropped (its DATA credited back to Triton, on the connection and the
  stream, so a large answer does not stall), and the stream keeps what it holds meanwhile — its admission slot
  and its place under ``grpc_max_streams`` — so cancelling and calling again cannot put more work on Triton
  than the limits allow (and nothing is spent from the reset budget: no stream is set up for nothing). If the
  client had not ended its side (a ModelStreamInfer stream), an empty DATA frame ends it, as if the client had:
  Triton answers what it has, then ends the stream.
- A reset of a stream Triton has already ended (the deadline passing as the answer is on its way: the very race
  of #7368) is not passed on either; if Triton ended a stream whose client was still sending, the client's side
  is ended with an empty DATA frame instead (:meth:`StreamTable.after_end`).
- A client connection that goes (or that the proxy ends) with calls in flight abandons them all; Triton's
  connection stays open until Triton has ended them, at most ``drain_timeout_s`` (past it, it is closed, and
  Triton cancels what is left). Meanwhile the proxy acknowledges Triton's SETTINGS and PINGs, as the client
  would have.
- ``grpc-timeout`` is not passed on: at the deadline, Triton's gRPC server would cancel the call itself. The
  client keeps its deadline (it resets the stream then: abandoned as above). The first header block that
  carries one switches its connection to re-encoded blocks (:mod:`tritonshare.proxy.grpc_headers`).

A stream is still reset at Triton where it cannot be left to run: it waits for an admission slot (Triton holds
its first message but for the last byte, and computes nothing), or a message of it is half forwarded (ending
the stream there would be Triton's error, not the call's end) — and a message the proxy refuses, as before.
What absorbing costs: a cancelled call's work is done anyway (Triton from 24.12 on can stop it:
``--grpc-cancellations forward`` then passes cancellations on, as nginx does), and a client sending deadlines has
its header blocks re-encoded (grpcio indexes grpc-timeout's values in HPACK's table; a repeated call keeps its
short path, re-encoded, but each new value sends a call or three down the full one: ~16 % more proxy CPU a grpcio
call with a deadline, ``bench/grpc_deadlines.py``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)


class OrphanedCalls:
    """The calls a gone client connection abandoned, still running at Triton: ``settle`` closes Triton's
    connection once they end (:meth:`ended`), or when ``bound_s`` has passed."""

    def __init__(self, count: int, bound_s: float, settle: Callable[[], None]) -> None:
        self._settle = settle
        self._left = count
        self._timer = asyncio.get_running_loop().call_later(bound_s, self._give_up, bound_s)

    def ended(self, left: int) -> None:
        """A call ended at Triton; ``left`` are still running."""
        self._left = left
        if not left:
            self.cancel()
            self._settle()

    def cancel(self) -> None:
        self._timer.cancel()

    def _give_up(self, bound_s: float) -> None:
        logger.warning(
            "%d gRPC calls abandoned by a client that left did not end at Triton within %g s: closing their "
            "connection to Triton (Triton cancels them)",
            self._left,
            bound_s,
        )
        self._settle()
