"""HTTP/1.1 pieces of the REST front end: a strict request-head parser, the re-serialised head sent to Triton,
a lenient response-head reader (framing only), chunked framing, and the proxy's own JSON answers.

The parser is strict on purpose (RFC 9112): whatever could be read two ways by two parsers — obs-fold, both
Content-Length and Transfer-Encoding, repeated Content-Length, a Transfer-Encoding other than chunked,
bare CR or LF, control characters — is a 400, so Triton never parses a head differently from the proxy.
Triton then receives a head built here (:func:`upstream_head`), not the client's bytes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
# origin-form only: a path (RFC 3986 pchar, '/', '%') and an optional query.
_REQUEST_LINE = re.compile(rb"(" + _TOKEN + rb") (/[!$&'()*+,\-./0-9:;=?@A-Z_a-z~%]*) HTTP/1\.([01])")
_VCHAR = rb"[\x21-\x7e\x80-\xff]"
_FIELD = re.compile(rb"(" + _TOKEN + rb"):[ \t]*(" + _VCHAR + rb"+(?:[ \t]+" + _VCHAR + rb"+)*)?[ \t]*")
# The same rule for a whole block of header lines at once: a value is visible characters, spaces and tabs (the
# spaces and tabs around it are then stripped); one C-level match instead of one per line.
_FIELD_LINES = re.compile(rb"(?:" + _TOKEN + rb":[\t\x20-\x7e\x80-\xff]*(?:\r\n|\Z))*")
_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]{1,15})(?:[ \t]*;[\x20-\x7e\t\x80-\xff]*)?")
_MAX_RESPONSE_HEAD = 64 * 1024
# Triton (2.51, libevhtp) closes the connection on a longer header name, or value (counted from its first byte
# that is not a space — tabs before the value count, as do trailing blanks; measured): refused here with 431,
# rather than forwarded to become a 502 counted as an upstream error.
MAX_FIELD_BYTES = 8191
_STATUS_LINE = re.compile(rb"HTTP/1\.[01] ([1-5][0-9][0-9])(?: [^\r\n]*)?")

# Hop-by-hop (RFC 9110 §7.6.1) and the headers whose meaning the proxy takes over: "Expect: 100-continue" is
# answered here (the body is checked before Triton sees the head). Framing (_FRAMING) is rebuilt, not dropped.
_NOT_FORWARDED = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"upgrade",
        b"proxy-authorization",
        b"proxy-authenticate",
        b"expect",
    }
)
_FRAMING = frozenset({b"content-length", b"transfer-encoding"})  # rebuilt from their checked values
# Headers the proxy interprets; each may appear once, and is sent to Triton under this exact spelling.
CANONICAL: dict[bytes, bytes] = {
    b"host": b"Host",
    b"content-length": b"Content-Length",
    b"transfer-encoding": b"Transfer-Encoding",
    b"content-encoding": b"Content-Encoding",
    b"inference-header-content-length": b"Inference-Header-Content-Length",
    b"expect": b"Expect",
    b"authorization": b"Authorization",
}
_INTERPRETED = frozenset(CANONICAL)

REASONS: dict[int, str] = {
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    413: "Content Too Large",
    415: "Unsupported Media Type",
    417: "Expectation Failed",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    502: "Bad Gateway",
    503: "Service Unavailable",
}

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class HttpError(Exception):
    """A request the proxy answers itself with ``status``; ``reason`` labels the refusal in metrics."""

    def __init__(self, status: int, message: str, reason: str = "bad_request") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason


# Heads are memoised and never changed once parsed, yet not frozen dataclasses: building a frozen one costs six
# times as much (object.__setattr__ per field), and a head is built for every request whose bytes are new.
@dataclass(slots=True)
class RequestHead:
    method: str
    target: str
    http10: bool
    fields: bytes  # forwarded header lines ("Name: value\r\n"...): hop-by-hop removed, framing rebuilt in its place
    has_host: bool
    content_length: int | None
    chunked: bool
    keep_alive: bool
    expect_continue: bool
    content_encoding: str  # "" when absent
    inference_header_length: int | None  # Inference-Header-Content-Length
    authorization: bytes | None  # the Authorization value (bearer token check), None when absent

    @property
    def has_body(self) -> bool:
        return self.chunked or bool(self.content_length)


def parse_request_head(head: bytes, strip: frozenset[bytes] = frozenset()) -> RequestHead:
    """Parse a request line and header lines (``head`` ends before the blank line). ``strip`` names headers
    (lower case) never forwarded, e.g. the key of Triton's restricted APIs."""
    line, _, block = head.partition(b"\r\n")
    match = _REQUEST_LINE.fullmatch(line)
    if match is None:
        raise HttpError(400, f"malformed request line {_show(line)}: expected 'METHOD /path HTTP/1.1'")
    fields = _parse_fields(block)
    single, connection_values = _index(fields)
    content_length, chunked = _framing(single, http10=match[3] == b"0")
    connection = _tokens(b",".join(connection_values)) if connection_values else frozenset()
    http10 = match[3] == b"0"
    if chunked:
        framing = b"Transfer-Encoding: chunked"
    else:
        framing = b"" if content_length is None else b"Content-Length: %d" % content_length
    return RequestHead(
        method=match[1].decode("ascii"),
        target=match[2].decode("ascii"),
        http10=http10,
        fields=_forwarded(fields, strip | (connection - _INTERPRETED), framing),
        has_host=b"host" in single,
        content_length=content_length,
        chunked=chunked,
        keep_alive=not http10 and b"close" not in connection,
        expect_continue=_expect(single.get(b"expect")),
        content_encoding=single.get(b"content-encoding", b"").decode("latin-1"),
        inference_header_length=_header_length(single.get(b"inference-header-content-length")),
        authorization=single.get(b"authorization"),
    )


