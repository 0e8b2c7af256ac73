"""The client's frames on one relayed gRPC connection other than DATA and header blocks, and the table by frame
type that the connection's read loop dispatches every frame through.

RST_STREAM, SETTINGS, PING, WINDOW_UPDATE and frame types HTTP/2 does not define pass on to Triton as they came
(SETTINGS and PING keep their meaning between the two ends, see :mod:`tritonshare.proxy.grpc`), but for what the
relay must keep Triton from seeing or must answer itself: a RST_STREAM or a stream WINDOW_UPDATE for a stream
Triton never saw is dropped (a connection error there, RFC 7540 §5.1); a forwarded stream the client resets
spends from its reset budget (rapid reset) — unless cancellations are absorbed: then it is abandoned, not reset at
Triton, and keeps its place under the cap on streams, and a reset of a stream Triton has ended is not passed on
either (:mod:`tritonshare.proxy.grpc_abandon`); a connection WINDOW_UPDATE has the DATA bytes of the proxy's own
answers taken off (:attr:`LocalAnswers.window_debt`). While the proxy answers every stream itself (Triton
unreachable, or the connection turned away), the connection's table is :meth:`ControlFrames.answering`: the proxy
acknowledges SETTINGS and PING, as Triton would. A client's PUSH_PROMISE, or any frame but a CONTINUATION inside
a header block, ends the connection.
"""

from __future__ import annotations

from collections.abc import Callable

from tritonshare.proxy import http2
from tritonshare.proxy.grpc_answers import LocalAnswers
from tritonshare.proxy.grpc_headers import ClientHeaders
from tritonshare.proxy.grpc_streams import ResetBudget, StreamTable

# Reads one frame (the read, the frame's start and end in it, its flags, its stream): None forwards it as it
# is, b"" drops it, other bytes go instead.
FrameHandler = Callable[[bytes, int, int, int, int], bytes | None]


class ControlFrames:
    """The client's RST_STREAM, WINDOW_UPDATE, and (while the proxy answers every stream) SETTINGS and PING
    frames of one connection.

    Its ``on_*`` and ``ack_*`` methods are the connection's handlers of those frames: they return None to forward
    the frame as it is, b"" to drop it, or bytes to send instead.
    """

    def __init__(
        self,
        streams: StreamTable,
        answers: LocalAnswers,
        resets: ResetBudget,
        to_client: Callable[[bytes], None],
        settled: Callable[[], None],
        *,
        absorb: bool,
    ) -> None:
        """``to_client``: writes the proxy's frames between Triton's; ``settled``: told when a stream is over (a
        draining connection may close then); ``absorb``: a client's reset is not passed on to Triton
        (:mod:`tritonshare.proxy.grpc_abandon`)."""
        self._streams = streams
        self._answers = answers
        self._resets = resets
        self._to_client = to_client
        self._settled = settled
        self._absorb = absorb

    def on_rst_stream(self, data: bytes, pos: int, stop: int, flags: int, stream_id: int) -> bytes | None:
        streams = self._streams
        if stream_id in streams.active:
            if self._absorb:
                # Left to run, it keeps its place under the cap on streams: no stream set up for nothing, so
                # nothing spent from the reset budget.
                instead = streams.abandon(stream_id)
                if instead is not None:
                    return instead
            self._resets.spend()
            streams.finish(stream_id, "cancelled")
            self._settled()
            return None
        if streams.forget_local(stream_id) or not streams.known_upstream(stream_id):
            return b""
        # Triton has ended it: a reset crossing Triton's answer is the very race that crashes Triton before 24.12.
        return streams.after_end(stream_id) if self._absorb else None

    def ack_settings(self, data: bytes, pos: int, stop: int, flags: int, stream_id: int) -> bytes | None:
        if not flags & http2.ACK:
            self._to_client(http2.SETTINGS_ACK)
        return None

    def ack_ping(self, data: bytes, pos: int, stop: int, flags: int, stream_id: int) -> bytes | None:
        if not flags & http2.ACK:
            self._to_client(http2.ping_ack(data[pos + http2.HEADER_SIZE : stop]))
        return None

    def on_window_update(self, data: bytes, pos: int, stop: int, flags: int, stream_id: int) -> bytes | None:
        if stream_id:
            return None if self._streams.known_upstream(stream_id) else b""
        answers = self._answers
        if not answers.window_debt or stop - pos < http2.HEADER_SIZE + 4:
            return None
        increment = http2.window_increment(memoryview(data)[pos + http2.HEADER_SIZE : stop])
        paid = min(increment, answers.window_debt)
        answers.window_debt -= paid
        return http2.window_update(0, increment - paid)

    def answering(self, handlers: tuple[FrameHandler, ...]) -> tuple[FrameHandler, ...]:
        """The connection's handlers by frame type once the proxy answers every stream itself: Triton, which would
        acknowledge the client's SETTINGS and PING, is not there."""
        table = list(handlers)
        table[http2.SETTINGS] = self.ack_settings
        table[http2.PING] = self.ack_ping
        return tuple(table)


def frame_handlers(
    on_data: FrameHandler, headers: ClientHeaders, control: ControlFrames
) -> tuple[tuple[FrameHandler, ...], tuple[FrameHandler, ...]]:
    """The handlers by frame type: of any frame, and of the frames that come while a header block is open (only
    its CONTINUATION frames may, RFC 7540 §6.10)."""
    frames = (
        on_data,
        headers.on_headers,
        _as_is,  # PRIORITY
        control.on_rst_stream,
        _as_is,  # SETTINGS
        _push_promise,
        _as_is,  # PING
        _as_is,  # GOAWAY
        control.on_window_update,
        headers.on_continuation,
    ) + (_as_is,) * 246  # extension frames (types 10-255) pass on: receivers ignore unknown types
    in_block = (_interrupted,) * http2.CONTINUATION + (headers.on_continuation,) + (_interrupted,) * 246
    return frames, in_block


def _as_is(data: bytes, pos: int, stop: int, flags: int, stream_id: int) -> bytes | None:
    return None


def _push_promise(data: bytes, pos: int, stop: int, flags: int, stream_id: int) -> bytes | None:
    raise http2.FrameError("a client sent PUSH_PROMISE: only servers may (RFC 9113 §8.4)")


def _interrupted(data: bytes, pos: int, stop: int, flags: int, stream_id: int) -> bytes | None:
    raise http2.FrameError("a header block was interrupted by another frame (RFC 7540 §6.10)")
