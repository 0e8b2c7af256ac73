"""Checksums as the stores state them: each algorithm's standard check value in the store's encoding, the same
value however the bytes are fed, the cheapest stated one chosen, and a mismatch or a short file refused as
transient (the next attempt may get it right). Pure logic: no servers."""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import itertools
import random
import zlib
from base64 import b64encode
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tritonshare.common.errors import TransientSourceError, TritonshareError
from tritonshare.loader.checksum import (
    HASHERS,
    cheapest,
    check,
    check_size,
    checksum_of,
    file_digest,
    hasher_for,
    joinable,
    joined,
    verify_file,
)
from tritonshare.loader.sources.base import Checksum, RemoteObject

CHECK_INPUT = b"123456789"  # the input every CRC catalogue gives its check value for


def crc(value: int, width: int) -> str:
    return b64encode(value.to_bytes(width, "big")).decode()


CHECK_VALUES = {
    "crc64nvme": crc(0xAE8B14860A799888, 8),
    "crc32c": crc(0xE3069283, 4),
    "crc32": crc(0xCBF43926, 4),
    "sha1": "f7c3bc1d808e04732adf679965ccc34ca7ae3441",
    "sha256": "15e2b0d3c33891ebb0f1ef609ec419420c20e320ce94c65fbc8c3312448eb225",
    "md5": "25f9e794323b453885f5181f1b624d0b",
}


def obj(size: int = 9, checksum: Checksum | None = None) -> RemoteObject:
    return RemoteObject(key="bucket/m/1/model.onnx", relpath="1/model.onnx", size=size, checksum=checksum)


def test_every_algorithm_has_a_check_value_here() -> None:
    assert set(HASHERS) == set(CHECK_VALUES)


@pytest.mark.parametrize("algorithm", sorted(CHECK_VALUES))
def test_each_algorithm_gives_the_standard_check_value_in_the_stores_encoding(algorithm: str) -> None:
    hasher = hasher_for(algorithm)
    hasher.update(CHECK_INPUT)
    assert hasher.value() == CHECK_VALUES[algorithm]