_Field = tuple[bytes, bytes, bytes, bytes]  # (lower-case name, name, value, the whole line)


def _parse_fields(block: bytes) -> list[_Field]:
    """The header lines (``block``: CRLF-separated), each checked against the field rule."""
    if not block:
        return []
    if _FIELD_LINES.fullmatch(block) is None:
        _refuse_field_lines(block)
    fields = []
    for line in block.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if len(line) > MAX_FIELD_BYTES and max(len(name), len(value.lstrip(b" "))) > MAX_FIELD_BYTES:
            message = f"header {_show(name)}: its name or value is longer than {MAX_FIELD_BYTES} bytes (Triton's limit)"
            raise HttpError(431, message, "too_large")
        fields.append((name.lower(), name, value.strip(b" \t"), line))
    return fields


def _refuse_field_lines(block: bytes) -> None:
    """Raise the error for the first header line that breaks the rule (after the block did not match)."""
    for line in block.split(b"\r\n"):
        if _FIELD.fullmatch(line) is None:
            if line[:1] in (b" ", b"\t"):
                raise HttpError(400, "obsolete line folding in the request headers is not accepted")
            raise HttpError(400, f"malformed header line {_show(line)}")
    raise HttpError(400, "malformed header lines")  # not expected: the two rules accept the same lines


def _index(fields: list[_Field]) -> tuple[dict[bytes, bytes], list[bytes]]:
    """The headers the proxy interprets (each at most once) and the values of Connection headers."""
    single: dict[bytes, bytes] = {}
    connection = []
    for lname, name, value, _ in fields:
        if lname in CANONICAL:
            if lname in single:
                raise HttpError(400, f"header {name.decode('latin-1')} appears more than once")
            single[lname] = value
        elif lname == b"connection":
            connection.append(value)
    return single, connection


def _framing(single: dict[bytes, bytes], *, http10: bool) -> tuple[int | None, bool]:
    length, encoding = single.get(b"content-length"), single.get(b"transfer-encoding")
    if length is not None and encoding is not None:
        raise HttpError(400, "both Content-Length and Transfer-Encoding are set; send only one")
    if encoding is not None:
        if encoding.lower() != b"chunked" or http10:
            raise HttpError(400, f"Transfer-Encoding {_show(encoding)} is not supported: only chunked (HTTP/1.1)")
        return None, True
    if length is None:
        return None, False
    if not length.isdigit() or len(length) > 18:
        raise HttpError(400, f"Content-Length {_show(length)} is not a number")
    return int(length), False


