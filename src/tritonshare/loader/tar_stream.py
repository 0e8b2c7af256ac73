"""A tar archive read front to back, as :mod:`tarfile`'s stream mode wants it, and proven complete at its end.

The standard library's stream mode (``r|*``) stops at the first block that is not a member header — the
end-of-archive zero block, but just as quietly the end of the data — and never reads a gzip stream's trailer.
So an archive cut short at a member boundary (a truncated upload whose stated size and checksum were taken of
the cut bytes) would unpack as a model missing files. :class:`TarStream` is the file tarfile reads instead:
it inflates the archive itself (gzip, bzip2, xz or lzma, told by the first bytes, as ``r|*`` tells them; a
plain tar passes through), remembers the last bytes it handed out, and :meth:`TarStream.check_end` then
requires both ends a whole archive has:

- a zero block where tarfile found no further member (POSIX writes two; one is enough, as for GNU tar, which
  warns of "a lone zero block"). Stricter than GNU tar and bsdtar, which take a plain tar that stops between
  two members for whole: for a model, a missing file is worse than a refused upload;
- a compressed stream that reached its own end (gzip's CRC-32 and length, bzip2's and xz's checks, all
  verified by the decompressors), reading on past the tar's end if need be — and no further.

Memory stays flat: input is read and inflated a chunk at a time, whatever the compression ratio. A stream
of several gzip members (or bzip2 streams, as ``pbzip2`` writes) reads as one, as ``gzip -d`` reads it.
"""

from __future__ import annotations

import bz2
import lzma
import tarfile
import zlib
from collections import deque
from collections.abc import Callable
from typing import IO, BinaryIO, Protocol, cast

BLOCK_BYTES = tarfile.BLOCKSIZE  # 512
READ_BYTES = 64 << 10  # compressed input taken per read
# tarfile.open's documented ``bufsize``, what tarfile asks for per read: larger than its default (10 KiB) for
# fewer calls, not so large that the buffer tarfile copies on every header and data read grows costly
TARFILE_BUFSIZE = 32 << 10
_KEPT_BYTES = 4 * TARFILE_BUFSIZE  # tarfile holds less than one bufsize unparsed: the end block is in here


class IncompleteArchive(tarfile.ReadError):
    """The archive ends before its end: cut short in transfer or upload. Its message says where."""


class DamagedEnd(tarfile.ReadError):
    """Where the end-of-archive marker belongs stands a block that is neither a member nor the marker."""


class Decompressor(Protocol):
    """What :class:`bz2.BZ2Decompressor` and :class:`lzma.LZMADecompressor` offer (and :class:`_Gzip`)."""

    @property
    def eof(self) -> bool: ...
    @property
    def unused_data(self) -> bytes: ...
    @property
    def needs_input(self) -> bool: ...
    def decompress(self, data: bytes, max_length: int = -1) -> bytes: ...


class _Gzip:
    """One gzip member through :mod:`zlib`, with bz2's and lzma's interface: input it could not take yet is
    kept here rather than handed back, and ``needs_input`` says when to read more."""

    def __init__(self) -> None:
        self._zlib = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)  # gzip header and trailer, checked
        self._held = b""
        self._filled = False  # the last call filled max_length: zlib may hold more output for input it took

    @property
    def eof(self) -> bool:
        return self._zlib.eof

    @property
    def unused_data(self) -> bytes:
        return self._zlib.unused_data

    @property
    def needs_input(self) -> bool:
        return not self._held and not self._filled

    def decompress(self, data: bytes, max_length: int = -1) -> bytes:
        out = self._zlib.decompress(self._held + data, max_length if max_length > 0 else 0)
        self._held = self._zlib.unconsumed_tail
        self._filled = len(out) == max_length
        return out


def _lzma() -> Decompressor:
    return lzma.LZMADecompressor()  # FORMAT_AUTO: .xz and the older .lzma


# name, the leading bytes that tell it (as tarfile's r|* tells them), a fresh decompressor for one stream
COMPRESSIONS: list[tuple[str, tuple[bytes, ...], Callable[[], Decompressor]]] = [
    ("gzip", (b"\x1f\x8b\x08",), _Gzip),
    ("bzip2", tuple(b"BZh%d1AY&SY" % level for level in range(1, 10)), bz2.BZ2Decompressor),
    ("xz", (b"\xfd7zXZ\x00",), _lzma),
    ("lzma", (b"\x5d\x00\x00\x80",), _lzma),
]
_SNIFF_BYTES = max(len(magic) for _, magics, _ in COMPRESSIONS for magic in magics)
_ERRORS = (zlib.error, OSError, EOFError, lzma.LZMAError)  # bz2 reports damage as OSError


