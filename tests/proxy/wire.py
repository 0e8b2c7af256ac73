"""What travels between the gRPC proxy and Triton: a real TCP pipe that can record it, and a reader of
the recorded HTTP/2 bytes that decodes header blocks with the ``hpack`` package's own decoder (so a
header block the proxy forwards or re-encodes must also be valid HPACK in sequence for a third party).
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field

import hpack

from tritonshare.proxy import http2


class TcpPipe:
    """A plain TCP forwarder from a local port to a target (Triton). Records what the proxy sends when
    ``record`` is set; :meth:`cut` closes every open connection (Triton "dies" mid-call)."""

    def __init__(self, port: int, target: tuple[str, int], *, record: bool = False) -> None:
        self.target = target
        self.record = record
        self.sent: list[bytearray] = []  # per connection: bytes from the proxy to the target
        self.open = 0  # connections to the target not yet closed both ways
        self.listener = socket.create_server(("127.0.0.1", port))
        self.threads: list[threading.Thread] = []
        self.sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._start(self._accept)

    def _start(self, target: Callable[..., None], *args: object) -> threading.Thread:
        thread = threading.Thread(target=target, args=args, daemon=True)
        with self._lock:
            self.threads.append(thread)
        thread.start()
        return thread

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self._start(self._serve, conn)

    def _serve(self, conn: socket.socket) -> None:
        with conn, socket.create_connection(self.target) as upstream:
            record = bytearray()
            with self._lock:
                self.sockets += [conn, upstream]
                self.sent.append(record)
                self.open += 1
            pumps = [
                self._start(_pump, conn, upstream, record if self.record else None),
                self._start(_pump, upstream, conn, None),
            ]
            for pump in pumps:
                pump.join()
            with self._lock:
                self.open -= 1

    def cut(self) -> None:
        with self._lock:
            for sock in self.sockets:
                with suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() (Linux)
        self.listener.close()
        self.cut()
        with self._lock:
            threads = list(self.threads)
        for thread in threads:
            thread.join(timeout=10)


def _pump(src: socket.socket, dst: socket.socket, record: bytearray | None) -> None:
    try:
        while data := src.recv(65536):
            if record is not None:
                record += data
            dst.sendall(data)
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        for sock in (src, dst):
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


@dataclass
class Stream:
    headers: dict[str, str] = field(default_factory=dict)
    data: bytearray = field(default_factory=bytearray)
    end_stream: bool = False
    reset_code: int | None = None


def client_streams(recorded: bytes) -> dict[int, Stream]:
    """The streams a client side opened on one recorded HTTP/2 connection (preface first; a connection
    closed before sending anything, like a port probe's, has none)."""
    if not recorded:
        return {}
    assert recorded.startswith(http2.PREFACE), f"not an HTTP/2 client connection: {recorded[:40]!r}"
    decoder, streams = hpack.Decoder(), {}
    decoder.max_allowed_table_size = 1 << 16
    pos, block, block_stream = len(http2.PREFACE), b"", 0
    while pos + http2.HEADER_SIZE <= len(recorded):
        length, kind, flags, stream_id = http2.parse_header(recorded, pos)
        payload = recorded[pos + http2.HEADER_SIZE : pos + http2.HEADER_SIZE + length]
        pos += http2.HEADER_SIZE + length
        stream = streams.setdefault(stream_id, Stream()) if stream_id else None
        if kind == http2.HEADERS:
            block, block_stream = bytes(http2.header_block_fragment(flags, payload)), stream_id
            stream.end_stream |= bool(flags & http2.END_STREAM)  # type: ignore[union-attr]
        elif kind == http2.CONTINUATION:
            block += payload
        elif kind == http2.DATA and stream is not None:
            stream.data += payload
            stream.end_stream |= bool(flags & http2.END_STREAM)
        elif kind == http2.RST_STREAM and stream is not None:
            stream.reset_code = struct.unpack(">L", payload)[0]
        if kind in (http2.HEADERS, http2.CONTINUATION) and flags & http2.END_HEADERS:
            fields = decoder.decode(block)
            streams[block_stream].headers.update({str(k): str(v) for k, v in fields})
    return streams


class RawClient:
    """An HTTP/2 client that writes frames as it is told, on a real socket: what a hostile or broken client sends.
    Header blocks are encoded by the ``hpack`` package (with incremental indexing, as gRPC clients do)."""

    def __init__(self, port: int, *, timeout_s: float = 10.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
        self.encoder = hpack.Encoder()
        self._buffer = b""
        self.sock.sendall(http2.PREFACE + http2.settings())

    def request(
        self, stream_id: int, path: str, *, end_stream: bool = False, extra: tuple[tuple[str, str], ...] = ()
    ) -> bytes:
        """A gRPC request's HEADERS frame (``extra``: more header fields, e.g. ``grpc-encoding``)."""
        fields = [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "proxy"),
                  ("content-type", "application/grpc"), ("te", "trailers"), *extra]  # fmt: skip
        flags = http2.END_HEADERS | (http2.END_STREAM if end_stream else 0)
        return http2.frame(http2.HEADERS, flags, stream_id, self.encoder.encode(fields))

    def frames(
        self, until: Callable[[list[tuple[int, int, int, bytes]]], bool], timeout_s: float = 10.0
    ) -> list[tuple[int, int, int, bytes]]:
        """Frames read (type, flags, stream, payload) until ``until`` holds of them, the peer closes (then the
        last one is ``(-1, 0, 0, b"")``) or ``timeout_s`` passes."""
        got: list[tuple[int, int, int, bytes]] = []
        self.sock.settimeout(timeout_s)
        while not until(got):
            while len(self._buffer) >= http2.HEADER_SIZE:
                length, kind, flags, stream_id = http2.parse_header(self._buffer, 0)
                if len(self._buffer) < http2.HEADER_SIZE + length:
                    break
                got.append((kind, flags, stream_id, self._buffer[http2.HEADER_SIZE : http2.HEADER_SIZE + length]))
                self._buffer = self._buffer[http2.HEADER_SIZE + length :]
            if until(got):
                break
            try:
                chunk = self.sock.recv(1 << 16)
            except TimeoutError:
                break
            except ConnectionError:  # reset: bytes it sent were left unread
                chunk = b""
            if not chunk:
                got.append((-1, 0, 0, b""))
                break
            self._buffer += chunk
        return got

    def close(self) -> None:
        self.sock.close()


def goaway_code(frames: list[tuple[int, int, int, bytes]]) -> int | None:
    """The error code of the last GOAWAY among ``frames``, if any."""
    codes = [int.from_bytes(p[4:8], "big") for kind, _, _, p in frames if kind == http2.GOAWAY]
    return codes[-1] if codes else None


def closed(frames: list[tuple[int, int, int, bytes]]) -> bool:
    return bool(frames) and frames[-1][0] == -1
