"""HTTP/1.1 heads and framing of the REST front end. Pure logic: no servers."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tritonshare.proxy.http1 import (
    MAX_FIELD_BYTES,
    ChunkedReader,
    HttpError,
    ResponseReader,
    error_response,
    parse_request_head,
    parse_response_head,
    upstream_head,
    whole_response,
)


def _head(*lines: str) -> bytes:
    return "\r\n".join(lines).encode("latin-1")


def test_a_plain_request_head_is_read() -> None:
    head = parse_request_head(
        _head("POST /v2/models/m/infer?x=1 HTTP/1.1", "Host: proxy:9000", "Content-Length: 12", "X-Trace: a b")
    )
    assert (head.method, head.target, head.http10) == ("POST", "/v2/models/m/infer?x=1", False)
    assert head.content_length == 12 and not head.chunked and head.keep_alive
    assert head.fields == b"Host: proxy:9000\r\nContent-Length: 12\r\nX-Trace: a b\r\n"  # framing rebuilt in place


@pytest.mark.parametrize(
    ("lines", "status", "words"),
    [
        (["GET /v2 HTTP/1.1 extra"], 400, "request line"),
        (["GET  /v2 HTTP/1.1"], 400, "request line"),
        (["GET http://triton/v2 HTTP/1.1"], 400, "request line"),  # absolute-form: not a forward proxy
        (["GET /v2 HTTP/2.0"], 400, "request line"),
        (["GET /v2 HTTP/0.9"], 400, "request line"),
        (["GET /v2#frag HTTP/1.1"], 400, "request line"),
        (["GET /v2\x00 HTTP/1.1"], 400, "request line"),
        (["GET /v2/models/own\\..\\other HTTP/1.1"], 400, "request line"),  # no pchar: read as '/' by some
        (["GET /v2 HTTP/1.1", "X-A: a\nX-B: b"], 400, "header line"),  # a bare LF ends a line for some parsers
        (["GET /v2 HTTP/1.1", "X-A: a\x0bb"], 400, "header line"),  # VT and FF are whitespace for some
        (["GET /v2 HTTP/1.1", "X-A: a\x0cb"], 400, "header line"),
        (["GET /v2 HTTP/1.1", "X-A: 1", " folded"], 400, "folding"),
        (["GET /v2 HTTP/1.1", "X-A: 1", "\tfolded"], 400, "folding"),
        (["GET /v2 HTTP/1.1", "Bad Name: 1"], 400, "header line"),
        (["GET /v2 HTTP/1.1", "X-A : 1"], 400, "header line"),  # whitespace before the colon
        (["GET /v2 HTTP/1.1", "X-A: a\rb"], 400, "header line"),
        (["GET /v2 HTTP/1.1", "X-A: a\nb"], 400, "header line"),
        (["GET /v2 HTTP/1.1", "X-A: a\x00b"], 400, "header line"),
        (["GET /v2 HTTP/1.1", "no colon"], 400, "header line"),
        (["POST /v2 HTTP/1.1", "Content-Length: 3", "Transfer-Encoding: chunked"], 400, "both"),
        (["POST /v2 HTTP/1.1", "Content-Length: 3", "Content-Length: 3"], 400, "more than once"),
        (["POST /v2 HTTP/1.1", "Content-Length: 3", "content-length: 4"], 400, "more than once"),
        (["POST /v2 HTTP/1.1", "Content-Length: 3, 3"], 400, "not a number"),
        (["POST /v2 HTTP/1.1", "Content-Length: -1"], 400, "not a number"),
        (["POST /v2 HTTP/1.1", "Content-Length: +3"], 400, "not a number"),
        (["POST /v2 HTTP/1.1", "Content-Length: 1" + "0" * 18], 400, "not a number"),  # 19 digits: past int64
        (["POST /v2 HTTP/1.1", "Transfer-Encoding: gzip, chunked"], 400, "only chunked"),
        (["POST /v2 HTTP/1.1", "Transfer-Encoding: identity"], 400, "only chunked"),
        (["POST /v2 HTTP/1.0", "Transfer-Encoding: chunked"], 400, "only chunked"),
        (["POST /v2 HTTP/1.1", "Transfer-Encoding: chunked", "Transfer-Encoding: chunked"], 400, "more than once"),
        (["GET /v2 HTTP/1.1", "Host: a", "Host: b"], 400, "more than once"),
        (["GET /v2 HTTP/1.1", "Authorization: Bearer a", "authorization: Bearer b"], 400, "more than once"),
        (["POST /v2 HTTP/1.1", "Content-Encoding: gzip", "Content-Encoding: identity"], 400, "more than once"),
        (
            ["POST /v2 HTTP/1.1", "Inference-Header-Content-Length: 1", "inference-header-content-length: 2"],
            400,
            "more than once",
        ),
        (["POST /v2 HTTP/1.1", "Inference-Header-Content-Length: 0x10"], 400, "not a number"),
        (["POST /v2 HTTP/1.1", "Inference-Header-Content-Length: 1" + "0" * 18], 400, "not a number"),
        (["POST /v2 HTTP/1.1", "Expect: something-else"], 417, "100-continue"),
    ],
)
def test_ambiguous_or_malformed_heads_are_refused(lines: list[str], status: int, words: str) -> None:
    with pytest.raises(HttpError) as caught:
        parse_request_head(_head(*lines))
    assert caught.value.status == status
    assert words in caught.value.message


@pytest.mark.parametrize(
    ("line", "refused"),
    [
        ("X-Big:   " + "a" * MAX_FIELD_BYTES, False),  # the spaces before a value do not count, as in Triton
        ("X-Big: \t" + "a" * (MAX_FIELD_BYTES - 1), False),  # but a tab does
        ("X-Big: \t" + "a" * MAX_FIELD_BYTES, True),
        ("X-Big: " + "a" * (MAX_FIELD_BYTES + 1), True),
        ("X-Big: " + "a" * (MAX_FIELD_BYTES - 1) + " ", False),  # trailing ones do
        ("X-Big: " + "a" * MAX_FIELD_BYTES + " ", True),
        ("X" * MAX_FIELD_BYTES + ": a", False),
        ("X" * (MAX_FIELD_BYTES + 1) + ": a", True),
    ],
)
def test_a_header_name_or_value_longer_than_tritons_limit_is_431(line: str, refused: bool) -> None:
    head = _head("GET /v2 HTTP/1.1", "Host: x", line)
    if not refused:
        assert parse_request_head(head).fields.endswith(line.encode() + b"\r\n")
        return
    with pytest.raises(HttpError) as caught:
        parse_request_head(head)
    assert caught.value.status == 431 and caught.value.reason == "too_large"
    assert caught.value.message.endswith(f"its name or value is longer than {MAX_FIELD_BYTES} bytes (Triton's limit)")


def test_the_largest_lengths_taken_have_18_digits() -> None:
    head = parse_request_head(
        _head("POST /v2 HTTP/1.1", "Content-Length: " + "9" * 18, "Inference-Header-Content-Length: " + "9" * 18)
    )
    assert head.content_length == head.inference_header_length == 10**18 - 1


def test_chunked_http11_request() -> None:
    head = parse_request_head(_head("POST /v2 HTTP/1.1", "Transfer-Encoding: Chunked"))
    assert head.chunked and head.content_length is None and head.has_body


def test_http10_closes_and_connection_close_is_honoured() -> None:
    assert not parse_request_head(_head("GET /v2 HTTP/1.0")).keep_alive
    assert not parse_request_head(_head("GET /v2 HTTP/1.0", "Connection: keep-alive")).keep_alive
    assert not parse_request_head(_head("GET /v2 HTTP/1.1", "Connection: Close")).keep_alive
    assert parse_request_head(_head("GET /v2 HTTP/1.1", "Connection: keep-alive")).keep_alive


def test_hop_by_hop_connection_named_and_stripped_headers_are_not_forwarded() -> None:
    head = parse_request_head(
        _head(
            "POST /v2 HTTP/1.1",
            "Host: h",
            "Connection: keep-alive, X-Hop, Content-Encoding",
            "X-Hop: 1",
            "Keep-Alive: timeout=5",
            "TE: trailers",
            "Upgrade: h2c",
            "Trailer: X-T",
            "Proxy-Authorization: secret",
            "Expect: 100-continue",
            "Triton-Restricted: key",
            "content-encoding: gzip",
            "inference-header-content-length: 7",
            "Content-Length: 9",
            "Accept: */*",
        ),
        strip=frozenset({b"triton-restricted"}),
    )
    # Connection cannot drop a header the proxy interprets; interpreted headers get one exact spelling.
    assert head.fields == (
        b"Host: h\r\nContent-Encoding: gzip\r\nInference-Header-Content-Length: 7\r\nContent-Length: 9\r\n"
        b"Accept: */*\r\n"
    )
    assert head.expect_continue and head.content_encoding == "gzip" and head.inference_header_length == 7


@pytest.mark.parametrize(
    ("framing", "rebuilt"),
    [
        ("Content-Length: 4", b"Content-Length: 4"),
        ("content-length:   004 ", b"Content-Length: 4"),
        ("Content-Length:\t4\t", b"Content-Length: 4"),  # tabs around a value are whitespace too
        ("Transfer-Encoding: chunked", b"Transfer-Encoding: chunked"),
        ("transfer-encoding: Chunked", b"Transfer-Encoding: chunked"),
    ],
)
def test_framing_is_rebuilt_where_the_client_put_it(framing: str, rebuilt: bytes) -> None:
    """So a head in the proxy's own spelling is forwarded byte for byte whatever its header order (Go's
    net/http writes Content-Length before the other headers, wrk in a random order)."""
    raw = _head("POST /v2/models/own/infer HTTP/1.1", "Host: h", framing, "Content-Type: application/json")
    head = parse_request_head(raw)
    assert head.fields == b"Host: h\r\n" + rebuilt + b"\r\nContent-Type: application/json\r\n"
    upstream = upstream_head(head, "/v2/models/own/infer", b"t")
    assert (upstream == raw + b"\r\n\r\n") == (framing.encode() == rebuilt)


def test_upstream_head_uses_the_canonical_path_and_rebuilt_framing() -> None:
    head = parse_request_head(_head("POST /v2/models/%6Fwn/infer?q=1 HTTP/1.1", "Host: h", "Content-Length: 4"))
    assert upstream_head(head, "/v2/models/own/infer", b"triton:8000") == (
        b"POST /v2/models/own/infer HTTP/1.1\r\nHost: h\r\nContent-Length: 4\r\n\r\n"
    )
    chunked = parse_request_head(_head("POST /v2 HTTP/1.0"))  # no Host: Triton's is added
    assert upstream_head(chunked, "/v2", b"triton:8000") == b"POST /v2 HTTP/1.1\r\nHost: triton:8000\r\n\r\n"
    te = parse_request_head(_head("POST /v2 HTTP/1.1", "Host: h", "Transfer-Encoding: chunked"))
    assert upstream_head(te, "/v2", b"t") == b"POST /v2 HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n"


def test_response_heads_give_their_framing() -> None:
    plain = parse_response_head(_head("HTTP/1.1 200 OK", "Content-Type: application/json", "Content-Length: 12"))
    assert (plain.status, plain.content_length, plain.chunked, plain.close) == (200, 12, False, False)
    stream = parse_response_head(_head("HTTP/1.1 200 OK", "Transfer-Encoding: chunked"))
    assert stream.chunked and stream.content_length is None
    closing = parse_response_head(_head("HTTP/1.0 400 Bad Request", "Connection: close"))
    assert closing.close and closing.has_connection
    with pytest.raises(HttpError) as caught:
        parse_response_head(b"HTTP/1.1 OK")
    assert caught.value.status == 502


def test_error_response_is_v2_json_with_length() -> None:
    raw = error_response(404, "Request for unknown model: 'x' is not found", close=True)
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 404 Not Found\r\n")
    assert b"Connection: close" in head and f"Content-Length: {len(body)}".encode() in head
    assert json.loads(body) == {"error": "Request for unknown model: 'x' is not found"}


def _chunked(pieces: list[bytes], trailer: bytes = b"") -> bytes:
    return b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in pieces if p) + b"0\r\n" + trailer + b"\r\n"


@given(st.lists(st.binary(max_size=40), max_size=6), st.data())
def test_chunked_reader_finds_payload_and_end_across_any_split(pieces: list[bytes], data: st.DataObject) -> None:
    wire = _chunked(pieces, b"X-T: 1\r\n") + b"NEXT"
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=5)))
    reader, end, start = ChunkedReader(), -1, 0
    payload: list[memoryview] = []
    for cut in [*cuts, len(wire)]:
        part = wire[start:cut]
        if part:
            end = reader.feed(part, 0, payload)
            if end >= 0:
                end += start
                break
        start = cut
    assert b"".join(bytes(p) for p in payload) == b"".join(pieces)
    assert wire[end:] == b"NEXT"


@pytest.mark.parametrize(
    ("wire", "words"),
    [
        (b"3\r\nabcX\r\n0\r\n\r\n", "not followed by CRLF"),
        (b"3\r\nabcXY0\r\n\r\n", "not followed by CRLF"),  # two bytes, but not CRLF
        (b"g\r\nabc\r\n0\r\n\r\n", "malformed chunk-size"),  # not hex
        (b"3\nabc\r\n0\r\n\r\n", "not ended by CRLF"),  # bare LF
        (b"3;x\nabc\r\n0\r\n\r\n", "not ended by CRLF"),
        (b" 3\r\nabc\r\n0\r\n\r\n", "malformed chunk-size"),
        (b"1" + b"0" * 15 + b"\r\n", "malformed chunk-size"),  # 16 hex digits: 2**60, past any body
        (b"1" * 5000, "too long"),  # endless size line
        (b"3;" + b"e" * 5000 + b"\r\nabc\r\n0\r\n\r\n", "too long"),  # a size line too long, whole in one read
        (b"0\r\nX-T: " + b"a" * 5000 + b"\r\n\r\n", "too long"),  # a trailer line too long, whole in one read
        (b"0\r\n" + (b"X-T: " + b"a" * 4000 + b"\r\n") * 17 + b"\r\n", "trailers too large"),  # 68,085 bytes
        (b"0\r\nX-T: a\rb\r\n\r\n", "malformed"),  # a bare CR in a trailer
    ],
)
def test_chunked_reader_rejects_malformed_framing(wire: bytes, words: str) -> None:
    with pytest.raises(HttpError) as caught:
        ChunkedReader(400).feed(wire)
    assert caught.value.status == 400 and words in caught.value.message


def test_chunked_reader_takes_a_15_digit_chunk_size() -> None:
    wire = b"0" * 14 + b"3\r\nabc\r\n0\r\n\r\n"
    payload: list[memoryview] = []
    assert ChunkedReader().feed(wire + b"NEXT", 0, payload) == len(wire)
    assert b"".join(bytes(p) for p in payload) == b"abc"


def test_response_reader_passes_bytes_through_and_finds_the_end() -> None:
    reader = ResponseReader({})
    first = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nab"
    assert reader.feed(first) is first  # untouched: the same object, no copy
    assert not reader.done
    assert reader.feed(b"cdeEXTRA") == b"cde"
    assert reader.done and reader.extra


def test_response_reader_follows_a_chunked_stream_and_adds_close_when_asked() -> None:
    reader = ResponseReader({})
    reader.close = True
    out = reader.feed(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nab")
    assert out == (
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        b"3\r\nab"
    )
    assert not reader.done
    assert reader.feed(b"c\r\n0\r\n\r\n") == b"c\r\n0\r\n\r\n" and reader.done


def test_response_reader_head_split_and_close_delimited_body() -> None:
    reader = ResponseReader({})
    assert reader.feed(b"HTTP/1.1 200 OK\r\nX: 1\r") == b""
    # the client learns where such a body ends only from the proxy's close: the head says it comes
    assert reader.feed(b"\n\r\nbody") == b"HTTP/1.1 200 OK\r\nX: 1\r\nConnection: close\r\n\r\nbody"
    assert not reader.done and reader.eof()


def test_response_reader_sees_a_truncated_response() -> None:
    reader = ResponseReader({})
    reader.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
    assert not reader.eof()


def test_the_authorization_value_is_read_and_forwarded_unless_stripped() -> None:
    lines = ("GET /v2 HTTP/1.1", "Host: h", "authorization: Bearer t0ken")
    head = parse_request_head(_head(*lines))
    assert head.authorization == b"Bearer t0ken" and head.fields == b"Host: h\r\nAuthorization: Bearer t0ken\r\n"
    stripped = parse_request_head(_head(*lines), strip=frozenset({b"authorization"}))
    assert stripped.authorization == b"Bearer t0ken" and stripped.fields == b"Host: h\r\n"
    assert parse_request_head(_head("GET /v2 HTTP/1.1")).authorization is None


def test_whole_response_takes_only_a_complete_known_response() -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 5"
    cache = {head: parse_response_head(head)}
    assert whole_response(head + b"\r\n\r\nabcde", cache) is cache[head]
    assert whole_response(head + b"\r\n\r\nabc", cache) is None  # more body to come
    assert whole_response(head + b"\r\n\r\nabcdeHTTP", cache) is None  # bytes past the response
    assert whole_response(head, cache) is None  # the head is not complete yet, even though it is known
    assert whole_response(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nx", cache) is None  # not seen before
    closing = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 1"
    cache[closing] = parse_response_head(closing)
    assert whole_response(closing + b"\r\n\r\nx", cache) is None  # Triton closes after it: the slow path


def test_error_response_carries_extra_headers() -> None:
    raw = error_response(429, "slow down", headers=b"Retry-After: 1\r\n")
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 429 Too Many Requests\r\n") and b"\r\nRetry-After: 1" in head
    assert json.loads(body) == {"error": "slow down"}
