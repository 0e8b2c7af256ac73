"""The gRPC front end: a 1:1 HTTP/2 frame relay between each client connection and one Triton connection.

Why a relay and not a gRPC server plus client: terminating HTTP/2 (grpcio, or the ``h2`` library) costs
4-9× nginx's CPU per request here (shared/bench/README.md); a relay that parses only what the policy
needs stays within reach of nginx. Each client connection gets its own connection to Triton, so stream
ids, SETTINGS, PING and WINDOW_UPDATE keep their meaning and pass through as bytes (REFERENCE §6).

Client → Triton (:mod:`tritonshare.proxy.grpc_connection`): frames are parsed; each header block is
HPACK-decoded in order by a decoder whose table mirrors the client's encoder (Triton's decoder sees the
same bytes, so the two stay in step) to read ``:path``, which the policy table judges
(:mod:`tritonshare.proxy.policy`, acted on by :mod:`tritonshare.proxy.grpc_verdicts`):

- ALLOW / OWN: the stream is forwarded. For OWN, every request message is walked as it streams by
  (:mod:`tritonshare.proxy.grpc_messages`, :mod:`tritonshare.proxy.protobuf`); the frame that completes a
  message is forwarded only once the message names the own model (field 1) and, for infer requests, no
  shared-memory parameter. A refused message's last frame never reaches Triton: the stream is reset there
  (RST_STREAM CANCEL) and the client gets the refusal status. A connection remembers the shape of its last
  clean message (leading fields, last field's header): a message of the same shape is judged with one
  comparison, whatever its tensor contents.
- READY / LIVE: answered here from the own model's readiness / Triton's liveness as the proxy keeps them (one
  question to Triton a second, whatever the rate of calls); DENY / unknown: answered here with
  PERMISSION_DENIED / UNIMPLEMENTED (:mod:`tritonshare.proxy.grpc_answers`). Triton never sees these
  streams, so their later frames are dropped (a stream frame for an idle stream is a connection error for
  Triton), client DATA is credited back with a connection WINDOW_UPDATE, and the DATA bytes of local
  answers are subtracted from the client's next connection WINDOW_UPDATEs to Triton (they were never
  Triton's to credit; the client's frames other than DATA and header blocks:
  :mod:`tritonshare.proxy.grpc_control`).
- A dropped header block that changed the client's table (incremental indexing, size update) would put
  Triton's table out of step: from then on the connection is in re-encode mode, where every forwarded
  block is decoded and re-encoded without indexing (:func:`encode_plain`). The same mode strips
  ``settings.strip_headers`` (Triton's restricted-API header keys) from every block.
- Compressed messages (grpc-encoding gzip or deflate) are decompressed to be walked, and forwarded as
  they came; other encodings are refused with UNIMPLEMENTED.

Triton → client (:mod:`tritonshare.proxy.grpc_upstream`): bytes pass through untouched; frame headers
are read, and header blocks decoded (cached) for ``grpc-status``. Triton's connection opens with the
client's first bytes (:mod:`tritonshare.proxy.grpc_opening`); when Triton cannot be reached, the proxy
answers as a minimal HTTP/2 server: each stream gets UNAVAILABLE, then GOAWAY; the next connection tries
Triton again. Upstream dying mid-connection closes the client's connection. A call the client gives up (its
RST_STREAM, its deadline, its connection gone) is not cancelled at Triton but left to end there, its answer
dropped (:mod:`tritonshare.proxy.grpc_abandon`: Triton before 24.12 can crash on a cancellation).

Access and fairness (issue 9; each off unless its option is given):

- ``--auth-token-file``: a new stream's ``authorization`` metadata must carry a valid bearer token, checked
  after its ``:path`` is judged and before the verdict is acted on (so a caller without one learns nothing
  about methods: UNAUTHENTICATED); the probes (ServerLive, ServerReady, Health/Check) stay open. The header
  is not passed on (the tenant's token is for the proxy, not for the Triton all tenants share), so header
  blocks are re-encoded (the last one's encoding kept: a client repeats its blocks).
- ``--max-inflight`` / ``--rate-limit-rps``: each inference stream takes an admission slot or waits for one
  without Triton starting it (:mod:`tritonshare.proxy.grpc_admission`); refused: RESOURCE_EXHAUSTED with
  ``grpc-retry-pushback-ms``, and the stream is reset at Triton.
- ``--tls-cert`` / ``--tls-key``: the listening socket speaks TLS (ALPN ``h2``), the certificate reloaded
  on change for new connections (:mod:`tritonshare.proxy.tls`); Triton is reached in plain text, on the
  node. A client speaking HTTP/2 in plain text to it (an insecure channel) has each call answered UNAVAILABLE
  saying to use a secure channel (:mod:`tritonshare.proxy.plaintext`), before any check of the call (its token
  included), as a connection past ``--max-connections`` is.

Limits per client connection (what one tenant may cost the proxy and the shared Triton): a frame longer than
Triton's SETTINGS_MAX_FRAME_SIZE (16 KiB until Triton's SETTINGS pass) is refused at its header with GOAWAY
FRAME_SIZE_ERROR, before it is held; a header block is held to ``max_header_bytes`` and 32 CONTINUATION frames
(more: ENHANCE_YOUR_CALM); ``grpc_max_streams`` (128) forwarded streams may be open at once — added to Triton's
SETTINGS as MAX_CONCURRENT_STREAMS, one more is refused with REFUSED_STREAM; streams ended early (the client's
RST_STREAM, a refused message) take from a budget of 1000 refilled at 100 a second, past which the connection
ends with GOAWAY ENHANCE_YOUR_CALM (HTTP/2 rapid reset, CVE-2023-44487); while the proxy's writes to the client
back up, the client is not read either (its refusals and window credits cannot pile up); a connection with no
stream open for ``grpc_idle_timeout_s`` (300 s) gets GOAWAY NO_ERROR and is closed, freeing its Triton connection.

Accounting (:class:`ProxyState`): a forwarded stream is in flight from its HEADERS until Triton's trailers
(code = their grpc-status, e.g. ``ok``, ``invalid_argument``), a RST_STREAM (``reset`` by Triton,
``cancelled`` by the client) or the connection's end (``closed``); refusals carry the proxy's status
(``not_found``, ``permission_denied``, ...). Draining sends GOAWAY naming the last stream seen: open streams
finish, newer ones are refused (REFUSED_STREAM, which clients retry elsewhere), and the connection closes
once idle.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from tritonshare.common.errors import cannot_listen
from tritonshare.proxy import plaintext
from tritonshare.proxy.grpc_connection import ClientConnection
from tritonshare.proxy.grpc_opening import OpenUpstream
from tritonshare.proxy.grpc_streams import PROTOCOL
from tritonshare.proxy.grpc_upstream import UpstreamConnection
from tritonshare.proxy.grpc_verdicts import Unavailable
from tritonshare.proxy.overload import Closed, has_room, over_cap_message
from tritonshare.proxy.state import ProxyState, listening_port
from tritonshare.proxy.tls import Handshakes

_PLAIN_TEXT = Unavailable(plaintext.GRPC_HINT, plaintext.REASON, turned_away=True)


class GrpcFrontend:
    """Listens for gRPC clients and relays each connection to Triton's gRPC port."""

    protocol = PROTOCOL

    def __init__(self, state: ProxyState, *, open_upstream: OpenUpstream | None = None) -> None:
        self._state = state
        self.upstream_address = state.settings.triton_grpc
        host, _, port = self.upstream_address.rpartition(":")
        self._upstream = (host.strip("[]") or "127.0.0.1", int(port))
        self.open_upstream: OpenUpstream = open_upstream or self._open_upstream
        self._server: asyncio.Server | None = None
        self.connections: set[ClientConnection] = set()
        state.metrics.count_connections(PROTOCOL, self.connections.__len__)
        self.handshakes: Handshakes | None = None
        self.draining = False

    @property
    def port(self) -> int:
        return listening_port(self._server) or self._state.settings.grpc_port

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        settings = self._state.settings
        if self._state.tls is not None:  # ALPN h2; put on in _accept, where its handshakes are counted
            self.handshakes = Handshakes(self._state.tls.server_context(PROTOCOL), plain_text=self._plain_text)
        try:
            self._server = await loop.create_server(self._accept, settings.host, settings.grpc_port, reuse_address=True)
        except OSError as exc:
            raise cannot_listen("gRPC", settings.host, settings.grpc_port, "--grpc-port", exc) from exc

    def stop_accepting(self) -> None:
        if self._server is not None:
            self._server.close()

    def _accept(self) -> asyncio.BaseProtocol:
        """A new client connection; past ``--max-connections`` one that answers UNAVAILABLE and goes away, or,
        with TLS, is closed at once (:mod:`tritonshare.proxy.overload`)."""
        cap = self._state.settings.max_connections
        tls = self.handshakes
        if has_room(cap, len(self.connections), tls):
            connection = ClientConnection(self, self._state)
            return connection if tls is None else tls.behind_tls(connection)
        if tls is not None:
            self._state.metrics.refused(PROTOCOL, "connection", "too_many_connections")
            return Closed()
        why = Unavailable(over_cap_message(self._state.own, cap), "too_many_connections", turned_away=True)
        return ClientConnection(self, self._state, turned_away=why)

    def _plain_text(self, first: bytes) -> asyncio.Protocol | None:
        """A connection to the TLS port whose first bytes are not TLS: HTTP/2 in plain text (an insecure channel)
        is answered as a connection turned away, each stream UNAVAILABLE saying why (a GOAWAY at once, before
        any stream, would show grpcio users "Deadline Exceeded" after it reconnected in a loop); a plain HTTP/1.x
        request (curl http://) gets 400 saying the port speaks gRPC over TLS, as REST's port answers it; other
        bytes are left to TLS, which closes the connection (:mod:`tritonshare.proxy.plaintext`)."""
        if plaintext.looks_like_h2c(first):  # first: its "PRI * HTTP/2.0" line starts like HTTP/1.x too
            return ClientConnection(self, self._state, turned_away=_PLAIN_TEXT)
        return plaintext.answer_http1(first, plaintext.GRPC_PORT_ANSWER, self._state.metrics, PROTOCOL)

    def begin_drain(self) -> None:
        self.draining = True
        for connection in list(self.connections):
            connection.begin_drain()

    def abort(self) -> None:
        for connection in list(self.connections):
            connection.abort()

    async def _open_upstream(self, factory: Callable[[], UpstreamConnection]) -> UpstreamConnection:
        _, protocol = await asyncio.get_running_loop().create_connection(factory, *self._upstream)
        return protocol
