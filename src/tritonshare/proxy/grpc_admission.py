"""Admission control on the gRPC relay (issue 9): each inference stream (``admission.LIMITED_ROUTES``) takes a
slot of the model's :class:`~tritonshare.proxy.admission.Admission`, or waits for one without Triton
starting it meanwhile; a stream refused a slot gets RESOURCE_EXHAUSTED and is reset at Triton.

A waiting stream's HEADERS still go to Triton (dropping them would put Triton's HPACK table out of step)
and so does its first message but for the message's last byte: Triton (gRPC) hands a request to its
handler only once the whole message is in, so nothing is computed before the slot comes. That byte, the
rest of its DATA frame and every later frame of the stream are held in the proxy; once admitted they go
on in order, and if refused (or the stream ends first) their bytes are credited back to the client.

Why hold so little: held bytes use up the client's connection window (Triton credits bytes once it has
them). Holding a whole message — gRPC clients send megabyte DATA frames — would let a few waiting calls
fill Triton's 4 MiB connection window and stall the connection's admitted calls until the waiting ones
time out. One byte per waiting unary call cannot. Crediting held bytes to the client at once is no way
out: once they go on, the client could send Triton more than its window allows (FLOW_CONTROL_ERROR, which
ends every stream of the connection). What is left: a ModelStreamInfer client that keeps sending while
its stream waits holds up to its stream window; if that fills the connection window, the connection's
other streams wait until the slot comes or the wait times out.

That holds for a client that keeps to flow control. One that does not could make the proxy hold without
bound, so held bytes are counted for the whole proxy (``Admission.held_bytes``): past :data:`MAX_HELD_BYTES`
a waiting stream that holds more is refused RESOURCE_EXHAUSTED, as if the queue were full, and what it held
is dropped and credited back.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable

from tritonshare.proxy import http2
from tritonshare.proxy.admission import GRPC_STATUS, Admission
from tritonshare.proxy.admission import Refusal as AdmissionRefusal
from tritonshare.proxy.grpc_messages import Refusal
from tritonshare.proxy.grpc_streams import Stream, StreamTable

# Ends a forwarded stream for the client with a refusal: (stream id, refusal, grpc-retry-pushback-ms).
RefuseForwarded = Callable[[int, Refusal, int | None], None]
# Bytes the whole proxy holds for waiting streams, at most (and one read more): 16 clients' worth of Triton's
# 4 MiB connection window. A client held 4 GB here before, sending on while ignoring flow control.
MAX_HELD_BYTES = 64 << 20
HELD_TOO_MUCH = "the proxy holds {held} MiB for calls waiting for a slot (at most {most} MiB); retry later"


class StreamGate:
    """Admission control of one relayed connection's inference streams."""

    def __init__(
        self,
        admission: Admission,
        streams: StreamTable,
        *,
        to_client: Callable[[bytes], None],
        to_upstream: Callable[[bytes], None],
        refuse: RefuseForwarded,
    ) -> None:
        self._admission = admission
        self._streams = streams
        self._to_client = to_client
        self._to_upstream = to_upstream
        self._refuse = refuse
        self._refusing: set[int] = set()  # streams to be refused for holding too much, at the next turn

    def admit(self, stream_id: int, stream: Stream) -> None:
        """A new inference stream (its HEADERS go on): take a slot now, or wait for one."""
        if self._admission.try_acquire():
            stream.holding = True
        else:
            stream.ticket = self._admission.enqueue(functools.partial(self._answered, stream_id))

    def hold(self, stream_id: int, stream: Stream, data: bytes, pos: int, stop: int, flags: int) -> bytes | None:
        """A DATA frame (``data[pos:stop]``) of a waiting stream, its messages accepted so far: what goes to
        Triton now — None: all of it; b"": nothing; bytes: a shorter frame."""
        if stream.held is not None:  # behind the held tail, in order
            stream.held.append(data[pos:stop])
            self._count(stream_id, stream, stop - pos - http2.HEADER_SIZE)
            return b""
        assert stream.inspector is not None
        if stream.inspector.messages:  # this frame completes the first message
            return self._hold_tail(stream_id, stream, data, pos, stop, flags)
        if flags & http2.END_STREAM:  # ends before a whole message: held too (Triton would answer it)
            stream.held = [data[pos:stop]]
            self._count(stream_id, stream, stop - pos - http2.HEADER_SIZE)
            return b""
        return None

    def _count(self, stream_id: int, stream: Stream, size: int) -> None:
        """``size`` more bytes held for ``stream``; past :data:`MAX_HELD_BYTES` for the whole proxy, the stream
        is refused (between frames, as admission's answers come)."""
        stream.held_bytes += size
        self._admission.held_bytes += size
        if self._admission.held_bytes > MAX_HELD_BYTES and stream_id not in self._refusing:
            self._refusing.add(stream_id)
            asyncio.get_running_loop().call_soon(self._held_too_much, stream_id)

    def _held_too_much(self, stream_id: int) -> None:
        self._refusing.discard(stream_id)
        stream = self._streams.active.get(stream_id)
        if stream is None or stream.held is None:  # gone meanwhile, or admitted and its frames sent
            return
        message = HELD_TOO_MUCH.format(held=self._admission.held_bytes >> 20, most=MAX_HELD_BYTES >> 20)
        self._refuse(stream_id, Refusal(GRPC_STATUS, message, "held_bytes"), 1000)  # credits what it held
        self._to_upstream(http2.rst_stream(stream_id, http2.CANCEL))

    def _hold_tail(self, stream_id: int, stream: Stream, data: bytes, pos: int, stop: int, flags: int) -> bytes:
        """Cut the frame completing the first message (a DATA frame may be cut anywhere): up to the message's
        last byte it goes on now; from there it is held, END_STREAM on the held part."""
        assert stream.inspector is not None
        start, end = pos + http2.HEADER_SIZE, stop
        if flags & http2.PADDED:  # the padding is dropped: Triton's windows never see it, so credit it here
            first, last = http2.data_content(flags, memoryview(data)[start:stop])
            padding = (stop - start) - (last - first)
            start, end = start + first, start + last
            self._to_client(http2.window_update(0, padding) + http2.window_update(stream_id, padding))
        cut = stream.inspector.first_end - 1
        tail = data[cut:end]
        stream.held = [http2.frame(http2.DATA, flags & http2.END_STREAM, stream_id, tail)]
        self._count(stream_id, stream, len(tail))
        return http2.frame(http2.DATA, 0, stream_id, data[start:cut]) if cut > start else b""

    def _answered(self, stream_id: int, refusal: AdmissionRefusal | None) -> None:
        """Admission's answer for a waiting stream: a loop callback, so it comes between whole frames."""
        stream = self._streams.active.get(stream_id)
        if stream is None:  # not expected: a stream that ends cancels its ticket
            if refusal is None:
                self._admission.release()
            return
        if refusal is not None:  # the ticket stays: StreamTable._leave credits what the stream held
            status = Refusal(GRPC_STATUS, refusal.message, refusal.reason)
            self._refuse(stream_id, status, refusal.retry_after_s * 1000)
            self._to_upstream(http2.rst_stream(stream_id, http2.CANCEL))
            return
        self._admission.held_bytes -= stream.held_bytes
        held, stream.held, stream.held_bytes = stream.held, None, 0
        stream.ticket, stream.holding = None, True
        if held:
            self._to_upstream(b"".join(held))
