"""One relayed gRPC client connection: its frames judged on the way to its own Triton connection.

See :mod:`tritonshare.proxy.grpc` for the design. This side parses every client frame, judges each request
message of a stream it forwarded, and forwards whole frames — as they came whenever possible, so a read
usually leaves in one write without a copy. Each frame goes to a handler by its type, from the table of
:mod:`tritonshare.proxy.grpc_control`: DATA frames are judged here; header blocks (a new stream's ``:path``
judged, the stream opened) are read by :mod:`tritonshare.proxy.grpc_headers`; the other frames by
:mod:`tritonshare.proxy.grpc_control`. Triton's connection opens with the client's first bytes
(:mod:`tritonshare.proxy.grpc_opening`); while it cannot be reached, this side answers every stream itself.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol, cast

from tritonshare.proxy import grpc_replies, http2
from tritonshare.proxy.grpc_abandon import OrphanedCalls
from tritonshare.proxy.grpc_admission import StreamGate
from tritonshare.proxy.grpc_answers import LocalAnswers
from tritonshare.proxy.grpc_control import ControlFrames, FrameHandler, frame_handlers
from tritonshare.proxy.grpc_headers import ClientHeaders
from tritonshare.proxy.grpc_messages import MessageInspector, MessageJudge, Refusal
from tritonshare.proxy.grpc_opening import OpenUpstream, UpstreamOpening
from tritonshare.proxy.grpc_streams import PROTOCOL, IdleWatch, ResetBudget, Stream, StreamTable
from tritonshare.proxy.grpc_upstream import UpstreamConnection
from tritonshare.proxy.grpc_verdicts import TRITON_DOWN, Unavailable
from tritonshare.proxy.hpack_codec import HeaderBlock, HpackError
from tritonshare.proxy.overload import Lingering
from tritonshare.proxy.state import ProxyState

logger = logging.getLogger(__name__)

_STATUS_LABELS = grpc_replies.STATUS_LABELS
# Why reading the client is paused (bits): Triton's connection or the client's has too much to write, or too
# many bytes wait for Triton's connection to open.
_TRITON_FULL, _CLIENT_FULL, _HELD_FULL = 1, 2, 4
# Frame constants read for every frame, as module globals (an attribute lookup each is measurable).
_HEADER_SIZE, _STREAM_ID_MASK, _END_STREAM = http2.HEADER_SIZE, http2.STREAM_ID_MASK, http2.END_STREAM
_SMALL_READ = 4096  # reads shorter than this, of an incomplete frame, are copied into one buffer
_U32 = http2.U32
_ZERO = bytes(4)  # the connection's stream id
# A remembered unary call (see ClientConnection._call): the read's length; where its DATA frame ends; its bytes up to
# the end of what judged its message, cut where its stream id stands (in the HEADERS frame, the stream's WINDOW_UPDATE
# frames, the DATA frame); where the header block's fragment ends, where the DATA frame starts; the bytes after it (the
# connection's WINDOW_UPDATE frames); the header block, the message judge. (Bytes are compared as slices: a
# ``startswith`` call parses its arguments, ~400 instructions.)
Call = tuple[int, int, tuple[bytes, ...], int, int, int, bytes, HeaderBlock, MessageJudge]


class Host(Protocol):
    """What a connection needs of the front end that accepted it."""

    connections: set[ClientConnection]
    draining: bool
    open_upstream: OpenUpstream
    upstream_address: str  # for log lines


class ClientConnection(asyncio.Protocol):
    """One client connection: judges its frames and forwards them to its own Triton connection."""

    def __init__(self, host: Host, state: ProxyState, *, turned_away: Unavailable | None = None) -> None:
        """``turned_away``: the connection is past ``--max-connections`` (:mod:`tritonshare.proxy.overload`) or
        plain text on the TLS port (:mod:`tritonshare.proxy.plaintext`); it answers the client's streams itself,
        before any check of the call, then goes away."""
        self._host = host
        self._state = state
        self.transport: asyncio.Transport | None = None
        self._upstream: UpstreamConnection | None = None
        self._opening: UpstreamOpening | None = None  # from connection_made until Triton's connection is open
        self._unavailable = turned_away  # set: answer every stream UNAVAILABLE, for this reason
        self._partial: list[bytes | bytearray | memoryview] = []  # pieces of a frame not yet complete
        self._partial_size = 0
        self._partial_need = 0  # that frame's full size (0: its 9-byte header is not complete yet)
        self._preface_left = len(http2.PREFACE)
        self._max_frame = http2.DEFAULT_MAX_FRAME_SIZE  # the largest the client may send: Triton's SETTINGS say
        self._max_header_bytes = state.settings.max_header_bytes
        self._max_streams = state.settings.grpc_max_streams
        self._paused = 0  # why reading the client is paused (_TRITON_FULL | _CLIENT_FULL | _HELD_FULL)
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
        # The last read that was one DATA frame holding one whole message, passed on a stream judged frame by frame:
        # (its bytes up to the end of what its judgment read, its length, its stream id, its stream). A read that
        # repeats them, on that stream still so judged, is the same judgment (see _repeats).
        self._same: tuple[bytes, int, int, Stream] | None = None
        # The last read that was one unary call whole: a HEADERS frame opening a stream with the block last forwarded,
        # then one DATA frame ending that stream, holding one uncompressed message passed. A read that repeats it, its
        # stream id aside, opens its stream as that block opens one and is judged as it was (see _calls_again).
        self._call: Call | None = None
        self._goaway_last: int | None = None
        self._absorb = state.settings.grpc_cancellations == "absorb"
        self._orphaned: OrphanedCalls | None = None  # the client is gone; calls it abandoned run on at Triton
        self._headers = ClientHeaders(self, state, self._streams, self._answers, self._gate, self._to_client)
        self._control = ControlFrames(
            self._streams, self._answers, self._resets, self._to_client, self._close_if_drained, absorb=self._absorb
        )
        self._frame_handlers, self._block_handlers = frame_handlers(self._on_data, self._headers, self._control)
        # By frame type; the block's own while a header block is open.
        self._handlers: tuple[FrameHandler, ...] = self._frame_handlers

    # ---------------------------------------------------------------------------------- lifecycle

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it
        if self._unavailable is not None:  # turned away: takes no place, opens nothing at Triton
            self._become_unavailable(self._unavailable)
            return
        self._host.connections.add(self)
        client = self.transport
        self._opening = UpstreamOpening(
            self,
            client,
            self._state,
            open_upstream=self._host.open_upstream,
            upstream_address=self._host.upstream_address,
            new_upstream=lambda: UpstreamConnection(self, client, self._max_streams),
        )
        if self._host.draining:
            self.begin_drain()

    def opened(self, upstream: UpstreamConnection | None, held: list[bytes]) -> None:
        """Triton's connection is open (None: Triton cannot be reached): the client's bytes ``held`` meanwhile
        go on."""
        if upstream is None:
            self._become_unavailable(TRITON_DOWN)
        else:
            self._upstream = upstream
        self._opening = None
        self._pause_client(_HELD_FULL, False)
        for data in held:
            if self.transport is None:  # ended while relaying what came before (see _close_with)
                break
            self._relay(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._opening is not None:
            self._opening.cancel()
        if self._idle is not None:
            self._idle.cancel()
        self._answers.cancel()
        upstream = self._upstream
        streams = self._streams
        if (
            self._absorb
            and upstream is not None
            and self._orphaned is None
            and (streams.open_count() or streams.half_open)
        ):
            # Triton is not told: the calls run to their end there (grpc_abandon), each stream's request side ended
            # (whether Triton's was); the connection is counted among the host's until they have.
            upstream.orphaned = True
            upstream.send(streams.abandon_all())
            if streams.abandoned:
                bound_s = self._state.settings.drain_timeout_s
                self._orphaned = OrphanedCalls(len(streams.abandoned), bound_s, self._settle)
                return
        self._settle()

    def _settle(self) -> None:
        """Done with the connection: Triton's is closed, the streams left are over."""
        self._host.connections.discard(self)
        if self._orphaned is not None:
            self._orphaned.cancel()
        if self._upstream is not None and self._upstream.transport is not None:
            self._upstream.transport.close()
        self._streams.end_all("closed")

    def upstream_lost(self, exc: Exception | None) -> None:
        if self.transport is not None and not self.transport.is_closing():
            if exc is not None or self._streams.open_count():
                self._state.metrics.upstream_error(PROTOCOL)
                logger.warning(
                    "connection to Triton gRPC lost (%s): closing the client's connection", exc or "closed by Triton"
                )
            self.transport.close()
        if self._orphaned is not None:
            self._settle()  # (its streams end there)
        else:
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
        drained = self._goaway_last is not None and not self._streams.open_count() and not self._answers.tasks
        if drained and self.transport is not None:
            asyncio.get_running_loop().call_soon(self.transport.close)

    # ---------------------------------------------------------------------------------- Triton's side

    def response_headers(self, stream_id: int, end_stream: bool, status: bytes | None) -> None:
        if not end_stream:
            stream = self._active.get(stream_id)
            if stream is not None:
                stream.headers_sent = True
        elif self._streams.finish(stream_id, _STATUS_LABELS.get(status or b"", "unknown"), triton_ended=True):
            self._stream_over()

    def response_ended(self, stream_id: int, code: str) -> None:
        if self._streams.finish(stream_id, code, triton_ended=code != "reset"):
            self._stream_over()

    def abandoned(self, stream_id: int) -> bool:
        return stream_id in self._streams.abandoned

    def _stream_over(self) -> None:
        """Triton ended a forwarded stream: a draining connection may close, a gone client's be done with."""
        if self._orphaned is not None:
            self._orphaned.ended(len(self._streams.abandoned))
        elif self._goaway_last is not None:
            self._close_if_drained()

    # ---------------------------------------------------------------------------------- client's side

    def data_received(self, data: bytes) -> None:
        if self._opening is None and not self._partial and not self._unavailable:
            same = self._same
            if same is not None and len(data) == same[1] and data[: len(same[0])] == same[0] and self._repeats(same):
                if self._upstream is not None:  # the next message of a stream, as the last one (bidi streaming)
                    self._upstream.send(data)
                return
            call = self._call
            if call is not None and (len(data) == call[0] or len(data) == call[1]) and self._calls_again(data, call):
                return
            try:  # the common case: Triton's connection is open, no frame left over from the last read
                self._relay_frames(data, 0)
            except (http2.FrameError, HpackError) as exc:
                self._fail(exc)
            return
        opening = self._opening
        if opening is not None:  # Triton's connection is still opening
            if not opening.started:
                self._first_bytes(opening)
            if opening.hold(data):
                self._pause_client(_HELD_FULL, True)
            return
        self._relay(data)

    def _repeats(self, same: tuple[bytes, int, int, Stream]) -> bool:
        """A read of the same bytes as ``same`` up to the end of what judged it, and as long, is judged as it was
        while its stream is still open and judged frame by frame (no inspector following it, not waiting for an
        admission slot) and no header block is open: one DATA frame, its header the same (stream, length, flags:
        neither padded nor ending the stream), one uncompressed message of the same length whose fields up to its
        last one's value are the same bytes (:meth:`MessageJudge.repeatable`)."""
        stream = same[3]
        return (
            self._active.get(same[2]) is stream
            and stream.inspector is None
            and stream.ticket is None
            and self._handlers is self._frame_handlers
        )

    def _calls_again(self, data: bytes, call: Call) -> bool:
        """A read as long as the remembered unary call ``call``, or as long as it without what followed its DATA
        frame (grpcio sends the connection's WINDOW_UPDATE with some calls only): when it is the same bytes up to the
        end of what judged its message but for a new stream's id (the same in every frame of the stream), and the
        same after its DATA frame or nothing there, the stream opens as the HEADERS handler opens it for that block
        (:meth:`ClientHeaders.open_again`; its HEADERS frame re-encoded when the connection's blocks are:
        :meth:`ClientHeaders.reencoded`), the stream's WINDOW_UPDATE frames pass as their handler passes them (a
        stream Triton knows), its DATA as the DATA handler passes it (the same judge, on a new stream judged frame by
        frame and given its admission slot at once: :meth:`MessageJudge.repeatable`; else that handler takes the rest
        of the read) and the connection's WINDOW_UPDATE frames as they came while the proxy owes the client no window
        (else their handler takes its debt off). False, nothing done, otherwise."""
        _, stop, parts, fragment_end, split, decided, tail, block, judge = call
        if data[:decided] != data[5:_HEADER_SIZE].join(parts) or self._handlers is not self._frame_handlers:
            return False
        if len(data) > stop and (data[stop:] != tail or self._answers.window_debt):
            return False
        stream_id = _U32.unpack_from(data, 5)[0] & _STREAM_ID_MASK
        stream = self._headers.open_again(stream_id, data[_HEADER_SIZE:fragment_end], block)
        if stream is None:
            return False
        stream.client_done = True  # (its DATA frame ends it)
        head = self._headers.reencoded(stream_id, block)
        if head is not None:  # Triton gets the block re-encoded (headers stripped), the frames after it as they came
            data = head + data[fragment_end:]
            split += len(head) - fragment_end
        if stream.judge is not judge or stream.inspector is not None or stream.ticket is not None:
            # (a call waiting for an admission slot: its DATA frame is followed by an inspector, and held)
            self._to_upstream(data[:split])
            self._relay_frames(data, split)
        elif self._upstream is not None:
            self._upstream.send(data)
        return True

    def _remember_call(self, data: bytes, pos: int, stop: int, stream: Stream) -> None:
        """The DATA frame ``data[pos:stop]`` ends ``stream`` with one uncompressed message passed by its judge: when
        the read is that stream's HEADERS frame, its WINDOW_UPDATE frames, that DATA frame, then the connection's
        WINDOW_UPDATE frames (as grpc clients send a unary call), it is remembered for :meth:`_calls_again` if a
        repeat of its bytes would be judged alike."""
        self._call = None
        if pos <= _HEADER_SIZE or self._preface_left or stream.judge is None:
            return
        length, kind, flags, _ = http2.parse_header(data, 0)
        if kind != http2.HEADERS or flags != http2.END_HEADERS:
            return
        sid, cuts, at = data[5:_HEADER_SIZE], [5], _HEADER_SIZE + length
        fragment_end = at
        while at < pos:  # frames between HEADERS and DATA (whole: the frame loop read them)
            if data[at + 3] != http2.WINDOW_UPDATE or data[at + 5 : at + _HEADER_SIZE] != sid:
                return
            cuts.append(at + 5)
            at += _HEADER_SIZE + http2.parse_header(data, at)[0]
        if at != pos or data[pos + 5 : pos + _HEADER_SIZE] != sid or not _connection_updates(data, stop):
            return
        cuts.append(pos + 5)
        block = self._headers.repeatable(data[_HEADER_SIZE:fragment_end], stream)
        decided = stream.judge.repeatable(data, pos + _HEADER_SIZE, stop) if block is not None else -1
        if block is not None and decided > 0:
            parts = tuple(data[cut + 4 : end] for cut, end in zip([-4, *cuts], [*cuts, decided], strict=True))
            tail = data[stop:]
            self._call = (len(data), stop, parts, fragment_end, pos, decided, tail, block, stream.judge)

    def _first_bytes(self, opening: UpstreamOpening) -> None:
        """The client spoke: Triton's connection opens, and the connection is closed once idle for long."""
        opening.start()
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

    # The DATA frame handler: returns None to forward the frame as it is, b"" to drop it, or bytes to send instead.

    def _on_data(self, data: bytes, pos: int, stop: int, flags: int, stream_id: int) -> bytes | None:
        stream = self._active.get(stream_id)
        if stream is None:
            return self._data_out_of_flight(stream_id, flags, stop - pos - _HEADER_SIZE)
        if flags & _END_STREAM:
            stream.client_done = True
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
                if not flags & http2.END_STREAM:
                    if pos == 0 and stop == len(data):  # the read was this frame
                        decided = stream.judge.repeatable(data, _HEADER_SIZE, stop)
                        self._same = (data[:decided], stop, stream_id, stream) if decided > 0 else None
                elif stream.ticket is None:  # the read may be a unary call whole
                    self._remember_call(data, pos, stop, stream)
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

    def _data_out_of_flight(self, stream_id: int, flags: int, length: int) -> bytes | None:
        """A DATA frame of a stream not in flight: forwarded if Triton saw the stream (it may have ended its side
        first), else dropped."""
        if not self._streams.known_upstream(stream_id):
            return self._drop_data(length)
        if flags & _END_STREAM:  # the client ends its side of a stream Triton ended: closed now
            self._streams.half_open.pop(stream_id, None)
        return None

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

    # ---------------------------------------------------------------------------------- Triton down

    def _become_unavailable(self, why: Unavailable) -> None:
        """Triton cannot be reached, or the connection is turned away: be a minimal HTTP/2 server that answers
        every stream UNAVAILABLE, then GOAWAY (see :meth:`_relay`); a client that opens no stream is let go after
        a while. (A GOAWAY at once, before any stream, would not do: grpcio retries the calls it did not send,
        transparently and at once, in a loop.)"""
        self._unavailable = why
        self._headers.forget_forwarded()
        answering = self._control.answering(self._frame_handlers)  # SETTINGS and PING acknowledged here
        if self._handlers is self._frame_handlers:
            self._handlers = answering
        self._frame_handlers = answering
        self._to_client(http2.settings({http2.SETTINGS_MAX_CONCURRENT_STREAMS: self._max_streams}))
        if self.transport is not None:
            transport = self.transport
            asyncio.get_running_loop().call_later(
                self._state.settings.connect_timeout_s,
                lambda: None if transport.is_closing() else self._close_with(http2.goaway(self._streams.client_max)),
            )


def _connection_updates(data: bytes, pos: int) -> bool:
    """Whether ``data[pos:]`` is whole WINDOW_UPDATE frames of the connection (or nothing)."""
    while len(data) - pos >= _HEADER_SIZE and data[pos + 3] == http2.WINDOW_UPDATE and data[pos + 5 : pos + 9] == _ZERO:
        pos += _HEADER_SIZE + http2.parse_header(data, pos)[0]
    return pos == len(data)


def _pause_reading(transport: asyncio.Transport | None, paused: bool) -> None:
    if transport is None or transport.is_closing():
        return
    if paused:
        transport.pause_reading()
    else:
        transport.resume_reading()
