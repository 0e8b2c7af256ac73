"""The elements each input of a gRPC infer request declares, read from its bytes (whole, or fed in pieces), and the
walkers' refusal of a message that cannot carry them: held against protobuf's own reading of the same bytes
(tritonclient's classes, what Triton parses).
"""

from __future__ import annotations

import gzip
import math
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2 as pb

from tests.proxy.test_grpc_messages import INFER, OWN, STATS, _varint, framed, inspect
from tritonshare.proxy.grpc_messages import MessageInspector, MessageJudge
from tritonshare.proxy.policy import GRPC_INVALID_ARGUMENT
from tritonshare.proxy.protobuf import MalformedMessage, MessageWalker
from tritonshare.proxy.shapes import NEGATIVE_DIM, SHAPE_FLOOR, TOO_MANY, InputShape, declared

Tensor = pb.ModelInferRequest.InferInputTensor
DIMS = st.one_of(
    st.integers(0, 127),
    st.integers(0, 300),
    st.integers(0, 2**63 - 1),
    st.integers(-(2**63), -1),
    st.sampled_from([2**62, 10**12, 2**63 - 1, -1]),
)


def _dim(value: int) -> bytes:
    return _varint(value & (2**64 - 1))  # int64: a negative dim is 10 bytes


@st.composite
def input_bytes(draw: st.DrawFn) -> bytes:
    """An input's bytes: its name, datatype, shape (any number of occurrences, packed or not) and typed contents,
    in any order."""
    fields = [b"\x0a\x06INPUT0", b"\x12\x04FP32"]
    for dims in draw(st.lists(st.lists(DIMS, max_size=5), max_size=3)):
        if draw(st.booleans()):
            packed = b"".join(map(_dim, dims))
            fields.append(b"\x1a" + _varint(len(packed)) + packed)
        else:
            fields.extend(b"\x18" + _dim(dim) for dim in dims)
    contents = draw(st.binary(max_size=40))
    if draw(st.booleans()):  # (without: the layout declared() reads at a glance, when in field order)
        fields.append(b"\x2a" + _varint(len(contents) + 2) + b"\x6a" + _varint(len(contents)) + contents)
    return b"".join(fields if draw(st.booleans()) else draw(st.permutations(fields)))


def protobuf_elements(data: bytes) -> int:
    shape = list(Tensor.FromString(data).shape)
    return NEGATIVE_DIM if any(dim < 0 for dim in shape) else min(math.prod(shape), TOO_MANY)


@settings(max_examples=300, deadline=None)
@given(data=input_bytes(), cuts=st.lists(st.integers(0, 400), max_size=5))
def test_declared_elements_are_protobufs_product_whole_or_in_pieces(data: bytes, cuts: list[int]) -> None:
    expected = protobuf_elements(data)
    assert declared(data, 0, len(data)) == expected
    shape = InputShape()
    bounds = [0, *sorted(c % (len(data) + 1) for c in cuts), len(data)]
    for start, end in zip(bounds, bounds[1:], strict=False):
        shape.feed(data, start, end)
    assert shape.finish() == expected
    assert shape.name == b"INPUT0" and shape.dims[:8] == list(Tensor.FromString(data).shape)[:8]


@pytest.mark.parametrize(
    "data",
    [b"\x1a\x02\x80", b"\x1a\x05\x01", b"\x1b", b"\x00\x01", b"\x18" + b"\xff" * 11, b"\x9a\x80\x80\x80\x10\x01\x01"],
    ids=["packed-ends-in-varint", "past-the-end", "group", "field-0", "long-varint", "wide-tag"],
)
def test_an_input_that_is_no_message_is_malformed(data: bytes) -> None:
    with pytest.raises(ValueError):
        declared(data, 0, len(data))
    shape = InputShape()
    with pytest.raises(ValueError):
        shape.feed(data, 0, len(data))
        shape.finish()
    message = framed(pb.ModelInferRequest(model_name="own").SerializeToString() + b"\x2a" + _varint(len(data)) + data)
    refused = inspect(message)
    assert refused is not None and refused.status == GRPC_INVALID_ARGUMENT and refused.reason == "malformed"


_NOISE = random.Random(7).randbytes(SHAPE_FLOOR + 4000)


def declaring(shape: list[int], contents: int = 0) -> bytes:
    request = pb.ModelInferRequest(model_name="own")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=shape)
    request.raw_input_contents.append(_NOISE[:contents])  # (noise: it does not compress)
    return request.SerializeToString()


