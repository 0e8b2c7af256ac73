"""The gRPC relay's framing logic, driven byte by byte: no sockets, so reads can be split anywhere.

Transports are simple recorders of what the relay writes (the asyncio transport interface, not an SDK
client). A client conversation is encoded the way grpc clients do it (HPACK with incremental indexing);
what reaches "Triton" is decoded with the ``hpack`` package's own decoder. The relay's output must not
depend on where TCP happened to split the bytes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import hpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2 as pb

from tests.proxy.wire import client_streams
from tritonshare.proxy import http2
from tritonshare.proxy.grpc import GrpcFrontend
from tritonshare.proxy.grpc_connection import ClientConnection
from tritonshare.proxy.grpc_upstream import UpstreamConnection
from tritonshare.proxy.grpc_verdicts import Unavailable
from tritonshare.proxy.policy import GRPC_SERVICE
from tritonshare.proxy.settings import ProxySettings
from tritonshare.proxy.state import ProxyState


@dataclass
class Recorder:
    """Stands in for an asyncio transport: keeps what is written."""

    out: bytearray = field(default_factory=bytearray)
    closed: bool = False

    def write(self, data: bytes | memoryview) -> None:
        self.out += data

    def writelines(self, chunks: list[bytes | memoryview]) -> None:
        for chunk in chunks:
            self.out += chunk

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    abort = close

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:  # the proxy's last word: for these tests, the connection is over
        self.closed = True

    def set_protocol(self, protocol: object) -> None:
        self.protocol = protocol

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


class Client:
    """Encodes a client's side of a conversation like a gRPC client library does."""

    def __init__(self) -> None:
        self.encoder = hpack.Encoder()

    def headers(self, stream_id: int, method: str, *extra: tuple[str, str]) -> bytes:
        fields = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", f"/{GRPC_SERVICE}/{method}"),
            (":authority", "proxy:9001"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            *extra,
        ]
        return http2.frame(http2.HEADERS, http2.END_HEADERS, stream_id, self.encoder.encode(fields))


def message(model: str, raw: bytes = b"") -> bytes:
    request = pb.ModelInferRequest(model_name=model)
    if raw:
        request.raw_input_contents.append(raw)
    body = request.SerializeToString()
    return b"\x00" + len(body).to_bytes(4, "big") + body


def data(stream_id: int, payload: bytes, *, end: bool = True) -> bytes:
    return http2.frame(http2.DATA, http2.END_STREAM if end else 0, stream_id, payload)


def conversation() -> bytes:
    client, big = Client(), message("own", bytes(range(256)) * 160)  # 40 KiB: three DATA frames
    return b"".join(
        [
            http2.PREFACE,
            http2.settings({0x4: 1 << 20}),
            http2.window_update(0, 1 << 20),
            client.headers(1, "ModelInfer"),
            data(1, message("own")),
            client.headers(3, "RepositoryIndex"),
            data(3, b"\x00" * 5),  # denied; its :path is indexed
            client.headers(5, "ModelInfer"),
            http2.window_update(5, 100),
            data(5, message("other")),  # refused
            client.headers(7, "ModelReady"),
            data(7, message("own")[:6], end=False),
            data(7, message("own")[6:]),
            client.headers(9, "ModelInfer"),
            data(9, big[:16_000], end=False),
            data(9, big[16_000:32_000], end=False),
            data(9, big[32_000:]),
            client.headers(11, "ServerReady"),
            data(11, b"\x00" * 5),  # answered by the proxy: not ready (draining)
            http2.window_update(0, 100),  # 5 of these bytes credit the proxy's own answer, not Triton's
            http2.frame(http2.PING, 0, 0, b"12345678"),
        ]
    )


