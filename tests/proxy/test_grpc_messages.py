"""Reading model names and shared-memory parameters from gRPC request messages as they stream past.

Messages are built with tritonclient's own protobuf classes (what Triton parses), then cut into DATA
chunks at every possible place: the verdict must not depend on where frames split a message.
"""

from __future__ import annotations

import gzip
import random
import struct
import zlib
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2 as pb

from tritonshare.proxy.grpc_messages import MessageInspector, MessageJudge, Refusal
from tritonshare.proxy.policy import (
    GRPC_INVALID_ARGUMENT,
    GRPC_NOT_FOUND,
    GRPC_PERMISSION_DENIED,
    GRPC_RESOURCE_EXHAUSTED,
    GRPC_RULES,
    GRPC_SERVICE,
    GRPC_UNIMPLEMENTED,
    GrpcRule,
)
from tritonshare.proxy.protobuf import MalformedMessage, MessageWalker, length_delimited

OWN = b"own"
INFER = GRPC_RULES[f"/{GRPC_SERVICE}/ModelInfer"]
STREAM = GRPC_RULES[f"/{GRPC_SERVICE}/ModelStreamInfer"]
STATS = GRPC_RULES[f"/{GRPC_SERVICE}/ModelStatistics"]


def framed(message: bytes, *, compressed: bool = False) -> bytes:
    return bytes([int(compressed)]) + struct.pack(">L", len(message)) + message


def infer(model: str = "own", **kwargs: object) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model, id="req-1", **kwargs)
    tensor = request.inputs.add(name="INPUT0", datatype="FP32", shape=[4])
    tensor.parameters["binary_data_size"].int64_param = 16
    request.outputs.add(name="OUTPUT0")
    request.raw_input_contents.append(bytes(range(16)))
    return request


def inspect(
    data: bytes, *cuts: int, rule: GrpcRule = INFER, encoding: bytes | None = None, limit: int = 1 << 20
) -> Refusal | None:
    """Feed ``data`` to a fresh inspector in pieces split at ``cuts``; the first refusal, if any."""
    inspector = MessageInspector(MessageJudge(rule, OWN, limit=limit), encoding=encoding)
    bounds = [0, *sorted(cuts), len(data)]
    for start, end in zip(bounds, bounds[1:], strict=False):
        refusal = inspector.feed(data, start, end)
        if refusal is not None:
            return refusal
    return None


def every_cut(data: bytes, **kwargs: object) -> set[Refusal | None]:
    return {inspect(data, cut, **kwargs) for cut in range(len(data) + 1)}  # type: ignore[arg-type]


def test_own_model_passes_wherever_the_frames_split_it() -> None:
    assert every_cut(framed(infer().SerializeToString())) == {None}


def test_other_model_is_not_found_wherever_the_frames_split_it() -> None:
    verdicts = every_cut(framed(infer("other").SerializeToString()))
    assert verdicts == {Refusal(GRPC_NOT_FOUND, "Request for unknown model: 'other' is not found", "other_model")}


def test_the_last_model_name_wins_as_in_protobuf() -> None:
    own_then_other = infer().SerializeToString() + b"\x0a\x05other"
    parsed = pb.ModelInferRequest.FromString(own_then_other)
    assert parsed.model_name == "other"  # what Triton would read
    assert {r.status for r in every_cut(framed(own_then_other)) if r} == {GRPC_NOT_FOUND}
    assert None not in every_cut(framed(own_then_other))
    other_then_own = infer("other").SerializeToString() + b"\x0a\x03own"
    assert every_cut(framed(other_then_own)) == {None}


def test_model_name_after_the_raw_contents_is_read() -> None:
    request = infer()
    request.ClearField("model_name")
    late = request.SerializeToString() + b"\x0a\x03own"
    assert every_cut(framed(late)) == {None}
    late_other = request.SerializeToString() + b"\x0a\x05other"
    assert inspect(framed(late_other), 9) is not None


def test_missing_or_empty_model_name_is_refused() -> None:
    assert inspect(framed(b""), rule=STATS) == Refusal(
        GRPC_NOT_FOUND, "Request for unknown model: '' is not found", "other_model"
    )
    assert inspect(framed(b"\x0a\x00"), rule=STATS) is not None


