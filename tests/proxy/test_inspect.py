"""The checks of an infer request's JSON (shared-memory parameters, nesting, shapes, classification), read the way
Triton reads the body, directly and through the streaming check. Pure logic."""

from __future__ import annotations

import functools
import gzip
import json
import time
import tracemalloc
import zlib
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tritonshare.proxy.inspect import (
    MAX_DEPTH,
    SHAPE_FLOOR,
    BodyRefused,
    check_depth,
    check_json,
    check_shapes,
    long_shapes,
    might_name_shm,
)
from tritonshare.proxy.request_body import InferBodyCheck, check_plain_body

CLEAN: dict[str, Any] = {
    "id": "shared_memory_region",  # the words as a value are fine: only keys are parameters
    "parameters": {"priority": 1},
    "inputs": [{"name": "INPUT0", "shape": [2], "datatype": "FP32", "data": [1, 2], "parameters": {}}],
    "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": False}}],
}


def _with_shm(where: str, key: str = "shared_memory_region") -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(json.dumps(CLEAN))
    target = {"request": doc, "input": doc["inputs"][0], "output": doc["outputs"][0]}[where]
    target["parameters"][key] = "region0"
    return doc


def _refused(call: Any, *args: Any, **kwargs: Any) -> BodyRefused:
    with pytest.raises(BodyRefused) as caught:
        call(*args, **kwargs)
    return caught.value


def test_clean_json_passes() -> None:
    check_json(json.dumps(CLEAN).encode())


def test_the_quick_look_lets_through_only_json_that_cannot_name_a_parameter() -> None:
    assert not might_name_shm(b'{"inputs": [{"name": "INPUT0", "data": [1, 2]}]}')
    assert might_name_shm(json.dumps(CLEAN).encode())  # the words as a value: the full check decides
    assert might_name_shm(b'{"parameters": {"shared\\u005fmemory_region": "r"}}')  # any escape counts
    assert might_name_shm(b'{"a": "\\u00e9"}')
    assert might_name_shm(b'{"a": "say \\"hi\\""}')  # any backslash: the full check decides


@pytest.mark.parametrize("where", ["request", "input", "output"])
@pytest.mark.parametrize("key", ["shared_memory_region", "shared_memory_offset", "shared_memory_byte_size"])
def test_shared_memory_parameters_are_refused_wherever_they_are(where: str, key: str) -> None:
    refusal = _refused(check_json, json.dumps(_with_shm(where, key)).encode())
    assert refusal.status == 400 and key in refusal.message and refusal.reason == "shared_memory"


def test_escaped_and_duplicated_keys_are_seen() -> None:
    escaped = b'{"inputs": [], "parameters": {"shared\\u005fmemory_region": "r"}}'
    assert _refused(check_json, escaped).reason == "shared_memory"
    # rapidjson (Triton) keeps the first of two equal keys, Python's json the last: every pair is checked.
    twice = b'{"parameters": {"shared_memory_region": "r"}, "parameters": {}}'
    assert _refused(check_json, twice).reason == "shared_memory"


def test_unreadable_json_that_might_hide_a_key_is_refused() -> None:
    assert _refused(check_json, b'{"a\\"": 1, "b": "never closed').reason == "bad_json"
    assert _refused(check_json, b'{"x": 1, "shared_memory_region": ').reason == "shared_memory"  # a key all the same


def test_keys_are_found_at_any_depth_in_any_spelling() -> None:
    deep = b'{"a": [' * 5000 + b'{"x": "\\\\", "shared\\u005Fmemory_offset"\r\n :0}' + b"]}" * 5000
    assert _refused(check_json, deep).message.startswith("shared-memory parameter 'shared_memory_offset'")
    spelled = "".join(f"\\u{ord(c):04X}" for c in "shared_memory_byte_size")
    assert _refused(check_json, b'[{"inputs": [{"parameters": {"%s": 1}}]}]' % spelled.encode()).reason == (
        "shared_memory"
    )


@pytest.mark.parametrize(
    "body",
    [
        b'{"id": "say \\"shared_memory_region\\": 1", "inputs": []}',  # a value that looks like a key
        b'{"id": "\\\\", "x": "\\"shared_memory_region\\":", "y": ["shared_memory_offset", ":"]}',
        b'{"shared_memory_region_x": 1, "a\\"shared_memory_region": 2, "shared\\u005fmemory": 3}',  # not the names
    ],
)
def test_what_is_not_a_key_is_not_refused(body: bytes) -> None:
    assert not set(_keys(body)) & {"shared_memory_region", "shared_memory_offset", "shared_memory_byte_size"}
    check_json(body)  # Python's parser agrees: no such key