async def relay(
    chunks: list[bytes],
    after: Callable[[ClientConnection, UpstreamConnection], None] | None = None,
    *,
    early: int = 0,
    **settings: object,
) -> tuple[bytes, bytes, ProxyState]:
    """Relay a client's bytes (Triton's connection opens with the client's first bytes, so the first
    ``max(early, 1)`` chunks arrive before it is open); returns what Triton and the client received.
    ``settings``: the proxy's, other than the defaults."""
    early = max(early, 1)
    state = ProxyState(ProxySettings(name="own", triton_grpc="127.0.0.1:1", **settings))  # type: ignore[arg-type]
    state.draining = True  # readiness answers at once, without asking Triton
    to_triton, to_client = Recorder(), Recorder()
    upstreams: list[UpstreamConnection] = []

    async def open_upstream(factory: Callable[[], UpstreamConnection]) -> UpstreamConnection:
        upstream = factory()
        upstream.connection_made(to_triton)  # type: ignore[arg-type]
        upstreams.append(upstream)
        return upstream

    connection = ClientConnection(GrpcFrontend(state, open_upstream=open_upstream), state)
    connection.connection_made(to_client)  # type: ignore[arg-type]
    for chunk in chunks[:early]:
        connection.data_received(chunk)
    for _ in range(10):  # the upstream "connects" (a few loop iterations: task, wait_for)
        await asyncio.sleep(0)
    assert upstreams, "the relay did not open its upstream connection"
    for chunk in chunks[early:]:
        if to_client.closed:  # (a transport stops reading once closed)
            break
        connection.data_received(chunk)
    if after is not None:
        after(connection, upstreams[0])
    return bytes(to_triton.out), bytes(to_client.out), state


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    bounds = [0, *sorted({c % (len(data) + 1) for c in cuts}), len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


def frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    out, pos = [], 0
    while pos < len(data):
        length, kind, flags, stream_id = http2.parse_header(data, pos)
        out.append((kind, flags, stream_id, data[pos + 9 : pos + 9 + length]))
        pos += 9 + length
    assert pos == len(data), "output ends inside a frame"
    return out


def header_fields(data: bytes) -> dict[int, dict[str, str]]:
    """The fields of each stream's last header block among ``data``'s frames (the proxy's output to a client),
    decoded in order with one HPACK decoder, as the client would."""
    decoder, out = hpack.Decoder(), {}
    for kind, _, stream_id, payload in frames(data):
        if kind == http2.HEADERS:
            out[stream_id] = {str(k): str(v) for k, v in decoder.decode(payload)}
    return out


def test_what_reaches_triton_and_what_the_client_gets() -> None:
    to_triton, to_client, _ = asyncio.run(relay([conversation()]))
    streams = client_streams(to_triton)
    opened = {sid: s.headers[":path"].rsplit("/", 1)[1] for sid, s in streams.items() if s.headers}
    assert opened == {1: "ModelInfer", 5: "ModelInfer", 7: "ModelReady", 9: "ModelInfer"}  # no 3, no 11
    assert streams[5].reset_code == http2.CANCEL and not streams[5].data
    assert bytes(streams[7].data) == message("own") and streams[7].end_stream
    assert bytes(streams[9].data) == message("own", bytes(range(256)) * 160)
    assert 3 not in streams and 11 not in streams  # not even their WINDOW_UPDATE or DATA frames
    updates = [http2.window_increment(p) for kind, _, sid, p in frames(to_triton[24:]) if kind == 8 and sid == 0]
    assert updates == [1 << 20, 95]  # the second one less the 5 DATA bytes of the proxy's own answer

    got = frames(to_client)
    statuses = {sid: p for kind, _, sid, p in got if kind == http2.HEADERS}
    decoder = hpack.Decoder()
    assert dict(decoder.decode(statuses[3]))["grpc-status"] == "7"  # PERMISSION_DENIED
    assert dict(decoder.decode(statuses[5]))["grpc-status"] == "5"  # NOT_FOUND
    assert len(decoder.header_table.dynamic_entries) == 0  # the client's table is left alone
    credits = [http2.window_increment(p) for kind, _, sid, p in got if kind == 8]
    assert credits == [5, len(message("other")), 5]  # dropped DATA is credited back to the client


def bidi(*models: str) -> list[bytes]:
    """A ModelStreamInfer stream (id 1) whose messages, one a read, name ``models`` (same-length tensors of other
    contents each), after the preface and the headers in a read of their own."""
    opening = http2.PREFACE + http2.settings({}) + Client().headers(1, "ModelStreamInfer")
    return [opening, *(data(1, message(m, bytes([i]) * 64), end=False) for i, m in enumerate(models))]


def until_reset(to_triton: bytes, stream_id: int) -> tuple[bytes, bool]:
    """The DATA payload Triton got on a stream before the proxy reset it, and whether it did."""
    got = b""
    for kind, _, sid, payload in frames(to_triton[len(http2.PREFACE) :]):
        if sid == stream_id and kind == http2.RST_STREAM:
            return got, True
        if sid == stream_id and kind == http2.DATA:
            got += payload
    return got, False


@pytest.mark.parametrize("other", ["owx", "other"])  # a name as long as the own one, and one that is not
def test_a_stream_repeating_its_messages_shape_is_judged_on_every_message(other: str) -> None:
    """Past the first message, a read repeating the last one's shape takes the proxy's short path: it must pass
    what the full judgment passes, whatever the tensor's bytes, and refuse another model's name; the same bytes
    in one read, judged by the full path, give Triton and the client the same."""
    reads = bidi("own", "own", "own", other, "own")
    to_triton, to_client, _ = asyncio.run(relay(reads))
    assert until_reset(to_triton, 1) == (b"".join(message("own", bytes([i]) * 64) for i in range(3)), True)
    statuses = {sid: p for kind, _, sid, p in frames(to_client) if kind == http2.HEADERS}
    assert dict(hpack.Decoder().decode(statuses[1]))["grpc-status"] == "5"  # NOT_FOUND
    assert asyncio.run(relay([reads[0], b"".join(reads[1:])]))[:2] == (to_triton, to_client)


def unary(*calls: tuple[int, str, str], grpcio: bool = False, extra: tuple[tuple[str, str], ...] = ()) -> list[bytes]:
    """Unary calls ``(stream id, method, model)``, each whole in one read, the model's tensor of other bytes each
    time, after the preface in a read of its own: HEADERS (with the ``extra`` fields) then DATA as h2load sends
    them, or (``grpcio``) with the stream's WINDOW_UPDATE between them and the connection's after them, as grpcio
    does."""
    client = Client()
    before, after = (b"", b"") if not grpcio else (http2.window_update(0, 100), http2.window_update(0, 100))
    reads = [
        client.headers(sid, method, *extra)
        + (http2.window_update(sid, 5) if grpcio else b"")
        + data(sid, message(model, bytes([sid]) * 64))
        + after
        for sid, method, model in calls
    ]
    return [http2.PREFACE + http2.settings({}) + before, *reads]


def short_path(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """What the unary call's short path answered, read after read it was asked (a spy on the real check)."""
    answers, real = [], ClientConnection._calls_again

    def spy(self: ClientConnection, data: bytes, call: object) -> bool:
        answers.append(real(self, data, call))  # type: ignore[arg-type]
        return answers[-1]

    monkeypatch.setattr(ClientConnection, "_calls_again", spy)
    return answers


@pytest.mark.interpreted
@pytest.mark.parametrize("grpcio", [False, True])
@pytest.mark.parametrize("other", ["owx", "other"])  # a name as long as the own one, and one that is not
def test_unary_calls_repeating_the_last_ones_bytes_are_judged_on_every_call(
    other: str, grpcio: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From the third call on, a read repeating the last call's bytes but for its stream id and tensor takes the
    proxy's short path: it must pass what the full judgment passes, and refuse another model's name, an admin
    method (after which blocks are re-encoded: its :path changed the table), a stream id not above the last one;
    the same bytes in one read, judged by the full path, give Triton and the client the same."""
    calls = [(1, "ModelInfer", "own"), (3, "ModelInfer", "own"), (5, "ModelInfer", "own"), (7, "ModelInfer", other)]
    calls += [(9, "ModelInfer", "own"), (11, "ModelInfer", "own")]
    reads = unary(*calls, (13, "RepositoryModelUnload", "own"), (15, "ModelInfer", "own"), grpcio=grpcio)
    taken = short_path(monkeypatch)
    to_triton, to_client, _ = asyncio.run(relay(reads[:7]))
    assert taken == ([True, False, True, True] if other == "owx" else [True, True, True])  # 5, (7), 9, 11
    assert asyncio.run(relay([reads[0], b"".join(reads[1:7])]))[:2] == (to_triton, to_client)
    to_triton, to_client, _ = asyncio.run(relay(reads))
    streams = client_streams(to_triton)
    assert sorted(streams) == [1, 3, 5, 7, 9, 11, 15]  # no 13: never forwarded
    for sid in (1, 3, 5, 9, 11, 15):
        assert bytes(streams[sid].data) == message("own", bytes([sid]) * 64) and streams[sid].end_stream
    assert streams[7].reset_code == http2.CANCEL and not streams[7].data
    got = frames(to_client)
    statuses = {sid: dict(hpack.Decoder().decode(p)) for kind, _, sid, p in got if kind == http2.HEADERS}
    assert statuses[7]["grpc-status"] == "5" and statuses[13]["grpc-status"] == "7"  # NOT_FOUND, PERMISSION_DENIED
    assert asyncio.run(relay([reads[0], b"".join(reads[1:])]))[:2] == (to_triton, to_client)
    again = unary(*calls, (7, "ModelInfer", "own"), grpcio=grpcio)  # the refused stream's id: a protocol error
    to_client = asyncio.run(relay(again))[1]
    assert frames(to_client)[-1][0] == http2.GOAWAY and to_client[-4:] == http2.PROTOCOL_ERROR.to_bytes(4, "big")
    assert asyncio.run(relay([again[0], b"".join(again[1:])]))[1] == to_client


# Unary calls whose repeats take the short path from the third on (5, 9, 11), but for one naming another model (7).
REPEATED = [(1, "ModelInfer", "own"), (3, "ModelInfer", "own"), (5, "ModelInfer", "own"), (7, "ModelInfer", "owx")]
REPEATED += [(9, "ModelInfer", "own"), (11, "ModelInfer", "own")]


@pytest.mark.parametrize("grpcio", [False, True])
@pytest.mark.parametrize("field", ["grpc-timeout", "x-triton-key"])  # a deadline (absorbed), a header stripped
def test_repeated_unary_calls_reencoded_for_triton_go_as_the_full_path_sends_them(field: str, grpcio: bool) -> None:
    """A call whose header block is re-encoded for Triton (a field taken out: the deadline the proxy absorbs, a
    header configured to be stripped) repeats as any other: Triton gets each call's block re-encoded without the
    field, its other frames as they came; another model's name is still refused; the same bytes in one read,
    judged by the full path, give Triton and the client the same (that the short path is taken: below)."""
    reads = unary(*REPEATED, grpcio=grpcio, extra=((field, "50m"),))
    to_triton, to_client, _ = asyncio.run(relay(reads, strip_headers=("X-Triton-Key",)))
    streams = client_streams(to_triton)
    assert sorted(streams) == [1, 3, 5, 7, 9, 11]
    for sid in (1, 3, 5, 9, 11):
        assert streams[sid].headers[":path"].endswith("/ModelInfer") and field not in streams[sid].headers
        assert bytes(streams[sid].data) == message("own", bytes([sid]) * 64) and streams[sid].end_stream
    assert streams[7].reset_code == http2.CANCEL and not streams[7].data
    in_one_read = asyncio.run(relay([reads[0], b"".join(reads[1:])], strip_headers=("X-Triton-Key",)))
    assert in_one_read[:2] == (to_triton, to_client)


@pytest.mark.parametrize("grpcio", [False, True])
@pytest.mark.parametrize("slots", [64, 2])  # every call admitted at once; calls past the second waiting
def test_repeated_unary_calls_under_admission_control_go_as_the_full_path_sends_them(slots: int, grpcio: bool) -> None:
    """With ``--max-inflight``, a call repeating the last one's bytes, admitted at once, goes to Triton as it came;
    waiting for a slot (Triton here never answers, so the first two calls keep theirs), its HEADERS go on and its
    message but for the last byte, the rest held; another model's name is refused either way. The same bytes in
    one read, judged by the full path, give Triton and the client the same (that the short path is taken: below)."""
    reads = unary(*REPEATED, grpcio=grpcio)
    to_triton, to_client, state = asyncio.run(relay(reads, max_inflight=slots))
    streams = client_streams(to_triton)
    assert sorted(streams) == [1, 3, 5, 7, 9, 11]
    for sid in (1, 3, 5, 9, 11):
        sent = message("own", bytes([sid]) * 64)
        admitted = slots > 2 or sid in (1, 3)
        assert bytes(streams[sid].data) == (sent if admitted else sent[:-1])
        assert streams[sid].end_stream is admitted
    assert state.admission.held_bytes == (0 if slots > 2 else 3)  # each waiting call's last byte (5, 9, 11)
    in_one_read = asyncio.run(relay([reads[0], b"".join(reads[1:])], max_inflight=slots))
    assert in_one_read[:2] == (to_triton, to_client)


@pytest.mark.interpreted
@pytest.mark.parametrize("grpcio", [False, True])
@pytest.mark.parametrize(
    ("extra", "settings"),
    [
        ((("grpc-timeout", "50m"),), {}),  # a deadline absorbed: blocks re-encoded
        ((("x-triton-key", "k"),), {"strip_headers": ("X-Triton-Key",)}),
        ((), {"max_inflight": 64}),  # admitted at once
        ((), {"max_inflight": 2}),  # 5, 9 and 11 wait for a slot
    ],
    ids=["deadline", "stripped", "admitted", "waiting"],
)
def test_repeated_unary_calls_take_the_short_path_when_blocks_are_reencoded_or_admitted(
    extra: tuple[tuple[str, str], ...], settings: dict[str, object], grpcio: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The two tests above, with a spy on the short path: it is taken from the third call on, but for the call
    naming another model."""
    taken = short_path(monkeypatch)
    asyncio.run(relay(unary(*REPEATED, grpcio=grpcio, extra=extra), **settings))
    assert taken == [True, False, True, True]  # 5, (7: another model), 9, 11


@pytest.mark.parametrize("grpcio", [False, True])
@pytest.mark.parametrize("even", [2, 8])  # a first stream (the full path); a repeat of the last call (short paths)
def test_a_stream_with_an_even_id_ends_the_connection(even: int, grpcio: bool) -> None:
    """Client streams have odd ids (RFC 9113 §5.1.1): an even one is a protocol error of the connection, never passed
    to Triton — on the full path, and on a read that repeats the last call's bytes but for its stream id."""
    calls = [(1, "ModelInfer", "own"), (3, "ModelInfer", "own"), (5, "ModelInfer", "own"), (even, "ModelInfer", "own")]
    reads = unary(*calls[3:] if even == 2 else calls, grpcio=grpcio)
    to_triton, to_client, _ = asyncio.run(relay(reads))
    assert goaway_code(to_client) == http2.PROTOCOL_ERROR
    assert even not in client_streams(to_triton)
    assert sorted(client_streams(to_triton)) == ([] if even == 2 else [1, 3, 5])


@pytest.mark.interpreted
def test_a_repeated_unary_call_after_the_proxys_own_answer_pays_the_window_debt_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """grpcio ends a unary call's read with a WINDOW_UPDATE of the connection: after the proxy answered a call itself
    (its DATA bytes, which Triton never sent, are a debt the next update pays), a call repeating the last one's bytes
    does not pass as it came — the update is cut by the debt, as the full path cuts it —, and the next ones do, with
    or without the update."""
    client = Client()

    def infer(sid: int, update: bool = True) -> bytes:
        call = client.headers(sid, "ModelInfer") + http2.window_update(sid, 5) + data(sid, message("own", b"t" * 64))
        return call + http2.window_update(0, 100) if update else call

    reads = [http2.PREFACE + http2.settings({}), infer(1), infer(3), infer(5)]  # (encoded in the order sent)
    path = hpack.NeverIndexedHeaderTuple(":path", f"/{GRPC_SERVICE}/ServerReady")  # no table change: no re-encoding
    fields = [(":method", "POST"), (":scheme", "http"), path, (":authority", "proxy:9001")]
    block = client.encoder.encode([*fields, ("content-type", "application/grpc"), ("te", "trailers")])
    ready = http2.frame(http2.HEADERS, http2.END_HEADERS, 7, block) + data(7, b"\x00" * 5)  # answered by the proxy
    reads += [ready, infer(9), infer(11), infer(13, update=False)]  # (grpcio sends some calls without the update)
    taken = short_path(monkeypatch)
    to_triton, to_client, _ = asyncio.run(relay(reads))
    assert taken == [True, False, True, True]  # 5, 9 (the debt), 11, 13
    debt = sum(len(p) for kind, _, sid, p in frames(to_client) if kind == http2.DATA and sid == 7)
    updates = [http2.window_increment(p) for kind, _, sid, p in frames(to_triton[24:]) if kind == 8 and sid == 0]
    assert debt > 0 and updates == [100, 100, 100, 100 - debt, 100]
    assert asyncio.run(relay([reads[0], b"".join(reads[1:])]))[:2] == (to_triton, to_client)


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=1 << 20), max_size=12), early=st.integers(0, 3))
def test_client_side_output_does_not_depend_on_read_boundaries(cuts: list[int], early: int) -> None:
    whole = asyncio.run(relay([conversation()]))
    pieces = asyncio.run(relay(split(conversation(), cuts), early=early))
    assert pieces[:2] == whole[:2]


