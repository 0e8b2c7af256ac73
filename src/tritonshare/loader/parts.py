"""One big object fetched as ranged parts by several threads, and verified as it lands.

An object's checksum (S3's MD5 ETag, GCS's CRC32C) covers the whole object in order, while its parts land
in parallel. So the checksum follows a *frontier*: the end of the bytes landed contiguously from offset 0.
After each chunk it writes, a worker that finds the frontier ahead of what is hashed hashes up to it —
unless another worker is already at it. It reads the bytes through a read-only memory map of an 8 MiB
window of the file, straight from the page cache (a ``pread`` copy cost ~0.8 s of CPU per GiB here); one
window at a time, because mapped pages count as the process's RSS: it stays flat whatever the object's size.
Parts are started in offset order, so the frontier moves along during the transfer, and when the last part
lands little is left to hash: the transfer costs about max(network, hashing) instead of their sum (MD5 runs
at ~0.65 GB/s on one core).

A part that fails resumes where its bytes stopped (a ranged GET from there), so hashed bytes are never
written again and the bytes already landed are not fetched twice.
"""

from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path

from tritonshare.loader.checksum import Hasher, check, hasher_for
from tritonshare.loader.sources.base import Checksum, RemoteObject
from tritonshare.loader.sources.stream import Part

HASH_STEP_BYTES = 8 << 20  # mapped and hashed at a time: bounds the mapped pages, releases the GIL often


class Split:
    """The parts of one object, how far each has landed, and the checksum frontier."""

    def __init__(self, obj: RemoteObject, target: Path, part_bytes: int, checksum: Checksum | None) -> None:
        self.obj = obj
        self.target = target
        self.part_bytes = part_bytes
        self.parts = [Part(offset, min(part_bytes, obj.size - offset)) for offset in range(0, obj.size, part_bytes)]
        self.expected = checksum
        self._hasher: Hasher | None = hasher_for(checksum.algorithm) if checksum else None
        self._landed = [0] * len(self.parts)  # bytes written contiguously from each part's start
        self._left = len(self.parts)
        self._hashed = 0  # bytes [0, _hashed) are in the hasher
        self._fd = -1  # the file, read-only, for hashing; opened on first use
        self._state = threading.Lock()
        self._hashing = threading.Lock()

    def remaining(self, index: int) -> Part | None:
        """What part ``index`` still needs: all of it, or the rest after a failed attempt; None when done."""
        part = self.parts[index]
        with self._state:
            done = self._landed[index]
        return None if done >= part.length else Part(part.offset + done, part.length - done)

    def landed(self, index: int, count: int) -> None:
        with self._state:
            self._landed[index] += count

    def complete(self, index: int) -> bool:
        """Mark part ``index`` complete; True for the caller that completed the last part."""
        with self._state:
            assert self._landed[index] == self.parts[index].length, "a part is complete when all its bytes landed"
            self._left -= 1
            return self._left == 0

    def catch_up(self, *, wait: bool = False) -> None:
        """Hash the landed bytes not hashed yet. Without ``wait``, returns at once when another thread is
        hashing (it will take these bytes too, or a later call will)."""
        if self._hasher is None or not self._hashing.acquire(blocking=wait):
            return
        try:
            while (end := self._frontier()) > self._hashed:
                self._hash_to(end)
        finally:
            self._hashing.release()

    def verify(self) -> None:
        """After the last part: hash what is left and compare (TransientSourceError on a mismatch)."""
        if self._hasher is None or self.expected is None:
            return
        try:
            self.catch_up(wait=True)
        finally:
            self.close()
        check(self.obj, self.expected, self._hasher)

    def close(self) -> None:
        with self._hashing:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def _hash_to(self, end: int) -> None:
        assert self._hasher is not None
        if self._fd < 0:
            self._fd = os.open(self.target, os.O_RDONLY)
        while self._hashed < end:
            start = self._hashed - self._hashed % mmap.ALLOCATIONGRANULARITY  # where a map may begin
            stop = min(end, self._hashed + HASH_STEP_BYTES)
            with mmap.mmap(self._fd, stop - start, offset=start, access=mmap.ACCESS_READ) as window:
                with memoryview(window) as view:
                    self._hasher.update(view[self._hashed - start :])
            self._hashed = stop

    def _frontier(self) -> int:
        with self._state:
            index = self._hashed // self.part_bytes
            while index < len(self.parts) and self._landed[index] == self.parts[index].length:
                index += 1
            if index == len(self.parts):
                return self.obj.size
            return self.parts[index].offset + self._landed[index]
