"""The REST front end: a byte-level HTTP/1.1 forwarder on asyncio (uvloop) protocols, no framework.

Per request: the head is parsed strictly (:mod:`tritonshare.proxy.http1`), judged by the policy table
(:func:`tritonshare.proxy.policy.judge_rest`), and either answered here or forwarded as a head rebuilt from
the canonical path and the client's end-to-end headers, so Triton parses exactly what was judged. Infer bodies
are held only until their JSON part is checked (:mod:`tritonshare.proxy.inspect`); the rest of a body, and the
whole response, pass through as bytes, as they arrive (server-sent events of ``generate_stream`` included).

Connections: each client connection gets its own connection to Triton (1:1, opened at its first forwarded
request) and one request at a time: bytes of a next (pipelined) request wait until the response is complete.
Connections to Triton left idle when their client goes are kept in a small pool, so one-request clients (curl,
probes) do not pay a connect each. Back-pressure both ways: reading from one side pauses while the other
side's write buffer is full, so a large tensor streams through in bounded memory.

Cost per request is what a sidecar per model pod is judged by (issue 4: nginx-class CPU), so the common case
is short: parsed and judged heads are memoised by their exact bytes (clients repeat the same head; parsing and
judging are pure functions of it; the drain state is checked per request, outside the memo), a body that came
with its head goes to Triton in the same write, and a response that came whole goes back untouched.
"""

from __future__ import annotations

import asyncio
import logging
import urllib.parse
from dataclasses import dataclass
from typing import cast

from tritonshare.common.errors import UsageError
from tritonshare.proxy.http1 import (
    CONTINUE,
    HttpError,
    RequestHead,
    ResponseHead,
    ResponseReader,
    error_response,
    parse_request_head,
    upstream_head,
)
from tritonshare.proxy.inspect import BodyRefused, InferBodyCheck, RequestBody, check_plain_body
from tritonshare.proxy.policy import REST_SERVER_ROUTES, RestDecision, judge_rest
from tritonshare.proxy.state import ProxyState

logger = logging.getLogger(__name__)

PROTOCOL = "rest"
IDLE_UPSTREAMS = 8  # idle connections to Triton kept for the next client
LINGER_S = 2.0  # after the proxy closes a connection, how long it still reads (and drops) what the client sends
_HEAD_MEMO = 512  # judged heads kept
_MEMO_HEAD_BYTES = 4096  # longer heads are not memoised
_WHOLE_BODY_BYTES = 64 * 1024  # a body that came with its head is sent with it in one write, up to this

# Why client reading is paused (bits): no connection to Triton yet, Triton's write buffer full, a pipelined
# request waiting for the current response.
_CONNECTING, _UPSTREAM_FULL, _BACKLOG = 1, 2, 4

_REFUSAL_REASONS = {400: "bad_request", 403: "denied", 404: "not_found", 405: "method"}
_UNAVAILABLE = "the inference server is unavailable; retry later"
READY_ROUTE = REST_SERVER_ROUTES["/v2/health/ready"].route  # not ready from the moment draining begins


@dataclass(frozen=True, slots=True)
class Judged:
    """A request head, parsed and judged once."""

    head: RequestHead
    decision: RestDecision
    upstream: bytes  # the head for Triton (forwarded requests only)
    inspect: bool  # the body is an infer request to check
    json_length: int | None  # JSON bytes at the start of the decoded body; None: all; 0: none (raw binary)
    whole: bool  # forwarded with a plain Content-Length body: if it came with the head, one write