def triton_replies() -> bytes:
    encoder = hpack.Encoder()

    def headers(stream_id: int, fields: list[tuple[str, str]], flags: int = 0) -> bytes:
        return http2.frame(http2.HEADERS, http2.END_HEADERS | flags, stream_id, encoder.encode(fields))

    def split_headers(stream_id: int, fields: list[tuple[str, str]]) -> bytes:  # HEADERS + CONTINUATION
        block = encoder.encode(fields)
        return http2.frame(http2.HEADERS, 0, stream_id, block[:100]) + http2.frame(
            http2.CONTINUATION, http2.END_HEADERS, stream_id, block[100:]
        )

    response, trailers = [(":status", "200"), ("content-type", "application/grpc")], [("grpc-status", "0")]
    parts = [  # encoded in wire order: each block may index what the ones before it inserted
        lambda: http2.settings({0x5: 1 << 22}),
        lambda: headers(1, response),
        lambda: data(1, b"\x00" * 40, end=False),
        lambda: headers(1, trailers, http2.END_STREAM),
        # Stream 5 was reset by the proxy: its DATA is dropped (and credited back to Triton), and so is a
        # header block unless it changes the client's HPACK table (the client must decode that one).
        lambda: headers(5, [*response, ("x-trace", "t-1")]),
        lambda: data(5, b"\x00" * 9, end=False),
        lambda: headers(5, trailers, http2.END_STREAM),
        lambda: split_headers(7, [*response, ("x-long", "v" * 300)]),
        lambda: data(7, b"\x01" * 70_000, end=False),
        lambda: headers(7, trailers, http2.END_STREAM),
        lambda: headers(9, response),
        lambda: data(9, b"\x02" * 20, end=False),
        lambda: headers(9, [("grpc-status", "3"), ("grpc-message", "unexpected datatype")], http2.END_STREAM),
    ]
    return b"".join(part() for part in parts)


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=1 << 20), max_size=12), drain_at=st.integers(0, 12))
def test_triton_side_passes_bytes_and_slips_goaway_in_between_frames(cuts: list[int], drain_at: int) -> None:
    replies = triton_replies()
    chunks = split(replies, cuts)

    def answer(connection: ClientConnection, upstream: UpstreamConnection) -> None:
        for index, chunk in enumerate(chunks):
            if index == drain_at:
                connection.begin_drain()  # GOAWAY, written at the next frame boundary
            upstream.data_received(chunk)

    to_triton, to_client, state = asyncio.run(relay([conversation()], answer))
    _, alone, _ = asyncio.run(relay([conversation()]))
    got = frames(to_client)
    for frame in frames(alone):  # what the proxy says by itself: refusals, readiness, window credits
        got.remove(frame)
    goaways = [f for f in got if f[0] == http2.GOAWAY]
    assert len(goaways) == (1 if drain_at < len(chunks) else 0)
    passed = [f for f in got if f[0] != http2.GOAWAY]
    replied = frames(replies)
    inserting = replied[4]
    assert inserting[:3] == (http2.HEADERS, http2.END_HEADERS, 5)
    # Triton's SETTINGS reach the client with the proxy's cap on concurrent streams added.
    capped = http2.settings({0x5: 1 << 22, http2.SETTINGS_MAX_CONCURRENT_STREAMS: 128})
    assert passed == [frames(capped)[0]] + [f for f in replied[1:] if f[2] != 5 or f is inserting]
    credits = [http2.window_increment(p) for k, _, sid, p in frames(to_triton[24:]) if k == 8 and sid == 0]
    assert credits[-1] == 9  # Triton's window gets back the dropped DATA bytes
    if goaways:  # never between a HEADERS frame and its CONTINUATION
        index = got.index(goaways[0])
        assert not (index > 0 and got[index - 1][0] == http2.HEADERS and not got[index - 1][1] & http2.END_HEADERS)
    assert state.inflight == 0  # every forwarded stream was ended by Triton (or reset by the proxy)
    requests = state.metrics.registry.get_sample_value
    labels = {"model": "own", "protocol": "grpc", "route": "ModelInfer"}
    assert requests("tritonshare_proxy_requests_total", {**labels, "code": "ok"}) == 1  # stream 1
    assert requests("tritonshare_proxy_requests_total", {**labels, "code": "invalid_argument"}) == 1  # Triton's
    assert requests("tritonshare_proxy_requests_total", {**labels, "code": "not_found"}) == 1  # the proxy's


