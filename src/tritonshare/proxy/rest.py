"""The REST front end: a byte-level HTTP/1.1 forwarder on asyncio (uvloop) protocols, no framework.

Per request: the head is parsed strictly (:mod:`tritonshare.proxy.http1`), judged by the policy table
(:func:`tritonshare.proxy.policy.judge_rest`), and either answered here or forwarded as a head rebuilt from
the canonical path and the client's end-to-end headers, so Triton parses exactly what was judged. Infer bodies
are held only until their JSON part is checked (:mod:`tritonshare.proxy.inspect`); the rest of a body, and the
whole response, pass through as bytes, as they arrive (server-sent events of ``generate_stream`` included).

The pieces: :class:`RestFrontend` here listens (with TLS when configured, ALPN http/1.1; a plain HTTP request on
the TLS port gets 400 saying to use https://, :mod:`tritonshare.proxy.plaintext`), keeps the memo of
judged heads and the timeout sweep; each client connection is a
:class:`~tritonshare.proxy.rest_connection.ClientConnection` (the short path, flow control, timeouts; the general
path of requests, with authentication, admission control and answers, in :mod:`tritonshare.proxy.rest_requests`),
whose :class:`~tritonshare.proxy.rest_upstream.Upstream` is its connection to Triton (1:1, with a
small pool of idle ones shared by the front end). Back-pressure both ways: reading from one side
pauses while the other side's write buffer is full, so a large tensor streams through in bounded memory.

Cost per request is what a sidecar per model pod is judged by (issue 4: nginx-class CPU), so the common case
is short: a whole request in one read, its head seen before, goes to Triton in one write, and a response that
comes whole goes back untouched. Heads are parsed and judged once, memoised by their exact bytes (parsing and
judging are pure functions of them), and the memo also records whether a head may take that short path; per
request only the drain state, the body length and the shared-memory marker are looked at. With admission
control or a rate limit on, a request they cover stays on the short path when it can take its slot (or its
rate-limit token) at once; one that must wait for a slot, or is refused, takes the general path, which queues,
refuses and counts (:meth:`~tritonshare.proxy.rest_connection.ClientConnection._gates_open`). With
authentication on, a head whose bearer token was found valid keeps that verdict stamped with the token file's
generation (:attr:`Judged.verified`): every request compares the stamp with the generation in force, after the
file is looked at as every check does, so a reload that drops the token refuses the next request; a head never
found valid takes the general path, which checks it in full and refuses it.
"""

from __future__ import annotations

import asyncio
import logging
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from tritonshare.common.errors import cannot_listen
from tritonshare.proxy import admission, auth, plaintext
from tritonshare.proxy.http1 import RequestHead, error_response, parse_request_head, upstream_head
from tritonshare.proxy.metrics import RouteMeter
from tritonshare.proxy.overload import Closed, TurnedAway, has_room, over_cap_message
from tritonshare.proxy.policy import RestDecision, Verdict, judge_rest
from tritonshare.proxy.readiness import TritonProbe
from tritonshare.proxy.request_body import body_too_large
from tritonshare.proxy.rest_connection import ClientConnection
from tritonshare.proxy.rest_requests import WHOLE_BODY_BYTES
from tritonshare.proxy.rest_upstream import PROTOCOL, UpstreamPool
from tritonshare.proxy.state import ProxyState, listening_port
from tritonshare.proxy.tls import Handshakes

logger = logging.getLogger(__name__)

# A request head must be complete this long after its first byte arrived (a connection's first head: after the
# connection was accepted, so a silent one is closed then, as gRPC's are, grpc_opening.SILENT_TIMEOUT_S).
HEADER_TIMEOUT_S = 30.0
# A keep-alive connection without a request for this long is closed: nginx's keepalive_timeout, which HTTP
# clients' pools are made to live with. Each idle connection holds a place under --max-connections.
IDLE_TIMEOUT_S = 75.0
_SWEEP_S = 1.0  # how often the timeouts are checked
_HEAD_MEMO = 512  # judged heads kept
_MEMO_HEAD_BYTES = 4096  # longer heads are not memoised


@dataclass(frozen=True, slots=True)
class HeadRules:
    """What judging a head depends on besides its bytes; fixed for the life of the front end."""

    own: str
    strip: frozenset[bytes]  # header names never forwarded (lower case)
    host: bytes  # Host for a request without one
    max_json_bytes: int
    max_body_bytes: int  # 0: no limit
    authenticating: bool  # --auth-token-file is set
    admitting: bool  # admission control is on
    rate_limiting: bool  # --rate-limit-rps is set: metadata routes take a token too


