"""Byte streams from a source, and copying them into files in bounded chunks.

A network source opens an object (or a byte range of it) as a :class:`Body`; the download engine reads it
into one reused buffer per thread, writes it with ``pwrite`` and feeds the same bytes to the checksum in
the same pass — the file is never read back. Memory stays at one buffer per transfer whatever the object's
size (seldon#6830, kserve#5162). A ``Body`` translates its transport's errors into the error tree; errors
writing the destination (a full disk) stay ``OSError`` for the engine to classify.

A store that ignores Range (some S3-compatible servers, a web server, or a proxy in front of either that drops
the header) answers a part's GET with 200 and the whole object. :class:`RangeSupport` is how every network
source handles that: said once, as a warning, and every part from then on raises
:class:`~tritonshare.common.errors.RangeIgnored` without a request, so the engine fetches each big object
whole instead, one GET streamed to disk and verified as any whole object (against the listed size and checksum).
"""

from __future__ import annotations

import logging
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from tritonshare.common.errors import RangeIgnored
from tritonshare.loader.sources.base import Checksum, Progress, RemoteObject

if TYPE_CHECKING:
    from tritonshare.loader.sources.transport import Transport

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20  # large enough to keep per-chunk Python overhead small, small enough for 16 at once

ReadInto = Callable[[memoryview], int]  # fills the buffer, returns the count; 0 at the end of the stream


@dataclass(frozen=True)
class Part:
    """Bytes ``offset`` to ``offset + length - 1`` of an object."""

    offset: int
    length: int

    @property
    def header(self) -> str:
        return f"bytes={self.offset}-{self.offset + self.length - 1}"


class Body(Protocol):
    """An object's bytes (or a part's) as they arrive."""

    checksum: Checksum | None  # the whole object's checksum as this response states it, if it does

    def readinto(self, buffer: memoryview, /) -> int:
        """Fill ``buffer``; 0 at the end. Raises TransientSourceError/SourceError, never a bare OSError."""
        ...

    def abort(self) -> None:
        """From another thread: make a read blocked on this body return now (early, or with an error), so a
        stopped download does not wait for a stalled store's read timeout."""
        ...

    def close(self) -> None: ...


class RangeSupport:
    """Whether a store serves byte ranges, as far as its answers tell: it does until a part's GET comes back
    whole (HTTP 200). Thread-safe: the engine's threads ask for parts at once.

    ``store`` names the store in the warning (``s3://bucket``, the URL); ``hint`` says what to check."""

    def __init__(self, store: str, hint: str, *, noun: str = "store") -> None:
        self._store, self._hint, self._noun = store, hint, noun
        self._ignored = False
        self._lock = threading.Lock()

    @property
    def ignored(self) -> bool:
        """True once a part's GET got the whole object: no part is asked for any more."""
        return self._ignored

    def check(self, what: str) -> None:
        """Before a part's request: RangeIgnored, without a request, when the store is known to ignore Range."""
        if self._ignored:
            raise RangeIgnored(f"{what}: the {self._noun} ignores the Range header")

    def whole_answer(self, what: str) -> RangeIgnored:
        """A part's GET was answered with 200 and the whole object: remember it, warn the first time, and
        return the error for the caller to raise (the engine then fetches the object whole)."""
        with self._lock:
            first, self._ignored = not self._ignored, True
        if first:
            logger.warning(
                "%s: the %s ignores the Range header (a ranged GET got the whole object) — fetching big objects "
                "whole, one stream each, which is slower than in parallel parts; %s",
                self._store,
                self._noun,
                self._hint,
            )
        return RangeIgnored(f"{what}: the {self._noun} ignored the Range header (HTTP 200, the whole object)")


@runtime_checkable
class StreamSource(Protocol):
    """A source that hands out byte streams; the engine then does the writing and the verifying."""

    def open(self, obj: RemoteObject, stall_timeout_s: float, part: Part | None = None) -> Body:
        """The object's bytes, or only ``part`` of them (then the checksum is None). Raises as
        ``Source.fetch`` does; for a part, RangeIgnored when the store answers with the whole object (the engine
        then fetches it whole), TransientSourceError when it answers with other bytes."""
        ...

    def ranged(self, obj: RemoteObject) -> bool:
        """Whether ``open`` may be given a part of ``obj``."""
        ...

    def whole_checksum(self, obj: RemoteObject, stall_timeout_s: float) -> Checksum | None:
        """A checksum of the whole object that neither the listing nor a ranged answer carries, when the store
        keeps one (S3's flexible checksums: one more request); None otherwise, without a request."""
        ...

    def abort(self) -> None:
        """From another thread, when the download stops: every request in progress ends now (even one whose
        answer's headers trickle in, which no read timeout ends), and every later one fails at once."""
        ...


def fetch_stream(
    source: StreamSource, obj: RemoteObject, dest: Path, progress: Progress, stall_timeout_s: float
) -> None:
    """``Source.fetch`` for a stream source: the whole object into ``dest`` (the engine does better)."""
    body = source.open(obj, stall_timeout_s)
    try:
        copy_to_file(body.readinto, dest, progress)
    finally:
        body.close()


class TransportSource(ABC):
    """What the network sources (S3, GCS, HTTP) share: their requests go through one :class:`Transport`, which
    :meth:`abort` ends from another thread and :meth:`close` closes, and ``Source.fetch`` is
    :func:`fetch_stream` over their own :meth:`open`."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport

    @abstractmethod
    def open(self, obj: RemoteObject, stall_timeout_s: float, part: Part | None = None) -> Body: ...

    @abstractmethod
    def ranged(self, obj: RemoteObject) -> bool: ...

    @abstractmethod
    def whole_checksum(self, obj: RemoteObject, stall_timeout_s: float) -> Checksum | None: ...

    def fetch(self, obj: RemoteObject, dest: Path, progress: Progress, stall_timeout_s: float) -> None:
        fetch_stream(self, obj, dest, progress, stall_timeout_s)

    def abort(self) -> None:
        self._transport.abort()

    def close(self) -> None:
        self._transport.close()


def copy_to_file(read_into: ReadInto, dest: Path, progress: Progress, *, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Stream everything ``read_into`` yields into ``dest`` (created or truncated). Returns the byte count."""
    buffer = memoryview(bytearray(chunk_bytes))
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    total = 0
    try:
        while count := read_into(buffer):
            write_all(fd, buffer[:count], total)
            total += count
            progress(count)
    finally:
        os.close(fd)
    return total


def write_all(fd: int, data: memoryview, offset: int) -> None:
    """``pwrite`` until every byte is written (a short write is legal, if rare, on regular files)."""
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)
