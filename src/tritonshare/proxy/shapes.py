"""Bounding the tensor shapes of gRPC infer requests: how many elements each input of a ModelInferRequest declares
(``inputs``, field 5 → ``shape``, field 3, repeated int64), read from the input's bytes.

Why: Triton checks an input's byte size as the product of its shape and its datatype's size in 64 bits, so a FP32
input of shape [2**62] with empty ``raw_input_contents`` passes as 0 bytes and is handed to the model — the Python
backend's stub died on it (and the model failed every request after, still READY); a backend inside Triton's
process would read out of bounds, for every tenant. A valid message carries at least a byte per element of each
input (``raw_input_contents``, or typed ``contents``; shared memory is refused by the policy), so an input declaring
more elements than the message has bytes (or than :data:`~tritonshare.proxy.inspect.SHAPE_FLOOR`, the REST bound's
floor) is refused before Triton sees it.

:func:`declared` reads an input lying whole in one buffer (the fast path: a few fields, its contents skipped by
length); :class:`InputShape` reads one fed in pieces, and keeps the input's name and first dims for the refusal.
Protobuf appends every occurrence of a repeated field, packed or not, so all of them count. A dim that is negative
(as int64) refuses the input whatever the rest (:data:`NEGATIVE_DIM`): Triton refuses -1 ("all input dimensions
should be specified") and an odd count of them (a negative byte size), but two (FP32 [-2**31, -2**31] of a model
with two variable dims) multiply to 2**62 elements, 0 bytes in 64 bits, and the Python backend's stub died on it.
Bytes that are not a message raise ``ValueError`` (the walkers of :mod:`tritonshare.proxy.protobuf` refuse the
message); a tag wider than 32 bits too, as they do.
"""

from __future__ import annotations

from math import prod

from tritonshare.proxy.inspect import SHAPE_FLOOR, TOO_MANY

__all__ = ["NEGATIVE_DIM", "SHAPE_FLOOR", "TOO_MANY", "InputShape", "declared", "overdeclared", "read_shape"]

INPUTS_TAG = 5 << 3 | 2  # ModelInferRequest.inputs, length-delimited
_NAME_TAG = 1 << 3 | 2  # InferInputTensor.name
_DATATYPE_TAG = 2 << 3 | 2  # InferInputTensor.datatype
_SHAPE_TAG = 3 << 3 | 2  # InferInputTensor.shape, packed (proto3's encoding)
_DIM_TAG = 3 << 3  # one dim of it, not packed (a parser accepts either)
_MAX_TAG = 0xFFFF_FFFF
_U64 = (1 << 64) - 1  # protobuf's C++ parser keeps a varint's low 64 bits
_NEGATIVE = 1 << 63  # an int64 dim below 0
NEGATIVE_DIM = TOO_MANY + 1  # the count of an input with a negative dim: more than any, and kept whatever follows
_QUICK_DIMS = 8  # one-byte dims multiplied in one call (127**8 < 2**56: no bignum)
_NAME_KEPT = 64  # bytes of an input's name kept for the refusal
_DIMS_KEPT = 8  # dims kept for the refusal


def declared(buf: bytes, pos: int, end: int) -> int:
    """The elements the input ``buf[pos:end]`` declares (the product of its dims, at most :data:`TOO_MANY`), or
    :data:`NEGATIVE_DIM`.

    At a glance first, in the layout every serializer writes for a small shape — name (field 1) and datatype (2)
    of fewer than 128 bytes, then a packed shape (3) of one or two one-byte dims ending the input: a walk costs
    ~4,000 instructions a field, this ~2,000 in all."""
    if end - pos > 6 and buf[pos] == _NAME_TAG and buf[pos + 1] < 0x80:
        at = pos + 2 + buf[pos + 1]
        if at + 5 <= end and buf[at] == _DATATYPE_TAG and buf[at + 1] < 0x80:
            at += 2 + buf[at + 1]
            left = end - at  # (the shape field's, if it ends the input: 3 or 4 bytes)
            if 3 <= left <= 4 and buf[at] == _SHAPE_TAG and buf[at + 1] == left - 2 and buf[at + 2] < 0x80:
                if left == 3:
                    return buf[at + 2]
                if buf[at + 3] < 0x80:
                    return buf[at + 2] * buf[at + 3]
    return _walked(buf, pos, end)


def _walked(buf: bytes, pos: int, end: int) -> int:
    """:func:`declared`, walking the input field by field."""
    count = 1
    while pos < end:
        tag = buf[pos]
        pos += 1
        if tag & 0x80:
            tag, pos = _varint(buf, pos - 1, end)
            if tag > _MAX_TAG:
                raise ValueError("a field tag wider than 32 bits in an input")
        if tag & 7 == 2:
            length = buf[pos] if pos < end else 0x80
            pos += 1
            if length & 0x80:
                length, pos = _varint(buf, pos - 1, end)
            stop = pos + length
            if stop > end:
                raise ValueError(f"field {tag >> 3} of an input runs past the end of the input")
            if tag == _SHAPE_TAG:
                count = _times(count, buf, pos, stop)
                if count == NEGATIVE_DIM:
                    return count
            pos = stop
        else:
            pos, dim = _scalar(buf, pos, end, tag)
            if tag == _DIM_TAG:
                if dim & _NEGATIVE:
                    return NEGATIVE_DIM
                count = min(count * dim, TOO_MANY)
        if tag < 8:
            raise ValueError("field number 0 in an input")
    return count


