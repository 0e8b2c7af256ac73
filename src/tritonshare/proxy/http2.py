"""HTTP/2 framing (RFC 7540 §4, §6): frame constants, 9-byte header parsing and the few frames the gRPC
relay writes itself. No state machine and no HPACK here: the relay passes other frames through as bytes.
"""

from __future__ import annotations

import struct

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"  # what a client sends before its first frame (§3.5)
HEADER_SIZE = 9
DEFAULT_MAX_FRAME_SIZE = 16_384  # every peer accepts frames this large (§6.5.2)
MAX_WINDOW_INCREMENT = 0x7FFF_FFFF

# Frame types (§6).
DATA = 0x0
HEADERS = 0x1
PRIORITY = 0x2
RST_STREAM = 0x3
SETTINGS = 0x4
PUSH_PROMISE = 0x5
PING = 0x6
GOAWAY = 0x7
WINDOW_UPDATE = 0x8
CONTINUATION = 0x9

# Flags.
END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20

# Error codes (§7).
NO_ERROR = 0x0
PROTOCOL_ERROR = 0x1
INTERNAL_ERROR = 0x2
FRAME_SIZE_ERROR = 0x6
REFUSED_STREAM = 0x7
CANCEL = 0x8
COMPRESSION_ERROR = 0x9
ENHANCE_YOUR_CALM = 0xB

# SETTINGS parameters (§6.5.2).
SETTINGS_MAX_CONCURRENT_STREAMS = 0x3
SETTINGS_MAX_FRAME_SIZE = 0x5

# Length (24 bits, as 8 + 16), type, flags, stream id (mask the reserved bit: & STREAM_ID_MASK). Hot loops
# unpack with it directly; elsewhere use parse_header.
FRAME_HEADER = struct.Struct(">BHBBL")
STREAM_ID_MASK = 0x7FFF_FFFF
U32 = struct.Struct(">L")  # a frame's 32-bit fields; a gRPC message's length
_GOAWAY = struct.Struct(">LL")
_SETTING = struct.Struct(">HL")


class FrameError(Exception):
    """A peer sent bytes that are not valid HTTP/2 framing, or went past a limit; the connection cannot go on.
    ``code``: the error code of the GOAWAY that ends it."""

    def __init__(self, message: str, code: int = PROTOCOL_ERROR) -> None:
        super().__init__(message)
        self.code = code


def parse_header(buf: bytes | bytearray | memoryview, pos: int) -> tuple[int, int, int, int]:
    """(payload length, type, flags, stream id) of the frame header at ``buf[pos:pos + 9]``."""
    high, low, kind, flags, stream_id = FRAME_HEADER.unpack_from(buf, pos)
    return (high << 16) | low, kind, flags, stream_id & STREAM_ID_MASK


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    length = len(payload)
    return FRAME_HEADER.pack(length >> 16, length & 0xFFFF, kind, flags, stream_id) + payload


def rst_stream(stream_id: int, error_code: int) -> bytes:
    return frame(RST_STREAM, 0, stream_id, U32.pack(error_code))


def end_stream(stream_id: int) -> bytes:
    """An empty DATA frame ending the sender's side of a stream."""
    return frame(DATA, END_STREAM, stream_id)


def ping_ack(payload: bytes) -> bytes:
    """The answer to a PING (its 8 opaque bytes, echoed)."""
    return frame(PING, ACK, 0, payload)


def window_update(stream_id: int, increment: int) -> bytes:
    """WINDOW_UPDATE frames for ``increment`` bytes (split when it exceeds the 31-bit maximum)."""
    out = []
    while increment > 0:
        step = min(increment, MAX_WINDOW_INCREMENT)
        out.append(frame(WINDOW_UPDATE, 0, stream_id, U32.pack(step)))
        increment -= step
    return b"".join(out)


def window_increment(payload: bytes | memoryview) -> int:
    return int(U32.unpack_from(payload, 0)[0]) & 0x7FFF_FFFF


def goaway(last_stream_id: int, error_code: int = NO_ERROR) -> bytes:
    return frame(GOAWAY, 0, 0, _GOAWAY.pack(last_stream_id, error_code))


def goaway_last_stream(payload: bytes | memoryview) -> int:
    return int(U32.unpack_from(payload, 0)[0]) & 0x7FFF_FFFF


def settings(pairs: dict[int, int] | None = None) -> bytes:
    payload = b"".join(_SETTING.pack(key, value) for key, value in (pairs or {}).items())
    return frame(SETTINGS, 0, 0, payload)


def settings_pairs(payload: bytes | memoryview) -> dict[int, int]:
    """The parameters of a SETTINGS frame payload, in order (a parameter given twice: its last value)."""
    if len(payload) % _SETTING.size:
        raise FrameError(f"SETTINGS payload of {len(payload)} bytes is not a multiple of 6", FRAME_SIZE_ERROR)
    return dict(_SETTING.iter_unpack(payload))


SETTINGS_ACK = frame(SETTINGS, ACK, 0)


def header_block_fragment(flags: int, payload: bytes | memoryview) -> bytes | memoryview:
    """The header block fragment of a HEADERS frame payload, without padding and priority fields."""
    start, end = 0, len(payload)
    if flags & PADDED:
        if end < 1 or payload[0] >= end:
            raise FrameError("HEADERS padding is longer than the frame")
        end -= payload[0]
        start = 1
    if flags & PRIORITY_FLAG:
        start += 5
    if start > end:
        raise FrameError("HEADERS frame too short for its priority fields")
    return payload[start:end]


def data_content(flags: int, payload: bytes | memoryview) -> tuple[int, int]:
    """(start, end) of the application data inside a DATA frame payload (padding removed)."""
    if not flags & PADDED:
        return 0, len(payload)
    if not payload or payload[0] >= len(payload):
        raise FrameError("DATA padding is longer than the frame")
    return 1, len(payload) - payload[0]


def header_frames(
    stream_id: int, block: bytes, *, end_stream: bool, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
) -> bytes:
    """A header block as HEADERS (+ CONTINUATION) frames of at most ``max_frame_size`` bytes."""
    first_flags = END_STREAM if end_stream else 0
    chunks = [block[i : i + max_frame_size] for i in range(0, len(block), max_frame_size)] or [b""]
    out = []
    for index, chunk in enumerate(chunks):
        flags = END_HEADERS if index == len(chunks) - 1 else 0
        out.append(
            frame(HEADERS if index == 0 else CONTINUATION, flags | (first_flags if index == 0 else 0), stream_id, chunk)
        )
    return b"".join(out)
