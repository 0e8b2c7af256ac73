"""Reading what the policy needs from protobuf request messages: their top-level fields, walked without
copying them (large fields such as ``raw_input_contents``, field 7, are skipped by length) —
:class:`FieldWalker` as a message's bytes stream past in pieces, :class:`MessageWalker` when it lies whole
in one buffer. The gRPC framing around them is :mod:`tritonshare.proxy.grpc_messages`'s.

What they read (REFERENCE §3, §6):

- field 1 — ``model_name`` of ModelInferRequest, ``name`` of the Model*Request messages. Protobuf does
  not require field order and the last occurrence wins, so every top-level field is walked and the
  verdict waits for the end of the message. Field 1 with another wire type is an unknown field to
  protobuf too, and is skipped.
- for infer requests, shared-memory parameters: the request's ``parameters`` (field 4, a
  ``map<string, InferParameter>``), each input's (field 5 → field 4) and each output's (field 6 →
  field 2). Protobuf strings are not escaped, so a field whose bytes never contain ``SHM_MARKER`` names
  no such parameter; only a field that does is kept (bounded) and parsed in full.
- for infer requests, the ``classification`` parameter of each output (field 6 → field 2): refused, Triton dies
  classifying a BYTES output (:data:`~tritonshare.proxy.policy.CLASSIFICATION_REFUSAL`). An output whose bytes
  never contain the word names no such parameter; one that does is parsed.
- for infer requests, each input's shape (field 5 → field 3): an input declaring more elements than the message
  can carry is refused (:mod:`tritonshare.proxy.shapes`, which says why). Only the inputs are read; the contents
  (field 7) are skipped by length as any other field.

Anything a walker cannot follow — a truncated field, a group, an invalid wire type — raises
:class:`MalformedMessage`, and the message is refused: never "allow" on a message not understood.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from tritonshare.proxy.policy import CLASSIFICATION, SHM_MARKER, SHM_PARAMETERS
from tritonshare.proxy.shapes import INPUTS_TAG, SHAPE_FLOOR, InputShape, declared, overdeclared, read_shape

MODEL_NAME_FIELD = 1
_NAME_TAG = MODEL_NAME_FIELD << 3 | 2  # field 1, length-delimited
# Top-level fields of ModelInferRequest that can hold parameters, and the field inside each that is the
# parameter map (None: the top-level field is itself a map entry).
PARAMETER_FIELDS: dict[int, int | None] = {4: None, 5: 4, 6: 2}
_SHM_KEYS = frozenset(name.encode() for name in SHM_PARAMETERS)
_NAME_LIMIT = 1024  # longer names are no model's name; kept only for the error message
_MARKER_TAIL = len(SHM_MARKER) - 1
OUTPUTS_FIELD = 6
_OUTPUTS_TAG = OUTPUTS_FIELD << 3 | 2
_CLASSIFICATION = CLASSIFICATION.encode()
_CLASSIFICATION_KEYS = frozenset({_CLASSIFICATION})
_CLASSIFICATION_TAIL = len(_CLASSIFICATION) - 1

# Walker states.
_TAG, _LENGTH, _VARINT, _SKIP, _VALUE = range(5)


# Protobuf's C++ parser (Triton's) reads a tag into 32 bits and drops what lies above: a 5-byte tag of
# 10 + 2**32 is field 1 to Triton. The walkers refuse every tag wider than 32 bits rather than see another field.
MAX_TAG = 0xFFFF_FFFF
_WIDE_TAG = "a field tag wider than 32 bits (protobuf's C++ parser would read it as another field)"


# Walking costs per field (~0.3 µs in Python), while a field can take 2 bytes: a compressed message of a few
# KiB inflating to millions of them held the event loop for seconds. So a compressed message may hold no more
# fields than this plus FIELDS_PER_COMPRESSED_BYTE for each byte of it received: a real request (tensors'
# names, shapes, contents) stays far below that, and refusing costs at most ~0.1 ms plus ~1 µs a byte received.
COMPRESSED_FIELDS = 256
FIELDS_PER_COMPRESSED_BYTE = 4
TOO_MANY_FIELDS = (
    f"a compressed message holds more fields than its size allows ({COMPRESSED_FIELDS} plus "
    f"{FIELDS_PER_COMPRESSED_BYTE} per compressed byte): the proxy does not walk that many"
)


class MalformedMessage(Exception):
    """The bytes are not a protobuf message the walker can follow."""


class Budget(Protocol):
    """Bytes held at once by every walker (:class:`~tritonshare.proxy.held.HeldBudget`)."""

    def reserve(self, size: int) -> bool: ...

    def release(self, size: int) -> None: ...


class OverBudget(Exception):
    """Keeping more of a parameter field would take the walkers' :class:`Budget` past its limit."""

    def __init__(self, size: int, own: int) -> None:
        super().__init__(f"{size} more bytes to keep, {own} kept")
        self.size = size  # what did not fit
        self.own = own  # what the walker had reserved already


