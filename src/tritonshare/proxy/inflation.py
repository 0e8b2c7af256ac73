"""A compressed stream inflated as it passes, in bounded steps, and stopped once it inflates too far: the zip-bomb
guard of both front ends, for a REST body with a gzip/deflate ``Content-Encoding`` (:mod:`tritonshare.proxy.inspect`)
and a gRPC message with a gzip/deflate ``grpc-encoding`` (:mod:`tritonshare.proxy.grpc_messages`).

Triton (2.51) inflates a compressed REST body, and its gRPC server a compressed message, whole into memory before
it reads it, with no bound of its own (measured: 2 MB of gzip sent through the proxy took Triton's RSS up by 2 GB,
kept after the request; four such requests at once, to 8.5 GB: a few dozen would have the node kill every tenant's
server; 1 GiB of zeros in 1 MB of gzip, as one gRPC message, took it up 2.3 GB, 1.3 GB of it kept). A stream may
inflate to at most :data:`MAX_INFLATE_RATIO` times the compressed bytes read so far (the zip-bomb guard of Envoy's
decompressor, same default) once past :data:`INFLATE_GRACE_BYTES`, and never to 2 GiB, where Triton's int
overflows and it refuses the request, but only after inflating it.

:class:`Inflation` hands its output out in steps of at most :data:`STEP` bytes, each counted against the bound
before the caller sees it; what the caller does not keep is dropped, so a stream costs the proxy a step of memory.
Its outcomes are typed, and each front end answers them its own way: :class:`InflatesTooFar` (REST 413, gRPC
RESOURCE_EXHAUSTED) and :class:`CorruptStream` (REST 400, gRPC INVALID_ARGUMENT). Whether the stream ended
(``eof``) and what came after its end (``trailing``: Triton stops at the end, so such bytes could be read two
ways) are for the caller to judge, when its body or message ends.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

MAX_INFLATE_RATIO = 100
INFLATE_GRACE_BYTES = 1 << 20
MAX_INFLATED_BYTES = (2 << 30) - 1
# What a refusal says after "the compressed body" (REST) or "the compressed message" (gRPC).
INFLATES_TOO_FAR = (
    f"inflates to more than {MAX_INFLATE_RATIO} times its size (or to 2 GiB), which the shared inference server "
    "would hold whole in memory; send it uncompressed"
)
STEP = 1 << 20  # inflated bytes produced at a time: the proxy's memory per stream


class InflatesTooFar(Exception):
    """The stream inflated past its bound (:func:`inflates_too_far`); the step that went past is not handed out."""


class CorruptStream(Exception):
    """The input is not a stream of the kind inflated (zlib's reason is the message)."""


def inflates_too_far(inflated: int, compressed: int, ceiling: int = MAX_INFLATED_BYTES) -> bool:
    """Has a stream that took ``compressed`` bytes inflated past its bound (:data:`MAX_INFLATE_RATIO` after the
    grace, ``ceiling`` in any case)?"""
    return inflated > ceiling or (inflated > INFLATE_GRACE_BYTES and inflated > MAX_INFLATE_RATIO * compressed)


class Inflation:
    """One zlib stream (``wbits`` as :func:`zlib.decompressobj` takes them) inflated piece by piece as its input
    arrives: :meth:`steps` yields the output, in bounded steps, and raises :class:`InflatesTooFar` or
    :class:`CorruptStream`. ``compressed`` and ``inflated`` count the bytes read and produced so far; ``ceiling``
    is the absolute bound (:data:`MAX_INFLATED_BYTES`, smaller in tests)."""

    __slots__ = ("_inflate", "compressed", "inflated", "_after_end", "_ceiling")

    def __init__(self, wbits: int, *, ceiling: int = MAX_INFLATED_BYTES) -> None:
        self._inflate = zlib.decompressobj(wbits)
        self.compressed = 0
        self.inflated = 0
        self._after_end = 0  # input given once the stream had ended: counted, never read
        self._ceiling = ceiling

    @property
    def eof(self) -> bool:
        """Has the stream ended?"""
        return self._inflate.eof

    @property
    def trailing(self) -> int:
        """Bytes of input after the end of the stream."""
        return len(self._inflate.unused_data) + self._after_end

    def steps(self, data: bytes | memoryview, keep: int = 0) -> Iterator[bytes]:
        """Inflate all of ``data``, yielding what it inflates to in steps of at most :data:`STEP` bytes, none
        empty; none spans the ``keep``-th byte yielded by this call (a caller keeping that many takes whole
        steps). Input after the end of the stream is counted in ``trailing``, not inflated."""
        inflate = self._inflate
        if inflate.eof:
            self._after_end += len(data)
            return
        given = 0
        while True:
            step = min(keep - given, STEP) if given < keep else STEP
            try:
                out = inflate.decompress(data, step)
            except zlib.error as exc:
                raise CorruptStream(str(exc)) from None
            self.compressed += len(data) - len(inflate.unconsumed_tail)
            self.inflated += len(out)
            if inflates_too_far(self.inflated, self.compressed, self._ceiling):
                raise InflatesTooFar(f"{self.inflated} bytes inflated from {self.compressed}")
            if out:
                given += len(out)
                yield out
            data = inflate.unconsumed_tail
            if inflate.eof or (not data and len(out) < step):  # ended, or all input read and no output pending
                return
