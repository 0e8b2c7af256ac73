"""Copy a byte stream into a file in bounded chunks: what every source's ``fetch`` does at its core.

Memory stays at one chunk per transfer whatever the object's size (seldon#6830, kserve#5162). The
caller passes a ``read_into`` that fills a buffer and translates its SDK's errors; errors writing the
destination (a full disk) are left as ``OSError`` for the download engine to classify.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from tritonshare.loader.sources.base import Progress

CHUNK_BYTES = 1 << 20  # large enough to keep per-chunk Python overhead small, small enough for 16 at once

ReadInto = Callable[[memoryview], int]  # fills the buffer, returns the count; 0 at the end of the stream


def copy_to_file(read_into: ReadInto, dest: Path, progress: Progress, *, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Stream everything ``read_into`` yields into ``dest`` (created or truncated). Returns the byte count."""
    buffer = memoryview(bytearray(chunk_bytes))
    total = 0
    with open(dest, "wb") as out:
        while count := read_into(buffer):
            out.write(buffer[:count])
            total += count
            progress(count)
    return total


def copy_to_range(read_into: ReadInto, dest: Path, offset: int, length: int, progress: Progress) -> int:
    """Stream at most ``length`` bytes from ``read_into`` into the existing file ``dest`` at ``offset``
    (one part of a ranged download; other parts are written by other threads). Returns the byte count."""
    buffer = memoryview(bytearray(min(CHUNK_BYTES, max(length, 1))))
    total = 0
    fd = os.open(dest, os.O_WRONLY)
    try:
        while total < length and (count := read_into(buffer[: min(len(buffer), length - total)])):
            written = 0
            while written < count:
                written += os.pwrite(fd, buffer[written:count], offset + total + written)
            total += count
            progress(count)
    finally:
        os.close(fd)
    return total


class CountingWriter:
    """A file-like object for SDKs that push bytes (``download_to_file``): writes through, reports progress."""

    def __init__(self, dest: Path, progress: Progress) -> None:
        self._file = open(dest, "wb")  # closed by close()/the context manager
        self._progress = progress

    def write(self, data: bytes) -> int:
        count = self._file.write(data)
        self._progress(count)
        return count

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> CountingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