def test_field_one_with_another_wire_type_is_not_a_name() -> None:
    # protobuf treats field 1 as a varint here as an unknown field: the name stays "own"
    message = b"\x0a\x03own" + b"\x08\x05"
    assert pb.ModelInferRequest.FromString(message).model_name == "own"
    assert inspect(framed(message)) is None


def test_every_message_of_a_stream_is_judged() -> None:
    stream = framed(infer().SerializeToString()) * 2 + framed(infer("other").SerializeToString())
    inspector = MessageInspector(MessageJudge(STREAM, OWN, limit=1 << 20), encoding=None)
    first_two = 2 * len(framed(infer().SerializeToString()))
    assert inspector.feed(stream, 0, first_two) is None
    refusal = inspector.feed(stream, first_two, len(stream))
    assert refusal is not None and refusal.status == GRPC_NOT_FOUND


@pytest.mark.parametrize("where", ["request", "input", "output"])
@pytest.mark.parametrize("key", ["shared_memory_region", "shared_memory_offset", "shared_memory_byte_size"])
def test_shared_memory_parameters_are_refused_wherever_they_are(where: str, key: str) -> None:
    request = infer()
    target = {
        "request": request.parameters,
        "input": request.inputs[0].parameters,
        "output": request.outputs[0].parameters,
    }[where]
    target[key].string_param = "region"
    verdicts = every_cut(framed(request.SerializeToString()))
    assert verdicts == {
        Refusal(GRPC_PERMISSION_DENIED, "shared-memory parameters are not available to tenants", "shared_memory")
    }


def test_marker_in_a_value_or_in_raw_contents_is_not_a_parameter() -> None:
    request = infer()
    request.parameters["note"].string_param = "shared_memory_region"  # a value, not a key
    request.raw_input_contents.append(b"shared_memory_region")  # tensor bytes are never parameters
    assert every_cut(framed(request.SerializeToString())) == {None}


def test_other_rpcs_do_not_inspect_parameters() -> None:
    request = infer()
    request.parameters["shared_memory_region"].string_param = "r"
    assert inspect(framed(request.SerializeToString()), rule=STATS) is None  # name only for non-infer RPCs


def test_oversized_parameters_with_the_marker_are_refused() -> None:
    request = infer()
    request.parameters["note"].string_param = "shared_memory_" + "x" * 2000
    data = framed(request.SerializeToString())
    assert inspect(data, limit=100) == Refusal(
        GRPC_RESOURCE_EXHAUSTED,
        "request parameters mention shared memory and are larger than the 100 bytes the proxy checks",
        "too_large",
    )
    assert inspect(data, 40, 700, limit=100) is not None
    assert inspect(data, limit=1 << 20) is None


@pytest.mark.parametrize("encoding", [b"gzip", b"deflate"])
def test_compressed_messages_are_inspected(encoding: bytes) -> None:
    def compress(data: bytes) -> bytes:
        return gzip.compress(data) if encoding == b"gzip" else zlib.compress(data)

    good = framed(compress(infer().SerializeToString()), compressed=True)
    bad = framed(compress(infer("other").SerializeToString()), compressed=True)
    assert every_cut(good, encoding=encoding) == {None}
    assert {r.status for r in every_cut(bad, encoding=encoding) if r} == {GRPC_NOT_FOUND}


def test_a_compressed_message_of_millions_of_tiny_fields_is_refused_not_walked() -> None:
    # 2-byte fields compress ~1000:1: a few KiB held the event loop for seconds while every field was walked
    own = pb.ModelInferRequest(model_name="own").SerializeToString()
    bomb = framed(gzip.compress(own + b"\x10\x00" * (4 << 20)), compressed=True)
    assert len(bomb) < 64 << 10
    for cuts in ((), (100,), (7, 3000)):
        refusal = inspect(bomb, *cuts, encoding=b"gzip")
        assert refusal is not None and refusal.status == GRPC_INVALID_ARGUMENT
        assert "more fields than its size allows" in refusal.message


