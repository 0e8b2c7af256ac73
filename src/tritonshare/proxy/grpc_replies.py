"""The gRPC responses the proxy writes itself: refusals and the probes (readiness, liveness).

Every header block here is static-table references and never-indexed literals (:func:`encode_plain`), so
the client's decoder table — which mirrors Triton's encoder — is left exactly as it was (REFERENCE §6).
"""

from __future__ import annotations

import urllib.parse

from tritonshare.proxy import http2
from tritonshare.proxy.hpack_codec import Header, encode_plain
from tritonshare.proxy.policy import GRPC_OK

# Metrics labels of gRPC status codes (grpc/doc/statuscodes.md), and of their ``grpc-status`` values.
STATUS_NAMES: dict[int, str] = {
    0: "ok",
    1: "cancelled",
    2: "unknown",
    3: "invalid_argument",
    4: "deadline_exceeded",
    5: "not_found",
    6: "already_exists",
    7: "permission_denied",
    8: "resource_exhausted",
    9: "failed_precondition",
    10: "aborted",
    11: "out_of_range",
    12: "unimplemented",
    13: "internal",
    14: "unavailable",
    15: "data_loss",
    16: "unauthenticated",
}
STATUS_LABELS: dict[bytes, str] = {str(code).encode(): name for code, name in STATUS_NAMES.items()}

_RESPONSE_HEADERS: tuple[Header, ...] = ((b":status", b"200"), (b"content-type", b"application/grpc"))
_MESSAGE_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")  # gRPC percent-encoding

# Probe answers by route: the response message for (no, yes). ServerLiveResponse{bool live = 1};
# ServerReadyResponse{bool ready = 1}; grpc.health.v1.HealthCheckResponse{status = 1: SERVING=1, NOT_SERVING=2}.
PROBE_MESSAGES: dict[str, tuple[bytes, bytes]] = {
    "ServerLive": (b"", b"\x08\x01"),
    "ServerReady": (b"", b"\x08\x01"),
    "HealthCheck": (b"\x08\x02", b"\x08\x01"),
}


def status_block(status: int, message: str, *, headers_sent: bool, pushback_ms: int | None = None) -> bytes:
    """The header block that ends a stream with ``status``: trailers after response headers, or a
    trailers-only response when nothing was sent on the stream yet. ``pushback_ms``: when the client's
    retry policy may retry (``grpc-retry-pushback-ms``, gRFC A6)."""
    fields: list[Header] = [] if headers_sent else list(_RESPONSE_HEADERS)
    fields.append((b"grpc-status", str(status).encode()))
    if message:
        fields.append((b"grpc-message", urllib.parse.quote(message, safe=_MESSAGE_SAFE).encode()))
    if pushback_ms is not None:
        fields.append((b"grpc-retry-pushback-ms", str(pushback_ms).encode()))
    return encode_plain(fields)


def refusal(
    stream_id: int, status: int, message: str, *, headers_sent: bool = False, pushback_ms: int | None = None
) -> bytes:
    """Frames that end stream ``stream_id`` with a gRPC error status."""
    block = status_block(status, message, headers_sent=headers_sent, pushback_ms=pushback_ms)
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