def unary_replies(*replies: tuple[int, str, int]) -> list[bytes]:
    """Triton's replies ``(stream id, grpc-status, DATA bytes)`` to unary calls, each whole in one read as Triton
    writes one: response headers, one DATA frame, trailers, a WINDOW_UPDATE of the connection."""
    encoder, response = hpack.Encoder(), [(":status", "200"), ("content-type", "application/grpc")]

    def block(fields: list[tuple[str, str]]) -> bytes:
        return encoder.encode(fields)

    return [
        http2.frame(http2.HEADERS, http2.END_HEADERS, sid, block(response))
        + data(sid, bytes([sid]) * size, end=False)
        + http2.frame(http2.HEADERS, http2.END_HEADERS | http2.END_STREAM, sid, block([("grpc-status", status)]))
        + http2.window_update(0, 100)
        for sid, status, size in replies
    ]


def test_unary_replies_repeating_the_last_ones_frames_are_read_on_every_reply() -> None:
    """From the third reply on, a read of Triton's repeating the last reply's frames but for its stream id and its
    DATA takes the proxy's short path: each call is counted by its own status — a reply with another status, or
    the same bytes after Triton's table changed (its index now names grpc-status 3), is read in full —, and one on
    a stream the proxy reset still does not reach the client; the same bytes, read by the full path, give the client
    and the metrics the same."""
    calls = [(sid, "ModelInfer", "own") for sid in (1, 3, 5, 7, 9, 11)] + [(13, "ModelInfer", "other")]
    reads = unary(*calls, (15, "ModelInfer", "own"))
    replies = unary_replies(
        (1, "0", 40), (3, "0", 40), (5, "0", 7), (7, "3", 7), (11, "0", 90), (13, "0", 7), (15, "0", 9)
    )
    fragments = [payload for kind, _, _, payload in frames(replies[2]) if kind == http2.HEADERS]
    as_five = http2.frame(http2.HEADERS, http2.END_HEADERS, 9, fragments[0]) + data(9, b"\x09" * 7, end=False)
    as_five += http2.frame(http2.HEADERS, http2.END_HEADERS | http2.END_STREAM, 9, fragments[1])
    replies[3:3] = [http2.window_update(0, 1) + replies.pop(3), as_five + http2.window_update(0, 100)]
    last = replies.pop()

    def answer(sent: list[bytes], remembered: list[object]) -> Callable[[ClientConnection, UpstreamConnection], None]:
        def reply(connection: ClientConnection, upstream: UpstreamConnection) -> None:
            for read in sent:
                if read == replies[6]:  # the call Triton answers: the client sends it now
                    connection.data_received(reads[7])
                upstream.data_received(read)
                remembered.append(upstream._reply)
            connection.data_received(reads[8])
            upstream.data_received(last)
            remembered.append(upstream._reply)

        return reply

    remembered: list[object] = []
    _, to_client, state = asyncio.run(relay(reads[:7], answer(replies, remembered)))
    assert remembered[0] is None and remembered[1] is remembered[2] is remembered[3] is not None  # 5: short path
    assert None is not remembered[4] is not remembered[3]  # 9 read in full
    assert None is not remembered[5] is not remembered[6] is not None  # 11 read in full (other bytes), 13 (reset)
    assert remembered[7] is remembered[6]  # 15 by the short path: no stream of its reset
    got = frames(to_client)
    assert [sid for kind, _, sid, _ in got if kind == http2.DATA] == [1, 3, 5, 7, 9, 11, 15]  # not 13
    whole = asyncio.run(relay(reads[:7], answer([b"".join(replies[:6]), replies[6]], [])))
    assert whole[1] == to_client
    labels = {"model": "own", "protocol": "grpc", "route": "ModelInfer"}
    for code, n in {"ok": 5, "invalid_argument": 2, "not_found": 1}.items():
        for proxy in (state, whole[2]):
            assert (
                proxy.metrics.registry.get_sample_value("tritonshare_proxy_requests_total", {**labels, "code": code})
                == n
            )
    assert state.inflight == 0


