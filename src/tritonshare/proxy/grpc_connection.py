"""One relayed gRPC client connection: its frames judged on the way to its own Triton connection.

See :mod:`tritonshare.proxy.grpc` for the design. This side parses every client frame, judges each request
message of a stream it forwarded, and forwards whole frames — as they came whenever possible, so a read
usually leaves in one write without a copy. Its header blocks (a new stream's ``:path`` judged, the stream
opened) are read by :mod:`tritonshare.proxy.grpc_headers`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol, cast

from tritonshare.proxy import grpc_replies, http2
from tritonshare.proxy.grpc_admission import StreamGate
from tritonshare.proxy.grpc_answers import LocalAnswers
from tritonshare.proxy.grpc_headers import ClientHeaders
from tritonshare.proxy.grpc_messages import MessageInspector, Refusal
from tritonshare.proxy.grpc_streams import PROTOCOL, IdleWatch, ResetBudget, Stream, StreamTable
from tritonshare.proxy.grpc_upstream import UpstreamConnection
from tritonshare.proxy.grpc_verdicts import TRITON_DOWN, Unavailable
from tritonshare.proxy.hpack_codec import HpackError
from tritonshare.proxy.overload import Lingering
from tritonshare.proxy.state import ProxyState

logger = logging.getLogger(__name__)

_PENDING_LIMIT = 1 << 20  # client bytes buffered while Triton's connection opens; reading pauses beyond
SILENT_TIMEOUT_S = 30.0  # a client connection that sends no byte for this long is closed
_STATUS_LABELS = grpc_replies.STATUS_LABELS
# Why reading the client is paused (bits): Triton's connection or the client's has too much to write, or too
# many bytes wait for Triton's connection to open.
_TRITON_FULL, _CLIENT_FULL, _PENDING_FULL = 1, 2, 4

# Opens the connection to Triton for one client connection (a seam: tests pass their own).
OpenUpstream = Callable[[Callable[[], UpstreamConnection]], Awaitable[UpstreamConnection]]
# Reads one frame (the read, the frame's start and end in it, its flags, its stream): None forwards it as it
# is, b"" drops it, other bytes go instead.
FrameHandler = Callable[[bytes, int, int, int, int], bytes | None]
# Frame constants read for every frame, as module globals (an attribute lookup each is measurable).
_HEADER_SIZE, _STREAM_ID_MASK = http2.HEADER_SIZE, http2.STREAM_ID_MASK
_SMALL_READ = 4096  # reads shorter than this, of an incomplete frame, are copied into one buffer


class Host(Protocol):
    """What a connection needs of the front end that accepted it."""

    connections: set[ClientConnection]
    draining: bool
    open_upstream: OpenUpstream
    upstream_address: str  # for log lines


class ClientConnection(asyncio.Protocol):
    """One client connection: judges its frames and forwards them to its own Triton connection."""

    _silence: asyncio.TimerHandle | None  # closes a connection that stays silent (from connection_made)

    def __init__(self, host: Host, state: ProxyState, *, turned_away: Unavailable | None = None) -> None:
        """``turned_away``: the connection is past ``--max-connections`` (:mod:`tritonshare.proxy.overload`); it
        answers the client's streams itself, then goes away."""
        self._host = host
        self._state = state
        self.transport: asyncio.Transport | None = None
        self._upstream: UpstreamConnection | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._pending: list[bytes] | None = []  # client bytes received while Triton's connection opens
        self._pending_size = 0
        self._unavailable = turned_away  # set: answer every stream UNAVAILABLE, for this reason
        self._partial: list[bytes | bytearray | memoryview] = []  # pieces of a frame not yet complete
        self._partial_size = 0
        self._partial_need = 0  # that frame's full size (0: its 9-byte header is not complete yet)
        self._preface_left = len(http2.PREFACE)
        self._max_frame = http2.DEFAULT_MAX_FRAME_SIZE  # the largest the client may send: Triton's SETTINGS say
        self._max_header_bytes = state.settings.max_header_bytes
        self._max_streams = state.settings.grpc_max_streams
        self._paused = 0  # why reading the client is paused (_TRITON_FULL | _CLIENT_FULL | _PENDING_FULL)
        self._resets = ResetBudget()
        self._idle: IdleWatch | None = None  # once the client has sent bytes
        self._streams = StreamTable(state, self._credit)
        self._active = self._streams.active  # read for every DATA frame
        self._answers = LocalAnswers(state, self._streams, self._to_client, self._close_if_drained)
        self._gate: StreamGate | None = None  # admission control, when on
        if state.admission.active:
            self._gate = StreamGate(
                state.admission,
                self._streams,
                to_client=self._to_client,
                to_upstream=self._to_upstream,
                refuse=self._answers.refuse_forwarded,
            )
        self.reset_streams = self._streams.reset  # read by the Triton side for every frame
        self._goaway_last: int | None = None
        self._headers = ClientHeaders(self, state, self._streams, self._answers, self._gate, self._to_client)
        self._frame_handlers: tuple[FrameHandler, ...] = (
            self._on_data,
            self._headers.on_headers,
            _as_is,
            self._on_rst_stream,
            self._on_settings,
            _push_promise,
            self._on_ping,
            _as_is,
            self._on_window_update,
            self._headers.on_continuation,
        ) + (_as_is,) * 246  # extension frames (types 10-255) pass on: receivers ignore unknown types
        # Inside a header block only its CONTINUATION frames may come (RFC 7540 §6.10).
        self._block_handlers: tuple[FrameHandler, ...] = (
            (_interrupted,) * http2.CONTINUATION + (self._headers.on_continuation,) + (_interrupted,) * 246
        )
        self._handlers: tuple[FrameHandler, ...] = (
            self._frame_handlers
        )  # by frame type; the block's own while a header block is open

    # ---------------------------------------------------------------------------------- lifecycle

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it
        if self._unavailable is not None:  # turned away: takes no place, opens nothing at Triton
            self._pending, self._silence = None, None
            self._become_unavailable(self._unavailable)
            return
        self._host.connections.add(self)
        # Triton's connection opens with the client's first bytes, not at accept: bare TCP connects must not
        # hold connections on the node's shared Triton; one that stays silent is closed.
        self._silence = asyncio.get_running_loop().call_later(SILENT_TIMEOUT_S, self._close_silent)
        if self._host.draining:
            self.begin_drain()

    def _close_silent(self) -> None:
        if self.transport is not None and self._connecting is None:
            self.transport.close()

    async def _connect(self) -> None:
        client = self.transport
        assert client is not None
        try:
            upstream = await asyncio.wait_for(
                self._host.open_upstream(lambda: UpstreamConnection(self, client, self._max_streams)),
                self._state.settings.connect_timeout_s,
            )
        except (OSError, TimeoutError) as exc:
            self._state.metrics.upstream_error(PROTOCOL)
            logger.warning(
                "Triton gRPC at %s is unreachable (%s): answering UNAVAILABLE",
                self._host.upstream_address,
                exc or "connect timeout",
            )
            self._become_unavailable(TRITON_DOWN)
        else:
            if client.is_closing():
                if upstream.transport is not None:
                    upstream.transport.close()
                return
            self._upstream = upstream
        pending, self._pending = self._pending or [], None
        self._pause_client(_PENDING_FULL, False)
        for data in pending:
            if self.transport is None:  # ended while relaying what came before (see _close_with)
                break
            self._relay(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._host.connections.discard(self)
        if self._silence is not None:
            self._silence.cancel()
        if self._idle is not None:
            self._idle.cancel()
        if self._connecting is not None:
            self._connecting.cancel()
        self._answers.cancel()
        if self._upstream is not None and self._upstream.transport is not None:
            self._upstream.transport.close()
        self._streams.end_all("closed")

    def upstream_lost(self, exc: Exception | None) -> None:
        if self.transport is not None and not self.transport.is_closing():
            if exc is not None or self._streams.active:
                self._state.metrics.upstream_error(PROTOCOL)
                logger.warning(
                    "connection to Triton gRPC lost (%s): closing the client's connection", exc or "closed by Triton"
                )
            self.transport.close()
        self._streams.end_all("closed")

    # Backpressure: a full write buffer on one side pauses reading on the other. A client's full one pauses
    # reading the client too: what it sends may be answered by the proxy itself (refusals, window credits), and
    # a client that never reads must not make those pile up.

    def pause_writing(self) -> None:
        _pause_reading(self._upstream.transport if self._upstream else None, True)
        self._pause_client(_CLIENT_FULL, True)

    def resume_writing(self) -> None:
        _pause_reading(self._upstream.transport if self._upstream else None, False)
        self._pause_client(_CLIENT_FULL, False)

    def upstream_paused(self, paused: bool) -> None:
        self._pause_client(_TRITON_FULL, paused)

    def _pause_client(self, reason: int, paused: bool) -> None:
        """Reading the client pauses while any reason holds, and resumes once none does."""
        before = self._paused
        self._paused = before | reason if paused else before & ~reason
        if bool(before) != bool(self._paused):
            _pause_reading(self.transport, paused)

    def client_may_send(self, max_frame_size: int) -> None:
        """Triton's SETTINGS_MAX_FRAME_SIZE is on its way to the client (never lowered: frames sent before the
        client read it may be in flight)."""
        self._max_frame = max(self._max_frame, max_frame_size)

    def begin_drain(self) -> None:
        """GOAWAY: the client opens no new stream here; streams it already opened go on."""
        if self._goaway_last is not None:
            return
        self._headers.forget_forwarded()
        self._goaway_last = self._streams.client_max
        self._to_client(http2.goaway(self._goaway_last))
        self._close_if_drained()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()
        if self._upstream is not None and self._upstream.transport is not None:
            self._upstream.transport.abort()

    @property
    def goaway_last(self) -> int | None:
        return self._goaway_last

    @property
    def unavailable(self) -> Unavailable | None:
        return self._unavailable

    def expect_continuation(self, expected: bool) -> None:
        """A header block is open (True): until it ends only its CONTINUATION frames may come (RFC 7540 §6.10)."""
        self._handlers = self._block_handlers if expected else self._frame_handlers

    def _close_if_drained(self) -> None:
        drained = self._goaway_last is not None and not self._streams.active and not self._answers.tasks
        if drained and self.transport is not None:
            asyncio.get_running_loop().call_soon(self.transport.close)

    # ---------------------------------------------------------------------------------- Triton's side

    def response_headers(self, stream_id: int, end_stream: bool, status: bytes | None) -> None:
        if not end_stream:
            stream = self._active.get(stream_id)
            if stream is not None:
                stream.headers_sent = True
        elif (
            self._streams.finish(stream_id, _STATUS_LABELS.get(status or b"", "unknown"))
            and self._goaway_last is not None
        ):
            self._close_if_drained()

    def response_ended(self, stream_id: int, code: str) -> None:
        if self._streams.finish(stream_id, code) and self._goaway_last is not None:
            self._close_if_drained()

    # ---------------------------------------------------------------------------------- client's side

    def data_received(self, data: bytes) -> None:
        if self._pending is None and not self._partial and not self._unavailable:
            try:  # the common case: Triton's connection is open, no frame left over from the last read
                self._relay_frames(data, 0)
            except (http2.FrameError, HpackError) as exc:
                self._fail(exc)
            return
        if self._pending is not None:  # Triton's connection is still opening
            if self._connecting is None:
                self._first_bytes()
            self._pending.append(data)
            self._pending_size += len(data)
            if self._pending_size > _PENDING_LIMIT:
                self._pause_client(_PENDING_FULL, True)
            return
        self._relay(data)

    def _first_bytes(self) -> None:
        """The client spoke: Triton's connection opens, and the connection is closed once idle for long."""
        if self._silence is not None:
            self._silence.cancel()
        self._connecting = asyncio.get_running_loop().create_task(self._connect())
        if (idle_s := self._state.settings.grpc_idle_timeout_s) > 0:
            self._idle = IdleWatch(self._streams, lambda: bool(self._answers.tasks), self._end_idle, idle_s)

    def _end_idle(self) -> None:
        """No stream for a while: GOAWAY NO_ERROR (clients reconnect when they need to), so an unused connection
        does not hold one of Triton's."""
        logger.info("closing a gRPC client connection that had no stream open for a while")
        self._close_with(http2.goaway(self._streams.client_max))

    def _relay(self, data: bytes) -> None:
        try:
            pos = self._complete_partial(data) if self._partial else 0
            if pos >= 0:
                self._relay_frames(data, pos)
        except (http2.FrameError, HpackError) as exc:
            self._fail(exc)
            return
        if self._unavailable and self._streams.local:  # every stream so far is answered: go away
            self._close_with(http2.goaway(self._streams.client_max))

    def _fail(self, exc: http2.FrameError | HpackError) -> None:
        logger.warning("closing a gRPC client connection: %s", exc)
        code = http2.COMPRESSION_ERROR if isinstance(exc, HpackError) else exc.code
        self._close_with(http2.goaway(self._streams.client_max, code))

    def _close_with(self, frames: bytes) -> None:
        """Send the client these last frames, then end the connection: it lingers (:class:`Lingering`), and
        this one is done with at once (its streams, its Triton connection)."""
        self._to_client(frames)
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.set_protocol(Lingering(transport))
            self.transport = None  # the client's is Lingering's now: Triton's side, closing, must not close it
            self.connection_lost(None)

    def _complete_partial(self, data: bytes) -> int:
        """Add a read to the incomplete frame; once complete, relay it. Returns where the rest of ``data``
        starts, or -1 if the frame is still incomplete. Pieces are joined once: a frame may be megabytes."""
        if not self._partial_need:  # rare: a read ended inside a frame header
            data = b"".join(self._partial) + data
            self._partial.clear()
            self._partial_size = 0
            self._relay_frames(data, 0)
            return -1
        need = self._partial_need - self._partial_size
        if len(data) < need:
            partial = self._partial
            if len(data) >= _SMALL_READ:
                partial.append(data)
            elif partial and type(partial[-1]) is bytearray:  # small reads share one buffer: an object for
                partial[-1] += data  # each read of a frame trickled in 2-byte writes took 6× its size
            else:
                partial.append(bytearray(data))
            self._partial_size += len(data)
            return -1
        self._partial.append(memoryview(data)[:need])
        frame = b"".join(self._partial)
        self._partial.clear()
        self._partial_need = self._partial_size = 0
        self._relay_frames(frame, 0)
        return need

    def _relay_frames(self, data: bytes, start: int) -> None:
        """Judge the whole frames of ``data[start:]``, keep an incomplete last one, forward the rest."""
        pos, end = start + self._skip_preface(data, start) if self._preface_left else start, len(data)
        chunks: list[bytes | memoryview] = []
        run = start  # bytes from here on are forwarded as they are (the preface included)
        unpack = http2.FRAME_HEADER.unpack_from
        while end - pos >= _HEADER_SIZE:
            high, low, kind, flags, stream_id = unpack(data, pos)
            stop = pos + _HEADER_SIZE + (high << 16 | low)
            if stop > end:
                break
            replacement = self._handlers[kind](data, pos, stop, flags, stream_id & _STREAM_ID_MASK)
            if replacement is not None:
                if run < pos:
                    chunks.append(memoryview(data)[run:pos])
                if replacement:
                    chunks.append(replacement)
                run = stop
            pos = stop
        if pos < end:
            self._keep_partial(data, pos)
        upstream = self._upstream
        if upstream is None or upstream.transport is None or upstream.transport.is_closing():
            return
        if chunks:
            if run < pos:
                chunks.append(memoryview(data)[run:pos])
            upstream.transport.writelines(chunks)
        elif run == 0 and pos == end:
            upstream.transport.write(data)
        elif run < pos:
            upstream.transport.write(memoryview(data)[run:pos])

    def _keep_partial(self, data: bytes, pos: int) -> None:
        """Keep the incomplete frame at the end of a read (a view: no copy yet), unless it is longer than the
        client may send: refused before it is held. (A frame whole in one read is at most a read long; what
        passes of those, Triton refuses itself.)"""
        if len(data) - pos >= _HEADER_SIZE:
            length, kind, _, _ = http2.parse_header(data, pos)
            if length > self._max_frame:
                raise http2.FrameError(
                    f"{length}-byte frame: larger than the {self._max_frame} bytes of SETTINGS_MAX_FRAME_SIZE",
                    http2.FRAME_SIZE_ERROR,
                )
            if (kind == http2.HEADERS or kind == http2.CONTINUATION) and length > self._max_header_bytes:
                raise http2.FrameError(f"header block larger than {self._max_header_bytes} bytes")
            self._partial_need = _HEADER_SIZE + length
        self._partial.append(memoryview(data)[pos:])
        self._partial_size = len(data) - pos

    def _skip_preface(self, data: bytes, pos: int) -> int:
        offset = len(http2.PREFACE) - self._preface_left
        take = min(self._preface_left, len(data) - pos)
        if data[pos : pos + take] != http2.PREFACE[offset : offset + take]:
            raise http2.FrameError("the client did not start with the HTTP/2 preface (is it a gRPC client?)")
        self._preface_left -= take
        return take

    def _to_upstream(self, frames: bytes) -> None:
        """The proxy's own frames (or held ones) to Triton, between whole client frames."""
        if self._upstream is not None:
            self._upstream.send(frames)

    def _to_client(self, frames: bytes) -> None:
        """The proxy's own frames to the client, between Triton's frames."""
        if self._upstream is not None:
            self._upstream.inject(frames)
        elif self.transport is not None and not self.transport.is_closing():
            self.transport.write(frames)

    # Frame handlers: return None to forward the frame as it is, b"" to drop it, or bytes to send instead.

    def _on_data(self, data: bytes, pos: int, stop: int, flags: int, stream_id: int) -> bytes | None:
        stream = self._active.get(stream_id)
        if stream is None:
            known = self._streams.known_upstream(stream_id)
            return None if known else self._drop_data(stop - pos - _HEADER_SIZE)
        inspector = stream.inspector
        if inspector is not None:
            refusal = self._inspect(inspector, data, pos, stop, flags)
        elif stream.judge is None:
            return None  # not inspected (ALLOW)
        elif flags & http2.PADDED:
            inspector = stream.inspector = MessageInspector(stream.judge, encoding=stream.encoding)
            refusal = self._inspect(inspector, data, pos, stop, flags)
        else:  # while every message lay whole in its frame, they are judged with no state of the stream's
            rest = stream.judge.whole(data, pos + _HEADER_SIZE, stop)
            if rest == stop:
                return None
            refusal = rest if isinstance(rest, Refusal) else self._inspect_from(stream, data, rest, stop)
        if refusal is None:
            if stream.ticket is None:
                return None
            assert self._gate is not None
            return self._gate.hold(stream_id, stream, data, pos, stop, flags)
        self._answers.refuse_forwarded(stream_id, refusal)
        self._drop_data(stop - pos - _HEADER_SIZE)
        self._resets.spend()
        return http2.rst_stream(stream_id, http2.CANCEL)

    def _inspect(self, inspector: MessageInspector, data: bytes, pos: int, stop: int, flags: int) -> Refusal | None:
        """Feed a DATA frame's content (padding left out) to a stream's inspector."""
        if flags & http2.PADDED:
            first, last = http2.data_content(flags, memoryview(data)[pos + _HEADER_SIZE : stop])
            return inspector.feed(data, pos + _HEADER_SIZE + first, pos + _HEADER_SIZE + last)
        return inspector.feed(data, pos + _HEADER_SIZE, stop)

    def _inspect_from(self, stream: Stream, data: bytes, start: int, stop: int) -> Refusal | None:
        """A message that does not lie whole in its frame starts at ``start``: the stream follows its messages
        from there on."""
        assert stream.judge is not None
        stream.inspector = MessageInspector(stream.judge, encoding=stream.encoding)
        return stream.inspector.feed(data, start, stop)

    def _drop_data(self, length: int) -> bytes:
        """A client DATA frame Triton must not see: credit its bytes back to the client's window."""
        self._credit(length)
        return b""

    def _credit(self, length: int) -> None:
        if length:
            self._to_client(http2.window_update(0, length))

    def _on_rst_stream(self, data: bytes, pos: int, stop: int, flags: int, stream_id: int) -> bytes | None:
        if self._streams.finish(stream_id, "cancelled"):
            self._resets.spend()
            self._close_if_drained()
            return None
        if self._streams.forget_local(stream_id):
            return b""
        return None if self._streams.known_upstream(stream_id) else b""

    def _on_settings(self, data: bytes, pos: int, stop: int, flags: int, stream_id: int) -> bytes | None:
        if self._unavailable and not flags & http2.ACK:
            self._to_client(http2.SETTINGS_ACK)
        return None

    def _on_ping(self, data: bytes, pos: int, stop: int, flags: int, stream_id: int) -> bytes | None:
        if self._unavailable and not flags & http2.ACK:
            self._to_client(http2.frame(http2.PING, http2.ACK, 0, data[pos + http2.HEADER_SIZE : stop]))
        return None

    def _on_window_update(self, data: bytes, pos: int, stop: int, flags: int, stream_id: int) -> bytes | None:
        if stream_id:
            return None if self._streams.known_upstream(stream_id) else b""
        answers = self._answers
        if not answers.window_debt or stop - pos < http2.HEADER_SIZE + 4:
            return None
        increment = http2.window_increment(memoryview(data)[pos + http2.HEADER_SIZE : stop])
        paid = min(increment, answers.window_debt)
        answers.window_debt -= paid
        return http2.window_update(0, increment - paid)

    # ---------------------------------------------------------------------------------- Triton down

    def _become_unavailable(self, why: Unavailable) -> None:
        """Triton cannot be reached, or the connection is turned away: be a minimal HTTP/2 server that answers
        every stream UNAVAILABLE, then GOAWAY (see :meth:`_relay`); a client that opens no stream is let go after
        a while. (A GOAWAY at once, before any stream, would not do: grpcio retries the calls it did not send,
        transparently and at once, in a loop.)"""
        self._unavailable = why
        self._headers.forget_forwarded()
        self._to_client(http2.settings({http2.SETTINGS_MAX_CONCURRENT_STREAMS: self._max_streams}))
        if self.transport is not None:
            transport = self.transport
            asyncio.get_running_loop().call_later(
                self._state.settings.connect_timeout_s,
                lambda: None if transport.is_closing() else self._close_with(http2.goaway(self._streams.client_max)),
            )


def _pause_reading(transport: asyncio.Transport | None, paused: bool) -> None:
    if transport is None or transport.is_closing():
        return
    if paused:
        transport.pause_reading()
    else:
        transport.resume_reading()


def _as_is(data: bytes, pos: int, stop: int, flags: int, stream_id: int) -> bytes | None:
    return None


def _push_promise(data: bytes, pos: int, stop: int, flags: int, stream_id: int) -> bytes | None:
    raise http2.FrameError("a client sent PUSH_PROMISE: only servers may (RFC 9113 §8.4)")


def _interrupted(data: bytes, pos: int, stop: int, flags: int, stream_id: int) -> bytes | None:
    raise http2.FrameError("a header block was interrupted by another frame (RFC 7540 §6.10)")