@dataclass(slots=True)
class WalkResult:
    model_name: bytes = b""
    name_complete: bool = True  # False: field 1 was longer than any model name (kept: its start)
    suspects: list[tuple[int, bytes]] = field(default_factory=list)  # parameter fields holding SHM_MARKER
    oversized: bool = False  # a parameter field held SHM_MARKER but was too large to keep and parse
    overdeclared: str = ""  # an input's shape declares more elements than the message carries: the refusal
    classified: bool = False  # an output names the classification parameter (or may: too large to parse)


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
        "_named",
        "_named_tail",
        "_result",
        "_budget",
        "_field_cost",
        "_suspects_cost",
        "_shape",
        "_worst",
        "_fed",
        "fields_left",
    )

    def __init__(self, *, inspect: bool, limit: int, fields: int = -1, budget: Budget | None = None) -> None:
        """``fields``: how many fields it may walk before it refuses the message (-1: any number); the
        owner may allow more as the message arrives (:attr:`fields_left`). ``budget``: where what it keeps
        of parameter fields is reserved as it is kept (:class:`OverBudget` when it does not fit), until the
        owner calls :meth:`release`."""
        self._inspect = inspect
        self._limit = limit  # bytes of parameter fields kept for a full parse
        self._budget = budget
        self._field_cost = 0  # reserved for the parts of the field being kept
        self._suspects_cost = 0  # reserved for the kept fields that name SHM_MARKER (until the message ends)
        self.fields_left = fields
        self._state = _TAG
        self._acc = self._shift = self._field = self._left = self._kept = 0
        self._name: list[bytes] = []
        self._parts: list[bytes | memoryview] | None = None
        self._hit = False
        self._tail = b""
        self._named = False  # the output (field 6) being walked holds the word "classification"
        self._named_tail = b""
        self._result = WalkResult()
        self._shape: InputShape | None = None  # the shape of the input (field 5) being walked
        self._worst: InputShape | None = None  # of the inputs walked, the one declaring the most elements
        self._fed = 0  # bytes of the message walked

    def feed(self, buf: bytes, pos: int, end: int) -> None:
        self._fed += end - pos
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
        worst = self._worst
        if worst is not None and worst.count > max(self._fed, SHAPE_FLOOR):
            self._result.overdeclared = overdeclared(worst, self._fed)
        return self._result

    def _start_field(self, tag: int) -> None:
        if self.fields_left >= 0:
            self.fields_left -= 1
            if self.fields_left < 0:
                raise MalformedMessage(TOO_MANY_FIELDS)
        number, wire_type = tag >> 3, tag & 7
        if number == 0:
            raise MalformedMessage("field number 0")
        if tag > MAX_TAG:
            raise MalformedMessage(_WIDE_TAG)
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
            self._named, self._named_tail = False, b""
            if number == INPUTS_TAG >> 3:
                self._shape = InputShape()
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
        if self._shape is not None:
            try:
                self._shape.feed(buf, start, end)
            except ValueError as exc:
                raise MalformedMessage(str(exc)) from exc
        if not self._hit:
            seam = self._tail + buf[start : start + _MARKER_TAIL]
            self._hit = buf.find(SHM_MARKER, start, end) >= 0 or SHM_MARKER in seam
            self._tail = buf[max(start, end - _MARKER_TAIL) : end]
        if self._field == OUTPUTS_FIELD and not self._named:
            seam = self._named_tail + buf[start : start + _CLASSIFICATION_TAIL]
            self._named = buf.find(_CLASSIFICATION, start, end) >= 0 or _CLASSIFICATION in seam
            self._named_tail = buf[max(start, end - _CLASSIFICATION_TAIL) : end]
        if self._parts is not None:
            self._kept += end - start
            if self._kept <= self._limit:
                self._parts.append(self._keep(buf, start, end))
            else:
                self._parts = None
                self._release_field()

    def _keep(self, buf: bytes, start: int, end: int) -> bytes | memoryview:
        """A part of a parameter field, kept until the field ends: a view when it is most of ``buf`` (which the
        view keeps whole), else a copy; reserved in the budget at what it keeps alive."""
        size = end - start
        if 2 * size >= len(buf):
            part: bytes | memoryview = memoryview(buf)[start:end]
            size = len(buf)
        else:
            part = buf[start:end]
        if self._budget is not None:
            if not self._budget.reserve(size):
                raise OverBudget(size, self._field_cost + self._suspects_cost)
            self._field_cost += size
        return part

    def _release_field(self) -> None:
        if self._field_cost and self._budget is not None:
            self._budget.release(self._field_cost)
        self._field_cost = 0

    def release(self) -> None:
        """Give back all that was reserved for what it kept: the message has been judged, or is dropped."""
        if self._budget is not None:
            self._budget.release(self._field_cost + self._suspects_cost)
        self._field_cost = self._suspects_cost = 0

    def _end_field(self) -> None:
        self._state = _TAG
        if self._field == MODEL_NAME_FIELD:
            self._result.model_name = b"".join(self._name)[:_NAME_LIMIT]
            return
        if self._shape is not None:
            self._end_input(self._shape)
            self._shape = None
        if self._named:  # (too large to parse: refused as if it named it)
            parts = self._parts
            if parts is None or names_parameter(OUTPUTS_FIELD, b"".join(parts), _CLASSIFICATION_KEYS):
                self._result.classified = True
        if self._hit:
            if self._parts is None:
                self._result.oversized = True
            else:
                self._result.suspects.append((self._field, b"".join(self._parts)))
                self._limit -= self._kept  # the bound holds for the kept fields of a message together
                # The joined copy is kept in place of the parts until the message is judged: so is its reservation.
                self._suspects_cost += self._kept
                self._field_cost -= self._kept
        self._release_field()
        self._parts, self._hit, self._kept = None, False, 0

    def _end_input(self, shape: InputShape) -> None:
        try:
            count = shape.finish()
        except ValueError as exc:
            raise MalformedMessage(str(exc)) from exc
        if count > SHAPE_FLOOR and (self._worst is None or count > self._worst.count):
            self._worst = shape