def _keys(body: bytes) -> list[str]:
    found: list[str] = []
    json.loads(body, object_pairs_hook=lambda pairs: found.extend(k for k, _ in pairs))
    return found


def test_a_large_body_with_an_escape_is_checked_in_bounded_memory_and_time() -> None:
    """Regression: any backslash made the check parse the whole document (48 MB of JSON: 722 MB peak, the event
    loop blocked 2.5 s). The keys are now found by one scan of the bytes (the quick look's ``partition`` copies
    the body once, briefly, and so does the nesting check's removal of escapes)."""
    data = ",".join(['"a\\"b"'] * 1_000_000 + ["1.5"] * 2_000_000)
    body = b'{"id": "\\n", "inputs": [{"name": "INPUT0", "data": [%s]}]}' % data.encode()
    tracemalloc.start()
    started = time.perf_counter()
    try:
        check_json(body)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    took = time.perf_counter() - started
    # one copy more: the nesting check drops the escapes before it looks at the brackets
    assert took < 1.0 and peak < 2 * len(body) + (1 << 20), f"{len(body)} bytes: {took:.2f} s, peak {peak} bytes"
    assert _refused(check_json, body[:-3] + b', "shared_memory_region": 1}]}').reason == "shared_memory"


def _check(body: bytes, *, encoding: str = "", json_length: int | None = None, limit: int = 1 << 20) -> bool:
    """Feed ``body`` one byte at a time, as the slowest client would; True once the JSON part is judged."""
    check = InferBodyCheck(encoding=encoding, json_length=json_length, max_json_bytes=limit)
    for i in range(len(body)):
        released = check.feed(body[i : i + 1])
        if released is not None:
            assert b"".join(released) == body[: i + 1]  # what was held is handed back, to be forwarded
            return True
    assert b"".join(check.finish()) == body
    return False


def test_binary_extension_judges_only_the_json_header() -> None:
    header = json.dumps(CLEAN).encode()
    binary = b"shared_memory_region" * 10  # tensor bytes are not JSON
    assert _check(header + binary, json_length=len(header)) is True
    bad = json.dumps(_with_shm("input")).encode()
    assert _refused(_check, bad + binary, json_length=len(bad)).reason == "shared_memory"


@pytest.mark.parametrize("compress", [gzip.compress, zlib.compress], ids=["gzip", "deflate"])
def test_compressed_bodies_are_decoded_before_the_check(compress: Any) -> None:
    encoding = "gzip" if compress is gzip.compress else "deflate"
    assert _check(compress(json.dumps(CLEAN).encode()), encoding=encoding) is False
    bad = json.dumps(_with_shm("request")).encode()
    assert _refused(_check, compress(bad), encoding=encoding).reason == "shared_memory"
    binary_bad = compress(bad + b"\x00" * 1000)
    assert _refused(_check, binary_bad, encoding=encoding, json_length=len(bad)).reason == "shared_memory"


def _escape_all(text: str) -> str:
    return '"' + "".join(f"\\u{ord(c):04x}" for c in text) + '"'


_SHM_NAMES = ("shared_memory_region", "shared_memory_offset", "shared_memory_byte_size")
_key_text = st.one_of(
    st.sampled_from(_SHM_NAMES),
    st.sampled_from(_SHM_NAMES).map(lambda name: name[:-1]),
    st.sampled_from(["inputs", "data", 'a"b', "a\\", "x"]),
)
_Spelling = Callable[[str], str]
_spellings: st.SearchStrategy[_Spelling] = st.sampled_from(
    [json.dumps, functools.partial(json.dumps, ensure_ascii=False), _escape_all]
)
_value_text = st.one_of(
    st.text(max_size=8), st.sampled_from(['"shared_memory_region": 1', '\\", "shared_memory_offset":'])
)


def _json(depth: int) -> st.SearchStrategy[str]:
    leaf = st.one_of(st.integers().map(str), _value_text.map(json.dumps))
    if depth == 0:
        return leaf
    inner = _json(depth - 1)
    key = st.tuples(_key_text, _spellings).map(lambda pair: pair[1](pair[0]))
    pairs = st.lists(st.tuples(key, st.sampled_from([":", " :", "\n:"]), inner), max_size=3)
    objects = pairs.map(lambda items: "{" + ", ".join(k + sep + v for k, sep, v in items) + "}")
    arrays = st.lists(inner, max_size=3).map(lambda items: "[" + ",".join(items) + "]")
    return st.one_of(leaf, objects, arrays)