@dataclass(slots=True)
class Judged:
    """A request head, parsed and judged once; memoised, never changed but for ``verified`` (not frozen: see
    RequestHead)."""

    head: RequestHead
    decision: RestDecision
    route: str
    upstream: bytes  # the head for Triton (forwarded requests only)
    inspect: bool  # the body is an infer request to check
    shapes: bool  # ... and its input shapes too (the infer route: see inspect.check_shapes)
    json_length: int | None  # JSON bytes at the start of the decoded body; None: all; 0: none (raw binary)
    whole: bool  # forwarded with a plain Content-Length body: if it came with the head, one write
    limited: bool  # takes an admission slot (when admission control is on)
    metered: bool  # takes a token of the metadata bucket (when rate limiting is on)
    open: bool  # needs no bearer token (when authentication is on)
    gated: bool  # admission control, the rate limit or authentication covers it: the short path asks them first
    quick: bool  # may take the short path, given its whole body without the shared-memory marker
    length: int  # Content-Length (0 without one)
    meter: RouteMeter  # the route's request accounting
    verbatim: bool  # the head for Triton is the client's head, byte for byte: forward the client's bytes as they are
    probe: TritonProbe | None  # a probe the proxy answers itself, from what it keeps of Triton's answer
    # The token file's generation (auth.BearerTokens.current) under which this head's Authorization was found
    # valid; another generation (-1: never) means check it in full. Only these exact bytes carry that token.
    verified: int = -1


def judge_head(
    raw: bytes,
    rules: HeadRules,
    meter_of: Callable[[str], RouteMeter],
    decisions: dict[tuple[str, str], RestDecision] | None = None,
    probes: Mapping[Verdict, TritonProbe] | None = None,
) -> Judged:
    """Parse a request head (raises :class:`~tritonshare.proxy.http1.HttpError`), judge it, and build what
    forwarding it needs, with the route's meter from ``meter_of``. ``decisions`` memoises the policy's verdicts
    by method and target (heads that differ only in other headers, such as a request id a mesh adds, then skip
    the policy's path parsing). ``probes``: what the verdicts the proxy answers itself (READY, LIVE) are answered
    from; without them those requests are forwarded. A Content-Length over ``rules.max_body_bytes`` is judged a
    413 (Triton would hold the body whole): never quick, never forwarded."""
    head = parse_request_head(raw, rules.strip)
    key = (head.method, head.target)
    decision = decisions.get(key) if decisions is not None else None
    if decision is None:
        decision = judge_rest(head.method, head.target, rules.own)
        if decisions is not None:
            if len(decisions) >= _HEAD_MEMO:
                decisions.clear()
            decisions[key] = decision
    route, length = decision.route, head.content_length or 0
    limited, open_ = route in admission.LIMITED_ROUTES, route in auth.OPEN_REST_ROUTES
    metered = route in admission.METADATA_ROUTES
    meter = meter_of(route)
    if not decision.status and rules.max_body_bytes and length > rules.max_body_bytes:
        decision = RestDecision(413, route, body_too_large(rules.max_body_bytes))
    if decision.status:
        return Judged(
            head, decision, route, b"", False, False, None, False, limited, metered, open_, False, False, length,
            meter, False, None,
        )  # fmt: skip
    probe = probes.get(decision.rule.verdict) if probes is not None and decision.rule is not None else None
    inspect = decision.rule is not None and decision.rule.inspect and head.has_body
    # Only infer has the binary-tensor extension: generate parses the whole body, whatever the header says.
    json_length = head.inference_header_length if route == "infer" else None
    whole = head.content_length is not None and not (inspect and head.content_encoding)
    quick = (
        whole
        and head.keep_alive
        and not head.expect_continue
        and length <= WHOLE_BODY_BYTES
        and not (inspect and (length > rules.max_json_bytes or (json_length or 0) > length))
        and probe is None
    )
    gated = (limited and rules.admitting) or (metered and rules.rate_limiting) or (rules.authenticating and not open_)
    upstream = upstream_head(head, decision.upstream_path, rules.host)
    verbatim = upstream == raw + b"\r\n\r\n"
    return Judged(
        head, decision, route, upstream, inspect, inspect and route == "infer", json_length, whole, limited, metered,
        open_, gated, quick, length, meter, verbatim, probe,
    )  # fmt: skip


