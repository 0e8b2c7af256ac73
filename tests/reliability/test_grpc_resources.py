"""What one gRPC client connection may cost the proxy and the node's shared Triton, against the real ones: a client
that never reads, frames larger than Triton accepts, streams open at once, HTTP/2 "rapid reset" (CVE-2023-44487).
A raw HTTP/2 client (:class:`tests.proxy.wire.RawClient`) plays the hostile tenant; a real gRPC client checks the
proxy still serves everyone else.
"""

from __future__ import annotations

import random
import socket
import time
import uuid
import zlib
from collections.abc import Iterator

import grpc
import pytest
from tritonclient.grpc import service_pb2 as pb

from tests.proxy.wire import RawClient, closed, goaway_code
from tests.support.proxy import ProxyProcess
from tests.support.triton import TritonServer
from tritonshare.common.layout import NodeLayout
from tritonshare.proxy import http2
from tritonshare.proxy.policy import GRPC_SERVICE

pytestmark = pytest.mark.triton

METADATA = f"/{GRPC_SERVICE}/ServerMetadata"  # forwarded to Triton as it is: no model needed
DENIED = f"/{GRPC_SERVICE}/RepositoryIndex"  # answered by the proxy itself
EMPTY_MESSAGE = b"\x00\x00\x00\x00\x00"


