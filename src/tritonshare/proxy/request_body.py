"""The request body on its way to Triton: read through its framing, held by the infer-body check until its JSON
part is judged (:mod:`tritonshare.proxy.inspect` says what is judged), then handed out re-framed for Triton.

Only the JSON part is held, bounded by ``max_json_bytes`` (more is a 413). A compressed body is inflated
whole as it passes, in bounded steps, its output past the JSON part dropped (:class:`BodyInflation`): Triton
inflates it whole into memory before reading it, so one that inflates too far (:mod:`tritonshare.proxy.inflation`)
is refused (413) — a gzip bomb blows up neither the proxy nor the shared Triton.

:class:`RequestBody` carries one body through; :class:`InferBodyCheck` holds and judges an infer or generate
body's JSON part as it arrives; :func:`check_plain_body` judges a whole plain body that came with its head.
"""

from __future__ import annotations

from tritonshare.proxy.http1 import LAST_CHUNK, ChunkedReader, chunk
from tritonshare.proxy.inflation import (
    INFLATE_GRACE_BYTES,
    INFLATES_TOO_FAR,
    MAX_INFLATE_RATIO,
    MAX_INFLATED_BYTES,
    CorruptStream,
    InflatesTooFar,
    Inflation,
)
from tritonshare.proxy.inspect import BodyRefused, check_classification, check_json, check_shapes

# Content-Encoding -> zlib wbits (None: the body is not encoded). Both compressed forms are read with automatic
# zlib/gzip header detection, as Triton does.
ENCODINGS: dict[str, int | None] = {"": None, "identity": None, "gzip": 47, "deflate": 47}
_HELD_SLACK = 1 << 20  # encoded bytes held beyond max_json_bytes before the JSON part must be complete


def check_plain_body(body: bytes, json_length: int | None, max_json_bytes: int, *, shapes: bool = False) -> None:
    """Check a whole unencoded body at once (the common case: it arrived with its head); ``shapes``: an infer
    request's input shapes (:func:`check_shapes`) and outputs (:func:`check_classification`) too."""
    if json_length == 0:
        return
    part = body if json_length is None else body[:json_length]
    if len(part) > max_json_bytes:
        raise BodyRefused(413, _too_large(max_json_bytes), "too_large")
    if json_length is not None and json_length > len(body):
        raise _short(json_length, len(body))
    check_json(part)
    if shapes:
        check_shapes(part, len(body))
        check_classification(part)


class InferBodyCheck:
    """Holds the request body's payload (already de-chunked, still encoded) as it arrives, until the JSON part
    is read and judged; then hands back what it held, to be forwarded. A plain body's JSON part is held once,
    as the copy that is checked (not also as the pieces it came in), so it costs its size in memory, not twice.

    :meth:`feed` returns the held payload once the JSON part is complete and clean (the rest of the body needs
    no look), else None; :meth:`finish`, at the end of the body, judges what was read and returns the held
    payload. Both raise :class:`BodyRefused`.
    """

    def __init__(
        self,
        *,
        encoding: str,
        json_length: int | None,
        max_json_bytes: int,
        max_body_bytes: int = 0,
        content_length: int | None = None,
        shapes: bool = False,
    ) -> None:
        """``content_length``: the body's, None when chunked; ``shapes``: an infer request's input shapes
        (:func:`check_shapes`) and outputs (:func:`check_classification`) are checked too."""
        self.inflation = inflation_for(encoding, max_body_bytes)  # RequestBody goes on with it past the JSON part
        self._shapes = shapes
        self._length = content_length
        self._carried = _carried(self.inflation is not None, content_length, max_body_bytes)
        # The JSON part's length, when the head tells it: Inference-Header-Content-Length (of the decoded body),
        # or the Content-Length of a plain body that is all JSON; None: known only as it arrives.
        self.declared = json_length if json_length is not None or self.inflation is not None else content_length
        if self.declared is not None and self.declared > max_json_bytes:
            raise BodyRefused(413, _too_large(max_json_bytes), "too_large")
        self._wanted = json_length  # None: the whole (decoded) body is JSON
        self._limit = max_json_bytes
        self._json = bytearray()
        self._held: list[bytes | memoryview] = []  # encoded payload; a plain body's: what follows the JSON part
        self._held_bytes = 0  # encoded payload held

    @property
    def holding(self) -> int:
        """Bytes held now, as the held-bytes budget counts them (:mod:`tritonshare.proxy.held`): the JSON part
        read so far, or the encoded bytes held if more."""
        return max(self._held_bytes, len(self._json))

    @property
    def needed(self) -> int:
        """Decoded bytes still wanted before the JSON part is complete (or the limit + 1 if unknown)."""
        goal = self._wanted if self._wanted is not None else self._limit + 1
        return goal - len(self._json)

    def feed(self, payload: bytes | memoryview) -> list[bytes | memoryview] | None:
        if self.inflation is None:
            needed = self.needed
            self._json += payload[:needed]
            if len(payload) > needed:
                self._held.append(payload[needed:])
        else:
            self._hold(payload)
            self._json += self.inflation.feed(payload, self.needed)
        if self._wanted is None:
            if len(self._json) > self._limit:
                raise BodyRefused(413, _too_large(self._limit), "too_large")
            return None
        if len(self._json) < self._wanted:
            return None
        return self._judge()

    def finish(self) -> list[bytes | memoryview]:
        if self.inflation is not None and not self.inflation.eof:
            raise _cut_short()
        if self._wanted is not None and len(self._json) < self._wanted:
            raise _short(self._wanted, len(self._json))
        return self._judge()

    def _judge(self) -> list[bytes | memoryview]:
        part, self._json = bytes(self._json), bytearray()
        check_json(part)
        if self._shapes:  # the JSON part is the whole decoded body when no header said its length
            if self._wanted is None:
                check_shapes(part, len(part))
            else:
                check_shapes(part, self._carried, exact=self.inflation is None and self._length is not None)
            check_classification(part)
        held, self._held = self._held, []
        return [part, *held] if part and self.inflation is None else held  # (an empty chunk would end a chunked body)

    def _hold(self, payload: bytes | memoryview) -> None:
        # Compressed input may carry bytes that inflate to nothing (a gzip header's comment field): bound them.
        self._held_bytes += len(payload)
        if self._held_bytes > self._limit + _HELD_SLACK:
            raise BodyRefused(413, _too_large(self._limit), "too_large")
        self._held.append(payload)


