"""Reading what the policy needs from gRPC request messages as their bytes stream past.

A gRPC message is 1 byte compressed-flag + 4 bytes big-endian length + a protobuf message, and it may be
split across any number of HTTP/2 DATA frames. :class:`MessageInspector` follows that framing for one
request stream and walks each message's top-level protobuf fields with :class:`FieldWalker`, without
copying them: large fields such as ``raw_input_contents`` (field 7) are skipped by length.

What it reads (REFERENCE §3, §6):

- field 1 — ``model_name`` of ModelInferRequest, ``name`` of the Model*Request messages. Protobuf does
  not require field order and the last occurrence wins, so every top-level field is walked and the
  verdict waits for the end of the message. Field 1 with another wire type is an unknown field to
  protobuf too, and is skipped.
- for infer requests, shared-memory parameters: the request's ``parameters`` (field 4, a
  ``map<string, InferParameter>``), each input's (field 5 → field 4) and each output's (field 6 →
  field 2). Protobuf strings are not escaped, so a field whose bytes never contain ``SHM_MARKER`` names
  no such parameter; only a field that does is kept (bounded) and parsed in full.

Anything the walker cannot follow — a truncated field, a group, an invalid wire type, a compressed
message in an encoding it cannot read — is refused: never "allow" on a message not understood.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from tritonshare.proxy.policy import (
    GRPC_INVALID_ARGUMENT,
    GRPC_NOT_FOUND,
    GRPC_PERMISSION_DENIED,
    GRPC_RESOURCE_EXHAUSTED,
    GRPC_UNIMPLEMENTED,
    SHM_MARKER,
    SHM_PARAMETERS,
    GrpcRule,
    grpc_model_allowed,
    grpc_not_found,
)

MODEL_NAME_FIELD = 1
_NAME_TAG = MODEL_NAME_FIELD << 3 | 2  # field 1, length-delimited
# Top-level fields of ModelInferRequest that can hold parameters, and the field inside each that is the
# parameter map (None: the top-level field is itself a map entry).
PARAMETER_FIELDS: dict[int, int | None] = {4: None, 5: 4, 6: 2}
_SHM_KEYS = frozenset(name.encode() for name in SHM_PARAMETERS)
_NAME_LIMIT = 1024  # longer names are no model's name; kept only for the error message
_MARKER_TAIL = len(SHM_MARKER) - 1
_DECOMPRESS_STEP = 1 << 20  # decompressed bytes produced per step: bounds memory on compression bombs
_U32 = struct.Struct(">L")
_DECOMPRESSORS = {b"gzip": 31, b"deflate": 15}  # grpc-encoding → zlib wbits (gzip header / zlib header)

# Walker states.
_TAG, _LENGTH, _VARINT, _SKIP, _VALUE = range(5)


class MalformedMessage(Exception):
    """The bytes are not a protobuf message the walker can follow."""


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request message is not forwarded, as the gRPC status the client gets."""

    status: int
    message: str
    reason: str  # metrics label


@dataclass(slots=True)
class WalkResult:
    model_name: bytes = b""
    name_complete: bool = True  # False: field 1 was longer than any model name (kept: its start)
    suspects: list[tuple[int, bytes]] = field(default_factory=list)  # parameter fields holding SHM_MARKER
    oversized: bool = False  # a parameter field held SHM_MARKER but was too large to keep and parse


