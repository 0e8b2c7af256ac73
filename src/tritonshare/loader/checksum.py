"""Checksums a store states for an object, computed over the bytes as they are written.

A store may state more than one (S3: the MD5 in a single-part ETag, and a CRC when the object was uploaded
with a flexible checksum). Any one of them proves the bytes came through intact, so the download engine
verifies the cheapest one available (:func:`cheapest`). Measured here (one core, 1 MiB views of a buffer in
cache, as the download threads hash them): CRC32 ≈ 73 GB/s (ISA-L; zlib's ≈ 4 GB/s), CRC64NVME ≈ 50 GB/s
(awscrt, whose import costs ~70 ms once), CRC32C ≈ 11 GB/s (it copies from a view), SHA-1 ≈ 1.4 GB/s,
SHA-256 ≈ 1.3 GB/s, MD5 ≈ 0.6 GB/s.

CRC64NVME is what S3 records for every object uploaded since 2025 without a checksum of the client's
choosing, multipart uploads included, whose ETag is no MD5: without it such an object would be checked by
its size alone.

Values are encoded as the stores send them: hex for MD5, SHA-1 and SHA-256; base64 of the big-endian
value for the CRCs.
"""

from __future__ import annotations

import functools
import hashlib
from base64 import b64encode
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import ClassVar, Protocol

from tritonshare.common.errors import TransientSourceError, TritonshareError
from tritonshare.loader.sources.base import Checksum, RemoteObject

_READ_BYTES = 1 << 20
_CRC32C_SLICE_BYTES = 64 << 10


class Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> None: ...

    def value(self) -> str:
        """The checksum of everything so far, encoded as :class:`Checksum` values are."""
        ...


class _HexHasher:
    def __init__(self, name: str) -> None:
        self._hash = hashlib.new(name)
        self.update = self._hash.update

    def value(self) -> str:
        return self._hash.hexdigest()


