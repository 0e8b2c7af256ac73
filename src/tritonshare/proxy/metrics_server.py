"""A tiny asyncio HTTP server for the metrics port (no framework): ``GET /metrics``, and the kubelet's probes.

The page is the proxy's own metrics followed by Triton's series for the own model only
(:mod:`tritonshare.proxy.triton_metrics`, read off the event loop: it blocks up to its timeout).

``GET /v2/health/ready`` and ``GET /v2/health/live`` answer as they do on the REST port (the own model's
readiness, not ready while draining; Triton's liveness; both from the answers the proxy keeps,
:mod:`tritonshare.proxy.readiness`). The manifests point the readinessProbe here: the REST port holds at most
``--max-connections`` client connections, and anyone who can reach it could fill them with silent connections,
making the kubelet's probe one more connection turned away (503) and the pod leave its Service. This port
serves no tenant and is not held by them: each connection gets one answer and is closed, and one that has not
sent its request head within :data:`HEAD_TIMEOUT_S` is closed without one. It holds at most
:data:`MAX_CONNECTIONS` at once, a cap of its own: a flood of silent connections then costs that many file
descriptors, not the process's whole open-files limit (past which every port's accepts fail). A connection
past the cap makes room by closing the oldest one that has not sent its request head — a flood's, since the
kubelet and a scraper send theirs at once — so a probe is answered in the middle of a flood rather than
turned away with it (a cap that closed the newcomer would let 64 silent connections make the pod unready).
Each connection closed so is counted as a refusal (``protocol="metrics"``), the first of each episode logged.
"""

from __future__ import annotations

import asyncio
import logging

from tritonshare.common.errors import cannot_listen
from tritonshare.proxy.policy import Verdict
from tritonshare.proxy.readiness import UNREACHABLE
from tritonshare.proxy.state import ProxyState, listening_port
from tritonshare.proxy.triton_metrics import TritonModelMetrics

logger = logging.getLogger(__name__)

HEAD_TIMEOUT_S = 10.0  # a connection's request head must be in within this
# Connections held at once: a scraper and the kubelet's probes use a few, each for milliseconds.
MAX_CONNECTIONS = 64
_CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
_MAX_HEAD = 16 * 1024
_PROBES = {b"/v2/health/ready": Verdict.READY, b"/v2/health/live": Verdict.LIVE}
_STATUS = {200: b"200 OK", 400: b"400 Bad Request", UNREACHABLE: b"503 Service Unavailable"}


class MetricsServer:
    def __init__(
        self, state: ProxyState, host: str, port: int, *, triton_metrics: TritonModelMetrics | None = None
    ) -> None:
        self._state = state
        self._metrics = state.metrics
        self._triton = triton_metrics
        self._host = host
        self._port = port
        self._server: asyncio.Server | None = None
        # open connections, oldest first: whether each has sent its request head
        self._connections: dict[asyncio.StreamWriter, bool] = {}
        self._full = False  # a connection was closed to make room since the port last had some: logged once
        self._metrics.count_connections("metrics", lambda: len(self._connections))

    @property
    def port(self) -> int:
        return listening_port(self._server)

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
        if len(self._connections) < MAX_CONNECTIONS:
            self._full = False
        elif self._make_room(writer) is writer:
            return
        self._connections[writer] = False
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_S)
            if writer in self._connections:
                self._connections[writer] = True
            writer.write(await self._answer(head[:_MAX_HEAD]))
            await asyncio.wait_for(writer.drain(), HEAD_TIMEOUT_S)  # a client that never reads holds no slot
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, OSError):
            pass
        finally:
            self._connections.pop(writer, None)
            writer.close()

    def _make_room(self, newcomer: asyncio.StreamWriter) -> asyncio.StreamWriter:
        """Past :data:`MAX_CONNECTIONS`: close the oldest connection still silent (its descriptor freed at
        once), or the newcomer when every one held is being answered; returns the one closed."""
        silent = next((w for w, asked in self._connections.items() if not asked), None)
        closed = silent or newcomer
        self._connections.pop(closed, None)
        closed.transport.abort()
        self._metrics.refused("metrics", "connection", "too_many_connections")
        if not self._full:
            self._full = True
            logger.warning(
                "the metrics port %d holds %d connections, its cap: each new one closes the oldest that has not "
                "asked anything yet — who floods it?",
                self.port,
                MAX_CONNECTIONS,
            )
        return closed

    async def _answer(self, head: bytes) -> bytes:
        method, _, rest = head.partition(b" ")
        target = rest.split(b" ", 1)[0].split(b"?", 1)[0]
        probe = _PROBES.get(target)
        if method == b"GET" and probe is not None:
            return await self._probe(probe)
        if method not in (b"GET", b"HEAD") or target not in (b"/metrics", b"/metrics/"):
            return _response(b"404 Not Found", b"text/plain", b"not found: try /metrics\n")
        body = self._metrics.exposition()
        if self._triton is not None:
            body += await asyncio.to_thread(self._triton.exposition)
        return _response(b"200 OK", _CONTENT_TYPE, b"" if method == b"HEAD" else body, len(body))

    async def _probe(self, verdict: Verdict) -> bytes:
        """The answer the REST port gives this probe, without its connection cap (see the module docstring)."""
        state = self._state
        if verdict is Verdict.READY and state.draining:
            return _response(_STATUS[UNREACHABLE], b"text/plain", b"the proxy is shutting down\n")
        status = await state.probes[verdict].status()
        if status == 200:
            return _response(_STATUS[200], b"text/plain", b"")
        why = b"Triton does not answer\n" if status == UNREACHABLE else b"not %s\n" % verdict.value.encode()
        return _response(_STATUS.get(status, b"%d Error" % status), b"text/plain", why)


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