@pytest.fixture(scope="module")
def proxy(triton: TritonServer, layout: NodeLayout, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    log = tmp_path_factory.mktemp("grpc-resources") / "proxy.log"
    process = ProxyProcess(f"res-{uuid.uuid4().hex[:8]}", triton, layout, log, ["--no-unload"]).start()
    yield process
    process.stop()


def serves(proxy: ProxyProcess) -> bool:
    with grpc.insecure_channel(proxy.grpc_url) as channel:
        return b"triton" in channel.unary_unary(METADATA)(b"", timeout=10)  # ServerMetadataResponse{name: triton}


def settings_of(frames: list[tuple[int, int, int, bytes]]) -> dict[int, int]:
    found = [p for kind, flags, _, p in frames if kind == http2.SETTINGS and not flags & http2.ACK]
    return http2.settings_pairs(found[0])


def test_the_client_sees_triton_s_frame_size_and_the_proxy_s_cap_on_streams(
    proxy: ProxyProcess, triton: TritonServer
) -> None:
    direct, relayed = RawClient(triton.grpc_port), RawClient(proxy.grpc_port)
    try:
        by_triton = settings_of(direct.frames(lambda got: any(f[0] == http2.SETTINGS for f in got)))
        seen = settings_of(relayed.frames(lambda got: any(f[0] == http2.SETTINGS for f in got)))
    finally:
        direct.close()
        relayed.close()
    assert seen == {**by_triton, http2.SETTINGS_MAX_CONCURRENT_STREAMS: 128}
    assert seen.get(http2.SETTINGS_MAX_FRAME_SIZE, 16384) == by_triton.get(http2.SETTINGS_MAX_FRAME_SIZE, 16384)


def test_a_frame_larger_than_triton_accepts_is_refused_before_the_proxy_holds_it(proxy: ProxyProcess) -> None:
    before = proxy.rss_kib()
    clients = [RawClient(proxy.grpc_port) for _ in range(5)]
    try:
        for client in clients:
            client.frames(lambda got: any(f[0] == http2.SETTINGS for f in got))  # Triton's SETTINGS are in
            head = http2.FRAME_HEADER.pack(0xFF, 0xFFFF, http2.DATA, 0, 1)  # 16 MiB - 1, 4x Triton's 4 MiB
            client.sock.sendall(head)
            try:
                client.sock.sendall(bytes(1 << 20))
            except (BrokenPipeError, ConnectionResetError):
                pass  # refused on the header already: the proxy closed while the body was on its way
        for client in clients:
            got = client.frames(closed)
            assert goaway_code(got) == http2.FRAME_SIZE_ERROR and closed(got)
    finally:
        for client in clients:
            client.close()
    grown = (proxy.rss_kib() - before) / 1024
    assert grown < 8, f"5 connections sending 16 MiB frames grew the proxy by {grown:.0f} MiB"
    assert serves(proxy)


def test_a_client_that_never_reads_stops_being_read(proxy: ProxyProcess) -> None:
    """Denied streams opened and reset, the answers never read: before, the proxy kept reading and queued its
    refusals (1.2M streams: +191 MiB); now it stops reading once its writes to the client back up."""
    client = RawClient(proxy.grpc_port, timeout_s=3)
    client.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    before, sent, stalled = proxy.rss_kib(), 0, False
    try:
        for batch in range(1000):  # up to 1M streams: unfixed, all read (+170 MiB); fixed, ~200k
            frames = b"".join(
                client.request(2 * (batch * 1000 + i) + 1, DENIED, end_stream=True)
                + http2.rst_stream(2 * (batch * 1000 + i) + 1, http2.CANCEL)
                for i in range(1000)
            )
            client.sock.sendall(frames)
            sent += 1000
    except TimeoutError:
        stalled = True  # the proxy stopped reading us
    finally:
        grown = (proxy.rss_kib() - before) / 1024
        client.close()
    print(f"\nunread refusals: {sent} streams sent before the send stalled; proxy RSS +{grown:.1f} MiB")
    assert stalled, f"all {sent} streams were read although their answers never were"
    assert grown < 16, f"{sent} streams whose answers were never read grew the proxy by {grown:.0f} MiB"
    assert serves(proxy)


def test_streams_past_the_cap_are_refused_and_triton_never_sees_them(proxy: ProxyProcess) -> None:
    client = RawClient(proxy.grpc_port)
    try:
        client.sock.sendall(b"".join(client.request(2 * i + 1, METADATA) for i in range(130)))  # no message yet: open
        got = client.frames(lambda got: sum(f[0] == http2.RST_STREAM for f in got) >= 2, timeout_s=10)
        refused = {sid: int.from_bytes(p, "big") for kind, _, sid, p in got if kind == http2.RST_STREAM}
        assert refused == {257: http2.REFUSED_STREAM, 259: http2.REFUSED_STREAM}
        client.sock.sendall(http2.frame(http2.DATA, http2.END_STREAM, 1, EMPTY_MESSAGE))  # stream 1 ends...
        client.frames(lambda got: any(f[0] == http2.HEADERS and f[1] & http2.END_STREAM for f in got))
        client.sock.sendall(
            client.request(261, METADATA) + http2.frame(http2.DATA, http2.END_STREAM, 261, EMPTY_MESSAGE)
        )
        got = client.frames(lambda got: any(f[2] == 261 and f[1] & http2.END_STREAM for f in got))
        assert [f[0] for f in got if f[2] == 261][-1] == http2.HEADERS  # ...and 261 is served: Triton's trailers
    finally:
        client.close()


def test_rapid_reset_ends_the_connection_and_the_proxy_serves_on(proxy: ProxyProcess) -> None:
    client = RawClient(proxy.grpc_port, timeout_s=5)
    started, sent = time.monotonic(), 0
    try:
        for batch in range(40):  # up to 20,000 streams, each forwarded to Triton and reset at once
            client.sock.sendall(
                b"".join(
                    client.request(2 * (batch * 500 + i) + 1, METADATA)
                    + http2.frame(http2.DATA, 0, 2 * (batch * 500 + i) + 1, EMPTY_MESSAGE)
                    + http2.rst_stream(2 * (batch * 500 + i) + 1, http2.CANCEL)
                    for i in range(500)
                )
            )
            sent += 500
    except (TimeoutError, ConnectionError):
        pass  # the proxy closed the connection
    got = client.frames(closed)
    client.close()
    assert goaway_code(got) == http2.ENHANCE_YOUR_CALM and closed(got)
    last = [int.from_bytes(p[:4], "big") & 0x7FFF_FFFF for kind, _, _, p in got if kind == http2.GOAWAY][-1]
    print(f"\nrapid reset: {sent} streams sent, GOAWAY after stream {last}, {time.monotonic() - started:.1f} s")
    assert last < 2 * sent - 1  # it stopped before the last stream sent (what follows lingers, dropped)
    assert "HTTP/2 rapid reset" in proxy.log_text()
    assert serves(proxy)


def test_a_connection_ended_with_goaway_is_read_to_its_end_by_a_client_still_sending(proxy: ProxyProcess) -> None:
    """The proxy half-closes after its GOAWAY and drops what the client still sends: closed at once with the
    client's bytes unread, the kernel resets the connection, and the client may lose the GOAWAY (seen once)."""
    client = RawClient(proxy.grpc_port, timeout_s=5)
    # 16 MiB: above MAX_FRAME_SIZE both before Triton's SETTINGS pass (16 KiB) and after (its 4 MiB)
    oversized = b"\xff\xff\xff" + bytes([http2.DATA, 0]) + (1).to_bytes(4, "big")
    client.sock.sendall(oversized)
    time.sleep(0.2)  # the proxy has answered and ended the connection; the client did not notice and sends on
    for _ in range(20):
        client.sock.sendall(b"\x00" * 32_768)  # never read by anyone
    got = client.frames(closed)
    client.close()
    assert goaway_code(got) == http2.FRAME_SIZE_ERROR and closed(got)
    assert serves(proxy)


def test_bytes_after_a_compressed_message_in_one_big_frame_are_refused_and_the_proxy_serves_on(
    proxy: ProxyProcess,
) -> None:
    """One DATA frame (Triton lets frames grow to 4 MiB) whose gzip stream inflates past the inflater's first 1 MiB
    step and ends with bytes after it: zlib then hands those bytes back as unconsumed input, and the proxy's
    inflate loop fed them back forever — one message left the proxy's event loop spinning, every client of the
    pod unanswered."""
    noise = random.Random(0)
    contents = b"".join(noise.randbytes(2048) + bytes(30720) for _ in range(128))  # 4 MiB, ~15x compressible
    request = pb.ModelInferRequest(model_name=proxy.name)
    request.inputs.add(name="INPUT0", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(contents)
    stream = zlib.compressobj(6, zlib.DEFLATED, 31)  # gzip
    packed = stream.compress(request.SerializeToString()) + stream.flush() + b"\x08\x01"  # 2 bytes after its end
    message = b"\x01" + len(packed).to_bytes(4, "big") + packed
    client = RawClient(proxy.grpc_port)
    try:
        got = client.frames(lambda got: any(f[0] == http2.SETTINGS and not f[1] & http2.ACK for f in got))
        assert settings_of(got).get(http2.SETTINGS_MAX_FRAME_SIZE, 0) > len(message)  # one frame holds it
        client.sock.sendall(
            client.request(1, f"/{GRPC_SERVICE}/ModelInfer", extra=(("grpc-encoding", "gzip"),))
            + http2.frame(http2.DATA, http2.END_STREAM, 1, message)
        )
        got = client.frames(
            lambda got: any(f[2] == 1 and (f[0] == http2.RST_STREAM or f[1] & http2.END_STREAM) for f in got),
            timeout_s=10,
        )
        assert any(f[2] == 1 for f in got), "no answer to the stream within 10 s"
        assert b"after its" in b"".join(p for kind, _, sid, p in got if sid == 1 and kind == http2.HEADERS)
    finally:
        client.close()
    assert serves(proxy)