def _times(count: int, buf: bytes, pos: int, stop: int) -> int:
    """``count`` times the packed dims ``buf[pos:stop]`` (saturating), or :data:`NEGATIVE_DIM`."""
    if stop - pos <= _QUICK_DIMS:
        dims = buf[pos:stop]
        if max(dims, default=0) < 0x80:  # one byte each: the bytes are the dims
            return min(count * prod(dims), TOO_MANY)
    while pos < stop:
        dim, pos = _varint(buf, pos, stop)
        if dim & _NEGATIVE:
            return NEGATIVE_DIM
        count = min(count * dim, TOO_MANY)
    return count


def _scalar(buf: bytes, pos: int, end: int, tag: int) -> tuple[int, int]:
    """Past a field that is not length-delimited: (where it ends, its value if a varint, else 0)."""
    wire_type = tag & 7
    if wire_type == 0:
        value, pos = _varint(buf, pos, end)
        return pos, value
    if wire_type != 1 and wire_type != 5:
        raise ValueError(f"field {tag >> 3} of an input has wire type {wire_type} (group or invalid)")
    pos += 8 if wire_type == 1 else 4
    if pos > end:
        raise ValueError("an input ends inside a field")
    return pos, 0


def _varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    """(value's low 64 bits, where it ends) of the varint at ``pos``, which must end before ``end``."""
    value = shift = 0
    while True:
        if pos >= end:
            raise ValueError("an input ends inside a varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value & _U64, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes in an input")


# InputShape's states.
_TAG, _LENGTH, _VARINT, _SKIP, _DIMS, _NAME = range(6)


class InputShape:
    """:func:`declared` for an input fed in pieces (a message split across frames, or inflated): :attr:`count` once
    :meth:`finish` is called, with the input's name and first dims (for :func:`overdeclared`)."""

    __slots__ = ("_state", "_acc", "_shift", "_tag", "_left", "name", "dims", "count")

    def __init__(self) -> None:
        self._state = _TAG
        self._acc = self._shift = self._tag = self._left = 0
        self.name = b""
        self.dims: list[int] = []
        self.count = 1

    def feed(self, buf: bytes, pos: int, end: int) -> None:
        while pos < end:
            state = self._state
            if state == _SKIP or state == _NAME:
                take = min(self._left, end - pos)
                if state == _NAME and len(self.name) < _NAME_KEPT:
                    self.name += buf[pos : pos + min(take, _NAME_KEPT - len(self.name))]
                pos += take
                self._left -= take
                if not self._left:
                    self._state = _TAG
                continue
            byte = buf[pos]
            pos += 1
            if state == _DIMS:
                self._left -= 1
            if byte & 0x80:
                self._acc |= (byte & 0x7F) << self._shift
                self._shift += 7
                if self._shift > 63:
                    raise ValueError("varint longer than 10 bytes in an input")
                if state == _DIMS and not self._left:
                    raise ValueError("a packed shape ends inside a varint")
                continue
            value = self._acc | (byte << self._shift)
            self._acc = self._shift = 0
            self._step(state, value)

    def _step(self, state: int, value: int) -> None:
        """Go on after a varint ``value`` read in ``state``."""
        if state == _TAG:
            self._start(value)
        elif state == _LENGTH:
            self._left = value
            if not value:
                self._state = _TAG
            elif self._tag == _SHAPE_TAG:
                self._state = _DIMS
            else:
                self._state = _NAME if self._tag == _NAME_TAG else _SKIP
                if self._tag == _NAME_TAG:
                    self.name = b""  # (the last one is protobuf's)
        else:  # _VARINT, _DIMS
            if self._tag != _DIM_TAG and state == _VARINT:
                self._state = _TAG
                return
            self._dim(value & _U64)
            if state == _VARINT or not self._left:
                self._state = _TAG

    def _start(self, tag: int) -> None:
        if tag > _MAX_TAG:
            raise ValueError("a field tag wider than 32 bits in an input")
        if tag < 8:
            raise ValueError("field number 0 in an input")
        self._tag, wire_type = tag, tag & 7
        if wire_type == 2:
            self._state = _LENGTH
        elif wire_type == 0:
            self._state = _VARINT
        elif wire_type == 1 or wire_type == 5:
            self._left, self._state = (8 if wire_type == 1 else 4), _SKIP
        else:
            raise ValueError(f"field {tag >> 3} of an input has wire type {wire_type} (group or invalid)")

    def _dim(self, dim: int) -> None:
        if len(self.dims) <= _DIMS_KEPT:  # (one more than shown: tells that there are more)
            self.dims.append(dim - (1 << 64) if dim & _NEGATIVE else dim)
        if self.count == NEGATIVE_DIM:
            return
        self.count = NEGATIVE_DIM if dim & _NEGATIVE else min(self.count * dim, TOO_MANY)

    def finish(self) -> int:
        if self._state != _TAG or self._shift:
            raise ValueError("an input ends inside a field")
        return self.count


def overdeclared(shape: InputShape, carried: int) -> str:
    """The refusal of an input that declares more elements than a message of ``carried`` bytes can carry."""
    dims = ", ".join(map(str, shape.dims[:_DIMS_KEPT])) + (", …" if len(shape.dims) > _DIMS_KEPT else "")
    name = shape.name.decode("utf-8", "replace")
    if shape.count == NEGATIVE_DIM:
        return (
            f"input {name!r} of shape [{dims}] has a negative dim: Triton takes two of them for a positive element "
            "count, whose 64-bit byte size can wrap to what the message carries"
        )
    return (
        f"input {name!r} of shape [{dims}] declares more elements than the {carried}-byte message can carry "
        f"(at least a byte each, or {SHAPE_FLOOR}): Triton would size the input from its shape"
    )


def read_shape(data: bytes) -> InputShape:
    """The whole :class:`InputShape` of one input's bytes (for the refusal of one :func:`declared` read)."""
    shape = InputShape()
    shape.feed(data, 0, len(data))
    shape.finish()
    return shape
