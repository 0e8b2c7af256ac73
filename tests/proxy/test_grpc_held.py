"""The held-bytes budget (``--max-held-bytes``, proxy/held.py) on the gRPC relay: the parameter fields of infer
messages (``inputs`` can carry tensor data in its contents) that the relay keeps across reads to check them are
reserved in it, a stream that does not fit is refused RESOURCE_EXHAUSTED and reset at Triton, and whatever way a
stream ends, what it reserved comes back. Frame by frame, without sockets (as ``test_grpc_relay``), then against
the real Triton."""

from __future__ import annotations

import asyncio
import gzip
import time
from collections.abc import Callable

import hpack
import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb

from tests.proxy.conftest import ServedModels
from tests.proxy.test_grpc import INFER, refusals
from tests.proxy.test_grpc_relay import Client, Recorder, data, header_fields
from tests.proxy.test_held import _held_bytes, _wait_until
from tests.proxy.wire import RawClient, client_streams
from tests.support.proxy import ProxyProcess
from tritonshare.proxy import http2
from tritonshare.proxy.grpc import GrpcFrontend
from tritonshare.proxy.grpc_connection import ClientConnection
from tritonshare.proxy.grpc_messages import MessageInspector, MessageJudge
from tritonshare.proxy.grpc_upstream import UpstreamConnection
from tritonshare.proxy.held import REASON, HeldBudget
from tritonshare.proxy.policy import GRPC_RULES, GRPC_SERVICE
from tritonshare.proxy.settings import ProxySettings
from tritonshare.proxy.state import ProxyState

MIB = 1 << 20
FRAME = 16_384  # a gRPC client's DATA frames


