"""One client connection of the REST front end (:mod:`tritonshare.proxy.rest`): its requests read, judged,
answered here or forwarded over its :class:`~tritonshare.proxy.rest_upstream.Upstream`, one at a time.

Each request is an :class:`Exchange`, from its head to the end of its response. A whole request whose head was
judged before takes the short path (:meth:`ClientConnection.data_received`): one comparison, one write to
Triton. Every other request takes the general path of :mod:`tritonshare.proxy.rest_requests` (its base class):
draining, authentication, the policy verdict, admission control, the body check. This module keeps the
connection itself: its lifecycle, flow control, timeouts, and Triton's answers.

Bytes of a next (pipelined) request wait until the response is complete, and while the client is not reading
what the proxy writes (its write buffer is full: reading from the client pauses too, so refusals the proxy
answers itself cannot pile up in memory). A request head must be complete within ``header_timeout_s`` of its
first byte (the first head: of the connection's accept; one that sends nothing then is closed), and a request
body may not stop for that long (else 408 and close: slowloris; a stalled body also gives back its admission
slot); a keep-alive connection idle for ``idle_timeout_s`` is closed
(:meth:`ClientConnection.expire`, called every second by the front end), and one idle for ``UPSTREAM_IDLE_S``
gives its connection to Triton back to the pool (idle clients do not each hold one of the shared Triton's).
"""

from __future__ import annotations

import asyncio
import logging
from bisect import bisect_left
from time import perf_counter
from typing import TYPE_CHECKING, cast

from tritonshare.proxy.http1 import ResponseHead
from tritonshare.proxy.inspect import CLASSIFICATION_WORD, ESCAPE, MAX_DEPTH, long_shapes
from tritonshare.proxy.metrics import BUCKETS
from tritonshare.proxy.overload import half_close
from tritonshare.proxy.policy import SHM_MARKER
from tritonshare.proxy.rest_exchange import Exchange
from tritonshare.proxy.rest_requests import CLIENT_FULL, UNAVAILABLE, RequestPath
from tritonshare.proxy.rest_upstream import CONNECTING, UPSTREAM_FULL, UPSTREAM_IDLE_S, Upstream

if TYPE_CHECKING:
    from tritonshare.proxy.rest import Judged, RestFrontend

logger = logging.getLogger(__name__)

_OURS = CONNECTING | UPSTREAM_FULL  # pauses that are the proxy's doing, not the client's: no timeout runs
_BROKEN = "the inference server closed the connection; retry"


