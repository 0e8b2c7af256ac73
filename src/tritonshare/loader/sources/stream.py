"""Copy a byte stream into a file in bounded chunks: what every source's ``fetch`` does at its core.

Memory stays at one chunk per transfer whatever the object's size (seldon#6830, kserve#5162). The
caller passes a ``read_into`` that fills a buffer and translates its SDK's errors; errors writing the
destination (a full disk) are left as ``OSError`` for the download engine to classify.
"""

from __future__ import annotations

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