def judge_head(raw: bytes, own: str, strip: frozenset[bytes], host: bytes) -> Judged:
    """Parse a request head (raises :class:`HttpError`), judge it, and build what forwarding it needs."""
    head = parse_request_head(raw, strip)
    decision = judge_rest(head.method, head.target, own)
    if decision.status:
        return Judged(head, decision, b"", False, None, False)
    inspect = decision.rule is not None and decision.rule.inspect and head.has_body
    # Only infer has the binary-tensor extension: generate parses the whole body, whatever the header says.
    json_length = head.inference_header_length if decision.route == "infer" else None
    whole = head.content_length is not None and not (inspect and head.content_encoding)
    return Judged(head, decision, upstream_head(head, decision.upstream_path, host), inspect, json_length, whole)


class RestFrontend:
    """Listens on ``settings.http_port``; one :class:`ClientConnection` per client connection."""

    protocol = PROTOCOL

    def __init__(self, state: ProxyState) -> None:
        self.state = state
        settings = state.settings
        url = urllib.parse.urlsplit(settings.triton_url)
        self.host_header = url.netloc.encode()
        self.strip = frozenset(name.lower().encode() for name in settings.strip_headers)
        self.max_header_bytes = settings.max_header_bytes
        self.max_json_bytes = settings.max_json_bytes
        self.pool = UpstreamPool(url.hostname or "127.0.0.1", url.port or 80, settings.connect_timeout_s, state)
        self.connections: set[ClientConnection] = set()
        self.response_heads: dict[bytes, ResponseHead] = {}
        self._heads: dict[bytes, Judged] = {}
        self._server: asyncio.Server | None = None
        self._port = 0

    @property
    def port(self) -> int:
        if not self._port:
            raise RuntimeError("the REST front end is not listening; call start() first")
        return self._port

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        settings = self.state.settings
        try:
            self._server = await loop.create_server(
                lambda: ClientConnection(self), settings.host, settings.http_port, backlog=1024, reuse_address=True
            )
        except OSError as exc:
            raise UsageError(
                f"REST: cannot listen on {settings.host}:{settings.http_port}: {exc.strerror or exc} — "
                "choose another --http-port or --host"
            ) from exc
        self._port = int(self._server.sockets[0].getsockname()[1])

    def stop_accepting(self) -> None:
        if self._server is not None:
            self._server.close()

    def begin_drain(self) -> None:
        for connection in list(self.connections):
            connection.drain()

    def abort(self) -> None:
        for connection in list(self.connections):
            connection.abort()
        self.pool.close()

    def judge(self, raw: bytes) -> Judged:
        """Parse and judge a request head (raises :class:`HttpError`); memoised by the head's bytes."""
        judged = self._heads.get(raw)
        if judged is None:
            judged = judge_head(raw, self.state.own, self.strip, self.host_header)
            if len(raw) <= _MEMO_HEAD_BYTES:
                if len(self._heads) >= _HEAD_MEMO:
                    self._heads.clear()
                self._heads[raw] = judged
        return judged


class Exchange:
    """One request on a client connection, from its head to the end of its response."""

    __slots__ = ("judged", "route", "body", "response", "started", "request_done", "response_done")

    def __init__(self, judged: Judged) -> None:
        self.judged = judged
        self.route = judged.decision.route
        self.body: RequestBody | None = None  # a body still to read
        self.response: ResponseReader | None = None  # set once forwarded (counted in flight from then on)
        self.started = 0.0
        self.request_done = False
        self.response_done = False


