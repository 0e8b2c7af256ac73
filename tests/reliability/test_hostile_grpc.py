"""Hostile gRPC input, judged where it matters: at "Triton". The proxy relays to a recording grpcio server
(:class:`~tests.reliability.conftest.GrpcRecorder`); after every generated call, each message that reached it must
be lawful by REFERENCE §3, read the way Triton reads it (a full protobuf parse: the last field 1 wins): a method
of the allow table, the own model's name in every own-model request, no shared-memory parameter in any infer
request. Messages are built field by field — any order, field 1 repeated or of the wrong wire type, unknown
fields, truncated bytes, compressed — over any method name, unary and streamed. The proxy must stay alive.
"""

from __future__ import annotations

import contextlib
import random
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import grpc
import pytest
from google.protobuf.message import DecodeError, Message
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2 as pb

from tests.reliability.conftest import RESTRICTED_KEY, Hostile
from tests.support.children import vm_kib
from tests.support.ports import free_port, wait_port
from tritonshare.proxy.policy import GRPC_SERVICE, HEALTH_SERVICE

OWN = "tenant-own"
OTHER = "tenant-other"
SHM_KEYS = ("shared_memory_region", "shared_memory_offset", "shared_memory_byte_size")
EXAMPLES = settings(
    max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
MIB = 1 << 20

# ---------------------------------------------------------------------------------------------- the oracle

FORWARDED_AS_IS = {f"/{GRPC_SERVICE}/ServerMetadata"}  # (the probes are answered by the proxy: never forwarded)
OWN_REQUESTS: dict[str, Callable[[bytes], Message]] = {
    f"/{GRPC_SERVICE}/ModelReady": pb.ModelReadyRequest.FromString,
    f"/{GRPC_SERVICE}/ModelMetadata": pb.ModelMetadataRequest.FromString,
    f"/{GRPC_SERVICE}/ModelConfig": pb.ModelConfigRequest.FromString,
    f"/{GRPC_SERVICE}/ModelStatistics": pb.ModelStatisticsRequest.FromString,
    f"/{GRPC_SERVICE}/ModelInfer": pb.ModelInferRequest.FromString,
    f"/{GRPC_SERVICE}/ModelStreamInfer": pb.ModelInferRequest.FromString,
}


def unlawful(method: str, message: bytes, own: str) -> str | None:
    """Why this message must not have reached Triton, or None."""
    if method in FORWARDED_AS_IS:
        return None
    parse = OWN_REQUESTS.get(method)
    if parse is None:
        return f"method {method} is not in the allow table"
    try:
        request = parse(message)
    except DecodeError:
        return None  # Triton cannot parse it either: it refuses the call
    name = request.model_name if isinstance(request, pb.ModelInferRequest) else request.name
    if name != own:
        return f"{method} for model {name!r}"
    if isinstance(request, pb.ModelInferRequest) and (keys := shm_keys(request)):
        return f"{method} with shared-memory parameters {keys}"
    return None


def shm_keys(request: pb.ModelInferRequest) -> list[str]:
    maps = [request.parameters, *(t.parameters for t in request.inputs), *(t.parameters for t in request.outputs)]
    return [key for parameters in maps for key in parameters if key in SHM_KEYS]


def assert_nothing_unlawful_reached_triton(hostile: Hostile, since: int) -> None:
    reasons = [r for method, message in hostile.grpc.seen[since:] if (r := unlawful(method, message, hostile.own))]
    assert not reasons, reasons
    keys = [m[RESTRICTED_KEY] for m in hostile.grpc.metadata[since:] if RESTRICTED_KEY in m]
    assert not keys, f"Triton's restricted-API key reached it: {keys}"
    assert hostile.alive(), hostile.proxy.log_text()[-3000:]


@pytest.fixture(scope="module")
def channel(hostile: Hostile) -> Iterator[grpc.Channel]:
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    with grpc.insecure_channel(hostile.proxy.grpc_url, options=options) as ch:
        yield ch


def call(
    channel: grpc.Channel, method: str, message: bytes, *, gzip: bool = False, metadata: Sequence[tuple[str, str]] = ()
) -> str:
    """A unary call with raw request bytes; the status name it ended with."""
    compression = grpc.Compression.Gzip if gzip else grpc.Compression.NoCompression
    try:
        channel.unary_unary(method)(message, timeout=10, compression=compression, metadata=metadata)
    except grpc.RpcError as exc:
        return str(exc.code().name)
    return "OK"


def still_serves(hostile: Hostile, channel: grpc.Channel) -> None:
    since = len(hostile.grpc.seen)
    assert call(channel, f"/{GRPC_SERVICE}/ModelReady", pb.ModelReadyRequest(name=OWN).SerializeToString()) == "OK"
    assert len(hostile.grpc.seen) == since + 1


# ---------------------------------------------------------------------------------------------- protobuf by hand


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def tag(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


def ld(number: int, payload: bytes) -> bytes:
    """A length-delimited field."""
    return tag(number, 2) + varint(len(payload)) + payload


names = st.one_of(
    st.sampled_from([OWN, OTHER, "", OWN.upper(), OWN + "\x00", OWN + " ", " " + OWN, OWN[:-1]]),
    st.text(max_size=12),
).map(lambda text: text.encode("utf-8"))
parameter_keys = st.one_of(st.sampled_from(SHM_KEYS), st.sampled_from(["priority", "timeout", "x"]))
parameter_values = st.one_of(
    st.binary(max_size=8).map(lambda b: ld(3, b)),  # string_param
    st.integers(0, 2**32).map(lambda n: tag(2, 0) + varint(n)),  # int64_param
)
map_entries = st.builds(lambda key, value: ld(1, key.encode()) + ld(2, value), parameter_keys, parameter_values)
tensors = st.builds(
    lambda name, params, number: ld(1, name) + b"".join(ld(number, p) for p in params),
    st.sampled_from([b"INPUT0", b"OUTPUT0"]),
    st.lists(map_entries, max_size=2),
    st.just(4),
)
outputs = st.builds(lambda name, params: ld(1, name) + b"".join(ld(2, p) for p in params), st.just(b"OUTPUT0"),
                    st.lists(map_entries, max_size=2))  # fmt: skip
unknown = st.builds(
    lambda number, kind, payload: (
        tag(number, 0) + varint(len(payload)) if kind == 0 else
        tag(number, 5) + payload.ljust(4, b"\0")[:4] if kind == 5 else
        tag(number, 1) + payload.ljust(8, b"\0")[:8] if kind == 1 else ld(number, payload)
    ),
    st.integers(8, 5000), st.sampled_from([0, 1, 2, 5]), st.binary(max_size=16),
)  # fmt: skip
fields = st.one_of(
    names.map(lambda name: ld(1, name)),  # model_name / name: may come more than once, anywhere
    st.integers(0, 2**40).map(lambda n: tag(1, 0) + varint(n)),  # field 1 of the wrong wire type
    st.just(ld(2, b"1")),
    map_entries.map(lambda entry: ld(4, entry)),
    tensors.map(lambda tensor: ld(5, tensor)),
    outputs.map(lambda out: ld(6, out)),
    st.binary(max_size=64).map(lambda raw: ld(7, raw)),
    unknown,
)
damage = st.one_of(st.just(lambda m: m), st.integers(1, 8).map(lambda n: lambda m: m[:-n]),
                   st.binary(min_size=1, max_size=6).map(lambda junk: lambda m: m + junk))  # fmt: skip
messages = st.builds(
    lambda parts, spoil: spoil(b"".join(parts)),
    st.lists(fields, max_size=8),
    st.one_of(st.just(lambda m: m), st.just(lambda m: m), damage),
)
benign = st.one_of(st.just(ld(2, b"1")), st.binary(max_size=32).map(lambda raw: ld(7, raw)), unknown)
lawful = st.builds(lambda before, after: b"".join(before) + ld(1, OWN.encode()) + b"".join(after),
                   st.lists(benign, max_size=2), st.lists(benign, max_size=2))  # fmt: skip
RPCS = [
    "ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelInfer", "ModelStreamInfer",
    "ModelConfig", "ModelStatistics", "RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload",
    "SystemSharedMemoryStatus", "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister",
    "CudaSharedMemoryStatus", "CudaSharedMemoryRegister", "CudaSharedMemoryUnregister", "TraceSetting",
    "LogSettings",
]  # fmt: skip
methods = st.one_of(
    st.sampled_from(RPCS).map(lambda rpc: f"/{GRPC_SERVICE}/{rpc}"),
    st.sampled_from(list(OWN_REQUESTS)),  # the own-model RPCs, where the message decides
    st.sampled_from(RPCS).map(lambda rpc: f"/{GRPC_SERVICE}/{rpc.lower()}"),
    st.sampled_from(RPCS).map(lambda rpc: f"/inference.GRPCInferenceService/{rpc}/"),
    st.sampled_from(RPCS).map(lambda rpc: f"/inference.grpcinferenceservice/{rpc}"),
    st.sampled_from(RPCS).map(lambda rpc: f"//{GRPC_SERVICE}/{rpc}"),
    st.just(f"/{HEALTH_SERVICE}/Check"),
    st.just(f"/{HEALTH_SERVICE}/Watch"),
    st.from_regex(r"/[ -~]{0,40}", fullmatch=True),
)


# ---------------------------------------------------------------------------------------------- properties


metadata = st.lists(
    st.tuples(
        st.sampled_from([RESTRICTED_KEY, "x-request-id", "authorization"]),
        st.from_regex(r"[a-z0-9]{1,8}", fullmatch=True),
    ),
    max_size=2,
)


@EXAMPLES
@given(method=methods, message=messages, gzip=st.booleans(), extra=metadata)
def test_no_unlawful_unary_call_reaches_triton(
    hostile: Hostile, channel: grpc.Channel, method: str, message: bytes, gzip: bool, extra: list[tuple[str, str]]
) -> None:
    since = len(hostile.grpc.seen)
    event(call(channel, method, message, gzip=gzip, metadata=extra))
    assert_nothing_unlawful_reached_triton(hostile, since)


@EXAMPLES
@given(stream=st.lists(st.one_of(lawful, lawful, messages), min_size=1, max_size=6), gzip=st.booleans())
def test_every_message_of_a_stream_is_judged(
    hostile: Hostile, channel: grpc.Channel, stream: list[bytes], gzip: bool
) -> None:
    since = len(hostile.grpc.seen)
    compression = grpc.Compression.Gzip if gzip else grpc.Compression.NoCompression
    responses = channel.stream_stream(f"/{GRPC_SERVICE}/ModelStreamInfer")(iter(stream), timeout=10,
                                                                              compression=compression)  # fmt: skip
    try:
        event(f"{sum(1 for _ in responses)} of {len(stream)} answered")
    except grpc.RpcError as exc:
        event(str(exc.code().name))
    assert_nothing_unlawful_reached_triton(hostile, since)


def raw_frames(frames: list[tuple[int, int, int, bytes]]) -> bytes:
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + struct.pack(">I", 0)[1:] + b"\x04\x00\x00\x00\x00\x00"
    body = b"".join(struct.pack(">I", len(p))[1:] + bytes([kind, flags]) + struct.pack(">I", sid) + p
                    for kind, flags, sid, p in frames)  # fmt: skip
    return preface + body


@settings(EXAMPLES, max_examples=100)
@given(
    frames=st.lists(
        st.tuples(
            st.integers(0, 12), st.integers(0, 255), st.sampled_from([0, 1, 3, 2**31 - 1]), st.binary(max_size=40)
        ),
        max_size=6,
    )
)
def test_arbitrary_http2_frames_reach_nothing_and_the_proxy_keeps_serving(
    hostile: Hostile, channel: grpc.Channel, frames: list[tuple[int, int, int, bytes]]
) -> None:
    since = len(hostile.grpc.seen)
    with socket.create_connection(("127.0.0.1", hostile.proxy.grpc_port), timeout=0.25) as sock:
        try:
            sock.sendall(raw_frames(frames))
            while sock.recv(65536):
                pass
        except OSError:
            pass  # a timeout (the proxy waits for more) or a reset (it gave up on us): both are fine
    assert_nothing_unlawful_reached_triton(hostile, since)


# ---------------------------------------------------------------------------------------------- malformed messages

MALFORMED = {
    "truncated varint": ld(1, OWN.encode()) + b"\x80",
    "length past the end": tag(1, 2) + varint(100) + OWN.encode(),
    "start group": ld(1, OWN.encode()) + tag(9, 3),
    "end group": ld(1, OWN.encode()) + tag(9, 4),
    "wire type 6": ld(1, OWN.encode()) + tag(9, 6),
    "field number 0": tag(0, 2) + varint(1) + b"x" + ld(1, OWN.encode()),
    "10-byte varint overflow": ld(1, OWN.encode()) + tag(9, 0) + b"\xff" * 10 + b"\x01",
}


@pytest.mark.parametrize("message", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_message_is_refused_and_reaches_nothing(
    hostile: Hostile, channel: grpc.Channel, message: bytes
) -> None:
    since = len(hostile.grpc.seen)
    assert call(channel, f"/{GRPC_SERVICE}/ModelInfer", message) == "INVALID_ARGUMENT"
    assert hostile.grpc.seen[since:] == []
    still_serves(hostile, channel)


def test_a_shared_memory_parameter_too_large_to_check_is_refused(hostile: Hostile, channel: grpc.Channel) -> None:
    value = ld(3, b"shared_memory_" + bytes(2 * MIB))  # a parameter value the proxy would have to hold to judge
    message = ld(1, OWN.encode()) + ld(4, ld(1, b"priority") + ld(2, value))
    since = len(hostile.grpc.seen)
    assert call(channel, f"/{GRPC_SERVICE}/ModelInfer", message) == "RESOURCE_EXHAUSTED"
    assert hostile.grpc.seen[since:] == []
    still_serves(hostile, channel)


def test_a_compressed_bomb_naming_another_model_at_its_end_is_refused_in_bounded_memory(
    hostile: Hostile, channel: grpc.Channel
) -> None:
    # 48 MiB inflating ~50x: within the inflate bound (100x), so the proxy walks it all to the last name, which wins
    noise = random.Random(0)
    filler = b"".join(noise.randbytes(1024) + bytes(49 * 1024) for _ in range(48 * MIB // (50 * 1024)))
    message = ld(1, OWN.encode()) + ld(7, filler) + ld(1, OTHER.encode())
    before = hostile.proxy.rss_kib("VmHWM") / 1024
    since = len(hostile.grpc.seen)
    assert call(channel, f"/{GRPC_SERVICE}/ModelInfer", message, gzip=True) == "NOT_FOUND"
    assert hostile.grpc.seen[since:] == []
    grown = hostile.proxy.rss_kib("VmHWM") / 1024 - before
    print(f"\ngRPC gzip bomb (48 MiB inflated, ~50x): NOT_FOUND; proxy VmHWM {before:.1f} MiB, +{grown:.1f}")
    assert grown < 16, f"the proxy's peak memory grew by {grown:.0f} MiB on a 48 MiB (inflated) message"
    still_serves(hostile, channel)


# ---------------------------------------------------------------------------------------------- HPACK


def hpack_integer(value: int, prefix_bits: int, flags: int) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([flags | value])
    out, value = bytearray([flags | limit]), value - limit
    while value >= 128:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out + bytes([value]))


def hpack_literal(name: bytes, value: bytes, *, indexed: bool = False) -> bytes:
    """A literal header field, "with incremental indexing" (it enters the decoder's table) or "without"."""
    head = hpack_integer(0, 6, 0x40) if indexed else hpack_integer(0, 4, 0x00)
    return head + hpack_integer(len(name), 7, 0) + name + hpack_integer(len(value), 7, 0) + value


def frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream_id) + payload


def test_a_client_cannot_grow_the_proxys_header_table_past_the_negotiated_size(
    hostile: Hostile, tmp_path: Path
) -> None:
    """A "dynamic table size update" sets how much the proxy's HPACK decoder keeps for the connection. Without a
    ceiling (RFC 7541 §6.3 bounds it by the decoder's SETTINGS_HEADER_TABLE_SIZE), each HEADERS block of a
    refused stream — never forwarded, so Triton never objects — could add a ~15 KiB entry for good: 4000 blocks
    grew the proxy by ~60 MiB, linearly, before proxy/hpack_codec.py refused sizes above 64 KiB."""
    http_port, grpc_port = free_port(), free_port()
    with open(tmp_path / "proxy.log", "wb") as log:
        proxy = subprocess.Popen(hostile.proxy_command(http_port, grpc_port, tmp_path), stdout=log, stderr=log)
    fields = b"".join(hpack_literal(n, v) for n, v in (
        (b":method", b"POST"), (b":scheme", b"http"), (b":authority", b"x"), (b"content-type", b"application/grpc"),
        (b":path", f"/{GRPC_SERVICE}/RepositoryIndex".encode()),  # denied: answered by the proxy itself
    ))  # fmt: skip
    try:
        wait_port(grpc_port)
        before = vm_kib(proxy.pid, "VmRSS") / 1024
        with socket.create_connection(("127.0.0.1", grpc_port), timeout=10) as sock:
            threading.Thread(target=_drain, args=(sock,), daemon=True).start()
            sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0, b""))
            for i in range(4000):
                block = (
                    hpack_integer(1 << 30, 5, 0x20) + fields + hpack_literal(b"x-%d" % i, bytes(15000), indexed=True)
                )
                try:
                    sock.sendall(frame(1, 0x5, 2 * i + 1, block))  # HEADERS, END_STREAM | END_HEADERS
                except OSError:
                    break  # the proxy ended the connection: what the fix does
            time.sleep(1.0)
            grown = vm_kib(proxy.pid, "VmRSS") / 1024 - before
    finally:
        proxy.kill()
        proxy.wait()
    assert grown < 16, f"4000 header blocks on refused streams grew the proxy by {grown:.0f} MiB"


def _drain(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while sock.recv(65536):
            pass