@settings(max_examples=300, deadline=None)
@given(doc=_json(3))
def test_the_check_refuses_exactly_the_json_whose_keys_name_a_parameter(doc: str) -> None:
    body = doc.encode()
    named = set(_keys(body)) & set(_SHM_NAMES)
    if named:
        assert _refused(check_json, body).reason == "shared_memory"
    else:
        check_json(body)


@pytest.mark.parametrize(
    "body",
    [
        b"[" * MAX_DEPTH + b"]" * MAX_DEPTH,
        b'{"a":' * (MAX_DEPTH - 1) + b"[]" + b"}" * (MAX_DEPTH - 1),
        b'{"inputs":[{"data":[[1,2],[3,4]]}]}',
        b"[" + b",".join([b"[1,2,3]"] * 100_000) + b"]",  # wide, shallow: many brackets, depth 2
        b'["' + b"[" * 1000 + b'"]',  # brackets inside a string are no nesting
        b'["\\\\' + b"]" * 1000 + b'"]',  # nor after an escaped backslash, inside the string
        b'["\\"' + b"[" * 1000 + b'"]',  # nor after an escaped quote
    ],
)
def test_json_nesting_up_to_the_limit_passes(body: bytes) -> None:
    check_depth(body)


@pytest.mark.parametrize(
    "body",
    [
        b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1),
        b"[{" * 65 + b"}]" * 65,  # objects and arrays together
        b'{"a":' * MAX_DEPTH + b"[]" + b"}" * MAX_DEPTH,
        b"[[]" * 200 + b"]" * 200,  # no long run of openers, deep all the same
        b"[" * (MAX_DEPTH + 1),  # never closed
        b"]" * (MAX_DEPTH + 1),
        b"[" * 50_000 + b"]" * 50_000,  # deep enough to crash Triton's recursive parser
    ],
)
def test_json_nested_deeper_than_the_limit_is_refused(body: bytes) -> None:
    assert _refused(check_json, body).reason == "too_deep"


def test_deep_nesting_is_judged_fast_even_when_huge() -> None:
    started = time.process_time()
    for body in (b"[" * (8 << 20) + b"]" * (8 << 20), b"[" * (16 << 20), b"[[]" * (4 << 20) + b"]" * (4 << 20)):
        assert _refused(check_depth, body).reason == "too_deep"
    assert time.process_time() - started < 2.0


def test_brackets_nested_just_under_the_limit_are_bounded_by_the_work_not_checked_for_seconds() -> None:
    # Depth 127 blocks, repeated: valid, within the limit, and 128 passes over 60 MB took 22 s (~1.2 s now).
    body = (b"[" * 127 + b"]" * 127) * 240_000
    started = time.process_time()
    refused = _refused(check_depth, body)
    assert refused.reason == "too_deep" and "too costly to check" in refused.message
    assert time.process_time() - started < 5.0
    tensor = b"[" + b",".join([b"[" + b",".join([b"[1,2]"] * 100) + b"]"] * 20_000) + b"]"  # depth 3, 2 M brackets
    check_depth(tensor)


def _declaring(shape: str, data: str = "[]", key: str = '"shape"') -> bytes:
    return b'{"inputs":[{"name":"INPUT0","datatype":"FP32",%s: %s,"data":%s}]}' % (
        key.encode(),
        shape.encode(),
        data.encode(),
    )


@pytest.mark.parametrize(
    "shape",
    [
        "[9223372036854775807]",
        "[18446744073709551615]",
        "[1000000, 1000000]",
        "[ 1048577 ]",
        "[99999999999999999999999]",
    ],
)
def test_a_shape_declaring_more_elements_than_the_body_carries_is_refused(shape: str) -> None:
    body = _declaring(shape)
    assert long_shapes(body)  # the short path sends it the long way
    refused = _refused(check_plain_body, body, None, 1 << 20, shapes=True)
    assert refused.status == 400 and refused.reason == "shape" and "shape" in refused.message


