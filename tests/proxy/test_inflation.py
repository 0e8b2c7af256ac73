"""The zip-bomb guard both front ends inflate through: bounded steps, the bound at its edges, the stream's ends.
Pure logic (REST's and gRPC's answers to its outcomes are tested in test_request_body.py and test_grpc_messages.py)."""

from __future__ import annotations

import gzip
import random
import struct
import zlib
from collections.abc import Iterable

import pytest

from tritonshare.proxy.inflation import (
    INFLATE_GRACE_BYTES,
    MAX_INFLATE_RATIO,
    MAX_INFLATED_BYTES,
    STEP,
    CorruptStream,
    InflatesTooFar,
    Inflation,
    inflates_too_far,
)

GZIP = 31  # the wbits of a gzip stream (the proxy's REST side reads either header: 47)


def _inflate(stream: Inflation, pieces: Iterable[bytes]) -> list[bytes]:
    return [out for piece in pieces for out in stream.steps(piece)]


def _split(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


@pytest.mark.parametrize(
    ("inflated", "compressed", "too_far"),
    [
        (INFLATE_GRACE_BYTES, 1, False),  # any ratio within the first MiB (a small body of repeats is legitimate)
        (INFLATE_GRACE_BYTES + 1, 1, True),
        (MAX_INFLATE_RATIO * 20_000, 20_000, False),  # exactly the ratio
        (MAX_INFLATE_RATIO * 20_000 + 1, 20_000, True),
        (MAX_INFLATED_BYTES, 1 << 30, False),  # Triton's int still holds it
        (MAX_INFLATED_BYTES + 1, 1 << 30, True),
    ],
)
def test_the_inflate_bound_at_its_edges(inflated: int, compressed: int, too_far: bool) -> None:
    assert inflates_too_far(inflated, compressed) is too_far


@pytest.mark.parametrize(("size", "too_far"), [(INFLATE_GRACE_BYTES, False), (INFLATE_GRACE_BYTES + 1, True)])
def test_zeros_inflate_up_to_the_grace_whatever_their_ratio(size: int, too_far: bool) -> None:
    packed = gzip.compress(bytes(size))  # ~1000x
    stream = Inflation(GZIP)
    if too_far:
        with pytest.raises(InflatesTooFar):
            _inflate(stream, _split(packed, 7))  # however the input is split
    else:
        assert b"".join(_inflate(stream, _split(packed, 7))) == bytes(size)
        assert stream.eof and stream.inflated == size and stream.compressed == len(packed)


def _at_ratio(excess: int) -> bytes:
    """A gzip stream of zeros that inflates to exactly MAX_INFLATE_RATIO times its size plus ``excess`` bytes, past
    the grace: its header's comment (read, inflating to nothing) makes up the size."""
    size = MAX_INFLATE_RATIO * 11_000 + excess  # ~1.05 MiB
    deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    body = deflate.compress(bytes(size)) + deflate.flush()
    trailer = struct.pack("<II", zlib.crc32(bytes(size)), size)
    comment = b"c" * (11_000 - 10 - 1 - len(body) - len(trailer))
    packed = b"\x1f\x8b\x08\x10" + bytes(4) + b"\x00\xff" + comment + b"\x00" + body + trailer  # FCOMMENT set
    assert len(packed) == 11_000 and gzip.decompress(packed) == bytes(size)
    return packed


@pytest.mark.parametrize(("excess", "too_far"), [(0, False), (1, True)], ids=["exactly-the-ratio", "one-byte-past"])
def test_a_stream_inflates_to_exactly_the_ratio_and_no_further(excess: int, too_far: bool) -> None:
    packed = _at_ratio(excess)
    stream = Inflation(GZIP)
    if too_far:
        with pytest.raises(InflatesTooFar):
            _inflate(stream, [packed])
        assert stream.inflated > INFLATE_GRACE_BYTES  # (refused for the ratio, not the grace)
    else:
        _inflate(stream, [packed])
        assert stream.eof and stream.inflated == MAX_INFLATE_RATIO * stream.compressed > INFLATE_GRACE_BYTES


@pytest.mark.parametrize(("size", "too_far"), [(4096, False), (4097, True)])
def test_the_absolute_bound_holds_whatever_the_ratio(size: int, too_far: bool) -> None:
    # The 2 GiB ceiling, made small: noise inflates ~1x, far within the ratio.
    packed = gzip.compress(random.Random(1).randbytes(size))
    stream = Inflation(GZIP, ceiling=4096)
    if too_far:
        with pytest.raises(InflatesTooFar):
            _inflate(stream, [packed])
    else:
        assert len(b"".join(_inflate(stream, [packed]))) == size and stream.eof


def test_output_comes_in_bounded_steps_and_a_step_past_the_bound_is_never_handed_out() -> None:
    data = random.Random(2).randbytes(1 << 20) + bytes(3 << 20) + b"end"
    packed = gzip.compress(data)
    steps = _inflate(Inflation(GZIP), [packed])
    assert b"".join(steps) == data and all(0 < len(out) <= STEP for out in steps)
    bomb = gzip.compress(bytes(8 << 20))
    stream, seen = Inflation(GZIP), 0
    with pytest.raises(InflatesTooFar):
        for out in stream.steps(bomb):
            seen += len(out)
    assert seen == INFLATE_GRACE_BYTES  # the first step, within the grace; the next went past the bound


def test_steps_end_at_what_the_caller_keeps() -> None:
    data = random.Random(3).randbytes(3 << 20)
    steps = list(Inflation(GZIP).steps(gzip.compress(data), keep=1000))
    assert len(steps[0]) == 1000 and all(len(out) <= STEP for out in steps) and b"".join(steps) == data


@pytest.mark.parametrize(
    "packed",
    [
        b"not compressed at all",
        gzip.compress(b"x" * 1000)[:10] + b"\xff" * 8,  # a good header, then a block of no type deflate has
        zlib.compress(b"a zlib header where gzip is read"),
    ],
    ids=["no-header", "bad-deflate", "wrong-header"],
)
def test_a_corrupt_stream_is_its_own_outcome(packed: bytes) -> None:
    with pytest.raises(CorruptStream) as caught:
        _inflate(Inflation(GZIP), _split(packed, 5))
    assert str(caught.value)  # zlib's reason, for the caller's answer


def test_a_truncated_stream_has_not_ended() -> None:
    packed = gzip.compress(b"some json")
    stream = Inflation(GZIP)
    assert b"".join(_inflate(stream, [packed[:-6]])) == b"some json" and not stream.eof


def test_what_follows_the_end_of_the_stream_is_counted_not_inflated() -> None:
    packed = gzip.compress(b"first")
    second = gzip.compress(b"second")  # another gzip member: Triton stops at the first one's end
    stream = Inflation(GZIP)
    assert _inflate(stream, [packed + second[:10], second[10:]]) == [b"first"]
    assert stream.eof and stream.trailing == len(second) and stream.inflated == len(b"first")
    ended = Inflation(GZIP)
    _inflate(ended, [packed])
    assert ended.eof and ended.trailing == 0


def test_what_follows_a_stream_that_ends_in_a_later_step_is_counted_and_inflating_stops() -> None:
    # zlib leaves the bytes after the end as unconsumed input too when the stream ends in a later step of a call:
    # fed back, they came back forever (the gRPC loop spun on them).
    data = random.Random(4).randbytes(64 << 10) + bytes(2 << 20)
    stream = Inflation(GZIP)
    assert b"".join(stream.steps(gzip.compress(data) + b"\x08\x01")) == data
    assert stream.eof and stream.trailing == 2


def test_empty_input_yields_nothing() -> None:
    stream = Inflation(GZIP)
    assert _inflate(stream, [b"", b""]) == [] and not stream.eof and stream.compressed == stream.inflated == 0
    empty = Inflation(GZIP)  # a whole stream of nothing
    assert _inflate(empty, [gzip.compress(b"")]) == [] and empty.eof and empty.trailing == 0
