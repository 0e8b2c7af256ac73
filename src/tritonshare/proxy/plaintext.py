"""What a port serving TLS tells a client that speaks plain text to it, as nginx does ("400 The plain HTTP
request was sent to HTTPS port"): closed without a word, the mistake showed as curl's "Empty reply from server"
or an opaque gRPC UNAVAILABLE.

:class:`tritonshare.proxy.tls.Handshakes` looks at a connection's first bytes only: a TLS handshake record starts
with 0x16 (whether or not the rest of the ClientHello came with it), and goes on behind TLS at once. Other bytes
are shown to the front end, which recognises the plain-text mistake of its own clients with the predicates here
and answers in their protocol: an HTTP/1.x request, on either port, with ``400`` and ``Connection: close`` saying
what the port speaks (:func:`answer_http1`: REST's :data:`REST_HINT`, gRPC's :data:`GRPC_PORT_HINT`, as a curl
to the wrong scheme or port gets), counted by route ``connection``; gRPC the HTTP/2 client preface (what an insecure
channel sends) by answering each stream UNAVAILABLE with :data:`GRPC_HINT`, before any check of the call (its
token included), counted by the call's route. What is neither goes to TLS, whose handshake fails and closes the
connection, as before. Each answer counts as a refusal with reason :data:`REASON`.
"""

from __future__ import annotations

import re

from tritonshare.proxy import http2
from tritonshare.proxy.http1 import error_response
from tritonshare.proxy.metrics import ProxyMetrics
from tritonshare.proxy.overload import TurnedAway

REASON = "plain_http_on_tls"
REST_HINT = "this port speaks TLS: use https:// (the request was sent in plain HTTP)"
GRPC_HINT = "this port speaks TLS: use a secure channel (grpc.secure_channel), not an insecure one"
GRPC_PORT_HINT = "this port speaks gRPC over TLS: use a secure gRPC channel (not plain HTTP)"
# The whole answer to a plain HTTP/1.x request on the REST port, and on the gRPC port.
REST_ANSWER = error_response(400, REST_HINT, close=True)
GRPC_PORT_ANSWER = error_response(400, GRPC_PORT_HINT, close=True)

# A request line's method (a token, RFC 9110 §5.6.2) and the space after it: what the first read of a plain
# HTTP/1.x client starts with. 0x16, TLS's first byte, is no token character.
_HTTP1_METHOD = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,32} ")
_H2_PREFACE_START = 3  # "PRI": enough of the HTTP/2 client preface to tell it


def looks_like_http1(first: bytes) -> bool:
    """Whether a connection's first bytes start an HTTP/1.x request (a method, then a space)."""
    return _HTTP1_METHOD.match(first) is not None


def looks_like_h2c(first: bytes) -> bool:
    """Whether a connection's first bytes start the HTTP/2 client preface: HTTP/2 in plain text."""
    return len(first) >= _H2_PREFACE_START and http2.PREFACE.startswith(first[: len(http2.PREFACE)])


def answer_http1(first: bytes, answer: bytes, metrics: ProxyMetrics, protocol: str) -> TurnedAway | None:
    """A connection to a TLS port whose first bytes start an HTTP/1.x request: ``answer`` written and the connection
    ended (:class:`~tritonshare.proxy.overload.TurnedAway`), counted as a refusal by route ``connection``; None
    for other bytes."""
    if not looks_like_http1(first):
        return None
    metrics.refused(protocol, "connection", REASON)
    return TurnedAway(answer)
