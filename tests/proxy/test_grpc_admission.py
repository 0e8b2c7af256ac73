"""Admission control on the gRPC relay, frame by frame (no sockets): what of a waiting stream reaches Triton
and when, what the client gets when the stream is refused or goes away, and the flow-control credit of the
bytes the proxy held back. Triton's side is decoded with the ``hpack`` package's own decoder."""

from __future__ import annotations

import asyncio

import hpack
import pytest

from tests.proxy.test_grpc_relay import Client, Recorder, data, frames, header_fields, message
from tests.proxy.wire import client_streams
from tritonshare.proxy import grpc_admission, http2
from tritonshare.proxy.grpc import GrpcFrontend
from tritonshare.proxy.grpc_connection import ClientConnection
from tritonshare.proxy.grpc_upstream import UpstreamConnection
from tritonshare.proxy.settings import ProxySettings
from tritonshare.proxy.state import ProxyState

pytestmark = pytest.mark.asyncio

BIG = message("own", bytes(range(256)) * 200)  # 51 KiB: more than one DATA frame of a client


class Relay:
    """One relayed connection with one admission slot; the test plays client and Triton."""

    def __init__(self, **options: object) -> None:
        """``options``: the proxy's settings besides one admission slot."""
        settings = {"max_inflight": 1, "queue_timeout_s": 30.0, **options}
        self.state = ProxyState(ProxySettings(name="own", triton_grpc="127.0.0.1:1", **settings))  # type: ignore[arg-type]
        self.to_triton, self.to_client = Recorder(), Recorder()
        self.client = Client()
        self.triton = hpack.Encoder()
        self.upstream: UpstreamConnection | None = None
        self.frontend = GrpcFrontend(self.state, open_upstream=self._open)
        self.connection = ClientConnection(self.frontend, self.state)
        self.connection.connection_made(self.to_client)  # type: ignore[arg-type]

    async def _open(self, factory: object) -> UpstreamConnection:
        upstream: UpstreamConnection = factory()  # type: ignore[operator]
        upstream.connection_made(self.to_triton)  # type: ignore[arg-type]
        self.upstream = upstream
        return upstream

    async def start(self) -> Relay:
        self.connection.data_received(http2.PREFACE + http2.settings())
        for _ in range(10):  # the upstream "connects"
            await asyncio.sleep(0)
        assert self.upstream is not None
        return self

    async def send(self, *frames_: bytes) -> None:
        self.connection.data_received(b"".join(frames_))
        await settle()

    async def triton_ends(self, stream_id: int) -> None:
        """Triton answers the stream: response headers, a message, trailers."""
        assert self.upstream is not None
        fields = [(":status", "200"), ("content-type", "application/grpc")]
        head = http2.frame(http2.HEADERS, http2.END_HEADERS, stream_id, self.triton.encode(fields))
        body = data(stream_id, b"\x00\x00\x00\x00\x00", end=False)
        tail = self.triton.encode([("grpc-status", "0")])
        self.upstream.data_received(
            head + body + http2.frame(http2.HEADERS, http2.END_HEADERS | http2.END_STREAM, stream_id, tail)
        )
        await settle()

    def at_triton(self) -> dict[int, object]:
        return client_streams(bytes(self.to_triton.out))  # type: ignore[return-value]

    def client_statuses(self) -> dict[int, dict[str, str]]:
        return header_fields(bytes(self.to_client.out))

    def credits(self, stream_id: int = 0) -> int:
        return sum(
            http2.window_increment(p)
            for kind, _, sid, p in frames(bytes(self.to_client.out))
            if kind == http2.WINDOW_UPDATE and sid == stream_id
        )


async def settle() -> None:
    for _ in range(5):  # admission answers come through loop.call_soon
        await asyncio.sleep(0)


def chunks(stream_id: int, payload: bytes, size: int = 16_384) -> list[bytes]:
    pieces = [payload[i : i + size] for i in range(0, len(payload), size)]
    return [data(stream_id, piece, end=i == len(pieces) - 1) for i, piece in enumerate(pieces)]