class ClientConnection(asyncio.Protocol):
    def __init__(self, frontend: RestFrontend) -> None:
        self.fe = frontend
        self.state = frontend.state
        self.transport: asyncio.Transport | None = None
        self.buf = b""  # client bytes not yet acted on
        self.exchange: Exchange | None = None
        self.upstream: Upstream | None = None
        self.connecting: asyncio.Task[None] | None = None
        self.queued: list[bytes | memoryview] = []  # for Triton, while connecting
        self.close_after = False  # close once the current exchange ends
        self.drain_grace = False  # the request in progress when draining began may still complete
        self.closing = False
        self.paused = 0
        self.linger: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------------------------------ client side

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it
        self.fe.connections.add(self)

    def data_received(self, data: bytes) -> None:
        if self.buf:
            data, self.buf = self.buf + data, b""
        if not self.closing:
            self._consume(data)

    def eof_received(self) -> bool:
        ex = self.exchange
        if ex is None or not ex.request_done or self.closing:
            return False
        self.close_after = True  # a client that half-closed after its request still gets the response
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.transport = None
        self.fe.connections.discard(self)
        if self.linger is not None:
            self.linger.cancel()
        if self.connecting is not None:
            self.connecting.cancel()
        ex, upstream = self.exchange, self.upstream
        self.exchange = self.upstream = None
        if ex is not None and ex.response is not None and not ex.response_done:
            self.state.end(PROTOCOL, ex.route, "499", ex.started)  # the client went away first
            if upstream is not None:
                upstream.close()
        elif upstream is not None:
            self.fe.pool.give(upstream)

    def pause_writing(self) -> None:
        if self.upstream is not None:
            self.upstream.pause_reading()

    def resume_writing(self) -> None:
        if self.upstream is not None:
            self.upstream.resume_reading()

    def drain(self) -> None:
        """Draining: an idle connection closes now; a busy one after its current response."""
        if self.exchange is None and not self.buf:
            self._shutdown()
        else:
            self.close_after = self.drain_grace = True

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def _consume(self, data: bytes) -> None:
        while data and not self.closing:
            ex = self.exchange
            if ex is None:
                data = self._read_head(data)
            elif not ex.request_done:
                data = self._read_body(ex, data)
            else:  # a pipelined request: it waits for the current response
                self.buf = data
                if len(data) > self.fe.max_header_bytes:
                    self._pause(_BACKLOG)
                return

    def _read_head(self, data: bytes) -> bytes:
        if data.startswith(b"\r\n"):  # empty lines before a request line are ignored (RFC 9112 §2.2)
            return data[2:]
        end = data.find(b"\r\n\r\n")
        if 0 <= end <= self.fe.max_header_bytes:
            try:
                judged = self.fe.judge(data[:end])
            except HttpError as exc:
                self._fail(exc)
                return b""
            return self._start(judged, data[end + 4 :])
        if end >= 0 or len(data) > self.fe.max_header_bytes:
            self._fail(HttpError(431, f"request head larger than {self.fe.max_header_bytes} bytes", "too_large"))
        else:
            self.buf = data
        return b""

    def _start(self, judged: Judged, rest: bytes) -> bytes:
        ex = self.exchange = Exchange(judged)
        if self.state.draining and (not self.drain_grace or judged.decision.route == READY_ROUTE):
            self._refuse(ex, 503, "the proxy is shutting down; retry on another replica", "draining", close=True)
        elif judged.decision.status:
            status = judged.decision.status
            self._refuse(ex, status, judged.decision.message, _REFUSAL_REASONS.get(status, "denied"))
        else:
            self.drain_grace = False
            if not judged.head.keep_alive:
                self.close_after = True
            if judged.whole and len(rest) >= (judged.head.content_length or 0):
                return self._forward_whole(ex, rest)
            return self._forward(ex, rest)
        return rest

    def _forward_whole(self, ex: Exchange, rest: bytes) -> bytes:
        """The common case: the whole plain body came with its head. Check it; head and body in one write."""
        judged = ex.judged
        size = judged.head.content_length or 0
        body = rest if len(rest) == size else rest[:size]
        if judged.inspect:
            try:
                check_plain_body(body, judged.json_length, self.fe.max_json_bytes)
            except BodyRefused as exc:
                self._refuse(ex, exc.status, exc.message, exc.reason, close=exc.status == 413)
                return rest  # the body is read and dropped
        ex.request_done = True
        if size <= _WHOLE_BODY_BYTES:
            self._begin(ex, judged.upstream + body if size else judged.upstream)
        else:
            self._begin(ex, judged.upstream)
            self._send(body)
        return rest[size:] if len(rest) > size else b""

    def _forward(self, ex: Exchange, rest: bytes) -> bytes:
        """A body still to come (or chunked, or encoded): hold it for the check if needed, else stream it."""
        judged, head = ex.judged, ex.judged.head
        if self.upstream is None:
            self._ensure_upstream()  # connect while the body arrives
        check = None
        if judged.inspect and judged.json_length != 0:
            try:
                check = InferBodyCheck(
                    encoding=head.content_encoding,
                    json_length=judged.json_length,
                    max_json_bytes=self.fe.max_json_bytes,
                )
            except BodyRefused as exc:
                self._refuse(ex, exc.status, exc.message, exc.reason, close=exc.status == 413)
                return rest
        ex.body = RequestBody(head.content_length or 0, head.chunked, check)
        if head.expect_continue:
            self._write(CONTINUE)
        if check is None:
            self._begin(ex, judged.upstream)
        if not head.has_body:
            self._request_done(ex)
        return rest

    def _read_body(self, ex: Exchange, data: bytes) -> bytes:
        body = ex.body
        assert body is not None
        was_ready = body.ready
        try:
            end = body.feed(data)
        except HttpError as exc:
            self._fail(exc)
            return b""
        refusal = body.refusal
        if refusal is not None and not ex.response_done:
            self._refuse(ex, refusal.status, refusal.message, refusal.reason, close=refusal.status == 413)
        elif body.ready and not was_ready:
            self._begin(ex, ex.judged.upstream)  # the check passed: the head, then what was held
        for piece in body.take():
            self._send(piece)
        if end < 0 or self.closing:
            return b""
        self._request_done(ex)
        return data[end:] if end < len(data) else b""

    def _request_done(self, ex: Exchange) -> None:
        ex.request_done = True
        if ex.response_done:
            self._finish()

    def _finish(self) -> None:
        """Both the request and its response are complete: on to the next request, if any."""
        self.exchange = None
        if self.close_after:
            self._shutdown()
            return
        if self.paused & _BACKLOG:
            self._unpause(_BACKLOG)
        if self.buf and not self.paused:
            data, self.buf = self.buf, b""
            self._consume(data)

    def _refuse(self, ex: Exchange, status: int, message: str, reason: str, *, close: bool = False) -> None:
        """Answer a request here; the rest of its body is read and dropped (or the connection closes)."""
        self.state.refuse(PROTOCOL, ex.route, str(status), reason)
        head = ex.judged.head
        logger.debug("refused %s %s with %d: %s", head.method, head.target, status, message)
        ex.response_done = True
        # After "Expect: 100-continue" the client may or may not send the body: only closing is unambiguous.
        close = close or self.close_after or not head.keep_alive or (head.expect_continue and head.has_body)
        self._write(error_response(status, message, close=close))
        if close:
            self._shutdown()
        elif ex.body is not None:
            ex.body.drop()
        elif head.has_body:
            ex.body = RequestBody(head.content_length or 0, head.chunked).drop()
        else:
            self._request_done(ex)

    def _fail(self, exc: HttpError) -> None:
        """A request that cannot be read further (malformed head or chunked body): answer and close."""
        ex = self.exchange
        logger.debug("malformed request: %s", exc.message)
        if ex is None or ex.response is None:
            self.state.refuse(PROTOCOL, ex.route if ex is not None else "malformed", str(exc.status), exc.reason)
        elif not ex.response_done:  # Triton got part of it: that connection goes (see _shutdown)
            ex.response_done = True
            self.state.end(PROTOCOL, ex.route, str(exc.status), ex.started)
            if ex.response.head is not None:  # Triton already answered: nothing more can be said
                self._shutdown()
                return
        self._write(error_response(exc.status, exc.message, close=True))
        self._shutdown()

    def _write(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)

    def _shutdown(self) -> None:
        """Close from the proxy's side: flush, send FIN, keep reading (and dropping) for a moment so the
        client sees the answer rather than a reset, then close."""
        if self.closing or self.transport is None:
            return
        self.closing = True
        self.buf = b""
        if self.transport.can_write_eof():
            self.transport.write_eof()
        if self.paused:
            self.paused = 0
            self.transport.resume_reading()
        self.linger = asyncio.get_running_loop().call_later(LINGER_S, self.transport.close)
        ex = self.exchange
        if ex is not None and ex.response is not None and not ex.request_done:
            self._drop_upstream()  # Triton holds part of a request that will never end

    def _pause(self, reason: int) -> None:
        if not self.paused and self.transport is not None and not self.closing:
            self.transport.pause_reading()
        self.paused |= reason

    def _unpause(self, reason: int) -> None:
        if not self.paused & reason:
            return
        self.paused &= ~reason
        if not self.paused and self.transport is not None and not self.closing:
            self.transport.resume_reading()

    # ------------------------------------------------------------------------------------ Triton side

    def _ensure_upstream(self) -> None:
        if self.connecting is not None:
            return
        upstream = self.fe.pool.take()
        if upstream is not None:
            upstream.owner = self
            self.upstream = upstream
            return
        self._pause(_CONNECTING)
        self.connecting = asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        try:
            upstream = await self.fe.pool.connect()
        except (OSError, asyncio.TimeoutError):
            self.connecting = None
            self._unavailable()
            return
        self.connecting = None
        if self.closing:
            self.fe.pool.give(upstream)
            return
        upstream.owner = self
        self.upstream = upstream
        queued, self.queued = self.queued, []
        for data in queued:
            upstream.write(data)
        self._unpause(_CONNECTING)

    def _unavailable(self) -> None:
        """Triton cannot be reached: 503 for the request waiting on it."""
        self.queued = []
        ex = self.exchange
        if ex is None or ex.response_done or self.closing:
            self._unpause(_CONNECTING)  # nothing waits on Triton now
            return
        if ex.response is not None:
            self.state.end(PROTOCOL, ex.route, "503", ex.started)
        else:
            self.state.refuse(PROTOCOL, ex.route, "503", "upstream")
        ex.response_done = True
        self._write(error_response(503, _UNAVAILABLE, close=True))
        self._shutdown()

    def _begin(self, ex: Exchange, data: bytes) -> None:
        """Forward: the request is in flight from here on."""
        ex.response = ResponseReader(self.fe.response_heads, no_body=ex.judged.head.method == "HEAD")
        ex.started = self.state.begin(PROTOCOL)
        upstream = self.upstream
        if upstream is not None:
            upstream.write(data)
        else:
            self._send(data)

    def _send(self, data: bytes | memoryview) -> None:
        if self.upstream is None:
            self._ensure_upstream()  # none yet, or Triton closed the idle one since
        if self.upstream is not None:
            self.upstream.write(data)
        else:
            self.queued.append(data)

    def upstream_data(self, upstream: Upstream, data: bytes) -> None:
        ex = self.exchange
        reader = ex.response if ex is not None else None
        if ex is None or reader is None or ex.response_done:
            upstream.close()  # Triton spoke out of turn: this connection cannot be trusted any more
            return
        reader.close = self.close_after
        try:
            out = reader.feed(data)
        except HttpError as exc:
            self._upstream_failed(ex, reader, exc.message)
            return
        if out and self.transport is not None:
            self.transport.write(out)
        if reader.done:
            self._response_done(ex, reader)

    def _response_done(self, ex: Exchange, reader: ResponseReader) -> None:
        ex.response_done = True
        head = reader.head
        assert head is not None
        self.state.end(PROTOCOL, ex.route, head.code, ex.started)
        if head.close or reader.extra or not ex.request_done:
            self._drop_upstream()
        if not ex.request_done:  # Triton answered before the body ended: the rest cannot follow
            self._shutdown()
        else:
            self._finish()

    def upstream_lost(self, upstream: Upstream, exc: Exception | None) -> None:
        if upstream is not self.upstream:
            return
        self.upstream = None
        ex = self.exchange
        reader = ex.response if ex is not None else None
        if ex is None or reader is None or ex.response_done:
            return  # an idle connection: the next request opens a new one
        if reader.eof():
            self._response_done(ex, reader)  # a response delimited by the close
        else:
            self._upstream_failed(ex, reader, f"connection to Triton lost: {exc or 'closed'}")

    def _upstream_failed(self, ex: Exchange, reader: ResponseReader, message: str) -> None:
        self.fe.pool.failed(message)
        ex.response_done = True
        self.state.end(PROTOCOL, ex.route, "502", ex.started)
        self._drop_upstream()
        if reader.head is None:
            self._write(error_response(502, "the inference server closed the connection; retry", close=True))
        self._shutdown()

    def _drop_upstream(self) -> None:
        upstream, self.upstream = self.upstream, None
        if upstream is not None:
            upstream.close()

    def upstream_pause(self) -> None:
        self._pause(_UPSTREAM_FULL)

    def upstream_resume(self) -> None:
        self._unpause(_UPSTREAM_FULL)