def test_a_stream_naming_two_paths_never_reaches_triton() -> None:
    # Which :path would Triton act on? The relay does not find out: a repeated pseudo-header is malformed.
    client = Client()
    twice = client.encoder.encode(
        [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", f"/{GRPC_SERVICE}/ServerMetadata"),
            (":path", f"/{GRPC_SERVICE}/RepositoryIndex"),
            (":authority", "proxy"),
            ("content-type", "application/grpc"),
        ]
    )
    talk = b"".join(
        [
            http2.PREFACE,
            http2.settings(),
            http2.frame(http2.HEADERS, http2.END_HEADERS, 1, twice),
            data(1, b"\0" * 5),
            client.headers(3, "ServerMetadata"),
            data(3, b"\0" * 5),
        ]
    )
    to_triton, to_client, _ = asyncio.run(relay([talk]))
    opened = {sid: s.headers[":path"] for sid, s in client_streams(to_triton).items() if s.headers}
    assert opened == {3: f"/{GRPC_SERVICE}/ServerMetadata"}
    resets = [(sid, p) for kind, _, sid, p in frames(to_client) if kind == http2.RST_STREAM]
    assert resets == [(1, http2.PROTOCOL_ERROR.to_bytes(4, "big"))]


def test_a_header_block_in_several_frames_is_judged_whole_and_forwarded() -> None:
    client = Client()
    block = client.encoder.encode(
        [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", f"/{GRPC_SERVICE}/ModelInfer"),
            (":authority", "p"),
            ("content-type", "application/grpc"),
            ("x-meta", "m" * 3000),
        ]
    )
    talk = b"".join(
        [
            http2.PREFACE,
            http2.settings(),
            http2.frame(http2.HEADERS, 0, 1, block[:1000]),
            http2.frame(http2.CONTINUATION, 0, 1, block[1000:2000]),
            http2.frame(http2.CONTINUATION, http2.END_HEADERS, 1, block[2000:]),
            data(1, message("own")),
        ]
    )
    to_triton, _, _ = asyncio.run(relay(split(talk, [30, 1500, 2500])))
    stream = client_streams(to_triton)[1]
    assert stream.headers["x-meta"] == "m" * 3000 and bytes(stream.data) == message("own")


