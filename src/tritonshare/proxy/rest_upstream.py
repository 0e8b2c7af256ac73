"""The Triton side of the REST front end: connections to Triton's HTTP port and the responses read from them.

Each client connection (:mod:`tritonshare.proxy.rest_connection`) sends its requests over one :class:`Upstream`
(1:1, taken at its first forwarded request; bytes written while it connects wait in it). The upstream reads
each response's framing as the bytes pass back to the client untouched, and tells its owner when the response
is complete, when Triton broke it off, or when Triton could not be reached. When the client goes, or has sent
no request for :data:`UPSTREAM_IDLE_S` (so that idle keep-alive clients do not each hold one of the shared
Triton's connections), an idle upstream goes to the :class:`UpstreamPool`, which keeps a few for the next
client connection (one-request clients such as curl and probes then pay no connect each).

Idle connections are not aged out: Triton's HTTP server (2.51, libevhtp) keeps an idle keep-alive connection
open indefinitely (checked here: one stayed open for ten minutes), so a pooled connection goes stale only
when Triton stops, and its close then arrives while it sits idle and takes it out of the pool. A request is
not retried on another connection when Triton closes under it: an inference request is not idempotent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol, cast

from tritonshare.proxy.http1 import HttpError, ResponseHead, ResponseReader, whole_response
from tritonshare.proxy.state import ProxyState

logger = logging.getLogger(__name__)

PROTOCOL = "rest"
IDLE_UPSTREAMS = 8  # idle connections to Triton kept for the next client
UPSTREAM_IDLE_S = 5.0  # a client connection without a request for this long gives its upstream back to the pool

# Why an owner pauses reading its client (bits of its pause state): its upstream is still connecting;
# Triton is not taking more bytes.
CONNECTING, UPSTREAM_FULL = 1, 2


class UpstreamOwner(Protocol):
    """The client connection an :class:`Upstream` works for."""

    transport: asyncio.Transport | None  # the client's; None once it is gone
    close_after: bool  # the client connection closes after this response: tell the client so

    def pause(self, reason: int) -> None:
        """Stop reading from the client (``reason``: :data:`CONNECTING` or :data:`UPSTREAM_FULL`)."""

    def unpause(self, reason: int) -> None: ...

    def response_done(self, head: ResponseHead, extra: bool) -> None:
        """The response is complete (``extra``: Triton sent bytes past it; the upstream is not reusable)."""

    def response_failed(self, *, answered: bool) -> None:
        """Triton broke off the response (``answered``: its head already went to the client)."""

    def unavailable(self) -> None:
        """Triton cannot be reached: nothing was sent."""

    def upstream_lost(self, upstream: Upstream) -> None:
        """This upstream is closed: forget it (before any of the calls above that its closing causes)."""


class Upstream(asyncio.Protocol):
    """One connection to Triton's HTTP port, owned by one client connection at a time (or idle in the pool):
    carries its requests and reads the responses to them."""

    def __init__(self, pool: UpstreamPool, owner: UpstreamOwner | None) -> None:
        self.pool = pool
        self.owner = owner
        self.transport: asyncio.Transport | None = None  # None while connecting
        self.closed = False
        self.reading_paused = False
        self.queued: list[bytes | memoryview] = []  # written while connecting
        self.reader: ResponseReader | None = None  # the response, unless it came whole in one read
        self.expecting = False  # a request went out and its response is not complete
        # The last response that came whole in one read: its size, its head's bytes (blank line included), the
        # parsed head.
        # A response of the same bytes' shape (same head, so same length) is recognised by one comparison.
        self.whole_size = -1
        self.whole_head = b""
        self.whole: ResponseHead | None = None

    @property
    def answered(self) -> bool:
        """Part of the response (its head at least) went to the client."""
        return self.reader is not None and self.reader.head is not None

    def request(self, data: bytes) -> None:
        """A request goes out (its head, and its body if that came whole): its response is read next."""
        self.reader = None
        self.expecting = True
        transport = self.transport
        if transport is not None and not self.closed:
            transport.write(data)
        else:
            self.write(data)

    def write(self, data: bytes | memoryview) -> None:
        """More of the request (body pieces)."""
        if self.closed:
            return
        if self.transport is not None:
            self.transport.write(data)
        else:
            self.queued.append(data)

    def pause_reading(self) -> None:
        """The client is not taking more bytes: stop reading Triton's response."""
        if self.transport is not None and not self.closed and not self.reading_paused:
            self.reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self.closed and self.reading_paused:
            self.reading_paused = False
            self.transport.resume_reading()

    def orphan(self, on_done: Callable[[], object]) -> None:
        """The owner left while Triton computes the request: read the response to its end and drop it, then
        run ``on_done`` and go back to the pool."""
        self.owner = Orphan(self, on_done)
        self.resume_reading()

    def close(self) -> None:
        """Close it (it holds part of a request, or cannot be reused); its owner hears nothing more."""
        self.owner = None
        self.expecting = False
        self.queued = []
        if not self.closed:
            self.closed = True
            self.pool.forget(self)
            if self.transport is not None:
                self.transport.close()

    # ------------------------------------------------------------------ the connection's events

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it
        if self.closed:  # dropped while connecting
            self.transport.close()
            return
        queued, self.queued = self.queued, []
        for data in queued:
            self.transport.write(data)
        if self.owner is not None:
            self.owner.unpause(CONNECTING)

    def data_received(self, data: bytes) -> None:
        owner = self.owner
        if owner is None or not self.expecting:
            self.close()  # Triton spoke with no request outstanding: the connection cannot be trusted any more
            if owner is not None:
                owner.upstream_lost(self)
            return
        reader = self.reader
        if reader is None:
            if owner.close_after:
                head = None
            elif len(data) == self.whole_size and data[: len(self.whole_head)] == self.whole_head:
                head = self.whole
            else:
                head = whole_response(data, self.pool.response_heads)
                if head is not None:
                    self._remember(data, head)
            if head is not None:  # the common case: the whole response in one read, passed on untouched
                self.expecting = False
                if owner.transport is not None:
                    owner.transport.write(data)
                owner.response_done(head, False)
                return
            reader = self.reader = ResponseReader(self.pool.response_heads)
        reader.close = owner.close_after
        try:
            out = reader.feed(data)
        except HttpError as exc:
            self._failed(owner, reader, exc.message)
            return
        if out and owner.transport is not None:
            owner.transport.write(out)
        if reader.done:
            assert reader.head is not None
            self.expecting = False
            owner.response_done(reader.head, reader.extra)

    def _remember(self, data: bytes, head: ResponseHead) -> None:
        """``data`` is one whole response with this head (so its body is ``head.content_length`` bytes)."""
        assert head.content_length is not None
        self.whole_size, self.whole_head, self.whole = len(data), data[: len(data) - head.content_length], head

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        owner, expecting = self.owner, self.expecting
        self.closed, self.owner, self.expecting = True, None, False
        self.pool.forget(self)
        if owner is None:
            return
        owner.upstream_lost(self)
        if not expecting:
            return  # it was idle: the next request opens a new one
        reader = self.reader or ResponseReader(self.pool.response_heads)
        if reader.eof():
            assert reader.head is not None
            owner.close_after = True  # a response delimited by the close: its head told the client so
            owner.response_done(reader.head, False)
        else:
            self._failed(owner, reader, f"connection to Triton lost: {exc or 'closed'}")

    def pause_writing(self) -> None:
        if self.owner is not None:
            self.owner.pause(UPSTREAM_FULL)

    def resume_writing(self) -> None:
        if self.owner is not None:
            self.owner.unpause(UPSTREAM_FULL)

    def _failed(self, owner: UpstreamOwner, reader: ResponseReader, message: str) -> None:
        self.pool.failed(message)
        self.close()
        owner.upstream_lost(self)
        owner.response_failed(answered=reader.head is not None)


