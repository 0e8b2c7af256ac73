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
    client_done: bool = False  # the client ended its side (END_STREAM)


class StreamTable:
    def __init__(self, state: ProxyState, credit: Callable[[int], None]) -> None:
        """``credit(n)``: give the client back ``n`` bytes of connection window (held DATA never sent)."""
        self._state = state
        self._admission = state.admission
        self._credit = credit
        self.active: dict[int, Stream] = {}  # one dict for the table's life (the relay keeps a reference)
        # Given up by the client, not by Triton, which runs them to their end (grpc_abandon): out of ``active``, so
        # no frame of the client's reaches Triton for them; still counted under the cap on open streams.
        self.abandoned: dict[int, Stream] = {}
        # Ended by Triton while the client's side was still open: whether the client's messages stood at a boundary
        # (recent ones; see after_end).
        self.half_open: dict[int, bool] = {}
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

    def finish(self, stream_id: int, code: str, *, triton_ended: bool = False) -> bool:
        """Triton or the client ended a forwarded stream; False if it was not in flight. ``triton_ended``: Triton
        ended its side (END_STREAM, not a reset), so the client's may still be open."""
        stream = self.active.pop(stream_id, None)
        if stream is None:
            if not self.abandoned:
                return False
            stream = self.abandoned.pop(stream_id, None)
            if stream is None:
                return False
            code = "cancelled"  # (by the client)
        if stream.ticket is not None or stream.holding:
            self._leave(stream)
        if triton_ended and not stream.client_done:  # (Triton ended it first: a streaming call)
            self.half_open[stream_id] = _at_boundary(stream)
            if len(self.half_open) > _RECENT_LIMIT:
                del self.half_open[next(iter(self.half_open))]
        if stream.inspector is not None:  # what it kept of a message in progress goes back
            stream.inspector.close()
        stream.meter.end(code, stream.started)
        return True

    def after_end(self, stream_id: int) -> bytes | None:
        """The client reset a stream Triton has ended: what Triton gets instead, when cancellations are absorbed —
        nothing if the client had ended its side too (the stream is closed at Triton), an empty DATA frame ending
        that side if it had not (between messages), or None: the reset goes on (a message half forwarded)."""
        boundary = self.half_open.pop(stream_id, None)
        if boundary is None:
            return b""
        return http2.end_stream(stream_id) if boundary else None

    def open_count(self) -> int:
        """Streams Triton runs for this connection: forwarded, and abandoned ones."""
        return len(self.active) + len(self.abandoned)

    def client_ended(self, stream_id: int) -> None:
        """The client's header block ended its side of a stream (its DATA frames are seen by the relay)."""
        stream = self.active.get(stream_id)
        if stream is not None:
            stream.client_done = True

    def abandon(self, stream_id: int) -> bytes | None:
        """The client gave up a forwarded stream (reset it, or left): it moves to :attr:`abandoned`, holding what
        it holds (its admission slot, its place among the streams) until Triton ends it, and no frame of it goes
        either way from now on (:meth:`known_upstream` is False). Returns what Triton gets instead of a
        cancellation (:mod:`tritonshare.proxy.grpc_abandon`), or None, nothing done, if the stream cannot be left
        to run: the caller resets it at Triton then."""
        stream = self.active.get(stream_id)
        if stream is None or stream.ticket is not None:
            return None  # (waiting for a slot: Triton holds its first message but for the last byte, computes nothing)
        if stream.client_done:  # Triton has the whole request: nothing to say
            instead = b""
        elif _at_boundary(stream):
            # Between messages: the request side ends here, as if the client had ended it (Triton answers what it
            # has, then ends the stream).
            instead = http2.end_stream(stream_id)
        else:
            return None
        stream.client_done = True  # (by the proxy, if not by the client)
        del self.active[stream_id]
        self.abandoned[stream_id] = stream
        _remember(self.reset, stream_id, self.abandoned)
        return instead

    def abandon_all(self) -> bytes:
        """The client's connection is gone: every forwarded stream is abandoned, or reset at Triton where it
        cannot be (see :meth:`abandon`). Returns the frames for Triton."""
        frames: list[bytes] = []
        for stream_id in list(self.half_open):  # ended by Triton, not yet by the client
            frames.append(self.after_end(stream_id) or http2.rst_stream(stream_id, http2.CANCEL))
        for stream_id in list(self.active):
            instead = self.abandon(stream_id)
            if instead is None:
                self.finish(stream_id, "closed")
                _remember(self.reset, stream_id, self.abandoned)
                frames.append(http2.rst_stream(stream_id, http2.CANCEL))
            elif instead:
                frames.append(instead)
        return b"".join(frames)

    def refuse(self, stream_id: int, refusal: Refusal) -> Stream:
        """A message of a forwarded stream is refused: the proxy resets it at Triton."""
        stream = self.active.pop(stream_id)
        if stream.ticket is not None or stream.holding:
            self._leave(stream)
        if stream.inspector is not None:  # what it kept of a message in progress goes back
            stream.inspector.close()
        _remember(self.reset, stream_id, self.abandoned)
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
        streams = [*self.active.values(), *self.abandoned.values()]
        self.active.clear()
        self.abandoned.clear()
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
        busy = bool(streams.active or streams.abandoned) or self._busy()
        if not (busy or self._was_busy or streams.client_max != self._mark):
            self._end()
            return
        self._was_busy, self._mark = busy, streams.client_max
        self._timer = asyncio.get_running_loop().call_later(self._period_s, self._check)


def _at_boundary(stream: Stream) -> bool:
    """Every message of the stream forwarded so far is whole (so ending its request side there is clean). Not
    known for a stream whose messages are not followed (no judge): False."""
    return stream.judge is not None and (stream.inspector is None or stream.inspector.between_messages())


def _remember(ids: dict[int, None], stream_id: int, running: dict[int, Stream] | None = None) -> None:
    """Add a stream id to a bounded set of recent ones; the oldest goes, unless it is still ``running`` at Triton
    (abandoned: its frames must still be dropped and credited)."""
    ids[stream_id] = None
    if len(ids) > _RECENT_LIMIT:
        oldest = next(iter(ids))
        del ids[oldest]
        if running and oldest in running:
            ids[oldest] = None
