"""gRPC streaming load for the proxy yardstick: Triton's bidi ``ModelStreamInfer`` against one target.

h2load drives unary calls only, so this drives the streaming half of issue 4's gRPC bar. At concurrency C it
opens C bidi streams, each on its own connection (as ``h2load -c C -m 1`` does), and on each stream sends one
request, waits for its response, sends the next: closed loop, one message in flight per stream (``--depth N``
keeps N in flight per stream instead: pipelined). The request is the yardstick's gRPC body
(``make_grpc_body.py``): a ModelInferRequest of FP32[16] to the model; each response is parsed and must be the
model's answer. After ``--seconds`` no request starts; those in flight are awaited and counted, then each
stream is half-closed and must end with grpc-status 0.

Two clients: ``h2`` (default), a lean HTTP/2 client on uvloop that sends pre-built frames and reads only what
gRPC needs, so that it costs the machine less than what it measures (≈ 40-65 µs of CPU per request on the
project's 2-core box, against 180-240 for grpcio, whose client alone nearly filled a core at 5,000 rps);
``grpcio``, grpc.aio, a real gRPC stack (to check the relay against one).

One line per concurrency: rps, latency (mean, p50, p99 in ms), requests answered and failed (an error in the
response, or a stream that broke: reset, ended early or with a non-zero grpc-status), the CPU µs per request of
``--pids`` (utime+stime from /proc/PID/stat, as the yardstick's cpu-of.sh), and the load generator's own CPU
in cores (``client_cores``: near 1.0 means the client, not the target, set the pace).

usage: .venv/bin/python bench/stream_bench.py HOST:PORT [--model identity] [--seconds 5] [--concurrency 1 16]
           [--depth 1] [--client h2|grpcio] [--label ours] [--pids PID ...]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import struct
import sys
import time
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import grpc  # type: ignore[import-untyped]
import hpack
import numpy as np
import uvloop
from tritonclient.grpc import service_pb2

METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"
ELEMENTS = 16  # as the yardstick's gRPC body (proxy-bench.sh: make_grpc_body.py MODEL 16)
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
RETRY_PAUSE_S = 0.01  # before reopening a stream that broke


def request_bytes(model: str, elements: int = ELEMENTS) -> bytes:
    """The yardstick's ModelInferRequest, serialised once: every message of every stream sends these bytes."""
    request = service_pb2.ModelInferRequest(model_name=model)
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[elements])
    request.raw_input_contents.append(np.arange(elements, dtype=np.float32).tobytes())
    return bytes(request.SerializeToString())


def response_error(raw: bytes, model: str) -> str | None:
    """What is wrong with one ModelStreamInferResponse, or None if it is the model's answer."""
    response = service_pb2.ModelStreamInferResponse.FromString(raw)
    if response.error_message:
        return str(response.error_message)
    if response.infer_response.model_name != model:
        return f"answer from model {response.infer_response.model_name!r}, not {model!r}"
    return None


