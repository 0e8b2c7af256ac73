"""One big object fetched as ranged parts by several threads, and verified as it lands.

An object's checksum (S3's MD5 ETag, GCS's CRC32C) covers the whole object, while its parts land in parallel.

A CRC (CRC32, CRC32C, CRC64NVME) is worked out in pieces and the pieces' CRCs joined at the end
(:func:`~tritonshare.loader.checksum.joined`): each download thread hashes the bytes it has just written,
from its own read buffer, still in the CPU's cache, as part of landing them (:meth:`Split.landed`). Only what
landed before the checksum was known (while its HEAD was asked) is read back from the file, by the hasher
thread. Nothing is left to hash when the last part lands: measured on one 200 MiB object carrying a CRC32
(`rclone serve s3`, the download in a fresh process, medians of 11 runs, 27 Nov), 0.55 s read back by the
hasher as MD5 still is (below), 0.52 s hashed as it lands (the same CPU: the tail is gone), 0.45 s with ISA-L's
CRC32 instead of zlib's; 0.43 s not verified at all.

MD5 and SHA run through the bytes in order: one hasher thread per object follows a *frontier*, the end of the
bytes landed contiguously from offset 0; the download threads only record what they wrote and wake it when the
frontier moves, so none of them stops receiving to hash. Parts are started in offset order, so the frontier
moves along during the transfer, though the first 16 land together. The hasher reads the bytes through a
read-only memory map of an 8 MiB window of the file, straight from the page cache (``pread`` into a buffer
cost 5 % more CPU here); one window at a time, because mapped pages count as the process's RSS, and the
hashers of one download map at most ``HASHING_AT_ONCE`` windows between them: memory stays flat whatever the
size and number of big files. ``hashlib`` releases the GIL while it hashes a window, so on a second core the
hashing overlaps with receiving (MD5 runs at ~0.5-0.75 GB/s on one core, and cannot be split).

When the store keeps a checksum that the listing does not carry (S3's flexible checksums), the hasher thread
first asks for it (``whole_checksum``: a HEAD, while the first parts land) and verifies the cheapest
checksum stated; if asking fails, the listed one is used.

The object's file is allocated at its full size before any part is fetched (:func:`reserve`), for the parts to
fill in place in any order.

A part that fails resumes where its bytes stopped (a ranged GET from there), so hashed bytes are never
written again and the bytes already landed are not fetched twice.

A store that ignores Range (a part's GET answered with the whole object) cannot serve parts at all: the split is
given up (:meth:`Split.give_up`), the parts not yet fetched are skipped, and once the parts in flight have ended
the object is fetched whole, as one that was never split — never while a part may still write into the file.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tritonshare.common.errors import TritonshareError
from tritonshare.loader.checksum import Hasher, cheapest, check, hasher_for, joinable, joined
from tritonshare.loader.sources.base import Checksum, RemoteObject
from tritonshare.loader.sources.stream import Part

logger = logging.getLogger(__name__)

HASH_STEP_BYTES = 8 << 20  # mapped and hashed at a time: bounds the mapped pages, and how long a stop waits
HASHING_AT_ONCE = 4  # objects hashed at the same moment, per download: at most 4 windows (32 MiB) mapped


def hashing_slots() -> threading.Semaphore:
    """What the splits of one download share, so that their hashers together map at most
    ``HASHING_AT_ONCE`` windows: a model of many big files would otherwise map one window per file."""
    return threading.BoundedSemaphore(HASHING_AT_ONCE)


class Split:
    """The parts of one object, how far each has landed, and how its checksum is worked out as they land.

    Its hasher thread starts with the first part fetched (:meth:`begin`), so a model of hundreds of big files
    runs hashers only for the objects being fetched, not one per file; :meth:`close` stops and joins it, and
    must be called however the download ends.
    """

    def __init__(
        self,
        obj: RemoteObject,
        target: Path,
        part_bytes: int,
        checksum: Checksum | None,
        slots: threading.Semaphore,
        ask: Callable[[], Checksum | None] | None = None,
    ) -> None:
        self.obj = obj
        self.target = target
        self.part_bytes = part_bytes
        self.parts = [Part(offset, min(part_bytes, obj.size - offset)) for offset in range(0, obj.size, part_bytes)]
        self.expected = checksum  # the cheapest stated: settled by the hasher thread once it has asked
        self._ask = ask
        self._landed = [0] * len(self.parts)  # bytes written contiguously from each part's start
        self._left = len(self.parts)
        self._next = 0  # the first part not landed whole
        self._frontier = 0  # bytes [0, _frontier) have landed
        # Once the checksum is known: the stretches of the object hashed apart, in order, joined by verify(); and
        # for a CRC, each part's stretch its download thread hashes as it lands (guarded by _state).
        self._pieces: list[_Piece] = []
        self._landing: list[_Piece] = []
        self._stopped = False
        self._failure: BaseException | None = None  # what stopped the hasher thread, for verify() to raise
        self._slots = slots  # held while a window is mapped
        self._state = threading.Condition()
        self._thread = threading.Thread(target=self._follow, name="tritonshare-hash", daemon=True)
        self._verifying = checksum is not None or ask is not None
        self._begun = False  # the hasher thread was started (guarded by _state)
        self._given_up = False  # the store cannot serve parts: the object is to come whole
        if checksum is not None and ask is None and joinable(checksum.algorithm):
            self._hand_over(checksum.algorithm)  # a CRC known before any byte lands: all of it hashed as it lands

    def begin(self) -> None:
        """Start the hasher thread, once, when a first part is about to be fetched."""
        with self._state:  # started under the lock: a close() cannot slip between the decision and the start
            if self._begun or self._stopped or not self._verifying:
                return
            self._begun = True
            self._thread.start()

    def remaining(self, index: int) -> Part | None:
        """What part ``index`` still needs: all of it, or the rest after a failed attempt; None when done, or
        when the split was given up."""
        part = self.parts[index]
        with self._state:
            done = part.length if self._given_up else self._landed[index]
        return None if done >= part.length else Part(part.offset + done, part.length - done)

    def give_up(self) -> None:
        """No more parts: the store cannot serve them. The object is to be fetched whole (:attr:`given_up`) by
        whoever completes the last part, the parts in flight having ended."""
        with self._state:
            self._given_up = True

    @property
    def given_up(self) -> bool:
        with self._state:
            return self._given_up

    def landed_bytes(self) -> int:
        """The bytes the parts have written, in all."""
        with self._state:
            return sum(self._landed)

    def landed(self, index: int, data: memoryview | bytes) -> None:
        """``data``, the next bytes of part ``index``, was written right after those landed before. For a CRC
        known by now it is hashed here, by the download thread, from its buffer."""
        with self._state:
            self._landed[index] += len(data)
            piece = self._landing[index] if self._landing else None
            if index == self._next:
                self._advance()
                self._state.notify()
        if piece is not None:  # the thread landing part ``index`` is the only one feeding its piece
            piece.hasher.update(data)
            piece.hashed += len(data)

    def complete(self, index: int) -> bool:
        """Mark part ``index`` complete (all its bytes landed, or the split given up); True for the caller that
        completed the last part."""
        with self._state:
            landed = self._landed[index] == self.parts[index].length
            assert landed or self._given_up, "a part is complete when all its bytes landed"
            self._left -= 1
            return self._left == 0

    def verify(self) -> None:
        """After the last part: wait for the hasher to finish and compare (TransientSourceError on a
        mismatch). Raises TritonshareError when the hasher was stopped (the download is being cancelled)."""
        if not self._verifying:
            return
        self.begin()  # (already begun when the engine fetched the parts)
        with self._state:
            begun = self._begun
        if not begun:  # closed first: the download is being cancelled
            raise TritonshareError(f"{self.obj.key}: download cancelled before its hashing began")
        self._thread.join()
        if self._failure is not None:
            raise self._failure
        if self.expected is None:
            return  # asked, and the store states no checksum either
        hashed = sum(piece.hashed - piece.start for piece in self._pieces)
        if hashed < self.obj.size:
            raise TritonshareError(f"{self.obj.key}: {hashed} of {self.obj.size} bytes hashed: download cancelled")
        check(self.obj, self.expected, joined([(piece.hasher, piece.stop - piece.start) for piece in self._pieces]))

    def close(self) -> None:
        """Stop the hasher (within one window) and wait for it; nothing reads the file afterwards."""
        with self._state:
            self._stopped = True
            self._state.notify()
        with self._state:
            begun = self._begun
        if begun:
            self._thread.join()

    def _advance(self) -> None:
        """Move the frontier past the parts landed whole (called with ``_state`` held)."""
        while self._next < len(self.parts) and self._landed[self._next] == self.parts[self._next].length:
            self._next += 1
        if self._next == len(self.parts):
            self._frontier = self.obj.size
        else:
            self._frontier = self.parts[self._next].offset + self._landed[self._next]

    def _follow(self) -> None:
        """The hasher thread: hash the bytes as they land, until the end of the object or a stop."""
        fd = -1
        try:
            if self._ask is not None:
                self.expected = self._asked()
            if self.expected is None:
                return
            if joinable(self.expected.algorithm):
                landed_before = self._hand_over(self.expected.algorithm)  # nothing, when handed over at the start
                if landed_before:
                    fd = os.open(self.target, os.O_RDONLY)
                for piece in landed_before:
                    self._hash_to(fd, piece, piece.stop)
                return
            fd = os.open(self.target, os.O_RDONLY)
            whole = _Piece(0, self.obj.size, hasher_for(self.expected.algorithm))
            self._pieces = [whole]
            while (end := self._wait_for_frontier(whole)) > whole.hashed:
                self._hash_to(fd, whole, end)
        except BaseException as exc:  # noqa: BLE001 - handed to the thread that verifies
            self._failure = exc
        finally:
            if fd >= 0:
                os.close(fd)

    def _asked(self) -> Checksum | None:
        """The cheapest of the listed checksum and the one the store states when asked."""
        assert self._ask is not None
        try:
            return cheapest(self._ask(), self.expected)
        except TritonshareError as exc:
            logger.warning("%s — verifying %s by its listed checksum", exc, self.obj.key)
            return self.expected

    def _hand_over(self, algorithm: str) -> list[_Piece]:
        """From now on each part's download thread hashes the bytes it lands; what landed before is returned,
        for the hasher thread to read back and hash (a CRC, known now). Once only."""
        with self._state:
            landed_before: list[_Piece] = []
            if self._landing:
                return landed_before
            for part, landed in zip(self.parts, self._landed, strict=True):
                middle, stop = part.offset + landed, part.offset + part.length
                if landed:
                    landed_before.append(_Piece(part.offset, middle, hasher_for(algorithm)))
                self._landing.append(_Piece(middle, stop, hasher_for(algorithm)))
            self._pieces = sorted(landed_before + self._landing, key=lambda piece: piece.start)
            return landed_before

    def _wait_for_frontier(self, whole: _Piece) -> int:
        """The frontier once it is past what is hashed; what is hashed when all is, or when stopped."""
        with self._state:
            while not self._stopped and self._frontier == whole.hashed < self.obj.size:
                self._state.wait()
            return whole.hashed if self._stopped else self._frontier

    def _hash_to(self, fd: int, piece: _Piece, end: int) -> None:
        while piece.hashed < end and not self._stopped:
            start = piece.hashed - piece.hashed % mmap.ALLOCATIONGRANULARITY  # where a map may begin
            stop = min(end, piece.hashed + HASH_STEP_BYTES)
            with self._slots, mmap.mmap(fd, stop - start, offset=start, access=mmap.ACCESS_READ) as window:
                with memoryview(window) as view:
                    piece.hasher.update(view[piece.hashed - start :])
            piece.hashed = stop


@dataclass
class _Piece:
    """A stretch of the object hashed on its own, by one thread at a time: the whole object (MD5, SHA), or a
    stretch of one part (a CRC, joined with the others' at the end)."""

    start: int
    stop: int
    hasher: Hasher
    hashed: int = field(init=False)  # bytes [start, hashed) are in the hasher

    def __post_init__(self) -> None:
        self.hashed = self.start


def reserve(target: Path, size: int) -> None:
    """Create ``target`` with ``size`` bytes allocated on disk, for parts to fill in place in any order.

    Allocated up front (``fallocate``), not sparse: 16 threads writing 2 GiB out of order into a sparse file
    cost ext4 ~40 % more system time than into an allocated one (0.50 vs 0.35 s here), and now and then
    stalled for seconds. A full disk is also found before any byte is fetched. A filesystem that cannot
    allocate ahead gets a sparse file, as before.
    """
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        if not _allocate(fd, size):
            os.ftruncate(fd, size)
    finally:
        os.close(fd)


def _allocate(fd: int, size: int) -> bool:
    """``fallocate(2)``; False where the filesystem does not support it. Not ``os.posix_fallocate``: glibc
    emulates that by writing a byte into every block, slow on the filesystems that need it."""
    import ctypes  # ~5 ms of start-up, paid only for objects fetched in parts

    libc = ctypes.CDLL(None, use_errno=True)
    fallocate = libc.fallocate64
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if fallocate(fd, 0, 0, size) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EOPNOTSUPP, errno.ENOSYS):
        return False
    raise OSError(code, os.strerror(code))