def _carried(compressed: bool, content_length: int | None, max_body_bytes: int) -> int:
    """The most decoded bytes a body can hold, as far as its head tells: its Content-Length when plain; when
    compressed, what that inflates to at most (:func:`~tritonshare.proxy.inflation.inflates_too_far`); else (chunked)
    --max-body-bytes, or when that is 0 the 2 GiB cap of compressed bodies."""
    most = max_body_bytes or MAX_INFLATED_BYTES
    if content_length is None:
        return most
    if compressed:
        return min(most, max(INFLATE_GRACE_BYTES, MAX_INFLATE_RATIO * content_length))
    return content_length


def inflation_for(encoding: str, max_body_bytes: int = 0) -> BodyInflation | None:
    """The inflater of a body with this ``Content-Encoding`` (None: not encoded), refusing one that inflates past
    ``max_body_bytes`` (0: no limit) too; 415 for one Triton cannot read."""
    if encoding not in ENCODINGS:
        raise BodyRefused(
            415, f"Content-Encoding {encoding!r} is not supported: use gzip, deflate or identity", "encoding"
        )
    wbits = ENCODINGS[encoding]
    return None if wbits is None else BodyInflation(wbits, max_body_bytes)


class BodyInflation:
    """A compressed body inflated as it passes (:class:`~tritonshare.proxy.inflation.Inflation`), as Triton will:
    its beginning is handed back (the JSON part to check), the rest counted and dropped. Raises
    :class:`BodyRefused` when the body inflates too far (413: past the inflate bound, or past ``limit``,
    ``--max-body-bytes``; 0: none), is not a gzip/zlib stream, or has data after the end of its stream (400:
    Triton stops there, so it could be read two ways)."""

    __slots__ = ("_stream", "_limit")

    def __init__(self, wbits: int, limit: int = 0) -> None:
        self._stream = Inflation(wbits)
        self._limit = limit

    @property
    def eof(self) -> bool:
        return self._stream.eof

    def feed(self, data: bytes | memoryview, keep: int = 0) -> bytes:
        """Inflate all of ``data``; return the first ``keep`` bytes it inflates to, dropping the rest."""
        stream, kept = self._stream, bytearray()
        try:
            for out in stream.steps(data, keep):
                if self._limit and stream.inflated > self._limit:
                    raise BodyRefused(413, body_too_large(self._limit), "too_large")
                if len(kept) < keep:
                    kept += out
        except InflatesTooFar:
            raise BodyRefused(413, f"the compressed body {INFLATES_TOO_FAR}", "too_large") from None
        except CorruptStream as exc:
            raise BodyRefused(400, f"the compressed body cannot be decoded: {exc}", "encoding") from None
        if stream.trailing:
            raise BodyRefused(400, "data follows the end of the compressed body", "encoding")
        return bytes(kept)