def _tokens(value: bytes) -> frozenset[bytes]:
    return frozenset(t.strip().lower() for t in value.split(b",") if t.strip())


def _expect(value: bytes | None) -> bool:
    if value is None:
        return False
    if value.lower() != b"100-continue":
        raise HttpError(417, f"Expect {_show(value)} is not supported (only 100-continue)", "expectation")
    return True


def _header_length(value: bytes | None) -> int | None:
    if value is None:
        return None
    if not value.isdigit() or len(value) > 18:
        raise HttpError(400, f"Inference-Header-Content-Length {_show(value)} is not a number")
    return int(value)


def _forwarded(fields: list[_Field], drop: frozenset[bytes], framing: bytes) -> bytes:
    """The header lines for Triton: as the client wrote them (each passed the field rule), but the headers the
    proxy interprets under one exact spelling, and the framing header (there is at most one) rebuilt where the
    client put it — so a head whose lines all read as the proxy would write them is forwarded as the client's
    own bytes (the short path), whatever the order of its headers."""
    out = []
    for lname, _, value, line in fields:
        if lname in _FRAMING:
            out.append(framing)
            continue
        if lname in _NOT_FORWARDED or lname in drop:
            continue
        canonical = CANONICAL.get(lname)
        out.append(line if canonical is None else canonical + b": " + value)
    return b"\r\n".join(out) + b"\r\n" if out else b""


def upstream_head(head: RequestHead, path: str, host: bytes) -> bytes:
    """The head sent to Triton: canonical path, HTTP/1.1, the forwarded fields (framing rebuilt among them)."""
    host_line = b"" if head.has_host else b"Host: " + host + b"\r\n"
    return b"%s %s HTTP/1.1\r\n%s%s\r\n" % (head.method.encode(), path.encode(), host_line, head.fields)


def _show(raw: bytes, limit: int = 80) -> str:
    text = raw.decode("latin-1")
    return repr(text if len(text) <= limit else text[: limit - 1] + "…")


# ---------------------------------------------------------------------------------------------- responses


@dataclass(slots=True)
class ResponseHead:
    status: int
    code: str  # the status as a metrics label
    content_length: int | None
    chunked: bool
    close: bool  # Triton will close the connection after this response
    has_connection: bool  # the head carries a Connection header


def parse_response_head(head: bytes) -> ResponseHead:
    """Read just the framing of Triton's response head (``head`` ends before the blank line)."""
    lines = head.split(b"\r\n")
    match = _STATUS_LINE.fullmatch(lines[0])
    if match is None:
        raise HttpError(502, f"Triton sent a malformed status line {_show(lines[0])}", "upstream")
    length: int | None = None
    chunked = close = has_connection = False
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep:
            raise HttpError(502, f"Triton sent a malformed header line {_show(line)}", "upstream")
        lname, value = name.strip().lower(), value.strip()
        if lname == b"content-length":
            if not value.isdigit():
                raise HttpError(502, f"Triton sent Content-Length {_show(value)}", "upstream")
            length = int(value)
        elif lname == b"transfer-encoding":
            chunked = value.lower().endswith(b"chunked")
            close = close or not chunked
        elif lname == b"connection":
            has_connection = True
            close = close or b"close" in _tokens(value)
    return ResponseHead(int(match[1]), match[1].decode(), None if chunked else length, chunked, close, has_connection)


def whole_response(data: bytes, cache: dict[bytes, ResponseHead]) -> ResponseHead | None:
    """The common case, read in one step: the head of ``data`` if ``data`` is exactly one whole final response
    whose head was seen before (in ``cache``, which :class:`ResponseReader` fills) and which leaves the
    connection open; else None (read it with a :class:`ResponseReader`)."""
    raw, end, body = data.partition(b"\r\n\r\n")  # one argument, no tuple to parse: cheaper than find + slice
    head = cache.get(raw) if end else None
    if head is None or head.content_length != len(body) or head.status < 200 or head.close:
        return None
    return head