async def test_a_waiting_stream_reaches_triton_but_for_its_last_byte_until_the_slot_comes() -> None:
    relay = await Relay().start()
    await relay.send(relay.client.headers(1, "ModelInfer"), *chunks(1, BIG))  # takes the slot
    await relay.send(relay.client.headers(3, "ModelInfer"), *chunks(3, BIG))  # waits
    waiting = relay.at_triton()[3]
    assert waiting.headers[":path"].endswith("/ModelInfer")  # type: ignore[attr-defined]
    assert bytes(waiting.data) == BIG[:-1] and not waiting.end_stream  # type: ignore[attr-defined]
    assert relay.state.admission.waiting == 1
    await relay.triton_ends(1)
    admitted = relay.at_triton()[3]
    assert bytes(admitted.data) == BIG and admitted.end_stream  # type: ignore[attr-defined]
    assert relay.state.admission.stats.inflight == 1 and relay.state.admission.waiting == 0
    await relay.triton_ends(3)
    assert relay.state.admission.idle and relay.state.inflight == 0
    assert relay.credits() == 0  # nothing was held back for good


async def test_padding_of_the_cut_frame_is_credited_to_the_client() -> None:
    relay = await Relay().start()
    await relay.send(relay.client.headers(1, "ModelInfer"), data(1, message("own")))
    small = message("own")
    padded = http2.frame(http2.DATA, http2.END_STREAM | http2.PADDED, 3, bytes([10]) + small + b"\x00" * 10)
    await relay.send(relay.client.headers(3, "ModelInfer"), padded)
    assert bytes(relay.at_triton()[3].data) == small[:-1]  # type: ignore[attr-defined]
    assert relay.credits(0) == relay.credits(3) == 11  # the pad length byte and 10 bytes of padding
    await relay.triton_ends(1)
    assert bytes(relay.at_triton()[3].data) == small  # type: ignore[attr-defined]


async def test_a_later_header_block_of_a_waiting_stream_follows_its_held_data() -> None:
    relay = await Relay().start()
    await relay.send(relay.client.headers(1, "ModelInfer"), data(1, message("own")))
    opening = relay.client.headers(3, "ModelInfer")
    trailers = http2.frame(
        http2.HEADERS,
        http2.END_HEADERS | http2.END_STREAM,
        3,
        relay.client.encoder.encode([("x-trailer", "t")]),  # indexed: changes the client's HPACK table
    )
    await relay.send(opening, data(3, message("own"), end=False), trailers)
    assert not relay.at_triton()[3].end_stream  # type: ignore[attr-defined]
    await relay.triton_ends(1)
    await relay.send(relay.client.headers(5, "ModelMetadata"), data(5, message("own")))  # decodable after it
    streams = relay.at_triton()
    assert bytes(streams[3].data) == message("own") and streams[3].end_stream  # type: ignore[attr-defined]
    assert streams[3].headers["x-trailer"] == "t"  # type: ignore[attr-defined]
    assert streams[5].headers[":path"].endswith("/ModelMetadata")  # type: ignore[attr-defined]


async def test_a_client_reset_leaves_the_queue_and_is_credited() -> None:
    relay = await Relay().start()
    await relay.send(relay.client.headers(1, "ModelInfer"), data(1, message("own")))
    await relay.send(relay.client.headers(3, "ModelInfer"), data(3, BIG))
    assert relay.state.admission.waiting == 1
    await relay.send(http2.rst_stream(3, http2.CANCEL))
    assert relay.state.admission.waiting == 0
    assert relay.at_triton()[3].reset_code == http2.CANCEL  # type: ignore[attr-defined]
    assert relay.credits() == 1  # the one byte Triton never got
    await relay.triton_ends(1)
    assert relay.state.admission.idle and relay.state.inflight == 0


async def test_a_stream_that_waits_too_long_is_refused_and_reset_at_triton() -> None:
    relay = await Relay(queue_timeout_s=0.05).start()
    await relay.send(relay.client.headers(1, "ModelInfer"), data(1, message("own")))
    await relay.send(relay.client.headers(3, "ModelInfer"), data(3, BIG[:20_000], end=False))
    await asyncio.sleep(0.1)
    await settle()
    status = relay.client_statuses()[3]
    assert status["grpc-status"] == "8"
    assert "no slot free within 0.05 s" in status["grpc-message"]
    assert status["grpc-retry-pushback-ms"] == "1000"
    assert relay.at_triton()[3].reset_code == http2.CANCEL  # type: ignore[attr-defined]
    before = relay.credits()
    await relay.send(data(3, BIG[20_000:]))  # the client had sent more meanwhile: dropped, credited
    assert relay.credits() - before == len(BIG) - 20_000
    assert bytes(relay.at_triton()[3].data) == BIG[:20_000]  # type: ignore[attr-defined]
    assert relay.state.metrics.registry.get_sample_value(
        "tritonshare_proxy_requests_total",
        {"model": "own", "protocol": "grpc", "route": "ModelInfer", "code": "resource_exhausted"},
    )
    await relay.triton_ends(1)
    assert relay.state.admission.idle and relay.state.inflight == 0


