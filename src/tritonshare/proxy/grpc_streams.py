"""The streams of one relayed gRPC connection: which ones Triton knows, and their accounting.

A stream is forwarded (Triton sees it: in flight until Triton ends it or either side resets it), answered
by the proxy itself (Triton never sees it), or reset by the proxy after forwarding (a refused message).
The relay must not send Triton frames of a stream it never saw — RST_STREAM or WINDOW_UPDATE on an idle
stream is a connection error (RFC 7540 §5.1) — so it asks :meth:`StreamTable.known_upstream`.

Under admission control (:mod:`tritonshare.proxy.admission`) an inference stream holds a slot or waits
for one; whichever way it ends, :meth:`StreamTable._leave` gives the slot back (or its place in the queue)
and credits the client's window for the frames it held back from Triton meanwhile.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from tritonshare.proxy import http2
from tritonshare.proxy.admission import Ticket
from tritonshare.proxy.grpc_messages import MessageInspector, MessageJudge, Refusal
from tritonshare.proxy.grpc_replies import STATUS_NAMES
from tritonshare.proxy.metrics import RouteMeter
from tritonshare.proxy.policy import GrpcRule
from tritonshare.proxy.state import ProxyState

PROTOCOL = "grpc"
_RECENT_LIMIT = 256  # ids of streams answered or reset by the proxy, remembered to drop their late frames
# Forwarded streams a client may end early (its RST_STREAM, or a message the proxy refuses): a burst of
# RESET_BURST, then RESETS_PER_S on average — nghttp2's answer to "rapid reset" (CVE-2023-44487) is 1000 and 33.
# A client cancelling 100 calls a second for good, or 1000 at once, stays within it; a flood does not.
RESET_BURST = 1000
RESETS_PER_S = 100.0


@dataclass(slots=True)
class Stream:
    """A stream forwarded to Triton and not yet finished."""

    rule: GrpcRule
    meter: RouteMeter  # its route's numbers
    started: float
    judge: MessageJudge | None  # OWN RPCs: judges each request message
    encoding: bytes | None  # its grpc-encoding
    inspector: MessageInspector | None = None  # follows its messages once one does not lie whole in a frame
    headers_sent: bool = False  # Triton has sent response headers on it
    ticket: Ticket | None = None  # waiting for an admission slot, or refused one (grpc_admission.StreamGate)
    holding: bool = False  # holds an admission slot
    held: list[bytes] | None = None  # its frames kept from Triton until it gets a slot
    held_bytes: int = 0  # their DATA payload bytes (flow-controlled)


class StreamTable:
    def __init__(self, state: ProxyState, credit: Callable[[int], None]) -> None:
        """``credit(n)``: give the client back ``n`` bytes of connection window (held DATA never sent)."""
        self._state = state
        self._admission = state.admission
        self._credit = credit
        self.active: dict[int, Stream] = {}  # one dict for the table's life (the relay keeps a reference)
        self.reset: dict[int, None] = {}  # forwarded, then reset by the proxy
        self.local: dict[int, None] = {}  # answered by the proxy
        self.client_max = 0  # highest stream id the client opened
        self.upstream_max = 0  # highest stream id forwarded to Triton
        self._meters: dict[str, RouteMeter] = {}  # by route

    def forward(self, stream_id: int, rule: GrpcRule, judge: MessageJudge | None, encoding: bytes | None) -> Stream:
        meter = self._meters.get(rule.route) or self._meter(rule.route)
        stream = self.active[stream_id] = Stream(rule, meter, meter.begin(), judge, encoding)
        self.upstream_max = stream_id
        return stream

    def _meter(self, route: str) -> RouteMeter:
        meter = self._meters[route] = self._state.metrics.meter(PROTOCOL, route)
        return meter

    def answer_locally(self, stream_id: int) -> None:
        _remember(self.local, stream_id)

    def known_upstream(self, stream_id: int) -> bool:
        """May frames of this stream go to Triton? Not if Triton never saw it (idle, or answered here),
        nor once the proxy has reset it."""
        return stream_id <= self.upstream_max and stream_id not in self.local and stream_id not in self.reset

    def finish(self, stream_id: int, code: str) -> bool:
        """Triton or the client ended a forwarded stream; False if it was not in flight."""
        stream = self.active.pop(stream_id, None)
        if stream is None:
            return False
        if stream.ticket is not None or stream.holding:
            self._leave(stream)
        if stream.inspector is not None:  # what it kept of a message in progress goes back
            stream.inspector.close()
        stream.meter.end(code, stream.started)
        return True

    def refuse(self, stream_id: int, refusal: Refusal) -> Stream:
        """A message of a forwarded stream is refused: the proxy resets it at Triton."""
        stream = self.active.pop(stream_id)
        if stream.ticket is not None or stream.holding:
            self._leave(stream)
        if stream.inspector is not None:  # what it kept of a message in progress goes back
            stream.inspector.close()
        _remember(self.reset, stream_id)
        stream.meter.end(STATUS_NAMES[refusal.status], stream.started)
        self._state.metrics.refused(PROTOCOL, stream.rule.route, refusal.reason)
        return stream

    def forget_local(self, stream_id: int) -> bool:
        """The client reset a stream the proxy answered; True if it was one."""
        if stream_id not in self.local:
            return False
        del self.local[stream_id]
        return True

    def end_all(self, code: str) -> None:
        streams = list(self.active.values())
        self.active.clear()
        for stream in streams:
            if stream.ticket is not None or stream.holding:
                self._leave(stream)
            if stream.inspector is not None:  # what it kept of a message in progress goes back
                stream.inspector.close()
            stream.meter.end(code, stream.started)

    def _leave(self, stream: Stream) -> None:
        """An admission-controlled stream is over: its slot goes to the next waiter, or it leaves the
        queue; frames it held back never reach Triton, so their bytes are credited to the client."""
        if stream.ticket is not None:  # waiting, or refused a slot: holds none (cancel is safe either way)
            stream.ticket.cancel()
            if stream.held_bytes:
                self._admission.held_bytes -= stream.held_bytes
                self._credit(stream.held_bytes)
            stream.ticket, stream.held, stream.held_bytes = None, None, 0
        elif stream.holding:
            stream.holding = False
            self._admission.release()


class ResetBudget:
    """A token bucket of the forwarded streams one client connection may end early: each such stream costs
    Triton a stream set up for nothing, and resets never count against SETTINGS_MAX_CONCURRENT_STREAMS."""

    __slots__ = ("_tokens", "_stamp")

    def __init__(self) -> None:
        self._tokens = float(RESET_BURST)
        self._stamp = time.monotonic()

    def spend(self) -> None:
        """One more stream ended early; raises :class:`~tritonshare.proxy.http2.FrameError` (ENHANCE_YOUR_CALM)
        once the budget is spent."""
        now = time.monotonic()
        self._tokens = min(RESET_BURST, self._tokens + (now - self._stamp) * RESETS_PER_S) - 1.0
        self._stamp = now
        if self._tokens < 0:
            raise http2.FrameError(
                f"the client ended streams early faster than {RESETS_PER_S:.0f} a second after a burst of "
                f"{RESET_BURST} (HTTP/2 rapid reset)",
                http2.ENHANCE_YOUR_CALM,
            )


class IdleWatch:
    """Ends a connection that had no stream open for a whole ``period_s`` (so for ``period_s`` to twice that),
    checked once a period: nothing is done per frame or per stream."""

    def __init__(
        self, streams: StreamTable, busy: Callable[[], bool], end: Callable[[], None], period_s: float
    ) -> None:
        """``busy``: is anything but a stream going on (an answer in progress)? ``end``: ends the connection."""
        self._streams = streams
        self._busy = busy
        self._end = end
        self._period_s = period_s
        self._was_busy = False  # a stream was open at the last check
        self._mark = streams.client_max  # the highest stream id then
        self._timer = asyncio.get_running_loop().call_later(period_s, self._check)

    def cancel(self) -> None:
        self._timer.cancel()

    def _check(self) -> None:
        streams = self._streams
        busy = bool(streams.active) or self._busy()
        if not (busy or self._was_busy or streams.client_max != self._mark):
            self._end()
            return
        self._was_busy, self._mark = busy, streams.client_max
        self._timer = asyncio.get_running_loop().call_later(self._period_s, self._check)


def _remember(ids: dict[int, None], stream_id: int) -> None:
    ids[stream_id] = None
    if len(ids) > _RECENT_LIMIT:
        del ids[next(iter(ids))]
