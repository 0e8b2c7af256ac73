"""Triton → client half of the gRPC relay: Triton's bytes pass through untouched, but for its SETTINGS.

Frame headers are read to know where frames start, so that the proxy's own frames (refusals, readiness
answers, GOAWAY) go in between Triton's, and to see streams end (trailers, RST_STREAM) for accounting and
draining. Triton's SETTINGS are read on their way (the largest frame the client may send), and may be changed
(the proxy's cap on concurrent streams). Triton's header blocks are decoded by a table that mirrors Triton's
encoder — cheap, as they repeat byte for byte and the decoder caches them — to read ``grpc-status`` for the
metrics, and to know whether a block may be dropped.

What Triton still sends on a stream the proxy has reset is dropped: DATA, with its bytes credited back to
Triton's window, and header blocks unless they change the client's decoder table (those are passed on: a
client decodes header blocks of closed streams to keep its table in step, RFC 7540 §4.3).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol, cast

from tritonshare.proxy import http2
from tritonshare.proxy.hpack_codec import HeaderBlock, HeaderDecoder, HpackError, changes_table

logger = logging.getLogger(__name__)

_PASS, _DROP, _HOLD = range(3)
# The frame constants read for every frame, as module globals (an attribute lookup each is measurable).
_FRAME_HEADER, _HEADER_SIZE, _STREAM_ID_MASK = http2.FRAME_HEADER, http2.HEADER_SIZE, http2.STREAM_ID_MASK
_DATA, _HEADERS, _WINDOW_UPDATE = http2.DATA, http2.HEADERS, http2.WINDOW_UPDATE
_END_STREAM, _END_HEADERS = http2.END_STREAM, http2.END_HEADERS
_BARE_MASK = http2.END_HEADERS | http2.PADDED | http2.PRIORITY_FLAG  # equal to END_HEADERS: a plain HEADERS
_U32 = http2.U32
_PLAIN_DATA = bytes((http2.DATA, 0))  # a DATA frame's type and flags: not ending its stream, not padded
_TRAILERS_FLAGS = http2.END_HEADERS | http2.END_STREAM
# A remembered unary reply (see UpstreamConnection._reply): its first 5 bytes (the HEADERS frame's length, type and
# flags), that frame's fragment, where the DATA frame starts, the trailers' first 5 bytes, what follows the trailers'
# header (their fragment and whole WINDOW_UPDATE frames), the trailers' status, and the decoder's table changes
# when both blocks were known. (Bytes are compared as slices: a ``startswith`` call parses its
# arguments, ~400 instructions.)
Reply = tuple[bytes, bytes, int, bytes, bytes, bytes | None, int]


class StreamOwner(Protocol):
    """The client side of the relay, told about Triton's side of each stream."""

    reset_streams: dict[int, None]  # streams the proxy has reset (refused after forwarding)

    @property
    def goaway_last(self) -> int | None: ...  # last stream id of the proxy's own GOAWAY, if sent

    def response_headers(self, stream_id: int, end_stream: bool, status: bytes | None) -> None: ...

    def response_ended(self, stream_id: int, code: str) -> None: ...

    def abandoned(self, stream_id: int) -> bool: ...  # a stream the client gave up that Triton still runs

    def upstream_lost(self, exc: Exception | None) -> None: ...

    def upstream_paused(self, paused: bool) -> None: ...

    def client_may_send(self, max_frame_size: int) -> None: ...  # Triton's SETTINGS_MAX_FRAME_SIZE, read