class ClientConnection(RequestPath, asyncio.Protocol):
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
        if self.exchange is None and not self.closing:
            if self.buf:  # a head held for its body (_recall), or the start of a head
                data, self.buf = self.buf + data, b""
            # The common case: a whole request in one read (or a held head, then its body), its head judged before
            # (the memo) as needing no more than a look for the shared-memory marker (anywhere in the bytes: one in
            # the head only sends the request the long way, which checks it properly) and a count of its body's
            # opening brackets (no more than MAX_DEPTH of them: it cannot nest deeper, else the long way measures
            # it; ~6 instructions a byte, skipped for a body of MAX_DEPTH bytes or less, which cannot) and, for
            # infer, a look at the digits of its "shape" arrays (more than a few send it the long way:
            # inspect.long_shapes) and for the word "classification" (inspect.check_classification); one write to
            # Triton.
            judged = self.last_judged
            if judged is None or len(data) != self.last_size or data[: len(self.last_head)] != self.last_head:
                judged = self._recall(data)
                if judged is None and self.buf:
                    return  # a head held for its body (_recall)
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
                        or (
                            judged.shapes
                            and (long_shapes(data, len(self.last_head)) or data.partition(CLASSIFICATION_WORD)[1])
                        )
                    )
                )
                and (not judged.gated or self._gates_open(judged))
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
        elif self.buf:
            data, self.buf = self.buf + data, b""
        self._consume(data)

    def _gates_open(self, judged: Judged) -> bool:
        """The short path's checks of a request that authentication, admission control or the rate limit covers,
        in the general path's order: its head's token verdict stands (found valid under the token file's
        generation in force), then it takes its slot (inference: held by the short path's exchange, given back as
        the general path's are, see :mod:`tritonshare.proxy.rest_requests`) or its metadata token now, if one is
        free. False: it takes the general path, which checks again, then queues it, or refuses and counts it."""
        tokens = self.state.auth
        if tokens is not None and not judged.open and judged.verified != tokens.current():
            return False
        gate = self.state.admission
        if judged.limited:
            if gate.active:
                if not gate.try_acquire():
                    return False
                self.sent.holding = True
        elif judged.metered and gate.rate_limited and not gate.try_metadata_token():
            return False
        return True

    def _recall(self, data: bytes) -> Judged | None:
        """The memo's judgement of ``data`` when it is exactly one request, head and whole body (remembered
        as the last one); else None. A head alone that would take the short path with its body is held for it
        (``buf``), and remembered as the last one: a client writing the body apart (http.client, requests,
        httpx) sends it next, and the two are then taken whole. If it is late, the next sweep starts the request
        the general way (:meth:`expire`)."""
        head, end, rest = data.partition(b"\r\n\r\n")
        judged = self.heads.get(head) if end else None
        if judged is None:
            return None
        if len(rest) != judged.length:
            if not rest and judged.quick:
                self.buf = data
                self.last_head, self.last_size, self.last_judged = data, len(data) + judged.length, judged
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
        self.pause(CLIENT_FULL)

    def resume_writing(self) -> None:
        if self.upstream is not None:
            self.upstream.resume_reading()
        self.unpause(CLIENT_FULL)

    def drain(self) -> None:
        """Draining: an idle connection closes now; a busy one after its current response. A head held for its
        body (data_received) is started now: the drain waits for a request in progress, not for a held head."""
        if self.exchange is None and not self.buf:
            self._shutdown()
        else:
            self.close_after = self.drain_grace = True
            self._start_held()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def expire(self, now: float) -> None:
        """The timeout sweep: close a connection whose head is incomplete, or whose body stopped coming, for
        ``header_timeout_s``, or that is idle for ``idle_timeout_s``. Its first request head must be complete
        ``header_timeout_s`` after the connection was accepted: a connection that never sends a byte is not
        an idle keep-alive client, only a place held under ``--max-connections`` (as gRPC's silent ones)."""
        if self.closing:
            return
        ex = self.exchange
        waiting = ex is not None and (ex.request_done or ex.ticket is not None or self.paused & _OURS)
        if self.progress != self.seen or waiting:
            self.seen, self.idle_since, self.stalled_since = self.progress, now, None
        elif ex is None and not self.buf:
            idle_s = now - self.idle_since
            if idle_s >= (self.fe.idle_timeout_s if self.progress else self.fe.header_timeout_s):
                self._shutdown()
            elif idle_s >= UPSTREAM_IDLE_S and self.upstream is not None and not self.paused:
                upstream, self.upstream = self.upstream, None  # for whoever needs one; the next request takes one
                self.fe.pool.give(upstream)
        elif self._holding_head():
            self._start_held()  # its body is late: the stall clock then times it as any other's
        elif self.stalled_since is None:
            self.stalled_since = now if self.progress else self.idle_since  # the first head: from the accept
            if now - self.stalled_since >= self.fe.header_timeout_s:
                self._time_out(ex)
        elif now - self.stalled_since >= self.fe.header_timeout_s:
            self._time_out(ex)

    def _holding_head(self) -> bool:
        """Whether a whole head is held for its body (_recall): no request in progress, reading not paused, and
        the bytes kept end a head (a partial head kept never does)."""
        return self.exchange is None and not self.paused and self.buf.endswith(b"\r\n\r\n")

    def _start_held(self) -> None:
        """A whole head held for its body (data_received) becomes a request in progress, read the general way."""
        if self._holding_head():
            data, self.buf = self.buf, b""
            self._consume(data)

    def _time_out(self, ex: Exchange | None) -> None:
        """408 and close: the head (``ex`` None) or the body did not come in time. A client that has not read its
        answers for that long (its next request waits for it to) is closed without one more."""
        limit = self.fe.header_timeout_s
        if self.paused & CLIENT_FULL:
            logger.info("closing a connection whose client has not read its answers for %g s", limit)
            self._shutdown()
        elif ex is None:
            self._give_up(None, 408, f"the request head was not complete within {limit:g} s", "header_timeout")
        else:
            message = f"the request body stopped: no byte of it for {limit:g} s"
            self._give_up(ex, 408, None if self._answered(ex) else message, "body_timeout")

    def _write(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)

    def _shutdown(self) -> None:
        """Close from the proxy's side (:func:`~tritonshare.proxy.overload.half_close`), reading and dropping
        what the client still sends."""
        if self.closing or self.transport is None:
            return
        self.closing = True
        self.buf = b""
        ex = self.exchange
        if ex is not None and ex.forwarded and not ex.request_done:
            self._drop_upstream()  # Triton holds part of a request that will never end
        self.linger = half_close(self.transport)
        if self.linger is not None and self.paused:
            self.paused = 0
            self.transport.resume_reading()

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
        self._give_up(ex, 503, UNAVAILABLE, "upstream")