class Upstream(asyncio.Protocol):
    """One connection to Triton's HTTP port, owned by one client connection at a time (or idle in the pool)."""

    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool
        self.owner: ClientConnection | None = None
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reading_paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.owner is None:
            self.close()  # idle connections get no bytes
            return
        self.owner.upstream_data(self, data)

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        if self.owner is not None:
            self.owner.upstream_lost(self, exc)

    def pause_writing(self) -> None:
        if self.owner is not None:
            self.owner.upstream_pause()

    def resume_writing(self) -> None:
        if self.owner is not None:
            self.owner.upstream_resume()

    def write(self, data: bytes | memoryview) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    def pause_reading(self) -> None:
        if self.transport is not None and not self.closed and not self.reading_paused:
            self.reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self.closed and self.reading_paused:
            self.reading_paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        self.owner = None
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()
            self.pool.forget(self)


class UpstreamPool:
    """Opens connections to Triton and keeps a few idle ones for the next client connection."""

    def __init__(self, host: str, port: int, timeout_s: float, state: ProxyState) -> None:
        self.host = host
        self.port = port
        self.timeout_s = timeout_s
        self.state = state
        self.idle: list[Upstream] = []
        self.down = False  # the last attempt failed (logged once per outage)

    async def connect(self) -> Upstream:
        loop = asyncio.get_running_loop()
        try:
            _, upstream = await asyncio.wait_for(
                loop.create_connection(lambda: Upstream(self), self.host, self.port), self.timeout_s
            )
        except (OSError, asyncio.TimeoutError) as exc:
            self.failed(f"cannot connect to Triton at {self.host}:{self.port}: {exc or 'timed out'}")
            raise
        if self.down:
            self.down = False
            logger.info("Triton at %s:%d is reachable again", self.host, self.port)
        return upstream

    def failed(self, message: str) -> None:
        self.state.metrics.upstream_error(PROTOCOL)
        if not self.down:
            self.down = True
            logger.warning("%s; answering 503 until it is back", message)

    def take(self) -> Upstream | None:
        while self.idle:
            upstream = self.idle.pop()
            if not upstream.closed:
                return upstream
        return None

    def give(self, upstream: Upstream) -> None:
        upstream.owner = None
        if upstream.closed:
            return
        if len(self.idle) >= IDLE_UPSTREAMS:
            upstream.close()
            return
        upstream.resume_reading()
        self.idle.append(upstream)

    def forget(self, upstream: Upstream) -> None:
        if upstream in self.idle:
            self.idle.remove(upstream)

    def close(self) -> None:
        for upstream in list(self.idle):
            upstream.close()
        self.idle.clear()