class ResponseReader:
    """Follows one response from Triton to its end. Its bytes go to the client as they come, untouched, except
    that the head gets ``Connection: close`` when the proxy will close the client connection (``close``).

    :meth:`feed` returns the bytes to send on; ``done`` turns True at the end of the response and ``extra`` if
    Triton sent bytes past it (the connection to Triton is then not reused). A response without length or
    chunked framing ends when Triton closes the connection (:meth:`eof`).
    """

    __slots__ = ("head", "close", "done", "extra", "_buf", "_left", "_chunks", "_no_body", "_cache")

    def __init__(self, cache: dict[bytes, ResponseHead], *, no_body: bool = False) -> None:
        self.head: ResponseHead | None = None
        self.close = False
        self.done = False
        self.extra = False
        self._buf = b""
        self._left = 0  # body bytes still due; -1: until Triton closes
        self._chunks: ChunkedReader | None = None
        self._no_body = no_body
        self._cache = cache

    def feed(self, data: bytes) -> bytes:
        if self.head is not None:
            stop = self._body(data, 0)
            return data if stop == len(data) else data[:stop]
        if self._buf:
            data, self._buf = self._buf + data, b""
        out = b""
        while True:
            end = data.find(b"\r\n\r\n")
            if end < 0:
                if len(data) > _MAX_RESPONSE_HEAD:
                    raise HttpError(502, "Triton's response head is too large", "upstream")
                self._buf = data
                return out
            head = self._parse(data[:end])
            if head.status >= 200:
                break
            out, data = out + data[: end + 4], data[end + 4 :]  # 1xx: informational, a final head follows
        final = self._final_head(head, data, end)
        return out + final if out else final  # (b"" + final is final itself in CPython; compiled, a copy)

    def _final_head(self, head: ResponseHead, data: bytes, end: int) -> bytes:
        self.head = head
        if self._no_body or head.status in (204, 304) or head.content_length == 0:
            self.done = True
        elif head.chunked:
            self._chunks = ChunkedReader(502)
        else:
            self._left = head.content_length if head.content_length is not None else -1
        stop = self._body(data, end + 4)
        # a body delimited by Triton's close ends for the client only when the proxy closes too: say so
        if (self.close or self._left == -1) and not head.close:
            return with_close(data[:end]) + data[end:stop]
        return data if stop == len(data) else data[:stop]

    def _parse(self, raw: bytes) -> ResponseHead:
        head = self._cache.get(raw)
        if head is None:
            head = parse_response_head(raw)
            if len(self._cache) >= 256:
                self._cache.clear()
            self._cache[raw] = head
        return head

    def _body(self, data: bytes, pos: int) -> int:
        """Where this response ends in ``data`` (from ``pos``); sets ``done`` when it ends there."""
        size = len(data)
        if self.done:
            stop = pos
        elif self._chunks is not None:
            end = self._chunks.feed(data, pos)
            stop = size if end < 0 else end
            self.done = end >= 0
        elif self._left >= 0:
            stop = pos + min(self._left, size - pos)
            self._left -= stop - pos
            self.done = not self._left
        else:
            stop = size
        self.extra = stop < size
        return stop

    def eof(self) -> bool:
        """Triton closed the connection: True if that ends this response (no length, no chunks)."""
        self.done = self.done or (self.head is not None and self._chunks is None and self._left == -1)
        return self.done


def with_close(head: bytes) -> bytes:
    """A response head (ending before the blank line) that tells the client the connection closes."""
    lines = [line for line in head.split(b"\r\n") if not line.lower().startswith(b"connection:")]
    return b"\r\n".join(lines) + b"\r\nConnection: close"


