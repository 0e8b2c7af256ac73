"""How a request on a REST client connection goes when it cannot take the short path: its head read and
judged, the request admitted, then forwarded whole or streamed (its body held for the check when it must be) or
answered here; then on to the next request. :class:`RequestPath` is the base of
:class:`~tritonshare.proxy.rest_connection.ClientConnection`, which owns the state it reads (declared below),
the connection's lifecycle, the short path, flow control and Triton's side.

After the head is judged, in order: draining (503); the bearer token when authentication is on (401 with
``WWW-Authenticate``; probes are open; checked per request: a head found valid keeps that verdict only while the
token file's generation is unchanged, :attr:`~tritonshare.proxy.rest.Judged.verified`, so a changed token file
counts at once); the policy verdict; admission control for inference routes when it is on: the request takes a slot
of the model's :class:`~tritonshare.proxy.admission.Admission`, or waits for one (parked: what the client sends
meanwhile is kept, up to a bound) and is refused with 429 + ``Retry-After`` if the wait fails; with a rate limit, a
metadata route takes a token of its own bucket or is refused so at once. A slot goes back exactly once
(:meth:`RequestPath._settle`): at the end of the response, when Triton fails, when the request is refused after
admission (its body fails the check), or when the client goes — but a request that Triton got whole keeps its slot
until Triton has answered it (the response is read and dropped), so clients that give up and retry cannot push more
than the cap into Triton."""

from __future__ import annotations

import functools
import logging
import re
from time import perf_counter
from typing import TYPE_CHECKING

from tritonshare.proxy import admission, auth, held
from tritonshare.proxy.http1 import CONTINUE, HttpError, error_response
from tritonshare.proxy.inspect import BodyRefused
from tritonshare.proxy.policy import REST_SERVER_ROUTES
from tritonshare.proxy.readiness import UNREACHABLE, TritonProbe
from tritonshare.proxy.request_body import InferBodyCheck, RequestBody, check_plain_body, inflation_for
from tritonshare.proxy.rest_exchange import Exchange
from tritonshare.proxy.rest_upstream import PROTOCOL, Upstream

if TYPE_CHECKING:
    from tritonshare.proxy.rest import Judged, RestFrontend
    from tritonshare.proxy.state import ProxyState

logger = logging.getLogger(__name__)

WHOLE_BODY_BYTES = 64 * 1024  # a body that came with its head is sent with it in one write, up to this
READY_ROUTE = REST_SERVER_ROUTES["/v2/health/ready"].route  # not ready from the moment draining begins
_EMPTY_LINES = re.compile(rb"(?:\r\n)*")

# Why client reading is paused (bits; CONNECTING = 1 and UPSTREAM_FULL = 2 come from rest_upstream): a pipelined
# request waiting for the current response, a request waiting for an admission slot, the client not reading.
BACKLOG, ADMISSION, CLIENT_FULL = 4, 8, 16

# The refusals' metrics label by the policy's status; a 404 is another model named, as gRPC's NOT_FOUND (same label).
_REFUSAL_REASONS = {400: "bad_request", 403: "denied", 404: "other_model", 405: "method", 413: "too_large"}
_PROBE_OK = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 0\r\n\r\n"  # as Triton answers
_PROBE_OK_CLOSE = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
UNAVAILABLE = "the inference server is unavailable; retry later"
_CHALLENGE = b"WWW-Authenticate: " + auth.WWW_AUTHENTICATE + b"\r\n"