class _Crc:
    """A CRC as the stores use them: reflected, every bit set before and after, computed by ``extend(data,
    crc)``, a C function. Stretches of an object hashed apart, in any order, are joined into the object's CRC
    (:func:`joined`) by arithmetic on their values (zlib's ``crc32_combine``: the first value times
    x^(8 × the second's length), modulo the polynomial, plus the second value), a few dozen microseconds a join."""

    WIDTH: ClassVar[int]  # bits
    POLY: ClassVar[int]  # the polynomial, reflected

    def __init__(self, extend: Callable[[bytes | memoryview, int], int]) -> None:
        self._extend = extend
        self._crc = 0

    def update(self, data: bytes | memoryview, /) -> None:
        self._crc = self._extend(data, self._crc)

    def value(self) -> str:
        return b64encode(self._crc.to_bytes(self.WIDTH // 8, "big")).decode()

    def join(self, other: _Crc, length: int) -> None:
        """Become the CRC of this one's bytes followed by ``other``'s ``length`` bytes."""
        self._crc = _times(_x_to_8n(length, self.WIDTH, self.POLY), self._crc, self.WIDTH, self.POLY) ^ other._crc


def _times(a: int, b: int, width: int, poly: int) -> int:
    """a × b modulo the polynomial (reflected: bit width-1 is x^0)."""
    top, product = 1 << (width - 1), 0
    while a:
        if a & top:
            product ^= b
        a = (a << 1) & ((top << 1) - 1)
        b = (b >> 1) ^ poly if b & 1 else b >> 1
    return product


@functools.lru_cache(maxsize=64)  # an object's parts have one length (but its last): worked out once
def _x_to_8n(n: int, width: int, poly: int) -> int:
    """x^(8n) modulo the polynomial: the product of x^(2^k) for the bits k of 8n."""
    powers = _powers_of_x(width, poly)
    result, k = 1 << (width - 1), 3  # x^0; 8n = n << 3
    while n:
        if n & 1:
            result = _times(powers[k], result, width, poly)
        n >>= 1
        k += 1
    return result


@functools.cache
def _powers_of_x(width: int, poly: int) -> tuple[int, ...]:
    """x^(2^k) modulo the polynomial for k = 0..66 (lengths up to 2^64 bytes), each the square of the one
    before."""
    powers = [1 << (width - 2)]  # x^1
    for _ in range(66):
        powers.append(_times(powers[-1], powers[-1], width, poly))
    return tuple(powers)


class _Crc32(_Crc):
    WIDTH, POLY = 32, 0xEDB88320

    def __init__(self) -> None:
        from isal import isal_zlib  # ISA-L's, with CLMUL (a runtime dependency, pyproject.toml); takes views

        super().__init__(isal_zlib.crc32)


class _Crc32c(_Crc):
    WIDTH, POLY = 32, 0x82F63B78

    def __init__(self) -> None:
        import google_crc32c  # C, with SSE4.2 (a runtime dependency, pyproject.toml)

        extend: Callable[[int, bytes], int] = google_crc32c.extend

        def extend_view(data: bytes | memoryview, crc: int) -> int:
            if isinstance(data, bytes):
                return extend(crc, data)
            # The C extension takes bytes only, not a view of a buffer (not even a read-only one): a copy, still
            # ~20x cheaper than MD5. In slices of 64 KiB: blocks freed by the 16 download threads that hash stay
            # in glibc's per-thread arenas (GCS 200 MiB peaked at 59 MiB RSS with 1 MiB slices, 43 MiB with 64 KiB).
            for start in range(0, len(data), _CRC32C_SLICE_BYTES):
                crc = extend(crc, bytes(data[start : start + _CRC32C_SLICE_BYTES]))
            return crc

        super().__init__(extend_view)


class _Crc64Nvme(_Crc):
    WIDTH, POLY = 64, 0x9A6C9329AC4BC9B5

    def __init__(self) -> None:
        from awscrt import checksums  # C, with CLMUL (a runtime dependency, pyproject.toml); takes views

        super().__init__(checksums.crc64nvme)


# algorithm → a new hasher; in order of cost, cheapest first (what cheapest() prefers; CRC64NVME's import
# outweighs its speed below ~1 GiB)
HASHERS: dict[str, Callable[[], Hasher]] = {
    "crc32": _Crc32,
    "crc32c": _Crc32c,
    "crc64nvme": _Crc64Nvme,
    "sha1": lambda: _HexHasher("sha1"),
    "sha256": lambda: _HexHasher("sha256"),
    "md5": lambda: _HexHasher("md5"),
}
_COST = {algorithm: rank for rank, algorithm in enumerate(HASHERS)}
_JOINABLE = frozenset(name for name, new in HASHERS.items() if isinstance(new, type) and issubclass(new, _Crc))


def hasher_for(algorithm: str) -> Hasher:
    factory = HASHERS.get(algorithm)
    if factory is None:
        raise TritonshareError(f"checksum algorithm {algorithm!r} is not one of {sorted(HASHERS)}")
    return factory()


def joinable(algorithm: str) -> bool:
    """Whether stretches of an object hashed apart can be joined into its checksum (:func:`joined`): the CRCs,
    not MD5 or SHA, whose state runs through the bytes in order."""
    return algorithm in _JOINABLE


def joined(pieces: Sequence[tuple[Hasher, int]]) -> Hasher:
    """The checksum of the pieces' bytes one after another, from each piece's hasher and its length in bytes:
    the first piece's hasher, now holding the whole. More than one piece: of a :func:`joinable` algorithm."""
    whole = pieces[0][0]
    for hasher, length in pieces[1:]:
        assert isinstance(whole, _Crc) and isinstance(hasher, type(whole)), "only pieces of one CRC are joined"
        whole.join(hasher, length)
    return whole


def cheapest(*checksums: Checksum | None) -> Checksum | None:
    """The stated checksum that is cheapest to compute; None when none is stated (or none we can compute)."""
    known = [c for c in checksums if c is not None and c.algorithm in _COST]
    return min(known, key=lambda c: _COST[c.algorithm], default=None)


def check(obj: RemoteObject, expected: Checksum, hasher: Hasher) -> None:
    """Compare; a mismatch is transient: the next attempt may get it right (a cut transfer, an object
    replaced mid-download)."""
    actual = hasher.value()
    if actual != expected.value:
        raise TransientSourceError(
            f"{obj.key}: {expected.algorithm} checksum mismatch "
            f"(store {expected.value}, downloaded {actual}) — the data was corrupted in transit"
        )


def check_size(obj: RemoteObject, size: int) -> None:
    if obj.size >= 0 and size != obj.size:
        raise TransientSourceError(f"{obj.key}: got {size} bytes, the store lists {obj.size}")


def file_digest(path: Path, algorithm: str) -> str:
    return _feed(path, hasher_for(algorithm)).value()


def checksum_of(path: Path, algorithm: str) -> Checksum:
    return Checksum(algorithm=algorithm, value=file_digest(path, algorithm))


def verify_file(obj: RemoteObject, path: Path, *, checksum: bool = True) -> None:
    """Size, then the listed checksum, of a file already written (for sources that write files themselves)."""
    check_size(obj, path.stat().st_size)
    if checksum and (expected := cheapest(obj.checksum)) is not None:
        check(obj, expected, _feed(path, hasher_for(expected.algorithm)))


def _feed(path: Path, hasher: Hasher) -> Hasher:
    buffer = memoryview(bytearray(_READ_BYTES))
    with open(path, "rb", buffering=0) as fh:
        while count := fh.readinto(buffer):
            hasher.update(buffer[:count])
    return hasher
