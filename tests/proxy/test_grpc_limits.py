"""What one gRPC client connection may cost the proxy and the shared Triton: frame and header block sizes, a
CONTINUATION flood, streams open at once, streams reset early (HTTP/2 "rapid reset"), idle connections, a
client that never reads, and frames only servers send. Driven without sockets, as in ``test_grpc_relay``.
"""

from __future__ import annotations

import asyncio
import gzip
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.proxy.test_grpc_relay import Client, Recorder, data, frames, goaway_code, message, relay
from tests.proxy.wire import client_streams
from tritonshare.proxy import http2
from tritonshare.proxy.grpc import GrpcFrontend
from tritonshare.proxy.grpc_connection import ClientConnection
from tritonshare.proxy.grpc_headers import MAX_CONTINUATIONS
from tritonshare.proxy.grpc_messages import MessageInspector, MessageJudge
from tritonshare.proxy.grpc_streams import RESET_BURST
from tritonshare.proxy.grpc_upstream import UpstreamConnection
from tritonshare.proxy.policy import judge_grpc_method
from tritonshare.proxy.settings import ProxySettings
from tritonshare.proxy.state import ProxyState

START = http2.PREFACE + http2.settings()
MIB = 1 << 20


def triton_says(settings: dict[int, int]) -> Callable[[ClientConnection, UpstreamConnection], None]:
    """After the client's bytes: Triton's SETTINGS arrive."""
    return lambda _, upstream: upstream.data_received(http2.settings(settings))


def after_triton_says(
    settings: dict[int, int], chunks: list[bytes]
) -> Callable[[ClientConnection, UpstreamConnection], None]:
    """Triton's SETTINGS arrive, then the client's ``chunks``, one read each (none once the connection is closed)."""

    def then(connection: ClientConnection, upstream: UpstreamConnection) -> None:
        upstream.data_received(http2.settings(settings))
        for chunk in chunks:
            if connection.transport is None or connection.transport.is_closing():
                return
            connection.data_received(chunk)

    return then


def client_settings(to_client: bytes) -> dict[int, int]:
    found = [p for kind, flags, _, p in frames(to_client) if kind == http2.SETTINGS and not flags & http2.ACK]
    return http2.settings_pairs(found[-1])


def resets(to_client: bytes) -> dict[int, int]:
    return {sid: int.from_bytes(p, "big") for kind, _, sid, p in frames(to_client) if kind == http2.RST_STREAM}


# ---------------------------------------------------------------------------------------------- frame sizes


def test_a_frame_longer_than_the_client_may_send_ends_the_connection_before_it_is_held() -> None:
    head = http2.FRAME_HEADER.pack(0xFF, 0xFFFF, http2.DATA, 0, 1)  # 16 MiB - 1: what the header can say
    to_triton, to_client, _ = asyncio.run(relay([START, head + bytes(1000)]))
    assert goaway_code(to_client) == http2.FRAME_SIZE_ERROR
    assert to_triton == START  # nothing of it reached Triton


def test_frames_may_grow_to_what_triton_advertises_and_no_further() -> None:
    client = Client()
    big = message("own", bytes(MIB))  # one 1 MiB DATA frame: fine once Triton said 4 MiB
    talk = [START + client.headers(1, "ModelInfer"), *split_frame(data(1, big))]
    to_triton, to_client, _ = asyncio.run(relay(talk))  # before Triton's SETTINGS: 16 KiB at most
    assert goaway_code(to_client) == http2.FRAME_SIZE_ERROR
    larger = {http2.SETTINGS_MAX_FRAME_SIZE: 4 * MIB}
    to_triton, to_client, _ = asyncio.run(relay(talk[:1], after_triton_says(larger, talk[1:])))
    assert goaway_code(to_client) is None
    assert bytes(client_streams(to_triton)[1].data) == big
    too_big = http2.FRAME_HEADER.pack(0x40, 1, http2.DATA, 0, 1)  # 4 MiB + 1
    to_triton, to_client, _ = asyncio.run(relay(talk[:1], after_triton_says(larger, [*talk[1:], too_big])))
    assert goaway_code(to_client) == http2.FRAME_SIZE_ERROR