@pytest.mark.parametrize(
    "shape",
    ["[1048576]", "[1024, 1024]", "[0, 18446744073709551615]", "[3, 0, 99999999999999999999999]", "[1.5e20]", "[]"],
)
def test_shapes_within_the_floor_or_of_no_elements_or_not_numbers_pass(shape: str) -> None:
    # (what is not a list of unsigned integers Triton refuses itself, without allocating)
    check_plain_body(_declaring(shape), None, 1 << 20, shapes=True)


def test_quick_shapes_are_not_parsed_and_the_check_is_off_for_other_routes() -> None:
    assert not long_shapes(_declaring("[1, 16]") + _declaring("[999999]"))
    check_plain_body(_declaring("[10000000000]"), None, 1 << 20)  # generate: shapes are not declared there


_SHAPE_PIECES = st.lists(
    st.one_of(
        st.text(alphabet="0123456789", min_size=1, max_size=8).map(str.encode),
        st.sampled_from([b":", b"[", b"]", b",", b" ", b"\n", b'"shape"', b'"data"', b"x"]),
    ),
    max_size=16,
)


def _array_digits(data: bytes, after: int) -> int:
    """The digits of the array a key ending at ``after`` holds, read plainly: blanks, ':', blanks, '[', then
    digits, commas and blanks (0 when the bytes are no such array)."""
    at = after
    while at < len(data) and data[at] in b" \t\n\r":
        at += 1
    if data[at : at + 1] != b":":
        return 0
    at += 1
    while at < len(data) and data[at] in b" \t\n\r":
        at += 1
    if data[at : at + 1] != b"[":
        return 0
    digits = 0
    for byte in data[at + 1 :]:
        if byte not in b"0123456789, \t\n\r":
            break
        digits += byte in b"0123456789"
    return digits


@settings(max_examples=600, deadline=None)
@given(st.binary(max_size=8), _SHAPE_PIECES, st.integers(0, 12))
@example(b"", [b":", b"[", b"1234567", b"]"], 0)
@example(b"", [b":", b"[", b"123456", b"]"], 0)
@example(b"", [b" ", b":", b"\n", b"[", b"1", b",", b"23", b" ", b",", b"4567"], 0)
@example(b"", [b"1234567", b"]"], 0)
@example(b"", [b":", b"[", b"123", b"x", b"4567"], 0)
@example(b"", [b":", b"[", b"1", b'"shape"', b":", b"[", b"1234567"], 0)
@example(b"", [b":", b"[", b"1234567"], 1)
def test_long_shapes_counts_the_digits_of_each_shape_array(prefix: bytes, pieces: list[bytes], pos: int) -> None:
    """The short path's answer is more than six digits in the array of some ``"shape"`` key from ``pos`` on,
    the array read as check_shapes reads one, however the bytes fall."""
    data = prefix + b'"shape"' + b"".join(pieces)
    keys = [at for at in range(pos, len(data)) if data.startswith(b'"shape"', at)]
    assert long_shapes(data, pos) == any(_array_digits(data, at + 7) > 6 for at in keys)


def test_long_shapes_reads_a_body_of_repeated_keys_in_linear_time() -> None:
    body = b'{"inputs":[{"name":"' + b'"shape"' * 32_000 + b'"}]}'  # 224 KB, one read: 29 s when quadratic
    started = time.perf_counter()
    assert not long_shapes(body)
    assert time.perf_counter() - started < 0.5  # ~1 ms linear


def test_a_shape_is_bounded_by_the_whole_body_binary_tensors_included() -> None:
    header = _declaring(f"[{SHAPE_FLOOR * 2}]", data='[], "parameters": {"binary_data_size": 8388608}')
    body = header + bytes(SHAPE_FLOOR * 8)
    check_plain_body(body, len(header), 1 << 20, shapes=True)  # 2 Mi FP32 elements in 8 MiB: carried
    refused = _refused(check_plain_body, body[: SHAPE_FLOOR * 2 - 1], len(header), 1 << 20, shapes=True)
    assert refused.reason == "shape"


def test_an_escaped_spelling_of_the_key_is_seen() -> None:
    escaped = _declaring("[10000000000]", key='"\\u0073hap\\u0065"')
    assert json.loads(escaped)["inputs"][0]["shape"] == [10000000000]
    assert _refused(check_shapes, escaped, len(escaped)).reason == "shape"


_BINARY = (
    b'{"inputs":[{"name":"INPUT0","datatype":"FP32","shape":[300000000],"parameters":{"binary_data_size":1200000000}}]}'
)