@pytest.mark.parametrize("meta", [40, 20_000])  # re-encoded in one HEADERS frame, or with a CONTINUATION
def test_re_encoded_blocks_reach_triton_whole_call_after_call_without_the_stripped_headers(meta: int) -> None:
    client = Client()
    metas = {1: "m" * meta, 3: "m" * meta, 5: "n" * meta}  # a block repeated, then another
    talk = b"".join(
        client.headers(i, "ModelInfer", ("x-admin-key", "secret"), ("x-meta", value)) + data(i, message("own"))
        for i, value in metas.items()
    )
    to_triton, _, _ = asyncio.run(relay([http2.PREFACE + http2.settings() + talk], strip_headers=("X-Admin-Key",)))
    streams = client_streams(to_triton)
    assert sorted(streams) == [1, 3, 5]
    for sid, stream in streams.items():
        assert "x-admin-key" not in stream.headers and stream.headers["x-meta"] == metas[sid]
        assert stream.headers[":path"] == f"/{GRPC_SERVICE}/ModelInfer" and bytes(stream.data) == message("own")
    sent = [(kind, flags, sid) for kind, flags, sid, _ in frames(to_triton[len(http2.PREFACE) :]) if sid]
    heads = [frame for frame in sent if frame[0] in (http2.HEADERS, http2.CONTINUATION)]
    if meta < 16_000:
        assert heads == [(http2.HEADERS, http2.END_HEADERS, sid) for sid in (1, 3, 5)]
    else:
        assert heads == [
            (kind, f, sid)
            for sid in (1, 3, 5)
            for kind, f in ((http2.HEADERS, 0), (http2.CONTINUATION, http2.END_HEADERS))
        ]