async def test_a_waiting_stream_past_the_held_bytes_bound_is_refused_and_credited(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a client that ignores flow control and sends on while its stream waits held 4 GB in the proxy
    monkeypatch.setattr(grpc_admission, "MAX_HELD_BYTES", 100_000)
    relay = await Relay().start()
    await relay.send(relay.client.headers(1, "ModelInfer"), data(1, message("own")))  # takes the slot
    await relay.send(relay.client.headers(3, "ModelInfer"), data(3, message("own"), end=False))  # waits, holds 1 B
    assert relay.state.admission.waiting == 1 and relay.state.admission.held_bytes == 1
    before = relay.credits()
    second = chunks(3, message("own", bytes(200_000)))[:8]  # the first 128 KiB of a second message, held
    await relay.send(*second)
    status = relay.client_statuses()[3]
    assert status["grpc-status"] == "8" and "holds 0 MiB for calls waiting for a slot" in status["grpc-message"]
    assert relay.at_triton()[3].reset_code == http2.CANCEL  # type: ignore[attr-defined]
    assert relay.credits() - before == 1 + 8 * 16_384  # everything it held, credited back
    assert relay.state.admission.held_bytes == 0 and relay.state.admission.waiting == 0
    await relay.triton_ends(1)
    assert relay.state.admission.idle and relay.state.inflight == 0


async def test_a_waiting_stream_naming_another_model_is_refused_and_leaves_the_queue() -> None:
    relay = await Relay().start()
    await relay.send(relay.client.headers(1, "ModelInfer"), data(1, message("own")))
    await relay.send(relay.client.headers(3, "ModelInfer"), data(3, message("other")))
    assert relay.client_statuses()[3]["grpc-status"] == "5"  # NOT_FOUND, as without admission control
    assert relay.state.admission.waiting == 0
    assert relay.at_triton()[3].reset_code == http2.CANCEL  # type: ignore[attr-defined]
    await relay.triton_ends(1)
    assert relay.state.admission.idle


async def test_a_stream_admitted_at_once_is_judged_as_without_admission_control() -> None:
    """The gate follows only a stream that waits: one that takes its slot at once is judged frame by frame as
    any stream is, a message split over frames reaching Triton whole and one naming another model refused."""
    relay = await Relay().start()
    await relay.send(relay.client.headers(1, "ModelInfer"), *chunks(1, BIG))
    assert bytes(relay.at_triton()[1].data) == BIG  # type: ignore[attr-defined]
    await relay.triton_ends(1)
    assert relay.state.admission.idle
    await relay.send(relay.client.headers(3, "ModelInfer"), data(3, message("other")))
    assert relay.client_statuses()[3]["grpc-status"] == "5"  # NOT_FOUND
    assert relay.at_triton()[3].reset_code == http2.CANCEL  # type: ignore[attr-defined]
    assert relay.state.admission.idle  # its slot came back with the refusal


async def test_metadata_and_readiness_never_wait() -> None:
    relay = await Relay().start()
    await relay.send(relay.client.headers(1, "ModelInfer"), data(1, message("own")))
    await relay.send(relay.client.headers(3, "ModelMetadata"), data(3, message("own")))
    assert bytes(relay.at_triton()[3].data) == message("own")  # type: ignore[attr-defined]
    assert relay.state.admission.waiting == 0


async def test_a_waiting_stream_cannot_pile_up_header_blocks() -> None:
    relay = await Relay().start()
    await relay.send(relay.client.headers(1, "ModelInfer"), data(1, message("own")))
    await relay.send(relay.client.headers(3, "ModelInfer"), data(3, message("own"), end=False))
    block = relay.client.encoder.encode([("x-trailer", "t")])
    await relay.send(http2.frame(http2.HEADERS, http2.END_HEADERS | http2.END_STREAM, 3, block))
    assert not relay.to_client.closed
    await relay.send(http2.frame(http2.HEADERS, http2.END_HEADERS | http2.END_STREAM, 3, block))
    goaway = [p for kind, _, _, p in frames(bytes(relay.to_client.out)) if kind == http2.GOAWAY]
    assert relay.to_client.closed and int.from_bytes(goaway[-1][4:8], "big") == http2.PROTOCOL_ERROR
