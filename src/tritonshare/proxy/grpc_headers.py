"""The client's header blocks on one relayed gRPC connection: each assembled, decoded and acted on.

A header block comes in one HEADERS frame, or in a HEADERS frame and its CONTINUATION frames with no other
frame in between (RFC 7540 §6.10). Every block is HPACK-decoded in order (:class:`HeaderDecoder`: its table
mirrors the client's encoder, as Triton's does). A block that opens a stream is judged
(:mod:`tritonshare.proxy.grpc_verdicts`) and then forwarded — with a message judge for an OWN route, or for any
stream with a ``grpc-encoding``, whose compressed messages are bounded in how far they inflate
(:mod:`tritonshare.proxy.grpc_messages`), and an admission slot for an inference route
(:mod:`tritonshare.proxy.grpc_admission`) — or answered here; a later block of a stream in flight (its
trailers) goes on. A block dropped after it changed the client's table would put Triton's table out of step:
from then on every forwarded block is re-encoded without indexing (as it is when headers are stripped).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from tritonshare.proxy import http2
from tritonshare.proxy.admission import LIMITED_ROUTES, METADATA_ROUTES
from tritonshare.proxy.grpc_admission import StreamGate
from tritonshare.proxy.grpc_answers import LocalAnswers
from tritonshare.proxy.grpc_messages import MessageInspector, MessageJudge
from tritonshare.proxy.grpc_streams import Stream, StreamTable
from tritonshare.proxy.grpc_verdicts import NewStreams, Unavailable
from tritonshare.proxy.hpack_codec import HeaderBlock, HeaderDecoder, encode_plain
from tritonshare.proxy.policy import GrpcRule, Verdict
from tritonshare.proxy.protobuf import MessageWalker
from tritonshare.proxy.state import ProxyState

# Frame constants read for every HEADERS frame, as module globals (an attribute lookup each is measurable).
_HEADER_SIZE = http2.HEADER_SIZE
_BARE_MASK = http2.END_HEADERS | http2.PADDED | http2.PRIORITY_FLAG  # equal to END_HEADERS: a plain HEADERS
_HEADERS = bytes((http2.HEADERS,))
_MAX_FRAGMENT = http2.DEFAULT_MAX_FRAME_SIZE  # a re-encoded block in one HEADERS frame: what every peer accepts
# A re-encoded HEADERS frame's flags byte, by the END_STREAM flag of the frame it stands for.
_END_HEADERS_FLAGS = {0: bytes((http2.END_HEADERS,)), http2.END_STREAM: bytes((http2.END_HEADERS | http2.END_STREAM,))}
# CONTINUATION frames one header block may take: a block within max_header_bytes needs 4 at the 16 KiB frames
# every peer accepts; more, empty ones above all, are a flood (CVE-2024-27316's class).
MAX_CONTINUATIONS = 32


class Relay(Protocol):
    """What the header side needs of the connection whose client frames it reads."""

    @property
    def unavailable(self) -> Unavailable | None: ...  # why every new stream is answered here, if it is

    @property
    def goaway_last(self) -> int | None: ...  # last stream id of the proxy's own GOAWAY, if sent

    def expect_continuation(self, expected: bool) -> None: ...  # True while a header block is open


class ClientHeaders:
    """The client's header blocks of one connection: new streams judged and opened, trailers passed on.

    :meth:`on_headers` and :meth:`on_continuation` are the connection's handlers of those frames: they
    return None to forward the frame as it is, b"" to drop it, or bytes to send instead.
    """

    def __init__(
        self,
        relay: Relay,
        state: ProxyState,
        streams: StreamTable,
        answers: LocalAnswers,
        gate: StreamGate | None,
        to_client: Callable[[bytes], None],
    ) -> None:
        """``gate``: admission control, when on; ``to_client``: writes the proxy's frames between Triton's."""
        self._relay = relay
        self._streams = streams
        self._gate = gate
        self._auth = state.auth
        self._max_bytes = state.settings.max_header_bytes
        self._own = state.own_bytes
        self._limit = state.settings.max_json_bytes
        self._budget = state.held_budget  # parameter bytes kept across reads are reserved there
        # Whole request messages are walked by these (remembering their leading fields), without / with the
        # parameter check.
        self._walkers = (
            MessageWalker(inspect=False, limit=self._limit),
            MessageWalker(inspect=True, limit=self._limit),
        )
        self._judges: dict[str, MessageJudge] = {}  # by route
        strip = {name.lower().encode() for name in state.settings.strip_headers}
        if state.auth is not None:
            strip.add(b"authorization")  # the tenant's token is for the proxy, not for Triton (as REST strips it)
        self._reencode = bool(strip)  # forward re-encoded header blocks instead of the client's bytes
        # Absorbing cancellations (grpc_abandon.py), a call's deadline is not passed on: at it, Triton's gRPC server
        # would cancel the call itself. The first block that carries one turns re-encoding on (for good: the two
        # tables part there).
        self._strip_deadlines = state.settings.grpc_cancellations == "absorb"
        if self._strip_deadlines:
            strip.add(b"grpc-timeout")
        self._strip = frozenset(strip)
        # The last block re-encoded (a client repeats it): the block, its fragment, and when it fits one HEADERS
        # frame that frame's length and type.
        self._plain: tuple[HeaderBlock, bytes, bytes | None] | None = None
        self._decoder = HeaderDecoder()
        self._known = self._decoder.known  # header blocks known by their bytes: a hit saves the decode call
        self._block: list[bytes] = []  # HEADERS + CONTINUATION frames of a header block in progress
        self._block_size = 0  # their bytes, frame headers included
        self._block_stream = 0  # their stream
        self._max_streams = state.settings.grpc_max_streams
        self._metered = METADATA_ROUTES if state.admission.rate_limited else frozenset()
        self._active = streams.active  # forwarded streams open (one dict for the table's life)
        self._new_streams = NewStreams(state, streams, answers, to_client)
        # The last new stream's header block and its rule when it was forwarded with nothing else to check (no
        # rate-limit token to take, Triton reachable, no GOAWAY sent): a client repeats the same block for every
        # call of a method (the same object while the decoder's table is unchanged, so the same bearer token),
        # which opens the next stream the same way, without a judgment. With a token file, only while the file's
        # generation is the one the block's token was checked under (``_verified``): a reload judges it again.
        self._forwarded: tuple[HeaderBlock, GrpcRule] | None = None
        self._verified = -1

    def forget_forwarded(self) -> None:
        """Judge every new stream from now on: the connection drains, or Triton cannot be reached."""
        self._forwarded = None

    def on_headers(self, data: bytes, pos: int, stop: int, flags: int, stream_id: int) -> bytes | None:
        if flags & _BARE_MASK == http2.END_HEADERS:  # the common case: a whole block, no padding or priority
            fragment = data[pos + _HEADER_SIZE : stop]
            block = self._known.get(fragment) or self._decode(fragment)  # (a known block was measured)
            if self._reopen(stream_id, block) is not None:  # a new stream opened as the last one was: forwarded
                if flags & http2.END_STREAM:  # (gRPC calls end with DATA: rare)
                    self._streams.client_ended(stream_id)
                return self.reencoded(stream_id, block, flags)
            return self._on_header_block(stream_id, flags, block)
        self._measure(stop - pos)
        if not flags & http2.END_HEADERS:  # a header block in several frames: its CONTINUATIONs come next
            self._block.append(data[pos:stop])
            self._block_size, self._block_stream = stop - pos, stream_id
            self._relay.expect_continuation(True)
            return b""
        fragment = bytes(http2.header_block_fragment(flags, memoryview(data)[pos + _HEADER_SIZE : stop]))
        return self._on_header_block(stream_id, flags, self._decoder.decode(fragment))

    def open_again(self, stream_id: int, fragment: bytes, block: HeaderBlock) -> Stream | None:
        """A plain HEADERS frame (END_HEADERS, no END_STREAM) of ``fragment`` on ``stream_id``, where ``block`` is
        the last block forwarded: the stream opened as :meth:`on_headers` opens it when the block repeats that one,
        else None (nothing done, the frame is for :meth:`on_headers`). The bytes are ``block``'s while the decoder
        knows them as it (its table unchanged since). What goes to Triton for the frame: :meth:`reencoded`."""
        if self._known.get(fragment) is not block:
            return None
        return self._reopen(stream_id, block)

    def reencoded(self, stream_id: int, block: HeaderBlock, flags: int = http2.END_HEADERS) -> bytes | None:
        """What Triton gets for the header block ``block`` of ``stream_id`` that goes on (``flags``: its HEADERS
        frame's): None for the client's frames as they came, else the block re-encoded."""
        return self._plain_frames(stream_id, flags, block) if self._reencode else None

    def _reopen(self, stream_id: int, block: HeaderBlock) -> Stream | None:
        """A new stream of ``block`` opened as the last block forwarded opened one, without judging it again: when
        ``block`` is that block, ``stream_id`` new and odd, the streams under their cap and the token as verified;
        None, nothing done, otherwise (the block is judged in full)."""
        forwarded = self._forwarded
        if (
            forwarded is None
            or forwarded[0] is not block
            or stream_id <= self._streams.client_max
            or not stream_id & 1
            or self._streams.open_count() >= self._max_streams
            or (self._auth is not None and self._auth.current() != self._verified)
        ):
            return None
        self._streams.client_max = stream_id
        return self._forward(stream_id, forwarded[1], block)

    def repeatable(self, fragment: bytes, stream: Stream) -> HeaderBlock | None:
        """The block of ``fragment`` when :meth:`open_again` would open a stream of it as ``stream`` was opened:
        it is the last block forwarded, with ``stream``'s rule."""
        forwarded = self._forwarded
        if forwarded is None or forwarded[1] is not stream.rule:
            return None
        block = self._known.get(fragment)
        return block if block is forwarded[0] else None

    def on_continuation(self, data: bytes, pos: int, stop: int, flags: int, stream_id: int) -> bytes | None:
        if not self._block or self._block_stream != stream_id:
            raise http2.FrameError("CONTINUATION frame without a HEADERS frame of its stream before it")
        self._block.append(data[pos:stop])
        self._block_size += stop - pos
        self._measure(self._block_size)
        if not flags & http2.END_HEADERS:
            if len(self._block) > MAX_CONTINUATIONS:
                raise http2.FrameError(
                    f"header block in more than {MAX_CONTINUATIONS} CONTINUATION frames", http2.ENHANCE_YOUR_CALM
                )
            return b""
        frames, self._block = self._block, []
        self._relay.expect_continuation(False)
        first_flags = http2.parse_header(frames[0], 0)[2]
        fragments = [http2.header_block_fragment(first_flags, memoryview(frames[0])[_HEADER_SIZE:])]
        fragments += [memoryview(f)[_HEADER_SIZE:] for f in frames[1:]]
        result = self._on_header_block(stream_id, first_flags, self._decoder.decode(b"".join(fragments)))
        return b"".join(frames) if result is None else result

    def _decode(self, fragment: bytes) -> HeaderBlock:
        """A header block in one plain HEADERS frame, seen for the first time on this connection."""
        self._measure(_HEADER_SIZE + len(fragment))
        return self._decoder.decode(fragment)

    def _measure(self, size: int) -> None:
        """A header block's frames so far, headers included, are ``size`` bytes: within max_header_bytes?"""
        if size > self._max_bytes:
            raise http2.FrameError(f"header block larger than {self._max_bytes} bytes")

    def _on_header_block(self, stream_id: int, flags: int, block: HeaderBlock) -> bytes | None:
        """A complete header block, decoded: judge a new stream, then forward it as is (None), re-encoded
        (bytes) or not at all (b"")."""
        if block.deadline and self._strip_deadlines:
            self._reencode = True
        if stream_id > self._streams.client_max:
            if not stream_id & 1:
                raise http2.FrameError(
                    f"headers on stream {stream_id}: a client's streams have odd ids (RFC 9113 §5.1.1)"
                )
            self._streams.client_max = stream_id
            if not self._open_stream(stream_id, block):
                self._reencode = self._reencode or block.changes_table
                return b""
        else:  # only trailers of a stream in flight go on
            stream = self._streams.active.get(stream_id)
            if stream is None:
                if block.path is not None:  # not trailers: a request on a stream id used or skipped already
                    raise http2.FrameError(
                        f"request headers on stream {stream_id}, not above the last stream opened "
                        f"({self._streams.client_max}): stream ids must grow (RFC 9113 §5.1.1)"
                    )
                self._reencode = self._reencode or block.changes_table
                return b""
            if stream.held is not None:  # behind its held frames; index-free, as it reaches Triton later
                if any(frame[3] == http2.HEADERS for frame in stream.held):  # bounds what a stream holds
                    raise http2.FrameError(f"stream {stream_id} sent a header block after its trailers")
                self._reencode = self._reencode or block.changes_table
                stream.held.append(self._plain_frames(stream_id, flags, block))
                return b""
        if flags & http2.END_STREAM:  # (gRPC calls end with DATA: rare)
            self._streams.client_ended(stream_id)
        return self.reencoded(stream_id, block, flags)

    def _plain_frames(self, stream_id: int, flags: int, block: HeaderBlock) -> bytes:
        """The block re-encoded without the dynamic table (and without stripped headers)."""
        plain = self._plain
        if plain is None or plain[0] is not block:
            fragment = encode_plain([h for h in block.headers if h[0] not in self._strip])
            # One HEADERS frame (the common case): its length and type, to which the flags and stream id go.
            single = len(fragment).to_bytes(3, "big") + _HEADERS if len(fragment) <= _MAX_FRAGMENT else None
            plain = self._plain = (block, fragment, single)
        _, fragment, single = plain
        if single is None:
            return http2.header_frames(stream_id, fragment, end_stream=bool(flags & http2.END_STREAM))
        return b"".join((single, _END_HEADERS_FLAGS[flags & http2.END_STREAM], stream_id.to_bytes(4, "big"), fragment))

    def _open_stream(self, stream_id: int, block: HeaderBlock) -> bool:
        """A client opened a stream: forward it (True) or answer it here (False)."""
        relay = self._relay
        rule = self._new_streams.judge(stream_id, block, unavailable=relay.unavailable, goaway_last=relay.goaway_last)
        if rule is None:
            return False
        # (a rate limit's metadata tokens are taken for every stream: judged each time; a bearer token passed
        # the judgment just now, under the token file's generation in force)
        self._forwarded = None if rule.route in self._metered else (block, rule)
        if self._auth is not None:
            self._verified = self._auth.generation
        self._forward(stream_id, rule, block)
        return True

    def _forward(self, stream_id: int, rule: GrpcRule, block: HeaderBlock) -> Stream:
        judge = None
        # An OWN route's messages are judged; any other's that may come compressed are followed too: Triton's
        # gRPC server inflates every compressed message whole, whatever its method (the inflate bound).
        if rule.verdict is Verdict.OWN or block.encoding is not None:
            judge = self._judges.get(rule.route) or self._new_judge(rule)
        stream = self._streams.forward(stream_id, rule, judge, block.encoding)
        if self._gate is not None and rule.route in LIMITED_ROUTES:
            self._gate.admit(stream_id, stream)
            # A stream that waits for its slot has its messages counted by the gate: an inspector from the start
            # (no DATA of it has come yet). One admitted at once is judged as any other, frame by frame.
            if judge is not None and stream.ticket is not None:
                stream.inspector = MessageInspector(judge, encoding=block.encoding)
        return stream

    def _new_judge(self, rule: GrpcRule) -> MessageJudge:
        walker = self._walkers[rule.inspect]
        judge = self._judges[rule.route] = MessageJudge(
            rule, self._own, limit=self._limit, budget=self._budget, walker=walker
        )
        return judge