def carried_exactly(extra: int) -> bytes:
    """A message whose input declares exactly ``extra`` elements more than the message's length (above the floor)."""
    contents = SHAPE_FLOOR + 100
    message = declaring([contents], contents)
    for _ in range(3):  # (the shape's varint grows with it: settle its length)
        message = declaring([len(message) + extra], contents)
    assert declared(message, message.index(b"\x2a") + 2, message.index(b"\x3a")) == len(message) + extra
    return message


@pytest.mark.parametrize(
    ("message", "refused"),
    [
        (declaring([2**62]), True),
        (declaring([10**6, 10**6]), True),
        (declaring([2**63 - 1]), True),
        (declaring([SHAPE_FLOOR]), False),  # the floor, whatever the message
        (declaring([SHAPE_FLOOR + 1]), True),
        (declaring([2, -1, 2**62]), True),
        (declaring([-(2**31), -(2**31)]), True),  # 2**62 elements: 0 bytes of FP32 in Triton's 64-bit check
        (declaring([-2, -3], 24), True),
        (declaring([-2, 0]), True),  # (a negative dim refuses whatever follows)
        (declaring([0, 2**62]), False),
        (carried_exactly(0), False),
        (carried_exactly(1), True),
    ],
    ids=[
        "2**62",
        "10**12",
        "2**63-1",
        "floor",
        "floor+1",
        "negative",
        "two-negatives",
        "small-negatives",
        "negative-then-0",
        "zero",
        "carried",
        "carried+1",
    ],
)
def test_an_input_declaring_more_than_the_message_carries_is_refused_wherever_it_splits(
    message: bytes, refused: bool
) -> None:
    data = framed(message)
    cuts = range(0, min(len(data), 40)) if len(data) > 1000 else range(len(data) + 1)
    verdicts = {inspect(data, cut) for cut in [*cuts, len(data) - 1]}
    if not refused:
        assert verdicts == {None}
        return
    assert len(verdicts) == 1
    (refusal,) = verdicts
    assert refusal is not None and refusal.status == GRPC_INVALID_ARGUMENT and refusal.reason == "shape"
    said = "has a negative dim" if re.search(r"of shape \[[^\]]*-", refusal.message) else "declares more elements"
    assert "input 'INPUT0' of shape [" in refusal.message and said in refusal.message


def test_a_compressed_message_is_bounded_by_its_inflated_length() -> None:
    refusal = inspect(framed(gzip.compress(declaring([2**62])), compressed=True), encoding=b"gzip")
    assert refusal is not None and refusal.reason == "shape"
    assert inspect(framed(gzip.compress(carried_exactly(0)), compressed=True), encoding=b"gzip") is None


def test_other_rpcs_do_not_read_shapes() -> None:
    assert inspect(framed(declaring([2**62])), rule=STATS) is None


@settings(max_examples=60, deadline=None)
@given(
    first=st.one_of(st.integers(0, 3000), st.integers(SHAPE_FLOOR, SHAPE_FLOOR + 3000)),
    declared_first=st.integers(SHAPE_FLOOR - 10, SHAPE_FLOOR + 6000),
    tail=st.lists(st.integers(SHAPE_FLOOR - 10, SHAPE_FLOOR + 12000), max_size=2),
    contents=st.integers(0, 3000),
)
def test_a_remembered_message_judges_the_next_as_a_fresh_walk_would(
    first: int, declared_first: int, tail: list[int], contents: int
) -> None:
    # The connection's walker remembers a clean message's leading fields (its input included) and takes the next
    # message with the same ones on trust when it is as long, else walks what follows them: the shape bound, which
    # depends on the message's length, must come out as a walk from the start says. (The fields that follow:
    # more inputs, more contents.)
    leading = declaring([declared_first], first)
    more = pb.ModelInferRequest()
    for dims in tail:
        more.inputs.add(name="INPUT1", datatype="FP32", shape=[dims])
    more.raw_input_contents.append(_NOISE[:contents])
    remembering = MessageWalker(inspect=True, limit=1 << 20)
    judge = MessageJudge(INFER, OWN, limit=1 << 20, walker=remembering)
    for message, dims in ((leading, [declared_first]), (leading + more.SerializeToString(), [declared_first, *tail])):
        data = framed(message)
        fresh = MessageInspector(MessageJudge(INFER, OWN, limit=1 << 20), encoding=None).feed(data, 0, len(data))
        assert (fresh is None) == all(n <= max(len(message), SHAPE_FLOOR) for n in dims), "fresh walk"
        assert MessageInspector(judge, encoding=None).feed(data, 0, len(data)) == fresh
        assert judge.whole(data, 0, len(data)) == (fresh if fresh is not None else len(data))


def test_a_malformed_input_raises_what_the_walker_refuses() -> None:
    with pytest.raises(MalformedMessage):
        MessageWalker(inspect=True, limit=1 << 20).walk(b"\x2a\x01\x1b", 0, 3)