def split_frame(frame: bytes, size: int = 65536) -> list[bytes]:
    return [frame[i : i + size] for i in range(0, len(frame), size)]


@pytest.mark.parametrize("whole", [True, False], ids=["one read", "many reads"])
def test_a_header_block_in_one_frame_is_held_to_max_header_bytes(whole: bool) -> None:
    fields = [(":method", "POST"), (":path", "/inference.GRPCInferenceService/ServerMetadata"), ("x-pad", "p" * 70_000)]
    frame = http2.frame(http2.HEADERS, http2.END_HEADERS, 1, Client().encoder.encode(fields, huffman=False))
    chunks = [frame] if whole else split_frame(frame, 4096)
    larger = {http2.SETTINGS_MAX_FRAME_SIZE: 4 * MIB}  # (not refused for its frame size)
    to_triton, to_client, _ = asyncio.run(relay([START], after_triton_says(larger, chunks)))
    assert goaway_code(to_client) == http2.PROTOCOL_ERROR
    assert not client_streams(to_triton)


def test_a_continuation_flood_ends_the_connection_after_a_few_frames() -> None:
    head = Client().headers(1, "ServerMetadata")
    flood = http2.frame(http2.CONTINUATION, 0, 1, b"") * 5000  # 45 KiB: under max_header_bytes
    to_triton, to_client, _ = asyncio.run(relay([START + http2.frame(http2.HEADERS, 0, 1, head[9:]) + flood]))
    assert goaway_code(to_client) == http2.ENHANCE_YOUR_CALM
    assert not client_streams(to_triton)