@pytest.mark.parametrize("algorithm", sorted(CHECK_VALUES))
def test_the_value_does_not_depend_on_how_the_bytes_are_fed(algorithm: str) -> None:
    data = random.Random(7).randbytes((5 << 20) // 2 + 3)  # 2.5 MiB and 3: views cross the 1 MiB slices
    whole = hasher_for(algorithm)
    whole.update(data)
    pieces = hasher_for(algorithm)
    view = memoryview(bytearray(data))
    for start, end in ((0, 1), (1, 1000), (1000, (3 << 20) // 2), ((3 << 20) // 2, len(data))):
        pieces.update(view[start:end] if start % 2 == 0 else bytes(view[start:end]))
    assert pieces.value() == whole.value()
    empty = hasher_for(algorithm)
    empty.update(memoryview(b""))
    assert empty.value() == hasher_for(algorithm).value()


@pytest.mark.parametrize("algorithm", sorted(CHECK_VALUES))
def test_only_the_crcs_are_joinable(algorithm: str) -> None:
    assert joinable(algorithm) == algorithm.startswith("crc")


@pytest.mark.parametrize("algorithm", ["crc32", "crc32c", "crc64nvme"])
@given(data=st.binary(max_size=3000), cuts=st.lists(st.integers(0, 3000), max_size=4))
@settings(max_examples=60, deadline=None)
def test_stretches_hashed_apart_join_into_the_whole_objects_crc(algorithm: str, data: bytes, cuts: list[int]) -> None:
    bounds = [0, *sorted(min(cut, len(data)) for cut in cuts), len(data)]  # empty stretches included
    pieces = []
    for start, stop in itertools.pairwise(bounds):
        hasher = hasher_for(algorithm)
        hasher.update(data[start:stop])
        pieces.append((hasher, stop - start))
    whole = hasher_for(algorithm)
    whole.update(data)
    assert joined(pieces).value() == whole.value()


def test_stretches_of_gigabytes_join_as_the_standard_crc32_combine_does() -> None:
    """Lengths past 32 bits, where the powers of x run long: against zlib's own crc32_combine, on the values of
    two stretches whose bytes are not needed (a CRC's join depends only on the values and the length)."""
    first, second = zlib.crc32(b"first stretch"), zlib.crc32(b"second stretch")
    for length in (1, 8 << 20, (5 << 30) + 7, (1 << 40) + 12345):
        left, right = hasher_for("crc32"), hasher_for("crc32")
        left._crc, right._crc = first, second  # type: ignore[attr-defined]
        assert joined([(left, 13), (right, length)]).value() == crc(zlib_combine(first, second, length), 4)


def zlib_combine(crc1: int, crc2: int, length: int) -> int:
    """zlib's crc32_combine, through ctypes: the standard the join is held to."""
    libz = ctypes.CDLL(ctypes.util.find_library("z"))
    libz.crc32_combine64.restype = ctypes.c_ulong
    libz.crc32_combine64.argtypes = [ctypes.c_ulong, ctypes.c_ulong, ctypes.c_int64]
    return int(libz.crc32_combine64(crc1, crc2, length)) & 0xFFFFFFFF


def test_a_file_is_read_whole_past_one_buffer(tmp_path: Path) -> None:
    data = random.Random(3).randbytes((1 << 20) + 17)
    path = tmp_path / "weights.bin"
    path.write_bytes(data)
    assert file_digest(path, "md5") == hashlib.md5(data).hexdigest()
    assert checksum_of(path, "crc32") == Checksum(algorithm="crc32", value=crc(zlib.crc32(data), 4))


def test_an_unknown_algorithm_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(TritonshareError, match=r"'sha512' is not one of \['crc32', 'crc32c', 'crc64nvme'"):
        hasher_for("sha512")


def test_the_cheapest_stated_checksum_is_chosen() -> None:
    md5 = Checksum(algorithm="md5", value="x")
    sha256 = Checksum(algorithm="sha256", value="x")
    crc32c = Checksum(algorithm="crc32c", value="x")
    crc64 = Checksum(algorithm="crc64nvme", value="x")
    crc32 = Checksum(algorithm="crc32", value="x")
    assert cheapest(md5, crc64) is crc64  # S3: an MD5 ETag and the CRC64NVME it records since 2025
    assert cheapest(crc32c, crc64) is crc32c  # CRC64NVME's library costs ~70 ms to import, more than it saves
    assert cheapest(crc64, crc32, crc32c) is crc32
    assert cheapest(sha256, None, crc32c, md5) is crc32c
    assert cheapest(md5, Checksum(algorithm="sha512", value="x")) is md5  # one we cannot compute is passed over
    assert cheapest(Checksum(algorithm="sha512", value="x"), None) is None
    assert cheapest() is None


def test_a_mismatch_is_transient_and_names_both_values() -> None:
    hasher = hasher_for("md5")
    hasher.update(CHECK_INPUT)
    check(obj(), Checksum(algorithm="md5", value=CHECK_VALUES["md5"]), hasher)  # a match: nothing
    with pytest.raises(TransientSourceError) as info:
        check(obj(), Checksum(algorithm="md5", value="0" * 32), hasher)
    message = str(info.value)
    assert "bucket/m/1/model.onnx: md5 checksum mismatch" in message
    assert "0" * 32 in message and CHECK_VALUES["md5"] in message


def test_a_size_other_than_listed_is_transient_and_an_unlisted_size_is_not_checked() -> None:
    check_size(obj(size=9), 9)
    check_size(obj(size=-1), 12345)  # HTTP without Content-Length
    with pytest.raises(TransientSourceError, match=r"got 8 bytes, the store lists 9"):
        check_size(obj(size=9), 8)
    with pytest.raises(TransientSourceError):
        check_size(obj(size=0), 1)


def test_verify_file_checks_the_size_then_the_cheapest_checksum(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(CHECK_INPUT)
    good = Checksum(algorithm="crc32c", value=CHECK_VALUES["crc32c"])
    bad = Checksum(algorithm="crc32c", value=crc(0, 4))
    verify_file(obj(checksum=good), path)
    verify_file(obj(), path)  # none stated: the size alone
    verify_file(obj(checksum=bad), path, checksum=False)  # the caller verified the bytes as they came
    with pytest.raises(TransientSourceError, match="crc32c checksum mismatch"):
        verify_file(obj(checksum=bad), path)
    with pytest.raises(TransientSourceError, match="got 9 bytes, the store lists 10"):
        verify_file(obj(size=10, checksum=good), path)