def cpu_ticks(pids: Sequence[int]) -> int:
    """utime+stime of these processes (all their threads), in clock ticks."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()  # the command name may hold spaces
        total += int(fields[11]) + int(fields[12])  # fields 14 and 15 of stat(5), counted after the name
    return total


class StreamBroken(Exception):
    """A stream failed: reset, refused, ended early or with an error status."""


@dataclass
class Tally:
    """What the streams of one run saw."""

    latencies: list[float] = field(default_factory=list)  # seconds, one per request answered by the model
    failures: int = 0  # requests answered with an error, and streams that broke
    first_error: str | None = None

    def fail(self, error: str) -> None:
        self.failures += 1
        if self.first_error is None:
            self.first_error = error


@dataclass(frozen=True)
class Load:
    host: str
    port: int
    model: str
    body: bytes  # one serialised ModelInferRequest
    depth: int  # requests in flight per stream
    metadata: tuple[tuple[str, str], ...] = ()  # more request headers, e.g. ("authorization", "Bearer …")

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"


# ---------------------------------------------------------------------------------------- the lean client

_FRAME = struct.Struct(">BHBBL")  # length (24 bits as 8 + 16), type, flags, stream id
_DATA, _HEADERS, _RST_STREAM, _SETTINGS, _PING, _GOAWAY, _WINDOW_UPDATE, _CONTINUATION = 0, 1, 3, 4, 6, 7, 8, 9
_END_STREAM, _ACK, _END_HEADERS, _PADDED, _PRIORITY = 0x1, 0x1, 0x4, 0x8, 0x20
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_INITIAL_WINDOW = 65535
_RECEIVE_WINDOW = 1 << 30  # the client's windows: Triton is never held back by them
_SETTING_ENABLE_PUSH, _SETTING_INITIAL_WINDOW = 0x2, 0x4


def _frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return _FRAME.pack(len(payload) >> 16, len(payload) & 0xFFFF, kind, flags, stream_id) + payload


def _client_preface() -> bytes:
    settings = struct.pack(">HLHL", _SETTING_ENABLE_PUSH, 0, _SETTING_INITIAL_WINDOW, _RECEIVE_WINDOW)
    grow = struct.pack(">L", _RECEIVE_WINDOW - _INITIAL_WINDOW)
    return _PREFACE + _frame(_SETTINGS, 0, 0, settings) + _frame(_WINDOW_UPDATE, 0, 0, grow)


def _content(flags: int, payload: bytes, priority: bool) -> bytes:
    """A DATA or HEADERS payload without its padding (and priority fields)."""
    start, end = 0, len(payload)
    if flags & _PADDED:
        start, end = 1, end - payload[0]
    if priority and flags & _PRIORITY:
        start += 5
    return payload[start:end]


class H2Stream(asyncio.Protocol):
    """One HTTP/2 connection carrying one bidi gRPC stream at a time; reads only what gRPC needs."""

    def __init__(self, load: Load) -> None:
        self._load = load
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._encoder, self._decoder = hpack.Encoder(), hpack.Decoder()
        self._stream_id = -1
        self._send_window = self._stream_window = self._initial_window = _INITIAL_WINDOW
        self._window_opened: asyncio.Event = asyncio.Event()
        self._block = bytearray()  # a header block arriving in several frames
        self._block_ends_stream = False
        self._message = bytearray()  # response bytes not yet a whole gRPC message
        self._responses: deque[bytes] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._ended: str | None = None  # why the stream ended ("" for grpc-status 0); None while open
        self.gone = False  # the connection is lost or going away: no new stream on it
        self._unacked = 0  # DATA bytes received and not yet credited back to Triton

    # ------------------------------------------------------------------------------------- use

    def open_stream(self) -> bytes:
        """Open the next stream; returns the DATA frame of one request on it."""
        assert self._transport is not None
        if self._transport.is_closing():  # (before connection_lost says so)
            self.gone = True
            raise StreamBroken("connection lost (closed by the server)")
        self._stream_id += 2
        self._stream_window = self._initial_window
        self._message.clear()
        self._responses.clear()
        self._ended = None
        headers = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", METHOD),
            (":authority", self._load.target),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            *self._load.metadata,
        ]
        self._transport.write(_frame(_HEADERS, _END_HEADERS, self._stream_id, self._encoder.encode(headers)))
        body = self._load.body
        return _frame(_DATA, 0, self._stream_id, b"\0" + len(body).to_bytes(4, "big") + body)

    async def send(self, frame: bytes) -> None:
        """Write one DATA frame once the send windows allow it."""
        size = len(frame) - _FRAME.size
        while self._send_window < size or self._stream_window < size:
            self._check_open()
            self._window_opened.clear()
            await self._window_opened.wait()
        self._check_open()
        self._send_window -= size
        self._stream_window -= size
        assert self._transport is not None
        self._transport.write(frame)

    async def receive(self) -> bytes:
        """The next response message of the stream."""
        while not self._responses:
            self._check_open()
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self._responses.popleft()

    async def finish(self) -> None:
        """Half-close the stream and wait for its trailers: grpc-status must be 0."""
        assert self._transport is not None
        if self._ended is None:
            self._transport.write(_frame(_DATA, _END_STREAM, self._stream_id))
        while self._ended is None:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        if self._ended:
            raise StreamBroken(self._ended)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def _check_open(self) -> None:
        if self._ended is not None:
            raise StreamBroken(self._ended or "the stream ended (grpc-status 0) with requests unanswered")

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _end(self, why: str) -> None:
        if self._ended is None:
            self._ended = why
        self._window_opened.set()
        self._wake()

    # ------------------------------------------------------------------------------------- asyncio

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it
        self._transport.write(_client_preface())

    def connection_lost(self, exc: Exception | None) -> None:
        self.gone = True
        self._end(f"connection lost ({exc or 'closed by the server'})")

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        pos, end = 0, len(buffer)
        while end - pos >= _FRAME.size:
            high, low, kind, flags, stream_id = _FRAME.unpack_from(buffer, pos)
            stop = pos + _FRAME.size + (high << 16 | low)
            if stop > end:
                break
            self._on_frame(kind, flags, stream_id & 0x7FFFFFFF, bytes(buffer[pos + _FRAME.size : stop]))
            pos = stop
        del buffer[:pos]

    # ------------------------------------------------------------------------------------- frames

    def _on_frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        handler = self._handlers.get(kind)
        if handler is not None:
            handler(self, flags, stream_id, payload)

    def _on_data(self, flags: int, stream_id: int, payload: bytes) -> None:
        self._credit(len(payload), stream_id)
        if stream_id != self._stream_id:
            return
        message = self._message
        message += _content(flags, payload, priority=False)
        while len(message) >= 5:
            size = int.from_bytes(message[1:5], "big")
            if len(message) < 5 + size:
                break
            self._responses.append(bytes(message[5 : 5 + size]))
            del message[: 5 + size]
        if flags & _END_STREAM:
            self._end("the stream ended without trailers")
        self._wake()

    def _on_headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        self._block = bytearray(_content(flags, payload, priority=True))
        self._block_ends_stream = bool(flags & _END_STREAM)
        if flags & _END_HEADERS:
            self._on_header_block(stream_id)

    def _on_continuation(self, flags: int, stream_id: int, payload: bytes) -> None:
        self._block += payload
        if flags & _END_HEADERS:
            self._on_header_block(stream_id)

    def _on_header_block(self, stream_id: int) -> None:
        block = self._decoder.decode(bytes(self._block), raw=True)  # every block: keeps the table in step
        if stream_id != self._stream_id or not self._block_ends_stream:
            return
        headers = {bytes(name): bytes(value).decode("latin-1") for name, value in block}
        status = headers.get(b"grpc-status", "(none)")
        self._end("" if status == "0" else f"grpc-status {status}: {headers.get(b'grpc-message', '')}")

    def _on_rst_stream(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == self._stream_id:
            self._end(f"the server reset the stream (error code {int.from_bytes(payload[:4], 'big')})")

    def _on_settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if flags & _ACK:
            return
        for offset in range(0, len(payload) - 5, 6):
            key, value = struct.unpack_from(">HL", payload, offset)
            if key == _SETTING_INITIAL_WINDOW:
                self._stream_window += value - self._initial_window
                self._initial_window = value
        self._write(_frame(_SETTINGS, _ACK, 0))
        self._window_opened.set()

    def _on_ping(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not flags & _ACK:
            self._write(_frame(_PING, _ACK, 0, payload))

    def _on_goaway(self, flags: int, stream_id: int, payload: bytes) -> None:
        last = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
        code = int.from_bytes(payload[4:8], "big")
        self.gone = True
        if last < self._stream_id or code:
            self._end(f"the server went away (GOAWAY, error code {code}, last stream {last})")

    def _on_window_update(self, flags: int, stream_id: int, payload: bytes) -> None:
        increment = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
        if stream_id == 0:
            self._send_window += increment
        elif stream_id == self._stream_id:
            self._stream_window += increment
        self._window_opened.set()

    _handlers: dict[int, Callable[[H2Stream, int, int, bytes], None]] = {
        _DATA: _on_data,
        _HEADERS: _on_headers,
        _CONTINUATION: _on_continuation,
        _RST_STREAM: _on_rst_stream,
        _SETTINGS: _on_settings,
        _PING: _on_ping,
        _GOAWAY: _on_goaway,
        _WINDOW_UPDATE: _on_window_update,
    }

    def _credit(self, size: int, stream_id: int) -> None:
        """Give Triton back its window once half of it is used (by then this stream has long ended)."""
        self._unacked += size
        if self._unacked >= _RECEIVE_WINDOW // 2:
            increment = struct.pack(">L", self._unacked)
            self._write(_frame(_WINDOW_UPDATE, 0, 0, increment) + _frame(_WINDOW_UPDATE, 0, stream_id, increment))
            self._unacked = 0

    def _write(self, frames: bytes) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(frames)


async def drive_h2(load: Load, deadline: float, tally: Tally) -> None:
    """One connection, streams on it one after another (a broken stream counts as a failure and is reopened)."""
    loop = asyncio.get_running_loop()
    try:
        _, connection = await loop.create_connection(lambda: H2Stream(load), load.host, load.port)
    except OSError as exc:
        tally.fail(f"cannot connect to {load.target}: {exc}")
        return
    try:
        while time.perf_counter() < deadline:
            try:
                await run_h2_stream(connection, load, deadline, tally)
            except StreamBroken as exc:
                tally.fail(str(exc))
                if connection.gone:
                    return
                await asyncio.sleep(RETRY_PAUSE_S)
    finally:
        connection.close()


async def run_h2_stream(connection: H2Stream, load: Load, deadline: float, tally: Tally) -> None:
    """Keep ``depth`` requests in flight on a new stream until the deadline, then wait for those in flight."""
    frame = connection.open_stream()
    sent: deque[float] = deque()  # send times of the requests in flight, oldest first (answers come in order)
    while True:
        while len(sent) < load.depth and time.perf_counter() < deadline:
            sent.append(time.perf_counter())
            await connection.send(frame)
        if not sent:
            await connection.finish()
            return
        raw = await connection.receive()
        tally_answer(tally, load, raw, sent.popleft())


def tally_answer(tally: Tally, load: Load, raw: bytes, started: float) -> None:
    error = response_error(raw, load.model)
    if error is None:
        tally.latencies.append(time.perf_counter() - started)
    else:
        tally.fail(error)


# ---------------------------------------------------------------------------------------- grpcio's client


async def drive_grpcio(load: Load, deadline: float, tally: Tally) -> None:
    """One channel (its own connection: no shared subchannel), streams on it one after another."""
    options = [("grpc.use_local_subchannel_pool", 1)]
    async with grpc.aio.insecure_channel(load.target, options=options) as channel:
        call_stream = channel.stream_stream(METHOD)  # bytes in, bytes out: no serialisation in the hot loop
        while time.perf_counter() < deadline:
            call = call_stream()
            try:
                await run_grpcio_stream(call, load, deadline, tally)
            except grpc.aio.AioRpcError as exc:
                tally.fail(f"stream failed: {exc.code().name} {exc.details()}")
                await asyncio.sleep(RETRY_PAUSE_S)
            except StreamBroken as exc:
                tally.fail(str(exc))
                await asyncio.sleep(RETRY_PAUSE_S)
            finally:
                call.cancel()


async def run_grpcio_stream(call: Any, load: Load, deadline: float, tally: Tally) -> None:
    sent: deque[float] = deque()
    while True:
        while len(sent) < load.depth and time.perf_counter() < deadline:
            sent.append(time.perf_counter())
            await call.write(load.body)
        if not sent:
            await call.done_writing()
            if await call.read() is not grpc.aio.EOF or await call.code() != grpc.StatusCode.OK:
                raise StreamBroken(f"the stream did not end cleanly: {await call.code()} {await call.details()}")
            return
        raw = await call.read()
        if raw is grpc.aio.EOF:
            raise StreamBroken(f"the server ended the stream with {len(sent)} request(s) unanswered")
        tally_answer(tally, load, raw, sent.popleft())


CLIENTS: dict[str, Callable[[Load, float, Tally], Coroutine[Any, Any, None]]] = {
    "h2": drive_h2,
    "grpcio": drive_grpcio,
}
EVENT_LOOPS: dict[str, Callable[[Coroutine[Any, Any, int]], int]] = {
    "h2": uvloop.run,
    "grpcio": asyncio.run,  # grpc.aio runs on asyncio's own loop
}


# ---------------------------------------------------------------------------------------- runs


@dataclass(frozen=True)
class Result:
    concurrency: int
    wall_s: float
    tally: Tally
    target_ticks: int | None  # CPU of --pids over the run
    client_s: float  # this process's CPU over the run

    def line(self, label: str) -> str:
        lat = sorted(self.tally.latencies)
        done = len(lat)

        def ms(q: float) -> float:
            return lat[min(done - 1, int(q * done))] * 1e3 if done else 0.0

        parts = [
            f"{label} stream c={self.concurrency} rps={done / self.wall_s:.1f}",
            f"mean={statistics.fmean(lat) * 1e3 if done else 0.0:.2f}ms p50={ms(0.5):.2f}ms p99={ms(0.99):.2f}ms",
            f"{done}ok/{self.tally.failures}failed",
        ]
        if self.target_ticks is not None and done:
            parts.append(f"cpu_us_per_req={self.target_ticks * 1e6 / CLOCK_TICKS / done:.1f}")
        parts.append(f"client_cores={self.client_s / self.wall_s:.2f}")
        return " ".join(parts)


async def run(client: str, load: Load, concurrency: int, seconds: float, pids: Sequence[int]) -> Result:
    tally = Tally()
    ticks, cpu, start = cpu_ticks(pids), time.process_time(), time.perf_counter()
    deadline = start + seconds
    await asyncio.gather(*(CLIENTS[client](load, deadline, tally) for _ in range(concurrency)))
    wall = time.perf_counter() - start
    target = cpu_ticks(pids) - ticks if pids else None
    return Result(concurrency, wall, tally, target, time.process_time() - cpu)


async def main_async(args: argparse.Namespace) -> int:
    host, _, port = args.target.rpartition(":")
    load = Load(host, int(port), args.model, request_bytes(args.model, args.elements), args.depth)
    await run(args.client, load, 1, min(args.seconds, 0.5), [])  # warm up: Triton's model instances, caches
    failed = False
    for concurrency in args.concurrency:
        result = await run(args.client, load, concurrency, args.seconds, args.pids)
        print(result.line(args.label), flush=True)
        if result.tally.first_error is not None:
            print(f"{args.label} stream c={concurrency}: first failure: {result.tally.first_error}", file=sys.stderr)
        failed = failed or bool(result.tally.failures) or not result.tally.latencies
    return 1 if failed else 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", help="HOST:PORT of a gRPC endpoint in front of Triton (or Triton itself)")
    parser.add_argument("--model", default="identity", help="an identity model: FP32 INPUT0 [-1] -> OUTPUT0")
    parser.add_argument("--seconds", type=float, default=5.0, help="load per concurrency level")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16], help="streams at once, per run")
    parser.add_argument("--depth", type=int, default=1, help="requests in flight per stream (1: closed loop)")
    parser.add_argument("--elements", type=int, default=ELEMENTS, help="FP32 elements per request")
    parser.add_argument("--client", choices=sorted(CLIENTS), default="h2", help="lean HTTP/2, or grpc.aio")
    parser.add_argument("--label", default="target", help="first word of each line (direct, nginx, ours)")
    parser.add_argument("--pids", type=int, nargs="*", default=[], help="processes whose CPU per request to report")
    args = parser.parse_args(argv)
    if ":" not in args.target or not args.target.rpartition(":")[2].isdigit():
        parser.error(f"target {args.target!r} is not HOST:PORT")
    if args.depth < 1 or args.seconds <= 0 or min(args.concurrency) < 1:
        parser.error("--depth and --concurrency must be at least 1, --seconds positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return EVENT_LOOPS[args.client](main_async(args))


if __name__ == "__main__":
    sys.exit(main())