@pytest.mark.parametrize("encoding", ["", "gzip"])
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_streamed_bodies_bound_shapes_by_what_their_head_says_they_can_carry(encoding: str, chunked: bool) -> None:
    def judged(header: bytes, max_body_bytes: int) -> str:
        payload = gzip.compress(header) if encoding else header
        check = InferBodyCheck(
            encoding=encoding,
            json_length=len(header),
            max_json_bytes=1 << 20,
            max_body_bytes=max_body_bytes,
            content_length=None if chunked else len(payload),
            shapes=True,
        )
        try:
            if check.feed(payload) is None:
                check.finish()
        except BodyRefused as exc:
            return exc.reason
        return "passed"

    # A binary input, bounded by the body: its Content-Length (times the inflate ratio when compressed), else
    # --max-body-bytes (1 GiB is more than 300 M elements, 256 MiB less).
    assert judged(_BINARY, 1 << 30) == ("passed" if chunked else "shape")
    assert judged(_BINARY, 1 << 28) == "shape"
    # An input with inline data (Triton sizes it from the shape): never more than the JSON part holds.
    assert judged(_declaring("[300000000]"), 1 << 30) == "shape"


@pytest.mark.parametrize(
    "body",
    [
        b'{"inputs":[{"shape":[1],"shape":[2000000],"data":[1]}]}',  # rapidjson reads the first: every one counts
        b'{"inputs":[{"shape":[2000000],"\\u0064ata":[1]}]}',  # the key's escaped spelling
        b'{"inputs":[{"shape":[2000000],"data":[1]}]' + b" " * (1 << 20) + b"}",  # too large to parse: refused
        b'{"inputs":[{"shape":[2000000],"data":[Inf]}]}',  # not JSON to Python (maybe to rapidjson): refused
    ],
)
def test_a_body_of_unknown_length_bounds_inline_data_by_its_json(body: bytes) -> None:
    assert _refused(check_shapes, body, 1 << 30, exact=False).reason in ("shape", "bad_json")
    check_shapes(body, 1 << 30)  # (a body known to be that long can carry it)


def test_a_body_of_unknown_length_passes_binary_inputs_larger_than_its_json() -> None:
    check_shapes(_BINARY, 1 << 30, exact=False)
    check_shapes(
        b'{"inputs":[{"shape":[2000000],"parameters":{"binary_data_size":8000000}}],"data":1}', 1 << 30, exact=False
    )


_CLASSIFIED = json.dumps({**CLEAN, "outputs": [{"name": "OUTPUT0", "parameters": {"classification": 3}}]}).encode()


@pytest.mark.parametrize(
    "body",
    [
        _CLASSIFIED,
        _CLASSIFIED.replace(b'"classification"', b'"cl\\u0061ssification"'),
        _CLASSIFIED.replace(b'"classification"', b'"classification" \n'),
        json.dumps({**CLEAN, "parameters": {"classification": "x"}}).encode(),  # (anywhere: Triton refuses the rest)
    ],
)
def test_the_classification_parameter_is_refused_in_any_spelling(body: bytes) -> None:
    # Triton 2.51 divides by a BYTES output's datatype size (0) to classify it: SIGFPE, the whole server.
    for refused in [
        _refused(check_plain_body, body, None, 1 << 20, shapes=True),
        _refused(_fed_whole, body, "gzip"),
    ]:
        assert refused.status == 400 and refused.reason == "classification" and "'classification'" in refused.message


def _fed_whole(body: bytes, encoding: str) -> None:
    check = InferBodyCheck(encoding=encoding, json_length=None, max_json_bytes=1 << 20, shapes=True)
    check.feed(gzip.compress(body) if encoding == "gzip" else body)
    check.finish()


@pytest.mark.parametrize(
    "body",
    [
        json.dumps({**CLEAN, "id": "classification"}).encode(),  # a value
        json.dumps({**CLEAN, "outputs": [{"name": 'x", "classification": 1'}]}).encode(),  # inside a string
        json.dumps({**CLEAN, "outputs": [{"name": "classification"}]}).encode(),  # an output of that name
    ],
)
def test_the_word_classification_that_is_no_key_passes(body: bytes) -> None:
    check_plain_body(body, None, 1 << 20, shapes=True)
    _fed_whole(body, "gzip")


def test_the_classification_check_is_off_for_other_routes() -> None:
    check_plain_body(_CLASSIFIED, None, 1 << 20)  # generate: no outputs are classified there
