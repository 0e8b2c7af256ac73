"""Stand-ins for Triton's metrics port that misbehave in ways a real one can: slow, or serving a huge page."""

from __future__ import annotations

import socket
import threading
import time

from tests.support.sockets import accept_each


class MetricsPort:
    """Answers every GET with ``200`` and ``body``, sent ``chunk`` bytes at a time with ``gap_s`` between chunks
        (a page that comes a byte every half second, each byte within a reader's per-read timeout, is a slow Triton
        metrics endpoint; it gives up after ``limit_s``). With ``cut_after`` it closes the connection after that many
    bytes of the body, its Content-Length still the whole body's (a Triton that dies mid-answer). Counts the
    connections it accepted."""

    def __init__(
        self,
        body: bytes,
        *,
        chunk: int = 1 << 16,
        gap_s: float = 0.0,
        limit_s: float = 60.0,
        cut_after: int | None = None,
    ) -> None:
        self.body, self.chunk, self.gap_s, self.limit_s = body, chunk, gap_s, limit_s
        self.cut_after = len(body) if cut_after is None else cut_after
        self.accepted = 0
        self._closed = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        accept_each(self.listener, self._serve, name="metrics-port")

    @classmethod
    def dripping(cls) -> MetricsPort:
        return cls(b"#" * 100_000, chunk=1, gap_s=0.5)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    def _serve(self, conn: socket.socket) -> None:
        self.accepted += 1
        with conn:
            try:
                conn.recv(65536)
                head = f"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {len(self.body)}\r\n\r\n"
                conn.sendall(head.encode())
                deadline = time.monotonic() + self.limit_s
                sent = self.body[: self.cut_after]
                for start in range(0, len(sent), self.chunk):
                    if time.monotonic() > deadline or self._closed.wait(self.gap_s):
                        return
                    conn.sendall(sent[start : start + self.chunk])
            except OSError:
                return

    def close(self) -> None:
        self._closed.set()
        self.listener.close()
