"""One client connection of the REST front end (:mod:`tritonshare.proxy.rest`): its requests read, judged,
answered here or forwarded over its :class:`~tritonshare.proxy.rest_upstream.Upstream`, one at a time.

Each request is an :class:`Exchange`, from its head to the end of its response. After the head is judged, in
order: draining (503); the bearer token when authentication is on (401 with ``WWW-Authenticate``; probes are
open; checked per request, never memoised, so a changed token file counts at once); the policy verdict;
admission control for inference routes when it is on: the request takes a slot of the model's
:class:`~tritonshare.proxy.admission.Admission`, or waits for one (parked: what the client sends meanwhile is
kept, up to a bound) and is refused with 429 + ``Retry-After`` if the wait fails. A slot goes back exactly
once (:meth:`ClientConnection._settle`): at the end of the response, when Triton fails, when the request is
refused after admission (its body fails the check), or when the client goes — but a request that Triton got
whole keeps its slot until Triton has answered it (the response is read and dropped), so clients that give up
and retry cannot push more than the cap into Triton.

Bytes of a next (pipelined) request wait until the response is complete, and while the client is not reading
what the proxy writes (its write buffer is full: reading from the client pauses too, so refusals the proxy
answers itself cannot pile up in memory). A request head must be complete within ``header_timeout_s`` of its
first byte, and a request body may not stop for that long (else 408 and close: slowloris; a stalled body also
gives back its admission slot); a keep-alive connection idle for ``idle_timeout_s`` is closed
(:meth:`ClientConnection.expire`, called every second by the front end), and one idle for ``UPSTREAM_IDLE_S``
gives its connection to Triton back to the pool (idle clients do not each hold one of the shared Triton's).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
from bisect import bisect_left
from time import perf_counter
from typing import TYPE_CHECKING, cast

from tritonshare.proxy import admission, auth
from tritonshare.proxy.http1 import CONTINUE, HttpError, ResponseHead, error_response
from tritonshare.proxy.inspect import (
    ESCAPE,
    MAX_DEPTH,
    BodyRefused,
    InferBodyCheck,
    RequestBody,
    check_plain_body,
)
from tritonshare.proxy.metrics import BUCKETS
from tritonshare.proxy.overload import LINGER_S
from tritonshare.proxy.policy import REST_SERVER_ROUTES, SHM_MARKER
from tritonshare.proxy.rest_exchange import Exchange
from tritonshare.proxy.rest_upstream import CONNECTING, PROTOCOL, UPSTREAM_FULL, UPSTREAM_IDLE_S, Upstream

if TYPE_CHECKING:
    from tritonshare.proxy.rest import Judged, RestFrontend

logger = logging.getLogger(__name__)

WHOLE_BODY_BYTES = 64 * 1024  # a body that came with its head is sent with it in one write, up to this
READY_ROUTE = REST_SERVER_ROUTES["/v2/health/ready"].route  # not ready from the moment draining begins
_EMPTY_LINES = re.compile(rb"(?:\r\n)*")

# Why client reading is paused (bits; CONNECTING = 1 and UPSTREAM_FULL = 2 come from rest_upstream): a pipelined
# request waiting for the current response, a request waiting for an admission slot, the client not reading.
_BACKLOG, _ADMISSION, _CLIENT_FULL = 4, 8, 16
_OURS = CONNECTING | UPSTREAM_FULL  # pauses that are the proxy's doing, not the client's: no timeout runs

_REFUSAL_REASONS = {400: "bad_request", 403: "denied", 404: "not_found", 405: "method"}
_UNAVAILABLE = "the inference server is unavailable; retry later"
_BROKEN = "the inference server closed the connection; retry"
_CHALLENGE = b"WWW-Authenticate: " + auth.WWW_AUTHENTICATE + b"\r\n"


class ClientConnection(asyncio.Protocol):
    def __init__(self, frontend: RestFrontend) -> None:
        self.fe = frontend
        self.state = frontend.state
        self.heads = frontend.heads
        self.upstream: Upstream | None = None  # its connection to Triton, from the first forwarded request
        self.transport: asyncio.Transport | None = None
        self.buf = b""  # client bytes not yet acted on
        self.exchange: Exchange | None = None  # the request in progress: ``spare`` restarted, or None
        self.spare = Exchange()
        self.sent = Exchange.sent_whole()  # the short path's
        # The last request taken whole from the memo: its head (with the blank line), its size with its body,
        # and its judgement. A client that repeats it costs one comparison (no search, no hashing).
        self.last_head = b""
        self.last_size = 0
        self.last_judged: Judged | None = None
        self.close_after = False  # close once the current exchange ends
        self.drain_grace = False  # the request in progress when draining began may still complete
        self.closing = False
        self.paused = 0
        self.linger: asyncio.TimerHandle | None = None
        self.progress = 0  # heads accepted, body reads, exchanges completed: the timeout sweep's sign of life
        self.seen = 0  # ``progress`` at the last sweep that saw it move
        self.idle_since = 0.0
        self.stalled_since: float | None = None  # the first sweep that saw a head or a body stall

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it
        self.fe.connections.add(self)
        self.idle_since = asyncio.get_running_loop().time()

    def data_received(self, data: bytes) -> None:
        if self.exchange is None and not self.buf and not self.closing:
            # The common case: a whole request in one read, its head judged before (the memo) as needing no
            # more than a look for the shared-memory marker (anywhere in the bytes: one in the head only sends
            # the request the long way, which checks it properly) and a count of its body's opening brackets (no
            # more than MAX_DEPTH of them: it cannot nest deeper, else the long way measures it; ~6 instructions
            # a byte, skipped for a body of MAX_DEPTH bytes or less, which cannot); one write to Triton.
            judged = self.last_judged
            if judged is None or len(data) != self.last_size or data[: len(self.last_head)] != self.last_head:
                judged = self._recall(data)
            if (
                judged is not None
                and judged.quick
                and not self.state.draining
                # might_name_shm(data), inlined (a call costs as much as the two searches)
                and not (
                    judged.inspect
                    and (
                        data.partition(SHM_MARKER)[1]
                        or data.partition(ESCAPE)[1]
                        or (
                            len(data) - len(self.last_head) > MAX_DEPTH  # a body this short cannot nest deeper
                            and data.count(b"[", len(self.last_head)) + data.count(b"{", len(self.last_head))
                            > MAX_DEPTH
                        )
                    )
                )
            ):
                ex = self.exchange = self.sent
                ex.judged, ex.response_done = judged, False
                self.drain_grace = False
                meter = judged.meter  # meter.begin(), inlined: once per request
                meter.gauge.value += 1
                meter.flight.value += 1
                ex.started = perf_counter()
                upstream = self.upstream
                payload = data if judged.verbatim else judged.upstream + data[len(self.last_head) :]
                if upstream is not None and upstream.transport is not None and not upstream.closed:
                    upstream.reader, upstream.expecting = None, True  # upstream.request(payload), inlined
                    upstream.transport.write(payload)
                else:
                    self._upstream().request(payload)
                return
        if self.buf:
            data, self.buf = self.buf + data, b""
        self._consume(data)

    def _recall(self, data: bytes) -> Judged | None:
        """The memo's judgement of ``data`` when it is exactly one request, head and whole body (remembered
        as the last one); else None."""
        head, end, rest = data.partition(b"\r\n\r\n")
        judged = self.heads.get(head) if end else None
        if judged is None or len(rest) != judged.length:
            return None
        self.last_head, self.last_size, self.last_judged = data[: len(data) - len(rest)], len(data), judged
        return judged

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
        ex, self.exchange = self.exchange, None
        upstream, self.upstream = self.upstream, None
        if ex is not None:
            if ex.ticket is not None:
                ex.ticket.cancel()  # it was waiting for a slot
                ex.ticket = None
            if ex.forwarded and not ex.response_done:
                ex.judged.meter.end("499", ex.started)  # the client went away first
                if ex.holding and ex.request_done and upstream is not None:
                    # Triton computes it all the same: the slot stays taken until Triton has answered.
                    upstream.orphan(self.state.admission.release)
                    return
            self._settle(ex)
        if upstream is not None:
            self.fe.pool.give(upstream)  # kept for another client if it is idle, else closed

    def pause_writing(self) -> None:
        """The client is not reading: stop reading Triton's response, and the client's next requests (their
        answers would pile up here)."""
        if self.upstream is not None:
            self.upstream.pause_reading()
        self.pause(_CLIENT_FULL)

    def resume_writing(self) -> None:
        if self.upstream is not None:
            self.upstream.resume_reading()
        self.unpause(_CLIENT_FULL)

    def drain(self) -> None:
        """Draining: an idle connection closes now; a busy one after its current response."""
        if self.exchange is None and not self.buf:
            self._shutdown()
        else:
            self.close_after = self.drain_grace = True

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def expire(self, now: float) -> None:
        """The timeout sweep: close a connection whose head is incomplete, or whose body stopped coming, for
        ``header_timeout_s``, or that is idle for ``idle_timeout_s``."""
        if self.closing:
            return
        ex = self.exchange
        waiting = ex is not None and (ex.request_done or ex.ticket is not None or self.paused & _OURS)
        if self.progress != self.seen or waiting:
            self.seen, self.idle_since, self.stalled_since = self.progress, now, None
        elif ex is None and not self.buf:
            idle_s = now - self.idle_since
            if idle_s >= self.fe.idle_timeout_s:
                self._shutdown()
            elif idle_s >= UPSTREAM_IDLE_S and self.upstream is not None and not self.paused:
                upstream, self.upstream = self.upstream, None  # for whoever needs one; the next request takes one
                self.fe.pool.give(upstream)
        elif self.stalled_since is None:
            self.stalled_since = now
        elif now - self.stalled_since >= self.fe.header_timeout_s:
            self._time_out(ex)

    def _time_out(self, ex: Exchange | None) -> None:
        """408 and close: the head (``ex`` None) or the body did not come in time. A client that has not read its
        answers for that long (its next request waits for it to) is closed without one more."""
        limit = self.fe.header_timeout_s
        if self.paused & _CLIENT_FULL:
            logger.info("closing a connection whose client has not read its answers for %g s", limit)
            self._shutdown()
        elif ex is None:
            self._give_up(None, 408, f"the request head was not complete within {limit:g} s", "header_timeout")
        else:
            message = f"the request body stopped: no byte of it for {limit:g} s"
            self._give_up(ex, 408, None if self._answered(ex) else message, "body_timeout")

    # ------------------------------------------------------------------------------------ requests

    def _consume(self, data: bytes) -> None:
        while data and not self.closing:
            ex = self.exchange
            if ex is None:
                if self.paused & _CLIENT_FULL:  # answers wait for the client to read them: so does its next request
                    self.buf = data
                    return
                data = self._read_head(data)
            elif ex.request_done:  # a pipelined request: it waits for the current response
                self.buf = data
                if len(data) > self.fe.max_header_bytes:
                    self.pause(_BACKLOG)
                return
            elif ex.ticket is not None:  # its request waits for a slot: keep what comes, up to a bound
                self.buf = data
                if len(data) > self.fe.max_header_bytes:
                    self.pause(_ADMISSION)
                return
            else:
                data = self._read_body(ex, data)

    def _read_head(self, data: bytes) -> bytes:
        if data[:2] == b"\r\n":  # empty lines before a request line are ignored (RFC 9112 §2.2)
            lines = _EMPTY_LINES.match(data)
            return data[lines.end() :] if lines is not None else data
        raw, found, rest = data.partition(b"\r\n\r\n")
        limit = self.fe.max_header_bytes
        if found and len(raw) <= limit:
            try:
                judged = self.fe.judge(raw)
            except HttpError as exc:
                self._fail(exc)
                return b""
            return self._start(judged, rest)
        if found or len(data) > limit:
            self._fail(HttpError(431, f"request head larger than {limit} bytes", "too_large"))
        else:
            self.buf = data
        return b""

    def _start(self, judged: Judged, rest: bytes) -> bytes:
        ex = self.exchange = self.spare.start(judged)
        self.progress += 1
        tokens = self.state.auth
        if self.state.draining and (not self.drain_grace or judged.route == READY_ROUTE):
            self._refuse(ex, 503, "the proxy is shutting down; retry on another replica", "draining", close=True)
        elif tokens is not None and not judged.open and not tokens.check_http(judged.head.authorization):
            self._refuse(ex, auth.HTTP_STATUS, auth.MESSAGE, "unauthenticated", headers=_CHALLENGE)
        elif judged.decision.status:
            status = judged.decision.status
            self._refuse(ex, status, judged.decision.message, _REFUSAL_REASONS.get(status, "denied"))
        else:
            self.drain_grace = False
            if not judged.head.keep_alive:
                self.close_after = True
            if judged.limited and self.state.admission.active and not self._admit(ex, rest):
                return b""
            return self._forward(ex, rest)
        return rest

    def _admit(self, ex: Exchange, rest: bytes) -> bool:
        """Take an admission slot (True), or park the request until :meth:`_admitted`: what comes meanwhile is
        kept, up to ``max_header_bytes``, then client reading pauses. Reading goes on below that so that a
        client that leaves is seen (a paused transport does not report the close) and gives up its place."""
        gate = self.state.admission
        if gate.try_acquire():
            ex.holding = True
            return True
        self.buf = rest
        if len(rest) > self.fe.max_header_bytes:
            self.pause(_ADMISSION)
        ex.ticket = gate.enqueue(functools.partial(self._admitted, ex))
        return False

    def _admitted(self, ex: Exchange, refusal: admission.Refusal | None) -> None:
        """Admission's answer for a parked request: forward it now, or refuse it (429)."""
        ex.ticket = None
        if ex is not self.exchange or self.closing:  # not expected: a client that goes cancels its ticket
            if refusal is None:
                self.state.admission.release()
            return
        data, self.buf = self.buf, b""
        self.unpause(_ADMISSION)
        if refusal is not None:
            retry = b"Retry-After: %d\r\n" % refusal.retry_after_s
            self._refuse(ex, admission.HTTP_STATUS, refusal.message, refusal.reason, headers=retry)
        else:
            ex.holding = True
            data = self._forward(ex, data)
        self._consume(data)

    def _forward(self, ex: Exchange, rest: bytes) -> bytes:
        judged = ex.judged
        if judged.whole and len(rest) >= judged.length:
            return self._forward_whole(ex, rest)
        return self._forward_streamed(ex, rest)

    def _forward_whole(self, ex: Exchange, rest: bytes) -> bytes:
        """The whole plain body came with its head. Check it; head and body in one write."""
        judged = ex.judged
        size = judged.length
        body = rest if len(rest) == size else rest[:size]
        if judged.inspect:
            try:
                check_plain_body(body, judged.json_length, self.fe.rules.max_json_bytes)
            except BodyRefused as exc:
                self._refuse(ex, exc.status, exc.message, exc.reason, close=exc.status == 413)
                return rest  # the body is read and dropped
        ex.request_done = True
        if size <= WHOLE_BODY_BYTES:
            self._begin(ex, judged.upstream + body if size else judged.upstream)
        else:
            self._begin(ex, judged.upstream)
            self._upstream().write(body)
        return rest[size:] if len(rest) > size else b""

    def _forward_streamed(self, ex: Exchange, rest: bytes) -> bytes:
        """A body still to come (or chunked, or encoded): hold it for the check if needed, else stream it."""
        judged, head = ex.judged, ex.judged.head
        self._upstream()  # connect while the body arrives
        check = None
        if judged.inspect and judged.json_length != 0:
            try:
                check = InferBodyCheck(
                    encoding=head.content_encoding,
                    json_length=judged.json_length,
                    max_json_bytes=self.fe.rules.max_json_bytes,
                )
            except BodyRefused as exc:
                self._refuse(ex, exc.status, exc.message, exc.reason, close=exc.status == 413)
                return rest
            ex.held = True  # not in flight until the check passes, but a drain waits for it
            self.state.held += 1
        ex.body = RequestBody(judged.length, head.chunked, check)
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
        self.progress += 1
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
            self._upstream().write(piece)
        if end < 0 or self.closing:
            return b""
        self._request_done(ex)
        return data[end:] if end < len(data) else b""

    def _begin(self, ex: Exchange, data: bytes) -> None:
        """Forward: the request is in flight from here on."""
        ex.forwarded = True
        ex.started = ex.judged.meter.begin()
        if ex.held:
            self._unhold(ex)
        self._upstream().request(data)

    def _request_done(self, ex: Exchange) -> None:
        ex.request_done = True
        if ex.response_done:
            self._finish()

    def _finish(self) -> None:
        """Both the request and its response are complete: on to the next request, if any."""
        self.exchange = None
        self.progress += 1
        if self.close_after:
            self._shutdown()
            return
        if self.paused & _BACKLOG:
            self.unpause(_BACKLOG)  # and on to the next request, unless something else pauses
        elif self.buf and not self.paused:
            data, self.buf = self.buf, b""
            self._consume(data)

    def _settle(self, ex: Exchange) -> None:
        """The exchange has its answer (or never will): its admission slot, if any, goes back."""
        ex.response_done = True
        if ex.holding:
            ex.holding = False
            self.state.admission.release()
        if ex.held:
            self._unhold(ex)

    def _unhold(self, ex: Exchange) -> None:
        ex.held = False
        self.state.held -= 1

    # ------------------------------------------------------------------------------------ answers

    def _refuse(
        self, ex: Exchange, status: int, message: str, reason: str, *, close: bool = False, headers: bytes = b""
    ) -> None:
        """Answer a request here; the rest of its body is read and dropped (or the connection closes)."""
        self.state.refuse(PROTOCOL, ex.judged.route, str(status), reason)
        head = ex.judged.head
        logger.debug("refused %s %s with %d: %s", head.method, head.target, status, message)
        self._settle(ex)
        # After "Expect: 100-continue" the client may or may not send the body: only closing is unambiguous.
        close = close or self.close_after or not head.keep_alive or (head.expect_continue and head.has_body)
        self._write(error_response(status, message, close=close, headers=headers))
        if close:
            self._shutdown()
        elif ex.body is not None:
            ex.body.drop()
        elif head.has_body:
            ex.body = RequestBody(ex.judged.length, head.chunked).drop()
        else:
            self._request_done(ex)

    def _fail(self, exc: HttpError) -> None:
        """A request that cannot be read further (malformed head or chunked body): answer and close."""
        logger.debug("malformed request: %s", exc.message)
        ex = self.exchange
        answered = ex is not None and self._answered(ex)
        self._give_up(ex, exc.status, None if answered else exc.message, exc.reason)

    def _answered(self, ex: Exchange) -> bool:
        """Triton's answer to this request is on its way to the client: the proxy cannot answer it any more."""
        upstream = self.upstream
        return ex.forwarded and upstream is not None and upstream.answered

    def _give_up(self, ex: Exchange | None, status: int, message: str | None, reason: str) -> None:
        """End the exchange (if any, and not answered yet) with ``status``, say ``message`` unless None, and
        close the connection. A request Triton got part of loses that connection too (see :meth:`_shutdown`)."""
        if ex is None:
            self.state.refuse(PROTOCOL, "malformed", str(status), reason)
        elif not ex.response_done:
            if ex.forwarded:
                ex.judged.meter.end(str(status), ex.started)
            else:
                self.state.refuse(PROTOCOL, ex.judged.route, str(status), reason)
            self._settle(ex)
        else:
            message = None  # already answered (a refused request's body turned out malformed)
        if message is not None:
            self._write(error_response(status, message, close=True))
        self._shutdown()

    def _write(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)

    def _shutdown(self) -> None:
        """Close from the proxy's side: flush, send FIN, keep reading (and dropping) for a moment so the
        client sees the answer rather than a reset, then close. TLS has no half-close: the transport closes
        at once (after its buffered bytes, with TLS close_notify)."""
        if self.closing or self.transport is None:
            return
        self.closing = True
        self.buf = b""
        ex = self.exchange
        if ex is not None and ex.forwarded and not ex.request_done:
            self._drop_upstream()  # Triton holds part of a request that will never end
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        if self.paused:
            self.paused = 0
            self.transport.resume_reading()
        self.linger = asyncio.get_running_loop().call_later(LINGER_S, self.transport.close)

    def pause(self, reason: int) -> None:
        if not self.paused and self.transport is not None and not self.closing:
            self.transport.pause_reading()
        self.paused |= reason

    def unpause(self, reason: int) -> None:
        """Resume reading unless something else pauses; bytes that came meanwhile are read now (they may hold
        a whole request, and the client may send nothing more)."""
        if not self.paused & reason:
            return
        self.paused &= ~reason
        if self.paused or self.transport is None or self.closing:
            return
        self.transport.resume_reading()
        if self.exchange is None and self.buf:
            data, self.buf = self.buf, b""
            self._consume(data)

    # ------------------------------------------------------------------------------------ Triton side

    def _upstream(self) -> Upstream:
        upstream = self.upstream
        if upstream is None:
            upstream = self.upstream = self.fe.pool.attach(self)
            if upstream.transport is None:
                self.pause(CONNECTING)
        return upstream

    def _drop_upstream(self) -> None:
        upstream, self.upstream = self.upstream, None
        if upstream is not None:
            upstream.close()

    def upstream_lost(self, upstream: Upstream) -> None:
        if upstream is self.upstream:
            self.upstream = None

    def response_done(self, head: ResponseHead, extra: bool) -> None:
        ex = self.exchange
        if ex is None:
            return
        ex.response_done = True  # _settle, inline: every request passes here
        if ex.holding:
            self._settle(ex)
        # ex.judged.meter.end(head.code, ex.started), inlined: every forwarded request passes here
        seconds = perf_counter() - ex.started
        meter = ex.judged.meter
        codes, latency, flight = meter.codes, meter.latency, meter.flight
        codes[head.code] = codes.get(head.code, 0) + 1
        latency.counts[bisect_left(BUCKETS, seconds)] += 1
        latency.total += seconds
        meter.gauge.value -= 1
        flight.value -= 1
        if flight.value == 0 and flight.on_idle is not None:
            flight.on_idle()
        if head.close or extra or not ex.request_done:
            self._drop_upstream()
            if not ex.request_done:  # Triton answered before the body ended: the rest cannot follow
                self._shutdown()
                return
        if self.close_after or self.paused or self.buf:
            self._finish()
        else:  # what _finish comes to when nothing else waits
            self.exchange = None
            self.progress += 1

    def response_failed(self, *, answered: bool) -> None:
        if self.exchange is not None:
            self._give_up(self.exchange, 502, None if answered else _BROKEN, "upstream")

    def unavailable(self) -> None:
        """Triton cannot be reached: 503 for the request waiting on it."""
        ex = self.exchange
        if ex is None or ex.response_done or self.closing:
            self.unpause(CONNECTING)  # nothing waits on Triton now
            return
        self._give_up(ex, 503, _UNAVAILABLE, "upstream")
