"""A tiny asyncio HTTP server for ``GET /metrics`` on the metrics port (no framework).

The page is the proxy's own metrics followed by Triton's series for the own model only
(:mod:`tritonshare.proxy.triton_metrics`, read off the event loop: it blocks up to its timeout).
Scrapes are rare, so each connection answers one request and closes.
"""

from __future__ import annotations

import asyncio
import logging

from tritonshare.common.errors import cannot_listen
from tritonshare.proxy.metrics import ProxyMetrics
from tritonshare.proxy.triton_metrics import TritonModelMetrics

logger = logging.getLogger(__name__)

_CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
_MAX_HEAD = 16 * 1024


class MetricsServer:
    def __init__(
        self, metrics: ProxyMetrics, host: str, port: int, *, triton_metrics: TritonModelMetrics | None = None
    ) -> None:
        self._metrics = metrics
        self._triton = triton_metrics
        self._host = host
        self._port = port
        self._server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        if self._server is None or not self._server.sockets:
            return 0
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        if self._port == 0:  # metrics turned off
            return
        try:
            self._server = await asyncio.start_server(self._handle, self._host, self._port)
        except OSError as exc:
            raise cannot_listen("metrics", self._host, self._port, "--metrics-port", exc) from exc

    def close(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            writer.write(await self._answer(head[:_MAX_HEAD]))
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, OSError):
            pass
        finally:
            writer.close()

    async def _answer(self, head: bytes) -> bytes:
        method, _, rest = head.partition(b" ")
        target = rest.split(b" ", 1)[0].split(b"?", 1)[0]
        if method not in (b"GET", b"HEAD") or target not in (b"/metrics", b"/metrics/"):
            return _response(b"404 Not Found", b"text/plain", b"not found: try /metrics\n")
        body = self._metrics.exposition()
        if self._triton is not None:
            body += await asyncio.to_thread(self._triton.exposition)
        return _response(b"200 OK", _CONTENT_TYPE, b"" if method == b"HEAD" else body, len(body))


def _response(status: bytes, content_type: bytes, body: bytes, length: int | None = None) -> bytes:
    size = len(body) if length is None else length
    return (
        b"HTTP/1.1 "
        + status
        + b"\r\nContent-Type: "
        + content_type
        + b"\r\nContent-Length: "
        + str(size).encode()
        + b"\r\nConnection: close\r\n\r\n"
        + body
    )