class Orphan:
    """The owner of a response whose client has left (see :meth:`Upstream.orphan`)."""

    transport: asyncio.Transport | None = None  # the response's bytes go nowhere
    close_after = False

    def __init__(self, upstream: Upstream, on_done: Callable[[], object]) -> None:
        self.upstream = upstream
        self.on_done: Callable[[], object] | None = on_done

    def pause(self, reason: int) -> None:
        pass

    def unpause(self, reason: int) -> None:
        pass

    def response_done(self, head: ResponseHead, extra: bool) -> None:
        self._done()
        if head.close or extra:
            self.upstream.close()
        else:
            self.upstream.pool.give(self.upstream)

    def response_failed(self, *, answered: bool) -> None:
        self._done()

    def unavailable(self) -> None:
        self._done()

    def upstream_lost(self, upstream: Upstream) -> None:
        pass

    def _done(self) -> None:
        on_done, self.on_done = self.on_done, None
        if on_done is not None:
            on_done()


class UpstreamPool:
    """Opens connections to Triton and keeps a few idle ones for the next client connection. Failures to
    reach Triton are counted, and logged once per outage. ``response_heads`` holds the parsed heads of
    Triton's responses by their bytes (a memo shared by every upstream)."""

    def __init__(self, host: str, port: int, timeout_s: float, state: ProxyState) -> None:
        self.host = host
        self.port = port
        self.timeout_s = timeout_s
        self.state = state
        self.response_heads: dict[bytes, ResponseHead] = {}
        self.idle: list[Upstream] = []
        self.down = False  # the last attempt failed (logged once per outage)
        self._connecting: set[asyncio.Task[None]] = set()

    def attach(self, owner: UpstreamOwner) -> Upstream:
        """An upstream for ``owner``: an idle one, or a new one that is connecting (see :data:`CONNECTING`)."""
        while self.idle:
            upstream = self.idle.pop()
            if not upstream.closed:
                upstream.owner = owner
                return upstream
        upstream = Upstream(self, owner)
        task = asyncio.get_running_loop().create_task(self._connect(upstream))
        self._connecting.add(task)
        task.add_done_callback(self._connecting.discard)
        return upstream

    def give(self, upstream: Upstream) -> None:
        """Back to the pool after a complete exchange (or closed, if the pool is full)."""
        upstream.owner = None
        if upstream.closed:
            return
        if len(self.idle) >= IDLE_UPSTREAMS or upstream.expecting:
            upstream.close()
            return
        upstream.resume_reading()
        self.idle.append(upstream)

    def forget(self, upstream: Upstream) -> None:
        if upstream in self.idle:
            self.idle.remove(upstream)

    def failed(self, message: str) -> None:
        self.state.metrics.upstream_error(PROTOCOL)
        if not self.down:
            self.down = True
            logger.warning("%s; answering 503 until it is back", message)

    def close(self) -> None:
        for task in list(self._connecting):
            task.cancel()
        for upstream in list(self.idle):
            upstream.close()
        self.idle.clear()

    async def _connect(self, upstream: Upstream) -> None:
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(loop.create_connection(lambda: upstream, self.host, self.port), self.timeout_s)
        except (OSError, asyncio.TimeoutError) as exc:
            self.failed(f"cannot connect to Triton at {self.host}:{self.port}: {str(exc) or 'timed out'}")
            owner = upstream.owner
            upstream.close()
            if owner is not None:
                owner.upstream_lost(upstream)
                owner.unavailable()
            return
        if self.down:
            self.down = False
            logger.info("Triton at %s:%d is reachable again", self.host, self.port)