class FieldWalker:
    """Walks the top-level fields of one protobuf message fed in chunks of any size."""

    __slots__ = (
        "_inspect",
        "_limit",
        "_state",
        "_acc",
        "_shift",
        "_field",
        "_left",
        "_name",
        "_parts",
        "_kept",
        "_hit",
        "_tail",
        "_result",
    )

    def __init__(self, *, inspect: bool, limit: int) -> None:
        self._inspect = inspect
        self._limit = limit  # bytes of parameter fields kept for a full parse
        self._state = _TAG
        self._acc = self._shift = self._field = self._left = self._kept = 0
        self._name: list[bytes] = []
        self._parts: list[memoryview] | None = None
        self._hit = False
        self._tail = b""
        self._result = WalkResult()

    def feed(self, buf: bytes, pos: int, end: int) -> None:
        while pos < end:
            state = self._state
            if state >= _SKIP:
                take = min(self._left, end - pos)
                if state == _VALUE:
                    self._take(buf, pos, pos + take)
                pos += take
                self._left -= take
                if not self._left:
                    if state == _VALUE:
                        self._end_field()
                    else:
                        self._state = _TAG
                continue
            byte = buf[pos]
            pos += 1
            if byte & 0x80:
                self._acc |= (byte & 0x7F) << self._shift
                self._shift += 7
                if self._shift > 63:
                    raise MalformedMessage("varint longer than 10 bytes")
                continue
            value = self._acc | (byte << self._shift)
            self._acc = self._shift = 0
            if state == _TAG:
                self._start_field(value)
            elif state == _LENGTH:
                self._start_value(value)
            else:
                self._state = _TAG

    def finish(self) -> WalkResult:
        if self._state != _TAG or self._shift:
            raise MalformedMessage("message ends inside a field")
        return self._result

    def _start_field(self, tag: int) -> None:
        number, wire_type = tag >> 3, tag & 7
        if number == 0:
            raise MalformedMessage("field number 0")
        self._field = number
        if wire_type == 2:
            self._state = _LENGTH
        elif wire_type == 0:
            self._state = _VARINT
        elif wire_type in (1, 5):
            self._skip(8 if wire_type == 1 else 4)
        else:
            raise MalformedMessage(f"field {number} has wire type {wire_type} (group or invalid)")

    def _start_value(self, length: int) -> None:
        number = self._field
        if number == MODEL_NAME_FIELD:
            self._name = []
            self._result.model_name, self._result.name_complete = b"", length <= _NAME_LIMIT
        elif self._inspect and number in PARAMETER_FIELDS:
            self._parts, self._kept, self._hit, self._tail = [], 0, False, b""
        else:
            self._skip(length)
            return
        self._left = length
        self._state = _VALUE if length else _TAG
        if not length:
            self._end_field()

    def _skip(self, length: int) -> None:
        self._left = length
        self._state = _SKIP if length else _TAG

    def _take(self, buf: bytes, start: int, end: int) -> None:
        if self._field == MODEL_NAME_FIELD:
            if sum(map(len, self._name)) < _NAME_LIMIT:
                self._name.append(buf[start:end])
            return
        if not self._hit:
            seam = self._tail + buf[start : start + _MARKER_TAIL]
            self._hit = buf.find(SHM_MARKER, start, end) >= 0 or SHM_MARKER in seam
            self._tail = buf[max(start, end - _MARKER_TAIL) : end]
        if self._parts is not None:
            self._kept += end - start
            if self._kept <= self._limit:
                self._parts.append(memoryview(buf)[start:end])
            else:
                self._parts = None

    def _end_field(self) -> None:
        self._state = _TAG
        if self._field == MODEL_NAME_FIELD:
            self._result.model_name = b"".join(self._name)[:_NAME_LIMIT]
            return
        if self._hit:
            if self._parts is None:
                self._result.oversized = True
            else:
                self._result.suspects.append((self._field, b"".join(self._parts)))
                self._limit -= self._kept  # the bound holds for the kept fields of a message together
        self._parts, self._hit, self._kept = None, False, 0


def walk_message(buf: bytes, pos: int, end: int, inspect: bool, limit: int) -> tuple[bytes, WalkResult | None]:
    """:class:`FieldWalker`'s reading of a message that lies whole in ``buf[pos:end]`` (the fast path): its model
    name (field 1, the last one, at most ``_NAME_LIMIT`` bytes), and its whole :class:`WalkResult` only when
    there is more to judge than that name (one longer than any model's, parameter fields naming
    ``SHM_MARKER``); None in the common case, which builds no object."""
    name, complete, details = b"", True, None
    while pos < end:
        tag = buf[pos]
        pos += 1
        if tag & 0x80:  # one-byte tags and lengths are read inline: a call each would cost more than the walk
            tag, pos = _varint_within(buf, pos - 1, end)
        if tag & 7 == 2:
            length = buf[pos] if pos < end else 0x80
            pos += 1
            if length & 0x80:
                length, pos = _varint_within(buf, pos - 1, end)
            stop = pos + length
            if stop > end:
                raise MalformedMessage(f"field {tag >> 3} runs past the end of its message")
            if tag == _NAME_TAG:
                complete = length <= _NAME_LIMIT
                name = buf[pos : stop if complete else pos + _NAME_LIMIT]
            elif inspect and tag >> 3 in PARAMETER_FIELDS and buf.find(SHM_MARKER, pos, stop) >= 0:
                details = _suspect(details or WalkResult(), tag >> 3, buf[pos:stop], limit)
            pos = stop
        else:
            pos = _skip_scalar(buf, pos, end, tag)
        if tag < 8:
            raise MalformedMessage("field number 0")
    if pos != end:
        raise MalformedMessage("message ends inside a field")
    if details is None and complete:
        return name, None
    details = details or WalkResult()
    details.model_name, details.name_complete = name, complete
    return name, details