class UpstreamConnection(asyncio.Protocol):
    """The connection to Triton that serves exactly one client connection."""

    def __init__(self, owner: StreamOwner, client: asyncio.Transport, max_streams: int) -> None:
        """``max_streams``: the cap on the client's concurrent streams the proxy advertises, if Triton's is higher."""
        self._owner = owner
        self._client = client
        self._max_streams = max_streams
        self.transport: asyncio.Transport | None = None
        self._left = 0  # payload bytes of the current frame not yet received
        self._mode = _PASS  # what to do with those bytes
        self._head = b""  # a frame header split across reads
        self._held = bytearray()  # a frame being collected whole (_HOLD)
        self._block: list[bytes] = []  # frames of a held header block awaiting END_HEADERS
        self._queued: list[bytes] = []  # the proxy's frames waiting for the end of the current frame
        self._decoder: HeaderDecoder | None = HeaderDecoder()  # None once Triton's blocks could not be read
        self._known = self._decoder.known  # its blocks known by their bytes (empty for good once it is None)
        self._reset = owner.reset_streams
        # The last read that was one unary reply whole: HEADERS, one DATA frame, trailers of one stream, then whole
        # WINDOW_UPDATE frames. A read of the same frames but for the stream's id and the DATA frame's length and
        # content is read as it was (see _replies_again).
        self._reply: Reply | None = None
        # The client is gone; calls it abandoned run on (grpc_abandon): Triton's SETTINGS and PINGs are
        # acknowledged here, as the client would have.
        self.orphaned = False

    # ---------------------------------------------------------------------------------- asyncio

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it

    def connection_lost(self, exc: Exception | None) -> None:
        self._owner.upstream_lost(exc)

    def pause_writing(self) -> None:
        self._owner.upstream_paused(True)

    def resume_writing(self) -> None:
        self._owner.upstream_paused(False)

    # ---------------------------------------------------------------------------------- writing

    def send(self, frames: bytes) -> None:
        """Write whole frames to Triton (the client side forwards whole frames only)."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(frames)

    def inject(self, frames: bytes) -> None:
        """Write the proxy's own frames to the client at the next frame boundary of Triton's stream (a
        header block in several frames is held until it is whole, so this is never inside one)."""
        if self._left and self._mode == _PASS:
            self._queued.append(frames)
        elif not self._client.is_closing():
            self._client.write(frames)

    # ---------------------------------------------------------------------------------- reading

    def data_received(self, data: bytes) -> None:
        start = 0
        if not (self._head or self._left or self._queued) and len(data) >= _HEADER_SIZE:
            kind = data[3]
            # A streaming reply, or Triton's window updates: frames that pass as they are, seen with one check each.
            if (kind == _DATA or kind == _WINDOW_UPDATE) and not self._reset:
                start = _passing(data)
                if start == len(data):
                    if not self._client.is_closing():
                        self._client.write(data)
                    return
            elif kind == _HEADERS:  # a unary call's reply, as the last one?
                reply = self._reply
                if reply is not None and data[:5] == reply[0] and self._replies_again(data, reply):
                    return
                self._relay(data, start)
                self._remember_reply(data)
                return
        self._relay(data, start)

    def _replies_again(self, data: bytes, reply: Reply) -> bool:
        """A read starting as the remembered unary reply ``reply`` does: when it is the same frames on one stream
        but for their stream id and the DATA frame's length and bytes, and Triton's table is as it was, Triton's
        trailers are told to the client side as :meth:`_relay` tells them (their status read once, by their
        bytes), and the read passes as it came, unless the proxy has reset the stream. False, nothing done,
        otherwise."""
        _, first, split, closing, rest, status, changes = reply
        sid = data[5:_HEADER_SIZE]
        if data[_HEADER_SIZE:split] != first or data[split + 3 : split + _HEADER_SIZE] != _PLAIN_DATA + sid:
            return False
        end = split + _HEADER_SIZE + (_U32.unpack_from(data, split - 1)[0] & 0xFFFFFF)  # the trailers
        if data[end:] != closing + sid + rest or self._decoder is None or self._decoder.changes != changes:
            return False
        stream_id = _U32.unpack_from(data, 5)[0] & _STREAM_ID_MASK
        if self._reset and stream_id in self._reset:  # (its frames are dropped)
            return False
        # (The response headers, not ending the stream, would only mark it as answered, just before it ends.)
        self._owner.response_headers(stream_id, True, status)
        if not self._client.is_closing():
            self._client.write(data)
        return True

    def _remember_reply(self, data: bytes) -> None:
        """After :meth:`_relay` read ``data``: remembered for :meth:`_replies_again` when it is a unary reply whole
        (HEADERS, one DATA frame, trailers, of one stream, then whole WINDOW_UPDATE frames) whose header blocks the
        decoder knows."""
        self._reply = None
        decoder, size = self._decoder, len(data)
        if decoder is None or size < 3 * _HEADER_SIZE:
            return
        length, _, flags, _ = http2.parse_header(data, 0)
        split = _HEADER_SIZE + length  # the DATA frame
        if flags != _END_HEADERS or size - split < 2 * _HEADER_SIZE or data[split + 3 : split + 5] != _PLAIN_DATA:
            return
        end = split + _HEADER_SIZE + http2.parse_header(data, split)[0]  # the trailers
        sid = data[5:_HEADER_SIZE]
        if size - end < _HEADER_SIZE or data[split + 5 : split + 9] != sid or data[end + 5 : end + 9] != sid:
            return
        length, kind, flags, _ = http2.parse_header(data, end)
        stop = pos = end + _HEADER_SIZE + length
        while size - pos >= _HEADER_SIZE and data[pos + 3] == _WINDOW_UPDATE:
            pos += _HEADER_SIZE + http2.parse_header(data, pos)[0]
        if kind != _HEADERS or flags != _TRAILERS_FLAGS or pos != size:
            return
        first, last = self._known.get(data[_HEADER_SIZE:split]), self._known.get(data[end + _HEADER_SIZE : stop])
        if first is not None and last is not None:
            rest = data[end + _HEADER_SIZE :]
            self._reply = (data[:5], data[9:split], split, data[end : end + 5], rest, last.status, decoder.changes)

    def _relay(self, data: bytes, start: int) -> None:
        """Pass Triton's frames on, looking at those the proxy must see (a stream's end, header blocks, frames of
        streams it reset) and slipping its own frames in between; ``data[:start]``, whole frames, passes as it is
        (:func:`_passing`: then no frame is split across reads, and nothing of the proxy's waits)."""
        if self._head:
            data, self._head = self._head + data, b""
        chunks: list[bytes | memoryview] = []
        pos = self._continue_frame(data, chunks) if self._left else start
        run = 0 if self._mode == _PASS or start else pos  # bytes from here on pass as they are
        if self._queued and not self._left:
            run = self._flush_queued(data, run, pos, chunks)
        end, unpack, reset, known = len(data), _FRAME_HEADER.unpack_from, self._reset, self._known
        while end - pos >= _HEADER_SIZE:
            high, low, kind, flags, stream_id = unpack(data, pos)
            stop = pos + _HEADER_SIZE + (high << 16 | low)
            if (kind == _WINDOW_UPDATE or kind == _DATA and not flags & _END_STREAM) and (
                not reset or stream_id & _STREAM_ID_MASK not in reset
            ):
                pos = stop  # the common frames pass, decided without a call
            elif (kind == _HEADERS and flags & _BARE_MASK == _END_HEADERS and stop <= end) and (
                not reset or stream_id & _STREAM_ID_MASK not in reset
            ):
                # A header block in one frame with no padding or priority, whole in this read: read, passed.
                fragment = data[pos + _HEADER_SIZE : stop]
                block = known.get(fragment) or self._decode(fragment)
                status = block.status if block is not None else None
                self._owner.response_headers(stream_id & _STREAM_ID_MASK, flags & _END_STREAM == _END_STREAM, status)
                pos = stop
                if self._queued and pos < end:  # (the stream's end may have credited the client's window)
                    run = self._flush_queued(data, run, pos, chunks)
            else:
                pos, run = self._frame(data, pos, stop, run, chunks, kind, flags, stream_id & _STREAM_ID_MASK)
        if pos > end:  # the last frame passes on in the next reads
            self._left, self._mode = pos - end, _PASS
        elif pos < end:  # a frame header split across reads
            self._head = data[pos:]
            end = pos
        elif self._queued and not self._left:
            run = self._flush_queued(data, run, end, chunks)
        if run == 0 and end == len(data) and not chunks and not self._client.is_closing():
            self._client.write(data)  # the common case: the read passes whole, as it came
        else:
            self._write(data, run, end, chunks)

    def _frame(
        self,
        data: bytes,
        pos: int,
        stop: int,
        run: int,
        chunks: list[bytes | memoryview],
        kind: int,
        flags: int,
        sid: int,
    ) -> tuple[int, int]:
        """A frame that is not simply passed (DATA and WINDOW_UPDATE, a header block whole in one frame, of a stream
        not reset): pass, hold or drop it. Returns where reading goes on and where the bytes that pass start."""
        mode = self._classify(kind, flags, sid, stop - pos - _HEADER_SIZE)
        if mode != _PASS:
            if run < pos:
                chunks.append(memoryview(data)[run:pos])
            pos = run = self._divert(data, pos, stop, mode, chunks)
        else:
            pos = stop
        if self._queued and pos < len(data):
            run = self._flush_queued(data, run, pos, chunks)
        return pos, run

    def _divert(self, data: bytes, pos: int, stop: int, mode: int, chunks: list[bytes | memoryview]) -> int:
        """Drop or hold the frame at ``pos`` instead of passing it; returns where reading goes on."""
        if stop <= len(data):
            if mode == _HOLD:
                chunks.extend(self._release(data[pos:stop]))
            return stop
        self._left, self._mode = stop - len(data), mode
        if mode == _HOLD:
            self._held = bytearray(data[pos:])
        return len(data)

    def _continue_frame(self, data: bytes, chunks: list[bytes | memoryview]) -> int:
        """Take the rest of a frame begun in an earlier read; returns where it ends in ``data``."""
        if not self._left:
            return 0
        take = min(self._left, len(data))
        self._left -= take
        if self._mode == _HOLD:
            self._held += data[:take]
            if not self._left:
                chunks.extend(self._release(bytes(self._held)))
                self._held = bytearray()
        return take

    def _flush_queued(self, data: bytes, run: int, pos: int, chunks: list[bytes | memoryview]) -> int:
        if run < pos:
            chunks.append(memoryview(data)[run:pos])
        chunks.extend(self._queued)
        self._queued.clear()
        return pos

    def _write(self, data: bytes, run: int, end: int, chunks: list[bytes | memoryview]) -> None:
        if self._client.is_closing():
            return
        if chunks:
            if run < end:
                chunks.append(memoryview(data)[run:end])
            self._client.writelines(chunks)
        elif run == 0 and end == len(data):
            self._client.write(data)
        elif run < end:
            self._client.write(memoryview(data)[run:end])

    def _classify(self, kind: int, flags: int, stream_id: int, length: int) -> int:
        if kind == http2.HEADERS or kind == http2.CONTINUATION:
            return _HOLD  # collected whole, then judged by _release
        if stream_id and stream_id in self._owner.reset_streams:
            self._dropped(kind, flags, stream_id, length)
            return _DROP
        if kind == http2.DATA:
            if flags & http2.END_STREAM:  # a gRPC response ends with trailers; this one did not
                self._owner.response_ended(stream_id, "unknown")
        elif kind == http2.RST_STREAM:
            self._owner.response_ended(stream_id, "reset")
        elif kind == http2.GOAWAY and self._owner.goaway_last is not None:
            return _HOLD
        elif kind == http2.SETTINGS and not flags & http2.ACK:
            if self.orphaned:
                self.send(http2.SETTINGS_ACK)
            return _HOLD
        elif kind == http2.PING and self.orphaned and not flags & http2.ACK:
            return _HOLD
        return _PASS

    def _dropped(self, kind: int, flags: int, stream_id: int, length: int) -> None:
        """A frame of a stream the proxy reset or the client abandoned, dropped: DATA credited back to Triton (the
        stream's window too while Triton still sends on it: a large answer must not stall it), and an abandoned
        stream's end seen."""
        abandoned = self._owner.abandoned(stream_id)
        if kind == http2.DATA:
            ended = flags & http2.END_STREAM
            if length:
                credit = http2.window_update(0, length)
                self.send(credit + http2.window_update(stream_id, length) if abandoned and not ended else credit)
            if ended and abandoned:
                self._owner.response_ended(stream_id, "unknown")
        elif kind == http2.RST_STREAM and abandoned:
            self._owner.response_ended(stream_id, "reset")

    def _release(self, frame: bytes) -> list[bytes]:
        """A held frame is complete: what of it (and of frames held before it) goes to the client."""
        _, kind, flags, _ = http2.parse_header(frame, 0)
        if kind == http2.PING:  # (orphaned: acknowledged here)
            self.send(http2.ping_ack(frame[http2.HEADER_SIZE :]))
            return []
        if kind == http2.GOAWAY:
            return [self._clamp_goaway(frame)]
        if kind == http2.SETTINGS:
            return [self._settings(frame)]
        self._block.append(frame)
        if not flags & http2.END_HEADERS:
            return []
        frames, self._block = self._block, []
        _, _, first_flags, stream_id = http2.parse_header(frames[0], 0)
        fragment = b"".join(_fragment(f) for f in frames)
        block = self._decode(fragment)
        if stream_id in self._owner.reset_streams:
            if first_flags & http2.END_STREAM:  # (a stream the proxy reset is over already)
                self._owner.response_ended(stream_id, "unknown")
            keep = block.changes_table if block is not None else changes_table(fragment)
            return frames if keep else []
        status = block.status if block is not None else None
        self._owner.response_headers(stream_id, bool(first_flags & http2.END_STREAM), status)
        return frames

    def _settings(self, frame: bytes) -> bytes:
        """Triton's SETTINGS on their way to the client: the largest frame the client may send from now on is
        Triton's, and the client is told the proxy's cap on its concurrent streams when Triton's is higher."""
        try:
            pairs = http2.settings_pairs(memoryview(frame)[http2.HEADER_SIZE :])
        except http2.FrameError:
            return frame  # for the client to object to
        self._owner.client_may_send(pairs.get(http2.SETTINGS_MAX_FRAME_SIZE, http2.DEFAULT_MAX_FRAME_SIZE))
        if pairs.get(http2.SETTINGS_MAX_CONCURRENT_STREAMS, self._max_streams + 1) <= self._max_streams:
            return frame
        pairs[http2.SETTINGS_MAX_CONCURRENT_STREAMS] = self._max_streams
        return http2.settings(pairs)

    def _decode(self, fragment: bytes) -> HeaderBlock | None:
        if self._decoder is None:
            return None
        try:
            return self._decoder.decode(fragment)
        except HpackError as exc:  # never break the relay over it: stop reading statuses on this connection
            logger.warning("cannot decode Triton's response headers (%s): statuses not read on this connection", exc)
            self._decoder, self._known, self._reply = None, {}, None
            return None

    def _clamp_goaway(self, frame: bytes) -> bytes:
        """Triton's GOAWAY after the proxy's own: its last stream id must not exceed the proxy's (§6.8)."""
        ours = self._owner.goaway_last or 0
        payload = frame[http2.HEADER_SIZE :]
        if len(payload) < 8 or http2.goaway_last_stream(payload) <= ours:
            return frame
        return http2.frame(http2.GOAWAY, 0, 0, ours.to_bytes(4, "big") + payload[4:])


def _fragment(frame: bytes) -> bytes | memoryview:
    _, kind, flags, _ = http2.parse_header(frame, 0)
    payload = memoryview(frame)[http2.HEADER_SIZE :]
    return http2.header_block_fragment(flags, payload) if kind == http2.HEADERS else payload


def _passing(data: bytes) -> int:
    """Where the whole frames at the start of a read that pass as they are without a look at their streams end:
    WINDOW_UPDATE, and DATA not ending its stream (the general loop of :meth:`UpstreamConnection._relay` passes
    these the same way, once no stream is reset)."""
    pos, end = 0, len(data)
    while end - pos >= _HEADER_SIZE:
        high, low, kind, flags, _ = _FRAME_HEADER.unpack_from(data, pos)
        stop = pos + _HEADER_SIZE + (high << 16 | low)
        if stop > end or not (kind == _WINDOW_UPDATE or kind == _DATA and not flags & _END_STREAM):
            break
        pos = stop
    return pos