def goaway_code(to_client: bytes) -> int | None:
    codes = [int.from_bytes(p[4:8], "big") for kind, _, _, p in frames(to_client) if kind == http2.GOAWAY]
    return codes[-1] if codes else None


def test_endless_continuation_frames_end_the_connection() -> None:
    client = Client()
    flood = [http2.frame(http2.CONTINUATION, 0, 1, b"\x00\x01a\x01b" * 3000) for _ in range(8)]  # 144 KiB
    head = client.headers(3, "ModelInfer")
    talk = b"".join([http2.PREFACE, http2.frame(http2.HEADERS, 0, 3, head[9:]), *flood])
    to_triton, to_client, _ = asyncio.run(relay([talk]))
    assert goaway_code(to_client) == http2.PROTOCOL_ERROR
    assert not client_streams(to_triton)  # the block never reached Triton


def test_a_header_block_interrupted_by_another_frame_ends_the_connection() -> None:
    head = Client().headers(1, "ModelInfer")
    talk = b"".join([http2.PREFACE, http2.frame(http2.HEADERS, 0, 1, head[9:]), data(1, message("own"))])
    to_triton, to_client, _ = asyncio.run(relay([talk]))
    assert goaway_code(to_client) == http2.PROTOCOL_ERROR
    assert not client_streams(to_triton)


def test_a_silent_client_gets_no_triton_connection_and_is_closed() -> None:
    async def scenario() -> tuple[int, bool]:
        state = ProxyState(ProxySettings(name="own", triton_grpc="127.0.0.1:1"))
        opened: list[UpstreamConnection] = []

        async def open_upstream(factory: Callable[[], UpstreamConnection]) -> UpstreamConnection:
            opened.append(factory())
            return opened[-1]

        to_client = Recorder()
        connection = ClientConnection(GrpcFrontend(state, open_upstream=open_upstream), state)
        connection.connection_made(to_client)  # type: ignore[arg-type]
        for _ in range(10):
            await asyncio.sleep(0)
        assert connection._opening is not None
        connection._opening.close_silent()  # what the silence timer does after SILENT_TIMEOUT_S
        return len(opened), to_client.closed

    assert asyncio.run(scenario()) == (0, True)