def infer_message(model: str, size: int, *, compress: bool = False) -> bytes:
    """A framed ModelInferRequest whose one input carries ``size`` bytes of FP32 data in its contents (field 5)."""
    request = pb.ModelInferRequest(model_name=model)
    tensor = request.inputs.add(name="INPUT0", datatype="FP32", shape=[size // 4])
    tensor.contents.fp32_contents.extend(_values(size))
    body = request.SerializeToString()
    if compress:
        body = gzip.compress(body)
    return bytes([compress]) + len(body).to_bytes(4, "big") + body


def data_frames(stream_id: int, payload: bytes, *, end: bool = True) -> list[bytes]:
    """``payload`` in DATA frames of :data:`FRAME` bytes, END_STREAM on the last one when ``end``."""
    pieces = [payload[i : i + FRAME] for i in range(0, len(payload), FRAME)]
    return [data(stream_id, piece, end=end and i == len(pieces) - 1) for i, piece in enumerate(pieces)]


class Connection:
    """One relayed client connection on a shared :class:`ProxyState`; the test plays the client and Triton."""

    def __init__(self, state: ProxyState, frontend: GrpcFrontend) -> None:
        self.to_triton, self.to_client = Recorder(), Recorder()
        self.client = Client()
        self.triton = hpack.Encoder()
        self.upstream: UpstreamConnection | None = None
        self.relay = ClientConnection(frontend, state)
        self.relay.connection_made(self.to_client)  # type: ignore[arg-type]

    def open(self, factory: Callable[[], UpstreamConnection]) -> UpstreamConnection:
        self.upstream = factory()
        self.upstream.connection_made(self.to_triton)  # type: ignore[arg-type]
        return self.upstream

    def send(self, *frames_: bytes) -> None:
        """Each frame in a read of its own: what a field spans is kept across reads."""
        for frame in frames_:
            if not self.to_client.closed:
                self.relay.data_received(frame)

    def triton_ends(self, stream_id: int) -> None:
        """Triton answers the stream before its request ended (as it does an invalid one)."""
        assert self.upstream is not None
        fields = [(":status", "200"), ("content-type", "application/grpc"), ("grpc-status", "3")]
        block = self.triton.encode(fields)
        self.upstream.data_received(http2.frame(http2.HEADERS, http2.END_HEADERS | http2.END_STREAM, stream_id, block))

    def statuses(self) -> dict[int, dict[str, str]]:
        return header_fields(bytes(self.to_client.out))

    def reset_at_triton(self, stream_id: int) -> int | None:
        return client_streams(bytes(self.to_triton.out))[stream_id].reset_code


class Proxy:
    """A proxy state and its gRPC front end, with no Triton behind: connections are made by :meth:`connect`."""

    def __init__(self, **settings: object) -> None:
        options = {"max_json_bytes": 8 * MIB, "max_held_bytes": 8 * MIB, **settings}
        self.state = ProxyState(ProxySettings(name="own", triton_grpc="127.0.0.1:1", **options))  # type: ignore[arg-type]
        self._connecting: Connection | None = None
        self.frontend = GrpcFrontend(self.state, open_upstream=self._open)

    async def _open(self, factory: Callable[[], UpstreamConnection]) -> UpstreamConnection:
        assert self._connecting is not None
        return self._connecting.open(factory)

    async def connect(self) -> Connection:
        conn = self._connecting = Connection(self.state, self.frontend)
        conn.relay.data_received(http2.PREFACE + http2.settings())
        for _ in range(10):  # the upstream "connects"
            await asyncio.sleep(0)
        assert conn.upstream is not None
        conn.upstream.data_received(http2.settings())
        return conn

    @property
    def held(self) -> int:
        return self.state.held_budget.held

    def refusals(self) -> float:
        labels = {"model": "own", "protocol": "grpc", "route": "ModelInfer", "reason": REASON}
        return self.state.metrics.registry.get_sample_value("tritonshare_proxy_refusals_total", labels) or 0.0


def test_a_field_kept_across_reads_is_reserved_and_given_back_when_its_message_ends() -> None:
    async def run() -> None:
        proxy = Proxy()
        conn = await proxy.connect()
        message = infer_message("own", MIB)
        pieces = data_frames(1, message)
        conn.send(conn.client.headers(1, "ModelInfer"), *pieces[:-1])
        assert MIB // 2 < proxy.held < 2 * MIB  # about the field so far (each read held whole, header included)
        conn.send(pieces[-1])
        assert proxy.held == 0
        assert bytes(client_streams(bytes(conn.to_triton.out))[1].data) == message  # forwarded whole, unchanged
        assert 1 not in conn.statuses()

    asyncio.run(run())


def test_a_stream_whose_field_does_not_fit_is_refused_and_reset_at_triton() -> None:
    async def run() -> None:
        proxy = Proxy(max_held_bytes=3 * MIB)
        conn = await proxy.connect()
        for stream_id in (1, 3):  # 2 MiB each: the second one does not fit
            pieces = data_frames(stream_id, infer_message("own", 2 * MIB))
            conn.send(conn.client.headers(stream_id, "ModelInfer"), *pieces[:-1])
        status = conn.statuses()[3]
        assert status["grpc-status"] == "8"  # RESOURCE_EXHAUSTED
        message = status["grpc-message"]
        assert "--max-held-bytes 3145728" in message and "raw_input_contents" in message, message
        assert conn.reset_at_triton(3) == http2.CANCEL
        assert proxy.refusals() == 1
        assert 2 * MIB <= proxy.held < 3 * MIB  # the first stream's field: the refused one gave back what it had
        conn.send(data_frames(1, infer_message("own", 2 * MIB))[-1])
        assert proxy.held == 0 and 1 not in conn.statuses()

    asyncio.run(run())


def test_every_reservation_comes_back_however_the_streams_end() -> None:
    """Many connections, many streams each holding part of a big ``inputs`` field (plain or gzip), some refused
    for the budget, then ended every way a stream ends: the budget comes back to zero."""

    async def run() -> None:
        proxy = Proxy(max_held_bytes=12 * MIB)
        plain, packed = infer_message("own", MIB), infer_message("own", MIB, compress=True)
        conns = [await proxy.connect() for _ in range(6)]
        rest: dict[tuple[int, int], list[bytes]] = {}  # (connection, stream): its frames not sent yet
        for n, conn in enumerate(conns):
            for i in range(8):
                stream_id = 2 * i + 1
                zipped = (n + i) % 4 == 0
                pieces = data_frames(stream_id, packed if zipped else plain)
                head = conn.client.headers(stream_id, "ModelInfer", *[("grpc-encoding", "gzip")] * zipped)
                cut = len(pieces) * (i + 2) // 12 + 1  # from a few frames to most of the message
                conn.send(head, *pieces[:cut])
                rest[n, stream_id] = pieces[cut:]
        refused = proxy.refusals()
        assert proxy.held > 11 * MIB and refused >= 10, (proxy.held, refused)  # full: the last streams refused
        assert {status["grpc-status"] for conn in conns for status in conn.statuses().values()} == {"8"}
        first, second, third, fourth, fifth, sixth = conns
        for stream_id in (1, 3, 5, 7):
            first.send(http2.rst_stream(stream_id, http2.CANCEL))  # the client cancels
        for stream_id in (9, 11, 13, 15):
            first.triton_ends(stream_id)  # Triton answers before the message ended
        second.relay.connection_lost(None)  # the client goes
        third.relay.upstream_lost(ConnectionResetError("Triton went away"))  # Triton goes
        fourth.relay.begin_drain()  # SIGTERM: the streams go on, then the drain ends the connection
        fourth.relay.connection_lost(None)
        for stream_id in range(1, 17, 2):  # the rest of each message: judged, forwarded (or dropped: refused)
            fifth.send(*rest[4, stream_id])
        assert proxy.held == 0  # the sixth connection's streams were all refused: full
        for stream_id in (17, 19, 21):  # the budget came back: new streams hold again
            sixth.send(sixth.client.headers(stream_id, "ModelInfer"), *data_frames(stream_id, plain)[:40])
        assert proxy.held > 1.5 * MIB and proxy.refusals() == refused
        sixth.relay.connection_lost(None)
        assert proxy.held == 0

    asyncio.run(run())


def test_a_field_naming_shared_memory_stays_reserved_until_its_message_is_judged() -> None:
    """An input whose bytes name the shared-memory marker is kept whole for a full parse until its message ends
    (the verdict needs it): its reservation stays while later fields arrive, and goes with the verdict."""
    budget = HeldBudget(0)
    judge = MessageJudge(GRPC_RULES[f"/{GRPC_SERVICE}/ModelInfer"], b"own", limit=MIB, budget=budget)
    request = pb.ModelInferRequest(model_name="own")
    tensor = request.inputs.add(name="INPUT0", datatype="FP32", shape=[65536])
    tensor.parameters["note"].string_param = "shared_memory_is_not_used"  # the marker, in a value: allowed
    tensor.contents.fp32_contents.extend([0.5] * 65536)
    request.raw_input_contents.append(bytes(200_000))  # after it: skipped, never kept
    message = infer_message_framed(request)
    inspector = MessageInspector(judge, encoding=None)
    pieces = [bytes(message[i : i + FRAME]) for i in range(0, len(message), FRAME)]  # a read (a buffer) each
    for n, piece in enumerate(pieces[:-1]):
        assert inspector.feed(piece, 0, len(piece)) is None
        if n * FRAME > 300_000:  # past the input, inside the raw contents: the joined input is still reserved
            assert 256 * 1024 <= budget.held < 300_000
    assert inspector.feed(pieces[-1], 0, len(pieces[-1])) is None and inspector.messages == 1
    assert budget.held == 0


def infer_message_framed(request: pb.ModelInferRequest) -> bytes:
    body = request.SerializeToString()
    return b"\x00" + len(body).to_bytes(4, "big") + body


# ---------------------------------------------------------------------------------------------- real Triton


class FlowClient:
    """A raw HTTP/2 client (:class:`~tests.proxy.wire.RawClient`) that sends DATA in :data:`FRAME`-byte frames
    within the windows the server gives, one frame per write, and reads what comes back meanwhile."""

    def __init__(self, port: int) -> None:
        self.raw = RawClient(port, timeout_s=30)
        self.decoder = hpack.Decoder()
        self.connection_window = self.initial_window = 65_535
        self.windows: dict[int, int] = {}
        self.statuses: dict[int, dict[str, str]] = {}  # trailers (or trailers-only answers), by stream
        self.replies: dict[int, bytearray] = {}

    def open(self, stream_id: int, path: str) -> None:
        self.windows[stream_id] = self.initial_window
        self.raw.sock.sendall(self.raw.request(stream_id, path))

    def send(self, stream_id: int, payload: bytes, *, end: bool) -> None:
        """Send ``payload`` on the stream unless it ends meanwhile (refused)."""
        for i in range(0, len(payload), FRAME):
            piece = payload[i : i + FRAME]
            while min(self.connection_window, self.windows[stream_id]) < len(piece):
                if stream_id in self.statuses:
                    return
                self.read(lambda got: bool(got), timeout_s=30)
            if stream_id in self.statuses:
                return
            last = end and i + FRAME >= len(payload)
            self.raw.sock.sendall(data(stream_id, piece, end=last))
            self.connection_window -= len(piece)
            self.windows[stream_id] -= len(piece)

    def wait_for(self, stream_id: int, timeout_s: float = 60) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        while stream_id not in self.statuses:
            assert time.monotonic() < deadline, f"stream {stream_id} did not end"
            self.read(lambda got: bool(got), timeout_s=1)
        return self.statuses[stream_id]

    def read(self, until: Callable[[list[tuple[int, int, int, bytes]]], bool], timeout_s: float) -> None:
        for kind, flags, stream_id, payload in self.raw.frames(until, timeout_s):
            assert kind != -1, "the proxy closed the connection"
            if kind == http2.SETTINGS and not flags & http2.ACK:
                pairs = http2.settings_pairs(payload)
                if 0x4 in pairs:  # SETTINGS_INITIAL_WINDOW_SIZE
                    for sid in self.windows:
                        self.windows[sid] += pairs[0x4] - self.initial_window
                    self.initial_window = pairs[0x4]
                self.raw.sock.sendall(http2.SETTINGS_ACK)
            elif kind == http2.WINDOW_UPDATE:
                if stream_id:
                    self.windows[stream_id] = self.windows.get(stream_id, 0) + http2.window_increment(payload)
                else:
                    self.connection_window += http2.window_increment(payload)
            elif kind == http2.DATA:
                self.replies.setdefault(stream_id, bytearray()).extend(payload)
                if payload:  # read: Triton may send on
                    self.raw.sock.sendall(
                        http2.window_update(0, len(payload)) + http2.window_update(stream_id, len(payload))
                    )
            elif kind == http2.HEADERS:
                fields = {str(k): str(v) for k, v in self.decoder.decode(payload)}
                if flags & http2.END_STREAM:
                    self.statuses[stream_id] = fields
            elif kind == http2.RST_STREAM:
                self.statuses[stream_id] = {"reset": str(int.from_bytes(payload, "big"))}

    def close(self) -> None:
        self.raw.close()


def _values(size: int) -> np.ndarray:
    return np.random.default_rng(size).random(size // 4, dtype=np.float32)


@pytest.mark.triton
def test_concurrent_streams_past_the_budget_are_refused_while_the_others_pass(
    start_proxy: Callable[..., ProxyProcess], served_models: ServedModels
) -> None:
    """An 8 MiB budget; five streams on one connection each send all but the last frame of a 3 MiB ``inputs``
    field (so it is held across reads): two fit, the others get RESOURCE_EXHAUSTED and are reset at Triton; the
    two then complete and Triton answers them; the budget comes back to zero, and a new stream passes."""
    own = served_models.own
    proxy = start_proxy(own, "--no-unload", "--max-json-bytes", str(4 * MIB), "--max-held-bytes", str(8 * MIB))
    messages = {sid: infer_message(own, 3 * MIB + sid * 4) for sid in (1, 3, 5, 7, 9, 11)}
    client = FlowClient(proxy.grpc_port)
    try:
        client.read(lambda got: any(kind == http2.SETTINGS for kind, *_ in got), timeout_s=10)
        for sid in (1, 3, 5, 7, 9):
            client.open(sid, INFER)
            client.send(sid, messages[sid][:-FRAME], end=False)
        refused = {sid: client.wait_for(sid) for sid in (5, 7, 9)}
        for status in refused.values():
            assert status["grpc-status"] == "8", status
            assert "--max-held-bytes 8388608" in status["grpc-message"], status
        assert 2 * (3 * MIB - FRAME) <= _held_bytes(proxy) <= 8 * MIB  # the two fields held, less their last frame
        assert refusals(proxy, "ModelInfer", REASON) == 3
        for sid in (1, 3):
            client.send(sid, messages[sid][-FRAME:], end=True)
            assert client.wait_for(sid)["grpc-status"] == "0"
            assert _output(client.replies[sid]) == _values(3 * MIB + sid * 4).tobytes()
        _wait_until(lambda: _held_bytes(proxy) == 0)
        client.open(11, INFER)  # the budget came back
        client.send(11, messages[11], end=True)
        assert client.wait_for(11)["grpc-status"] == "0"
    finally:
        client.close()
    _wait_until(lambda: _held_bytes(proxy) == 0)


@pytest.mark.triton
def test_the_proxy_memory_stays_bounded_under_concurrent_large_inputs(
    start_proxy: Callable[..., ProxyProcess], served_models: ServedModels
) -> None:
    """8 streams each send all but the last frame of a 6 MiB ``inputs`` field to a proxy with an 8 MiB budget: one
    is held, the others refused as they reach the budget, and the proxy's peak RSS grows by far less than the
    48 MiB they would hold without it."""
    own = served_models.own
    proxy = start_proxy(own, "--no-unload", "--max-json-bytes", str(8 * MIB), "--max-held-bytes", str(8 * MIB))
    message = infer_message(own, 6 * MIB)
    client = FlowClient(proxy.grpc_port)
    try:
        client.read(lambda got: any(kind == http2.SETTINGS for kind, *_ in got), timeout_s=10)
        before = proxy.rss_kib("VmRSS")
        for sid in range(1, 17, 2):
            client.open(sid, INFER)
            client.send(sid, message[:-FRAME], end=False)
        time.sleep(0.5)
        grown_mib = (proxy.rss_kib("VmHWM") - before) / 1024
        held = _held_bytes(proxy)
        refused = sum(client.statuses.get(sid, {}).get("grpc-status") == "8" for sid in range(1, 17, 2))
    finally:
        client.close()
    print(f"\n8 × 6 MiB inputs at once, budget 8 MiB: held {held / MIB:.1f} MiB, VmHWM +{grown_mib:.1f} MiB")
    assert held <= 8 * MIB and refused == 7
    assert grown_mib < 24, f"the proxy's peak RSS grew by {grown_mib:.1f} MiB for 8 MiB held"
    _wait_until(lambda: _held_bytes(proxy) == 0)


def _output(reply: bytes) -> bytes:
    response = pb.ModelInferResponse.FromString(bytes(reply[5:]))
    return response.raw_output_contents[0]
