"""The hashers of big objects (pure logic on local files: the parts are written, then reported landed)."""

from __future__ import annotations

import hashlib
import os
import threading
import time
import zlib
from base64 import b64encode
from pathlib import Path

import pytest

from tritonshare.common.errors import TransientSourceError
from tritonshare.loader.parts import HASHING_AT_ONCE, Split, hashing_slots
from tritonshare.loader.sources.base import Checksum, RemoteObject

PART = 1 << 20


class CountingSlots(threading.BoundedSemaphore):
    """The download's hashing slots, counting how many are held at once."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.held = self.peak = 0
        self.count_lock = threading.Lock()

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        acquired = super().acquire(blocking, timeout)
        with self.count_lock:
            self.held += acquired
            self.peak = max(self.peak, self.held)
        return acquired

    def __enter__(self, blocking: bool = True, timeout: float | None = None, /) -> bool:
        return self.acquire(blocking, timeout)  # threading.Semaphore binds __enter__ to its own acquire

    def release(self, n: int = 1) -> None:
        with self.count_lock:
            self.held -= n
        super().release(n)


def landed_split(folder: Path, name: str, slots: threading.Semaphore, *, md5: str | None = None) -> Split:
    """A 4-part object already on disk, its parts reported landed in reverse order."""
    data = os.urandom(4 * PART)
    (folder / name).write_bytes(data)
    checksum = Checksum(algorithm="md5", value=md5 or hashlib.md5(data).hexdigest())
    obj = RemoteObject(key=f"m/{name}", relpath=name, size=len(data), checksum=checksum)
    split = Split(obj, folder / name, PART, checksum, slots)
    split.begin()  # as the engine does when it starts fetching the first part
    for index in reversed(range(len(split.parts))):
        part = split.parts[index]
        split.landed(index, data[part.offset : part.offset + part.length])
        split.complete(index)
    return split


def test_many_big_objects_are_hashed_a_few_at_a_time(tmp_path: Path) -> None:
    slots = CountingSlots(HASHING_AT_ONCE)
    splits = [landed_split(tmp_path, f"w{i}.bin", slots) for i in range(3 * HASHING_AT_ONCE)]
    try:
        for split in splits:
            split.verify()  # raises on a mismatch
    finally:
        for split in splits:
            split.close()
    assert 1 <= slots.peak <= HASHING_AT_ONCE  # mapped windows stay bounded whatever the number of files


def test_a_wrong_checksum_is_reported_once_the_hasher_has_read_everything(tmp_path: Path) -> None:
    split = landed_split(tmp_path, "w.bin", hashing_slots(), md5="0" * 32)
    try:
        with pytest.raises(TransientSourceError, match=r"m/w.bin: md5 checksum mismatch \(store 0{32}, downloaded "):
            split.verify()
    finally:
        split.close()


def test_a_hasher_waiting_for_bytes_that_never_come_stops_when_closed(tmp_path: Path) -> None:
    (tmp_path / "w.bin").write_bytes(bytes(4 * PART))
    obj = RemoteObject(key="m/w.bin", relpath="w.bin", size=4 * PART, checksum=Checksum(algorithm="md5", value="0"))
    split = Split(obj, tmp_path / "w.bin", PART, obj.checksum, hashing_slots())
    split.begin()
    split.landed(0, bytes(PART // 2))  # half of the first part, then the download is cancelled
    split.close()
    assert not [thread for thread in threading.enumerate() if thread.name == "tritonshare-hash"]


def crc32_of(data: bytes) -> Checksum:
    return Checksum(algorithm="crc32", value=b64encode(zlib.crc32(data).to_bytes(4, "big")).decode())


def land(split: Split, data: bytes, index: int, start: int, stop: int) -> None:
    """Bytes [start, stop) of part ``index`` land, in two pieces, as a download thread reports them."""
    offset = split.parts[index].offset
    middle = (start + stop) // 2
    split.landed(index, memoryview(data)[offset + start : offset + middle])
    split.landed(index, memoryview(data)[offset + middle : offset + stop])


def no_hasher_thread(timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while any(thread.name == "tritonshare-hash" for thread in threading.enumerate()):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_crc_known_before_any_byte_lands_is_worked_out_from_the_landed_bytes_not_read_back(tmp_path: Path) -> None:
    data = os.urandom(4 * PART)
    (tmp_path / "w.bin").write_bytes(bytes(len(data)))  # the file holds zeros: only what landed() got holds the data
    obj = RemoteObject(key="m/w.bin", relpath="w.bin", size=len(data), checksum=crc32_of(data))
    split = Split(obj, tmp_path / "w.bin", PART, obj.checksum, hashing_slots())
    split.begin()
    try:
        for index in (2, 0, 3, 1):  # parts land in any order
            land(split, data, index, 0, PART)
            split.complete(index)
        split.verify()  # the CRCs of the landed pieces, joined: the object's
    finally:
        split.close()


def test_bytes_landed_while_the_crc_was_asked_for_are_read_back_the_rest_hashed_as_they_land(tmp_path: Path) -> None:
    data = os.urandom(4 * PART)
    (tmp_path / "w.bin").write_bytes(data)
    obj = RemoteObject(key="m/w.bin", relpath="w.bin", size=len(data), checksum=None)
    answered = threading.Event()

    def ask() -> Checksum:
        answered.wait(10)  # the store's answer comes once the first halves have landed
        return crc32_of(data)

    split = Split(obj, tmp_path / "w.bin", PART, None, hashing_slots(), ask=ask)
    split.begin()
    try:
        for index in range(4):
            land(split, data, index, 0, PART // 2)
        answered.set()
        assert no_hasher_thread()  # it has read back the first halves and is done
        with open(tmp_path / "w.bin", "r+b") as file:  # from now on the file is not read: its second halves
            for index in range(4):  # may hold anything
                file.seek(index * PART + PART // 2)
                file.write(bytes(PART // 2))
        for index in range(4):
            land(split, data, index, PART // 2, PART)
            split.complete(index)
        split.verify()
    finally:
        split.close()


def test_bytes_read_back_are_checked_as_they_are_in_the_file(tmp_path: Path) -> None:
    data = os.urandom(4 * PART)
    on_disk = bytearray(data)
    on_disk[PART + 100] ^= 1  # part 1 landed its first half before the CRC was known; one bit of it is wrong
    (tmp_path / "w.bin").write_bytes(on_disk)
    obj = RemoteObject(key="m/w.bin", relpath="w.bin", size=len(data), checksum=None)
    answered = threading.Event()

    def ask() -> Checksum:
        answered.wait(10)
        return crc32_of(data)

    split = Split(obj, tmp_path / "w.bin", PART, None, hashing_slots(), ask=ask)
    split.begin()
    try:
        land(split, data, 1, 0, PART // 2)
        answered.set()
        assert no_hasher_thread()
        for index in range(4):
            land(split, data, index, PART // 2 if index == 1 else 0, PART)
            split.complete(index)
        with pytest.raises(TransientSourceError, match=r"m/w.bin: crc32 checksum mismatch"):
            split.verify()
    finally:
        split.close()