class RequestBody:
    """One request's body: read through its framing (Content-Length or chunked), held by the check (if any)
    until its JSON part is judged, and handed out re-framed for Triton (a chunked body is re-chunked, without
    chunk extensions or trailers).

    :meth:`feed` consumes client bytes and returns the index just past the body's end (-1: more to come); what
    may go to Triton now is collected by :meth:`take`. ``ready`` turns True when the check passes (the head
    goes first); ``refusal`` is set if it fails, and from then on, as after :meth:`drop`, the rest of the body
    is read and dropped. A compressed body is inflated to its end (``inflation``: the check's, else the one
    given), so one that inflates too far is refused even after its JSON part passed. A chunked body carrying
    more than ``max_bytes`` (``--max-body-bytes``; 0: no limit; a Content-Length is judged with the head) is
    refused as it passes. Malformed chunked framing raises :class:`~tritonshare.proxy.http1.HttpError`.
    """

    __slots__ = ("left", "chunks", "max_bytes", "carried", "check", "inflation", "ready", "refusal", "dropping", "_out")

    def __init__(
        self,
        length: int,
        chunked: bool,
        check: InferBodyCheck | None = None,
        inflation: BodyInflation | None = None,
        *,
        max_bytes: int = 0,
    ) -> None:
        self.left = length
        self.chunks = ChunkedReader(400) if chunked else None
        self.max_bytes = max_bytes if chunked else 0
        self.carried = 0  # payload bytes of a chunked body so far (counted only under max_bytes)
        self.check = check
        self.inflation = check.inflation if check is not None else inflation
        self.ready = check is None
        self.refusal: BodyRefused | None = None
        self.dropping = False
        self._out: list[bytes | memoryview] = []

    def drop(self) -> RequestBody:
        """The proxy answered the request: read the rest of its body and forget it."""
        self.dropping = True
        self.check = self.inflation = None
        self._out = []
        return self

    def feed(self, data: bytes) -> int:
        if self.chunks is not None:
            payload: list[memoryview] = []
            end = self.chunks.feed(data, 0, payload)
            for piece in payload:
                if self.max_bytes:
                    self._carry(len(piece))
                self._payload(piece)
        else:
            end = min(self.left, len(data))
            self.left -= end
            self._payload(data if end == len(data) else memoryview(data)[:end])
            end = -1 if self.left else end
        if end >= 0:
            self._end()
        return end

    def take(self) -> list[bytes | memoryview]:
        out, self._out = self._out, []
        return out

    def _payload(self, part: bytes | memoryview) -> None:
        if not part or self.dropping:
            return
        if self.check is None:
            if self.inflation is not None:
                try:
                    self.inflation.feed(part)
                except BodyRefused as exc:
                    self._refuse(exc)
                    return
            self._emit(part)
            return
        try:
            held = self.check.feed(part)
        except BodyRefused as exc:
            self._refuse(exc)
            return
        if held is not None:
            self._pass(held)

    def _carry(self, size: int) -> None:
        self.carried += size
        if self.carried > self.max_bytes and not self.dropping:
            self._refuse(BodyRefused(413, body_too_large(self.max_bytes), "too_large"))

    def _end(self) -> None:
        if self.check is not None and not self.dropping:
            try:
                held = self.check.finish()
            except BodyRefused as exc:
                self._refuse(exc)
                return
            self._pass(held)
        elif self.inflation is not None and not self.inflation.eof and not self.dropping:
            # (the check passed on the JSON part earlier, or there was none): Triton must not have all of it
            self._refuse(_cut_short())
            return
        if self.chunks is not None and not self.dropping:
            self._out.append(LAST_CHUNK)

    def _pass(self, held: list[bytes | memoryview]) -> None:
        self.check = None
        self.ready = True
        for part in held:
            self._emit(part)

    def _refuse(self, exc: BodyRefused) -> None:
        self.refusal = exc
        self.drop()

    def _emit(self, part: bytes | memoryview) -> None:
        if self.chunks is None:
            self._out.append(part)
        else:
            self._out.extend(chunk(part))


def _cut_short() -> BodyRefused:
    return BodyRefused(400, "the body ends before the end of its compressed stream", "encoding")


def _short(json_length: int, body_length: int) -> BodyRefused:
    message = f"Inference-Header-Content-Length {json_length} is more than the body's {body_length} bytes"
    return BodyRefused(400, message, "bad_request")


def body_too_large(limit: int) -> str:
    return f"the request body is larger than the proxy's limit of {limit} bytes (--max-body-bytes)"


def _too_large(limit: int) -> str:
    return f"the request's JSON is larger than the proxy's limit of {limit} bytes (max_json_bytes)"
