"""The gRPC responses the proxy writes itself: refusals and the own model's readiness.

Every header block here is static-table references and never-indexed literals (:func:`encode_plain`), so
the client's decoder table — which mirrors Triton's encoder — is left exactly as it was (REFERENCE §6).
"""

from __future__ import annotations

import urllib.parse

from tritonshare.proxy import http2
from tritonshare.proxy.hpack_codec import Header, encode_plain
from tritonshare.proxy.policy import (
    GRPC_INTERNAL,
    GRPC_INVALID_ARGUMENT,
    GRPC_NOT_FOUND,
    GRPC_OK,
    GRPC_PERMISSION_DENIED,
    GRPC_RESOURCE_EXHAUSTED,
    GRPC_UNAVAILABLE,
    GRPC_UNIMPLEMENTED,
)

# Metrics labels of the gRPC statuses the proxy answers with.
STATUS_NAMES: dict[int, str] = {
    GRPC_OK: "ok",
    GRPC_INVALID_ARGUMENT: "invalid_argument",
    GRPC_NOT_FOUND: "not_found",
    GRPC_PERMISSION_DENIED: "permission_denied",
    GRPC_RESOURCE_EXHAUSTED: "resource_exhausted",
    GRPC_UNIMPLEMENTED: "unimplemented",
    GRPC_INTERNAL: "internal",
    GRPC_UNAVAILABLE: "unavailable",
}

_RESPONSE_HEADERS: tuple[Header, ...] = ((b":status", b"200"), (b"content-type", b"application/grpc"))
_MESSAGE_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")  # gRPC percent-encoding

# Readiness answers by route: the response message for (not ready, ready).
# ServerReadyResponse{bool ready = 1}; grpc.health.v1.HealthCheckResponse{status = 1: SERVING=1, NOT_SERVING=2}.
READINESS_MESSAGES: dict[str, tuple[bytes, bytes]] = {
    "ServerReady": (b"", b"\x08\x01"),
    "HealthCheck": (b"\x08\x02", b"\x08\x01"),
}


def status_block(status: int, message: str, *, headers_sent: bool) -> bytes:
    """The header block that ends a stream with ``status``: trailers after response headers, or a
    trailers-only response when nothing was sent on the stream yet."""
    fields: list[Header] = [] if headers_sent else list(_RESPONSE_HEADERS)
    fields.append((b"grpc-status", str(status).encode()))
    if message:
        fields.append((b"grpc-message", urllib.parse.quote(message, safe=_MESSAGE_SAFE).encode()))
    return encode_plain(fields)


def refusal(stream_id: int, status: int, message: str, *, headers_sent: bool = False) -> bytes:
    """Frames that end stream ``stream_id`` with a gRPC error status."""
    block = status_block(status, message, headers_sent=headers_sent)
    return http2.header_frames(stream_id, block, end_stream=True)


def unary_response(stream_id: int, message: bytes) -> tuple[bytes, int]:
    """Frames of a successful unary response carrying ``message``, and the DATA bytes among them (they
    count against the client's flow-control window)."""
    payload = b"\x00" + len(message).to_bytes(4, "big") + message
    frames = (
        http2.header_frames(stream_id, encode_plain(_RESPONSE_HEADERS), end_stream=False)
        + http2.frame(http2.DATA, 0, stream_id, payload)
        + http2.header_frames(stream_id, status_block(GRPC_OK, "", headers_sent=True), end_stream=True)
    )
    return frames, len(payload)