@pytest.mark.parametrize("turned_away", [False, True], ids=["triton-unreachable", "turned-away"])
def test_a_connection_the_proxy_answers_itself_acknowledges_settings_and_pings(turned_away: bool) -> None:
    # the proxy stands in for Triton there: a client whose SETTINGS or keepalive PINGs go unacknowledged drops
    # the connection (a keepalive timeout) instead of reading the UNAVAILABLE answers
    async def scenario() -> list[tuple[int, int, int, bytes]]:
        state = ProxyState(ProxySettings(name="own", triton_grpc="127.0.0.1:1"))

        async def open_upstream(factory: Callable[[], UpstreamConnection]) -> UpstreamConnection:
            raise ConnectionRefusedError("connection refused")

        why = Unavailable("too many connections", "too_many_connections") if turned_away else None
        to_client = Recorder()
        connection = ClientConnection(GrpcFrontend(state, open_upstream=open_upstream), state, turned_away=why)
        connection.connection_made(to_client)  # type: ignore[arg-type]
        connection.data_received(http2.PREFACE + http2.settings() + http2.frame(http2.PING, 0, 0, b"first..."))
        for _ in range(10):  # Triton's connection is refused (a few loop iterations: task, wait_for)
            await asyncio.sleep(0)
        connection.data_received(http2.frame(http2.PING, 0, 0, b"second.."))
        return frames(bytes(to_client.out))

    answered = asyncio.run(scenario())
    assert (http2.SETTINGS, http2.ACK, 0, b"") in answered
    assert (http2.PING, http2.ACK, 0, b"first...") in answered
    assert (http2.PING, http2.ACK, 0, b"second..") in answered


def test_a_frame_trickled_in_tiny_reads_is_kept_in_one_buffer_and_relayed_whole() -> None:
    # an object per 2-byte read of a 4 MiB frame cost the proxy 6× the frame's size
    big = message("own", bytes(range(256)) * 60)  # 15 KiB: one frame, under Triton's first MAX_FRAME_SIZE
    frame = data(1, big)
    start = http2.PREFACE + http2.settings() + Client().headers(1, "ModelInfer") + frame[:9]
    kept: list[int] = []

    def pieces(connection: ClientConnection, upstream: UpstreamConnection) -> None:
        for pos in range(9, len(frame), 2):
            connection.data_received(frame[pos : pos + 2])
            kept.append(len(connection._partial))

    to_triton, _, _ = asyncio.run(relay([start], pieces))
    assert max(kept) <= 2  # the header's view and one growing buffer
    assert bytes(client_streams(to_triton)[1].data) == big


def test_an_unreachable_triton_is_logged_once_per_outage_and_counted_per_connection(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Regression: every client connection opened while Triton's gRPC port was down logged its own warning — a
    restarting Triton (down as long as its models take to load) and clients reconnecting made a line each."""

    async def scenario() -> None:
        state = ProxyState(ProxySettings(name="own", triton_grpc="127.0.0.1:1"))
        # Triton's port at each client connection in turn: refused thrice, open, silent (a connect timeout) twice
        up: list[BaseException | None] = [ConnectionRefusedError(111, "Connection refused")] * 3
        up += [None, TimeoutError(), TimeoutError()]

        async def open_upstream(factory: Callable[[], UpstreamConnection]) -> UpstreamConnection:
            if (down := up.pop(0)) is not None:
                raise down
            upstream = factory()
            upstream.connection_made(Recorder())  # type: ignore[arg-type]
            return upstream

        frontend = GrpcFrontend(state, open_upstream=open_upstream)
        for _ in range(6):
            connection = ClientConnection(frontend, state)
            connection.connection_made(Recorder())  # type: ignore[arg-type]
            connection.data_received(http2.PREFACE + http2.settings())
            for _ in range(10):  # Triton's connection opens, or is refused (task, wait_for)
                await asyncio.sleep(0)
        assert state.metrics._upstream_errors == {"rest": 0, "grpc": 5}

    with caplog.at_level(logging.INFO, logger="tritonshare.proxy.grpc_opening"):
        asyncio.run(scenario())
    said = [r.getMessage() for r in caplog.records if r.name == "tritonshare.proxy.grpc_opening"]
    down = (
        "Triton gRPC at 127.0.0.1:1 is unreachable ([Errno 111] Connection refused): answering UNAVAILABLE until it "
        "is back"
    )
    silent = "Triton gRPC at 127.0.0.1:1 is unreachable (connect timeout): answering UNAVAILABLE until it is back"
    assert said == [down, "Triton gRPC at 127.0.0.1:1 is reachable again", silent]


def test_tritons_frames_on_a_stream_the_proxy_reset_do_not_reach_the_client() -> None:
    """Triton may send on a stream before it sees the proxy's RST_STREAM: the client, answered by the proxy
    already, gets none of it, while what passes as it is (a connection's WINDOW_UPDATE) still does."""

    def triton_answers_late(_: ClientConnection, upstream: UpstreamConnection) -> None:
        upstream.data_received(data(1, message("own"), end=False) + http2.window_update(0, 10))

    _, to_client, _ = asyncio.run(relay(bidi("own", "other"), triton_answers_late))
    got = [(kind, sid) for kind, _, sid, _ in frames(to_client)]
    assert (http2.DATA, 1) not in got
    assert got[-1] == (http2.WINDOW_UPDATE, 0)