class MessageWalker:
    """:class:`FieldWalker`'s reading of messages that lie whole in one buffer (the fast path), for one relayed
    connection: a message's model name (field 1, the last one, at most ``_NAME_LIMIT`` bytes), and its whole
    :class:`WalkResult` only when there is more to judge than that name (a name longer than any model's,
    parameter fields naming ``SHM_MARKER``).

    It remembers the last message that needed no closer look and whose last field's value it did not read (a
    length-delimited field other than the name and, for infer requests, the parameter fields): its leading
    fields, the name they hold, and its last field's header and length. A client repeats all of that in every
    request (model name, tensor names and shapes, the contents' length); only the contents differ. A walk
    reads left to right, so a message that starts with the same leading fields is in the same state after
    them; one that also has the same last field's header, with exactly that many bytes after it, reads the
    same as a whole — whatever those bytes are. So do the leading fields' inputs, whose shapes are bounded by the
    message's length: a message walked on after them is at least as long as the remembered one (it holds its
    leading fields and its last field whole), so they declare no more than it can carry."""

    __slots__ = ("_inspect", "_limit", "_prefix", "_cut", "_rest", "_name")

    def __init__(self, *, inspect: bool, limit: int) -> None:
        self._inspect = inspect  # parameter fields are checked (infer requests)
        self._limit = limit  # bytes of parameter fields kept for a full parse
        self._prefix = b""  # the remembered leading fields, then the last field's tag and length
        self._cut = 0  # where that last field starts in the prefix
        self._rest = -1  # its value's length (-1: nothing remembered)
        self._name = b""  # the model name the leading fields hold

    def shape(self, buf: bytes, pos: int, end: int, name: bytes) -> int:
        """The length of the remembered leading fields and last field's header when the message ``buf[pos:end]``
        is of the remembered shape and they name ``name`` — every message with those bytes there and as long
        walks as ``(name, None)`` —, else -1."""
        prefix = self._prefix
        if self._rest < 0 or self._name != name or pos + len(prefix) + self._rest != end:
            return -1
        n = len(prefix)  # (within the message: the value's length is not negative; a slice compared costs less)
        return n if buf[pos : pos + n] == prefix else -1

    def walk(self, buf: bytes, pos: int, end: int) -> tuple[bytes, WalkResult | None]:
        prefix = self._prefix
        n = len(prefix)  # (a slice compared: startswith parses its arguments, ~400 instructions a call)
        try:  # (free in Python 3.11 unless raised)
            if pos + n > end or buf[pos : pos + n] != prefix:  # (b"", when nothing is remembered, always matches)
                return self._walk(buf, pos, pos, end, b"")
            if pos + n + self._rest == end:  # the same fields, then a value as long as the last one's
                return self._name, None
            return self._walk(buf, pos, pos + self._cut, end, self._name)  # after the same leading fields
        except ValueError as exc:  # an input that is no message (shapes.declared)
            raise MalformedMessage(str(exc)) from exc

    def _walk(  # noqa: C901  (one-byte tags, lengths and checks inline: a call costs ~700 instructions)
        self, buf: bytes, start: int, pos: int, end: int, name: bytes
    ) -> tuple[bytes, WalkResult | None]:
        """Walk the message ``buf[start:end]`` from ``pos`` on, the state at ``pos`` being ``name`` (complete, no
        parameter field to look at)."""
        complete, details, tag, value = True, None, 0, pos
        last = pos  # where the last field starts
        while pos < end:
            last, tag = pos, buf[pos]
            pos += 1
            if tag & 0x80:  # one-byte tags and lengths are read inline: a call each would cost more than the walk
                tag, pos = _varint_within(buf, pos - 1, end)
                if tag > MAX_TAG:
                    raise MalformedMessage(_WIDE_TAG)
            if tag & 7 == 2:
                length = buf[pos] if pos < end else 0x80
                pos += 1
                if length & 0x80:
                    length, pos = _varint_within(buf, pos - 1, end)
                value, stop = pos, pos + length
                if stop > end:
                    raise MalformedMessage(f"field {tag >> 3} runs past the end of its message")
                if tag == _NAME_TAG:
                    complete = length <= _NAME_LIMIT
                    name = buf[pos : stop if complete else pos + _NAME_LIMIT]
                elif tag < 8:
                    raise MalformedMessage("field number 0")
                elif self._inspect and tag >> 3 in PARAMETER_FIELDS:
                    if buf.find(SHM_MARKER, pos, stop) >= 0:
                        details = _suspect(details or WalkResult(), tag >> 3, buf[pos:stop], self._limit)
                    if tag == _OUTPUTS_TAG and buf.find(_CLASSIFICATION, pos, stop) >= 0:
                        details = _check_output(details, buf[pos:stop])
                    if tag == INPUTS_TAG and declared(buf, pos, stop) > SHAPE_FLOOR:  # (rare: read again, to tell)
                        details = _check_input(details, buf, pos, stop, end - start)
                pos = stop
            else:
                pos = _skip_scalar(buf, pos, end, tag)  # (never past the end: fields end inside the message)
        if details is not None or not complete:
            return name, _with_name(details or WalkResult(), name, complete)
        if tag & 7 == 2 and tag != _NAME_TAG and not (self._inspect and tag >> 3 in PARAMETER_FIELDS):
            # The last field's value was not read: remember this message's shape.
            self._prefix, self._cut, self._rest, self._name = buf[start:value], last - start, end - value, name
        return name, None