def test_a_compressed_request_with_many_inputs_is_walked_whole() -> None:
    request = pb.ModelInferRequest(model_name="own", id="req-1")
    for i in range(500):
        tensor = request.inputs.add(name=f"INPUT{i}", datatype="FP32", shape=[4])
        tensor.parameters["binary_data_size"].int64_param = 16
        request.raw_input_contents.append(bytes(16))  # zeros: as compressible as tensors get
    request.outputs.add(name="OUTPUT0")
    message = framed(gzip.compress(request.SerializeToString()), compressed=True)
    assert inspect(message, encoding=b"gzip") is None
    assert inspect(message, 10, len(message) // 2, encoding=b"gzip") is None
    other = framed(gzip.compress(infer("other").SerializeToString()), compressed=True)
    assert inspect(other, encoding=b"gzip") is not None  # walked to its end, as before


def _gzip_stream(*parts: bytes) -> bytes:
    stream = zlib.compressobj(6, zlib.DEFLATED, 31)
    return b"".join(stream.compress(part) for part in parts) + stream.flush()


def _contents_head(size: int) -> bytes:
    """The tag and length of a raw_input_contents field (7) of ``size`` bytes."""
    length = bytearray()
    while size >= 0x80:
        length.append(size & 0x7F | 0x80)
        size >>= 7
    return b"\x3a" + bytes([*length, size])


def test_a_compressed_message_that_inflates_too_far_is_refused_before_it_ends() -> None:
    # Triton's gRPC server inflates a message whole before checking its size: 1 MB of gzip took it up 2.3 GB.
    own = infer().SerializeToString()
    packed = _gzip_stream(own, _contents_head(256 << 20), *[bytes(1 << 20)] * 256)  # 256 MiB in ~256 KiB
    message = framed(packed, compressed=True)
    inspector = MessageInspector(MessageJudge(INFER, OWN, limit=1 << 20), encoding=b"gzip")
    fed, refusal = 0, None
    while refusal is None and fed < len(message):
        refusal = inspector.feed(message, fed, min(fed + 16384, len(message)))  # DATA frames of 16 KiB
        fed += 16384
    assert refusal is not None and refusal.status == GRPC_RESOURCE_EXHAUSTED and refusal.reason == "too_large"
    assert "inflates to more than 100 times its size" in refusal.message and "send it uncompressed" in refusal.message
    assert fed < 64 << 10  # refused once the first MiB of zeros inflated, long before the end reached Triton


def test_a_compressed_message_within_the_inflate_bound_passes() -> None:
    noise = random.Random(0)
    tensor = b"".join(noise.randbytes(2048) + bytes(30720) for _ in range(128))  # 4 MiB, inflating ~15x
    request = infer()
    request.raw_input_contents[0] = tensor
    message = framed(_gzip_stream(request.SerializeToString()), compressed=True)
    assert inspect(message, encoding=b"gzip") is None
    assert inspect(message, 100, len(message) // 2, encoding=b"gzip") is None


@pytest.mark.timeout(10)
def test_bytes_after_a_compressed_message_that_inflates_past_a_step_are_refused_not_spun_on() -> None:
    # The stream ends in a later 1 MiB step than the first of its read: zlib then leaves the bytes after its end
    # as unconsumed input too, and the proxy's inflate loop fed them back forever (its event loop at 100% CPU).
    noise = random.Random(0)
    request = infer()
    request.raw_input_contents[0] = b"".join(noise.randbytes(2048) + bytes(30720) for _ in range(128))  # ~15x
    packed = _gzip_stream(request.SerializeToString()) + b"\x08\x01"
    message = framed(packed, compressed=True)
    refusal = MessageInspector(MessageJudge(INFER, OWN, limit=1 << 20), encoding=b"gzip").feed(message, 0, len(message))
    assert refusal is not None and refusal.status == GRPC_INVALID_ARGUMENT
    assert "has 2 bytes after its b'gzip' stream ends" in refusal.message


def test_compression_the_proxy_cannot_read_is_unimplemented() -> None:
    refusal = inspect(framed(b"\x00\x01", compressed=True), encoding=b"snappy")
    assert refusal is not None and refusal.status == GRPC_UNIMPLEMENTED and "snappy" in refusal.message


@pytest.mark.parametrize(
    "message",
    [
        b"\x0a\x09own",  # field runs past the message
        b"\x0b\x00",  # group start (wire type 3)
        b"\x0e\x00",  # wire type 6
        b"\x02\x00",  # field number 0
        b"\x0a\x03own\x28",  # ends inside a varint field
    ],
)
def test_malformed_messages_are_refused(message: bytes) -> None:
    verdicts = every_cut(framed(message))
    assert {r.status for r in verdicts if r} == {GRPC_INVALID_ARGUMENT}
    assert None not in verdicts


WIDE_NAME_TAG = bytes([0x8A, 0x80, 0x80, 0x80, 0x10])  # 10 + 2**32: field 1 to protobuf's C++ parser


def test_a_tag_wider_than_32_bits_is_refused_not_skipped() -> None:
    # Triton's C++ parser keeps a tag's low 32 bits: this last field is model_name "other" to Triton.
    message = infer().SerializeToString() + WIDE_NAME_TAG + b"\x05other"
    verdicts = every_cut(framed(message))
    assert {r.status for r in verdicts if r} == {GRPC_INVALID_ARGUMENT} and None not in verdicts
    walker = MessageWalker(inspect=True, limit=1 << 20)
    with pytest.raises(MalformedMessage, match="wider than 32 bits"):
        walker.walk(message, 0, len(message))


def test_a_shared_memory_key_behind_a_wide_tag_is_refused() -> None:
    param = pb.InferParameter(string_param="region").SerializeToString()
    key = b"shared_memory_region"
    entry = WIDE_NAME_TAG + bytes([len(key)]) + key + b"\x12" + bytes([len(param)]) + param  # map key: field 1
    tensor = pb.ModelInferRequest.InferInputTensor(name="INPUT0", datatype="FP32", shape=[4]).SerializeToString()
    tensor += b"\x22" + bytes([len(entry)]) + entry  # InferInputTensor.parameters (field 4)
    message = b"\x0a\x03own\x2a" + bytes([len(tensor)]) + tensor  # ModelInferRequest.inputs (field 5)
    verdicts = every_cut(framed(message))
    assert None not in verdicts and {r.status for r in verdicts if r} <= {GRPC_INVALID_ARGUMENT, GRPC_PERMISSION_DENIED}
    with pytest.raises(MalformedMessage, match="wider than 32 bits"):
        list(length_delimited(entry))


def test_a_long_but_32_bit_tag_is_read_as_its_field() -> None:
    # Non-canonical, yet within 32 bits: field 1 to protobuf, and to the proxy.
    message = infer().SerializeToString() + bytes([0x8A, 0x80, 0x80, 0x80, 0x00]) + b"\x05other"
    assert pb.ModelInferRequest.FromString(message).model_name == "other"
    assert {r.status for r in every_cut(framed(message)) if r} == {GRPC_NOT_FOUND}


def test_truncated_compressed_stream_is_refused() -> None:
    partial = gzip.compress(infer().SerializeToString())[:-6]
    refusal = inspect(framed(partial, compressed=True), encoding=b"gzip")
    assert refusal is not None and refusal.status == GRPC_INVALID_ARGUMENT


def test_large_raw_contents_are_skipped_not_buffered() -> None:
    request = infer()
    request.raw_input_contents[0] = b"\x01" * (8 << 20)
    data = framed(request.SerializeToString())
    assert inspect(data, *range(1, len(data), 16_384), limit=1024) is None


def test_whole_messages_are_judged_up_to_the_first_that_is_not_whole() -> None:
    # The relay judges messages lying whole in a DATA frame with no state of the stream's, and hands the
    # first one that does not (split across frames, or compressed) to the stream's inspector.
    judge = MessageJudge(STREAM, OWN, limit=1 << 20)
    own, other = framed(infer().SerializeToString()), framed(infer("other").SerializeToString())
    compressed = framed(gzip.compress(infer().SerializeToString()), compressed=True)
    assert judge.whole(own + own, 0, 2 * len(own)) == 2 * len(own)
    assert judge.whole(own + own, 0, len(own) + 7) == len(own)  # the second is cut: it starts there
    assert judge.whole(own + compressed, 0, len(own) + len(compressed)) == len(own)
    refusal = judge.whole(own + other + own, 0, 3 * len(own) + 2)
    assert isinstance(refusal, Refusal) and refusal.status == GRPC_NOT_FOUND
    malformed = judge.whole(framed(b"\x0b\x00"), 0, 7)
    assert isinstance(malformed, Refusal) and malformed.status == GRPC_INVALID_ARGUMENT


def test_messages_of_a_connection_repeating_leading_fields_are_still_judged_whole() -> None:
    # One walker per connection remembers the leading fields of the last clean message: what follows them, and
    # a message that only resembles them, must be judged as if walked from the start.
    walker = MessageWalker(inspect=True, limit=1 << 20)

    def judged(message: bytes) -> Refusal | None:
        judge = MessageJudge(INFER, OWN, limit=1 << 20, walker=walker)
        whole = judge.whole(framed(message), 0, len(framed(message)))  # as the relay judges a whole message
        fed = MessageInspector(judge, encoding=None).feed(framed(message), 0, len(framed(message)))
        assert fed == (None if whole == len(framed(message)) else whole)
        return fed

    base = infer().SerializeToString()
    other_contents = infer()
    other_contents.raw_input_contents[0] = bytes(range(16, 32))
    shm = infer()
    shm.parameters["shared_memory_region"].string_param = "r"
    assert judged(base) is None  # remembered: everything before raw_input_contents
    assert judged(other_contents.SerializeToString()) is None
    late_other = judged(base + b"\x0a\x05other")  # the same leading fields, a later name wins
    assert late_other is not None and late_other.status == GRPC_NOT_FOUND
    late_shm = judged(base + shm.SerializeToString().split(b"\x0a\x03own", 1)[1])
    assert late_shm is not None and late_shm.status == GRPC_PERMISSION_DENIED
    first_other = judged(infer("oth").SerializeToString())  # as long as the name, other bytes
    assert first_other is not None and first_other.status == GRPC_NOT_FOUND
    assert judged(base[:-3]) is not None  # cut inside the remembered fields' successor: malformed
    assert judged(base) is None
    # A last field whose value is read (parameters) is never taken on trust, however alike the messages are.
    clean, marked = pb.ModelInferRequest(model_name="own"), pb.ModelInferRequest(model_name="own")
    clean.parameters["x" * len("shared_memory_region")].string_param = "r"
    marked.parameters["shared_memory_region"].string_param = "r"
    assert len(clean.SerializeToString()) == len(marked.SerializeToString())
    assert judged(clean.SerializeToString()) is None
    refused = judged(marked.SerializeToString())
    assert refused is not None and refused.status == GRPC_PERMISSION_DENIED


@settings(max_examples=200, deadline=None)
@given(
    names=st.lists(st.sampled_from(["own", "other", "", "ow", "own2"]), min_size=1, max_size=3),
    raw=st.binary(max_size=300),
    cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=6),
)
def test_verdict_matches_protobuf_for_any_field_order_and_split(names: list[str], raw: bytes, cuts: list[int]) -> None:
    # Fields in any order, the name possibly repeated: allowed exactly when protobuf reads "own".
    pieces = [b"\x0a" + bytes([len(n)]) + n.encode() for n in names]
    body = infer().SerializeToString().split(b"\x0a\x03own", 1)[1]  # the request without its name field
    message = pieces[0] + body + b"".join(pieces[1:]) + b"\x3a" + _varint(len(raw)) + raw
    data = framed(message)
    expected = pb.ModelInferRequest.FromString(message).model_name == "own"
    assert (inspect(data, *[c % (len(data) + 1) for c in cuts]) is None) == expected


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def test_an_empty_message_is_judged_wherever_the_frames_split_it() -> None:
    # An empty ModelStatistics request asks for every model's statistics: it must be judged even when it is the
    # stream's last bytes and its 5-byte prefix came split across frames.
    refused = Refusal(GRPC_NOT_FOUND, "Request for unknown model: '' is not found", "other_model")
    assert every_cut(framed(b""), rule=STATS) == {refused}
    judge = MessageJudge(STATS, OWN, limit=1 << 20)
    assert judge.whole(framed(b""), 0, 5) == refused  # lying whole in one frame: judged there


@pytest.mark.parametrize("cut", [0, 1, 2, 3, 4, 5, 40])
def test_a_stream_of_many_messages_is_counted_and_its_first_end_kept_wherever_it_splits(cut: int) -> None:
    # A prefix split across frames must not be re-read as the start of a message (400 messages: enough bytes
    # for a misread length to seem whole). The relay holds a stream for admission from the first message's end.
    one = framed(infer().SerializeToString())
    data = one * 400
    inspector = MessageInspector(MessageJudge(STREAM, OWN, limit=1 << 20), encoding=None)
    assert inspector.feed(data, 0, cut) is None
    assert inspector.feed(data, cut, len(data)) is None
    assert inspector.messages == 400
    assert inspector.first_end == len(one)


def test_a_compressed_flag_other_than_0_or_1_is_refused() -> None:
    message = bytes([2]) + struct.pack(">L", 5) + b"\x0a\x03own"
    for refusal in every_cut(message, encoding=b"gzip"):
        assert refusal is not None and refusal.status == GRPC_INVALID_ARGUMENT


def test_an_uncompressed_message_after_a_compressed_one_is_read_as_it_is() -> None:
    # gRPC flags each message: a stream with grpc-encoding gzip may send some uncompressed.
    compressed = framed(gzip.compress(infer().SerializeToString()), compressed=True)
    plain = framed(infer().SerializeToString())
    data = compressed + plain
    assert {inspect(data, cut, rule=STREAM, encoding=b"gzip") for cut in range(len(compressed), len(data))} == {None}
    inspector = MessageInspector(MessageJudge(STREAM, OWN, limit=1 << 20), encoding=b"gzip")
    assert inspector.feed(compressed * 3 + plain, 0, 3 * len(compressed) + len(plain)) is None
    assert (inspector.messages, inspector.first_end) == (4, len(compressed))
    other = compressed + framed(infer("other").SerializeToString())
    refusal = inspect(other, len(compressed) + 3, rule=STREAM, encoding=b"gzip")
    assert refusal is not None and refusal.status == GRPC_NOT_FOUND


@pytest.mark.parametrize(("encoding", "packed"), [(b"gzip", zlib.compress), (b"deflate", gzip.compress)])
def test_a_message_compressed_otherwise_than_its_encoding_says_is_refused(
    encoding: bytes, packed: Callable[[bytes], bytes]
) -> None:
    # Triton inflates with the format grpc-encoding names: the proxy must not read another one in its place.
    message = framed(packed(infer().SerializeToString()), compressed=True)
    refusal = inspect(message, encoding=encoding)
    assert refusal is not None and refusal.status == GRPC_INVALID_ARGUMENT


CLASSIFICATION_REFUSED = Refusal(
    GRPC_INVALID_ARGUMENT,
    "the output parameter 'classification' is not available through this proxy: Triton 2.51 divides by zero to "
    "classify a BYTES output, and dies (SIGFPE) with every tenant's model — rank the output in the client",
    "classification",
)


@pytest.mark.parametrize("value", ["int64_param", "string_param"])
def test_the_classification_parameter_of_an_output_is_refused_wherever_the_frames_split_it(value: str) -> None:
    request = infer()
    setattr(request.outputs[0].parameters["classification"], value, 1 if value == "int64_param" else "1")
    data = framed(request.SerializeToString())
    assert every_cut(data) == {CLASSIFICATION_REFUSED}
    assert inspect(data, limit=8) == CLASSIFICATION_REFUSED  # (an output larger than the parameter fields kept)


def test_the_word_classification_that_is_no_output_parameter_passes() -> None:
    request = infer()
    request.outputs.add(name="classification")
    request.outputs[0].parameters["note"].string_param = "classification"
    request.parameters["classification"].int64_param = 1  # (Triton reads it on outputs only)
    request.raw_input_contents.append(b"classification")
    assert every_cut(framed(request.SerializeToString())) == {None}