class TarStream:
    """The uncompressed bytes of the tar archive in ``raw``: :meth:`open_tar` reads its members, then
    :meth:`check_end` proves it whole."""

    def __init__(self, raw: BinaryIO) -> None:
        self._raw = raw
        self._input = _read_at_least(raw, _SNIFF_BYTES)
        self.compression, self._new = _compression(self._input)
        self._decompressor = self._new() if self._new is not None else None
        self._delivered = 0  # bytes of tar handed out
        self._kept: deque[tuple[int, bytes]] = deque()  # (offset, chunk): at least the last _KEPT_BYTES

    def open_tar(self, tarinfo: type[tarfile.TarInfo] = tarfile.TarInfo) -> tarfile.TarFile:
        """tarfile in stream mode over these bytes, its headers read as ``tarinfo`` (typeshed asks its
        ``fileobj`` for ``write`` and ``seek`` too; in ``r|`` mode tarfile only reads)."""
        return tarfile.open(fileobj=cast("IO[bytes]", self), mode="r|", bufsize=TARFILE_BUFSIZE, tarinfo=tarinfo)

    def read(self, size: int) -> bytes:
        data = self._inflate(size) if self._new is not None else self._pass(size)
        if data:
            self._keep(data)
        return data

    def check_end(self, tar: tarfile.TarFile) -> None:
        """Raise unless a zero block stands where ``tar`` found no further member, and the compressed stream,
        if any, ended whole. ``TarFile.offset`` (that position) is not in tarfile's documentation, but has
        been its reading position since the module began; typeshed declares it."""
        end = tar.offset
        block = self._kept_block(end)
        if len(block) < BLOCK_BYTES:
            raise IncompleteArchive(
                f"it ends after {end} bytes of tar, before the tar's end-of-archive marker: it was cut short"
            )
        if block.count(0) != BLOCK_BYTES:
            raise DamagedEnd(
                f"at byte {end} of the tar stands a block that is neither a member's header nor the end-of-archive "
                "marker"
            )
        self._drain()

    def _pass(self, size: int) -> bytes:
        if self._input:
            data, self._input = self._input[:size], self._input[size:]
            return data
        return self._raw.read(size)

    def _inflate(self, size: int) -> bytes:
        """Up to ``size`` bytes of tar, at least one unless the archive's data has ended."""
        while True:
            decompressor = self._stream()
            if decompressor is None:
                return b""
            data = b"" if not decompressor.needs_input else self._take_input()
            if out := self._decompress(decompressor, data, size):
                return out

    def _stream(self) -> Decompressor | None:
        """The decompressor to read on with: a fresh one once a stream ends and another follows (as in
        ``cat a.gz b.gz``); None once none follows — what does, if anything, is ignored, as ``gzip -d`` does."""
        decompressor, new = self._decompressor, self._new
        if decompressor is None or new is None or not decompressor.eof:
            return decompressor
        following = decompressor.unused_data
        if len(following) < _SNIFF_BYTES:
            following += _read_at_least(self._raw, _SNIFF_BYTES - len(following))
        self._input = following
        self._decompressor = new() if _compression(following)[1] is new else None
        return self._decompressor

    def _take_input(self) -> bytes:
        data, self._input = self._input or self._raw.read(READ_BYTES), b""
        if not data:
            raise IncompleteArchive(f"its {self.compression} stream stops before the stream's end: it was cut short")
        return data

    def _decompress(self, decompressor: Decompressor, data: bytes, size: int) -> bytes:
        try:
            return decompressor.decompress(data, size if size > 0 else READ_BYTES)
        except _ERRORS as exc:
            raise tarfile.ReadError(f"damaged {self.compression} data: {exc}") from exc

    def _drain(self) -> None:
        """Read the current compressed stream to its end (the tar's padding, the trailer), output discarded."""
        decompressor = self._decompressor
        while decompressor is not None and not decompressor.eof:
            data = b"" if not decompressor.needs_input else self._take_input()
            self._decompress(decompressor, data, READ_BYTES)

    def _keep(self, data: bytes) -> None:
        self._kept.append((self._delivered, data))
        self._delivered += len(data)
        while self._delivered - self._kept[0][0] - len(self._kept[0][1]) >= _KEPT_BYTES:
            self._kept.popleft()

    def _kept_block(self, start: int) -> bytes:
        """The delivered bytes from ``start`` on, at most one block; short when the tar ended sooner."""
        if self._kept and start < self._kept[0][0]:  # a tarfile reading further ahead than it does today
            raise RuntimeError(f"tar end {start} precedes the bytes kept to check it (from {self._kept[0][0]})")
        parts = [chunk[max(start - offset, 0) :] for offset, chunk in self._kept if offset + len(chunk) > start]
        return b"".join(parts)[:BLOCK_BYTES]


def _compression(head: bytes) -> tuple[str, Callable[[], Decompressor] | None]:
    for name, magics, new in COMPRESSIONS:
        if head.startswith(magics):
            return name, new
    return "tar", None


def _read_at_least(raw: BinaryIO, size: int) -> bytes:
    """``size`` bytes, fewer only at the end: a pipe hands out what has arrived."""
    data = raw.read(size)
    while data and len(data) < size and (more := raw.read(size - len(data))):
        data += more
    return data