class RestFrontend:
    """Listens on ``settings.http_port``; one :class:`ClientConnection` per client connection.

    ``header_timeout_s`` and ``idle_timeout_s`` bound how long a connection may take to send a request head
    (else 408 and close; a connection that sends nothing at all is closed) and stay idle between requests (then
    it is closed)."""

    protocol = PROTOCOL

    def __init__(
        self, state: ProxyState, *, header_timeout_s: float = HEADER_TIMEOUT_S, idle_timeout_s: float = IDLE_TIMEOUT_S
    ) -> None:
        self.state = state
        settings = state.settings
        url = urllib.parse.urlsplit(settings.triton_url)
        strip = {name.lower().encode() for name in settings.strip_headers}
        if state.auth is not None:
            strip.add(b"authorization")  # the tenant's token is for the proxy, not for Triton
        self.rules = HeadRules(
            own=state.own,
            strip=frozenset(strip),
            host=url.netloc.encode(),
            max_json_bytes=settings.max_json_bytes,
            max_body_bytes=settings.max_body_bytes,
            authenticating=state.auth is not None,
            admitting=state.admission.active,
            rate_limiting=state.admission.rate_limited,
        )
        self.max_header_bytes = settings.max_header_bytes
        self.header_timeout_s = header_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.pool = UpstreamPool(url.hostname or "127.0.0.1", url.port or 80, settings.connect_timeout_s, state)
        self.connections: set[ClientConnection] = set()
        state.metrics.count_connections(PROTOCOL, self.connections.__len__)
        self.handshakes: Handshakes | None = None
        self.heads: dict[bytes, Judged] = {}
        self.decisions: dict[tuple[str, str], RestDecision] = {}
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.TimerHandle | None = None
        self._port = 0

    @property
    def port(self) -> int:
        if not self._port:
            raise RuntimeError("the REST front end is not listening; call start() first")
        return self._port

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        settings = self.state.settings
        if self.state.tls is not None:  # TLS is put on in _accept, where its handshakes are counted
            self.handshakes = Handshakes(self.state.tls.server_context(PROTOCOL), plain_text=self._plain_text)
        try:
            self._server = await loop.create_server(
                self._accept, settings.host, settings.http_port, backlog=1024, reuse_address=True
            )
        except OSError as exc:
            raise cannot_listen("REST", settings.host, settings.http_port, "--http-port", exc) from exc
        self._port = listening_port(self._server)
        self._sweeper = loop.call_later(_SWEEP_S, self._sweep)

    def stop_accepting(self) -> None:
        if self._server is not None:
            self._server.close()

    def _accept(self) -> asyncio.BaseProtocol:
        """A new client connection, or, past ``--max-connections``, a 503 (:mod:`tritonshare.proxy.overload`)."""
        cap = self.state.settings.max_connections
        tls = self.handshakes
        if has_room(cap, len(self.connections), tls):
            return ClientConnection(self) if tls is None else tls.behind_tls(ClientConnection(self))
        self.state.metrics.refused(PROTOCOL, "connection", "too_many_connections")
        if tls is not None:
            return Closed()
        message = over_cap_message(self.state.own, cap)
        return TurnedAway(error_response(503, message, close=True, headers=b"Retry-After: 1\r\n"))

    def _plain_text(self, first: bytes) -> asyncio.Protocol | None:
        """A connection to the TLS port whose first bytes are not TLS: a plain HTTP request gets 400 saying so
        (:mod:`tritonshare.proxy.plaintext`); other bytes are left to TLS, which closes the connection."""
        return plaintext.answer_http1(first, plaintext.REST_ANSWER, self.state.metrics, PROTOCOL)

    def begin_drain(self) -> None:
        for connection in list(self.connections):
            connection.drain()

    def abort(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for connection in list(self.connections):
            connection.abort()
        self.pool.close()

    def judge(self, raw: bytes) -> Judged:
        """Parse and judge a request head (raises :class:`~tritonshare.proxy.http1.HttpError`); memoised by
        the head's bytes."""
        judged = self.heads.get(raw)
        if judged is None:
            judged = judge_head(raw, self.rules, self._meter, self.decisions, self.state.probes)
            if len(raw) <= _MEMO_HEAD_BYTES:
                if len(self.heads) >= _HEAD_MEMO:
                    self.heads.clear()
                self.heads[raw] = judged
        return judged

    def _meter(self, route: str) -> RouteMeter:
        return self.state.metrics.meter(PROTOCOL, route)

    def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        try:
            for connection in list(self.connections):
                connection.expire(now)
        finally:  # a failure is the loop's to log; it must not switch every timeout off
            self._sweeper = loop.call_later(_SWEEP_S, self._sweep)