class RequestPath:
    """The general path of the requests of one client connection (see the module docstring)."""

    # The connection's state, set by ClientConnection.__init__.
    fe: RestFrontend
    state: ProxyState
    upstream: Upstream | None
    buf: bytes  # client bytes not yet acted on
    exchange: Exchange | None  # the request in progress
    spare: Exchange
    close_after: bool
    drain_grace: bool
    closing: bool
    paused: int
    progress: int

    # What the connection does for this path.

    def pause(self, reason: int) -> None:
        raise NotImplementedError

    def unpause(self, reason: int) -> None:
        raise NotImplementedError

    def _write(self, data: bytes) -> None:
        raise NotImplementedError

    def _shutdown(self) -> None:
        raise NotImplementedError

    def _upstream(self) -> Upstream:
        raise NotImplementedError

    # ------------------------------------------------------------------------------------ requests

    def _consume(self, data: bytes) -> None:
        while data and not self.closing:
            ex = self.exchange
            if ex is None:
                if self.paused & CLIENT_FULL:  # answers wait for the client to read them: so does its next request
                    self.buf = data
                    return
                data = self._read_head(data)
            elif ex.request_done:  # a pipelined request: it waits for the current response
                self.buf = data
                if len(data) > self.fe.max_header_bytes:
                    self.pause(BACKLOG)
                return
            elif ex.ticket is not None:  # its request waits for a slot: keep what comes, up to a bound
                self.buf = data
                if len(data) > self.fe.max_header_bytes:
                    self.pause(ADMISSION)
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
        # Without its blank line, up to 3 bytes of it may have come: a head of ``limit`` bytes is waited for
        if found or len(data) > limit + 3:
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
        elif tokens is not None and not judged.open and not self._authenticated(judged, tokens):
            self._refuse(ex, auth.HTTP_STATUS, auth.MESSAGE, "unauthenticated", headers=_CHALLENGE)
        elif judged.decision.status:
            status = judged.decision.status  # 413: a body over --max-body-bytes, not read (the connection closes)
            reason = _REFUSAL_REASONS.get(status, "denied")
            self._refuse(ex, status, judged.decision.message, reason, close=status == 413)
        else:
            self.drain_grace = False
            if not judged.head.keep_alive:
                self.close_after = True
            if judged.probe is not None:
                return self._answer_probe(ex, judged.probe, rest)
            if judged.limited and self.state.admission.active and not self._admit(ex, rest):
                return b""
            if judged.metered and self.state.admission.rate_limited:
                refusal = self.state.admission.take_metadata_token()
                if refusal is not None:
                    retry = b"Retry-After: %d\r\n" % refusal.retry_after_s
                    self._refuse(ex, admission.HTTP_STATUS, refusal.message, refusal.reason, headers=retry)
                    return rest
            return self._forward(ex, rest)
        return rest

    def _authenticated(self, judged: Judged, tokens: auth.BearerTokens) -> bool:
        """The head carries a valid bearer token: by its verdict stamped with the token file's generation in
        force, else by a full check (which stamps it when it passes; a refusal is never kept)."""
        if judged.verified == tokens.current():
            return True
        if not tokens.check_http(judged.head.authorization):
            return False
        judged.verified = tokens.generation
        return True

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
            self.pause(ADMISSION)
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
        self.unpause(ADMISSION)
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
                check_plain_body(body, judged.json_length, self.fe.rules.max_json_bytes, shapes=judged.shapes)
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
        check = inflation = None
        max_body_bytes = self.fe.rules.max_body_bytes
        if judged.inspect:
            try:
                if judged.json_length != 0:
                    check = InferBodyCheck(
                        encoding=head.content_encoding,
                        json_length=judged.json_length,
                        max_json_bytes=self.fe.rules.max_json_bytes,
                        max_body_bytes=max_body_bytes,
                        content_length=None if head.chunked else judged.length,
                        shapes=judged.shapes,
                    )
                else:  # a raw binary body: nothing to check but how far it inflates (Triton inflates it too)
                    inflation = inflation_for(head.content_encoding, max_body_bytes)
            except BodyRefused as exc:
                self._refuse(ex, exc.status, exc.message, exc.reason, close=exc.status == 413)
                return rest
        if check is not None:
            ex.held = True  # not in flight until the check passes, but a drain waits for it
            ex.reserved = 0
            self.state.held += 1
            # A JSON part of known length whose body has not begun to come reserves it all now (before any
            # "100 Continue"). Bytes of the body that came with the head are read at once (_read_body), and what
            # is held past that read is reserved after it: a body that came whole holds nothing (a compressed
            # one's bytes, fewer than its declared JSON, must not make it look held).
            declared = check.declared
            if declared is not None and not rest and not self._reserve(ex, declared):
                return rest
        ex.body = RequestBody(judged.length, head.chunked, check, inflation, max_bytes=max_body_bytes)
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
        check = body.check
        if refusal is not None and not ex.response_done:
            if ex.forwarded:  # Triton has part of it (a body too large, or inflating too far): it loses that connection
                self.state.metrics.refused(PROTOCOL, ex.judged.route, refusal.reason)
                self._give_up(ex, refusal.status, None if self._answered(ex) else refusal.message, refusal.reason)
            else:
                self._refuse(ex, refusal.status, refusal.message, refusal.reason, close=refusal.status == 413)
        elif body.ready and not was_ready:
            self._begin(ex, ex.judged.upstream)  # the check passed: the head, then what was held
        elif check is not None:  # held past this read: reserved in full (the body is not at its end)
            self._reserve(ex, max(check.holding, check.declared or 0))
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
        if self.paused & BACKLOG:
            self.unpause(BACKLOG)  # and on to the next request, unless something else pauses
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

    def _reserve(self, ex: Exchange, total: int) -> bool:
        """Make the request's reservation of the held-bytes budget (:mod:`tritonshare.proxy.held`) ``total``
        bytes; if they do not fit, refuse it (503) and close: the rest of its body is still to come (a body that
        came whole with its head is never held, so never reserves)."""
        more = total - ex.reserved
        if more <= 0:
            return True
        budget = self.state.held_budget
        if budget.reserve(more):
            ex.reserved = total
            return True
        exc = budget.refusal(more, ex.reserved)
        self._refuse(ex, exc.status, exc.message, exc.reason, close=True, headers=held.RETRY_AFTER)
        return False

    def _unhold(self, ex: Exchange) -> None:
        """The request's body is no longer held: its JSON part was checked and handed on, or it was refused, or
        its connection ended. What it held goes, and its reservation with it."""
        ex.held = False
        self.state.held -= 1
        if ex.reserved:
            self.state.held_budget.release(ex.reserved)
            ex.reserved = 0
        body = ex.body
        if body is not None and not body.ready:
            body.drop()  # now, not when a connection that lingers after its answer ends

    # ------------------------------------------------------------------------------------ answers

    def _answer_probe(self, ex: Exchange, probe: TritonProbe, rest: bytes) -> bytes:
        """A probe the proxy answers itself (REST ``/v2/health/ready``, ``/v2/health/live``), from what it keeps
        of Triton's answer: at once, or when the question out to Triton comes back (a body is dropped meanwhile;
        a pipelined request waits, as behind any response)."""
        ex.started = perf_counter()
        head = ex.judged.head
        if head.has_body:
            ex.body = RequestBody(ex.judged.length, head.chunked).drop()
        else:
            ex.request_done = True
        probe.ask(functools.partial(self._probed, ex))
        return rest

    def _probed(self, ex: Exchange, status: int) -> None:
        """Triton's status for a probe (200: yes) is known: answer it as Triton would (the own model not ready:
        400; Triton unreachable: 503)."""
        if ex is not self.exchange or ex.response_done or self.closing:
            return  # the connection ended meanwhile
        route = ex.judged.route
        close = self.close_after or not ex.judged.head.keep_alive
        if status == 200:
            self._write(_PROBE_OK_CLOSE if close else _PROBE_OK)
        else:
            if status == UNREACHABLE:
                message = UNAVAILABLE
            elif route == READY_ROUTE:
                message = f"model '{self.state.own}' is not ready"
            else:
                message = "the inference server is not live"
            self._write(error_response(status, message, close=close))
        ex.response_done = True
        self.state.answered(PROTOCOL, route, str(status), ex.started)
        if ex.request_done:
            self._finish()

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