def _check_input(details: WalkResult | None, buf: bytes, pos: int, stop: int, carried: int) -> WalkResult | None:
    """The walk's details once the input ``buf[pos:stop]``, declaring more than SHAPE_FLOOR elements, is read in a
    message of ``carried`` bytes: with the refusal of the first input that declares more than that."""
    if declared(buf, pos, stop) <= carried or (details is not None and details.overdeclared):
        return details
    details = details or WalkResult()
    details.overdeclared = overdeclared(read_shape(buf[pos:stop]), carried)  # (its bytes are a message: read)
    return details


def _check_output(details: WalkResult | None, output: bytes) -> WalkResult | None:
    """The walk's details once an output holding the word "classification" is read: marked if it names the
    parameter."""
    if not names_parameter(OUTPUTS_FIELD, output, _CLASSIFICATION_KEYS):
        return details
    details = details or WalkResult()
    details.classified = True
    return details


def _with_name(result: WalkResult, name: bytes, complete: bool) -> WalkResult:
    result.model_name, result.name_complete = name, complete
    return result


def _skip_scalar(buf: bytes, pos: int, end: int, tag: int) -> int:
    """Past the value of a field that is not length-delimited (``tag``'s wire type 0, 1 or 5)."""
    wire_type = tag & 7
    if wire_type == 0:
        pos = _varint_within(buf, pos, end)[1]
    elif wire_type == 1 or wire_type == 5:
        pos += 8 if wire_type == 1 else 4
        if pos > end:
            raise MalformedMessage("message ends inside a field")
    else:
        raise MalformedMessage(f"field {tag >> 3} has wire type {wire_type} (group or invalid)")
    if tag < 8:
        raise MalformedMessage("field number 0")
    return pos


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
        if tag > MAX_TAG:
            raise MalformedMessage(_WIDE_TAG)
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
    return names_parameter(number, data, _SHM_KEYS)


def names_parameter(number: int, data: bytes, keys: frozenset[bytes]) -> bool:
    """Does top-level field ``number`` (4 parameters, 5 an input, 6 an output) name a parameter of ``keys``?"""
    inner = PARAMETER_FIELDS[number]
    entries = [data] if inner is None else [value for key, value in length_delimited(data) if key == inner]
    return any(key == 1 and value in keys for entry in entries for key, value in length_delimited(entry))