def _skip_scalar(buf: bytes, pos: int, end: int, tag: int) -> int:
    """Past the value of a field that is not length-delimited (``tag``'s wire type 0, 1 or 5)."""
    wire_type = tag & 7
    if wire_type == 0:
        return _varint_within(buf, pos, end)[1]
    if wire_type == 1 or wire_type == 5:
        return pos + (8 if wire_type == 1 else 4)
    raise MalformedMessage(f"field {tag >> 3} has wire type {wire_type} (group or invalid)")


def _suspect(result: WalkResult, number: int, data: bytes, limit: int) -> WalkResult:
    """A parameter field naming ``SHM_MARKER``: kept for a full parse while the kept fields of the message fit
    in ``limit`` bytes together; beyond, the message is oversized."""
    if len(data) > limit - sum(len(kept) for _, kept in result.suspects):
        result.oversized = True
    else:
        result.suspects.append((number, data))
    return result


def _varint_within(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    if pos >= end:
        raise MalformedMessage("message ends inside a varint")
    byte = buf[pos]
    if byte < 0x80:
        return byte, pos + 1
    value, shift = byte & 0x7F, 7
    while True:
        pos += 1
        if pos >= end:
            raise MalformedMessage("message ends inside a varint")
        byte = buf[pos]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos + 1
        shift += 7
        if shift > 63:
            raise MalformedMessage("varint longer than 10 bytes")


def length_delimited(data: bytes) -> Iterator[tuple[int, bytes]]:
    """(field number, bytes) of each length-delimited field of a complete message; other fields are
    skipped. Raises :class:`MalformedMessage` for bytes that are not a message."""
    walker_pos, end = 0, len(data)
    while walker_pos < end:
        tag, walker_pos = _varint(data, walker_pos)
        number, wire_type = tag >> 3, tag & 7
        if number == 0:
            raise MalformedMessage("field number 0")
        if wire_type == 0:
            walker_pos = _varint(data, walker_pos)[1]
        elif wire_type in (1, 5):
            walker_pos += 8 if wire_type == 1 else 4
        elif wire_type == 2:
            length, walker_pos = _varint(data, walker_pos)
            if walker_pos + length > end:
                raise MalformedMessage(f"field {number} runs past the end of its message")
            yield number, data[walker_pos : walker_pos + length]
            walker_pos += length
        else:
            raise MalformedMessage(f"field {number} has wire type {wire_type} (group or invalid)")
    if walker_pos != end:
        raise MalformedMessage("message ends inside a field")


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data):
            raise MalformedMessage("message ends inside a varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise MalformedMessage("varint longer than 10 bytes")


def names_shm_parameter(number: int, data: bytes) -> bool:
    """Does top-level field ``number`` (4 parameters, 5 an input, 6 an output) name a shared-memory
    parameter? Any occurrence of a key counts, not only the last one protobuf would keep."""
    inner = PARAMETER_FIELDS[number]
    entries = [data] if inner is None else [value for key, value in length_delimited(data) if key == inner]
    return any(key == 1 and value in _SHM_KEYS for entry in entries for key, value in length_delimited(entry))


class MessageInspector:
    """Follows the gRPC messages of one request stream and judges each one as it completes."""

    __slots__ = (
        "_rule",
        "_inspect",
        "_own",
        "_accept",
        "_encoding",
        "_limit",
        "_prefix",
        "_left",
        "_walker",
        "_inflater",
        "_refusal",
        "messages",
        "first_end",
    )

    def __init__(self, rule: GrpcRule, own: bytes, *, encoding: bytes | None, limit: int) -> None:
        self._rule = rule
        self._inspect = rule.inspect
        self._own = own
        self._accept = own or None  # a name accepted without asking the policy (never an empty one)
        self._encoding = encoding
        self._limit = limit
        self._prefix = b""  # the 5-byte prefix of a message, while it arrives in pieces
        self._left = 0  # body bytes of the current message still to come
        self._walker: FieldWalker | None = None
        self._inflater: zlib._Decompress | None = None
        self._refusal: Refusal | None = None
        self.messages = 0  # messages judged and accepted so far
        # Where the first accepted message ended, in the buffer of the feed() call that completed it (the
        # relay holds a stream waiting for admission from that message's last byte on).
        self.first_end = -1

    def feed(self, buf: bytes, pos: int, end: int) -> Refusal | None:
        """Feed DATA bytes ``buf[pos:end]``; the refusal of the first message completed in them that
        must not reach Triton, if any. Once a refusal is returned, the stream is over."""
        try:
            while pos < end:
                if self._walker is None and not self._prefix and end - pos >= 5 and not buf[pos]:
                    stop = pos + 5 + _U32.unpack_from(buf, pos + 1)[0]
                    if stop <= end:  # a whole uncompressed message: walk it in one go
                        name, details = walk_message(buf, pos + 5, stop, self._inspect, self._limit)
                        if details is not None or name != self._accept:
                            refusal = self._judge(name, details, stop)
                            if refusal is not None:
                                return refusal
                        elif self.messages:  # the own model, nothing more to look at (as _judge, inline)
                            self.messages += 1
                        else:
                            self.messages, self.first_end = 1, stop
                        pos = stop
                        continue
                pos = self._feed_piece(buf, pos, end)
                if pos < 0:
                    return self._refusal
        except (MalformedMessage, zlib.error) as exc:
            return Refusal(GRPC_INVALID_ARGUMENT, f"request message is not valid protobuf: {exc}", "malformed")
        return None

    def _feed_piece(self, buf: bytes, pos: int, end: int) -> int:
        """Follow a message that is not whole in ``buf[pos:end]``: its 5-byte prefix, or bytes of its body.
        Returns where reading goes on, -1 if a message was refused (:attr:`_refusal`)."""
        if self._walker is None:
            take = min(5 - len(self._prefix), end - pos)
            self._prefix += buf[pos : pos + take]
            pos += take
            if len(self._prefix) == 5:
                self._refusal = self._start_message(pos)
                if self._refusal is not None:
                    return -1
            return pos
        take = min(self._left, end - pos)
        self._feed_body(buf, pos, pos + take)
        pos += take
        self._left -= take
        if not self._left:
            self._refusal = self._end_message(pos)
            if self._refusal is not None:
                return -1
        return pos

    def _start_message(self, pos: int) -> Refusal | None:
        flag, length = self._prefix[0], int.from_bytes(self._prefix[1:5], "big")
        self._prefix = b""
        if flag > 1:
            raise MalformedMessage(f"gRPC message flag {flag} is neither 0 nor 1")
        self._inflater = None
        if flag == 1:
            wbits = _DECOMPRESSORS.get(self._encoding or b"")
            if wbits is None:
                shown = (self._encoding or b"(none)").decode("latin-1")
                return Refusal(
                    GRPC_UNIMPLEMENTED,
                    f"the proxy cannot inspect messages compressed with "
                    f"grpc-encoding {shown!r}; use gzip, deflate or none",
                    "compression",
                )
            self._inflater = zlib.decompressobj(wbits)
        self._walker = FieldWalker(inspect=self._inspect, limit=self._limit)
        self._left = length
        return self._end_message(pos) if length == 0 else None

    def _feed_body(self, buf: bytes, start: int, end: int) -> None:
        assert self._walker is not None
        if self._inflater is None:
            self._walker.feed(buf, start, end)
            return
        chunk = buf[start:end]
        while chunk:
            out = self._inflater.decompress(chunk, _DECOMPRESS_STEP)
            self._walker.feed(out, 0, len(out))
            chunk = self._inflater.unconsumed_tail

    def _end_message(self, pos: int) -> Refusal | None:
        walker, self._walker = self._walker, None
        assert walker is not None
        if self._inflater is not None:
            rest = self._inflater.flush()
            walker.feed(rest, 0, len(rest))
            if not self._inflater.eof:
                raise MalformedMessage(f"compressed message ends before its {self._encoding!r} stream does")
        result = walker.finish()
        return self._judge(result.model_name, result, end=pos)

    def _judge(self, name: bytes, result: WalkResult | None, end: int) -> Refusal | None:
        """The verdict on a message that ended at ``end`` in the buffer being fed: its model name, and the rest
        of its walk (None: nothing but the name to judge)."""
        complete = result is None or result.name_complete
        if not complete or not grpc_model_allowed(self._rule, name, self._own):
            return Refusal(GRPC_NOT_FOUND, grpc_not_found(name), "other_model")
        refusal = None if result is None else self._parameters_refusal(result)
        if refusal is not None:
            return refusal
        self.messages += 1
        if self.messages == 1:
            self.first_end = end
        return None

    def _parameters_refusal(self, result: WalkResult) -> Refusal | None:
        if result.oversized:
            return Refusal(
                GRPC_RESOURCE_EXHAUSTED,
                f"request parameters mention shared memory and are larger "
                f"than the {self._limit} bytes the proxy checks",
                "too_large",
            )
        for number, data in result.suspects:
            if names_shm_parameter(number, data):
                return Refusal(
                    GRPC_PERMISSION_DENIED, "shared-memory parameters are not available to tenants", "shared_memory"
                )
        return None