def test_a_header_block_in_its_most_continuation_frames_is_forwarded() -> None:
    block = Client().encoder.encode(
        [(":method", "POST"), (":path", "/inference.GRPCInferenceService/ServerMetadata"), ("x-meta", "m" * 320)]
    )
    count = MAX_CONTINUATIONS + 1  # the HEADERS frame and its CONTINUATIONs
    pieces = [block[len(block) * i // count : len(block) * (i + 1) // count] for i in range(count)]
    talk = http2.frame(http2.HEADERS, 0, 1, pieces[0]) + b"".join(
        http2.frame(http2.CONTINUATION, http2.END_HEADERS if i == len(pieces) - 1 else 0, 1, p)
        for i, p in enumerate(pieces)
        if i
    )
    to_triton, to_client, _ = asyncio.run(relay([START + talk + data(1, b"\x00" * 5)]))
    assert goaway_code(to_client) is None
    assert client_streams(to_triton)[1].headers["x-meta"] == "m" * 320


# ---------------------------------------------------------------------------------------------- streams


def test_a_stream_opened_after_the_drains_goaway_is_refused_first_and_counted_as_draining(tmp_path: Path) -> None:
    """REFUSED_STREAM says it was not processed, so the client may retry it on another replica: before the token
    check (UNAUTHENTICATED is not retried) and counted, as REST counts its 503 after a drain."""
    tokens = tmp_path / "tokens"
    tokens.write_text("secret\n")
    client = Client()

    def drain_then_open(connection: ClientConnection, _: UpstreamConnection) -> None:
        connection.begin_drain()
        connection.data_received(client.headers(3, "ModelInfer") + data(3, message("own")))

    talk = START + client.headers(1, "ModelInfer", ("authorization", "Bearer secret"))
    to_triton, to_client, state = asyncio.run(relay([talk], drain_then_open, auth_token_file=tokens))
    assert goaway_code(to_client) == http2.NO_ERROR
    assert sorted(client_streams(to_triton)) == [1]  # stream 1 came before the GOAWAY and goes on
    assert resets(to_client) == {3: http2.REFUSED_STREAM}
    refusals = {
        sample.labels["reason"]: sample.value
        for family in state.metrics.registry.collect()
        for sample in family.samples
        if sample.name == "tritonshare_proxy_refusals_total" and sample.labels["route"] == "ModelInfer"
    }
    assert refusals["draining"] == 1 and refusals["unauthenticated"] == 0


def test_the_client_is_told_the_cap_on_streams_and_one_past_it_is_refused() -> None:
    client = Client()
    talk = START + b"".join(client.headers(2 * i + 1, "ModelInfer") for i in range(5))
    to_triton, to_client, state = asyncio.run(
        relay([talk], triton_says({http2.SETTINGS_MAX_FRAME_SIZE: 4 * MIB}), grpc_max_streams=3)
    )
    assert client_settings(to_client) == {http2.SETTINGS_MAX_FRAME_SIZE: 4 * MIB, 3: 3}
    assert sorted(client_streams(to_triton)) == [1, 3, 5]  # 7 and 9 never reach Triton
    assert resets(to_client) == {7: http2.REFUSED_STREAM, 9: http2.REFUSED_STREAM}
    labels = {"model": "own", "protocol": "grpc", "route": "ModelInfer", "reason": "too_many_streams"}
    assert state.metrics.registry.get_sample_value("tritonshare_proxy_refusals_total", labels) == 2


def test_a_stream_ended_makes_room_for_the_next() -> None:
    """(Cancellations forwarded: the reset ends the stream at Triton. Absorbed, the stream keeps its place until
    Triton ends it: test_grpc_abandon.)"""
    client = Client()
    talk = START + client.headers(1, "ModelInfer") + client.headers(3, "ModelInfer")
    talk += http2.rst_stream(1, http2.CANCEL) + client.headers(5, "ModelInfer")
    to_triton, to_client, _ = asyncio.run(relay([talk], grpc_max_streams=2, grpc_cancellations="forward"))
    assert sorted(client_streams(to_triton)) == [1, 3, 5]
    assert not resets(to_client)


def test_triton_s_lower_cap_on_streams_is_passed_on_as_it_is() -> None:
    _, to_client, _ = asyncio.run(relay([START], triton_says({3: 10, 4: 65535})))
    assert client_settings(to_client) == {3: 10, 4: 65535}


def test_rapid_reset_ends_the_connection_after_a_bounded_number_of_streams() -> None:
    """(Cancellations forwarded. Absorbed, the calls run on at Triton and keep their places under the cap on
    streams, which bounds them first: test_grpc_abandon.)"""
    client, body = Client(), message("own")
    talk = [
        client.headers(2 * i + 1, "ModelInfer") + data(2 * i + 1, body) + http2.rst_stream(2 * i + 1, http2.CANCEL)
        for i in range(3 * RESET_BURST)
    ]
    to_triton, to_client, _ = asyncio.run(relay([START, *talk], grpc_cancellations="forward"))
    assert goaway_code(to_client) == http2.ENHANCE_YOUR_CALM
    reached = len(client_streams(to_triton))
    assert RESET_BURST <= reached <= RESET_BURST + 100, reached  # (+ what 100 a second refill meanwhile)


def test_refused_messages_count_as_streams_ended_early() -> None:
    client, body = Client(), message("other")  # another tenant's model: refused, the stream reset at Triton
    talk = [client.headers(2 * i + 1, "ModelInfer") + data(2 * i + 1, body) for i in range(2 * RESET_BURST)]
    _, to_client, _ = asyncio.run(relay([START, *talk]))
    assert goaway_code(to_client) == http2.ENHANCE_YOUR_CALM


def test_requests_on_a_stream_id_already_used_end_the_connection() -> None:
    client = Client()
    talk = [START + client.headers(3, "ServerMetadata") + data(3, b"\x00" * 5), client.headers(1, "ServerMetadata")]
    to_triton, to_client, _ = asyncio.run(relay(talk))
    assert goaway_code(to_client) == http2.PROTOCOL_ERROR
    assert sorted(client_streams(to_triton)) == [3]


def test_trailers_of_a_stream_no_longer_open_are_dropped_quietly() -> None:
    client = Client()
    trailers = http2.frame(
        http2.HEADERS, http2.END_HEADERS | http2.END_STREAM, 1, client.encoder.encode([("x-t", "1")])
    )
    talk = START + client.headers(1, "RepositoryIndex") + trailers  # denied: answered here
    _, to_client, _ = asyncio.run(relay([talk]))
    assert goaway_code(to_client) is None


def test_a_client_push_promise_ends_the_connection() -> None:
    client = Client()
    opening = START + client.headers(1, "ServerMetadata")
    promise = http2.frame(http2.PUSH_PROMISE, http2.END_HEADERS, 1, b"\x00\x00\x00\x02" + client.headers(2, "x")[9:])
    to_triton, to_client, _ = asyncio.run(relay([opening, promise]))
    assert goaway_code(to_client) == http2.PROTOCOL_ERROR
    assert http2.PUSH_PROMISE not in [kind for kind, *_ in frames(to_triton[len(http2.PREFACE) :])]


# ---------------------------------------------------------------------------------------------- connections


class PausingRecorder(Recorder):
    """A transport that remembers whether reading it is paused."""

    paused = False

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False


def test_a_client_that_does_not_read_is_not_read_either() -> None:
    async def scenario() -> list[bool]:
        state = ProxyState(ProxySettings(name="own", triton_grpc="127.0.0.1:1"))
        to_client, to_triton = PausingRecorder(), PausingRecorder()

        async def open_upstream(factory: Callable[[], UpstreamConnection]) -> UpstreamConnection:
            upstream = factory()
            upstream.connection_made(to_triton)  # type: ignore[arg-type]
            return upstream

        connection = ClientConnection(GrpcFrontend(state, open_upstream=open_upstream), state)
        connection.connection_made(to_client)  # type: ignore[arg-type]
        connection.data_received(START)
        for _ in range(10):
            await asyncio.sleep(0)
        seen = []
        connection.pause_writing()  # the client's write buffer is full
        seen += [to_client.paused, to_triton.paused]
        connection.upstream_paused(True)  # and Triton's
        connection.resume_writing()
        seen.append(to_client.paused)  # still: Triton's buffer is full
        connection.upstream_paused(False)
        seen.append(to_client.paused)
        return seen

    assert asyncio.run(scenario()) == [True, True, True, False]


def test_a_connection_with_no_stream_open_goes_away_after_the_idle_timeout() -> None:
    idle_s = 0.3

    async def scenario() -> tuple[bool, float, bytes]:
        settings = ProxySettings(
            name="own", triton_grpc="127.0.0.1:1", grpc_idle_timeout_s=idle_s, grpc_cancellations="forward"
        )  # (the reset ends the stream at once)
        state = ProxyState(settings)
        to_client, to_triton = Recorder(), Recorder()

        async def open_upstream(factory: Callable[[], UpstreamConnection]) -> UpstreamConnection:
            upstream = factory()
            upstream.connection_made(to_triton)  # type: ignore[arg-type]
            return upstream

        connection = ClientConnection(GrpcFrontend(state, open_upstream=open_upstream), state)
        connection.connection_made(to_client)  # type: ignore[arg-type]
        connection.data_received(START + Client().headers(1, "ModelInfer"))  # a stream open: not idle
        await asyncio.sleep(3 * idle_s)
        open_through = not to_client.closed
        connection.data_received(http2.rst_stream(1, http2.CANCEL))
        idle_from = time.monotonic()
        while not to_client.closed and time.monotonic() - idle_from < 10 * idle_s:
            await asyncio.sleep(0.01)
        idle_for = time.monotonic() - idle_from
        connection.connection_lost(None)
        return open_through, idle_for, bytes(to_client.out)

    open_through, idle_for, to_client = asyncio.run(scenario())
    assert open_through  # a stream was open for three timeouts
    assert idle_s <= idle_for <= 3 * idle_s  # checked once a timeout: closed after one to two
    assert goaway_code(to_client) == http2.NO_ERROR


# ---------------------------------------------------------------------------------------------- messages


@pytest.mark.parametrize("encoding", [b"gzip", b"deflate"])
def test_a_compressed_message_with_bytes_after_its_stream_is_refused(encoding: bytes) -> None:
    body = message("own")[5:]
    packed = gzip.compress(body) if encoding == b"gzip" else zlib.compress(body)
    rule = judge_grpc_method("/inference.GRPCInferenceService/ModelInfer")
    assert rule is not None
    judge = MessageJudge(rule, b"own", limit=MIB)
    for tail, refused in ((b"", False), (b"\x08\x01", True)):
        framed = b"\x01" + len(packed + tail).to_bytes(4, "big") + packed + tail
        refusal = MessageInspector(judge, encoding=encoding).feed(framed, 0, len(framed))
        assert (refusal is not None) == refused
        if refusal is not None:
            assert "after its" in refusal.message