def error_response(status: int, message: str, *, close: bool = False, headers: bytes = b"") -> bytes:
    """A v2-style ``{"error": "..."}`` answer from the proxy itself; ``headers`` are extra header lines
    (each ending in CRLF)."""
    body = json.dumps({"error": message}).encode()
    return b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s%s\r\n%s" % (
        status,
        REASONS.get(status, "Error").encode(),
        len(body),
        headers,
        b"Connection: close\r\n" if close else b"",
        body,
    )


# ---------------------------------------------------------------------------------------------- chunked


_SIZE, _DATA, _DATA_END, _TRAILER, _DONE = range(5)
_MAX_LINE = 4096  # a chunk-size line with extensions, or one trailer line
_MAX_TRAILERS = 64 * 1024


class ChunkedReader:
    """Walks chunked framing (RFC 9112 §7.1) across reads: yields the payload and finds the message end.

    ``strict`` (requests) rejects anything but ``HEX[;ext]CRLF data CRLF``; chunk extensions and trailers are
    dropped, since the proxy re-chunks what it forwards. Errors raise :class:`HttpError` ``error_status``.
    """

    __slots__ = ("_state", "_left", "_line", "_trailers", "_error_status")

    def __init__(self, error_status: int = 400) -> None:
        self._state = _SIZE
        self._left = 0
        self._line = b""
        self._trailers = 0
        self._error_status = error_status

    @property
    def done(self) -> bool:
        return self._state == _DONE

    def feed(self, data: bytes, pos: int = 0, payload: list[memoryview] | None = None) -> int:
        """Consume ``data[pos:]``; append payload slices to ``payload`` (if given). Returns the index just past
        the end of the message, or -1 when all of ``data`` was consumed and more is needed."""
        end = len(data)
        while pos < end:
            state = self._state
            if state == _DATA:
                take = min(self._left, end - pos)
                if payload is not None:
                    payload.append(memoryview(data)[pos : pos + take])
                pos += take
                self._left -= take
                if not self._left:
                    self._state = _DATA_END
            elif state == _DATA_END:
                pos = self._data_end(data, pos)
            else:
                pos = self._line_step(data, pos)
                if self._state == _DONE:
                    return pos
        return -1

    def _data_end(self, data: bytes, pos: int) -> int:
        """The CRLF after chunk data (possibly split across reads: ``_left`` counts bytes of it seen)."""
        if data[pos] != b"\r\n"[self._left]:
            raise HttpError(self._error_status, "chunked body: chunk data is not followed by CRLF")
        self._left += 1
        if self._left == 2:
            self._left = 0
            self._state = _SIZE
        return pos + 1

    def _line_step(self, data: bytes, pos: int) -> int:
        newline = data.find(b"\n", pos)
        if newline < 0:
            self._line += data[pos:]
            if len(self._line) > _MAX_LINE:
                raise HttpError(self._error_status, "chunked body: chunk-size or trailer line too long")
            return len(data)
        line = self._line + data[pos:newline]
        self._line = b""
        if len(line) > _MAX_LINE:  # whether it came in one read or several
            raise HttpError(self._error_status, "chunked body: chunk-size or trailer line too long")
        if not line.endswith(b"\r"):
            raise HttpError(self._error_status, "chunked body: line not ended by CRLF")
        line = line[:-1]
        if self._state == _SIZE:
            self._size_line(line)
        else:
            self._trailer_line(line)
        return newline + 1

    def _size_line(self, line: bytes) -> None:
        match = _CHUNK_SIZE.fullmatch(line)
        if match is None:
            raise HttpError(self._error_status, f"chunked body: malformed chunk-size line {_show(line)}")
        self._left = int(match[1], 16)
        self._state = _DATA if self._left else _TRAILER

    def _trailer_line(self, line: bytes) -> None:
        if not line:
            self._state = _DONE
            return
        self._trailers += len(line)
        if self._trailers > _MAX_TRAILERS or b"\r" in line:
            raise HttpError(self._error_status, "chunked body: trailers too large or malformed")


def chunk(payload: bytes | memoryview) -> list[bytes | memoryview]:
    """One chunk of a re-chunked body."""
    return [b"%x\r\n" % len(payload), payload, b"\r\n"]


LAST_CHUNK = b"0\r\n\r\n"
